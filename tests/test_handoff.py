"""The health hand-off: a burst of facts becomes one delivery, a hold-down's end another, on a fake clock."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from helpers.devices import dev, pool_of
from helpers.node import GUARD_S

from densedev.health.handoff import Handoff
from densedev.health.tracker import HealthTracker, PoolUpdate
from densedev.model import PoolConfig, Role

POOL = "intel.com/vfs"


class FakeClock:
    """A monotonic clock the test moves by hand (the tracker's and the hand-off's deadlines)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Deliveries:
    """Records what the hand-off delivers and wakes a waiter on each delivery."""

    def __init__(self) -> None:
        self.calls: list[tuple[dict[str, PoolUpdate], float | None, int]] = []
        self._arrived = asyncio.Event()

    def __call__(self, updates: Mapping[str, PoolUpdate], latency: float | None, events: int) -> None:
        self.calls.append((dict(updates), latency, events))
        self._arrived.set()

    async def next(self) -> tuple[dict[str, PoolUpdate], float | None, int]:
        """Wait for the next delivery and return it (a guard, not a measure: none coming fails the test)."""
        seen = len(self.calls)
        async with asyncio.timeout(GUARD_S):
            while len(self.calls) == seen:
                self._arrived.clear()
                await self._arrived.wait()
        return self.calls[-1]


def tracker(clock: FakeClock) -> HealthTracker:
    """A tracker of one pool of the four VFs of PF ens1f0 (hold-down 1 s), its first report collected."""
    pf = dev("0000:3b:00.0", Role.PF, pf="", netdevs=("ens1f0",), pf_netdev="")
    vfs = [dev(f"0000:3b:00.{k}", pf=pf.id, pf_netdev="ens1f0") for k in range(1, 5)]
    config = PoolConfig(resource_name="vfs", resource_prefix="intel.com")
    t = HealthTracker([pf, *vfs], [pool_of(config, vfs)], clock=clock)
    t.collect()
    return t


async def test_a_burst_of_facts_is_one_delivery_with_its_event_count() -> None:
    clock = FakeClock()
    health = tracker(clock)
    got = Deliveries()
    handoff = Handoff(health, got, window=0.01, clock=clock)
    health.set_links([("ens1f0", False)])
    handoff.note(1)
    handoff.note(3)  # rides along: the window was armed by the first
    updates, latency, events = await got.next()
    assert list(updates) == [POOL] and updates[POOL].healthy == (False,) * 4
    assert latency is not None and events == 4
    assert len(got.calls) == 1 and not handoff.coalescer.pending


async def test_the_end_of_a_hold_down_is_delivered_without_an_event() -> None:
    clock = FakeClock()
    health = tracker(clock)
    got = Deliveries()
    handoff = Handoff(health, got, window=0.0, clock=clock)
    health.set_links([("ens1f0", False)])
    handoff.note(1)
    await got.next()
    health.set_links([("ens1f0", True)])  # healthy again: told only after the 1 s hold-down
    handoff.note(1)
    updates, _, _ = await got.next()
    assert updates == {}
    clock.now += 1.0  # the hold-down ends; the flush armed for its deadline tells it
    updates, latency, events = await got.next()
    assert updates[POOL].healthy == (True,) * 4 and latency is None and events == 0
    handoff.cancel()


async def test_a_new_window_takes_the_pending_flush_over() -> None:
    clock = FakeClock()
    health = tracker(clock)
    got = Deliveries()
    handoff = Handoff(health, got, window=60.0, clock=clock)
    health.set_links([("ens1f0", False)])
    handoff.note(1)
    old = handoff.coalescer
    handoff.set_window(0.0)
    assert not old.pending and handoff.coalescer is not old and handoff.coalescer.pending
    updates, _, events = await got.next()
    assert updates[POOL].healthy == (False,) * 4 and events == 1


async def test_cancel_drops_the_pending_flush() -> None:
    clock = FakeClock()
    handoff = Handoff(tracker(clock), Deliveries(), window=60.0, clock=clock)
    handoff.note(1)
    handoff.cancel()
    assert not handoff.coalescer.pending
