"""Device health: per-device facts (links, RDMA ports, drivers) → per-pool advertised health.

The tracker is the only holder of a member's health: pools are known by their extended resource name,
the wire encoder, the allocator and the DRA driver ask it (or take what ``collect`` hands out) and keep
no health of their own.

Facts are kept as bitmaps over device-table indexes (a device's position in the ``devices`` sequence),
one bitmap per fact, and each pool has a membership mask.  After a batch of facts, a pool's *raw*
unhealthy set is the OR of the fact bitmaps its ``HealthPolicy`` enables, within its mask; an XOR diff
against the previous raw set finds the few devices that flipped, so a pool that did not change costs
one diff and produces nothing.

Timing: Unhealthy is advertised at once; Healthy again only after ``hold_down_s`` of continuous health,
so a flapping link does not make the kubelet flap its allocatable count.  ``next_deadline`` tells the
caller when the next hold-down ends, so it can sleep instead of polling (``coalesce.Coalescer`` folds a
burst of events into one ``collect``).
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, TypeVar, overload

from .. import accel
from ..model import Device, Pool, Role

# RDMA port states (include/rdma/ib_verbs.h, enum ib_port_state): 4 ACTIVE, 5 ACTIVE_DEFER pass.
RDMA_PORT_ACTIVE = (4, 5)

REASON_PF_LINK = "pf-link-down"
REASON_LINK = "link-down"
REASON_RDMA = "rdma-port-down"
REASON_UNBOUND = "driver-unbound"
REASON_DRIVER = "driver-changed"
REASON_RECOVERING = "recovering"  # healthy again, waiting out the hold-down in some pool

# Fact bitmaps, indexed by these positions in HealthTracker._facts.
_PF_LINK, _LINK, _RDMA = range(3)


class PoolUpdate(NamedTuple):
    """A pool whose advertised health changed: the new state of every member and what changed."""

    pool: str  # the pool's extended resource name (``PoolConfig.full_name``)
    healthy: Sequence[bool]  # per member, in ``Pool.members`` order
    changed: tuple[int, ...]  # member positions whose advertised health changed (ascending)


def _bit(bitmap: bytes | bytearray, i: int) -> bool:
    return bool(bitmap[i >> 3] >> (i & 7) & 1)


class MemberHealth(Sequence[bool]):
    """A pool's advertised health per member at one flush, read from that flush's bitmap when asked.

    A flush's readers look at the members that changed (the wire encoder, the DRA stream and slices):
    building a tuple of every member's health for them cost 5 ms of a 65,536-device pool's PF-down.
    Equal to any sequence of the same booleans (a tuple in tests).
    """

    __slots__ = ("_devices", "_unhealthy")

    def __init__(self, unhealthy: bytes, devices: Sequence[int]) -> None:
        self._unhealthy = unhealthy  # advertised-unhealthy bitmap by device index (immutable bytes)
        self._devices = devices  # device index per member position, -1: not in the table (healthy)

    def __len__(self) -> int:
        return len(self._devices)

    @overload
    def __getitem__(self, position: int) -> bool: ...
    @overload
    def __getitem__(self, position: slice) -> Sequence[bool]: ...
    def __getitem__(self, position: int | slice) -> bool | Sequence[bool]:
        if isinstance(position, slice):
            return tuple(self[p] for p in range(*position.indices(len(self))))
        i = self._devices[position]
        return i < 0 or not _bit(self._unhealthy, i)

    def __iter__(self) -> Iterator[bool]:
        unhealthy = self._unhealthy
        return (i < 0 or not unhealthy[i >> 3] >> (i & 7) & 1 for i in self._devices)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str | bytes):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]  # equal to tuples, so not hashable like them

    def __repr__(self) -> str:
        return f"MemberHealth({tuple(self)!r})"


K = TypeVar("K")
V = TypeVar("V")


def _tuples(lists: dict[K, list[V]], shared: dict[Any, Any]) -> dict[K, tuple[V, ...]]:
    """Return the mapping with each list frozen to a tuple, equal tuples one object (``shared`` keeps them).

    Most of these lists hold one item per device (a VF's own netdev, its one position, its one pool), so
    at 16,384 devices a list each (88 bytes with append's spare slots) was ~1.9 MiB per mapping; a tuple
    is 48 bytes, and the devices of one pool share a single ``(pool,)`` and each position's ``(pos,)``.
    """
    return {key: shared.setdefault(t, t) for key, items in lists.items() for t in (tuple(items),)}


class _PoolState:
    """One pool's mask, member layout and health state (raw, advertised, last sent, pending recovery)."""

    def __init__(
        self, pool: Pool, index: Mapping[str, int], nbytes: int, shared: dict[Any, Any] | None = None
    ) -> None:
        self.name = pool.config.full_name
        self.policy = pool.config.health
        self.ids = tuple(m.id for m in pool.members)
        self._member_devices: dict[str, int] | None = None  # member ID → device index, built on demand
        # Member positions per device index: a shared RDMA pool advertises many IDs for one device.
        positions: dict[int, list[int]] = {}
        # The driver each device had when the pool selected it (the driver rule compares against it).
        self.selected_driver: dict[int, str] = {}
        # The device index of each member position (-1: none), for a flush's MemberHealth: 4 bytes a
        # member.
        self.devices = array("i", [-1]) * len(pool.members)
        for pos, member in enumerate(pool.members):
            i = index.get(member.device.id)
            if i is None:
                continue  # a member whose device is not in the table has no facts; it stays healthy
            positions.setdefault(i, []).append(pos)
            self.devices[pos] = i
            self.selected_driver[i] = member.device.driver
        self.positions = _tuples(positions, {} if shared is None else shared)
        self.mask = accel.set_bits(bytes(nbytes), list(self.positions), True)
        self.driver_bad = bytes(nbytes)
        self.raw = bytes(nbytes)  # unhealthy by the facts right now
        self.advertised = bytes(nbytes)  # unhealthy as we want the kubelet to see it
        self.sent = bytes(nbytes)  # unhealthy as last returned by collect()
        self.pending: dict[int, float] = {}  # device index → when it became healthy (hold-down running)
        self.force = True  # report at the next collect even without a change (new or re-shaped pool)

    def device_of(self, member_id: str) -> int | None:
        """Return the device index of a member (-1: not in the device table), or None for a non-member."""
        # Built at the first Allocate after a rescan, not at every rescan: a rescan of 16k devices
        # re-lays out every pool, while Allocate calls are rare and ask about a few IDs.
        if self._member_devices is None:
            devices: dict[str, int] = dict.fromkeys(self.ids, -1)
            for i, positions in self.positions.items():
                for pos in positions:
                    devices[self.ids[pos]] = i
            self._member_devices = devices
        return self._member_devices.get(member_id)


class HealthTracker:
    """Turns per-device facts into per-pool advertised health with hold-down, via bitmaps."""

    def __init__(
        self,
        devices: Sequence[Device],
        pools: Sequence[Pool],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._clock = clock
        self._links: dict[str, bool] = {}  # ifname → up, as last reported (absent: unknown, counts as up)
        self._links_down = 0  # how many of them are down (none: no device can stay down in _flip)
        self._ports: dict[str, dict[int, int]] = {}  # ibdev → port → state
        # Devices whose driver DRA claims change on purpose (manage_drivers), by ID → the driver they go
        # back to; and those given back whose return no scan has shown yet (same mapping).
        self._managed: dict[str, str] = {}
        self._given_back: dict[str, str] = {}
        self._build(devices, pools)

    # ------------------------------------------------------------------------------------------ layout
    def _build(
        self, devices: Sequence[Device], pools: Sequence[Pool], index: Mapping[str, int] | None = None
    ) -> None:
        self._devices = tuple(devices)
        # The device table's own index when given (one dict of every id, not two: 0.8 MiB at 16k).
        self._index = index if index is not None else {d.id: i for i, d in enumerate(self._devices)}
        self._nbytes = (len(self._devices) + 7) // 8
        # Devices with no driver bound, as the table shows them (the count of "unbound" is a popcount).
        self._unbound = accel.set_bits(
            bytes(self._nbytes), [i for i, d in enumerate(self._devices) if d.driver == ""], True
        )
        by_netdev: dict[str, list[int]] = {}
        by_pf_netdev: dict[str, list[int]] = {}
        by_ibdev: dict[str, list[int]] = {}
        pf = Role.PF  # a local: one enum attribute lookup, not one per device
        for i, d in enumerate(self._devices):
            for name in d.netdevs:
                by_netdev.setdefault(name, []).append(i)
            if d.pf_netdev and d.role != pf:
                by_pf_netdev.setdefault(d.pf_netdev, []).append(i)
            if d.rdma_device:
                by_ibdev.setdefault(d.rdma_device, []).append(i)
        shared: dict[Any, Any] = {}
        self._by_netdev = _tuples(by_netdev, shared)
        self._by_pf_netdev = _tuples(by_pf_netdev, shared)
        self._by_ibdev = _tuples(by_ibdev, shared)
        self._pools: dict[str, _PoolState] = {}
        for p in pools:
            state = _PoolState(p, self._index, self._nbytes, shared)
            if state.name in self._pools:
                raise ValueError(f"HealthTracker: pool {state.name} given twice")
            self._pools[state.name] = state
        pools_of: dict[int, list[_PoolState]] = {}
        for state in self._pools.values():
            for i in state.positions:
                pools_of.setdefault(i, []).append(state)
        self._pools_of = _tuples(pools_of, shared)
        empty = bytes(self._nbytes)
        self._facts = [empty, empty, empty]
        self._facts[_PF_LINK] = self._link_bitmap(self._by_pf_netdev)
        self._facts[_LINK] = self._link_bitmap(self._by_netdev)
        self._facts[_RDMA] = self._rdma_bitmap()
        for state in self._pools.values():
            state.driver_bad = self._driver_bitmap(state, state.selected_driver)
            state.raw = self._raw(state)
            state.advertised = state.raw  # a fresh pool starts from the facts, without a hold-down

    def _link_bitmap(self, by_name: dict[str, tuple[int, ...]]) -> bytes:
        down = [i for name, up in self._links.items() if not up for i in by_name.get(name, ())]
        return accel.set_bits(bytes(self._nbytes), down, True)

    def _rdma_bitmap(self) -> bytes:
        down = [
            i for ib, ports in self._ports.items() if self._ib_down(ports) for i in self._by_ibdev.get(ib, ())
        ]
        return accel.set_bits(bytes(self._nbytes), down, True)

    @staticmethod
    def _ib_down(ports: dict[int, int]) -> bool:
        return any(state not in RDMA_PORT_ACTIVE for state in ports.values())

    def _driver_ok(self, i: int, selected: str) -> bool:
        # The driver bound now is the current table's: each rescan brings it (no copy by id kept).
        now = self._devices[i].driver
        return now != "" and now == selected

    def _driver_bitmap(self, state: _PoolState, indexes: Iterable[int]) -> bytes:
        bad: list[int] = []
        good: list[int] = []
        for i in indexes:
            (good if self._driver_ok(i, state.selected_driver[i]) else bad).append(i)
        return accel.set_bits(accel.set_bits(state.driver_bad, bad, True), good, False)

    def _raw(self, state: _PoolState) -> bytes:
        policy = state.policy
        parts = []
        if policy.pf_link:
            parts.append(self._facts[_PF_LINK])
        if policy.own_link:
            parts.append(self._facts[_LINK])
        if policy.rdma_port:
            parts.append(self._facts[_RDMA])
        if policy.driver:
            parts.append(state.driver_bad)
        return accel.or_bitmaps(parts, state.mask)

    # ------------------------------------------------------------------------------------------- facts
    def set_links(self, states: Iterable[tuple[str, bool]]) -> None:
        """Record link states by interface name (``True``: operstate up / carrier) and re-evaluate."""
        up: list[int] = []
        down: list[int] = []
        pf_up: list[int] = []
        pf_down: list[int] = []
        for name, is_up in states:
            was = self._links.get(name)
            if was == is_up:
                continue
            self._links[name] = is_up
            self._links_down += (not is_up) - (was is False)
            (up if is_up else down).extend(self._by_netdev.get(name, ()))
            (pf_up if is_up else pf_down).extend(self._by_pf_netdev.get(name, ()))
        if up or down:
            self._facts[_LINK] = self._flip(self._facts[_LINK], down, up, self._by_netdev)
        if pf_up or pf_down:
            self._facts[_PF_LINK] = self._flip(self._facts[_PF_LINK], pf_down, pf_up, self._by_pf_netdev)
        if up or down or pf_up or pf_down:
            self._evaluate()

    def drop_links(self, names: Iterable[str]) -> None:
        """Forget links that left the host namespace (RTM_DELLINK): gone is not down, e.g. a VF in a pod."""
        states = [(name, True) for name in names if name in self._links]
        self.set_links(states)
        for name, _ in states:
            self._links.pop(name, None)

    def _flip(
        self, bitmap: bytes, down: list[int], up: list[int], by_name: dict[str, tuple[int, ...]]
    ) -> bytes:
        bitmap = accel.set_bits(bitmap, down, True)
        # A device with two netdevs stays down while either is down; with no link down (the first dump
        # of a healthy node: every device "up"), none does, and asking each of them was 2 of the 3 ms
        # that dump took at 4,096 VFs.
        if self._links_down:
            still = [i for i in up if any(not self._links.get(n, True) for n in self._names_of(i, by_name))]
        else:
            still = []
        cleared = accel.set_bits(bitmap, up, False)
        return accel.set_bits(cleared, still, True)

    def _names_of(self, i: int, by_name: dict[str, tuple[int, ...]]) -> tuple[str, ...]:
        d = self._devices[i]
        return d.netdevs if by_name is self._by_netdev else (d.pf_netdev,)

    def manage_drivers(self, drivers: Mapping[str, str]) -> bool:
        """Take the devices whose driver DRA claims change on purpose (ID → the driver they go back to,
        "" for none); return whether advertised health may have changed.

        A claim's ``driver`` rebinds its VF at Prepare and gives the old driver back at Unprepare: for
        these devices the driver they are bound to is the expected one, never ``driver-changed`` (the
        rule that catches a VF rebound behind the pool's back), until a scan shows a device given back
        on its old driver.  Their other facts (PF link, own link, RDMA) count as before.
        """
        for device_id in self._managed.keys() - drivers.keys():
            self._given_back[device_id] = self._managed[device_id]
        for device_id in drivers:
            self._given_back.pop(device_id, None)
        self._managed = dict(drivers)
        changed = False
        for device_id in drivers:
            i = self._index.get(device_id)
            if i is None:
                continue
            now = self._devices[i].driver
            for state in self._pools_of.get(i, ()):
                if now and state.selected_driver.get(i) != now:
                    # A rescan saw the rebind before the claim was recorded: re-selected as it is now.
                    state.selected_driver[i] = now
                    state.driver_bad = self._driver_bitmap(state, (i,))
                    changed = True
        if changed:
            self._evaluate()
        return changed

    def set_rdma_ports(self, states: Iterable[tuple[str, int, int]]) -> None:
        """Record RDMA port states ``(ibdev, port, state)`` (ib_port_state numbers) and re-evaluate."""
        touched: set[str] = set()
        for ib, port, state in states:
            ports = self._ports.setdefault(ib, {})
            if ports.get(port) != state:
                ports[port] = state
                touched.add(ib)
        if not touched:
            return
        down = [i for ib in touched if self._ib_down(self._ports[ib]) for i in self._by_ibdev.get(ib, ())]
        up = [i for ib in touched if not self._ib_down(self._ports[ib]) for i in self._by_ibdev.get(ib, ())]
        bitmap = accel.set_bits(self._facts[_RDMA], up, False)
        self._facts[_RDMA] = accel.set_bits(bitmap, down, True)
        self._evaluate()

    def _evaluate(self) -> None:
        # Fold the facts into each pool: unhealthy at once, healthy starts the hold-down clock.
        now = self._clock()
        for state in self._pools.values():
            raw = self._raw(state)
            changed = accel.diff_bitmaps(state.raw, raw, state.mask)
            if not changed:
                continue
            state.raw = raw
            bad = []
            for i in changed:
                if _bit(raw, i):
                    bad.append(i)
                    state.pending.pop(i, None)
                elif _bit(state.advertised, i):
                    state.pending[i] = now
            if bad:
                state.advertised = accel.set_bits(state.advertised, bad, True)

    # ------------------------------------------------------------------------------------------ output
    def collect(self) -> dict[str, PoolUpdate]:
        """Return the pools whose advertised health changed since the last call (all pools the first time)."""
        now = self._clock()
        out: dict[str, PoolUpdate] = {}
        for name, state in self._pools.items():
            if state.pending:
                hold = state.policy.hold_down_s
                # A device the kubelet has not yet been told is unhealthy (a blip shorter than the
                # coalescing window) is told once before it recovers: unhealthy is never swallowed.
                done = [
                    i for i, since in state.pending.items() if now - since >= hold and _bit(state.sent, i)
                ]
                for i in done:
                    del state.pending[i]
                if done:
                    state.advertised = accel.set_bits(state.advertised, done, False)
            changed = accel.diff_bitmaps(state.sent, state.advertised, state.mask)
            if not changed and not state.force:
                continue
            state.sent = state.advertised
            state.force = False
            positions = sorted(pos for i in changed for pos in state.positions.get(i, ()))
            out[name] = PoolUpdate(name, MemberHealth(state.advertised, state.devices), tuple(positions))
        return out

    def published(self, pool: str) -> None:
        """Note that the pool's whole list just went out with its advertised health: no report is owed.

        A pool set up or given a new membership publishes its whole list at once; without this, the
        report ``replace`` owes it would send the same list again at the next flush.
        """
        state = self._pools.get(pool)
        if state is not None:
            state.sent = state.advertised
            state.force = False

    @staticmethod
    def _member_health(state: _PoolState) -> tuple[bool, ...]:
        flags = [True] * len(state.ids)
        for i in accel.select_bits(state.advertised, state.mask):
            for pos in state.positions[i]:
                flags[pos] = False
        return tuple(flags)

    def healthy(self, pool: str) -> tuple[bool, ...]:
        """Return the advertised health of every member of a pool (by name), in member order."""
        return self._member_health(self._pools[pool])

    def is_healthy(self, pool: str, member_id: str) -> bool:
        """Return whether the ID is a member of the pool whose advertised health is Healthy."""
        state = self._pools.get(pool)
        if state is None:
            return False
        i = state.device_of(member_id)
        return i is not None and (i < 0 or not _bit(state.advertised, i))

    def device_healthy(self, device_id: str) -> bool:
        """Return whether no pool advertises the device unhealthy (a device no pool lists counts healthy)."""
        i = self._index.get(device_id)
        return i is None or not any(_bit(state.advertised, i) for state in self._pools_of.get(i, ()))

    def counts(self, pool: str) -> tuple[int, int, dict[str, int]]:
        """Return a pool's members advertised healthy and unhealthy, and the unhealthy ones by reason."""
        state = self._pools[pool]
        if len(state.ids) != len(state.positions):  # a shared RDMA pool: several member IDs per device
            return self.counts_by_device(pool)
        # Every flush of a pool sets its gauges: with all of a 65,536-device pool's PFs down, asking
        # reasons() of each unhealthy device took ~140 ms of the loop per flush, and looking up only
        # its driver still 17 ms.  Every reason is a bitmap over the same device positions, so each
        # count is a popcount: link and RDMA facts, unbound devices (built with the table), and a
        # driver that differs from the one some pool selected it with (the pools' driver_bad, which
        # also holds the unbound ones).  Hold-downs are per pool: only the running ones are looked at.
        unhealthy = int.from_bytes(state.advertised, "little") & int.from_bytes(state.mask, "little")
        reasons: dict[str, int] = {}
        for reason, fact in ((REASON_PF_LINK, _PF_LINK), (REASON_LINK, _LINK), (REASON_RDMA, _RDMA)):
            n = (unhealthy & int.from_bytes(self._facts[fact], "little")).bit_count()
            if n:
                reasons[reason] = n
        unbound = int.from_bytes(self._unbound, "little")
        driver_bad = int.from_bytes(self._driver_bad_any(), "little")
        pending: set[int] = set()
        for other in self._pools.values():
            pending.update(other.pending)
        recovering = int.from_bytes(accel.set_bits(bytes(self._nbytes), pending, True), "little")
        for reason, n in (
            (REASON_UNBOUND, (unhealthy & unbound).bit_count()),
            (REASON_DRIVER, (unhealthy & driver_bad & ~unbound).bit_count()),
            (REASON_RECOVERING, (unhealthy & recovering).bit_count()),
        ):
            if n:
                reasons[reason] = n
        bad = unhealthy.bit_count()
        return len(state.ids) - bad, bad, reasons

    def _driver_bad_any(self) -> bytes:
        """Return the devices whose driver some pool that lists them finds wrong (or none is bound)."""
        return accel.or_bitmaps([s.driver_bad for s in self._pools.values()], bytes(b"\xff" * self._nbytes))

    def counts_by_device(self, pool: str) -> tuple[int, int, dict[str, int]]:
        """Return what ``counts`` does, from ``reasons`` asked device by device (shared pools; its spec)."""
        state = self._pools[pool]
        bad = 0
        reasons: dict[str, int] = {}
        for i in accel.select_bits(state.advertised, state.mask):
            n = len(state.positions[i])  # a shared RDMA pool advertises several member IDs per device
            bad += n
            for r in self.reasons(self._devices[i].id):
                reasons[r] = reasons.get(r, 0) + n
        return len(state.ids) - bad, bad, reasons

    def unhealthy_devices(self, pool: str) -> tuple[str, ...]:
        """Return the IDs of the pool's devices advertised unhealthy (device IDs, not shared member IDs)."""
        state = self._pools[pool]
        return tuple(self._devices[i].id for i in accel.select_bits(state.advertised, state.mask))

    def next_deadline(self) -> float | None:
        """Return the clock time at which the earliest running hold-down ends, or ``None``."""
        deadlines = [
            since + state.policy.hold_down_s
            for state in self._pools.values()
            for since in state.pending.values()
        ]
        return min(deadlines) if deadlines else None

    def reasons(self, device_id: str) -> tuple[str, ...]:
        """Return why a device is (or is about to be reported) unhealthy; empty when nothing is wrong.

        These are facts, whatever the pools' policies enable; ``recovering`` means healthy again but
        still inside the hold-down of a pool that advertises it unhealthy.
        """
        i = self._index.get(device_id)
        if i is None:
            return ()
        out = []
        if _bit(self._facts[_PF_LINK], i):
            out.append(REASON_PF_LINK)
        if _bit(self._facts[_LINK], i):
            out.append(REASON_LINK)
        if _bit(self._facts[_RDMA], i):
            out.append(REASON_RDMA)
        now = self._devices[i].driver
        if now == "":
            out.append(REASON_UNBOUND)
        elif any(state.selected_driver[i] != now for state in self._pools_of.get(i, ())):
            out.append(REASON_DRIVER)
        if any(i in state.pending for state in self._pools_of.get(i, ())):
            out.append(REASON_RECOVERING)
        return tuple(out)

    # ----------------------------------------------------------------------------------------- rescans
    def replace(
        self, devices: Sequence[Device], pools: Sequence[Pool], index: Mapping[str, int] | None = None
    ) -> None:
        """Adopt a rescanned device table and pools, keeping facts and hold-downs of devices that remain.

        ``index``: the table's id → position of ``devices`` (``DeviceTable.index``), used, not copied.
        """
        old_devices = self._devices
        old = self._pools
        # Link and RDMA facts are keyed by name, so they carry over; drivers come from the new table.
        self._build(devices, pools, index)
        for name, state in self._pools.items():
            prev = old.get(name)
            if prev is None:
                continue  # a new pool: force-reported at the next collect
            # The driver a device was selected with sticks while it stays in the pool: a VF rebound
            # (iavf → vfio-pci) under a pool that does not filter by driver is "driver-changed", not
            # silently re-selected with whatever it is bound to now.
            # Not for a device a DRA claim rebinds (or gave back since the last rescan): that change is
            # ours, so it keeps the driver the table shows now.
            carried = False
            managed, given_back = self._managed, self._given_back
            for i_old, driver in prev.selected_driver.items():
                device_id = old_devices[i_old].id
                if (managed or given_back) and (device_id in managed or device_id in given_back):
                    continue
                i = self._index.get(device_id)
                if i is not None and i in state.selected_driver and state.selected_driver[i] != driver:
                    state.selected_driver[i] = driver
                    carried = True
            if carried:
                state.driver_bad = self._driver_bitmap(state, state.selected_driver)
                state.raw = self._raw(state)
            # Carry "advertised unhealthy", "last sent" and running hold-downs over by device id.
            adv = [self._index.get(old_devices[i].id) for i in accel.select_bits(prev.advertised, prev.mask)]
            sent = [self._index.get(old_devices[i].id) for i in accel.select_bits(prev.sent, prev.mask)]
            keep_adv = [i for i in adv if i is not None and i in state.positions]
            keep_sent = [i for i in sent if i is not None and i in state.positions]
            state.advertised = accel.or_bitmaps(
                [state.raw, accel.set_bits(bytes(self._nbytes), keep_adv, True)], state.mask
            )
            state.sent = accel.set_bits(bytes(self._nbytes), keep_sent, True)
            for i_old, since in prev.pending.items():
                i = self._index.get(old_devices[i_old].id)
                if i is not None and i in state.positions and not _bit(state.raw, i):
                    state.pending[i] = since
            # Devices advertised unhealthy before but healthy now and not yet pending start their hold-down.
            now = self._clock()
            for i in accel.diff_bitmaps(state.raw, state.advertised, state.mask):
                state.pending.setdefault(i, now)
            # Same members in the same order: only health changes need telling; otherwise the whole list
            # (and a report still owed, e.g. a replace before the first collect, stays owed).
            state.force = prev.force or state.ids != prev.ids
        # A device given back is an ordinary one again once a scan shows it on the driver it went back to.
        for device_id, driver in list(self._given_back.items()):
            i = self._index.get(device_id)
            if i is None or self._devices[i].driver == driver:
                del self._given_back[device_id]
