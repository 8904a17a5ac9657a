"""A pool's life with the kubelet: serve, Register on ``kubelet.sock``, and do it again after a restart."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path

import grpc

from ..files import FileIdentity, identify
from ..node.watch import DirectoryWatch
from .feed import PoolFeed
from .server import PluginServer, PoolService
from .wire import encode_register_request

log = logging.getLogger(__name__)

VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"

# Codes that mean "no kubelet to talk to (yet)": retry soon.  Any other error is the kubelet refusing
# the request (a bad resource name comes back as UNKNOWN with its text): retry slowly.
_ABSENT = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}

# How long a stopping pool server lets calls in progress finish.  Every DevicePlugin handler answers
# within one turn of the loop (ListAndWatch streams are ended first), so little is needed; and the
# whole grace is spent whenever the kubelet sent a call just as the server began to stop: grpc.aio no
# longer dispatches it, and the server's shutdown waits for the kubelet's connection, which that call
# keeps open, until the grace ends and the call is cancelled (the kubelet sees CANCELLED).  With 0.5 s,
# 2 of 4 runs of bench/bench_upgrade.py (20 upgrades, a pod admitted every 10 ms) had an old process
# whose exit -- inside the upgrade's window of rejected pods -- came ~0.5 s late (old_exit p99 ~570 ms;
# its log: 506 ms from the stream's end to the server's stop).
STOP_GRACE_S = 0.1


async def announce_kubelet(kubelet_dir: Path, poll: float = 0.5) -> None:
    """Log once while ``kubelet.sock`` is missing and once when it appears, for as long as it runs.

    Without it a daemon started before the kubelet (or pointed at the wrong directory) serves and waits
    in silence; the kubelet creates ``kubelet.sock`` when its device manager starts listening and
    deletes it on exit, so each restart shows as one "waiting" and one "appeared" line.
    """
    path = Path(kubelet_dir) / KUBELET_SOCKET
    present: bool | None = None
    while True:
        now = identify(path) is not None
        if now != present:
            if not now:
                log.info("waiting for %s: pools register when the kubelet listens there", path)
            elif present is False:
                log.info("%s appeared: registering", path)
            present = now
        await asyncio.sleep(poll)


class PluginRunner:
    """Keeps one pool served and registered with the kubelet across kubelet restarts."""

    def __init__(
        self,
        resource: str,
        kubelet_dir: Path,
        socket_name: str,
        feed: PoolFeed,
        service: PoolService,
        *,
        poll: float = 0.1,
        watch: DirectoryWatch | None = None,
        watched_poll: float = 2.0,
        backoff: tuple[float, float] = (0.05, 2.0),
        refused_retry: float = 30.0,
        register_timeout: float = 15.0,
        stream_grace: float = 0.5,
        first_stream_grace: float = 2.0,
    ) -> None:
        if "/" in socket_name or not socket_name:
            raise ValueError(f"{resource}: socket name {socket_name!r} must be a file name in {kubelet_dir}")
        self.resource = resource
        self.kubelet_dir = Path(kubelet_dir)
        self.socket_name = socket_name
        self.socket_path = self.kubelet_dir / socket_name
        self.kubelet_socket = self.kubelet_dir / KUBELET_SOCKET
        self._feed = feed
        self._service = service
        # With a working watch of the kubelet's directory the runner wakes on its changes and on its
        # own streams' ends, and looks by itself only every ``watched_poll`` seconds (a safety net);
        # without one it looks every ``poll`` seconds.
        self._poll = poll
        self._dirwatch = watch
        self._watched_poll = watched_poll
        self._wakeup = asyncio.Event()
        self._unsubscribe: Callable[[], None] | None = None
        self._backoff = backoff
        self._refused_retry = refused_retry
        self._register_timeout = register_timeout
        self._stream_grace = stream_grace
        self._first_stream_grace = first_stream_grace
        self._server: PluginServer | None = None
        self._task: asyncio.Task[None] | None = None
        self.registered = False
        self.registrations = 0
        self.last_error = ""  # why the last Register failed, "" after a success

    async def start(self) -> None:
        """Serve the pool now, then keep it registered in the background; raise if it cannot be served.

        The runner's whole life, its first serve included, is one task, so a stop during the start
        ends it like any other (the daemon's start retries run beside reloads that stop the pool).
        """
        if self._task is not None:
            raise RuntimeError(f"{self.resource}: runner already started")
        served: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._task = task = asyncio.create_task(self._life(served), name=f"registration {self.resource}")
        await asyncio.wait((served, task), return_when=asyncio.FIRST_COMPLETED)
        if task.done() and not served.done():
            if self._task is task:
                self._task = None  # may be started again, as the daemon's retries do
            if not task.cancelled():
                raise task.exception() or RuntimeError(f"{self.resource}: runner ended while starting")

    async def stop(self) -> None:
        """Stop registering and serving, and remove the pool's socket."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            # Its first serve's failure, if that is how it ended, was start's to report.
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        unsubscribe, self._unsubscribe = self._unsubscribe, None
        if unsubscribe is not None:
            unsubscribe()
        self.registered = False
        server, self._server = self._server, None
        if server is not None:
            await server.stop(STOP_GRACE_S)

    async def _life(self, served: asyncio.Future[None]) -> None:
        await self._serve()
        served.set_result(None)
        if self._dirwatch is not None:
            # Only kubelet.sock and our own socket matter here: woken by the other pools' sockets too, a
            # thousand runners would each look at every start and stop of the others (O(pools²)).
            self._unsubscribe = self._dirwatch.subscribe(
                self._wakeup.set, names=(KUBELET_SOCKET, self.socket_name)
            )
        await self._run()

    async def _serve(self) -> None:
        """Stop the old server before starting the new one: the kubelet may drop a second instance."""
        old, self._server = self._server, None
        if old is not None:
            await old.stop(STOP_GRACE_S)
        server = PluginServer(self.resource, self.socket_path, self._feed, self._service)
        server.on_streams_changed = self._wakeup.set
        await server.start()
        self._server = server

    def _own_socket_intact(self) -> bool:
        server = self._server
        return server is not None and server.intact

    async def _run(self) -> None:
        delay = self._backoff[0]
        while True:
            try:
                kubelet = await self._register()
                delay = self._backoff[0]
                await self._watch(kubelet)
                self.registered = False
                log.warning("%s: kubelet restarted or own socket removed; serving afresh", self.resource)
                await self._wait_for_kubelet()
                await self._serve()
            except asyncio.CancelledError:
                raise
            except Exception:
                # Never let one pool's trouble end its runner: log, wait, start over.
                self.registered = False
                log.exception("%s: registration loop failed; retrying in %.2f s", self.resource, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self._backoff[1])
                with contextlib.suppress(Exception):
                    await self._serve()

    async def _register(self) -> FileIdentity | None:
        """Register until the kubelet accepts; return the identity of the kubelet.sock that did."""
        delay = self._backoff[0]
        while True:
            # kubelet.sock first, our socket second: a starting kubelet deletes every socket in its
            # directory before it listens on kubelet.sock (the device manager's Start: removeContents,
            # then Listen), so our socket found intact after that kubelet.sock was read is past the
            # sweep, and the kubelet that answers can dial it.
            kubelet = identify(self.kubelet_socket)
            if not self._own_socket_intact():
                await self._serve()  # the kubelet deleted our socket while we waited
                continue  # and look again: it may have restarted meanwhile
            if kubelet is None:
                await self._sleep_watching(delay, kubelet)
                delay = min(delay * 2, self._backoff[1])
                continue
            error, absent = await self._register_once()
            if error is None:
                self.registered = True
                self.registrations += 1
                self.last_error = ""
                log.info("%s: registered with the kubelet as %s", self.resource, self.socket_name)
                return kubelet
            self.last_error = error
            if absent:
                log.info("%s: kubelet not answering (%s); retrying in %.2f s", self.resource, error, delay)
                await self._sleep_watching(delay, kubelet)
                delay = min(delay * 2, self._backoff[1])
            else:
                log.error(
                    "%s: the kubelet refused the registration: %s; retrying in %.0f s or when it restarts",
                    self.resource,
                    error,
                    self._refused_retry,
                )
                await self._sleep_watching(self._refused_retry, kubelet)

    async def _register_once(self) -> tuple[str | None, bool]:
        """Send one RegisterRequest; return (error text or None, whether the kubelet seems absent)."""
        pre_start, preferred = self._service.options()
        # The kubelet reads the options from GetDevicePluginOptions; sent here too for older ones.
        request = encode_register_request(VERSION, self.socket_name, self.resource, pre_start, preferred)
        async with grpc.aio.insecure_channel(f"unix:{self.kubelet_socket}") as channel:
            # Bytes both ways (no serializers): the request is encoded above, the reply is an Empty.
            register = channel.unary_unary("/v1beta1.Registration/Register", None, None)
            try:
                await register(request, timeout=self._register_timeout)
            except grpc.aio.AioRpcError as exc:
                return f"{exc.code().name}: {exc.details()}", exc.code() in _ABSENT
        return None, False

    async def _sleep_watching(self, seconds: float, kubelet: FileIdentity | None) -> None:
        """Sleep up to ``seconds``, waking early when kubelet.sock is recreated (a kubelet restart) or our
        socket is gone (a refusal may be the kubelet failing to dial it: registering again needs it back)."""
        deadline = time.monotonic() + seconds
        while (remaining := deadline - time.monotonic()) > 0:
            await self._pause(remaining)
            now = identify(self.kubelet_socket)
            if (now is not None and now != kubelet) or not self._own_socket_intact():
                return

    async def _watch(self, kubelet: FileIdentity | None) -> None:
        """Return once the kubelet restarted (kubelet.sock changed or gone), our socket was removed, or
        we have no stream: the kubelet dropped ours and opened none for ``stream_grace`` seconds, or
        never opened one within ``first_stream_grace`` seconds of our registration."""
        lost_since: float | None = None
        while True:
            server = self._server
            grace = (
                self._stream_grace
                if server is not None and server.streams_opened
                else self._first_stream_grace
            )
            await self._pause(grace if lost_since is not None else None)
            if identify(self.kubelet_socket) != kubelet or not self._own_socket_intact():
                return
            # The kubelet never redials a ended stream: its devices stay unhealthy until we register
            # again.  Wait a little first: a stream can end just before a restart is visible.  A stream
            # that never opened counts too: the v1.32 device manager, when the client a registration
            # replaced ends its stream, disconnects the newest client, possibly before its ListAndWatch
            # reached us (plugin/v1beta1/handler.go, runClient); the kubelet opens the stream as it
            # answers Register, so a longer wait, ``first_stream_grace``, tells that from a slow start.
            server = self._server
            if server is not None and not server.streams:
                now = time.monotonic()
                if lost_since is None:
                    lost_since = now
                elif now - lost_since >= grace:
                    log.warning(
                        "%s: %s; registering again",
                        self.resource,
                        "the kubelet closed our ListAndWatch stream"
                        if server.streams_opened
                        else f"the kubelet opened no ListAndWatch stream within {grace:g} s of registering",
                    )
                    return
            else:
                lost_since = None

    async def _wait_for_kubelet(self) -> None:
        """Wait while kubelet.sock is absent: a starting kubelet deletes every socket before listening."""
        while identify(self.kubelet_socket) is None:
            await self._pause()

    async def _pause(self, at_most: float | None = None) -> None:
        """Wait for a change the watch or our server reports, or the poll interval, or ``at_most``."""
        watch = self._dirwatch
        if watch is None or not (watch.active or watch.rewatch()):
            await asyncio.sleep(self._poll if at_most is None else min(self._poll, at_most))
            return
        timeout = self._watched_poll if at_most is None else min(self._watched_poll, at_most)
        if not self._wakeup.is_set():
            timer = asyncio.get_running_loop().call_later(timeout, self._wakeup.set)
            try:
                await self._wakeup.wait()
            finally:
                timer.cancel()
        # No settling pause after a wake-up: a kubelet restart is a burst of directory events, and a look
        # in its middle only costs another turn, since every look compares identities (kubelet.sock
        # read before our socket, see _register) rather than trusting the event that woke it.
        # Cleared after waking: whatever set it happened before, and the caller looks at it now.
        self._wakeup.clear()
