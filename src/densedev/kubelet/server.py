"""One DevicePlugin gRPC server per pool, on its own unix socket in the kubelet's device-plugin dir."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

import grpc

from ..model import RequestError
from ..printable import clip
from .feed import PoolFeed
from .lifecycle import SocketServer, unary
from .wire import encode_options

if TYPE_CHECKING:
    from .._proto import api_pb2

log = logging.getLogger(__name__)

SERVICE = "v1beta1.DevicePlugin"

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


def api() -> ModuleType:
    """Return the generated device-plugin API module, importing it (and protobuf) at the first call.

    Nothing before a pool's first list needs it (the options and the lists are encoded by ``wire``):
    Allocate, GetPreferredAllocation and PreStartContainer load it, or the warm-up after the first list.
    """
    from .._proto import api_pb2

    return api_pb2


# After a pool's first list, the generated classes are imported in a thread of their own, so the first
# Allocate does not wait ~15 ms for them on the event loop (a health flush would wait as long).  The
# delay leaves the other pools' first lists, sent just after, the CPU to themselves.
WARM_UP_DELAY_S = 0.5
_warm_up_started = False


def _import_api_later() -> None:
    time.sleep(WARM_UP_DELAY_S)
    api()


def warm_up() -> None:
    """Import the generated API module in the background, once per process (see WARM_UP_DELAY_S)."""
    global _warm_up_started
    if _warm_up_started:
        return
    _warm_up_started = True
    threading.Thread(target=_import_api_later, name="densedev-warm-up", daemon=True).start()


class _Message:
    """A message class of the device-plugin API, named when the server is built, imported when used."""

    def __init__(self, name: str) -> None:
        self._name = name

    def FromString(self, data: bytes) -> Any:
        """Parse ``data`` as this message."""
        return getattr(api(), self._name).FromString(data)

    @staticmethod
    def SerializeToString(message: Any) -> bytes:
        """Serialize a message of this class."""
        return bytes(message.SerializeToString())


class PluginServer:
    """Serves ``/v1beta1.DevicePlugin/*`` for one pool on ``socket_path``."""

    def __init__(self, resource: str, socket_path: Path, feed: PoolFeed, service: PoolService) -> None:
        self.resource = resource
        self.socket_path = Path(socket_path)
        # The handlers' side lives apart: the socket's handlers are its bound methods, so were they this
        # server's, server and socket would form a reference cycle, and a stopped pool would wait for a
        # collection that never comes for objects Daemon.start gc.freeze()s (1,000 pools reloaded to 0
        # kept all their memory).
        self._calls = _Calls(resource, feed, service)
        self._socket = SocketServer(resource, self.socket_path, (self._calls.handler(),))

    @property
    def streams(self) -> int:
        """ListAndWatch streams open now."""
        return self._calls.streams

    @property
    def streams_opened(self) -> int:
        """ListAndWatch streams opened since start."""
        return self._calls.streams_opened

    @property
    def on_streams_changed(self) -> Callable[[], None] | None:
        """Called as a stream opens or ends."""
        return self._calls.on_streams_changed

    @on_streams_changed.setter
    def on_streams_changed(self, hook: Callable[[], None] | None) -> None:
        self._calls.on_streams_changed = hook

    @property
    def running(self) -> bool:
        """Whether the gRPC server is serving (and not stopping)."""
        return self._socket.running and not self._calls.stopping.is_set()

    @property
    def intact(self) -> bool:
        """Whether we serve and our socket is still in place (a kubelet restart deletes it)."""
        return self._socket.intact

    async def start(self) -> None:
        """Bind the socket and serve; the server is fully ready when this returns."""
        if not self._socket.running:
            # Renewed before the socket exists: a stream opened at once must not see the last stop.
            self._calls.stopping = asyncio.Event()
        await self._socket.start()
        log.info("%s: serving DevicePlugin on %s", self.resource, self.socket_path)

    async def stop(self, grace: float = 0.5) -> None:
        """Stop serving (open streams are cancelled after ``grace`` seconds) and remove our socket."""
        calls = self._calls
        calls.stopping.set()  # end open streams now rather than after the grace period
        if calls.streams:
            # Let each ListAndWatch handler return before the server goes: its OK status is then on
            # its way and the kubelet sees the stream end cleanly, not a connection torn down under it.
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a cancellation that
            # arrives as the inner wait completes (cpython gh-86296), and the runner cancelled in here
            # would live on after its stop.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(grace, 0.5)):
                    await calls.no_streams.wait()
        if await self._socket.stop(grace):
            log.info("%s: stopped serving on %s", self.resource, self.socket_path)


class _Calls:
    """What one pool's server answers the kubelet: options, ListAndWatch from its feed, unary calls."""

    def __init__(self, resource: str, feed: PoolFeed, service: PoolService) -> None:
        self.resource = resource
        self._feed = feed
        self._service = service
        self.stopping = asyncio.Event()  # set while the server stops: open streams end
        self.streams = 0  # ListAndWatch streams open now
        self.streams_opened = 0  # ListAndWatch streams opened since start
        self.on_streams_changed: Callable[[], None] | None = None  # called as a stream opens or ends
        self.no_streams = asyncio.Event()
        self.no_streams.set()

    def handler(self) -> grpc.GenericRpcHandler:
        """Return the DevicePlugin service's handler, answering with this object's methods."""
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                # Both take an Empty (its bytes are not parsed) and answer bytes encoded by ``wire``.
                "GetDevicePluginOptions": grpc.unary_unary_rpc_method_handler(
                    self._options, response_serializer=_identity
                ),
                "ListAndWatch": grpc.unary_stream_rpc_method_handler(
                    self._list_and_watch, response_serializer=_identity
                ),
                "GetPreferredAllocation": unary(
                    self._preferred,
                    _Message("PreferredAllocationRequest"),
                    _Message("PreferredAllocationResponse"),
                ),
                "Allocate": unary(self._allocate, _Message("AllocateRequest"), _Message("AllocateResponse")),
                "PreStartContainer": unary(
                    self._prestart,
                    _Message("PreStartContainerRequest"),
                    _Message("PreStartContainerResponse"),
                ),
            },
        )

    async def _options(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            pre_start, preferred = self._service.options()
        except Exception as exc:
            await self._internal(context, "GetDevicePluginOptions", exc)
        return encode_options(pre_start, preferred)

    async def _list_and_watch(
        self, request: bytes, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        # Send the latest whole list at once, then every newer one.  Each message replaces the whole
        # list at the kubelet, so skipping intermediate versions loses nothing.  Never return: the
        # kubelet treats a finished stream as "all devices unhealthy" and never redials.
        self.streams += 1
        self.streams_opened += 1
        self.no_streams.clear()
        self._streams_changed()
        log.info("%s: ListAndWatch stream opened", self.resource)
        stopping = asyncio.ensure_future(self.stopping.wait())
        newer: asyncio.Future[tuple[int, bytes]] | None = None
        try:
            if self._feed.listed:
                version, message = self._feed.latest()
            else:
                # Served before the pool's first whole list exists: the first answer waits for it.  The
                # kubelet takes each ListAndWatch message as the whole set of devices
                # (ManagerImpl.genericDeviceUpdateCallback), so an early empty answer would withdraw
                # devices, and a partial one could offer a device before ownership filtered it.
                newer = asyncio.ensure_future(self._feed.first())
                await asyncio.wait((newer, stopping), return_when=asyncio.FIRST_COMPLETED)
                if not newer.done():
                    return  # the server is stopping (finally cancels the wait)
                version, message = newer.result()
            yield message
            warm_up()
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
                self.no_streams.set()
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
        return api().AllocateResponse(container_responses=[response])

    async def _preferred(
        self, request: api_pb2.PreferredAllocationRequest, context: grpc.aio.ServicerContext
    ) -> Any:
        responses = []
        try:
            for req in request.container_requests:
                ids = self._service.preferred(
                    list(req.available_deviceIDs), list(req.must_include_deviceIDs), req.allocation_size
                )
                responses.append(api().ContainerPreferredAllocationResponse(deviceIDs=ids))
        except RequestError as exc:
            await self._refuse(context, "GetPreferredAllocation", exc)
        except Exception as exc:
            await self._internal(context, "GetPreferredAllocation", exc)
        return api().PreferredAllocationResponse(container_responses=responses)

    async def _prestart(
        self, request: api_pb2.PreStartContainerRequest, context: grpc.aio.ServicerContext
    ) -> Any:
        try:
            self._service.prestart(list(request.devices_ids))
        except RequestError as exc:
            await self._refuse(context, "PreStartContainer", exc)
        except Exception as exc:
            await self._internal(context, "PreStartContainer", exc)
        return api().PreStartContainerResponse()

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
