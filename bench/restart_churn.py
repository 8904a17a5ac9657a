"""What a kubelet restart costs the pools: gRPC servers made and Registers sent per pool, and the time
until every pool is registered again with a live stream, with and without a pause after each wake-up.

    python bench/restart_churn.py [--pools 16] [--restarts 20] [--settle-ms 0,50] [--json]

The runners watch the kubelet's directory as the daemon's do (inotify) and the kubelet emulator restarts
as a kubelet does (every socket in the directory deleted, kubelet.sock listening again).  ``--settle-ms``
adds that pause after every wake-up, as PluginRunner did before issue 14 (50 ms): it shows what the
pause bought (servers and Registers per restart) and what it cost (time to re-register).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import logging
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SRC = Path(__file__).resolve().parents[1] / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

import grpc  # noqa: E402
import uvloop  # noqa: E402

from densedev._proto import api_pb2  # noqa: E402
from densedev.kubelet.feed import PoolFeed  # noqa: E402
from densedev.kubelet.registration import PluginRunner  # noqa: E402
from densedev.kubelet.wire import ListEncoder  # noqa: E402
from densedev.node.watch import DirectoryWatch  # noqa: E402
from densedev.testing.kubelet import KubeletEmulator  # noqa: E402

DEVICES = 8
GUARD = 30.0  # a hang guard, not a figure


class Pool:
    """The smallest PoolService: healthy devices, nothing refused."""

    def __init__(self, name: str, bus: int) -> None:
        self.ids = [f"0000:{bus:02x}:00.{i}" for i in range(DEVICES)]
        self.message = ListEncoder(self.ids, [0] * DEVICES, name=name).encode([True] * DEVICES)

    def options(self) -> tuple[bool, bool]:
        return False, False

    def allocate(self, ids: Sequence[str]) -> api_pb2.ContainerAllocateResponse:
        return api_pb2.ContainerAllocateResponse()

    def preferred(self, available: Sequence[str], must_include: Sequence[str], size: int) -> list[str]:
        return list(available)[:size]

    def prestart(self, ids: Sequence[str]) -> None:
        return None


async def measure(pools: int, restarts: int, settle: float) -> dict[str, Any]:
    counts: collections.Counter[str] = collections.Counter()
    real_server, real_register, real_pause = grpc.aio.server, PluginRunner._register_once, PluginRunner._pause

    def server(*args: Any, **kw: Any) -> Any:
        counts["servers"] += 1
        return real_server(*args, **kw)

    async def register(self: PluginRunner) -> tuple[str | None, bool]:
        counts["registers"] += 1
        return await real_register(self)

    async def pause(self: PluginRunner, at_most: float | None = None) -> None:
        await real_pause(self, at_most)
        await asyncio.sleep(settle)

    grpc.aio.server = server  # type: ignore[assignment]
    PluginRunner._register_once = register  # type: ignore[method-assign]
    if settle:
        PluginRunner._pause = pause  # type: ignore[method-assign]
    directory = Path(tempfile.mkdtemp(prefix="dd-", dir="/tmp"))
    watch = DirectoryWatch(directory)
    kubelet = KubeletEmulator(directory)
    names = [f"example.com/pool{i}" for i in range(pools)]
    try:
        if not watch.start():
            raise SystemExit("restart_churn: inotify is unavailable here; the runners would poll instead")
        await kubelet.start()
        services = [Pool(name, 0x10 + i) for i, name in enumerate(names)]
        runners = [
            PluginRunner(name, directory, f"pool{i}.sock", PoolFeed(s.message), s, watch=watch)
            for i, (name, s) in enumerate(zip(names, services, strict=True))
        ]
        await asyncio.gather(*(r.start() for r in runners))

        def registered(times: int) -> bool:
            return all(
                kubelet.registrations(n) >= times
                and not kubelet.stream_ended(n)
                and kubelet.allocatable(n) == DEVICES
                for n in names
            )

        await kubelet.wait_for(lambda: registered(1), GUARD)
        counts.clear()
        each: list[float] = []
        for n in range(2, restarts + 2):
            started = time.perf_counter()
            await kubelet.restart()
            await kubelet.wait_for(lambda n=n: registered(n), GUARD)  # type: ignore[misc]
            each.append(time.perf_counter() - started)
        await asyncio.gather(*(r.stop() for r in runners))
    finally:
        grpc.aio.server, PluginRunner._register_once, PluginRunner._pause = (
            real_server,
            real_register,
            real_pause,
        )  # type: ignore[assignment,method-assign]
        await kubelet.stop()
        watch.close()
        shutil.rmtree(directory, ignore_errors=True)
    each.sort()
    per = pools * restarts
    return {
        "bench": "restart_churn",
        "pools": pools,
        "restarts": restarts,
        "settle_ms": round(settle * 1e3),
        "servers_per_pool_restart": round(counts["servers"] / per, 2),
        "registers_per_pool_restart": round(counts["registers"] / per, 2),
        "reregistered_ms_median": round(each[len(each) // 2] * 1e3, 1),
        "reregistered_ms_max": round(each[-1] * 1e3, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pools", type=int, default=16)
    parser.add_argument("--restarts", type=int, default=20)
    parser.add_argument("--settle-ms", default="0,50", help="pauses to compare, comma-separated")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)  # each restart logs a line per pool: the figures would drown
    for settle_ms in (float(x) for x in args.settle_ms.split(",")):
        result = uvloop.run(measure(args.pools, args.restarts, settle_ms / 1e3))
        if args.json:
            print(json.dumps(result), flush=True)
        else:
            r = result
            print(
                f"pause {r['settle_ms']:3d} ms after a wake-up: {r['servers_per_pool_restart']:.2f} servers"
                f" and {r['registers_per_pool_restart']:.2f} Registers per pool per restart; every pool"
                f" registered again in {r['reregistered_ms_median']:.0f} ms (median of {args.restarts},"
                f" max {r['reregistered_ms_max']:.0f} ms)",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
