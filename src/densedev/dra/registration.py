"""The DRA driver's two sockets: the DRA service (node + health) and the plugin-watcher registration.

The kubelet's plugin watcher finds ``<registry dir>/<driver>-reg.sock`` (inotify, and a walk at its
start), calls ``pluginregistration.Registration/GetInfo`` within 1 s and then
``NotifyRegistrationStatus``; it then dials the endpoint we gave, ``<plugins dir>/<driver>/dra.sock``,
for ``DRAPlugin`` (v1 on 1.34+, v1beta1 on 1.32 to 1.33) and ``DRAResourceHealth``
(pkg/kubelet/pluginmanager/operationexecutor/operation_generator.go; cm/dra/plugin).  As the official
helper does, the DRA socket is bound before the registration socket, a stale socket file is removed
before ``listen`` and ours is removed on close.  A restarted kubelet walks the registry dir and
registers existing sockets again, so nothing has to be re-created then; a socket someone deleted is
re-created (and the kubelet, seeing a new registration socket, registers it afresh).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from .. import files
from .._proto import pluginregistration_pb2 as reg_pb
from ..kubelet.lifecycle import SocketServer, unary
from ..node.watch import DirectoryWatch
from ..printable import clip
from . import DEFAULT_PLUGINS_DIR, DEFAULT_REGISTRY_DIR

log = logging.getLogger(__name__)

PLUGIN_TYPE = "DRAPlugin"
REGISTRATION_SERVICE = "pluginregistration.Registration"
# In this order: a 1.34+ kubelet takes the first entry it knows, a 1.32/1.33 one prefers v1beta1 when
# listed (and would silently fall back to v1alpha3 otherwise, which we do not serve).
SUPPORTED_VERSIONS = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
HEALTH_VERSION = "v1alpha1.DRAResourceHealth"
MAX_NOTIFICATIONS = 100  # the registration statuses kept for inspection; older ones are dropped


async def _serve(server: SocketServer) -> None:
    await server.start()
    log.info("%s: serving on %s", server.label, server.path)


async def _unserve(server: SocketServer, grace: float | None = 0.5) -> None:
    if await server.stop(grace):
        log.info("%s: stopped serving on %s", server.label, server.path)


@dataclass(frozen=True)
class Notification:
    """One NotifyRegistrationStatus the kubelet sent."""

    registered: bool
    error: str


class DraPlugin:
    """Serves a DRA driver to the kubelet and keeps both of its sockets in place until stopped."""

    def __init__(
        self,
        driver: str,
        handlers: Sequence[grpc.GenericRpcHandler],
        *,
        registry_dir: Path = DEFAULT_REGISTRY_DIR,
        plugins_dir: Path = DEFAULT_PLUGINS_DIR,
        health: bool = True,
        watch: DirectoryWatch | None = None,
        poll: float = 1.0,
    ) -> None:
        self.driver = files.check_name(driver)
        self.registry_dir = Path(registry_dir)
        self.plugin_dir = Path(plugins_dir) / driver
        self.endpoint = self.plugin_dir / "dra.sock"
        self.registration_socket = self.registry_dir / f"{driver}-reg.sock"
        self.plugin_type = PLUGIN_TYPE
        self.versions: tuple[str, ...] = (
            (*SUPPORTED_VERSIONS, HEALTH_VERSION) if health else SUPPORTED_VERSIONS
        )
        self._dra = SocketServer(f"DRA {driver}", self.endpoint, handlers)
        self._reg = SocketServer(
            f"DRA registration {driver}", self.registration_socket, (self._reg_handler(),)
        )
        self._watch = watch
        self._poll = poll
        self._wake = asyncio.Event()
        self._unsubscribe: Callable[[], None] | None = None
        self._task: asyncio.Task[None] | None = None
        self.notifications: list[Notification] = []
        self.registered = False
        self.info_calls = 0
        self.recreated = 0  # times a deleted or replaced socket of ours was made again
        self.on_registered: Callable[[], None] | None = None  # called after each successful registration

    async def start(self) -> None:
        """Bind the DRA socket, then the registration socket, and keep them in place in the background."""
        if self._task is not None:
            raise RuntimeError(f"DRA {self.driver}: already started")
        files.ensure_dir(self.registry_dir)
        files.ensure_dir(self.plugin_dir)
        await _serve(self._dra)
        try:
            await _serve(self._reg)
        except BaseException:
            await _unserve(self._dra, None)
            raise
        if self._watch is not None:
            self._unsubscribe = self._watch.subscribe(self._wake.set)
        self._task = asyncio.create_task(self._keep(), name=f"DRA sockets {self.driver}")

    async def stop(self) -> None:
        """Stop keeping, remove the registration socket first (the kubelet deregisters), then the DRA one."""
        task, self._task = self._task, None
        unsubscribe, self._unsubscribe = self._unsubscribe, None
        if unsubscribe is not None:
            unsubscribe()
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.registered = False
        await _unserve(self._reg)
        await _unserve(self._dra)

    def remove_leftovers(self) -> None:
        """Remove socket files of ours an earlier run left, then the plugin dir if it is empty.

        For a driver gone for good (renamed, its last claim unprepared): a registration socket left by
        a killed run keeps the kubelet believing the driver is there, and removing it is what makes the
        kubelet deregister the driver (pluginwatcher: a Remove event).  Only sockets are removed.
        """
        if self._task is not None:
            raise RuntimeError(f"DRA {self.driver}: still serving")
        for path in (self.registration_socket, self.endpoint):
            try:
                if stat.S_ISSOCK(os.lstat(path).st_mode):
                    path.unlink()
                    log.info("DRA %s: removed %s", self.driver, path)
            except FileNotFoundError:
                continue
        with contextlib.suppress(OSError):  # not empty (a checkpoint moved aside is kept), or absent
            os.rmdir(self.plugin_dir)

    async def _keep(self) -> None:
        while True:
            try:
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a cancellation
                # that arrives as the wake-up does (cpython gh-86296), and stop() would wait for ever.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._poll):
                        await self._wake.wait()
                self._wake.clear()
                await self.check()
            except asyncio.CancelledError:
                raise
            except Exception:
                # Never let socket upkeep die: log and look again at the next poll.
                log.exception("DRA %s: keeping the sockets failed; retrying", self.driver)

    async def check(self) -> bool:
        """Re-create a socket of ours that was deleted or replaced; return whether anything was."""
        redo = False
        if not self._dra.intact:
            log.warning("DRA %s: %s was removed or replaced; serving it again", self.driver, self.endpoint)
            await _unserve(self._dra, None)
            await _serve(self._dra)
            redo = True  # the kubelet's connection broke: make it register (and dial) again
        if redo or not self._reg.intact:
            if not redo:
                log.warning(
                    "DRA %s: %s was removed or replaced; serving it again",
                    self.driver,
                    self.registration_socket,
                )
            self.registered = False
            await _unserve(self._reg, None)
            await _serve(self._reg)
            redo = True
        if redo:
            self.recreated += 1
        return redo

    # -- pluginregistration.Registration ------------------------------------------------------------

    def _reg_handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            REGISTRATION_SERVICE,
            {
                "GetInfo": unary(self._get_info, reg_pb.InfoRequest, reg_pb.PluginInfo),
                "NotifyRegistrationStatus": unary(
                    self._notify, reg_pb.RegistrationStatus, reg_pb.RegistrationStatusResponse
                ),
            },
        )

    async def _get_info(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self.info_calls += 1
        return reg_pb.PluginInfo(
            type=self.plugin_type,
            name=self.driver,
            endpoint=str(self.endpoint),
            supported_versions=list(self.versions),
        )

    async def _notify(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        note = Notification(request.plugin_registered, clip(request.error, 1000))
        self.notifications = [*self.notifications[-(MAX_NOTIFICATIONS - 1) :], note]
        self.registered = note.registered
        if note.registered:
            log.info("DRA %s: registered with the kubelet", self.driver)
            hook = self.on_registered
            if hook is not None:
                try:
                    hook()
                except Exception:
                    log.exception("DRA %s: on_registered hook failed", self.driver)
        else:
            log.error("DRA %s: the kubelet refused the registration: %s", self.driver, note.error)
        return reg_pb.RegistrationStatusResponse()
