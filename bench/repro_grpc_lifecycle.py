"""Reproduce what goes wrong when grpc.aio servers on unix sockets start and stop concurrently.

    python bench/repro_grpc_lifecycle.py [--servers 16] [--cycles 50] [--loop uvloop|asyncio] [--json]

Standalone on purpose (grpcio and uvloop only, no densedev), so it can go into a grpc issue as it is.
Three scenarios, each run with no guard, with one asyncio.Lock around every start and stop (densedev's
old fix), and with one owner task that runs every start and stop itself (densedev's design now):

  distinct   every server restarts on its own path, all at once, nobody cancelled: does concurrency
             alone hurt?  (It does not: 0 failures in every mode.)
  cancel     the same, but each restart's task is cancelled after 0-3 loop turns, as a pool's runner
             is when a reload or shutdown stops it mid-restart.  ``AioServer.start`` is not
             cancellation-safe: it awaits a future that its serving task later resolves, the caller's
             cancellation cancels that future, the serving task dies of InvalidStateError when it
             resolves it, and ``stop`` then raises InvalidStateError too (in place of the
             CancelledError, if called from the cancelled task's clean-up).
  overlap    a new server binds a path while the old one on that path is still stopping.  gRPC core
             unlinks the path when the old listener goes (the posix event engine's acceptor
             destructor calls UnlinkIfUnixDomainSocket by path, not by inode): the new, live server's
             socket file vanishes, and no client can dial it again.

Each line names the failures counted; ``--json`` prints one JSON document per scenario and mode.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import logging
import random
import socket
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import grpc
import uvloop

T = TypeVar("T")
OPTIONS = (("grpc.so_reuseport", 0),)


class Owner:
    """The design under test: one task per loop runs every start and stop, so none overlaps another and
    a caller's cancellation never reaches inside grpc (the operation finishes; a start nobody waits for
    any more is undone)."""

    def __init__(self) -> None:
        self._queue: collections.deque[tuple[Callable[[], Awaitable[Any]], asyncio.Future[Any], Any]] = (
            collections.deque()
        )
        self._worker: asyncio.Task[None] | None = None

    async def run(
        self, op: Callable[[], Awaitable[T]], undo: Callable[[T], Awaitable[Any]] | None = None
    ) -> T:
        """Queue ``op``; return its result.  ``undo`` reverts a result whose caller has gone."""
        done: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._submit(op, done, undo)
        try:
            return await done
        except asyncio.CancelledError:
            # Cancelled after the result was set but before this task resumed: nobody will use it.
            if undo is not None and done.done() and not done.cancelled() and done.exception() is None:
                result = done.result()
                self._submit(lambda: undo(result), asyncio.get_running_loop().create_future(), None)
            raise

    def _submit(self, op: Callable[[], Awaitable[Any]], done: asyncio.Future[Any], undo: Any) -> None:
        self._queue.append((op, done, undo))
        if self._worker is None or self._worker.done():
            self._worker = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        while self._queue:
            op, done, undo = self._queue.popleft()
            try:
                result = await op()
            except Exception as exc:
                if not done.done():
                    done.set_exception(exc)
                continue
            if done.done() and undo:  # the caller was cancelled meanwhile
                await undo(result)
            elif not done.done():
                done.set_result(result)


def make_handler() -> grpc.GenericRpcHandler:
    async def ping(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return b"pong"

    return grpc.method_handlers_generic_handler(
        "repro.Repro", {"Ping": grpc.unary_unary_rpc_method_handler(ping)}
    )


async def answers(path: Path) -> bool:
    """Whether a server answers a call on ``path`` now."""
    try:
        async with grpc.aio.insecure_channel(f"unix:{path}") as channel:
            await channel.unary_unary("/repro.Repro/Ping")(b"", timeout=5)
        return True
    except grpc.aio.AioRpcError:
        return False


def listening(path: Path) -> bool:
    """Whether anything accepts connections on ``path`` (a server that should be gone, if so)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        s.close()


class Scenario:
    """One scenario under one guard: servers, their paths, and what failed."""

    def __init__(self, root: Path, guard: str) -> None:
        self.root = root
        self.guard = guard
        self.lock = asyncio.Lock()
        self.owner = Owner()
        self.failures: collections.Counter[str] = collections.Counter()
        self.cycles = 0

    def fail(self, what: str, exc: BaseException | None = None) -> None:
        self.failures[what if exc is None else f"{what}: {type(exc).__name__}"] += 1

    async def guarded(
        self, op: Callable[[], Awaitable[T]], undo: Callable[[T], Awaitable[Any]] | None = None
    ) -> T:
        if self.guard == "lock":
            async with self.lock:
                return await op()
        if self.guard == "owner":
            return await self.owner.run(op, undo)
        return await op()

    async def start(self, path: Path) -> tuple[grpc.aio.Server, int]:
        async def op() -> tuple[grpc.aio.Server, int]:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()  # a stale socket, as every server here does before binding
            server = grpc.aio.server(options=OPTIONS)
            server.add_generic_rpc_handlers((make_handler(),))
            if server.add_insecure_port(f"unix:{path}") == 0:
                raise OSError(f"cannot bind {path}")
            inode = path.lstat().st_ino
            try:
                await server.start()
            except BaseException as exc:
                self.fail("start interrupted", exc)
                try:
                    await server.stop(None)  # without it the half-made server outlives the loop
                except BaseException as stop_exc:
                    self.fail("stop after an interrupted start raised", stop_exc)
                raise
            return server, inode

        async def undo(started: tuple[grpc.aio.Server, int]) -> None:
            await started[0].stop(None)

        return await self.guarded(op, undo)

    async def stop(self, server: grpc.aio.Server, grace: float | None) -> None:
        async def op() -> None:
            await server.stop(grace)

        await self.guarded(op)


async def distinct(sc: Scenario, servers: int, cycles: int) -> None:
    async def one(path: Path) -> None:
        for _ in range(cycles):
            try:
                server, _inode = await asyncio.wait_for(sc.start(path), 10)
            except BaseException as exc:
                sc.fail("start raised", exc)
                continue
            if not await answers(path):
                sc.fail("started server does not answer")
            try:
                await asyncio.wait_for(sc.stop(server, 0.1), 10)
            except BaseException as exc:
                sc.fail("stop raised", exc)
            sc.cycles += 1

    await asyncio.gather(*(one(sc.root / f"d{i}.sock") for i in range(servers)))


async def cancel(sc: Scenario, servers: int, cycles: int) -> None:
    rng = random.Random(1)

    async def one(path: Path) -> None:
        slot: list[grpc.aio.Server] = []

        async def restart() -> None:
            server, _inode = await sc.start(path)
            slot.append(server)

        for _ in range(cycles):
            task = asyncio.ensure_future(restart())
            for _ in range(rng.randrange(4)):
                await asyncio.sleep(0)
            # A pool's stop: cancel its task, then stop the server the task had started, if any.
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            except BaseException as exc:
                sc.fail("start raised", exc)
            for server in slot:
                try:
                    await sc.stop(server, None)
                except BaseException as exc:
                    sc.fail("stop raised", exc)
            slot.clear()
            sc.cycles += 1

    await asyncio.gather(*(one(sc.root / f"c{i}.sock") for i in range(servers)))
    if sc.guard == "owner":
        await sc.owner.run(lambda: asyncio.sleep(0))  # in order: every start cancelled before is undone
    await asyncio.sleep(0.05)
    # Every pool is stopped now: a path that still accepts connections belongs to a server whose stop
    # failed, so gRPC core never destroyed it.
    for i in range(servers):
        if listening(sc.root / f"c{i}.sock"):
            sc.fail("a stopped server still listens")


async def overlap(sc: Scenario, servers: int, cycles: int) -> None:
    async def one(path: Path) -> None:
        server, _inode = await sc.start(path)
        for _ in range(cycles):
            # The replacement is asked for while the old server is still stopping, as two owners of a
            # path (a runner stopping, its successor starting) would do without a common owner.
            stopping = asyncio.ensure_future(sc.stop(server, 0.1))
            await asyncio.sleep(0)
            try:
                server, inode = await sc.start(path)
            except BaseException as exc:
                sc.fail("start raised", exc)
                await stopping
                server, inode = await sc.start(path)
            await stopping
            await asyncio.sleep(0.002)
            try:
                intact = path.lstat().st_ino == inode
            except FileNotFoundError:
                intact = False
            if not intact:
                sc.fail("live server's socket file removed")
            elif not await answers(path):
                sc.fail("started server does not answer")
            sc.cycles += 1
        await sc.stop(server, None)

    await asyncio.gather(*(one(sc.root / f"o{i}.sock") for i in range(servers)))


SCENARIOS = {"distinct": distinct, "cancel": cancel, "overlap": overlap}


async def run(name: str, guard: str, servers: int, cycles: int) -> dict[str, Any]:
    errors: list[str] = []
    asyncio.get_running_loop().set_exception_handler(
        lambda _loop, ctx: errors.append(str(ctx.get("message")))
    )
    with tempfile.TemporaryDirectory(prefix="repro-grpc-") as tmp:
        sc = Scenario(Path(tmp), guard)
        started = time.monotonic()
        await SCENARIOS[name](sc, servers, cycles)
        elapsed = time.monotonic() - started
    failures = dict(sc.failures)
    if errors:
        failures["unhandled in the loop"] = len(errors)
    return {
        "scenario": name,
        "guard": guard,
        "servers": servers,
        "cycles": sc.cycles,
        "seconds": round(elapsed, 2),
        "failures": failures,
        "grpcio": grpc.__version__,
        "loop": type(asyncio.get_running_loop()).__module__,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", type=int, default=16)
    parser.add_argument("--cycles", type=int, default=50)
    parser.add_argument("--scenario", choices=[*SCENARIOS, "all"], default="all")
    parser.add_argument("--guard", choices=["none", "lock", "owner", "all"], default="all")
    parser.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.CRITICAL)  # grpc's own lines would bury the figures
    names = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    guards = ["none", "lock", "owner"] if args.guard == "all" else [args.guard]
    for name in names:
        for guard in guards:
            runner = uvloop.run if args.loop == "uvloop" else asyncio.run
            result = runner(run(name, guard, args.servers, args.cycles))
            if args.json:
                print(json.dumps(result), flush=True)
            else:
                found = ", ".join(f"{k} x{v}" for k, v in sorted(result["failures"].items())) or "none"
                print(
                    f"{name:9} guard={guard:5} {result['cycles']:5} cycles in {result['seconds']:5.2f} s"
                    f"  failures: {found}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
