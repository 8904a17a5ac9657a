"""Starting and stopping the gRPC servers on unix sockets, for the device-plugin and DRA APIs alike."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat
import weakref
from collections.abc import Sequence
from pathlib import Path

import grpc

from .. import files
from .sockets import MAX_UNIX_PATH
from .wire import KUBELET_MAX_MESSAGE

log = logging.getLogger(__name__)

# The kubelet receives at most 4 MiB per message; sending more would only end the stream there, so
# the sender refuses it first.  Requests from the kubelet are small (device ID lists).
SERVER_OPTIONS = (
    ("grpc.max_send_message_length", KUBELET_MAX_MESSAGE),
    ("grpc.max_receive_message_length", KUBELET_MAX_MESSAGE),
    ("grpc.so_reuseport", 0),
)

_LIFECYCLE_LOCKS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = (
    weakref.WeakKeyDictionary()
)


def _lifecycle_lock() -> asyncio.Lock:
    """One lock per event loop that every server start and stop takes, one at a time.

    After a kubelet restart every pool replaces its server at the same moment.  grpc.aio servers
    started while others on the same loop are shutting down were seen to have their start cancelled
    (CancelledError out of ``AioServer.start``, then InvalidStateError from its shutdown) and never
    come up; taking turns costs a millisecond per pool.
    """
    loop = asyncio.get_running_loop()
    lock = _LIFECYCLE_LOCKS.get(loop)
    if lock is None:
        lock = _LIFECYCLE_LOCKS[loop] = asyncio.Lock()
    return lock


Identity = tuple[int, int, int]


def _identify(path: Path) -> Identity | None:
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return st.st_dev, st.st_ino, st.st_ctime_ns


class UnixServer:
    """One grpc.aio server on one unix socket (mode 0600 whatever the umask), removed on stop."""

    def __init__(self, label: str, path: Path, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self.label = label
        self.path = Path(path)
        self._handlers = tuple(handlers)
        self._server: grpc.aio.Server | None = None
        self.identity: Identity | None = None

    @property
    def intact(self) -> bool:
        """Whether we serve and the path is still the socket we bound (not deleted, not replaced)."""
        return (
            self._server is not None and self.identity is not None and _identify(self.path) == self.identity
        )

    async def start(self) -> None:
        """Remove a stale socket, bind, restrict the mode and serve."""
        if len(os.fsencode(self.path)) > MAX_UNIX_PATH:
            raise OSError(f"{self.label}: socket path {self.path} exceeds {MAX_UNIX_PATH} bytes (sun_path)")
        async with _lifecycle_lock():
            files.ensure_dir(self.path.parent)
            _remove_socket(self.path)
            server = grpc.aio.server(options=SERVER_OPTIONS)
            server.add_generic_rpc_handlers(self._handlers)
            try:
                # gRPC binds inside add_insecure_port with the process umask: narrow it for that call.
                old_umask = os.umask(0o777 & ~files.SOCKET_MODE)
                try:
                    port = server.add_insecure_port(f"unix:{self.path}")
                finally:
                    os.umask(old_umask)
                if port == 0:
                    raise OSError(f"{self.label}: cannot listen on {self.path}")
                _restrict_socket(self.path)
                await server.start()
            except BaseException:
                await server.stop(None)
                raise
            self._server = server
            self.identity = _identify(self.path)
        log.info("%s: serving on %s", self.label, self.path)

    async def stop(self, grace: float | None = 0.5) -> None:
        """Stop serving and remove the socket if it is still the one we bound."""
        server, self._server = self._server, None
        if server is None:
            return
        async with _lifecycle_lock():
            await server.stop(grace)
        if self.identity is not None and _identify(self.path) == self.identity:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        self.identity = None
        log.info("%s: stopped serving on %s", self.label, self.path)


def _restrict_socket(path: Path) -> None:
    """Give the socket we just bound mode 0600; refuse if the path is not a socket (planted meanwhile)."""
    st = os.lstat(path)
    if not stat.S_ISSOCK(st.st_mode):
        raise OSError(f"{path} is not the socket we bound; refusing to serve on it")
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
