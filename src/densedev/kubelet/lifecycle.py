"""The one owner of every gRPC server start and stop on an event loop, for the device-plugin and DRA sockets.

Every bind, start, stop and socket-file removal runs in the owner's task, one at a time and in the
order asked.  Two grpc.aio behaviours make that necessary (docs/grpc-lifecycle.md, with the
reproduction in bench/repro_grpc_lifecycle.py):

* ``AioServer.start`` is not cancellation-safe.  It awaits a future that its serving task resolves one
  loop turn later; cancelling the caller meanwhile cancels that future, the serving task then dies of
  InvalidStateError, and ``stop`` raises InvalidStateError as well, in place of the CancelledError.  A
  pool's runner, stopped by a reload in the middle of a restart, would swallow its own cancellation
  that way and run on.  Here the caller's cancellation never reaches grpc: the owner finishes the
  start, and stops the server again when nobody waits for it any more.
* gRPC core unlinks a unix socket by *path*, not by inode: before it binds and when a listener goes
  (the posix event engine's acceptor destructor calls ``UnlinkIfUnixDomainSocket``).  A stop that
  overlaps a start on the same path removes the new, live server's socket file, and the kubelet can no
  longer dial it.  Here a stop has finished before any later start begins.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import logging
import os
import stat
import weakref
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import grpc

from .. import files
from ..files import FileIdentity, identify
from .sockets import MAX_UNIX_PATH
from .wire import KUBELET_MAX_MESSAGE

log = logging.getLogger(__name__)

T = TypeVar("T")

# The kubelet receives at most 4 MiB per message; sending more would only end the stream there, so
# the sender refuses it first.  Requests from the kubelet are small (device ID lists).
SERVER_OPTIONS = (
    ("grpc.max_send_message_length", KUBELET_MAX_MESSAGE),
    ("grpc.max_receive_message_length", KUBELET_MAX_MESSAGE),
    ("grpc.so_reuseport", 0),
)


class _Job(NamedTuple):
    """One start or stop for the owner to run, the future its caller awaits, and how to revert it."""

    run: Callable[[], Awaitable[Any]]
    done: asyncio.Future[Any]
    undo: Callable[[Any], Awaitable[object]] | None


class Lifecycle:
    """Runs the gRPC server starts and stops of one event loop in its own task, one at a time, in order."""

    def __init__(self) -> None:
        self._queue: collections.deque[_Job] = collections.deque()
        self._worker: asyncio.Task[None] | None = None

    async def run(
        self, job: Callable[[], Awaitable[T]], undo: Callable[[T], Awaitable[object]] | None = None
    ) -> T:
        """Run ``job`` after every job asked before it and return its result.

        A caller cancelled meanwhile stops waiting, but the job still runs to its end (an interrupted
        grpc.aio start or stop is what this class exists to prevent); ``undo`` then reverts a result
        that nobody takes.
        """
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()
        self._submit(_Job(job, done, undo))
        try:
            return await done
        except asyncio.CancelledError:
            # Cancelled after the job finished but before this task resumed: the result has no taker.
            if undo is not None and done.done() and not done.cancelled() and done.exception() is None:
                result = done.result()
                self._submit(_Job(lambda: undo(result), loop.create_future(), None))
            raise

    def _submit(self, job: _Job) -> None:
        self._queue.append(job)
        if self._worker is None:
            self._worker = asyncio.get_running_loop().create_task(self._drain(), name="grpc server lifecycle")

    async def _drain(self) -> None:
        try:
            while self._queue:
                job = self._queue.popleft()
                if job.undo is not None and job.done.cancelled():
                    continue  # a start whose caller has gone before it began: not made at all
                try:
                    result = await job.run()
                except Exception as exc:
                    if not job.done.done():
                        job.done.set_exception(exc)
                    else:  # its caller has gone: nobody else will say it
                        log.warning("a gRPC server start or stop nobody waits for failed: %s", exc)
                    continue
                except BaseException:
                    # The loop is closing (this task cancelled): no caller may wait for ever.
                    job.done.cancel()
                    raise
                if not job.done.done():
                    job.done.set_result(result)
                elif job.undo is not None:
                    try:
                        await job.undo(result)
                    except Exception:
                        log.exception("undoing a gRPC server start nobody waits for failed")
        finally:
            for job in self._queue:
                job.done.cancel()
            self._queue.clear()
            # Cleared with no await after the last look at the queue, so _submit starts a new worker
            # exactly when this one can take no more jobs.
            self._worker = None


_OWNERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Lifecycle] = weakref.WeakKeyDictionary()


def lifecycle() -> Lifecycle:
    """Return the running loop's one Lifecycle: every gRPC server of the loop starts and stops through it."""
    loop = asyncio.get_running_loop()
    owner = _OWNERS.get(loop)
    if owner is None:
        owner = _OWNERS[loop] = Lifecycle()
    return owner


def unary(fn: Callable[..., Any], request: Any, response: Any) -> grpc.RpcMethodHandler:
    """Return the handler of a unary method: ``fn`` answers a ``request`` message with a ``response``."""
    return grpc.unary_unary_rpc_method_handler(
        fn, request_deserializer=request.FromString, response_serializer=response.SerializeToString
    )


class SocketServer:
    """One grpc.aio server on one unix socket (mode 0600 whatever the umask), removed on stop.

    Its state changes only in the owner's task, in the order starts and stops were asked: a stop asked
    after a start stops what that start made, however the two callers interleave.
    """

    def __init__(self, label: str, path: Path, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self.label = label
        self.path = Path(path)
        self._handlers = tuple(handlers)
        self._server: grpc.aio.Server | None = None
        self.identity: FileIdentity | None = None  # of the socket we bound, to tell it from a new file

    @property
    def running(self) -> bool:
        """Whether the gRPC server is serving."""
        return self._server is not None

    @property
    def intact(self) -> bool:
        """Whether we serve and the path is still the socket we bound (not deleted, not replaced)."""
        return (
            self._server is not None
            and self.identity is not None
            and identify(self.path, follow_symlinks=False) == self.identity
        )

    async def start(self) -> None:
        """Remove a stale socket, bind, restrict the mode and serve; the server answers when this returns."""
        await lifecycle().run(self._bind, self._unwanted)

    async def stop(self, grace: float | None = 0.5) -> bool:
        """Stop serving (calls still open are cancelled after ``grace`` seconds) and remove our socket.

        Return whether a server was running.
        """
        return await lifecycle().run(lambda: self._stop(grace))

    async def _bind(self) -> grpc.aio.Server:
        """Run by the owner: bind and start a new server."""
        path = self.path
        if self._server is not None:
            raise RuntimeError(f"{self.label}: server already running on {path}")
        if len(os.fsencode(path)) > MAX_UNIX_PATH:
            raise OSError(f"{self.label}: socket path {path} exceeds {MAX_UNIX_PATH} bytes (sun_path)")
        files.ensure_dir(path.parent)
        _remove_socket(path)  # a stale socket from a previous run would make bind fail
        server = grpc.aio.server(options=SERVER_OPTIONS)
        server.add_generic_rpc_handlers(self._handlers)
        try:
            # gRPC binds the socket inside add_insecure_port, with the process umask: narrow it for that
            # call so the socket is never callable by other users (an umask of 000 made it 0777, and any
            # local user could Allocate), then set the mode explicitly as well.
            old_umask = os.umask(0o777 & ~files.SOCKET_MODE)
            try:
                port = server.add_insecure_port(f"unix:{path}")
            finally:
                os.umask(old_umask)
            if port == 0:
                raise OSError(f"{self.label}: cannot listen on unix:{path}")
            _restrict_socket(path)
            # The identity of the socket we bound, read before start: a kubelet restart may delete the
            # socket at any moment (its device manager removes every socket in the directory), and the
            # keeper must then see ours gone rather than this start fail half-done.
            identity = identify(path, follow_symlinks=False)
            if identity is None:
                raise FileNotFoundError(errno.ENOENT, "the socket was deleted as it was bound", str(path))
            await server.start()
        except BaseException:
            # Without an explicit stop, the half-made server's finaliser runs after the loop is gone.
            # Only the owner's own cancellation (the loop closing) can interrupt start here, and then
            # stop raises InvalidStateError: the first error is the one to report.
            with contextlib.suppress(Exception):
                await server.stop(None)
            raise
        self._server, self.identity = server, identity
        return server

    async def _unwanted(self, server: grpc.aio.Server) -> None:
        """Run by the owner: stop a server whose start nobody waits for, unless a stop took it already."""
        if self._server is server:
            await self._stop(None)

    async def _stop(self, grace: float | None) -> bool:
        """Run by the owner: stop our server and remove its socket if the path still holds it."""
        server, identity = self._server, self.identity
        if server is None:
            return False
        self._server = self.identity = None
        await server.stop(grace)
        # gRPC core has already unlinked whatever socket was at the path as its listener went; the
        # owner's order is what keeps that from being a newer server's.  Ours is removed here too, so
        # a stop leaves no socket whatever gRPC version runs.
        if identity is not None and identify(self.path, follow_symlinks=False) == identity:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        return True


def _restrict_socket(path: Path) -> None:
    """Give the socket we just bound mode 0600; refuse if the path is not a socket (planted meanwhile)."""
    st = os.lstat(path)
    if not stat.S_ISSOCK(st.st_mode):
        raise OSError(f"{path} is not the socket we bound; refusing to serve on it")
    # Only when the narrowed umask did not already give it: a chmod moves the ctime, and a watcher
    # that tells files apart by (inode, ctime), as the DRA kubelet emulator does, would take the
    # socket it saw a moment before for a different one and register the plugin twice.
    if stat.S_IMODE(st.st_mode) != files.SOCKET_MODE:
        os.chmod(path, files.SOCKET_MODE)


def _remove_socket(path: Path) -> None:
    """Remove a unix socket left at ``path``; refuse to remove anything that is not a socket."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise FileExistsError(f"{path} exists and is not a socket; not removing it")
    path.unlink(missing_ok=True)
