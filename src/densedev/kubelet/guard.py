"""A pool's kubelet calls behind the ownership map: no device held under another resource is allocated.

The check belongs to the kubelet stage, which consumes the ownership map (``pools/ownership.py``); the
map itself knows nothing of the device-plugin API it guards.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..model import RequestError
from ..ops.logs import summarise
from ..pools.ownership import Ownership
from .server import PoolService

if TYPE_CHECKING:
    from .._proto import api_pb2


class GuardedService:
    """A pool's kubelet calls, refusing devices held under another resource and recording allocations."""

    def __init__(self, resource: str, inner: PoolService, ownership: Ownership) -> None:
        self.resource = resource
        self.inner = inner
        self.ownership = ownership

    def options(self) -> tuple[bool, bool]:
        """Return the pool's options."""
        return self.inner.options()

    def allocate(self, ids: Sequence[str]) -> api_pb2.ContainerAllocateResponse:
        """Refuse IDs running pods hold under another resource; otherwise allocate and record them."""
        clash = self.ownership.conflicts(self.resource, ids)
        if clash and not self.ownership.known:
            raise RequestError(
                RequestError.PRECONDITION,
                f"{self.resource}: what running pods hold cannot be read yet (PodResources and the kubelet "
                f"checkpoint both failed since start): {summarise(sorted(clash))}",
            )
        if clash:
            under = sorted({r for rs in clash.values() for r in rs})
            raise RequestError(
                RequestError.PRECONDITION,
                f"{self.resource}: devices held by running pods under another resource "
                f"({summarise(under, limit=2, noun='resource')}): {summarise(sorted(clash))}",
            )
        response = self.inner.allocate(ids)
        self.ownership.note_allocated(self.resource, ids)
        return response

    def preferred(self, available: Sequence[str], must_include: Sequence[str], size: int) -> list[str]:
        """Answer GetPreferredAllocation."""
        return self.inner.preferred(available, must_include, size)

    def prestart(self, ids: Sequence[str]) -> None:
        """Answer PreStartContainer."""
        self.inner.prestart(ids)
