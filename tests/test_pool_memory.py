"""A stopped pool's objects go with their last reference, without the cyclic collector.

``Daemon.start`` freezes what it made (``gc.freeze``), and the collector never looks at frozen objects
again: a pool's objects in a reference cycle would outlive the pool for good once it stops (1,000 pools
reloaded to 0 and back held both sets, 704 MiB).  Here the collector is off while the objects are
dropped, so only reference counting can free them; ``rediscovery.collect_frozen`` handles the cycles of
others (grpc's per-call objects), tested through a reload in ``test_reload``.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.devices import dev, pool_of
from helpers.plugin import RESOURCE, FakePool, pci_ids

from densedev.health.tracker import HealthTracker
from densedev.kubelet.feed import PoolFeed
from densedev.kubelet.pools import PoolRuntime
from densedev.kubelet.server import PluginServer
from densedev.model import PoolConfig
from densedev.ops.metrics import Metrics
from densedev.settings import DaemonSettings


@pytest.fixture
def collector_off() -> Iterator[None]:
    """The cyclic collector off, as it is for objects ``gc.freeze`` froze."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_a_pool_runtime_is_freed_by_reference_counting(sock_dir: Path, collector_off: None) -> None:
    devices = [dev(f"0000:3b:00.{i}", pf="0000:3b:00.0") for i in range(1, 5)]
    pool = pool_of(PoolConfig("vf", "example.com"), devices)
    tracker = HealthTracker(devices, [pool])
    settings = DaemonSettings(kubelet_dir=sock_dir, dev_root=sock_dir / "dev")
    runtime = PoolRuntime(pool, settings, Metrics(), health=tracker)
    assert runtime.allocator  # its allocator asks the tracker, which it must not do through the runtime
    gone = [weakref.ref(o) for o in (runtime, runtime.allocator, runtime.runner, runtime.feed)]
    del runtime
    assert [r() for r in gone] == [None] * len(gone)


async def test_a_stopped_plugin_server_is_freed_by_reference_counting(
    sock_dir: Path, collector_off: None
) -> None:
    # Its socket holds the gRPC handlers: were they the server's own bound methods, server and socket
    # would be a cycle, holding the pool's feed and service (its allocator) with them.
    pool = FakePool(pci_ids(4))
    feed = PoolFeed(pool.message())
    server = PluginServer(RESOURCE, sock_dir / "vf.sock", feed, pool)
    await server.start()
    await server.stop()
    gone = weakref.ref(server)
    del server
    assert gone() is None
