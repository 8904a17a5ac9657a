"""What a pool costs: ``densedev run`` with N device-plugin pools, its memory and its reloads N → 0 → N.

A simulated node (``simnode``) of PFs with 4 VFs per pool; pool ``i`` selects 4 VFs of one PF by a
``pfNames`` range (``ens1f0#4-7``), so every pool is a gRPC server on its own socket, registered with
the kubelet emulator (in this process) and streaming its list.  The daemon runs as its own process,
exactly the command a DaemonSet runs.  Measured in one run, for each source tree given:
  * the RSS of the daemon serving 1 pool (the interpreter, imports, the device table);
  * start-up until every pool's first list reached the emulator, and the RSS once settled;
  * for each cycle: the config rewritten to 0 pools and SIGHUP, timed until the last pool's socket is
    gone, RSS; then back to N pools and SIGHUP, timed until every pool registered again and listed, RSS;
  * per pool: (RSS at start with N pools - RSS with 1) / (N - 1), in KiB; start-up and reload times / N.
``--baseline SRC`` runs another tree first (e.g. ``git archive main`` unpacked, with the extension
copied in), so old and new compare on one machine in one run.

``--attribute`` runs the daemon in this process under tracemalloc instead (the emulator in a child
process, so its allocations are not counted) and prints what one pool's Python heap holds, by source
file: the heap with N pools minus the heap after the reload to 0, and what one more cycle N → 0 left.
gRPC's C core allocates outside Python's allocator: tracemalloc does not see it, the RSS figures do.

    PYTHONPATH=src python bench/bench_pool_cost.py [--quick] [--json] [--pools 1000] [--cycles 2]
        [--baseline /tmp/densedev-main/src] [--attribute]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import _impl
import uvloop

from densedev.testing import simnode
from densedev.testing.kubelet import KubeletEmulator

VFS_PER_POOL = 4
SETTLE_S = 2.0  # after a start or reload: the allocators' deferred preparation, the catch-up rescan


def pool_doc(layout: simnode.NodeLayout, n: int) -> dict[str, object]:
    """The config of ``n`` pools of VFS_PER_POOL VFs each, by pfNames ranges, in PF order."""
    per_pf = len(layout.pfs[0].vf_addresses) // VFS_PER_POOL
    pools = []
    for i in range(n):
        pf = layout.pfs[i // per_pf]
        first = (i % per_pf) * VFS_PER_POOL
        pools.append(
            {
                "resourceName": f"p{i}",
                "selectors": {"pfNames": [f"{pf.netdev}#{first}-{first + VFS_PER_POOL - 1}"]},
            }
        )
    return {"resourceList": pools, "reconcileSeconds": 3600}


def pool_sockets(kubelet_dir: Path) -> int:
    """How many pool sockets are in the kubelet's directory (every ``.sock`` but ``kubelet.sock``)."""
    return sum(1 for e in os.scandir(kubelet_dir) if e.name.endswith(".sock") and e.name != "kubelet.sock")


def listed_again(emu: KubeletEmulator, names: list[str], regs: dict[str, int], since: float) -> bool:
    """Whether every pool registered again since ``regs`` was counted and sent a list after ``since``."""
    return all(
        emu.registrations(r) > regs[r] and not emu.stream_ended(r) and emu.updates(r)[-1].received > since
        for r in names
    )


async def wait_until(predicate: Callable[[], bool], timeout: float, poll: float = 0.01) -> None:
    """Poll ``predicate`` until it holds; raise TimeoutError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError
        await asyncio.sleep(poll)


async def measure(src: Path, layout: simnode.NodeLayout, work: Path, n: int, cycles: int) -> dict:
    """Run the daemon of tree ``src`` with ``n`` pools through ``cycles`` reloads n → 0 → n."""
    config = work / "config.json"
    full = json.dumps(pool_doc(layout, n))
    empty = json.dumps(pool_doc(layout, 0))
    config.write_text(full)
    names = [f"intel.com/p{i}" for i in range(n)]
    kubelet_dir = Path(tempfile.mkdtemp(prefix="dd-", dir="/tmp"))
    emu = KubeletEmulator(kubelet_dir, checkpoint=False)
    await emu.start()
    t = time.monotonic()
    daemon = subprocess.Popen(
        _impl.daemon_argv(config, layout.root, kubelet_dir, work / "dev", None, src=src),
        env=_impl.daemon_env(src=src),
    )
    out: dict = {"src": str(src), "pools": n, "cycles": []}
    try:
        await emu.wait_for(lambda: all(emu.updates(r) for r in names), 600)
        out["startup_s"] = round(time.monotonic() - t, 2)
        await asyncio.sleep(SETTLE_S)
        out["rss_start_mib"] = round(_impl.rss_mib(daemon.pid), 1)
        for _ in range(cycles):
            cycle = {}
            config.write_text(empty)
            t = time.monotonic()
            daemon.send_signal(signal.SIGHUP)
            await wait_until(lambda: pool_sockets(kubelet_dir) == 0, 600)
            cycle["to_0_s"] = round(time.monotonic() - t, 2)
            await asyncio.sleep(SETTLE_S)
            cycle["rss_0_mib"] = round(_impl.rss_mib(daemon.pid), 1)
            regs = {r: emu.registrations(r) for r in names}
            config.write_text(full)
            t = time.monotonic()
            daemon.send_signal(signal.SIGHUP)
            await emu.wait_for(lambda g=regs, t0=t: listed_again(emu, names, g, t0), 600)
            cycle["to_n_s"] = round(time.monotonic() - t, 2)
            await asyncio.sleep(SETTLE_S)
            cycle["rss_n_mib"] = round(_impl.rss_mib(daemon.pid), 1)
            out["cycles"].append(cycle)
    finally:
        daemon.send_signal(signal.SIGTERM)
        t = time.monotonic()
        out["exit"] = await asyncio.to_thread(daemon.wait, 600)
        out["stop_s"] = round(time.monotonic() - t, 2)
        await emu.stop()
        shutil.rmtree(kubelet_dir, ignore_errors=True)
    last = out["cycles"][-1] if out["cycles"] else None
    if last is not None:
        out["reload_to_0_ms_per_pool"] = round(last["to_0_s"] * 1e3 / n, 2)
        out["reload_to_n_ms_per_pool"] = round(last["to_n_s"] * 1e3 / n, 2)
    out["startup_ms_per_pool"] = round(out["startup_s"] * 1e3 / n, 2)
    return out


def line(r: dict) -> str:
    """One human-readable line of a run's figures."""
    cycles = "; ".join(
        f"→0 {c['to_0_s']} s ({c['rss_0_mib']} MiB), →{r['pools']} {c['to_n_s']} s ({c['rss_n_mib']} MiB)"
        for c in r["cycles"]
    )
    return (
        f"{r['src']}: 1 pool {r['rss_one_pool_mib']} MiB; {r['pools']} pools: start {r['startup_s']} s, "
        f"RSS {r['rss_start_mib']} MiB; {cycles}; per pool {r['kib_per_pool']} KiB, "
        f"start {r['startup_ms_per_pool']} ms, reload to 0 {r.get('reload_to_0_ms_per_pool')} ms, "
        f"reload to {r['pools']} {r.get('reload_to_n_ms_per_pool')} ms; SIGTERM → exit {r['exit']} in "
        f"{r['stop_s']} s"
    )


def node_for(work: Path, pools: int) -> simnode.NodeLayout:
    """A simulated node with room for ``pools`` pools of VFS_PER_POOL VFs (PFs of 128 VFs)."""
    per_pf = 128
    pfs = max(1, -(-pools * VFS_PER_POOL // per_pf))
    return simnode.build_node(work / "sys", pfs=pfs, vfs_per_pf=per_pf, numa_nodes=2)


async def run(args: argparse.Namespace, work: Path) -> list[dict]:
    layout = node_for(work, args.pools)
    trees = [*(Path(b) for b in args.baseline), _impl.SRC]
    results = []
    for src in trees:
        one = await measure(src, layout, work, 1, 0)
        result = await measure(src, layout, work, args.pools, args.cycles)
        result["rss_one_pool_mib"] = one["rss_start_mib"]
        extra = result["rss_start_mib"] - one["rss_start_mib"]
        result["kib_per_pool"] = round(extra * 1024 / max(1, args.pools - 1), 1)
        results.append(result)
        if not args.json:
            print(line(result), flush=True)
    return results


async def attribute(args: argparse.Namespace, work: Path) -> dict:
    """Run the daemon here under tracemalloc; return one pool's Python heap by source file."""
    import tracemalloc

    from densedev.daemon import Daemon
    from densedev.pools import config as config_mod

    n = args.pools
    layout = node_for(work, n)
    config = work / "config.json"
    full, empty = json.dumps(pool_doc(layout, n)), json.dumps(pool_doc(layout, 0))
    config.write_text(full)
    noise = [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, "<frozen *>")]
    # The emulator in a child process: its channels and stream buffers are not the daemon's.
    async with _impl.emulator_child() as kubelet_dir:
        settings = _impl.traced_settings(layout.root, kubelet_dir, work, config)
        daemon = Daemon(settings, config_mod.load(config))

        async def served() -> tracemalloc.Snapshot:
            await wait_until(lambda: daemon.registered()[0], 600, poll=0.05)
            await asyncio.sleep(SETTLE_S)
            return tracemalloc.take_snapshot().filter_traces(noise)

        async def reload(text: str) -> None:
            config.write_text(text)
            assert await daemon.reload()
            await asyncio.sleep(SETTLE_S)

        tracemalloc.start(1)
        try:
            await daemon.start()
            with_n = await served()
            await reload(empty)
            at_0 = tracemalloc.take_snapshot().filter_traces(noise)
            await reload(full)
            await served()
            await reload(empty)
            at_0_again = tracemalloc.take_snapshot().filter_traces(noise)
        finally:
            tracemalloc.stop()
            await daemon.stop()
    stats = with_n.compare_to(at_0, "filename")
    by_file = [
        {
            "file": _short(st.traceback[0].filename),
            "kib": round(st.size_diff / 1024 / n, 2),
            "blocks": st.count_diff / n,
        }
        for st in stats[:15]
    ]
    left = sum(st.size_diff for st in at_0_again.compare_to(at_0, "filename"))
    return {
        "pools": n,
        "python_heap_kib_per_pool": round(sum(st.size_diff for st in stats) / 1024 / n, 1),
        "by_file": by_file,
        "left_after_a_cycle_kib_per_pool": round(left / 1024 / n, 2),
    }


def _short(filename: str) -> str:
    """A source file's name from its package on (``densedev/...``, ``grpc/...``, ``asyncio/...``)."""
    parts = Path(filename).parts
    for anchor in ("densedev", "grpc", "asyncio"):
        if anchor in parts:
            return "/".join(parts[parts.index(anchor) :])
    return Path(filename).name


def main() -> int:
    p = _impl.arguments(__file__, __doc__, "200 pools, one cycle")
    p.add_argument("--pools", type=int, default=1000)
    p.add_argument("--cycles", type=int, default=2)
    p.add_argument("--baseline", action="append", default=[], help="another src tree to run first")
    p.add_argument("--attribute", action="store_true", help="one pool's Python heap by source file")
    args = p.parse_args()
    logging.basicConfig(level=logging.ERROR)
    if args.quick:
        args.pools, args.cycles = 200, 1
    with _impl.scratch("densedev-bench-", _impl.tmpfs_dir(1 << 30)) as work:
        if args.attribute:
            found = uvloop.run(attribute(args, work))
            if args.json:
                print(json.dumps({"bench": "pool_cost_attribute", **found}))
                return 0
            print(
                f"{found['pools']} pools: {found['python_heap_kib_per_pool']} KiB of Python heap a pool "
                f"(what a reload to 0 frees); one more cycle {found['pools']} → 0 left "
                f"{found['left_after_a_cycle_kib_per_pool']} KiB a pool"
            )
            for row in found["by_file"]:
                print(f"  {row['kib']:8.2f} KiB {row['blocks']:7.1f} blocks  {row['file']}")
            return 0
        results = uvloop.run(run(args, work))
    if args.json:
        print(json.dumps({"bench": "pool_cost", "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
