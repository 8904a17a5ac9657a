"""Health tracker: facts → per-pool advertised health with hold-down, on a fake clock; and the coalescer."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from helpers import devices
from hypothesis import given, settings
from hypothesis import strategies as st

from densedev.health.coalesce import Coalescer
from densedev.health.tracker import (
    REASON_DRIVER,
    REASON_LINK,
    REASON_PF_LINK,
    REASON_RDMA,
    REASON_RECOVERING,
    REASON_UNBOUND,
    HealthTracker,
    MemberHealth,
)
from densedev.model import Device, HealthPolicy, Pool, PoolConfig, PoolMember, Role


class FakeClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def dev(
    addr: str,
    role: str = Role.VF,
    driver: str = "iavf",
    pf: str = "",
    pf_netdev: str = "",
    netdevs: tuple[str, ...] = (),
    rdma: str = "",
    vf_index: int = -1,
) -> Device:
    """Build a Device record as discovery would for an Intel E810 function."""
    return devices.dev(
        addr, role, vendor="8086", device="1889" if role == Role.VF else "1592", subsystem_vendor="8086",
        driver=driver, pf=pf, vf_index=vf_index, pf_netdev=pf_netdev, netdevs=netdevs,
        link_type="ether" if netdevs else "", rdma_device=rdma, pcie_root="pci0000:00",
    )  # fmt: skip


def node(pfs: int = 2, vfs: int = 4) -> list[Device]:
    """PFs ens<p>f0 at 0000:<p+1>:00.0 with VFs at .1.., each VF with host netdev ens<p>f0v<k>."""
    out = []
    for p in range(pfs):
        pf_addr = f"0000:{p + 1:02x}:00.0"
        out.append(dev(pf_addr, Role.PF, "ice", netdevs=(f"ens{p}f0",), rdma=f"irdma{p}"))
        for k in range(vfs):
            out.append(
                dev(
                    f"0000:{p + 1:02x}:00.{k + 1}" if k < 7 else f"0000:{p + 1:02x}:01.{k - 7}",
                    pf=pf_addr,
                    pf_netdev=f"ens{p}f0",
                    netdevs=(f"ens{p}f0v{k}",),
                    vf_index=k,
                )
            )
    return out


def pool(name: str, devices: list[Device], policy: HealthPolicy | None = None) -> Pool:
    """A pool ``intel.com/<name>`` of the given devices, one member each, with an optional health policy."""
    cfg = PoolConfig(resource_name=name, resource_prefix="intel.com", health=policy or HealthPolicy())
    return Pool(cfg, tuple(PoolMember(d.id, d) for d in devices))


VF0, VF1, PFS = "intel.com/vf0", "intel.com/vf1", "intel.com/pfs"  # the pools of ``setup``


def rebound(devices: list[Device], drivers: dict[str, str]) -> list[Device]:
    """The device table a rescan reads after bind/unbind uevents: the named devices bound to new drivers."""
    return [d._replace(driver=drivers[d.id]) if d.id in drivers else d for d in devices]


def setup_pools(devices: list[Device]) -> list[Pool]:
    """``setup``'s pools over a (rescanned) device table: PF0's VFs, PF1's VFs, both PFs."""
    return [
        pool("vf0", vfs_of(devices, "ens0f0")),
        pool("vf1", vfs_of(devices, "ens1f0")),
        pool("pfs", [d for d in devices if d.role == Role.PF]),
    ]


def vfs_of(devices: list[Device], pf_netdev: str) -> list[Device]:
    """The VFs whose PF netdev is ``pf_netdev``."""
    return [d for d in devices if d.pf_netdev == pf_netdev]


@pytest.fixture
def clock() -> FakeClock:
    """A fake clock."""
    return FakeClock()


@pytest.fixture
def setup(clock: FakeClock) -> tuple[HealthTracker, list[Device]]:
    """Two PFs with four VFs each; pool VF0 = PF0's VFs, VF1 = PF1's VFs, PFS = both PFs."""
    devices = node()
    tracker = HealthTracker(devices, setup_pools(devices), clock=clock)
    first = tracker.collect()
    assert list(first) == [VF0, VF1, PFS] and all(all(u.healthy) for u in first.values())
    assert all(u.pool == name for name, u in first.items())
    return tracker, devices


def test_first_collect_reports_every_pool_then_nothing(setup: tuple[HealthTracker, list[Device]]) -> None:
    tracker, _ = setup
    assert tracker.collect() == {}
    assert tracker.next_deadline() is None
    tracker.set_links([("ens0f0", True), ("ens1f0", True)])  # up is what we assumed: no change
    assert tracker.collect() == {}


def test_pf_down_takes_its_vfs_at_once_only_in_its_pool(
    setup: tuple[HealthTracker, list[Device]], clock: FakeClock
) -> None:
    tracker, devices = setup
    tracker.set_links([("ens0f0", False)])
    updates = tracker.collect()  # no time passes: unhealthy is reported at once
    assert list(updates) == [VF0, PFS]  # PF0's VFs, and PF0 itself (own link) in the PF pool
    vf_update = updates[VF0]
    assert vf_update.healthy == (False,) * 4 and vf_update.changed == (0, 1, 2, 3)
    assert updates[PFS].healthy == (False, True) and updates[PFS].changed == (0,)
    for vf in vfs_of(devices, "ens0f0"):
        assert tracker.reasons(vf.id) == (REASON_PF_LINK,)
    assert tracker.reasons("0000:01:00.0") == (REASON_LINK,)
    assert tracker.reasons("0000:02:00.1") == ()


def test_recovery_waits_for_the_hold_down(
    setup: tuple[HealthTracker, list[Device]], clock: FakeClock
) -> None:
    tracker, devices = setup
    tracker.set_links([("ens0f0", False)])
    tracker.collect()
    clock.now += 5
    tracker.set_links([("ens0f0", True)])
    assert tracker.next_deadline() == clock.now + 1.0
    assert tracker.collect() == {}
    assert REASON_RECOVERING in tracker.reasons(vfs_of(devices, "ens0f0")[0].id)
    clock.now += 0.999
    assert tracker.collect() == {}
    clock.now += 0.001
    updates = tracker.collect()
    assert list(updates) == [VF0, PFS]
    assert updates[VF0].healthy == (True,) * 4 and updates[VF0].changed == (0, 1, 2, 3)
    assert tracker.next_deadline() is None
    assert tracker.reasons(vfs_of(devices, "ens0f0")[0].id) == ()


def test_flapping_restarts_the_hold_down(setup: tuple[HealthTracker, list[Device]], clock: FakeClock) -> None:
    tracker, _ = setup
    tracker.set_links([("ens0f0", False)])
    assert VF0 in tracker.collect()
    for _ in range(3):  # up 0.5 s, down again: never healthy long enough
        clock.now += 0.5
        tracker.set_links([("ens0f0", True)])
        assert VF0 not in tracker.collect()
        clock.now += 0.5
        tracker.set_links([("ens0f0", False)])
        assert VF0 not in tracker.collect()  # still unhealthy as advertised: nothing to send
    assert tracker.next_deadline() is None
    clock.now += 0.2
    tracker.set_links([("ens0f0", True)])
    clock.now += 1.0
    assert tracker.collect()[VF0].healthy == (True,) * 4


def test_down_and_up_inside_one_window_is_still_reported(
    setup: tuple[HealthTracker, list[Device]], clock: FakeClock
) -> None:
    # A blip between two collects must not vanish: unhealthy latched, then healthy after the hold-down.
    tracker, _ = setup
    tracker.set_links([("ens1f0", False)])
    clock.now += 0.001
    tracker.set_links([("ens1f0", True)])
    assert tracker.collect()[VF1].healthy == (False,) * 4
    clock.now += 1.0
    assert tracker.collect()[VF1].healthy == (True,) * 4


def test_zero_hold_down_recovers_at_next_collect(clock: FakeClock) -> None:
    devices = node(1, 2)
    tracker = HealthTracker(devices, [pool("p", devices[1:], HealthPolicy(hold_down_s=0.0))], clock=clock)
    tracker.collect()
    tracker.set_links([("ens0f0", False)])
    tracker.set_links([("ens0f0", True)])
    assert tracker.collect()["intel.com/p"].healthy == (False, False)
    assert tracker.collect()["intel.com/p"].healthy == (True, True)


def test_own_link_down_only_with_a_host_netdev(
    setup: tuple[HealthTracker, list[Device]], clock: FakeClock
) -> None:
    tracker, devices = setup
    vf = vfs_of(devices, "ens1f0")[2]
    tracker.set_links([("ens1f0v2", False)])
    upd = tracker.collect()[VF1]
    assert upd.healthy == (True, True, False, True) and upd.changed == (2,)
    assert tracker.reasons(vf.id) == (REASON_LINK,)
    # The VF's netdev moves into a pod: RTM_DELLINK in the host namespace.  Gone is not down.
    tracker.drop_links(["ens1f0v2"])
    clock.now += 1.0
    assert tracker.collect()[VF1].healthy == (True,) * 4
    # After the rescan the VF has no host netdev at all; a link of that name going down is not its.
    moved = vf._replace(netdevs=())
    devices2 = [moved if d.id == vf.id else d for d in devices]
    tracker.replace(
        devices2, [pool("vf0", vfs_of(devices2, "ens0f0")), pool("vf1", vfs_of(devices2, "ens1f0"))]
    )
    tracker.collect()
    tracker.set_links([("ens1f0v2", False)])
    assert tracker.collect() == {}
    assert tracker.reasons(vf.id) == ()


def test_policy_switches_rules_off(clock: FakeClock) -> None:
    devices = node(1, 2)
    vfs = devices[1:]
    lenient = HealthPolicy(pf_link=False, own_link=False, rdma_port=False, driver=False)
    tracker = HealthTracker(devices, [pool("strict", vfs), pool("lenient", vfs, lenient)], clock=clock)
    tracker.collect()
    tracker.set_links([("ens0f0", False), ("ens0f0v0", False)])
    # vfs[1] unbound (the unbind uevent's rescan): the lenient pool keeps selecting it, as one
    # without a driver selector would.
    devices = rebound(devices, {vfs[1].id: ""})
    vfs = devices[1:]
    tracker.replace(devices, [pool("strict", vfs), pool("lenient", vfs, lenient)])
    updates = tracker.collect()
    assert list(updates) == ["intel.com/strict"] and updates["intel.com/strict"].healthy == (False, False)
    assert tracker.reasons(vfs[0].id) == (REASON_PF_LINK, REASON_LINK)
    assert tracker.reasons(vfs[1].id) == (REASON_PF_LINK, REASON_UNBOUND)


def test_two_netdevs_stay_down_while_either_is_down(clock: FakeClock) -> None:
    d = dev("0000:05:00.0", Role.PF, "mlx5_core", netdevs=("p0", "p0rep"))
    tracker = HealthTracker([d], [pool("p", [d])], clock=clock)
    tracker.collect()
    tracker.set_links([("p0", False), ("p0rep", False)])
    assert tracker.collect()["intel.com/p"].healthy == (False,)
    tracker.set_links([("p0", True)])
    clock.now += 10
    assert tracker.collect() == {}
    tracker.set_links([("p0rep", True)])
    clock.now += 1
    assert tracker.collect()["intel.com/p"].healthy == (True,)


_link_ops = st.lists(
    st.tuples(
        st.sampled_from(["set", "drop"]), st.sampled_from(["p0", "p0rep", "p1", "other"]), st.booleans()
    ),
    max_size=30,
)


@settings(max_examples=200, deadline=None)
@given(_link_ops)
def test_a_device_is_down_while_any_of_its_links_is_known_down(ops: list[tuple[str, str, bool]]) -> None:
    # The tracker keeps a count of links down to skip the per-device check when none is (the first dump
    # of a healthy node); the count must follow every set and drop, or a device with two netdevs would
    # come up while one is still down.
    two = dev("0000:05:00.0", Role.PF, "mlx5_core", netdevs=("p0", "p0rep"))
    one = dev("0000:06:00.0", Role.PF, "mlx5_core", netdevs=("p1",))
    policy = HealthPolicy(hold_down_s=0.0)
    tracker = HealthTracker([two, one], [pool("p", [two, one], policy)], clock=FakeClock())
    known: dict[str, bool] = {}
    tracker.collect()
    healthy = (True, True)
    for op, name, up in ops:
        if op == "set":
            tracker.set_links([(name, up)])
            known[name] = up
        else:
            tracker.drop_links([name])
            known.pop(name, None)
        update = tracker.collect().get("intel.com/p")
        if update is not None:
            healthy = update.healthy
        expected = tuple(all(known.get(n, True) for n in d.netdevs) for d in (two, one))
        assert healthy == expected, (op, name, up, known)


@pytest.mark.parametrize("shared_index", [False, True])
def test_driver_unbound_or_changed(
    setup: tuple[HealthTracker, list[Device]], clock: FakeClock, shared_index: bool
) -> None:
    # The daemon learns of a bind or unbind from its uevent, rescans, and hands the tracker the new table:
    # a pool that does not filter by driver keeps the device, which is unhealthy while not bound to the
    # driver it was selected with.  The daemon passes the table's own index (one dict of ids, not two).
    from densedev.node.table import DeviceTable

    tracker, devices = setup

    def replace(devices: list[Device]) -> None:
        if shared_index:
            table = DeviceTable(tuple(devices))
            tracker.replace(table.devices, setup_pools(devices), table.index)
            assert tracker._index is table.index
        else:
            tracker.replace(devices, setup_pools(devices))

    a, b = vfs_of(devices, "ens0f0")[:2]
    devices = rebound(devices, {a.id: "vfio-pci", b.id: ""})
    replace(devices)
    upd = tracker.collect()[VF0]
    assert upd.healthy == (False, False, True, True) and upd.changed == (0, 1)
    assert tracker.reasons(a.id) == (REASON_DRIVER,) and tracker.reasons(b.id) == (REASON_UNBOUND,)
    devices = rebound(devices, {a.id: "iavf", b.id: "iavf"})
    replace(devices)
    assert tracker.collect() == {}  # healthy again: the hold-down runs
    clock.now += 1
    assert tracker.collect()[VF0].healthy == (True,) * 4
    assert tracker.reasons(a.id) == () and tracker.reasons(b.id) == ()


def test_a_driver_a_dra_claim_rebinds_is_not_a_driver_change(
    setup: tuple[HealthTracker, list[Device]], clock: FakeClock
) -> None:
    """A claim's ``driver: vfio-pci`` is ours: healthy bound to vfio-pci, and again once given back."""
    tracker, devices = setup
    a, b = vfs_of(devices, "ens0f0")[:2]
    assert tracker.manage_drivers({a.id: "iavf"}) is False  # the table still shows iavf: nothing to redo
    devices = rebound(devices, {a.id: "vfio-pci", b.id: "vfio-pci"})  # b: rebound behind our back
    tracker.replace(devices, setup_pools(devices))
    assert tracker.collect()[VF0].healthy == (True, False, True, True)
    assert tracker.reasons(a.id) == () and tracker.reasons(b.id) == (REASON_DRIVER,)
    # Its PF going down counts as for any VF.
    tracker.set_links([("ens0f0", False)])
    assert tracker.reasons(a.id) == (REASON_PF_LINK,)
    assert tracker.collect()[VF0].healthy == (False, False, False, False)
    tracker.set_links([("ens0f0", True)])
    clock.now += 1
    tracker.collect()
    # Given back at Unprepare; a scan of other devices (the table still shows vfio-pci) keeps it healthy,
    # and so does the scan that shows iavf again.
    assert tracker.manage_drivers({}) is False
    tracker.replace(devices, setup_pools(devices))
    assert tracker.reasons(a.id) == ()
    devices = rebound(devices, {a.id: "iavf"})
    tracker.replace(devices, setup_pools(devices))
    assert tracker.reasons(a.id) == ()
    # An ordinary device again: rebound now, it is a driver change.
    devices = rebound(devices, {a.id: "vfio-pci"})
    tracker.replace(devices, setup_pools(devices))
    assert tracker.reasons(a.id) == (REASON_DRIVER,)


def test_a_rebind_seen_before_the_claim_is_recorded_is_taken_back(
    setup: tuple[HealthTracker, list[Device]], clock: FakeClock
) -> None:
    tracker, devices = setup
    a = vfs_of(devices, "ens0f0")[0]
    devices = rebound(devices, {a.id: "vfio-pci"})
    tracker.replace(devices, setup_pools(devices))  # a rescan between the rebind and the record
    assert tracker.collect()[VF0].healthy == (False, True, True, True)
    assert tracker.manage_drivers({a.id: "iavf"}) is True
    assert tracker.reasons(a.id) == (REASON_RECOVERING,)  # no driver change: the hold-down runs
    clock.now += 1
    assert tracker.collect()[VF0].healthy == (True,) * 4


def test_rdma_port_not_active(setup: tuple[HealthTracker, list[Device]], clock: FakeClock) -> None:
    tracker, _ = setup
    tracker.set_rdma_ports([("irdma0", 1, 4), ("irdma1", 1, 5)])  # ACTIVE, ACTIVE_DEFER
    assert tracker.collect() == {}
    tracker.set_rdma_ports([("irdma1", 1, 1)])  # DOWN
    upd = tracker.collect()[PFS]
    assert upd.healthy == (True, False)
    assert tracker.reasons("0000:02:00.0") == (REASON_RDMA,)
    tracker.set_rdma_ports([("irdma1", 1, 4)])
    clock.now += 1
    assert tracker.collect()[PFS].healthy == (True, True)


def test_shared_pool_flips_every_id_of_a_device(clock: FakeClock) -> None:
    d = dev("0000:05:00.0", Role.PF, "mlx5_core", netdevs=("p0",), rdma="mlx5_0")
    other = dev("0000:06:00.0", Role.PF, "mlx5_core", netdevs=("p1",), rdma="mlx5_1")
    cfg = PoolConfig(resource_name="rdma_shared", resource_prefix="rdma", rdma_shared=3)
    members = tuple(PoolMember(f"{x.rdma_device}-{k}", x) for x in (d, other) for k in range(3))
    tracker = HealthTracker([d, other], [Pool(cfg, members)], clock=clock)
    tracker.collect()
    tracker.set_rdma_ports([("mlx5_0", 1, 2)])  # INIT
    upd = tracker.collect()["rdma/rdma_shared"]
    assert upd.healthy == (False, False, False, True, True, True) and upd.changed == (0, 1, 2)
    # The allocator asks by member ID; the DRA side by device ID; both read the same bitmaps.
    assert not tracker.is_healthy("rdma/rdma_shared", "mlx5_0-2")
    assert tracker.is_healthy("rdma/rdma_shared", "mlx5_1-0")
    assert not tracker.device_healthy(d.id) and tracker.device_healthy(other.id)
    assert tracker.unhealthy_devices("rdma/rdma_shared") == (d.id,)


def test_replace_keeps_facts_and_reports_new_shapes(
    setup: tuple[HealthTracker, list[Device]], clock: FakeClock
) -> None:
    tracker, _ = setup
    tracker.set_links([("ens0f0", False)])
    tracker.collect()
    # Rescan: PF0 now has 6 VFs (two created), PF1 lost its last VF.
    grown = node(2, 6)
    new = [d for d in grown if not (d.pf_netdev == "ens1f0" and d.vf_index >= 3)]
    tracker.replace(new, setup_pools(new))
    updates = tracker.collect()
    # vf0 and vf1 changed shape: reported whole; the new VFs of the down PF are unhealthy at once.
    assert updates[VF0].healthy == (False,) * 6
    assert updates[VF1].healthy == (True,) * 3
    assert PFS not in updates  # same PFs, same health: nothing to send
    clock.now += 3
    tracker.set_links([("ens0f0", True)])
    clock.now += 1
    assert tracker.collect()[VF0].healthy == (True,) * 6


def test_replace_carries_a_running_hold_down(
    setup: tuple[HealthTracker, list[Device]], clock: FakeClock
) -> None:
    tracker, devices = setup
    tracker.set_links([("ens0f0", False)])
    tracker.collect()
    tracker.set_links([("ens0f0", True)])
    clock.now += 0.5
    tracker.replace(list(devices), setup_pools(devices))
    assert tracker.collect() == {}  # same shape, still inside the hold-down
    assert tracker.next_deadline() == clock.now + 0.5
    clock.now += 0.5
    assert tracker.collect()[VF0].healthy == (True,) * 4


def test_the_readers_ask_the_tracker_by_pool_name(
    setup: tuple[HealthTracker, list[Device]], clock: FakeClock
) -> None:
    # Advertised health is what every reader sees, before and after collect: a device down now is
    # refused at once, and one recovering stays unhealthy until its hold-down has run.
    tracker, devices = setup
    vf = vfs_of(devices, "ens1f0")[1]
    tracker.set_links([("ens1f0v1", False)])
    assert tracker.healthy(VF1) == (True, False, True, True)
    assert not tracker.is_healthy(VF1, vf.id) and not tracker.device_healthy(vf.id)
    assert tracker.unhealthy_devices(VF1) == (vf.id,) and tracker.unhealthy_devices(VF0) == ()
    assert tracker.collect()[VF1].healthy == tracker.healthy(VF1)
    tracker.set_links([("ens1f0v1", True)])
    assert not tracker.is_healthy(VF1, vf.id)
    clock.now += 1
    tracker.collect()
    assert tracker.is_healthy(VF1, vf.id) and tracker.device_healthy(vf.id)
    # Not a member, another pool's member, an unknown pool: not healthy in that pool.
    assert not tracker.is_healthy(VF1, "0000:99:00.0")
    assert not tracker.is_healthy(VF0, vf.id)
    assert not tracker.is_healthy("intel.com/nope", vf.id)
    # A device no pool lists (withheld) is not unhealthy to the DRA gate.
    assert tracker.device_healthy("0000:99:00.0")
    with pytest.raises(KeyError):
        tracker.healthy("intel.com/nope")


def test_member_without_a_table_device_stays_healthy(clock: FakeClock) -> None:
    devices = node(1, 2)
    ghost = dev("0000:77:00.1", pf="0000:77:00.0", pf_netdev="ens0f0")  # selected, then gone from the table
    tracker = HealthTracker(devices, [pool("p", [*devices[1:], ghost])], clock=clock)
    tracker.set_links([("ens0f0", False)])
    assert tracker.collect()["intel.com/p"].healthy == (False, False, True)
    assert tracker.is_healthy("intel.com/p", ghost.id)


def test_pool_names_are_unique(clock: FakeClock) -> None:
    devices = node(1, 2)
    with pytest.raises(ValueError, match=r"intel\.com/p given twice"):
        HealthTracker(devices, [pool("p", devices[1:2]), pool("p", devices[2:])], clock=clock)


def test_a_large_node_changes_only_the_affected_pool(clock: FakeClock) -> None:
    # 64 PFs x 256 VFs, 16 pools of 1,024 VFs (4 PFs each): one PF down touches one pool, 256 members.
    devices = node(64, 256)
    vfs = [d for d in devices if d.role == Role.VF]
    pools = [pool(f"p{k}", vfs[k * 1024 : (k + 1) * 1024]) for k in range(16)]
    tracker = HealthTracker(devices, pools, clock=clock)
    tracker.collect()
    tracker.set_links([("ens9f0", False)])
    updates = tracker.collect()
    assert list(updates) == ["intel.com/p2"]
    upd = updates["intel.com/p2"]
    assert upd.changed == tuple(range(256, 512)) and upd.healthy.count(False) == 256


# ----------------------------------------------------------------------------------------- coalescer
async def test_coalescer_folds_a_burst_into_one_flush() -> None:
    loop = asyncio.get_running_loop()
    flushes: list[float] = []
    first = asyncio.Event()

    def flush() -> None:
        flushes.append(loop.time())
        first.set()

    coalescer = Coalescer(flush, window=0.05)
    start = loop.time()
    for _ in range(100):
        coalescer.notify()
    assert coalescer.pending
    await first.wait()
    assert flushes[0] - start >= 0.05 - 1e-3  # never before the window (the loop's clock granularity)
    coalescer.notify()  # a new burst arms a new flush
    await asyncio.sleep(0.1)
    assert len(flushes) == 2


async def test_coalescer_is_not_pushed_back_by_later_events() -> None:
    calls: list[int] = []
    coalescer = Coalescer(lambda: calls.append(1), window=0.05)
    coalescer.notify()
    # Keep notifying far more often than the window: a deadline pushed back by each event never comes,
    # the first event's deadline does.  The bound only turns that hang into a failure.
    for _ in range(2000):
        if calls:
            break
        await asyncio.sleep(0.005)
        coalescer.notify()
    coalescer.cancel()
    assert calls, "a steady stream of events postponed the flush"


async def test_coalescer_cancel_drops_the_scheduled_flush() -> None:
    calls: list[int] = []
    fired = asyncio.Event()

    def flush() -> None:
        calls.append(1)
        fired.set()

    coalescer = Coalescer(flush, window=0.01)
    coalescer.notify()
    coalescer.cancel()  # as Daemon.stop and a reload's hand-over do
    assert not coalescer.pending
    coalescer.notify()  # due after the cancelled one would have been: only this one fires
    await fired.wait()
    await asyncio.sleep(0.02)
    assert not coalescer.pending
    assert calls == [1]
    with pytest.raises(ValueError, match="window must be >= 0"):
        Coalescer(lambda: None, window=-1)


# ------------------------------------------------------------------------------ against a plain model
class Model:
    """The health rules restated per (pool, member) with plain sets and dicts: the tracker's spec."""

    def __init__(self, devices: list[Device], pools: list[Pool]) -> None:
        self.devices = {d.id: d for d in devices}
        self.pools = pools
        self.links: dict[str, bool] = {}
        self.ports: dict[str, dict[int, int]] = {}
        self.drivers = {d.id: d.driver for d in devices}
        self.adv: dict[tuple[int, str], bool] = {}
        self.sent: dict[tuple[int, str], bool] = {}
        self.since: dict[tuple[int, str], float] = {}
        self.first = True
        self.settle(0.0)

    def bad(self, p: int, selected: Device) -> bool:
        pol = self.pools[p].config.health
        d = self.devices[selected.id]
        down = lambda n: not self.links.get(n, True)  # noqa: E731
        return (
            (pol.pf_link and d.role != Role.PF and bool(d.pf_netdev) and down(d.pf_netdev))
            or (pol.own_link and any(down(n) for n in d.netdevs))
            or (pol.rdma_port and any(s not in (4, 5) for s in self.ports.get(d.rdma_device, {}).values()))
            or (pol.driver and (self.drivers[d.id] == "" or self.drivers[d.id] != selected.driver))
        )

    def settle(self, now: float) -> None:
        for p, pl in enumerate(self.pools):
            for m in pl.members:
                key = (p, m.device.id)
                if self.bad(p, m.device):
                    self.adv[key] = True
                    self.since.pop(key, None)
                elif self.adv.get(key) and key not in self.since:
                    self.since[key] = now

    def collect(self, now: float) -> dict[int, tuple[tuple[bool, ...], tuple[int, ...]]]:
        out = {}
        for p, pl in enumerate(self.pools):
            hold = pl.config.health.hold_down_s
            for key, since in list(self.since.items()):
                if key[0] == p and now - since >= hold and self.sent.get(key):
                    self.adv[key] = False
                    del self.since[key]
            keys = [(p, m.device.id) for m in pl.members]
            changed = tuple(
                k for k, key in enumerate(keys) if self.adv.get(key, False) != self.sent.get(key, False)
            )
            if changed or self.first:
                out[p] = (tuple(not self.adv.get(key, False) for key in keys), changed)
            for key in keys:
                self.sent[key] = self.adv.get(key, False)
        self.first = False
        return out


_ops = st.one_of(
    st.tuples(
        st.just("link"),
        st.sampled_from(["ens0f0", "ens1f0", "ens0f0v0", "ens0f0v1", "ens1f0v2"]),
        st.booleans(),
    ),
    st.tuples(st.just("port"), st.sampled_from(["irdma0", "irdma1"]), st.integers(1, 2), st.integers(1, 5)),
    st.tuples(
        st.just("driver"),
        st.sampled_from(["0000:01:00.1", "0000:01:00.2", "0000:02:00.3"]),
        st.sampled_from(["iavf", "", "vfio-pci"]),
    ),
    st.tuples(st.just("tick"), st.sampled_from([0.0, 0.25, 0.5, 0.75, 1.0, 2.0])),
    st.tuples(st.just("collect")),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_ops, max_size=40))
def test_tracker_matches_the_model(ops: list[tuple[Any, ...]]) -> None:
    devices = node(2, 3)
    vf0, vf1 = vfs_of(devices, "ens0f0"), vfs_of(devices, "ens1f0")
    rdma = [d._replace(rdma_device="irdma0" if d.pf_netdev == "ens0f0" else "irdma1") for d in vf0 + vf1]
    devices = [devices[0], *rdma[:3], devices[4], *rdma[3:]]
    vf0, vf1 = vfs_of(devices, "ens0f0"), vfs_of(devices, "ens1f0")
    pools = [
        pool("all", vf0 + vf1),
        pool("vf1-lenient", vf1, HealthPolicy(pf_link=False, driver=False, hold_down_s=0.5)),
        pool("vf0-no-hold", vf0, HealthPolicy(own_link=False, hold_down_s=0.0)),
        Pool(
            PoolConfig("shared", "rdma", rdma_shared=2),
            tuple(PoolMember(f"{d.id}-{k}", d) for d in vf0 for k in range(2)),
        ),
    ]
    clock = FakeClock()
    tracker = HealthTracker(devices, pools, clock=clock)
    model = Model(devices, pools)
    for op in [*ops, ("collect",)]:
        if op[0] == "link":
            tracker.set_links([(op[1], op[2])])
            model.links[op[1]] = op[2]
        elif op[0] == "port":
            tracker.set_rdma_ports([(op[1], op[2], op[3])])
            model.ports.setdefault(op[1], {})[op[2]] = op[3]
        elif op[0] == "driver":
            # A bind/unbind uevent: the daemon rescans and hands the tracker the new table and pools.
            model.drivers[op[1]] = op[2]
            table = rebound(devices, model.drivers)
            by_id = {d.id: d for d in table}
            tracker.replace(
                table,
                [
                    Pool(p.config, tuple(PoolMember(m.id, by_id[m.device.id]) for m in p.members))
                    for p in pools
                ],
            )
        elif op[0] == "tick":
            clock.now += op[1]
        if op[0] != "collect":
            model.settle(clock.now)
            continue
        got = {u.pool: (u.healthy, u.changed) for u in tracker.collect().values()}
        assert got == {pools[p].config.full_name: v for p, v in model.collect(clock.now).items()}
        for p in pools:  # the gauges' counts (popcounts over fact bitmaps) agree with asking each device
            name = p.config.full_name
            assert tracker.counts(name) == tracker.counts_by_device(name)


def test_per_device_lookups_are_shared_tuples(clock: FakeClock) -> None:
    # Memory at density: the per-device entries (a device's pools, its member positions, a VF's own
    # netdev) were one list each, ~1.9 MiB per mapping at 16,384 devices; the devices of one pool now
    # share one (pool,) tuple, and every pool's (pos,) tuples are the same objects.
    devices = node(2, 64)
    tracker = HealthTracker(devices, setup_pools(devices), clock=clock)
    pools_of = list(tracker._pools_of.values())
    assert all(isinstance(v, tuple) for v in pools_of)
    assert len({id(v) for v in pools_of}) == len({v for v in pools_of})  # one object per distinct set
    states = list(tracker._pools.values())
    vf0, vf1 = tracker._pools[VF0], tracker._pools[VF1]
    assert vf0.positions[min(vf0.positions)] is vf1.positions[min(vf1.positions)]  # both are (0,)
    assert all(isinstance(v, tuple) for s in states for v in s.positions.values())
    # And the lookups still answer as before: a PF down flips exactly its VFs.
    tracker.collect()
    tracker.set_links([("ens0f0", False)])
    assert tracker.collect()[VF0].healthy == (False,) * 64


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["ens0f0", "ens1f0", "ens0f0v1", "ens1f0v3"]), st.booleans()),
                max_size=20))  # fmt: skip
def test_a_flushs_member_health_is_the_trackers_at_that_flush(flips: list[tuple[str, bool]]) -> None:
    # A flush hands its readers a view over the advertised bitmap, not a tuple of every member: it must
    # read what healthy() read at that flush, for every member (one outside the device table, several
    # members of one device as a shared RDMA pool lists it), whatever came after.
    devices = node(vfs=7)  # 16 devices: the last bitmap byte's top bit is a device (ens1f0v6)
    stranger = dev("0000:7f:00.1", pf="0000:7f:00.0", pf_netdev="gone", netdevs=("gonev0",), vf_index=0)
    vfs = vfs_of(devices, "ens0f0") + vfs_of(devices, "ens1f0")
    shared = Pool(
        PoolConfig("shared", "intel.com", health=HealthPolicy(hold_down_s=0.0)),
        tuple(PoolMember(f"{d.id}-{k}", d) for d in vfs for k in range(3)),
    )
    plain = Pool(
        PoolConfig("plain", "intel.com", health=HealthPolicy(hold_down_s=0.0)),
        tuple(PoolMember(d.id, d) for d in [*vfs, stranger]),
    )
    tracker = HealthTracker(devices, [shared, plain], clock=FakeClock())
    seen: list[tuple[MemberHealth, tuple[bool, ...]]] = []
    for name, up in [("ens0f0", True), ("gonev0", False), ("ens1f0", False), *flips]:
        tracker.set_links([(name, up)])
        for pool_name, update in tracker.collect().items():
            assert isinstance(update.healthy, MemberHealth)
            seen.append((update.healthy, tracker.healthy(pool_name)))
            if pool_name == "intel.com/plain":
                assert update.healthy[-1] is True  # the stranger: no device in the table, no facts
    for view, then in seen:
        assert len(view) == len(then) and tuple(view) == then and view == then
        assert [view[p] for p in range(len(then))] == list(then)
        assert view[-1] == then[-1] and view[1:5] == then[1:5]
