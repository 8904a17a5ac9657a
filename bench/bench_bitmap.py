"""Benchmark the health bitmaps and the tracker at node scale, extension vs twin in the same run.

Bitmaps of 65,536 devices (8 KiB): ``diff_bitmaps`` with a few changed bits (the usual event) and with
one PF's 256 VFs changed, ``select_bits`` and ``or_bitmaps`` of four fact bitmaps (one pool evaluation).
Then the ``HealthTracker`` on 64 PFs x 256 VFs (16,384 devices, 16 pools of 1,024): one PF link down,
``set_links`` + ``collect`` (the work between the netlink event and the wire), once per implementation
(each in a child process, since ``accel`` picks one per process).  Target: diff ≤ 20 µs.

    PYTHONPATH=src python bench/bench_bitmap.py [--quick] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

SRC = Path(__file__).resolve().parents[1] / "src"
sys.path.insert(0, str(SRC))

import _impl  # noqa: E402  (bench/ is on sys.path: the script's own dir)

BITS = 65536


def per_call(fn: Callable[[], object], calls: int, rounds: int) -> float:
    """Return the median over ``rounds`` of the mean seconds per call (the machine is shared and noisy)."""
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


def bitmap(indexes: range | list[int], nbits: int) -> bytes:
    """A bitmap with the given bits set."""
    out = bytearray(nbits // 8)
    for i in indexes:
        out[i >> 3] |= 1 << (i & 7)
    return bytes(out)


def bench_bitmaps(mod: ModuleType, calls: int, rounds: int) -> dict[str, float]:
    """Time the bitmap functions of one implementation."""
    full = b"\xff" * (BITS // 8)
    old = bitmap(range(0, BITS, 97), BITS)  # some devices already unhealthy
    few = bytes(a ^ b for a, b in zip(old, bitmap([5, 1000, 40000, 65000], BITS), strict=True))
    pf = bytes(a ^ b for a, b in zip(old, bitmap(range(4096, 4352), BITS), strict=True))
    assert len(mod.diff_bitmaps(old, few, full)) == 4 and len(mod.diff_bitmaps(old, pf, full)) == 256
    facts = [old, few, pf, full[:0] + bytes(BITS // 8)]
    return {
        "diff_few_s": per_call(lambda: mod.diff_bitmaps(old, few, full), calls, rounds),
        "diff_pf256_s": per_call(lambda: mod.diff_bitmaps(old, pf, full), calls, rounds),
        "diff_none_s": per_call(lambda: mod.diff_bitmaps(old, old, full), calls, rounds),
        "select_s": per_call(lambda: mod.select_bits(old, full), calls, rounds),
        "or4_s": per_call(lambda: mod.or_bitmaps(facts, full), calls, rounds),
    }


def bench_tracker(rounds: int) -> dict[str, object]:
    """Time one PF flip through the tracker at 16,384 devices (the accel this process picked)."""
    from densedev import accel
    from densedev.health.tracker import HealthTracker
    from densedev.model import Device, Pool, PoolConfig, PoolMember, Role

    def dev(addr: str, role: str, pf: str, pf_netdev: str, netdevs: tuple[str, ...], k: int) -> Device:
        return Device(
            addr, role, "8086", "1889", "020000", "8086", "0000", "iavf", 0, -1, False, -1, 0, 0, pf, k,
            pf_netdev, netdevs, "ether", "", (), "", "", "", "pci0000:00", "",
        )  # fmt: skip

    devices = []
    for p in range(64):
        pf = f"0000:{0x18 + p:02x}:00.0"
        devices.append(dev(pf, Role.PF, "", "", (f"ens{p}f0",), -1))
        for k in range(256):
            devices.append(
                dev(f"0000:{0x18 + p:02x}:{1 + (k >> 3):02x}.{k & 7}", Role.VF, pf, f"ens{p}f0", (), k)
            )
    vfs = [d for d in devices if d.role == Role.VF]
    pools = [
        Pool(
            PoolConfig(f"pool{k}", "intel.com"),
            tuple(PoolMember(d.id, d) for d in vfs[k * 1024 : (k + 1) * 1024]),
        )
        for k in range(16)
    ]
    now = [0.0]
    t0 = time.perf_counter()
    tracker = HealthTracker(devices, pools, clock=lambda: now[0])
    tracker.collect()
    build_s = time.perf_counter() - t0
    downs: list[float] = []
    ups: list[float] = []
    for _ in range(rounds):
        for up, samples in ((False, downs), (True, ups)):
            now[0] += 10.0  # past the 1 s hold-down: every flip is reported
            start = time.perf_counter()
            tracker.set_links([("ens9f0", up)])
            updates = tracker.collect()
            if up:  # the hold-down started at set_links: this collect is the one after it expires
                now[0] += 10.0
                updates = tracker.collect()
            samples.append(time.perf_counter() - start)
            assert list(updates) == ["intel.com/pool2"]
            assert updates["intel.com/pool2"].healthy.count(False) == (0 if up else 256)

    def unchanged() -> None:
        tracker.set_links([("ens20f0", True)])  # already up: no fact changes
        tracker.collect()

    quiet = per_call(unchanged, 50, 5)
    return {
        "implementation": accel.IMPLEMENTATION,
        "devices": len(devices),
        "build_s": build_s,
        "pf_down_s": statistics.median(downs),
        "pf_up_s": statistics.median(ups),
        "no_change_collect_s": quiet,
    }


def main() -> int:
    """Run the benchmark and print figures (or JSON)."""
    parser = _impl.arguments(__file__, __doc__, "fewer repetitions (a smoke run)")
    parser.add_argument("--tracker-only", action="store_true", help=argparse.SUPPRESS)  # child mode
    args = parser.parse_args()
    calls, rounds = (200, 3) if args.quick else (2000, 7)
    if args.tracker_only:
        print(json.dumps(bench_tracker(5 if args.quick else 41)))
        return 0

    from densedev import _fast_py as twin

    impls: dict[str, ModuleType] = {"python": twin}
    with contextlib.suppress(ImportError):  # a missing build: report the twin alone
        impls["cython"] = importlib.import_module("densedev._fast")
    results: dict[str, object] = {"bits": BITS}
    for name, mod in impls.items():
        results[name] = bench_bitmaps(mod, calls if name == "cython" else max(20, calls // 20), rounds)
    for name, env in (("tracker_cython", {}), ("tracker_python", {"DENSEDEV_NO_EXTENSIONS": "1"})):
        if name == "tracker_cython" and "cython" not in impls:
            continue
        cmd = [sys.executable, __file__, "--tracker-only"] + (["--quick"] if args.quick else [])
        out = subprocess.run(
            cmd, env={**os.environ, "PYTHONPATH": str(SRC), **env}, capture_output=True, text=True, check=True
        )
        results[name] = json.loads(out.stdout)

    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    us = 1e6
    print(f"bitmap bench: {BITS} bits ({BITS // 8} bytes), median of {rounds} rounds")
    for name in impls:
        r = results[name]
        assert isinstance(r, dict)
        print(
            f"  [{name:<6}] diff 4 changes {r['diff_few_s'] * us:8.2f} µs   diff 256 changes "
            f"{r['diff_pf256_s'] * us:8.2f} µs   diff none {r['diff_none_s'] * us:8.2f} µs   "
            f"select {r['select_s'] * us:8.2f} µs   or of 4 {r['or4_s'] * us:8.2f} µs"
        )
    if len(impls) == 2:
        py, cy = results["python"], results["cython"]
        assert isinstance(py, dict) and isinstance(cy, dict)
        ratios = "   ".join(f"{k[:-2]} {py[k] / cy[k]:.1f}x" for k in cy)
        print(f"  python/cython: {ratios}")
        print(f"  target diff <= 20 µs: {'met' if cy['diff_few_s'] * us <= 20 else 'MISSED'} (cython)")
    for name in ("tracker_cython", "tracker_python"):
        r = results.get(name)
        if isinstance(r, dict):
            print(
                f"  [{name}] {r['devices']} devices / 16 pools: build {r['build_s'] * 1e3:8.2f} ms   "
                f"PF down set_links+collect {r['pf_down_s'] * 1e3:7.3f} ms   "
                f"up (+ hold-down collect) {r['pf_up_s'] * 1e3:7.3f} ms   "
                f"unchanged {r['no_change_collect_s'] * 1e3:7.3f} ms"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
