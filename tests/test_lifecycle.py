"""The one owner of gRPC server starts and stops: cancelled starts, overlapping stops, and a hammering.

The two grpc.aio behaviours it exists for (docs/grpc-lifecycle.md; bench/repro_grpc_lifecycle.py):
``AioServer.start`` is not cancellation-safe, and gRPC core unlinks a unix socket by path when a
listener goes.  Run against the old lock-based code, the cancelled start fails with InvalidStateError,
the stop asked after a start leaves a server running, and the hammering fails; the overlap test keeps
a stop and a start on one path from ever overlapping again (with no guard at all, about one start in
six lost its socket).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import socket
import stat
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import grpc
import pytest

from densedev.dra.registration import DraPlugin
from densedev.files import identify
from densedev.kubelet.lifecycle import SocketServer

GUARD = 10.0  # hang guards only: nothing here asserts on speed


def ping_handler(name: str) -> grpc.GenericRpcHandler:
    """A service answering ``/test.Ping/Who`` with ``name``: tells which server answered."""

    async def who(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return name.encode()

    return grpc.method_handlers_generic_handler(
        "test.Ping", {"Who": grpc.unary_unary_rpc_method_handler(who)}
    )


async def who(path: Path) -> str:
    """Ask the server on ``path`` who it is."""
    async with grpc.aio.insecure_channel(f"unix:{path}") as channel:
        call = channel.unary_unary("/test.Ping/Who")
        answer: bytes = await call(b"", timeout=GUARD)
        return answer.decode()


def listening(path: Path) -> bool:
    """Whether anything accepts a connection on ``path`` now."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        s.close()


def sockets_in(directory: Path) -> dict[Path, tuple[int, int, int] | None]:
    """Every socket file under ``directory`` with its identity."""
    found: dict[Path, tuple[int, int, int] | None] = {}
    for dirpath, _dirs, names in os.walk(directory):
        for name in names:
            path = Path(dirpath) / name
            if stat.S_ISSOCK(path.lstat().st_mode):
                found[path] = identify(path, follow_symlinks=False)
    return found


@pytest.mark.parametrize("turns", range(6))
async def test_a_start_cancelled_at_any_moment_ends_cancelled_and_leaves_nothing_behind(
    sock_dir: Path, turns: int
) -> None:
    # A pool's runner cancelled by a reload while it restarts its server.  Cancelled inside
    # AioServer.start (turns 1-2 here), the old code's clean-up stop raised InvalidStateError in place of
    # the CancelledError, so the task went on instead of ending.
    path = sock_dir / "p.sock"

    server = SocketServer("pool", path, (ping_handler("first"),))
    task = asyncio.ensure_future(server.start())
    for _ in range(turns):
        await asyncio.sleep(0)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    # Ended cancelled, or started before the cancel came: never anything else.
    assert task.cancelled() or (task.done() and task.exception() is None)
    # The next server on the path comes after whatever the owner did for the cancelled caller: a
    # start nobody waited for was undone before this one binds, so its socket stays this one's.
    second = SocketServer("pool", path, (ping_handler("second"),))
    await server.stop()
    await second.start()
    assert not server.running and second.intact
    assert await who(path) == "second"
    assert await second.stop()
    assert not path.exists() and not listening(path)


async def test_a_start_asked_while_the_path_is_still_stopping_keeps_its_socket(sock_dir: Path) -> None:
    # gRPC core unlinks the path by name as the old listener goes: without one owner running stops and
    # starts in order, about one in six of these starts lost its socket file (bench/repro_grpc_lifecycle.py).
    path = sock_dir / "p.sock"

    old = SocketServer("pool", path, (ping_handler("0"),))
    await old.start()
    for n in range(1, 41):
        new = SocketServer("pool", path, (ping_handler(str(n)),))
        stopping = asyncio.ensure_future(old.stop(0.1))
        await asyncio.sleep(0)
        await new.start()
        assert await stopping
        assert new.intact, f"cycle {n}: the new server's socket file was removed under it"
        assert await who(path) == str(n)
        old = new
    await old.stop()


async def test_a_stop_asked_after_a_start_stops_what_that_start_made(sock_dir: Path) -> None:
    # The caller of stop does not wait for the start to have returned to its own caller: the owner runs
    # both in the order asked, so nothing is left serving.
    path = sock_dir / "p.sock"

    server = SocketServer("pool", path, (ping_handler("x"),))
    starting = asyncio.ensure_future(server.start())
    await asyncio.sleep(0)  # the start is asked (its task ran up to the owner), not yet done
    assert not server.running
    assert await server.stop()
    await starting
    assert not server.running and not path.exists() and not listening(path)


POOLS = 16
ROUNDS = 1000


async def test_hammered_restarts_leave_every_server_answering_and_no_dead_socket(sock_dir: Path) -> None:
    # Many pools on one loop restarting at once from every side, as a node sees it: kubelet restarts
    # (every socket in the directory deleted, every pool serving afresh at the same moment), reloads
    # (pools stopped and started again), runners cancelled in the middle of a start and then stopped,
    # and the DRA driver re-creating its deleted sockets from its own keeper task.
    rng = random.Random(14)
    plugin_dir = sock_dir / "device-plugins"

    pools = [
        SocketServer(f"pool{i}", plugin_dir / f"p{i}.sock", (ping_handler(f"pool{i}"),)) for i in range(POOLS)
    ]
    dra = DraPlugin(
        "hammer.example.com",
        (ping_handler("dra"),),
        registry_dir=sock_dir / "registry",
        plugins_dir=sock_dir / "plugins",
        poll=0.005,
    )
    await dra.start()
    await asyncio.gather(*(p.start() for p in pools))

    async def restart(pool: SocketServer) -> None:  # a reload re-registering the pool
        await pool.stop(None)
        await pool.start()

    async def cancelled_start(pool: SocketServer) -> None:  # a runner stopped mid-restart
        await pool.stop(None)
        task = asyncio.ensure_future(pool.start())
        for _ in range(rng.randrange(4)):
            await asyncio.sleep(0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await pool.stop(None)  # the runner's stop after cancelling its task
        await pool.start()  # and the pool comes back with the next config

    async def kubelet_restart(busy: list[SocketServer]) -> None:
        for path in sockets_in(plugin_dir):
            path.unlink(missing_ok=True)
        # Every runner sees its socket gone and serves afresh, all at the same moment (a runner
        # busy restarting its pool already does: one task per pool, never two).
        await asyncio.gather(*(restart(p) for p in pools if p not in busy and not p.intact))

    kinds = 0
    for _round in range(ROUNDS):
        chosen = rng.sample(pools, rng.randrange(1, 6))
        work: list[Coroutine[Any, Any, None]] = []
        for pool in chosen:
            work.append(restart(pool) if rng.random() < 0.5 else cancelled_start(pool))
        if rng.random() < 0.2:
            work.append(kubelet_restart(chosen))
            kinds |= 1
        if rng.random() < 0.2:
            victim = rng.choice([dra.endpoint, dra.registration_socket])
            victim.unlink(missing_ok=True)  # the DRA keeper puts it back on its own
            kinds |= 2
        await asyncio.wait_for(asyncio.gather(*work), GUARD)
    assert kinds == 3

    # Every pool serves; the DRA keeper has put back whatever socket of it is missing.
    for pool in pools:
        if not pool.intact:
            await restart(pool)
    deadline = asyncio.get_running_loop().time() + GUARD
    while not (dra.endpoint.exists() and dra.registration_socket.exists()):
        assert asyncio.get_running_loop().time() < deadline, "the DRA sockets were not re-created"
        await asyncio.sleep(0.01)
    assert [await who(p.path) for p in pools] == [f"pool{i}" for i in range(POOLS)]
    assert await who(dra.endpoint) == "dra"
    # No socket file belongs to a dead server: exactly the live ones, each the file its server bound.
    live = {p.path: p.identity for p in pools}
    found = sockets_in(sock_dir)
    assert {k: v for k, v in found.items() if k.parent == plugin_dir} == live
    assert set(found) == {*live, dra.endpoint, dra.registration_socket}
    await dra.stop()
    assert all(await asyncio.gather(*(p.stop() for p in pools)))
    assert sockets_in(sock_dir) == {}
    assert not any(listening(p.path) for p in pools)
