"""Benchmark event-loop lag while a full sysfs scan runs in a worker thread (extension and twin).

The daemon runs its reconcile scan with ``asyncio.to_thread(discovery.scan, root)`` so that health
messages to the kubelet keep flowing; that only helps if the scan lets go of the GIL while it waits on
the kernel.  This script builds a simulated node (16,384 VFs with RDMA; ``--quick``: 2,048), then, in
one child process per implementation (``DENSEDEV_NO_EXTENSIONS`` decides which, as in production),
runs the scan in a worker thread on uvloop while a probe task sleeps 1 ms in a loop and records how
late each wake-up is.  Printed per implementation: the scan's wall time, the probe's overshoot
(median, p99, max) during the scans and while idle, and how many probe ticks ran per scan.  A
garbage collection the scan's allocations trigger also stops the loop (it holds the GIL); it is left
on, as in the daemon, unless ``--no-gc`` (which shows what the scan alone costs the loop).  Two kinds
of scan, as the daemon runs them: the start-up scan (helper threads, a new table) and the periodic
reconcile (one thread, the node unchanged, the old table frozen out of the collector's way as the
daemon does).  The switch interval is the daemon's (``densedev.cli.SWITCH_INTERVAL_S``) unless
``--switch-interval`` says otherwise (CPython's default is 0.005).

    python bench/bench_scan_loop.py --quick
    python bench/bench_scan_loop.py --dir /dev/shm/scan --json     # tree on tmpfs, kept for reruns
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SRC = Path(__file__).resolve().parent.parent / "src"
sys.path.insert(0, str(SRC))

import _impl  # noqa: E402  (bench/ is on sys.path: the script's own dir)

SIZES = {2048: (8, 256), 16384: (64, 256)}  # VFs: (PFs, VFs per PF)
PROBE_S = 0.001


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _measure(root: str, repeat: int, idle_s: float, no_gc: bool, switch_s: float) -> dict[str, Any]:
    from densedev import accel
    from densedev.node import scanner as discovery

    if no_gc:
        gc.disable()
    sys.setswitchinterval(switch_s)

    overshoot: list[float] = []
    running = True

    async def probe() -> None:
        # perf_counter, not loop.time(): uvloop's clock ticks in whole milliseconds.
        while running:
            t0 = time.perf_counter()
            await asyncio.sleep(PROBE_S)
            overshoot.append(time.perf_counter() - t0 - PROBE_S)

    task = asyncio.create_task(probe())
    await asyncio.sleep(idle_s)  # the probe alone: the floor this machine gives
    idle = overshoot[:]
    del overshoot[:]
    scans: list[float] = []
    ticks: list[int] = []
    # Tables are kept until the probe stops: freeing 16k devices takes the loop thread ~10 ms itself,
    # which is the daemon's cost of dropping its old table, not the scan's.
    tables: list[discovery.DeviceTable] = []
    kinds: dict[str, dict[str, Any]] = {}
    for kind in ("start", "reconcile"):
        if kind == "reconcile":
            # As the daemon: its table is frozen out of the collector's way, and the periodic
            # reconcile reads on one thread and finds the node unchanged.
            gc.freeze()
        scans: list[float] = []
        ticks: list[int] = []
        del overshoot[:]
        for _ in range(repeat):
            before = len(overshoot)
            t0 = time.perf_counter()
            if kind == "start":
                tables.append(await asyncio.to_thread(discovery.scan, root))
            else:
                table = await asyncio.to_thread(discovery.scan, root, tables[-1], threads=False)
                assert table is tables[-1], "the node changed during the benchmark"
            scans.append(time.perf_counter() - t0)
            ticks.append(len(overshoot) - before)
        kinds[kind] = _figures(overshoot, scans, ticks)
    running = False
    await task
    gc.unfreeze()
    return {
        "implementation": accel.IMPLEMENTATION,
        "gc": not no_gc,
        "switch_interval_ms": round(switch_s * 1e3, 3),
        "devices": len(tables[-1].devices) if tables else 0,
        "start": kinds["start"],
        "reconcile": kinds["reconcile"],
        "idle_lag_ms": _lags(idle),
    }


def _lags(values: list[float]) -> dict[str, float]:
    ms = 1e3
    return {
        "median": round(_percentile(values, 0.5) * ms, 2),
        "p99": round(_percentile(values, 0.99) * ms, 2),
        "max": round(max(values, default=0.0) * ms, 2),
    }


def _figures(overshoot: list[float], scans: list[float], ticks: list[int]) -> dict[str, Any]:
    return {
        "scan_ms_median": round(statistics.median(scans) * 1e3, 1),
        "scan_ms_best": round(min(scans) * 1e3, 1),
        "probe_ticks_per_scan": ticks,
        "lag_ms": _lags(overshoot),
    }


def _child(root: str, repeat: int, idle_s: float, no_gc: bool, switch_s: float) -> None:
    import uvloop

    print(json.dumps(uvloop.run(_measure(root, repeat, idle_s, no_gc, switch_s))))


def _run_child(
    root: Path, repeat: int, idle_s: float, no_ext: bool, no_gc: bool, switch_s: float
) -> dict[str, Any] | None:
    env = dict(os.environ)
    env.pop("DENSEDEV_NO_EXTENSIONS", None)
    if no_ext:
        env["DENSEDEV_NO_EXTENSIONS"] = "1"
    cmd = [sys.executable, __file__, "--child", str(root), "--repeat", str(repeat), "--idle", str(idle_s)]
    cmd += ["--switch-interval", str(switch_s)]
    if no_gc:
        cmd.append("--no-gc")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        return None
    result: dict[str, Any] = json.loads(proc.stdout.splitlines()[-1])
    return result


def run(
    vfs: int, repeat: int, idle_s: float, workdir: Path, no_gc: bool = False, switch_s: float | None = None
) -> dict[str, Any]:
    """Build (or reuse) the node and measure both implementations in child processes."""
    from densedev.testing.simnode import build_node

    pfs, per_pf = SIZES[vfs]
    root = workdir / f"node-{vfs}"
    t0 = time.perf_counter()
    if not (root / ".simnode").exists():
        build_node(root, pfs=pfs, vfs_per_pf=per_pf, rdma=True)
    results: dict[str, Any] = {"vfs": vfs, "build_s": round(time.perf_counter() - t0, 1), "runs": []}
    if switch_s is None:
        from densedev.cli import SWITCH_INTERVAL_S

        switch_s = SWITCH_INTERVAL_S  # what `densedev run` sets
    for no_ext in (False, True):
        row = _run_child(root, repeat, idle_s, no_ext, no_gc, switch_s)
        if row is not None:
            results["runs"].append(row)
    return results


def _print(results: dict[str, Any]) -> None:
    gc_note = "" if all(r["gc"] for r in results["runs"]) else ", gc off"
    switch = results["runs"][0]["switch_interval_ms"] if results["runs"] else "?"
    what = f"{results['vfs']} VFs, RDMA{gc_note}, switch interval {switch} ms"
    print(f"event-loop lag during full scans in asyncio.to_thread on uvloop ({what})")
    print(f"probe: asyncio.sleep({PROBE_S}) in a loop; overshoot = wake-up minus the asked delay")
    print("start: the start-up scan (threads); reconcile: the periodic one (one thread, node unchanged)")
    head = ("impl", "scan", "devices", "scan ms", "lag med", "lag p99", "lag max", "idle max", "ticks/scan")
    print("{:>10} {:>10} {:>8} {:>9} {:>8} {:>8} {:>8} {:>9} {:>14}".format(*head))
    for r in results["runs"]:
        idle = r["idle_lag_ms"]
        for kind in ("start", "reconcile"):
            k = r[kind]
            lag = k["lag_ms"]
            ticks = ",".join(str(t) for t in k["probe_ticks_per_scan"])
            print(
                f"{r['implementation']:>10} {kind:>10} {r['devices']:>8} {k['scan_ms_median']:>9} "
                f"{lag['median']:>8} {lag['p99']:>8} {lag['max']:>8} {idle['max']:>9} {ticks:>14}"
            )


def main() -> int:
    """Parse flags, run the benchmark and print a table or JSON."""
    _impl.announce(__file__)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2,048 VFs (smoke run)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--repeat", type=int, default=3, help="scans per implementation")
    parser.add_argument("--idle", type=float, default=0.5, help="seconds of probing before the scans")
    parser.add_argument("--dir", type=Path, help="keep the simulated node here (reused when present)")
    parser.add_argument("--no-gc", action="store_true", help="garbage collector off during the scans")
    parser.add_argument(
        "--switch-interval",
        type=float,
        help="sys.setswitchinterval in seconds (default: what `densedev run` sets)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.repeat, args.idle, args.no_gc, args.switch_interval)
        return 0
    vfs = 2048 if args.quick else 16384
    with _impl.workdir(args.dir, "densedev-bench-loop-") as workdir:
        results = run(vfs, args.repeat, args.idle, workdir, args.no_gc, args.switch_interval)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        _print(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
