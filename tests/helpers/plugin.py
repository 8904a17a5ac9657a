"""A fake pool service for the device-plugin server tests, and PCI IDs shaped like a PF's VFs."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from densedev._proto import api_pb2
from densedev.kubelet.feed import PoolFeed
from densedev.kubelet.server import PluginServer
from densedev.kubelet.wire import ListEncoder
from densedev.model import RequestError

RESOURCE = "example.com/vf"


def pci_ids(count: int, bus: int = 0x3B) -> list[str]:
    """Return PCI addresses shaped like a PF's VFs: 0000:3b:00.2, ..."""
    return [f"0000:{bus + (i >> 8):02x}:{(i >> 3) & 0x1F:02x}.{i & 7}" for i in range(count)]


class FakePool:
    """A small PoolService: IDs with health, refusing what allocation.py would refuse."""

    def __init__(self, ids: Sequence[str], *, pre_start: bool = False, preferred: bool = True) -> None:
        self.health = dict.fromkeys(ids, True)
        self.ids = list(ids)
        self.pre_start = pre_start
        self.offer_preferred = preferred
        self.prestarted: list[list[str]] = []
        self.encoder = ListEncoder(self.ids, [i % 2 for i in range(len(self.ids))], name=RESOURCE)

    def message(self) -> bytes:
        """Return the pool's current ListAndWatch message."""
        return self.encoder.encode([self.health[i] for i in self.ids])

    def options(self) -> tuple[bool, bool]:
        return self.pre_start, self.offer_preferred

    def _check(self, ids: Sequence[str]) -> None:
        unknown = [i for i in ids if i not in self.health]
        if unknown:
            raise RequestError(RequestError.INVALID, f"unknown devices: {', '.join(unknown)}")
        unhealthy = [i for i in ids if not self.health[i]]
        if unhealthy:
            raise RequestError(RequestError.PRECONDITION, f"unhealthy devices: {', '.join(unhealthy)}")

    def allocate(self, ids: Sequence[str]) -> api_pb2.ContainerAllocateResponse:
        if "explode" in ids:
            raise ZeroDivisionError("pool bug")
        self._check(ids)
        return api_pb2.ContainerAllocateResponse(envs={"PCIDEVICE_EXAMPLE_COM_VF": ",".join(ids)})

    def preferred(self, available: Sequence[str], must_include: Sequence[str], size: int) -> list[str]:
        rest = [i for i in sorted(available) if i not in must_include]
        return list(must_include) + rest[: max(0, size - len(must_include))]

    def prestart(self, ids: Sequence[str]) -> None:
        self._check(ids)
        self.prestarted.append(list(ids))


@contextlib.asynccontextmanager
async def serving(
    resource: str, path: Path, pool: FakePool, feed: PoolFeed | None = None
) -> AsyncIterator[PluginServer]:
    """A PluginServer for ``pool`` on ``path`` (streaming ``feed``, or the pool's list), started, and stopped
    afterwards."""
    server = PluginServer(resource, path, feed if feed is not None else PoolFeed(pool.message()), pool)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()
