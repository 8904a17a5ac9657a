"""Benchmark the whole daemon serving a node through DRA: start → slices, and PF down → slices.

``bench_dra.py`` measures the publisher alone; this runs ``Daemon`` as ``densedev run`` does (scan, pools,
health tracker, ownership, claims checkpoint, DRA driver, kubelet plugin sockets) on uvloop, against the
API-server stand-in in its own process and the DRA kubelet emulator.  For each size it prints:

  * start → every slice at the stand-in: seconds from ``Daemon.start`` until the publisher is idle with
    every device published, and the slice writes that took (target: writes = slices).  The API client
    library is imported before (``densedev run`` imports it while its scan-ahead child reads sysfs) and
    its import time printed apart;
  * PF down (its 256 VFs withdrawn) → slices written: from ``set_links`` (as a netlink event arrives)
    through the 2 ms coalescing window, the tracker and the publisher until the stand-in acknowledged
    the last write, p50/p99 over one event per PF, and writes per event (target ≤ 2).  The per-slice
    rate limit and the node's write bucket (``--write-qps``, default 0 here) are off so each event is
    measured, not the policy: with the daemon's defaults (20 writes/s, burst 512) a start of 512
    slices empties the bucket, and back-to-back flips of 8 writes each then take 8 / 20 s = 400 ms —
    the fleet limit doing its job, not the machinery's latency;
  * PF down → kubelet: from ``set_links`` until the DRA kubelet emulator received the health-stream
    message that carries it (DRA's NodeWatchResources, 1.34+), p50/p99;

  * idle CPU of this process (the daemon; the stand-in runs apart) over ``--idle`` seconds, and its RSS.

``--pfs 64 --vfs-per-pf 1024`` runs one node of that size (65,536 devices) instead of the two default
ones; ``--pools N`` groups the PFs into N DRA pools (by ``pfNames``) instead of one.

    PYTHONPATH=src python bench/bench_dra_daemon.py [--quick] [--json] [--dir /dev/shm]
        [--pfs 64 --vfs-per-pf 1024] [--pools 1|64] [--idle 10]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _impl
import uvloop
from bench_dra import NODE, start_stand_in

from densedev import accel
from densedev.daemon import Daemon, DaemonSettings
from densedev.dra import DraSettings, apiclient
from densedev.dra.apiclient import ResourceClient
from densedev.pools import config as config_mod
from densedev.testing import simnode
from densedev.testing.dra_kubelet import DraKubelet


async def _writes_then_idle(daemon: Daemon, before: int) -> None:
    assert daemon.dra is not None and daemon.dra.publisher is not None
    pub = daemon.dra.publisher
    while pub.writes == before:
        await asyncio.sleep(0.0002)
    await pub.wait_idle()


def _pool_doc(layout: simnode.NodeLayout, pools: int) -> dict[str, object]:
    """One DRA pool of every VF, or ``pools`` pools each selecting consecutive PFs by ``pfNames``."""
    if pools <= 1:
        return {"resourceList": [{"resourceName": "vfs", "api": "dra"}]}
    per = -(-len(layout.pfs) // pools)
    groups = [layout.pfs[i : i + per] for i in range(0, len(layout.pfs), per)]
    return {
        "resourceList": [
            {"resourceName": f"vfs_{n}", "api": "dra", "selectors": {"pfNames": [pf.netdev for pf in g]}}
            for n, g in enumerate(groups)
        ]
    }


async def run_size(
    pfs: int, vfs_per_pf: int, work: Path, pools: int = 1, idle: float = 0.0, write_qps: float = 0.0
) -> dict[str, object]:
    layout = simnode.build_node(work / "sys", pfs=pfs, vfs_per_pf=vfs_per_pf)
    cfg_path = work / "config.json"
    doc = _pool_doc(layout, pools)
    cfg_path.write_text(json.dumps(doc))
    proc, url = start_stand_in(validate=False)

    async def client() -> ResourceClient:
        return ResourceClient.for_url(url)

    short = Path(tempfile.mkdtemp(prefix="bd-", dir="/tmp"))  # sun_path holds 107 bytes
    # The registry is watched (inotify); the kubelet's plugin-manager reconciler runs once a second, so
    # the emulator's 50 ms test-speed poll would be its own idle CPU in this process, not the daemon's.
    kubelet = DraKubelet(short / "registry", poll=1.0)
    settings = DaemonSettings(
        sysfs_root=work / "sys",
        kubelet_dir=short / "dp",
        dev_root=work / "dev",
        cdi_dir=work / "cdi",
        devinfo_dir=None,
        config_path=cfg_path,
        netlink=False,
        pod_resources_socket=None,
        dra=DraSettings(
            node_name=NODE,
            plugins_dir=short / "plugins",
            registry_dir=short / "registry",
            min_write_interval_s=0.0,
            write_qps=write_qps,
        ),
    )
    (short / "dp").mkdir()
    daemon = Daemon(settings, config_mod.load(cfg_path), dra_client=client)
    devices = pfs * vfs_per_pf
    # ``densedev run`` imports the API client library while its scan-ahead child reads sysfs (cli
    # _serve; a forked child, which this process, with threads, cannot make): paid here before the
    # clock, and printed.
    import_s = apiclient.preload()
    try:
        await kubelet.start()
        t0 = time.perf_counter()
        # As ``densedev run`` starts: the collector off until Daemon.start has frozen what it built,
        # and with DRA pools until their first publish is done (then one collection, and a freeze).
        gc.disable()
        try:
            await daemon.start()
            await _writes_then_idle(daemon, 0)
            start_s = time.perf_counter() - t0
            gc.collect()
            gc.freeze()
        finally:
            gc.enable()
        assert daemon.dra is not None and daemon.dra.publisher is not None
        pub = daemon.dra.publisher
        start_writes = pub.writes
        (record,) = kubelet.plugins.values()
        latencies: list[float] = []
        to_kubelet: list[float] = []
        writes: list[int] = []
        for pf in layout.pfs:
            before, heard = pub.writes, record.health_received
            t = time.monotonic()
            daemon.set_links([(pf.netdev, False)])
            await _writes_then_idle(daemon, before)
            latencies.append(time.monotonic() - t)
            writes.append(pub.writes - before)
            while record.health_received == heard:  # the message is stamped as it arrived
                await asyncio.sleep(0.001)
            to_kubelet.append(record.health_messages[-1][0] - t)
        cpu = wall = 0.0
        if idle:
            cpu0, wall0 = time.process_time(), time.monotonic()
            await asyncio.sleep(idle)
            cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
        rss = _impl.rss_mib(os.getpid())
    finally:
        await daemon.stop()
        await kubelet.stop()
        proc.terminate()
        proc.wait()
        shutil.rmtree(short, ignore_errors=True)
    lat, kub = sorted(latencies), sorted(to_kubelet)
    return {
        "bench": "dra_daemon",
        "implementation": accel.IMPLEMENTATION,
        "devices": devices,
        "pools": len(doc["resourceList"]),  # type: ignore[arg-type]
        "start_s": round(start_s, 3),
        "client_import_s": round(import_s, 3),
        "start_writes": start_writes,
        "slices": -(-devices // 128),
        "pf_down_events": len(lat),
        "pf_down_writes_max": max(writes),
        "pf_down_p50_ms": round(statistics.median(lat) * 1000, 2),
        "pf_down_p99_ms": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1000, 2),
        "pf_down_kubelet_p50_ms": round(statistics.median(kub) * 1000, 2),
        "pf_down_kubelet_p99_ms": round(kub[min(len(kub) - 1, int(len(kub) * 0.99))] * 1000, 2),
        # In the order of the flips (--json): the first ones after a start pay for fresh memory.
        "pf_down_kubelet_each_ms": [round(x * 1000, 2) for x in to_kubelet],
        "write_qps": write_qps,
        "idle_s": idle,
        "idle_cpu_percent": round(100 * cpu / wall, 3) if wall else None,
        "rss_mib": round(rss, 1),
    }


def main() -> int:
    """Run the benchmark at 4,096 and 16,384 devices (``--quick``: 4,096 only) and print the figures."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="4,096 devices only")
    p.add_argument("--json", action="store_true")
    p.add_argument("--dir", type=Path, default=None, help="where the simulated nodes go (e.g. /dev/shm)")
    p.add_argument("--pfs", type=int, default=0, help="one node of this many PFs (with --vfs-per-pf)")
    p.add_argument("--vfs-per-pf", type=int, default=256)
    p.add_argument("--pools", type=int, default=1, help="DRA pools the PFs are grouped into")
    p.add_argument("--idle", type=float, default=0.0, help="seconds of idle CPU to measure after the flips")
    p.add_argument(
        "--write-qps", type=float, default=0.0, help="the node's slice writes per second (daemon default 20)"
    )
    args = p.parse_args()
    logging.disable(logging.WARNING)  # the daemon's own lines (no PodResources here) are not the output
    sizes = [(16, 256)] if args.quick else [(16, 256), (64, 256)]
    if args.pfs:
        sizes = [(args.pfs, args.vfs_per_pf)]
    for pfs, vfs in sizes:
        # tmpfs when there is room: 16k functions' files on disk took most of a CI run's 100 s here.
        where = args.dir or _impl.tmpfs_dir((1 << 30) * max(1, pfs * vfs // 16384), pfs * vfs)
        with tempfile.TemporaryDirectory(prefix="bench-dra-daemon-", dir=where) as tmp:
            r = uvloop.run(run_size(pfs, vfs, Path(tmp), args.pools, args.idle, args.write_qps))
        if args.json:
            print(json.dumps(r))
        else:
            print(
                f"{r['devices']:>6} devices ({r['implementation']}): start → all {r['slices']} slices "
                f"{r['start_s']:.3f} s with {r['start_writes']} writes (the API client's import before it: "
                f"{r['client_import_s']:.3f} s); PF down → slices written "
                f"p50 {r['pf_down_p50_ms']} ms p99 {r['pf_down_p99_ms']} ms over {r['pf_down_events']} "
                f"PFs, at most {r['pf_down_writes_max']} writes each"
                + (f" at {r['write_qps']} writes/s" if r["write_qps"] else "")
                + f"; PF down → kubelet p50 {r['pf_down_kubelet_p50_ms']} ms "
                f"p99 {r['pf_down_kubelet_p99_ms']} ms; {r['pools']} pools; "
                + (f"idle CPU {r['idle_cpu_percent']} % over {r['idle_s']} s; " if r["idle_s"] else "")
                + f"RSS {r['rss_mib']} MiB"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
