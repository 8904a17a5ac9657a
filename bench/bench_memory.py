"""The daemon's memory at density: RSS of ``densedev run`` and what each MiB of it holds.

A simulated node of 64 PFs x 256 VFs (16,384 devices; ``--pfs 64 --vfs-per-pf 1024``: 65,536) in 16
device-plugin pools, no pool on DRA.  Measured in one run:
  * ``rss_mib``: the resident memory of ``densedev run`` as its own process (the DaemonSet's command),
    once every pool's list reached the kubelet emulator and the start-up work settled; its anonymous and
    file-backed parts (``/proc/<pid>/status`` RssAnon / RssFile: the heap versus mapped code);
  * ``baseline_rss_mib``: the same interpreter after importing what the daemon imports, with no node:
    the floor a node's size adds to;
  * the breakdown: the daemon run in this process under ``tracemalloc`` (the emulator in a child process
    so its allocations stay out), the Python heap the running daemon holds beyond its imports, by source
    line (what structure) and by file.  Allocations in C outside Python's allocator (gRPC's core, the
    kernel's socket buffers) are in the RSS figure and not here.

Targets (issue 26): ≤ 80 MiB at 16,384 devices, ≤ 250 MiB at 65,536.  ``--quick``: 8 PFs x 64 VFs.

    PYTHONPATH=src python bench/bench_memory.py [--quick] [--json] [--pfs 64 --vfs-per-pf 1024] [--top 15]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import _impl
import uvloop

from densedev import accel
from densedev.testing import simnode
from densedev.testing.kubelet import KubeletEmulator

SETTLE_S = 3.0  # the allocators' deferred preparation and the catch-up rescan after the first lists
POOLS = 16
# What the daemon process imports before it reads a node (the baseline's imports).
IMPORTS = "import densedev.cli, densedev.daemon, densedev.kubelet.server, grpc, uvloop"


def config_doc(layout: simnode.NodeLayout) -> dict[str, object]:
    """16 pools (or one per PF when fewer PFs) selecting consecutive PFs by pfNames, as bench_e2e's."""
    per = -(-len(layout.pfs) // POOLS)
    groups = [layout.pfs[i : i + per] for i in range(0, len(layout.pfs), per)]
    return {
        "resourceList": [
            {"resourceName": f"vfs_{n}", "selectors": {"pfNames": [pf.netdev for pf in g]}}
            for n, g in enumerate(groups)
        ],
        "reconcileSeconds": 3600,
    }


def status_kib(pid: int) -> dict[str, int]:
    """The ``kB`` lines of ``/proc/<pid>/status`` (VmRSS, RssAnon, RssFile ...)."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if value.strip().endswith("kB"):
                out[key] = int(value.split()[0])
    return out


async def process_rss(work: Path, layout: simnode.NodeLayout) -> dict[str, object]:
    """RSS of ``densedev run`` in its own process once it serves every pool."""
    config = work / "config.json"
    kubelet_dir = Path(tempfile.mkdtemp(prefix="dd-", dir="/tmp"))
    emu = KubeletEmulator(kubelet_dir, update_work=False)  # the daemon's memory is measured, not the kubelet
    await emu.start()
    t = time.perf_counter()
    daemon = subprocess.Popen(
        _impl.daemon_argv(config, layout.root, kubelet_dir, work / "dev", None), env=_impl.daemon_env()
    )
    try:
        names = [f"intel.com/vfs_{n}" for n in range(len(config_doc(layout)["resourceList"]))]  # type: ignore[arg-type]
        await emu.wait_for(lambda: all(emu.updates(n) for n in names), 300)
        start_s = time.perf_counter() - t
        await asyncio.sleep(SETTLE_S)
        status = status_kib(daemon.pid)
    finally:
        daemon.terminate()
        await asyncio.to_thread(daemon.wait, 30)
        await emu.stop()
        shutil.rmtree(kubelet_dir, ignore_errors=True)
    base = subprocess.run(
        [sys.executable, "-c", f"{IMPORTS}\nprint(open('/proc/self/status').read())"],
        env=_impl.daemon_env(),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    base_kib = next(int(line.split()[1]) for line in base.splitlines() if line.startswith("VmRSS:"))
    return {
        "start_s": round(start_s, 2),
        "rss_mib": round(status["VmRSS"] / 1024, 1),
        "rss_anon_mib": round(status.get("RssAnon", 0) / 1024, 1),
        "rss_file_mib": round(status.get("RssFile", 0) / 1024, 1),
        "baseline_rss_mib": round(base_kib / 1024, 1),
    }


async def breakdown(work: Path, layout: simnode.NodeLayout, top: int) -> dict[str, object]:
    """The running daemon's Python heap beyond its imports, by source line and by file (tracemalloc)."""
    import tracemalloc

    from densedev.daemon import Daemon
    from densedev.pools import config as config_mod

    config = work / "config.json"
    noise = [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, "<frozen *>")]
    async with _impl.emulator_child() as kubelet_dir:
        settings = _impl.traced_settings(layout.root, kubelet_dir, work, config)
        tracemalloc.start(1)
        daemon = Daemon(settings, config_mod.load(config))
        try:
            before = tracemalloc.take_snapshot().filter_traces(noise)
            await daemon.start()
            deadline = time.monotonic() + 600
            while not daemon.registered()[0] and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await asyncio.sleep(SETTLE_S)
            after = tracemalloc.take_snapshot().filter_traces(noise)
        finally:
            tracemalloc.stop()
            await daemon.stop()
    devices = sum(len(pf.vf_addresses) for pf in layout.pfs)

    def rows(key: str) -> list[dict[str, object]]:
        stats = after.compare_to(before, key)
        out = []
        for st in stats[:top]:
            frame = st.traceback[0]
            where = _short(frame.filename) + (f":{frame.lineno}" if key == "lineno" else "")
            out.append(
                {
                    "where": where,
                    "mib": round(st.size_diff / 2**20, 2),
                    "bytes_per_device": round(st.size_diff / devices, 1),
                    "blocks": st.count_diff,
                }
            )
        return out

    total = sum(st.size_diff for st in after.compare_to(before, "filename"))
    return {
        "python_heap_mib": round(total / 2**20, 1),
        "python_heap_bytes_per_device": round(total / devices, 1),
        "by_line": rows("lineno"),
        "by_file": rows("filename"),
    }


def _short(filename: str) -> str:
    """A source file's name from its package on (``densedev/...``, ``grpc/...``, ``asyncio/...``)."""
    parts = Path(filename).parts
    for anchor in ("densedev", "grpc", "asyncio", "python3.11"):
        if anchor in parts:
            return "/".join(parts[parts.index(anchor) :])
    return filename


async def measure(args: argparse.Namespace, work: Path) -> dict[str, object]:
    t = time.perf_counter()
    layout = simnode.build_node(work / "sys", pfs=args.pfs, vfs_per_pf=args.vfs_per_pf)
    build_s = time.perf_counter() - t
    (work / "config.json").write_text(json.dumps(config_doc(layout)))
    result: dict[str, object] = {
        "bench": "memory",
        "implementation": accel.IMPLEMENTATION,
        "devices": sum(len(pf.vf_addresses) for pf in layout.pfs),
        "pools": len(config_doc(layout)["resourceList"]),  # type: ignore[arg-type]
        "build_node_s": round(build_s, 1),
    }
    result.update(await process_rss(work, layout))
    if not args.no_breakdown:
        result.update(await breakdown(work, layout, args.top))
    return result


def main() -> int:
    """Measure and print the daemon's RSS and its breakdown."""
    _impl.announce(__file__)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", action="store_true")
    p.add_argument("--pfs", type=int, default=64)
    p.add_argument("--vfs-per-pf", type=int, default=256)
    p.add_argument("--top", type=int, default=15, help="rows of the breakdown")
    p.add_argument("--no-breakdown", action="store_true", help="the process's RSS only")
    p.add_argument("--dir", default=None, help="where to build the simulated node (default: tmpfs if room)")
    args = p.parse_args()
    logging.basicConfig(level=logging.ERROR)
    if args.quick:
        args.pfs, args.vfs_per_pf, args.top = 8, 64, 5
    parent = args.dir or _impl.tmpfs_dir(devices=args.pfs * args.vfs_per_pf)
    with _impl.scratch("densedev-mem-", parent) as work:
        r = uvloop.run(measure(args, work))
    if args.json:
        print(json.dumps(r))
        return 0
    print(
        f"memory [{r['implementation']}] {r['devices']} devices in {r['pools']} pools: densedev run RSS "
        f"{r['rss_mib']} MiB (anon {r['rss_anon_mib']}, file {r['rss_file_mib']}; its imports alone "
        f"{r['baseline_rss_mib']} MiB); start {r['start_s']} s"
    )
    if "python_heap_mib" in r:
        print(
            f"  Python heap the running daemon holds beyond its imports: {r['python_heap_mib']} MiB "
            f"({r['python_heap_bytes_per_device']} B/device); by source line:"
        )
        for row in r["by_line"]:  # type: ignore[attr-defined]
            print(
                f"    {row['mib']:>7} MiB {row['bytes_per_device']:>7} B/dev "
                f"{row['blocks']:>8} blocks  {row['where']}"
            )
        print("  by file:")
        for row in r["by_file"]:  # type: ignore[attr-defined]
            print(f"    {row['mib']:>7} MiB {row['bytes_per_device']:>7} B/dev  {row['where']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
