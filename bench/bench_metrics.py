"""Benchmark what metrics cost the daemon: per-call overhead on the hot paths and a scrape's cost.

  * ``record_send``: called once per ListAndWatch message (per pool per coalescing window);
  * ``set_pool_devices``: once per pool update, with a handful of reasons;
  * ``observe_allocate``: once per Allocate;
  * ``render``: building the exposition for N pools (runs on the daemon's event loop at each scrape);
  * ``scrape``: a full HTTP GET /metrics over loopback against ``MetricsServer`` on uvloop.

Metrics have no Cython path, so there is no extension/twin ratio here; the figure that matters is the
share of the event loop a scrape takes.

    PYTHONPATH=src python bench/bench_metrics.py [--quick] [--json] [--pools N]
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import _impl

from densedev.ops.metrics import Metrics, MetricsServer


def per_call(fn: Callable[[int], object], calls: int, repeat: int) -> float:
    """Return the median seconds per call over ``repeat`` batches of ``calls`` calls."""
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        for i in range(calls):
            fn(i)
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


def filled(pools: int) -> tuple[Metrics, list[str]]:
    """Return metrics with every series a busy node of ``pools`` pools would have."""
    m = Metrics()
    names = [f"intel.com/pool_{i}" for i in range(pools)]
    for name in names:
        m.set_pool_devices(name, 250, 6, {"pf_link_down": 4, "driver": 2})
        m.record_transitions(name, 6, 2)
        m.record_registration(name, True)
        for k in range(20):
            m.record_send(name, 12_000, 0.0001 * (k + 1), events=k + 1)
            m.observe_allocate(name, 0.0003)
            m.observe_preferred(name, 0.0008)
    m.observe_scan(0.02, devices=16384)
    for source in ("link", "uevent"):
        m.record_netlink(source, 100)
    return m, names


async def scrape_times(m: Metrics, repeat: int) -> tuple[float, float]:
    """Return the median seconds of a GET /metrics over loopback and the worst loop stall meanwhile."""
    # Every scrape renders (no kept body): the figure is a render's cost as a scrape sees it.
    server = MetricsServer(m, lambda: (True, "ok"), "127.0.0.1", 0, min_render_interval_s=0)
    await server.start()
    samples = []
    loop = asyncio.get_running_loop()
    worst = [0.0]

    async def ticker() -> None:
        # What a ListAndWatch send waiting on the loop sees: how late a 1 ms timer fires.
        while True:
            due = loop.time() + 0.001
            await asyncio.sleep(0.001)
            worst[0] = max(worst[0], loop.time() - due)

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    try:
        for _ in range(repeat):
            start = time.perf_counter()
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            body = await reader.read()
            samples.append(time.perf_counter() - start)
            writer.close()
            await writer.wait_closed()
            assert body.startswith(b"HTTP/1.1 200 OK"), body[:40]
    finally:
        tick.cancel()
        await server.stop()
    return statistics.median(samples), worst[0]


def main() -> int:
    """Run the benchmark and print figures (or JSON)."""
    parser = _impl.arguments(__file__, __doc__, "fewer repetitions (a smoke run)")
    parser.add_argument("--pools", type=int, default=64)
    args = parser.parse_args()
    repeat, calls = (3, 2000) if args.quick else (15, 20000)

    m, names = filled(args.pools)
    n = len(names)
    body = m.render()
    results: dict[str, object] = {
        "pools": args.pools,
        "record_send_s": per_call(lambda i: m.record_send(names[i % n], 12_000, 0.0004, 3), calls, repeat),
        "set_pool_devices_s": per_call(
            lambda i: m.set_pool_devices(names[i % n], 250, 6, {"pf_link_down": 4, "driver": 2}),
            calls,
            repeat,
        ),
        "observe_allocate_s": per_call(lambda i: m.observe_allocate(names[i % n], 0.0003), calls, repeat),
        "render_s": _impl.timed(m.render, repeat),
        "exposition_bytes": len(body),
    }
    results["scrape_s"], results["loop_stall_s"] = uvloop.run(scrape_times(m, repeat))
    if args.json:
        print(json.dumps(results))
        return 0
    print(f"metrics with {args.pools} pools ({len(body):,} bytes of exposition)")
    print(f"  record_send        {results['record_send_s'] * 1e6:8.2f} µs/call")
    print(f"  set_pool_devices   {results['set_pool_devices_s'] * 1e6:8.2f} µs/call")
    print(f"  observe_allocate   {results['observe_allocate_s'] * 1e6:8.2f} µs/call")
    print(f"  render             {results['render_s'] * 1e3:8.2f} ms")
    print(f"  HTTP scrape        {results['scrape_s'] * 1e3:8.2f} ms (loopback, uvloop)")
    print(f"  worst loop stall   {results['loop_stall_s'] * 1e3:8.2f} ms during scrapes (rendered off-loop)")
    print("  extension/python   n/a (metrics have no Cython path)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
