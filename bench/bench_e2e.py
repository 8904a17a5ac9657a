"""End-to-end: from a real ``ip link set <pf> down`` to the kubelet emulator holding that PF's VFs Unhealthy.

A simulated node of 64 PFs x 256 VFs (16,384 devices) in 16 pools of 1,024 (``--pools``: PFs grouped into
that many pools; ``--pfs 64 --vfs-per-pf 1024`` is the 65,536-device node); each PF's netdev is a real
veth link in a private network namespace, so the kernel's rtnetlink event drives the daemon exactly as on
a node.  Measured in one run:
  * start-up: ``densedev run`` started until every pool's full list reached the emulator (process start,
    imports, scan, pools, servers, registration);
  * flip latency: the link change is sent as a raw RTM_NEWLINK request (t0 just before send) and the
    latency is the emulator's receive time of the message holding the PF's VFs Unhealthy; p50/p99
    (both processes read the same CLOCK_MONOTONIC); and until the emulator had *applied* it, doing the
    real kubelet's per-update work (the device set replaced, the checkpoint of the whole node written
    and fsynced), which grows with the pool's size (``--no-update-work``: received only);
  * kubelet restart: until every pool registered again and sent a fresh full list;
  * idle CPU of the daemon process over N seconds with nothing changing (/proc/<pid>/stat), and its
    resident memory; the daemon runs as its own process, exactly the command a DaemonSet runs.

Needs root (network namespaces).  ``--quick``: 8 PFs x 64 VFs, 20 flips, 3 s idle.

    PYTHONPATH=src python bench/bench_e2e.py [--quick] [--json] [--pfs 64 --vfs-per-pf 256 --flips 100]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import _impl
import uvloop

from densedev import accel
from densedev.pools import config as config_mod
from densedev.testing import simnode
from densedev.testing.kubelet import UNHEALTHY, KubeletEmulator
from densedev.testing.netns import LinkSwitch, namespace


async def measure(args: argparse.Namespace, work: Path, ns: str) -> dict[str, object]:
    sysfs = work / "sys"
    t = time.perf_counter()
    layout = simnode.build_node(sysfs, pfs=args.pfs, vfs_per_pf=args.vfs_per_pf, numa_nodes=2)
    build_s = time.perf_counter() - t
    _impl.veth_pfs(ns, [pf.netdev for pf in layout.pfs])
    per_pool = -(-args.pfs // max(1, args.pools))
    groups = [layout.pfs[i : i + per_pool] for i in range(0, len(layout.pfs), per_pool)]
    doc = {
        "resourceList": [
            {
                "resourceName": f"vfs_{n}",
                "selectors": {"pfNames": [pf.netdev for pf in group]},
                "healthPolicy": {"holdDownSeconds": args.hold_down},
            }
            for n, group in enumerate(groups)
        ],
        "coalesceMs": args.coalesce_ms,
        "reconcileSeconds": args.reconcile_seconds,
    }
    (work / "config.json").write_text(json.dumps(doc))
    cfg = config_mod.load(work / "config.json")
    # The kubelet's checkpoint is on its disk (/var/lib/kubelet): /tmp here, not tmpfs, so fsync costs.
    kubelet_dir = Path(tempfile.mkdtemp(prefix="dd-", dir="/tmp"))
    emu = KubeletEmulator(kubelet_dir, update_work=not args.no_update_work)
    await emu.start()
    # The daemon runs as its own process, as deployed, so its CPU and memory are its own; the emulator
    # here receives its messages, and CLOCK_MONOTONIC is shared, so latencies compare across processes.
    names = [p.full_name for p in cfg.pools]
    t = time.perf_counter()
    daemon = subprocess.Popen(
        _impl.daemon_argv(work / "config.json", sysfs, kubelet_dir, work / "dev", ns), env=_impl.daemon_env()
    )
    await emu.wait_for(lambda: all(emu.updates(n) for n in names), 120)
    startup_s = time.perf_counter() - t
    await _impl.past_catch_up()
    pool_of = {pf.netdev: f"intel.com/vfs_{n}" for n, g in enumerate(groups) for pf in g}
    switch = LinkSwitch(ns)
    rng = random.Random(7)
    down_lat: list[float] = []
    down_applied: list[float] = []
    up_lat: list[float] = []
    try:
        for _ in range(args.flips):
            pf = rng.choice(layout.pfs)
            res = pool_of[pf.netdev]
            before = len(emu.updates(res))
            t0 = time.monotonic()
            switch.set(pf.netdev, False)
            await emu.wait_for(lambda r=res, b=before: len(emu.updates(r)) > b, 10)
            upd = emu.updates(res)[-1]
            assert all(upd.devices[a] == UNHEALTHY for a in pf.vf_addresses)
            down_lat.append(upd.received - t0)
            down_applied.append(upd.applied - t0)
            before = len(emu.updates(res))
            t0 = time.monotonic()
            switch.set(pf.netdev, True)
            await emu.wait_for(lambda r=res, b=before: len(emu.updates(r)) > b, 10)
            up_lat.append(emu.updates(res)[-1].received - t0)
        await asyncio.sleep(args.hold_down + 0.1)
        # Kubelet restart: plugin sockets deleted, kubelet.sock recreated; every pool must notice,
        # serve afresh, register again and send its full list.
        regs = {n: emu.registrations(n) for n in names}
        lists = {n: len(emu.updates(n)) for n in names}
        t = time.perf_counter()
        await emu.restart()
        await emu.wait_for(
            lambda: all(emu.registrations(n) > regs[n] and len(emu.updates(n)) > lists[n] for n in names), 60
        )
        restart_s = time.perf_counter() - t
        # Idle: nothing changes; only timers (reconcile, registration watch, port poll) may run.
        rss_start = _impl.rss_mib(daemon.pid)
        cpu0, wall0 = _impl.cpu_seconds(daemon.pid), time.monotonic()
        await asyncio.sleep(args.idle)
        cpu1, wall1 = _impl.cpu_seconds(daemon.pid), time.monotonic()
        cpu = cpu1 - cpu0
        rss_after = _impl.rss_mib(daemon.pid)
    finally:
        switch.close()
        daemon.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(daemon.wait, 30)
        await emu.stop()
        shutil.rmtree(kubelet_dir, ignore_errors=True)
    return {
        "implementation": accel.IMPLEMENTATION,
        "devices": sum(len(pf.vf_addresses) for pf in layout.pfs),
        "pools": len(names),
        "vfs_per_pf": args.vfs_per_pf,
        "build_node_s": round(build_s, 2),
        "startup_ms": round(startup_s * 1e3, 1),
        "kubelet_restart_to_all_registered_ms": round(restart_s * 1e3, 1),
        "flips": args.flips,
        "down_p50_ms": round(_impl.percentile(down_lat, 0.5) * 1e3, 3),
        "down_p99_ms": round(_impl.percentile(down_lat, 0.99) * 1e3, 3),
        "down_max_ms": round(max(down_lat) * 1e3, 3),
        "kubelet_update_work": not args.no_update_work,
        "down_applied_p50_ms": round(_impl.percentile(down_applied, 0.5) * 1e3, 3),
        "down_applied_p99_ms": round(_impl.percentile(down_applied, 0.99) * 1e3, 3),
        "down_applied_max_ms": round(max(down_applied) * 1e3, 3),
        "up_p50_ms": round(_impl.percentile(up_lat, 0.5) * 1e3, 3),
        "up_p99_ms": round(_impl.percentile(up_lat, 0.99) * 1e3, 3),
        "hold_down_s": args.hold_down,
        "idle_s": args.idle,
        "idle_cpu_percent": round(100 * cpu / (wall1 - wall0), 3),
        "daemon_rss_after_flips_mib": round(rss_start, 1),
        "daemon_rss_after_idle_mib": round(rss_after, 1),
        "daemon_exit_code": code,
        "mean_down_ms": round(statistics.fmean(down_lat) * 1e3, 3),
        # Every sample, so a report can draw the distribution rather than two percentiles of it.
        "down_ms": [round(x * 1e3, 3) for x in down_lat],
        "up_ms": [round(x * 1e3, 3) for x in up_lat],
    }


def main() -> int:
    _impl.announce(__file__)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", action="store_true")
    p.add_argument("--pfs", type=int, default=64)
    p.add_argument("--vfs-per-pf", type=int, default=256)
    p.add_argument("--pools", type=int, default=16, help="pools the PFs are grouped into (1 ... --pfs)")
    p.add_argument("--flips", type=int, default=100)
    p.add_argument(
        "--no-update-work", action="store_true", help="the emulator skips the kubelet's per-update work"
    )
    p.add_argument("--idle", type=float, default=60.0)
    p.add_argument(
        "--hold-down", type=float, default=0.0, help="holdDownSeconds of the pools (0: time recovery too)"
    )
    p.add_argument("--coalesce-ms", type=float, default=2.0)
    p.add_argument(
        "--reconcile-seconds",
        type=float,
        default=60.0,
        help="the daemon's full-reconcile interval (default 60, as deployed; 3600: idle between reconciles)",
    )
    p.add_argument("--dir", default=None, help="where to build the simulated node (default: tmpfs if room)")
    args = p.parse_args()
    logging.basicConfig(level=logging.ERROR)  # the daemon's warnings per flip are the point, not news
    if args.quick:
        args.pfs, args.vfs_per_pf, args.flips, args.idle = 8, 64, 20, 3.0
        args.pools = min(args.pools, args.pfs)
    if os.geteuid() != 0 or shutil.which("ip") is None:
        print("bench_e2e: needs root and iproute2 (network namespaces); skipped", file=sys.stderr)
        return 0
    parent = args.dir or _impl.tmpfs_dir(devices=args.pfs * args.vfs_per_pf)
    with _impl.scratch("densedev-bench-", parent) as work, namespace("densedev-b") as ns:
        result = uvloop.run(measure(args, work, ns))
    if args.json:
        print(json.dumps(result))
    else:
        r = result
        print(
            f"e2e [{r['implementation']}] {r['devices']} devices in {r['pools']} pools: "
            f"start-up {r['startup_ms']} ms; PF down → kubelet ({r['vfs_per_pf']} VFs Unhealthy) "
            f"p50 {r['down_p50_ms']} ms p99 {r['down_p99_ms']} ms max {r['down_max_ms']} ms over "
            f"{r['flips']} flips; applied by the kubelet (set + fsynced checkpoint) p50 "
            f"{r['down_applied_p50_ms']} ms p99 {r['down_applied_p99_ms']} ms "
            f"max {r['down_applied_max_ms']} ms; "
            f"up p50 {r['up_p50_ms']} ms p99 {r['up_p99_ms']} ms "
            f"(hold-down {r['hold_down_s']} s); idle CPU {r['idle_cpu_percent']} % of a core over "
            f"{r['idle_s']} s; daemon RSS {r['daemon_rss_after_flips_mib']} / "
            f"{r['daemon_rss_after_idle_mib']} MiB; exit {r['daemon_exit_code']} on SIGTERM; "
            f"kubelet restart → all pools registered with full lists in "
            f"{r['kubelet_restart_to_all_registered_ms']} ms"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
