"""GetPreferredAllocation: validity, must-include, NUMA/PF locality under pack, PF diversity under spread."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
from helpers.devices import dev, pool_of
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from densedev.alloc.respond import POLICIES, AllocationSettings, PoolAllocator, build_lookup, topology_of
from densedev.model import Device, PoolConfig, Role

PACK, SPREAD, NONE = POLICIES["pack"], POLICIES["spread"], POLICIES["none"]


@dataclass
class Scenario:
    devices: list[Device]
    available: list[str]
    must: list[str]
    size: int
    use_lookup: bool = True

    @property
    def index(self) -> dict[str, int]:
        return {d.id: i for i, d in enumerate(self.devices)}

    @property
    def topology(self) -> bytes:
        return topology_of(self.devices)

    def by_id(self) -> dict[str, Device]:
        return {d.id: d for d in self.devices}


def group(d: Device) -> str:
    return d.pf or d.id


@st.composite
def scenarios(draw: st.DrawFn, numas: tuple[int, ...] = (-1, 0, 1), musts: bool = True) -> Scenario:
    """A node with a few PFs (NUMA node, PCIe root, VF count) and a few standalone functions."""
    devices: list[Device] = []
    for p in range(draw(st.integers(1, 6))):
        numa = draw(st.sampled_from(numas))
        root = f"pci0000:{draw(st.integers(0, 2)):02x}"
        pf = f"0000:{0x10 + p:02x}:00.0"
        for v in range(draw(st.integers(1, 10))):
            devices.append(
                dev(f"0000:{0x10 + p:02x}:{1 + v // 8:02x}.{v % 8}", pf=pf, numa_node=numa, pcie_root=root)
            )
    for s in range(draw(st.integers(0, 3))):
        devices.append(
            dev(
                f"0000:{0x80 + s:02x}:00.0",
                role=Role.PCI,
                pf="",
                vf_index=-1,
                numa_node=draw(st.sampled_from(numas)),
            )
        )
    ids = [d.id for d in devices]
    available = draw(st.lists(st.sampled_from(ids), unique=True, max_size=len(ids)))
    must = draw(st.lists(st.sampled_from(available), unique=True, max_size=3)) if musts and available else []
    size = draw(st.integers(0, len(ids) + 2))
    return Scenario(devices, available, must, size, draw(st.booleans()))


def pick(impl: ModuleType, s: Scenario, policy: int) -> tuple[str, ...]:
    lookup = build_lookup(s.index) if s.use_lookup else b""
    result: tuple[str, ...] = impl.pick_devices(
        s.available, s.must, s.size, s.index, s.topology, policy, lookup
    )
    return result


QUICK = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@QUICK
@given(s=scenarios(), policy=st.sampled_from([PACK, SPREAD, NONE]))
def test_extension_and_twin_agree(both: tuple[ModuleType, ModuleType], s: Scenario, policy: int) -> None:
    fast, twin = both
    assert pick(fast, s, policy) == pick(twin, s, policy)


@QUICK
@given(s=scenarios(), policy=st.sampled_from([PACK, SPREAD, NONE]), data=st.data())
def test_extension_and_twin_agree_on_messy_requests(
    both: tuple[ModuleType, ModuleType], s: Scenario, policy: int, data: st.DataObject
) -> None:
    # Repeated IDs and IDs the pool never advertised: no sane kubelet sends them, both must cope alike.
    strangers = ["0000:ff:1f.7", "mlx5_core.sf.99", ""]
    s.available = s.available + data.draw(st.lists(st.sampled_from(s.available + strangers), max_size=6))
    s.must = s.must + s.must[:1] + data.draw(st.lists(st.sampled_from(strangers), max_size=2))
    fast, twin = both
    result = pick(fast, s, policy)
    assert result == pick(twin, s, policy)
    assert len(result) == len(set(result))
    assert list(result[: len(dict.fromkeys(s.must))]) == list(dict.fromkeys(s.must))


@QUICK
@given(s=scenarios(), policy=st.sampled_from([PACK, SPREAD, NONE]))
def test_lookup_table_resolves_like_the_dict(impl: ModuleType, s: Scenario, policy: int) -> None:
    s.use_lookup = True
    with_table = pick(impl, s, policy)
    s.use_lookup = False
    assert with_table == pick(impl, s, policy)


@QUICK
@given(s=scenarios(), policy=st.sampled_from([PACK, SPREAD, NONE]))
def test_answer_is_valid(impl: ModuleType, s: Scenario, policy: int) -> None:
    result = pick(impl, s, policy)
    assert len(result) == len(set(result)), "duplicate IDs"
    assert set(result) <= set(s.available) | set(s.must), "an ID that is not available"
    assert list(result[: len(s.must)]) == s.must, "must-includes first, all of them"
    assert len(result) == max(len(s.must), min(s.size, len(set(s.available) | set(s.must))))


@QUICK
@given(s=scenarios(musts=False))
def test_pack_stays_on_one_numa_node_when_one_can_hold_the_request(impl: ModuleType, s: Scenario) -> None:
    by_id = s.by_id()
    free_per_numa = Counter(by_id[i].numa_node for i in s.available)
    result = pick(impl, s, PACK)
    if free_per_numa and max(free_per_numa.values()) >= s.size:
        assert len({by_id[i].numa_node for i in result}) <= 1


@QUICK
@given(s=scenarios())
def test_pack_follows_the_must_includes_numa_node(impl: ModuleType, s: Scenario) -> None:
    by_id = s.by_id()
    must_numas = {by_id[i].numa_node for i in s.must}
    if len(must_numas) != 1:
        return
    (numa,) = must_numas
    free_there = sum(1 for i in s.available if i not in s.must and by_id[i].numa_node == numa)
    result = pick(impl, s, PACK)
    if free_there >= s.size - len(s.must):
        assert {by_id[i].numa_node for i in result} <= {numa}


@QUICK
@given(s=scenarios(numas=(0,), musts=False))
def test_pack_uses_one_pf_when_one_can_hold_the_request(impl: ModuleType, s: Scenario) -> None:
    by_id = s.by_id()
    free_per_pf = Counter(group(by_id[i]) for i in s.available)
    result = pick(impl, s, PACK)
    if free_per_pf and max(free_per_pf.values()) >= s.size:
        assert len({group(by_id[i]) for i in result}) <= 1


@QUICK
@given(s=scenarios(numas=(0,)))
def test_pack_fills_the_must_includes_pf_first(impl: ModuleType, s: Scenario) -> None:
    by_id = s.by_id()
    must_pfs = {group(by_id[i]) for i in s.must}
    if len(must_pfs) != 1:
        return
    (pf,) = must_pfs
    free_there = sum(1 for i in s.available if i not in s.must and group(by_id[i]) == pf)
    result = pick(impl, s, PACK)
    if free_there >= s.size - len(s.must):
        assert {group(by_id[i]) for i in result} == {pf}


@QUICK
@given(s=scenarios(numas=(1,), musts=False))
def test_spread_takes_one_device_per_pf_first(impl: ModuleType, s: Scenario) -> None:
    by_id = s.by_id()
    pfs_available = {group(by_id[i]) for i in s.available}
    result = pick(impl, s, SPREAD)
    assert len({group(by_id[i]) for i in result}) == min(len(result), len(pfs_available))


@QUICK
@given(s=scenarios(musts=False))
def test_spread_is_numa_aligned(impl: ModuleType, s: Scenario) -> None:
    by_id = s.by_id()
    free_per_numa = Counter(by_id[i].numa_node for i in s.available)
    result = pick(impl, s, SPREAD)
    if free_per_numa and max(free_per_numa.values()) >= s.size:
        assert len({by_id[i].numa_node for i in result}) <= 1


@QUICK
@given(s=scenarios())
def test_none_is_must_then_kubelet_order(impl: ModuleType, s: Scenario) -> None:
    rest = [i for i in s.available if i not in s.must]
    expected = (s.must + rest[: max(0, s.size - len(s.must))]) if s.size > len(s.must) else s.must
    assert list(pick(impl, s, NONE)) == expected


# -- exact answers on a realistic node -------------------------------------------------------------


def node() -> list[Device]:
    """Two NUMA nodes; NUMA 0: PFs 3b:00.0 (4 free VFs), 3b:00.1 (2); NUMA 1: 86:00.0 (8), 86:00.1 (8)."""
    out: list[Device] = []
    for pf, numa, count, root in (
        ("0000:3b:00.0", 0, 4, "pci0000:3a"),
        ("0000:3b:00.1", 0, 2, "pci0000:3a"),
        ("0000:86:00.0", 1, 8, "pci0000:85"),
        ("0000:86:00.1", 1, 8, "pci0000:85"),
    ):
        bus = pf[:8]
        fn = int(pf[-1])
        for v in range(count):
            out.append(dev(f"{bus}{2 + fn * 2 + v // 8:02x}.{v % 8}", pf=pf, numa_node=numa, pcie_root=root))
    return out


@pytest.fixture
def allocators(tmp_path: Path) -> dict[str, PoolAllocator]:
    s = AllocationSettings(cdi_dir=None, devinfo_dir=None, dev_root=tmp_path)
    return {
        p: PoolAllocator(pool_of(PoolConfig("vf", "example.com", preferred=p), node()), s, lambda _id: True)
        for p in POLICIES
    }


def test_pack_picks_the_best_fitting_pf(allocators: dict[str, PoolAllocator]) -> None:
    ids = [d.id for d in node()]
    # NUMA 1 has most free devices; both its PFs hold 3, the tie goes to the lower PF id.
    assert allocators["pack"].preferred(ids, [], 3) == ["0000:86:02.0", "0000:86:02.1", "0000:86:02.2"]


def test_pack_stays_with_the_must_include(allocators: dict[str, PoolAllocator]) -> None:
    ids = [d.id for d in node()]
    got = allocators["pack"].preferred(ids, ["0000:3b:02.1"], 4)
    assert got == ["0000:3b:02.1", "0000:3b:02.0", "0000:3b:02.2", "0000:3b:02.3"]
    # the PF runs out: continue on the same NUMA node (its other PF), not on the bigger node 1
    got = allocators["pack"].preferred(ids, ["0000:3b:02.1"], 6)
    assert got[4:] == ["0000:3b:04.0", "0000:3b:04.1"]


def test_spread_takes_one_vf_per_pf(allocators: dict[str, PoolAllocator]) -> None:
    ids = [d.id for d in node()]
    assert allocators["spread"].preferred(ids, [], 2) == ["0000:86:02.0", "0000:86:04.0"]
    got = allocators["spread"].preferred(ids, ["0000:3b:02.0"], 2)
    assert got == ["0000:3b:02.0", "0000:3b:04.0"]


def test_none_keeps_the_kubelet_order(allocators: dict[str, PoolAllocator]) -> None:
    ids = [d.id for d in reversed(node())]
    assert allocators["none"].preferred(ids, ["0000:3b:02.0"], 3) == ["0000:3b:02.0", ids[0], ids[1]]


def test_bad_input_is_refused_clearly(impl: ModuleType) -> None:
    with pytest.raises(ValueError, match="policy 7"):
        impl.pick_devices([], [], 1, {}, b"", 7)
    with pytest.raises(ValueError, match="13 bytes"):
        impl.pick_devices([], [], 1, {}, b"\0" * 13, 0)
    with pytest.raises(ValueError, match="NUMA node 5000"):
        impl.pick_devices(["a"], [], 1, {"a": 0}, (5000).to_bytes(4, "little") + bytes(8), 0)
    with pytest.raises(ValueError, match="beyond the topology"):
        impl.pick_devices(["a"], [], 1, {"a": 3}, bytes(12), 0)
    with pytest.raises(ValueError, match="lookup is 5 bytes"):
        impl.pick_devices(["a"], [], 1, {"a": 0}, bytes(12), 0, b"12345")
    with pytest.raises(ValueError, match="beyond the topology"):
        impl.pick_devices(["0000:00:01.0"], [], 1, {}, bytes(12), 0, build_lookup({"0000:00:01.0": 9}))


def test_lookup_parses_only_the_kernels_spelling(impl: ModuleType) -> None:
    ids = ["0000:3b:00.2", "0000:3b:1f.7", "ffff:ff:00.0"]
    index = {i: n for n, i in enumerate(ids)}
    lookup = build_lookup(index)
    assert len(lookup) == 2 * (4 + 4 * 65536)  # one block per PCI domain
    topo = bytes(12 * len(ids))
    for i in ids:
        assert impl.pick_devices([i], [], 1, index, topo, NONE, lookup) == (i,)
    # not canonical: never the table; unknown to the dict as well, so it ranks last as an unknown ID
    for odd in ("0000:3B:00.2", "0000:3b:20.0", "0000:3b:00.8", " 000:3b:00.2", "0000-3b:00.2"):
        assert impl.pick_devices([odd, ids[0]], [], 2, index, topo, NONE, lookup) == (ids[0], odd)
