"""PF flip → kubelet while ``/metrics`` is flooded: p99 idle, then with N clients looping on the endpoint.

``densedev run`` runs as its own process with ``--metrics-addr 127.0.0.1:<port>`` on a simulated node
whose PF netdevs are real veth links in a private network namespace (as bench_e2e); the kubelet emulator
runs here.  In one run:
  * idle: F flips of random PFs (down, then up), nothing else; the latency is from the RTM_NEWLINK
    request until the emulator received the message holding the PF's VFs in the new health;
  * flooded: a child process opens N clients on 127.0.0.1, each looping GET /metrics on a fresh
    connection (as a scraper does) until its deadline, its request budget or its stdin closing; while
    they run, F more flips, and a /healthz probe every 100 ms timed from here.
Printed: both p99s and their ratio (issue 23's target is at most 2), the clients' requests by answer
(200 / 503 / failed) and the probes' latency.  The traffic is loopback only and stops by itself.

``--src DIR`` runs the daemon from another tree's ``src`` for a before/after on old code, e.g. the
main branch before the scrape bounds (``git archive 9d8eb05 src | tar -x -C /tmp/old``).

Needs root (network namespaces).  ``--quick``: 8 PFs x 64 VFs, 10 flips per phase, 100 clients.

    PYTHONPATH=src python bench/bench_scrape.py [--quick] [--json] [--clients 400] [--flips 50] [--src DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import resource
import shutil
import signal
import socket
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
from densedev.testing.kubelet import HEALTHY, UNHEALTHY, KubeletEmulator
from densedev.testing.netns import LinkSwitch, namespace

REQUEST = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: bench_scrape\r\n\r\n"


# --------------------------------------------------------------------------------------- the clients


async def flood(port: int, clients: int, seconds: float, budget: int) -> dict[str, float]:
    """Run ``clients`` loops of GET /metrics until ``seconds`` pass, ``budget`` requests were made or
    stdin closes; return the requests by outcome."""
    loop = asyncio.get_running_loop()
    began = loop.time()
    deadline = began + seconds
    counts = {"200": 0, "503": 0, "other": 0, "failed": 0}
    made = 0
    stop = asyncio.Event()
    # The parent closes our stdin when its flips are done; EOF (or the deadline) ends every loop.
    loop.add_reader(sys.stdin.fileno(), stop.set)

    async def client() -> None:
        nonlocal made
        while not stop.is_set() and loop.time() < deadline and made < budget:
            made += 1
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5)
                try:
                    writer.write(REQUEST)
                    answer = await asyncio.wait_for(reader.read(), 10)
                finally:
                    writer.close()
            except (OSError, TimeoutError):
                counts["failed"] += 1
                await asyncio.sleep(0.01)  # a refused or reset connect: do not spin on it
                continue
            status = answer[9:12].decode("latin-1", "replace")
            counts[status if status in counts else "failed" if not answer else "other"] += 1

    await asyncio.gather(*(client() for _ in range(clients)))
    loop.remove_reader(sys.stdin.fileno())
    return {**counts, "seconds": round(loop.time() - began, 3)}


def child(args: argparse.Namespace) -> int:
    """The client process: its figures as one JSON line on stdout."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < args.clients + 64:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, args.clients + 64), hard))
    counts = uvloop.run(flood(args.port, args.clients, args.seconds, args.budget))
    print(json.dumps(counts), flush=True)
    return 0


# --------------------------------------------------------------------------------------- the bench


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def probe(port: int) -> tuple[float, int]:
    """Time one GET /healthz; return seconds and status (0: failed)."""
    t0 = time.monotonic()
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 10)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        status = int(answer[9:12]) if answer[9:12].isdigit() else 0
    except (OSError, TimeoutError):
        status = 0
    return time.monotonic() - t0, status


async def measure(args: argparse.Namespace, work: Path, ns: str) -> dict[str, object]:
    sysfs = work / "sys"
    layout = simnode.build_node(sysfs, pfs=args.pfs, vfs_per_pf=args.vfs_per_pf, numa_nodes=2)
    _impl.veth_pfs(ns, [pf.netdev for pf in layout.pfs])
    per_pool = max(1, args.pfs // 16)
    groups = [layout.pfs[i : i + per_pool] for i in range(0, len(layout.pfs), per_pool)]
    doc = {
        "resourceList": [
            {
                "resourceName": f"vfs_{n}",
                "selectors": {"pfNames": [pf.netdev for pf in group]},
                "healthPolicy": {"holdDownSeconds": 0},
            }
            for n, group in enumerate(groups)
        ],
        "reconcileSeconds": 3600,  # no full reconcile scan inside either phase
    }
    (work / "config.json").write_text(json.dumps(doc))
    cfg = config_mod.load(work / "config.json")
    names = [p.full_name for p in cfg.pools]
    pool_of = {pf.netdev: f"intel.com/vfs_{n}" for n, g in enumerate(groups) for pf in g}
    kubelet_dir = Path(tempfile.mkdtemp(prefix="dd-", dir="/tmp"))
    emu = KubeletEmulator(kubelet_dir)
    await emu.start()
    port = free_port()
    src = Path(args.src) if args.src else _impl.SRC
    argv = _impl.daemon_argv(work / "config.json", sysfs, kubelet_dir, work / "dev", ns, src=src)
    daemon = subprocess.Popen([*argv, "--metrics-addr", f"127.0.0.1:{port}"], env=_impl.daemon_env(src=src))
    switch = LinkSwitch(ns)
    rng = random.Random(7)

    async def flips(count: int) -> list[float]:
        latencies: list[float] = []
        for _ in range(count):
            pf = rng.choice(layout.pfs)
            res = pool_of[pf.netdev]
            for up in (False, True):
                want = HEALTHY if up else UNHEALTHY

                def arrived(r: str = res, p: simnode.SimPF = pf, w: str = want) -> bool:
                    devs = emu.devices(r)
                    return all(devs.get(a) == w for a in p.vf_addresses)

                await asyncio.sleep(args.gap)  # flips spread over seconds: renders run once a second
                t0 = time.monotonic()
                switch.set(pf.netdev, up)
                await emu.wait_for(arrived, 60)
                # The first message that shows them all in the new health is the one waited for.
                upd = next(u for u in emu.updates(res) if u.received >= t0 and _all(u.devices, pf, want))
                latencies.append(upd.received - t0)
        return latencies

    clients = None
    try:
        await emu.wait_for(lambda: all(emu.updates(n) for n in names), 120)
        await _impl.past_catch_up()
        idle = await flips(args.flips)
        clients = subprocess.Popen(
            [
                sys.executable, __file__, "--child", "--port", str(port), "--clients", str(args.clients),
                "--seconds", str(args.max_seconds), "--budget", str(args.budget),
            ],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(_impl.SRC)},
        )  # fmt: skip
        await asyncio.sleep(args.ramp)  # every client connected and looping before the first flip
        probes: list[tuple[float, int]] = []

        async def probing() -> None:
            while True:
                probes.append(await probe(port))
                await asyncio.sleep(0.1)

        prober = asyncio.ensure_future(probing())
        t_flood = time.monotonic()
        cpu0, kids0 = _impl.cpu_seconds(daemon.pid), _impl.cpu_seconds(clients.pid)
        try:
            flooded = await flips(args.flips)
        finally:
            prober.cancel()
        flood_s = time.monotonic() - t_flood
        daemon_cpu = (_impl.cpu_seconds(daemon.pid) - cpu0) / flood_s
        clients_cpu = (_impl.cpu_seconds(clients.pid) - kids0) / flood_s
        # Closing their stdin (communicate does) stops the clients at their next request.
        out, _ = await asyncio.to_thread(clients.communicate, b"", 60)
        counts = json.loads(out.decode().strip().splitlines()[-1])
        client_s = counts.pop("seconds")
        alive = daemon.poll() is None
    finally:
        if clients is not None and clients.poll() is None:
            clients.kill()
        switch.close()
        daemon.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(daemon.wait, 30)
        await emu.stop()
        shutil.rmtree(kubelet_dir, ignore_errors=True)
    idle_p99 = _impl.percentile(idle, 0.99)
    flooded_p99 = _impl.percentile(flooded, 0.99)
    ok_probes = [s for s, status in probes if status == 200]
    return {
        "implementation": accel.IMPLEMENTATION,
        "daemon_src": str(src),
        "devices": sum(len(pf.vf_addresses) for pf in layout.pfs),
        "pools": len(names),
        "clients": args.clients,
        "flips_per_phase": args.flips,
        "idle_p50_ms": round(_impl.percentile(idle, 0.5) * 1e3, 2),
        "idle_p99_ms": round(idle_p99 * 1e3, 2),
        "flooded_p50_ms": round(_impl.percentile(flooded, 0.5) * 1e3, 2),
        "flooded_p99_ms": round(flooded_p99 * 1e3, 2),
        "flooded_max_ms": round(max(flooded) * 1e3, 2),
        "p99_ratio": round(flooded_p99 / idle_p99, 2),
        "flood_s": round(flood_s, 2),
        "daemon_cpu_percent_flooded": round(100 * daemon_cpu, 1),
        "clients_cpu_percent": round(100 * clients_cpu, 1),
        "scrapes": counts,
        "scrapes_per_s": round(sum(counts.values()) / client_s, 1),
        "healthz_probes": len(probes),
        "healthz_ok": len(ok_probes),
        "healthz_p50_ms": round(_impl.percentile(ok_probes, 0.5) * 1e3, 2) if ok_probes else None,
        "healthz_max_ms": round(max(s for s, _ in probes) * 1e3, 2) if probes else None,
        "daemon_alive_after": alive,
        "daemon_exit_code": code,
    }


def _all(devices: dict[str, str], pf: simnode.SimPF, want: str) -> bool:
    return all(devices.get(a) == want for a in pf.vf_addresses)


def main() -> int:
    _impl.announce(__file__)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", action="store_true")
    p.add_argument("--pfs", type=int, default=16)
    p.add_argument("--vfs-per-pf", type=int, default=64)
    p.add_argument("--flips", type=int, default=50, help="flips (down and up) per phase")
    p.add_argument("--clients", type=int, default=400, help="concurrent clients looping on /metrics")
    p.add_argument("--max-seconds", type=float, default=120.0, help="the clients' own deadline")
    p.add_argument("--budget", type=int, default=2_000_000, help="the clients' total requests at most")
    p.add_argument("--gap", type=float, default=0.05, help="seconds between flips")
    p.add_argument("--ramp", type=float, default=1.0, help="seconds of flood before the first flip")
    p.add_argument("--src", default=None, help="run the daemon from this tree's src (before/after)")
    p.add_argument("--dir", default=None, help="where to build the simulated node (default: tmpfs if room)")
    # The client process (started by the bench itself).
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--seconds", type=float, default=0.0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    logging.basicConfig(level=logging.ERROR)
    if args.quick:
        args.pfs, args.vfs_per_pf, args.flips, args.clients, args.ramp = 8, 64, 10, 100, 0.5
    if os.geteuid() != 0 or shutil.which("ip") is None:
        print("bench_scrape: needs root and iproute2 (network namespaces); skipped", file=sys.stderr)
        return 0
    parent = args.dir or _impl.tmpfs_dir(1 << 30)
    with _impl.scratch("densedev-bench-", parent) as work, namespace("densedev-s") as ns:
        result = uvloop.run(measure(args, work, ns))
    if args.json:
        print(json.dumps(result))
    else:
        r = result
        c = r["scrapes"]
        assert isinstance(c, dict)
        print(
            f"scrape [{r['implementation']}] {r['devices']} devices in {r['pools']} pools "
            f"(daemon from {r['daemon_src']}): PF flip → kubelet p99 idle {r['idle_p99_ms']} ms, with "
            f"{r['clients']} clients looping on /metrics {r['flooded_p99_ms']} ms: ratio "
            f"{r['p99_ratio']} (target ≤ 2); p50 {r['idle_p50_ms']} / {r['flooded_p50_ms']} ms, flooded max "
            f"{r['flooded_max_ms']} ms, {2 * r['flips_per_phase']} flips per phase (down and up)"  # type: ignore[operator]
        )
        print(
            f"  flooded phase {r['flood_s']} s, daemon CPU {r['daemon_cpu_percent_flooded']} % of a core, "
            f"clients' {r['clients_cpu_percent']} %; scrapes {r['scrapes_per_s']}/s; 200: {c['200']}, "
            f"503: {c['503']}, "
            f"other: {c['other']}, failed: {c['failed']}; /healthz every 100 ms: {r['healthz_ok']} of "
            f"{r['healthz_probes']} OK, p50 {r['healthz_p50_ms']} ms, max {r['healthz_max_ms']} ms; "
            f"daemon alive {r['daemon_alive_after']}, exit {r['daemon_exit_code']} on SIGTERM"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
