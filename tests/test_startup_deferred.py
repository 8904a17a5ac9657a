"""Work moved off the path to the first list still happens: GetPreferredAllocation's ranking data.

A pool's allocator builds the topology and address lookup tables GetPreferredAllocation ranks with at its
first call or when the daemon prepares it after the first lists (~5 ms per 4,096 members), not when it
is made; the answers are the same either way, and a new membership is never ranked with the old tables.
"""

from __future__ import annotations

from pathlib import Path

from helpers.devices import dev, pool_of
from helpers.node import Node
from helpers.waiting import eventually

from densedev import accel
from densedev.alloc.respond import LOOKUP_MIN_MEMBERS, AllocationSettings, PoolAllocator
from densedev.daemon import Daemon
from densedev.model import Device, PoolConfig
from densedev.testing.kubelet import KubeletEmulator

CONFIG = PoolConfig("p", "example.com", preferred="pack")
PFS = ("0000:10:00.0", "0000:20:00.0")
DEVICES = [
    dev(f"0000:{0x10 * (1 + p):02x}:01.{v}", pf=PFS[p], numa_node=p, pcie_root=f"pci0000:{p:02x}")
    for p in range(2)
    for v in range(4)
]


def allocator(devices: list[Device]) -> PoolAllocator:
    settings = AllocationSettings(cdi_dir=None, devinfo_dir=None, dev_root=Path("/nonexistent"))
    return PoolAllocator(pool_of(CONFIG, devices), settings, lambda _id: True)


def test_ranking_is_built_at_the_first_preferred_call_and_answers_as_when_prepared() -> None:
    lazy, prepared = allocator(DEVICES), allocator(DEVICES)
    prepared.prepare()
    assert lazy._ranking is None and prepared._ranking is not None
    ids = [d.id for d in DEVICES]
    for size in range(1, len(ids) + 1):
        assert lazy.preferred(ids, [], size) == prepared.preferred(ids, [], size)
    assert lazy._ranking == prepared._ranking


def test_a_new_membership_is_ranked_with_new_tables() -> None:
    a = allocator(DEVICES)
    a.prepare()
    # The PF on NUMA node 1 only: its VFs, packed, fill the answer; the old tables indexed other devices.
    a.update(pool_of(CONFIG, DEVICES[4:]))
    assert a._ranking is None
    ids = [d.id for d in DEVICES[4:]]
    assert sorted(a.preferred(ids, [], 2)) == sorted(allocator(DEVICES[4:]).preferred(ids, [], 2))


async def test_the_daemon_prepares_each_pool_after_its_start(
    node: Node, kubelet: KubeletEmulator, daemon: Daemon
) -> None:
    runtimes = list(daemon.pools.values())
    assert runtimes
    # Nothing asks for a preferred allocation here: the daemon's own timer (PREPARE_DELAY_S) builds them.
    await eventually(lambda: all(r.allocator._ranking is not None for r in runtimes), "ranking prepared")


def test_only_a_pool_of_thousands_keeps_an_address_table() -> None:
    # The table is 256 KiB per PCI domain whatever the pool's size: a pool of 8 ranks through its dict
    # (1,000 such pools held 250 MiB of tables); one of 4,096 gets it, where it saves hashing the IDs.
    small = allocator(DEVICES)
    small.prepare()
    assert small._ranking is not None and small._ranking[1] == b""
    many = [
        dev(f"0000:{0x10 + i // 256:02x}:{(i % 256) >> 3:02x}.{i & 7}", pf=PFS[0], pcie_root="pci0000:00")
        for i in range(LOOKUP_MIN_MEMBERS)
    ]
    large = allocator(many)
    large.prepare()
    assert large._ranking is not None
    assert (large._ranking[1] != b"") == (accel.IMPLEMENTATION == "cython")
    # With or without the table, the same answer (the twin, which never uses one, is the spec).
    available = [d.id for d in reversed(many)]
    answer = large.preferred(available, [], 5)
    large._ranking = (large._ranking[0], b"")
    assert large.preferred(available, [], 5) == answer and len(set(answer)) == 5
