"""One DevicePlugin gRPC server per pool, on its own unix socket in the kubelet's device-plugin dir."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat
import weakref
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn, Protocol

import grpc

from .. import files
from .._proto import api_pb2
from ..model import RequestError
from ..printable import clip
from .feed import PoolFeed
from .sockets import MAX_UNIX_PATH
from .wire import KUBELET_MAX_MESSAGE

log = logging.getLogger(__name__)

SERVICE = "v1beta1.DevicePlugin"

# The kubelet receives at most 4 MiB per message; sending more would only end the stream there, so
# the sender refuses it first.  Requests from the kubelet are small (device ID lists).
SERVER_OPTIONS = (
    ("grpc.max_send_message_length", KUBELET_MAX_MESSAGE),
    ("grpc.max_receive_message_length", KUBELET_MAX_MESSAGE),
    ("grpc.so_reuseport", 0),
)

# A status message travels in HTTP/2 trailers, which gRPC caps (grpc.max_metadata_size, 8 KiB by default;
# a peer seeing more ends the call with RESOURCE_EXHAUSTED instead of our code): stay far below.
MAX_STATUS_CHARS = 1000

_STATUS = {
    RequestError.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    RequestError.PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
}


def status_of(exc: RequestError) -> grpc.StatusCode:
    """Return the gRPC status a refused request is answered with."""
    return _STATUS.get(exc.kind, grpc.StatusCode.INVALID_ARGUMENT)


class PoolService(Protocol):
    """What a pool answers to the kubelet's unary calls (implemented by ``allocation``)."""

    def options(self) -> tuple[bool, bool]:
        """Return ``(pre_start_required, get_preferred_allocation_available)``."""
        ...

    def allocate(self, ids: Sequence[str]) -> api_pb2.ContainerAllocateResponse:
        """Return the container response for these IDs; raise ``RequestError`` to refuse."""
        ...

    def preferred(self, available: Sequence[str], must_include: Sequence[str], size: int) -> list[str]:
        """Return the preferred IDs for an allocation of ``size`` devices."""
        ...

    def prestart(self, ids: Sequence[str]) -> None:
        """Check the IDs before a container starts; raise ``RequestError`` to fail the start."""
        ...


def _identity(message: bytes) -> bytes:
    """Serialize an already encoded message: the feed holds wire bytes, re-encoding would waste them."""
    return message


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


class PluginServer:
    """Serves ``/v1beta1.DevicePlugin/*`` for one pool on ``socket_path``."""

    def __init__(self, resource: str, socket_path: Path, feed: PoolFeed, service: PoolService) -> None:
        self.resource = resource
        self.socket_path = Path(socket_path)
        self._feed = feed
        self._service = service
        self._server: grpc.aio.Server | None = None
        self._inode: files.FileIdentity | None = None
        self._stopping = asyncio.Event()
        self.streams = 0  # ListAndWatch streams open now
        self.streams_opened = 0  # ListAndWatch streams opened since start
        self.on_streams_changed: Callable[[], None] | None = None  # called as a stream opens or ends
        self._no_streams = asyncio.Event()
        self._no_streams.set()

    @property
    def running(self) -> bool:
        """Whether the gRPC server is serving."""
        return self._server is not None

    @property
    def socket_identity(self) -> files.FileIdentity | None:
        """The (device, inode, ctime ns) of the socket this server bound, to tell it from a new file."""
        return self._inode

    async def start(self) -> None:
        """Bind the socket and serve; the server is fully ready when this returns."""
        async with _lifecycle_lock():
            await self._start()

    async def _start(self) -> None:
        if self._server is not None:
            raise RuntimeError(f"{self.resource}: server already running on {self.socket_path}")
        files.ensure_dir(self.socket_path.parent)
        _remove_socket(self.socket_path)  # a stale socket from a previous run would make bind fail
        server = grpc.aio.server(options=SERVER_OPTIONS)
        server.add_generic_rpc_handlers((self._handler(),))
        address = f"unix:{self.socket_path}"
        if len(os.fsencode(self.socket_path)) > MAX_UNIX_PATH:
            raise OSError(
                f"{self.resource}: socket path {self.socket_path} exceeds {MAX_UNIX_PATH} bytes (sun_path)"
            )
        try:
            # gRPC binds the socket inside add_insecure_port, with the process umask: narrow it for that
            # call so the socket is never callable by other users (an umask of 000 made it 0777, and any
            # local user could Allocate), then set the mode explicitly as well.
            old_umask = os.umask(0o777 & ~files.SOCKET_MODE)
            try:
                port = server.add_insecure_port(address)
            finally:
                os.umask(old_umask)
            if port == 0:
                raise OSError(f"{self.resource}: cannot listen on {address}")
            _restrict_socket(self.socket_path)
            # The identity of the socket we bound, read before start: a kubelet restart may delete the
            # socket at any moment (its device manager removes every socket in the directory), and
            # the registration loop must then see ours gone rather than this start fail half-done.
            # ctime too: on ext4 a deleted socket's inode number is soon reused by the next one.
            st = os.lstat(self.socket_path)
            await server.start()
        except BaseException:
            # Without an explicit stop, the half-made server's finaliser runs after the loop is gone.
            await server.stop(None)
            raise
        self._stopping = asyncio.Event()
        self._server = server
        self._inode = files.identity_of(st)
        log.info("%s: serving DevicePlugin on %s", self.resource, self.socket_path)

    async def stop(self, grace: float = 0.5) -> None:
        """Stop serving (open streams are cancelled after ``grace`` seconds) and remove our socket."""
        server, self._server = self._server, None
        if server is None:
            return
        self._stopping.set()  # end open streams now rather than after the grace period
        if self.streams:
            # Let each ListAndWatch handler return before the server goes: its OK status is then on
            # its way and the kubelet sees the stream end cleanly, not a connection torn down under it.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._no_streams.wait(), min(grace, 0.5))
        async with _lifecycle_lock():
            await server.stop(grace)
        # Remove the socket only if it is still the one we bound: after a kubelet restart the path may
        # already belong to a newer server.
        try:
            st = os.lstat(self.socket_path)
            if files.identity_of(st) == self._inode:
                self.socket_path.unlink()
        except FileNotFoundError:
            pass
        self._inode = None
        log.info("%s: stopped serving on %s", self.resource, self.socket_path)

    def _handler(self) -> grpc.GenericRpcHandler:
        def unary(fn: Callable[..., Any], request: Any, response: Any) -> grpc.RpcMethodHandler:
            return grpc.unary_unary_rpc_method_handler(
                fn, request_deserializer=request.FromString, response_serializer=response.SerializeToString
            )

        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "GetDevicePluginOptions": unary(self._options, api_pb2.Empty, api_pb2.DevicePluginOptions),
                "ListAndWatch": grpc.unary_stream_rpc_method_handler(
                    self._list_and_watch,
                    request_deserializer=api_pb2.Empty.FromString,
                    response_serializer=_identity,
                ),
                "GetPreferredAllocation": unary(
                    self._preferred, api_pb2.PreferredAllocationRequest, api_pb2.PreferredAllocationResponse
                ),
                "Allocate": unary(self._allocate, api_pb2.AllocateRequest, api_pb2.AllocateResponse),
                "PreStartContainer": unary(
                    self._prestart, api_pb2.PreStartContainerRequest, api_pb2.PreStartContainerResponse
                ),
            },
        )

    async def _options(self, request: api_pb2.Empty, context: grpc.aio.ServicerContext) -> Any:
        try:
            pre_start, preferred = self._service.options()
        except Exception as exc:
            await self._internal(context, "GetDevicePluginOptions", exc)
        return api_pb2.DevicePluginOptions(
            pre_start_required=pre_start, get_preferred_allocation_available=preferred
        )

    async def _list_and_watch(
        self, request: api_pb2.Empty, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        # Send the latest whole list at once, then every newer one.  Each message replaces the whole
        # list at the kubelet, so skipping intermediate versions loses nothing.  Never return: the
        # kubelet treats a finished stream as "all devices unhealthy" and never redials.
        self.streams += 1
        self.streams_opened += 1
        self._no_streams.clear()
        self._streams_changed()
        log.info("%s: ListAndWatch stream opened", self.resource)
        stopping = asyncio.ensure_future(self._stopping.wait())
        newer: asyncio.Future[tuple[int, bytes]] | None = None
        try:
            version, message = self._feed.latest()
            yield message
            while True:
                newer = asyncio.ensure_future(self._feed.wait_newer(version))
                await asyncio.wait((newer, stopping), return_when=asyncio.FIRST_COMPLETED)
                if not newer.done():
                    newer.cancel()
                    return  # the server is stopping
                version, message = newer.result()
                yield message
        finally:
            stopping.cancel()
            if newer is not None:
                newer.cancel()
            self.streams -= 1
            if not self.streams:
                self._no_streams.set()
            self._streams_changed()
            log.info("%s: ListAndWatch stream closed", self.resource)

    def _streams_changed(self) -> None:
        hook = self.on_streams_changed
        if hook is not None:
            hook()

    async def _allocate(self, request: api_pb2.AllocateRequest, context: grpc.aio.ServicerContext) -> Any:
        count = len(request.container_requests)
        if count != 1:
            # The kubelet sends exactly one container request per Allocate call and uses only the first
            # response; anything else is not a kubelet and gets no half-answer.
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{self.resource}: Allocate needs exactly one container request, got {count}",
            )
        ids = list(request.container_requests[0].devices_ids)
        try:
            response = self._service.allocate(ids)
        except RequestError as exc:
            await self._refuse(context, "Allocate", exc)
        except Exception as exc:
            await self._internal(context, "Allocate", exc)
        return api_pb2.AllocateResponse(container_responses=[response])

    async def _preferred(
        self, request: api_pb2.PreferredAllocationRequest, context: grpc.aio.ServicerContext
    ) -> Any:
        responses = []
        try:
            for req in request.container_requests:
                ids = self._service.preferred(
                    list(req.available_deviceIDs), list(req.must_include_deviceIDs), req.allocation_size
                )
                responses.append(api_pb2.ContainerPreferredAllocationResponse(deviceIDs=ids))
        except RequestError as exc:
            await self._refuse(context, "GetPreferredAllocation", exc)
        except Exception as exc:
            await self._internal(context, "GetPreferredAllocation", exc)
        return api_pb2.PreferredAllocationResponse(container_responses=responses)

    async def _prestart(
        self, request: api_pb2.PreStartContainerRequest, context: grpc.aio.ServicerContext
    ) -> Any:
        try:
            self._service.prestart(list(request.devices_ids))
        except RequestError as exc:
            await self._refuse(context, "PreStartContainer", exc)
        except Exception as exc:
            await self._internal(context, "PreStartContainer", exc)
        return api_pb2.PreStartContainerResponse()

    async def _refuse(self, context: grpc.aio.ServicerContext, call: str, exc: RequestError) -> NoReturn:
        code = status_of(exc)
        # Bounded and escaped whatever the request held: the message may quote IDs the caller sent.
        message = clip(exc.message, MAX_STATUS_CHARS)
        log.warning("%s: %s refused (%s): %s", self.resource, call, code.name, message)
        await context.abort(code, f"{self.resource}: {message}")

    async def _internal(self, context: grpc.aio.ServicerContext, call: str, exc: Exception) -> NoReturn:
        # A bug in a pool must fail this one call, never the server: the kubelet keeps the stream.
        log.exception("%s: %s failed", self.resource, call)
        await context.abort(
            grpc.StatusCode.INTERNAL, f"{self.resource}: {call} failed: {clip(repr(exc), MAX_STATUS_CHARS)}"
        )


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
