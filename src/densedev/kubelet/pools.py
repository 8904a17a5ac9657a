"""One device-plugin pool's runtime at the kubelet: its feed, encoder, allocator and registration runner."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from ..alloc.respond import AllocationSettings, PoolAllocator
from ..health.tracker import HealthTracker
from ..model import Pool
from ..ops.metrics import MeteredService, Metrics
from ..pools.ownership import GuardedService, Ownership
from .feed import PoolFeed
from .registration import PluginRunner
from .server import PoolService
from .sockets import socket_name_for
from .watch import DirectoryWatch
from .wire import ListEncoder

if TYPE_CHECKING:
    from ..daemon import DaemonSettings


class PoolRuntime:
    """Everything that runs for one pool: its feed, encoder, allocator and kubelet-facing runner."""

    def __init__(
        self,
        pool: Pool,
        settings: DaemonSettings,
        metrics: Metrics,
        watch: DirectoryWatch | None = None,
        ownership: Ownership | None = None,
        *,
        health: HealthTracker,
    ) -> None:
        self.pool = pool
        self.feed = PoolFeed()
        self._health = health  # the only holder of the members' health; the allocator asks it
        self.encoder = self._new_encoder(pool)
        self.allocator = PoolAllocator(
            pool,
            AllocationSettings(
                cdi_dir=settings.cdi_dir,
                devinfo_dir=settings.devinfo_dir,
                dev_root=settings.dev_root,
                cdi_annotations=settings.cdi_annotations,
            ),
            self.is_healthy,
        )
        name = pool.config.full_name
        socket_name = socket_name_for(name, settings.kubelet_dir)
        inner: PoolService = self.allocator
        if ownership is not None:
            inner = GuardedService(name, inner, ownership)  # one pod per device across resources
        service = MeteredService(name, inner, metrics)
        # Each pool watches kubelet.sock and its own socket: woken by the daemon's inotify watch of the
        # kubelet's directory, or (without one) looking 5 times a second, well within the 1 s the
        # kubelet allows a plugin to come back after its restart.
        self.runner = PluginRunner(
            name,
            settings.kubelet_dir,
            socket_name,
            self.feed,
            service,
            poll=settings.registration_poll_s,
            watch=watch,
        )
        self.registrations_seen = 0

    @staticmethod
    def _new_encoder(pool: Pool) -> ListEncoder:
        numa = [-1 if pool.config.exclude_topology else m.device.numa_node for m in pool.members]
        return ListEncoder([m.id for m in pool.members], numa, name=pool.config.full_name)

    @property
    def name(self) -> str:
        """Return the pool's extended resource name."""
        return self.pool.config.full_name

    def is_healthy(self, device_id: str) -> bool:
        """Return whether the ID is a member the health tracker advertises Healthy."""
        return self._health.is_healthy(self.name, device_id)

    def publish(self, healthy: Sequence[bool], changed: Iterable[int] | None) -> int:
        """Encode the health the tracker handed over, hand the message to the streams, return its size."""
        # ``changed``: the members the tracker says changed since its last report (None: all of them).
        message = self.encoder.encode(healthy, changed)
        self.feed.publish(message)
        return len(message)

    def replace(self, pool: Pool, healthy: Sequence[bool]) -> int:
        """Adopt a new membership (rescan or reload) and publish the whole list once."""
        self.pool = pool
        self.encoder = self._new_encoder(pool)
        self.allocator.update(pool)
        return self.publish(healthy, None)
