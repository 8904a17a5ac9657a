"""Overrun recovery: a stopped daemon, a real rtnetlink overrun, and the time until the kubelet is right.

``densedev run`` runs as its own process on a simulated node whose PF netdevs are real veth links in a
private network namespace (as bench_e2e).  Each cycle SIGSTOPs the daemon, floods the namespace with
link changes by ``ip -batch`` (flips of spare veths, then one PF flipped last), so the kernel drops
messages for the daemon's socket (ENOBUFS), and SIGCONTs it.  Measured per cycle: from SIGCONT until
the kubelet emulator holds that PF's VFs in the new health — the overrun seen, the socket reopened,
the dump read, health coalesced and sent.  The daemon's own metrics (``/metrics``) give the overruns,
reopenings and its resync duration (overrun → dump read).  A final ordinary flip shows events flow.

Needs root (network namespaces).  ``--quick``: 8 PFs x 64 VFs, 3 cycles, a 256 KiB buffer.

    PYTHONPATH=src python bench/bench_overrun.py [--quick] [--json] [--cycles 10] [--rcvbuf BYTES]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import _impl
import uvloop

from densedev import accel
from densedev.testing import simnode
from densedev.testing.kubelet import HEALTHY, UNHEALTHY, KubeletEmulator
from densedev.testing.netns import namespace


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> dict[str, float]:
    """Return the daemon's netlink samples by name and labels, e.g. ``overruns_total{source="link"}``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"densedev_netlink_(\S+) (\S+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def batch(ns: str, lines: list[str]) -> None:
    subprocess.run(["ip", "-n", ns, "-batch", "-"], input="".join(lines), text=True, check=True)


async def measure(args: argparse.Namespace, work: Path, ns: str) -> dict[str, object]:
    sysfs = work / "sys"
    layout = simnode.build_node(sysfs, pfs=args.pfs, vfs_per_pf=args.vfs_per_pf, numa_nodes=2)
    lines = [
        f"link add {pf.netdev} type veth peer name p{i}\nlink set p{i} up\nlink set {pf.netdev} up\n"
        for i, pf in enumerate(layout.pfs)
    ]
    lines += [f"link add fl{k} type veth peer name fl{k}p\n" for k in range(args.flood_links)]
    batch(ns, lines)
    per_pool = max(1, args.pfs // 16)
    groups = [layout.pfs[i : i + per_pool] for i in range(0, len(layout.pfs), per_pool)]
    doc = {
        "reconcileSeconds": 3600,
        "resourceList": [
            {
                "resourceName": f"vfs_{n}",
                "selectors": {"pfNames": [pf.netdev for pf in group]},
                "healthPolicy": {"holdDownSeconds": 0},
            }
            for n, group in enumerate(groups)
        ],
    }
    (work / "config.json").write_text(json.dumps(doc))
    pool_of = {pf.netdev: f"intel.com/vfs_{n}" for n, g in enumerate(groups) for pf in g}
    kubelet_dir = Path(tempfile.mkdtemp(prefix="dd-", dir="/tmp"))
    emu = KubeletEmulator(kubelet_dir)
    await emu.start()
    port = free_port()
    daemon = subprocess.Popen(
        [
            sys.executable, "-m", "densedev.cli", "run",
            "--config", str(work / "config.json"),
            "--sysfs-root", str(sysfs),
            "--kubelet-dir", str(kubelet_dir),
            "--dev-root", str(work / "dev"),
            "--devinfo-dir", "",
            "--netns", ns,
            "--netlink-rcvbuf", str(args.rcvbuf),
            "--metrics-addr", f"127.0.0.1:{port}",
            "--log-level", "error",
        ],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")},
    )  # fmt: skip
    recoveries: list[float] = []
    missed = 0  # cycles in which the kernel did not overrun the daemon's socket
    try:
        names = sorted(set(pool_of.values()))
        await emu.wait_for(lambda: all(emu.updates(n) for n in names), 120)
        await _impl.past_catch_up()
        flips = [
            f"link set fl{k} {'down' if j % 2 == 0 else 'up'}\n"
            for j in range(args.rounds)
            for k in range(args.flood_links)
        ]
        for cycle in range(args.cycles):
            pf = layout.pfs[cycle % len(layout.pfs)]
            res = pool_of[pf.netdev]
            before = (await asyncio.to_thread(scrape, port)).get('overruns_total{source="link"}', 0.0)
            daemon.send_signal(signal.SIGSTOP)
            batch(ns, [*flips, f"link set {pf.netdev} down\n"])
            t0 = time.monotonic()
            daemon.send_signal(signal.SIGCONT)

            def down(res: str = res, pf: simnode.SimPF = pf) -> bool:
                devs = emu.devices(res)
                return all(devs.get(a) == UNHEALTHY for a in pf.vf_addresses)

            await emu.wait_for(down, 60)
            recoveries.append(time.monotonic() - t0)
            after = (await asyncio.to_thread(scrape, port)).get('overruns_total{source="link"}', 0.0)
            missed += after == before
            batch(ns, [f"link set {pf.netdev} up\n"])

            def up(res: str = res, pf: simnode.SimPF = pf) -> bool:
                devs = emu.devices(res)
                return all(devs.get(a) == HEALTHY for a in pf.vf_addresses)

            await emu.wait_for(up, 60)
        metrics = await asyncio.to_thread(scrape, port)
    finally:
        daemon.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(daemon.wait, 30)
        await emu.stop()
        shutil.rmtree(kubelet_dir, ignore_errors=True)
    count = metrics.get('resync_seconds_count{source="link"}', 0.0)
    total = metrics.get('resync_seconds_sum{source="link"}', 0.0)
    return {
        "implementation": accel.IMPLEMENTATION,
        "devices": sum(len(pf.vf_addresses) for pf in layout.pfs),
        "pools": len(groups),
        "rcvbuf": args.rcvbuf,
        "flood_requests": len(flips) + 1,
        "cycles": args.cycles,
        "cycles_without_overrun": missed,
        "recovery_p50_ms": round(_impl.percentile(recoveries, 0.5) * 1e3, 1),
        "recovery_max_ms": round(max(recoveries) * 1e3, 1),
        "overruns": metrics.get('overruns_total{source="link"}', 0.0),
        "reopens": metrics.get('reopens_total{reason="overrun",source="link"}', 0.0),
        "daemon_resync_mean_ms": round(1e3 * total / count, 1) if count else None,
        "daemon_exit_code": code,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", action="store_true")
    p.add_argument("--pfs", type=int, default=64)
    p.add_argument("--vfs-per-pf", type=int, default=256)
    p.add_argument("--cycles", type=int, default=10)
    p.add_argument("--rcvbuf", type=int, default=8 << 20, help="the daemon's netlink buffer (default as run)")
    p.add_argument("--flood-links", type=int, default=64, help="spare veths flipped by the flood")
    p.add_argument("--rounds", type=int, default=200, help="flips of every spare veth per flood")
    p.add_argument("--dir", default=None, help="where to build the simulated node (default: tmpfs)")
    args = p.parse_args()
    logging.basicConfig(level=logging.ERROR)
    if args.quick:
        args.pfs, args.vfs_per_pf, args.cycles, args.rcvbuf, args.rounds = 8, 64, 3, 256 << 10, 20
    if os.geteuid() != 0 or shutil.which("ip") is None:
        print("bench_overrun: needs root and iproute2 (network namespaces); skipped", file=sys.stderr)
        return 0
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    with _impl.scratch("densedev-bench-", args.dir or shm) as work, namespace("densedev-o") as ns:
        result = uvloop.run(measure(args, work, ns))
    if args.json:
        print(json.dumps(result))
    else:
        r = result
        print(
            f"overrun [{r['implementation']}] {r['devices']} devices in {r['pools']} pools, netlink buffer "
            f"{r['rcvbuf']} B, {r['flood_requests']} link changes per flood while stopped: SIGCONT → "
            f"kubelet holds the PF's VFs Unhealthy p50 {r['recovery_p50_ms']} ms max "
            f"{r['recovery_max_ms']} ms over {r['cycles']} cycles ({r['cycles_without_overrun']} without "
            f"an overrun); overruns {r['overruns']:.0f}, reopenings {r['reopens']:.0f}, daemon's resync "
            f"(overrun → dump read) mean {r['daemon_resync_mean_ms']} ms; exit {r['daemon_exit_code']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
