"""Benchmark ResourceSlice publishing under two API-server faults, against the in-process stand-in.

The publisher runs with its defaults (real clock, 0.5-30 s backoff, 10 s write timeout) except the
per-slice rate limit, set to 0 so that every event is written at once.  For each fault it prints:

  * **hung write**: the stand-in takes slice A's write and never answers it; each event then changes
    slice B (a PF's VF going down or up) and the figure is the time until B's new state is stored, over
    ``--events`` events (before issue 23 the publishing pass waited out the 30 s request timeout);
  * **conflicts**: every write to slice A is answered 409 for ``--seconds`` of real time; the figure is
    how many writes of A reached the stand-in (before issue 23: ~217 a second, no backoff).

    PYTHONPATH=src python bench/bench_dra_faults.py [--events 5] [--seconds 10] [--json] [--dir /dev/shm]
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
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
from densedev.testing.apiserver import ApiServerStandIn

NODE = "bench-node"
EVENT_BOUND_S = 45.0  # longer than any request timeout the publisher ever had (30 s)


def _holder(srv: ApiServerStandIn, device: str) -> str | None:
    """The slice holding ``device`` at the stand-in, or None when it is withdrawn."""
    for s in srv.node_slices(NODE):
        if any(d["name"] == device for d in s["spec"]["devices"]):
            return str(s["metadata"]["name"])
    return None


async def _until(cond: Callable[[], bool], bound: float) -> float:
    """Seconds until ``cond()`` holds (polled every ms), or ``bound`` when it never does."""
    t0 = time.perf_counter()
    while not cond():
        if time.perf_counter() - t0 > bound:
            return bound
        await asyncio.sleep(0.001)
    return time.perf_counter() - t0


async def run(events: int, seconds: float, work: Path) -> dict[str, object]:
    layout = simnode.build_node(work / "node", pfs=4, vfs_per_pf=256)
    cfg = config.parse(json.dumps({"resourceList": [{"resourceName": "vfs", "api": "dra"}]}))
    pools = slices.dra_pools(selectors.build_pools(cfg, discovery.scan(layout.root).devices))
    out: dict[str, object] = {"bench": "dra_faults", "devices": sum(len(p.members) for p in pools)}
    async with ApiServerStandIn(validate=False) as srv:
        srv.add_node(NODE)
        client = ResourceClient.for_url(srv.url)
        settings = PublisherSettings(NODE, names.DEFAULT_DRIVER_NAME, min_write_interval_s=0.0)
        pub = Publisher(client, settings, pools)
        await pub.start()
        try:
            await pub.wait_idle()
            a_vf, b_vf = layout.pfs[0].vf_addresses[0], layout.pfs[1].vf_addresses[0]
            a_dev, b_dev = names.device_name(a_vf), names.device_name(b_vf)
            a = _holder(srv, a_dev)
            assert a is not None

            # Hung write: A's write held; B toggled, each change timed until stored.
            srv.hang_writes = {a}
            pub.update(unhealthy={a_vf})
            await _until(lambda: srv.hung[a] >= 1, EVENT_BOUND_S)
            latencies = []
            for k in range(events):
                down = k % 2 == 0
                pub.update(unhealthy={a_vf, b_vf} if down else {a_vf})
                latencies.append(
                    await _until(lambda d=down: (_holder(srv, b_dev) is None) == d, EVENT_BOUND_S)
                )
            out["hung_events"] = events
            out["hung_b_p50_ms"] = round(statistics.median(latencies) * 1000, 2)
            out["hung_b_max_ms"] = round(max(latencies) * 1000, 2)
            srv.hang_writes = set()
            srv.release_hung()
            pub.update(unhealthy=())
            await asyncio.wait_for(pub.wait_idle(), 120)

            # Conflicts: every write of A answered 409 for ``seconds``.
            srv.conflict_writes = {a}
            before = srv.tries[a]
            pub.update(unhealthy={a_vf})
            await asyncio.sleep(seconds)
            out["conflict_seconds"] = seconds
            out["conflict_writes"] = srv.tries[a] - before
            srv.conflict_writes = set()
        finally:
            await pub.stop()
            await client.close()
    return out


def main() -> int:
    """Run both faults and print their figures."""
    p = _impl.arguments(__file__, __doc__, "2 hung-write events, 3 s of conflicts")
    p.add_argument("--events", type=int, default=5)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--dir", type=Path, default=None, help="where the simulated node goes (e.g. /dev/shm)")
    args = p.parse_args()
    if args.quick:
        args.events, args.seconds = 2, 3.0
    # tmpfs when there is room: the node's files on a loaded disk are most of the quick run, and untimed.
    with tempfile.TemporaryDirectory(dir=args.dir or _impl.tmpfs_dir(1 << 30)) as tmp:
        r = uvloop.run(run(args.events, args.seconds, Path(tmp)))
    if args.json:
        print(json.dumps(r))
        return 0
    print(
        f"{r['devices']} devices, slice A's write hung: slice B stored after p50 {r['hung_b_p50_ms']} ms, "
        f"max {r['hung_b_max_ms']} ms over {r['hung_events']} events"
    )
    print(
        f"slice A answered 409 on every write for {r['conflict_seconds']:g} s: "
        f"{r['conflict_writes']} writes of A reached the server"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
