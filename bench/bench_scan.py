"""Benchmark the sysfs scan: extension vs plain-Python twin on simulated nodes of 1k, 4k and 16k VFs.

Prints, per node size, the scan time of each implementation (best and median of ``--repeat`` runs,
each implementation timed in a fresh process of its own, as the daemon scans at start, one right
after the other so both see the same machine state), their ratio, what the daemon does at start
(scan into a device table, then select pools: the figure of the 4k target), the 16k/4k linearity
figure, the syscalls per device counted with ``strace -c -f`` (when strace is installed), and each
scan's CPU split into user and kernel time.  The extension's kernel time spread over every core is the
least any scan doing its syscalls can take; the twin's time over it is printed as the "ratio ceiling".
(The kernel splits a thread's CPU into user and system time by sampling at its tick: the split is
rough for the short 1k scans, close for 4k and 16k.)

    python bench/bench_scan.py            # 1,024 / 4,096 / 16,384 VFs with RDMA
    python bench/bench_scan.py --quick    # 1,024 VFs only, a smoke run
    python bench/bench_scan.py --json     # one JSON object on stdout
    python bench/bench_scan.py --dir /dev/shm/scan   # nodes on tmpfs, kept for the next run

Building the trees dominates the run on a disk filesystem (each of ~40 files and links per VF is a
journalled create: ~50 s for 16k VFs on this VM's ext4, ~10 s on tmpfs; a 16k-VF tree with RDMA
takes ~2.7 GB either way).  The scan itself is syscall-bound (~8 per device with RDMA, ~5 without, at
1.5-2.5 us each on this VM); the extension spreads them over a helper thread, the twin cannot.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

SRC = Path(__file__).resolve().parent.parent / "src"
sys.path.insert(0, str(SRC))

import _impl  # noqa: E402  (bench/ is on sys.path: the script's own dir)

from densedev.node import scanner as discovery  # noqa: E402
from densedev.pools import config  # noqa: E402
from densedev.pools import select as selectors  # noqa: E402
from densedev.testing.simnode import build_node  # noqa: E402

SIZES = {1024: (4, 256), 4096: (16, 256), 16384: (64, 256)}  # VFs: (PFs, VFs per PF)
TARGET_4K_MS = 50.0
TARGET_LINEARITY = 4.5
TARGET_RATIO = 5.0


def _time(module: str, root: bytes, repeat: int) -> dict[str, Any]:
    """Best and median ms of ``repeat`` scans by ``module`` in a fresh child process, the devices found
    and the CPU per scan (user, kernel)."""
    return _child("scan", module, root, repeat)


def _child(kind: str, module: str, root: bytes, repeat: int) -> dict[str, Any]:
    # A process of its own per implementation: neither inherits the other's heap (the twin leaves
    # ~100k objects' worth of fragmented arenas behind), and the daemon scans in a fresh process too.
    cmd = [sys.executable, __file__, "--child", kind, module, os.fsdecode(root), str(repeat)]
    env = dict(os.environ)
    env.pop("DENSEDEV_NO_EXTENSIONS", None)
    if module == "densedev._fast_py":
        env["DENSEDEV_NO_EXTENSIONS"] = "1"  # the pooled path scans through accel: make it pick the twin
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


def _run_child(kind: str, module: str, root: str, repeat: int) -> dict[str, Any]:
    """Time scans (``scan``: the module's scan_sysfs; ``pooled``: scan into a table + pools) here."""
    raw = os.fsencode(root)
    times = []
    count = 0
    # Each result is dropped outside the timed window: freeing the last scan's thousands of objects is
    # not part of the next one (the daemon keeps its table).
    if kind == "pooled":
        from densedev import accel

        assert accel.impl.__name__ == module, f"asked for {module}, accel chose {accel.impl.__name__}"
    cpu: dict[str, float] = {}
    if kind == "scan":
        fn = importlib.import_module(module).scan_sysfs
        before = resource.getrusage(resource.RUSAGE_SELF)  # microseconds, not os.times()' 10 ms ticks
        for _ in range(repeat):
            t0 = time.perf_counter()
            rows, _warnings = fn(raw, None)
            times.append(time.perf_counter() - t0)
            count = len(rows)
            del rows, _warnings
        after = resource.getrusage(resource.RUSAGE_SELF)
        # CPU per scan, every thread of this process: the kernel's share bounds what threads can win.
        cpu = {
            "user_ms": (after.ru_utime - before.ru_utime) * 1e3 / repeat,
            "sys_ms": (after.ru_stime - before.ru_stime) * 1e3 / repeat,
        }
    else:
        cfg = _pool_config(Path(root))
        for _ in range(repeat):
            t0 = time.perf_counter()
            pools = selectors.build_pools(cfg, discovery.scan(root).devices)
            times.append(time.perf_counter() - t0)
            del pools
    return {"best": min(times) * 1e3, "median": statistics.median(times) * 1e3, "count": count, **cpu}


_STRACE_CHILD = """
import os, sys
sys.path.insert(0, {src!r})
os.environ.pop("DENSEDEV_NO_EXTENSIONS", None)
import importlib
mod = importlib.import_module({module!r})
if {scan}:
    mod.scan_sysfs({root!r}, None)
"""


def _strace_calls(module: str, root: bytes, scan: bool) -> int | None:
    """Total syscalls of a child that imports ``module`` and (optionally) scans once."""
    code = _STRACE_CHILD.format(src=str(SRC), module=module, root=root, scan=scan)
    with tempfile.NamedTemporaryFile("r", suffix=".strace") as out:
        proc = subprocess.run(
            ["strace", "-c", "-f", "-o", out.name, sys.executable, "-c", code],
            capture_output=True,
            check=False,
        )
        if proc.returncode != 0:
            return None
        for line in out.read().splitlines():
            parts = line.split()
            if parts and parts[-1] == "total":
                # "100.00  secs  usecs/call  calls  errors  total" (errors may be absent)
                nums = [p for p in parts[:-1] if p.replace(".", "").isdigit()]
                return int(nums[3]) if len(nums) >= 4 else int(nums[-1])
    return None


def _syscalls_per_device(module: str, root: bytes, devices: int) -> float | None:
    if shutil.which("strace") is None or devices == 0:
        return None
    base = _strace_calls(module, root, scan=False)
    full = _strace_calls(module, root, scan=True)
    if base is None or full is None:
        return None
    return (full - base) / devices


def _pool_config(root: Path) -> config.Config:
    """Pools of the shape ``simnode.write_config`` writes: one per PF for half the PFs, RDMA, the rest."""
    devices = discovery.scan(root).devices
    pfs = [d for d in devices if d.role == "pf" and d.netdevs]
    doc = {
        "resourceList": [
            *(
                {"resourceName": f"pf{i}", "selectors": {"pfNames": [pf.netdevs[0]]}}
                for i, pf in enumerate(pfs[: len(pfs) // 2])
            ),
            {"resourceName": "rdma_vfs", "selectors": {"isRdma": True, "linkTypes": ["ether", "infiniband"]}},
            {"resourceName": "rest", "selectors": {"vendors": sorted({d.vendor for d in devices})}},
        ]
    }
    return config.parse(json.dumps(doc))


def _time_pooled(module: str, root: Path, repeat: int) -> float:
    """Best time (ms) of what the daemon does at start with ``module``: scan into a table, select pools."""
    best: float = _child("pooled", module, os.fsencode(root), repeat)["best"]
    return best


def run(sizes: list[int], repeat: int, workdir: Path, rdma: bool, strace: bool) -> dict[str, Any]:
    """Build each node, scan it with both implementations and return the figures."""
    twin = importlib.import_module("densedev._fast_py")
    fast: ModuleType | None
    try:
        fast = importlib.import_module("densedev._fast")
    except ImportError:
        fast = None
    results: dict[str, Any] = {"rdma": rdma, "repeat": repeat, "extension": fast is not None, "nodes": []}
    for vfs in sizes:
        pfs, per_pf = SIZES[vfs]
        root = workdir / (f"node-{vfs}" if rdma else f"node-{vfs}-nordma")  # never reuse the other kind
        t0 = time.perf_counter()
        if not (root / ".simnode").exists():
            build_node(root, pfs=pfs, vfs_per_pf=per_pf, rdma=rdma)
        build_s = time.perf_counter() - t0
        raw = os.fsencode(root)
        row: dict[str, Any] = {"vfs": vfs, "build_s": round(build_s, 2)}
        py = _time("densedev._fast_py", raw, repeat)
        py_best, py_med, devices = py["best"], py["median"], py["count"]
        row.update(
            devices=devices,
            python_best_ms=round(py_best, 2),
            python_median_ms=round(py_med, 2),
            python_scan_and_pools_ms=round(_time_pooled("densedev._fast_py", root, repeat), 2),
        )
        if fast is not None:
            assert fast.scan_sysfs(raw, None) == twin.scan_sysfs(raw, None), "extension and twin disagree"
            cy = _time("densedev._fast", raw, repeat)
            cy_best, cy_med = cy["best"], cy["median"]
            # The extension's kernel time alone, spread over every core, is the least it can take: the
            # twin's time over that is the ratio no user-space work can beat on this machine.
            floor = cy["sys_ms"] / (os.cpu_count() or 1)
            row.update(
                cython_best_ms=round(cy_best, 2),
                cython_median_ms=round(cy_med, 2),
                ratio=round(py_best / cy_best, 2),
                cpu_ms={
                    "cython": {"user": round(cy["user_ms"], 1), "sys": round(cy["sys_ms"], 1)},
                    "python": {"user": round(py["user_ms"], 1), "sys": round(py["sys_ms"], 1)},
                },
                ratio_ceiling=round(py_best / floor, 2) if floor > 0 else None,
                cython_us_per_device=round(cy_best * 1e3 / devices, 2),
                scan_and_pools_ms=round(_time_pooled("densedev._fast", root, repeat), 2),
            )
            row["pooled_ratio"] = round(row["python_scan_and_pools_ms"] / row["scan_and_pools_ms"], 2)
        if strace:
            row["syscalls_per_device"] = {
                "cython": _syscalls_per_device("densedev._fast", raw, devices) if fast else None,
                "python": _syscalls_per_device("densedev._fast_py", raw, devices),
            }
        results["nodes"].append(row)
    by_vfs = {n["vfs"]: n for n in results["nodes"]}
    key = "cython_best_ms" if fast is not None else "python_best_ms"
    if 4096 in by_vfs and 16384 in by_vfs:
        results["linearity_16k_over_4k"] = round(by_vfs[16384][key] / by_vfs[4096][key], 2)
    if 4096 in by_vfs and fast is not None:
        n4 = by_vfs[4096]
        results["targets"] = {
            "4k_scan_and_pools_ms<=50": n4["scan_and_pools_ms"] <= TARGET_4K_MS,
            "ratio>=5": n4["ratio"] >= TARGET_RATIO,
            "linearity<=4.5": results.get("linearity_16k_over_4k", 0) <= TARGET_LINEARITY
            if "linearity_16k_over_4k" in results
            else None,
        }
    return results


def _print(results: dict[str, Any]) -> None:
    print(f"sysfs scan (rdma={results['rdma']}, best/median of {results['repeat']} runs)")
    head = (
        "VFs",
        "devices",
        "cython ms",
        "python ms",
        "ratio",
        "us/dev",
        "+pools ms",
        "ratio",
        "syscalls/dev",
    )
    print("{:>6} {:>8} {:>16} {:>16} {:>6} {:>7} {:>15} {:>6} {:>14}".format(*head))
    for n in results["nodes"]:
        cy = f"{n.get('cython_best_ms', '-')}/{n.get('cython_median_ms', '-')}"
        py = f"{n['python_best_ms']}/{n['python_median_ms']}"
        pooled = f"{n.get('scan_and_pools_ms', '-')}/{n['python_scan_and_pools_ms']}"
        sc = n.get("syscalls_per_device") or {}
        scs = (
            "/".join("-" if v is None else f"{v:.1f}" for v in (sc.get("cython"), sc.get("python")))
            if sc
            else "-"
        )
        print(
            f"{n['vfs']:>6} {n['devices']:>8} {cy:>16} {py:>16} {n.get('ratio', '-'):>6} "
            f"{n.get('cython_us_per_device', '-'):>7} {pooled:>15} {n.get('pooled_ratio', '-'):>6} {scs:>14}"
        )
    for n in results["nodes"]:
        if "cpu_ms" in n:
            cy, py = n["cpu_ms"]["cython"], n["cpu_ms"]["python"]
            print(
                f"{n['vfs']:>6} VFs, CPU per scan (user + kernel ms): cython {cy['user']} + {cy['sys']}, "
                f"python {py['user']} + {py['sys']}; ratio ceiling on {os.cpu_count()} cores "
                f"(python / cython kernel time per core): {n['ratio_ceiling']}"
            )
    if "linearity_16k_over_4k" in results:
        print(f"linearity 16k/4k: {results['linearity_16k_over_4k']} (target <= {TARGET_LINEARITY})")
    if "targets" in results:
        print("targets met:", ", ".join(f"{k}={v}" for k, v in results["targets"].items()))


def main() -> int:
    """Parse flags, run the benchmark and print a table or JSON."""
    _impl.announce(__file__)
    if sys.argv[1:2] == ["--child"]:
        kind, module, root, repeat = sys.argv[2:6]
        print(json.dumps(_run_child(kind, module, root, int(repeat))))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1,024 VFs only (smoke run)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--repeat", type=int, default=0, help="scans per implementation (default 5, quick 3)")
    parser.add_argument("--no-rdma", action="store_true", help="nodes without RDMA devices")
    parser.add_argument("--no-strace", action="store_true", help="skip the syscall count")
    parser.add_argument("--dir", type=Path, help="keep the simulated nodes here (reused when present)")
    parser.add_argument("--sizes", default="", help="comma-separated VF counts out of 1024,4096,16384")
    args = parser.parse_args()
    sizes = [1024] if args.quick else [1024, 4096, 16384]
    if args.sizes:
        sizes = [int(x) for x in args.sizes.split(",")]
        unknown = [x for x in sizes if x not in SIZES]
        if unknown:
            parser.error(f"--sizes {unknown}: choose from {sorted(SIZES)}")
    repeat = args.repeat or (3 if args.quick else 5)
    with _impl.workdir(args.dir, "densedev-bench-scan-") as workdir:
        results = run(sizes, repeat, workdir, rdma=not args.no_rdma, strace=not args.no_strace)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        _print(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
