"""Benchmark ResourceSlice publishing against the API-server stand-in, at 4,096 and 16,384 devices.

The stand-in runs as its own process (as an API server would: its work is not on the driver's loop);
the driver side is the production client and publisher on uvloop.  For each size it prints:

  * start → every slice at the stand-in: seconds from ``Publisher.start`` (API discovery, list, Node
    get, every create) until it is idle, and writes against slices (target ≤ 1 s at 4k, writes = slices);
  * PF down (its 256 VFs withdrawn) → slices written: writes per event (target ≤ 2) and latency from
    the update until the server acknowledged the last write, p50/p99 over ``--events`` PF-down events
    (target p99 ≤ 50 ms); the per-slice rate limit is kept out of this (a fake clock moves past it);
  * a PF flapping at 10 Hz for ``--flap-seconds`` with the default 1 s per-slice rate limit on the
    real clock: writes in all (unlimited it would be 2 per flip).

With ``--validate`` the stand-in also schema-checks every write, as the tests run it (that is the
stand-in's cost, not the driver's).

    PYTHONPATH=src python bench/bench_dra.py [--quick] [--json] [--validate] [--dir /dev/shm]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import _impl
import uvloop

from densedev.dra import names, slices
from densedev.dra.apiclient import ResourceClient
from densedev.dra.publisher import Publisher, PublisherSettings
from densedev.node import scanner as discovery
from densedev.pools import config
from densedev.pools import select as selectors
from densedev.testing import simnode

NODE = "bench-node"


class Clock:
    """A clock the benchmark moves past the rate limit before each PF-down event."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset


def start_stand_in(validate: bool) -> tuple[subprocess.Popen[str], str]:
    """Start ``python -m densedev.testing.apiserver`` and return it and its URL."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        x for x in (str(Path(__file__).resolve().parents[1] / "src"), env.get("PYTHONPATH", "")) if x
    )
    argv = [sys.executable, "-m", "densedev.testing.apiserver", "--node", NODE]
    if not validate:
        argv.append("--no-validate")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    url = proc.stdout.readline().strip()
    if not url.startswith("http://"):
        proc.kill()
        raise SystemExit(f"stand-in did not start: {url!r}")
    return proc, url


async def run_size(
    pfs: int, vfs_per_pf: int, events: int, flap_s: float, validate: bool, work: Path
) -> dict[str, object]:
    layout = simnode.build_node(work / f"node{pfs}x{vfs_per_pf}", pfs=pfs, vfs_per_pf=vfs_per_pf)
    cfg = config.parse(json.dumps({"resourceList": [{"resourceName": "vfs", "api": "dra"}]}))
    pools = slices.dra_pools(selectors.build_pools(cfg, discovery.scan(layout.root).devices))
    devices = sum(len(p.members) for p in pools)
    proc, url = start_stand_in(validate)
    client = ResourceClient.for_url(url)
    clock = Clock()
    pub = Publisher(client, PublisherSettings(NODE, names.DEFAULT_DRIVER_NAME), pools, clock=clock)
    try:
        t0 = time.perf_counter()
        await pub.start()
        await pub.wait_idle()
        start_s = time.perf_counter() - t0
        items, _ = await client.list_slices(f"spec.nodeName={NODE}")
        start_writes = pub.writes
        assert sum(len(s["spec"]["devices"]) for s in items) == devices

        latencies: list[float] = []
        writes_per_event: list[int] = []
        for k in range(events):
            pf = layout.pfs[k % len(layout.pfs)]
            for unhealthy in (set(pf.vf_addresses), set()):
                clock.offset += 10.0  # past the per-slice rate limit: measure the work, not the policy
                before = pub.writes
                t = time.perf_counter()
                pub.update(unhealthy=unhealthy)
                await pub.wait_idle()
                if unhealthy:
                    latencies.append(time.perf_counter() - t)
                    writes_per_event.append(pub.writes - before)

        flap_writes = 0
        if flap_s > 0:
            # The real clock now, with the default 1 s per-slice limit: a PF flapping at 10 Hz.
            clock.offset += 10.0
            pf = layout.pfs[0]
            before = pub.writes
            end = time.monotonic() + flap_s
            down = False
            while time.monotonic() < end:
                down = not down
                pub.update(unhealthy=set(pf.vf_addresses) if down else set())
                await asyncio.sleep(0.1)
            pub.update(unhealthy=set())
            clock.offset += 10.0
            pub.poke()
            await pub.wait_idle()
            flap_writes = pub.writes - before
    finally:
        await pub.stop()
        await client.close()
        proc.terminate()
        proc.wait()
    lat = sorted(latencies)
    p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else 0.0
    return {
        "bench": "dra",
        "devices": devices,
        "slices": len(items),
        "validate": validate,
        "start_s": round(start_s, 4),
        "start_writes": start_writes,
        "pf_down_events": len(lat),
        "pf_down_writes_max": max(writes_per_event, default=0),
        "pf_down_p50_ms": round(statistics.median(lat) * 1000, 2) if lat else None,
        "pf_down_p99_ms": round(p99 * 1000, 2),
        "flap_seconds": flap_s,
        "flap_flips": int(flap_s * 10),
        "flap_writes": flap_writes,
    }


def main() -> int:
    """Run the sizes and print their figures."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--quick", action="store_true", help="smoke run: 4,096 devices, few events, 2 s of flapping"
    )
    p.add_argument("--json", action="store_true")
    p.add_argument("--validate", action="store_true", help="the stand-in schema-checks every write")
    p.add_argument("--events", type=int, default=100)
    p.add_argument("--flap-seconds", type=float, default=60.0)
    p.add_argument("--dir", type=Path, default=None, help="where the simulated nodes go (e.g. /dev/shm)")
    args = p.parse_args()
    sizes = [(16, 256)] if args.quick else [(16, 256), (64, 256)]
    events = 10 if args.quick else args.events
    flap = 2.0 if args.quick else args.flap_seconds
    # tmpfs when there is room: writing 4,096 functions' files on a loaded disk took most of CI's quick
    # run here (318 s), none of it in the figures (the node is built before anything is timed).
    with tempfile.TemporaryDirectory(dir=args.dir or _impl.tmpfs_dir(1 << 30)) as tmp:
        for i, (pfs, vfs) in enumerate(sizes):
            r = uvloop.run(run_size(pfs, vfs, events, flap if i == 0 else 0.0, args.validate, Path(tmp)))
            if args.json:
                print(json.dumps(r))
                continue
            print(
                f"{r['devices']:>6} devices: start -> {r['slices']} slices in {r['start_s'] * 1000:.0f} ms, "
                f"{r['start_writes']} writes{' (stand-in validating)' if args.validate else ''}"
            )
            print(
                f"        PF down (256 VFs): <= {r['pf_down_writes_max']} slice writes; "
                f"p50 {r['pf_down_p50_ms']} ms, p99 {r['pf_down_p99_ms']} ms "
                f"over {r['pf_down_events']} events"
            )
            if r["flap_seconds"]:
                print(
                    f"        PF flapping at 10 Hz for {r['flap_seconds']:g} s ({r['flap_flips']} flips): "
                    f"{r['flap_writes']} slice writes (1 s per-slice limit)"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
