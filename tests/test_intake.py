"""The event intake: kernel events become tracker marks and hand-off notes, or rescan requests."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path

from helpers.devices import dev, pool_of
from helpers.node import GUARD_S

from densedev import accel
from densedev.health.handoff import Handoff
from densedev.health.intake import EventIntake
from densedev.health.tracker import HealthTracker, PoolUpdate
from densedev.model import PoolConfig, Role
from densedev.node.events import RTM_DELLINK, RTM_NEWLINK
from densedev.node.rescans import RescanRequests
from densedev.node.scanner import Scanner
from densedev.ops.metrics import Metrics

PF, VF = "0000:3b:00.0", "0000:3b:00.1"
POOL = "intel.com/vfs"
PCI = (("SUBSYSTEM", "pci"),)


class Intake:
    """An intake over a tracker of one pool (the two VFs of PF ens1f0), recording the deliveries."""

    def __init__(self, tmp: Path) -> None:
        pf = dev(PF, Role.PF, pf="", netdevs=("ens1f0",), pf_netdev="")
        vfs = [dev(VF, pf=PF, pf_netdev="ens1f0"), dev("0000:3b:00.2", pf=PF, pf_netdev="ens1f0")]
        config = PoolConfig(resource_name="vfs", resource_prefix="intel.com")
        self.tracker = HealthTracker([pf, *vfs], [pool_of(config, vfs)])
        self.tracker.collect()
        self.delivered: list[dict[str, PoolUpdate]] = []
        self.arrived = asyncio.Event()
        self.handoff = Handoff(self.tracker, self._deliver, window=0.0)
        self.requests = RescanRequests()
        self.metrics = Metrics(accel.IMPLEMENTATION)
        self.intake = EventIntake(
            Scanner(tmp),
            self.tracker,
            self.handoff,
            self.requests,
            self.metrics,
            monitors=None,
            devices=lambda: (pf, *vfs),
            rdma_devices=list,
            rdma_poll_s=lambda: 3600.0,
        )

    def _deliver(self, updates: Mapping[str, PoolUpdate], latency: float | None, events: int) -> None:
        self.delivered.append(dict(updates))
        self.arrived.set()

    async def asked(self) -> tuple[set[str], bool, bool]:
        """Wait until a rescan was asked for (a guard, not a measure) and return what it would read."""
        async with asyncio.timeout(GUARD_S):
            await self.requests.wait(reconcile_s=3600)
        return self.requests.take()


async def test_a_pf_link_down_marks_its_vfs_and_is_delivered_once(tmp_path: Path) -> None:
    t = Intake(tmp_path)
    t.intake.on_links(((RTM_NEWLINK, 7, "ens1f0", 0x1, 2, 0, 0),))  # IF_OPER_DOWN, no carrier
    async with asyncio.timeout(GUARD_S):
        await t.arrived.wait()
    assert t.delivered == [{POOL: t.delivered[0][POOL]}] and t.delivered[0][POOL].healthy == (False, False)
    assert "pf-link-down" in t.tracker.reasons(VF)
    t.requests.request(PF)
    assert await t.asked() == ({PF}, False, False)  # a link event is health: it asked no full rescan


async def test_a_netdev_that_left_the_namespace_is_not_down(tmp_path: Path) -> None:
    t = Intake(tmp_path)
    t.intake.on_links(((RTM_DELLINK, 7, "ens1f0", 0x1, 2, 0, 0),))
    await asyncio.sleep(0)
    assert "pf-link-down" not in t.tracker.reasons(VF)


async def test_a_pci_uevent_asks_a_targeted_rescan_and_others_ask_nothing(tmp_path: Path) -> None:
    t = Intake(tmp_path)
    t.intake.on_uevent(("add", "/devices/virtual/block/loop0", (("SUBSYSTEM", "block"),)))
    t.intake.on_uevent(("bind", f"/devices/pci0000:00/{VF}", PCI))
    assert await t.asked() == ({VF}, False, False)  # the block device's event asked nothing


async def test_lost_uevents_are_noted_for_the_full_rescan_and_lost_links_are_not(tmp_path: Path) -> None:
    t = Intake(tmp_path)
    t.requests.request(VF)
    t.intake.on_overrun("link")  # the link monitor dumps every link itself; the rescan is the safety net
    assert await t.asked() == (set(), True, False) and t.requests.lost_at is None
    t.requests.request(VF)
    t.intake.on_overrun("uevent")
    assert await t.asked() == (set(), True, False) and t.requests.lost_at is not None
