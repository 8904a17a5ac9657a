"""The kubelet side of the DRA driver in one piece: recover claims, then serve node, health, registration.

What the daemon wires: it builds a ``KubeletPlugin`` with its ``DeviceGate`` (pools whose API is DRA,
health, ownership) and a ``ClaimReader`` (the API client), calls ``start`` — which returns the device IDs
that prepared claims hold, before any socket exists, so ownership counts them first — feeds
``health.update`` from its health engine, and republishes its ResourceSlices from
``on_registered`` (the kubelet deletes slices published before a registration completes).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..alloc import cdi, devinfo
from ..node.vflinks import VfLinks
from ..node.watch import DirectoryWatch
from .claims import ClaimReader, DeviceGate
from .configure import JournalMetrics
from .health import RESEND_SECONDS, HealthStream
from .node import NodeService, NodeSettings, handlers
from .registration import DEFAULT_PLUGINS_DIR, DEFAULT_REGISTRY_DIR, DraPlugin


class KubeletPlugin:
    """One DRA driver on one node: its node service, its health stream and its two sockets."""

    def __init__(
        self,
        driver: str,
        node_name: str,
        reader: ClaimReader,
        gate: DeviceGate,
        *,
        plugins_dir: Path = DEFAULT_PLUGINS_DIR,
        registry_dir: Path = DEFAULT_REGISTRY_DIR,
        cdi_dir: Path = cdi.DEFAULT_CDI_DIR,
        devinfo_dir: Path | None = devinfo.DEFAULT_DEVINFO_DIR,
        dev_root: Path = Path("/dev"),
        watch: DirectoryWatch | None = None,
        poll: float = 1.0,
        resend: float = RESEND_SECONDS,
        links: VfLinks | None = None,
        journal_metrics: JournalMetrics | None = None,
        sysfs_root: Path | None = None,
    ) -> None:
        # One pool per node, named after the node (the ResourceSlice side names it the same way).
        settings = NodeSettings(
            driver,
            node_name,
            plugin_dir=Path(plugins_dir) / driver,
            cdi_dir=cdi_dir,
            devinfo_dir=devinfo_dir,
            dev_root=dev_root,
        )
        self.service = NodeService(
            settings, reader, gate, links=links, journal_metrics=journal_metrics, sysfs_root=sysfs_root
        )
        # Served whatever the kubelet does with it: 1.34-1.36 open the stream even when not advertised.
        self.health = HealthStream(node_name, resend=resend)
        self.plugin = DraPlugin(
            driver,
            [*handlers(self.service), self.health.handler()],
            registry_dir=registry_dir,
            plugins_dir=plugins_dir,
            watch=watch,
            poll=poll,
        )
        self._started = False
        self._recovered = False  # the checkpoint is read once: later the service's state is the truth

    @property
    def started(self) -> bool:
        """Whether the sockets are served (from ``start`` until ``stop``)."""
        return self._started

    @property
    def on_registered(self) -> Callable[[], None] | None:
        """Called after each successful registration (publish the node's ResourceSlices then)."""
        return self.plugin.on_registered

    @on_registered.setter
    def on_registered(self, hook: Callable[[], None] | None) -> None:
        self.plugin.on_registered = hook

    def recover(self) -> frozenset[str]:
        """Load the prepared claims' checkpoint (once, before serving); return the device IDs they hold."""
        if not self._recovered:
            self.service.recover()
            self._recovered = True
        return self.service.withheld()

    async def start(self) -> frozenset[str]:
        """Recover prepared claims (unless done already), then serve; return the device IDs they hold."""
        held = self.recover()
        self.service.start_restores()  # recovered before the loop ran: restores start now
        await self.plugin.start()
        self._started = True
        return held

    def remove_state(self) -> None:
        """Remove the checkpoint, CDI specs, leftover sockets and plugin dir (stopped, no claim left)."""
        self.service.remove_state()
        self.plugin.remove_leftovers()

    async def stop(self) -> None:
        """End the health stream, then remove the registration socket and the DRA socket."""
        self.health.stop()
        await self.service.stop_restores()
        if self._started:
            self._started = False
            await self.plugin.stop()
