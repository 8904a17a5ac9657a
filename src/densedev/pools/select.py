"""Selectors: one device table → every resource pool, with the SR-IOV network device plugin's semantics.

Matching, as that plugin does it (see ``docs/config.md``):

* within one key the values are ORed, across keys they are ANDed; an absent key matches anything;
* with a list of selectors a device joins the pool if any selector matches it;
* a device belongs to at most one pool: the first pool in config order that selects it (the plugin's
  ``excludeAllocatedDevices``), so two pools never hand the same function to two pods;
* ``netDevice`` pools take PCI network functions and skip a PF whose VFs are enabled (its VFs are the
  devices); ``accelerator`` pools take any PCI function but a bridge; ``auxNetDevice`` pools take
  subfunctions only.

Speed: each selector is compiled (per selection) into list filters over frozensets, run in C-speed
comprehensions over the (sorted once) device list.  A selector naming devices (``pciAddresses``,
``pfNames``, ``rootDevices``) starts from an index of the table by that key instead of the whole list,
so a node with one pool per PF costs devices + pools, not devices times pools.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from itertools import groupby
from operator import attrgetter
from typing import Any

from ..model import (
    Config,
    Device,
    DeviceType,
    IndexRange,
    IndexSpans,
    Pool,
    PoolConfig,
    PoolMember,
    Role,
    Selector,
    SharedScope,
    VdpaType,
)
from ..printable import columns, listing

# Root ports and switch ports sit in the device table (discovery scans every PCI function) but are the
# fabric itself; an accelerator pool selecting by vendor alone must never take one.
_BRIDGE_CLASS = "06"
# PoolMember(...) is a Python-level __new__ per ID; the tuple constructor makes the same named tuple.
_make_member = partial(tuple.__new__, PoolMember)

Filter = Callable[[list[Device]], list[Device]]


def shared_id(device_id: str, k: int) -> str:
    """Return the ID of the ``k``-th share of a device in a shared RDMA pool: ``"<device id>/<k>"``."""
    return f"{device_id}/{k}"


def _natural(text: str) -> tuple[Any, ...]:
    # "mlx5_core.sf.10" after "mlx5_core.sf.9": subfunction names carry unpadded numbers.
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", text))


def _sort_key(d: Device) -> tuple[int, Any]:
    # PCI addresses are fixed-width lower-case hex, so plain string order is address order.
    return (1, _natural(d.id)) if d.role == Role.SF else (0, d.id)


class _Table:
    """What every pool's selection shares: the sorted device list, per-type bases, PF link types."""

    def __init__(self, devices: Sequence[Device]) -> None:
        # A scan's table is sorted by id already: sorting it again is one pass of comparisons.  The member
        # is held in a local: an enum attribute lookup per device would triple the cost of these passes.
        sf = Role.SF
        pci = [d for d in devices if d.role != sf]
        pci.sort(key=attrgetter("id"))
        sfs = [d for d in devices if d.role == sf]
        sfs.sort(key=lambda d: _natural(d.id))
        self.pci = pci
        self.sfs = sfs
        self._net: list[Device] | None = None
        self._accel: list[Device] | None = None
        self._pf_link: dict[str, str] | None = None
        self._indexes: dict[tuple[str, str], dict[str, list[Device]]] = {}
        self._positions: dict[str, dict[str, int]] = {}

    def base(self, device_type: DeviceType) -> list[Device]:
        """Return the devices a pool of ``device_type`` may take, before selectors, in stable order."""
        if device_type == DeviceType.AUX_NET_DEVICE:
            return self.sfs
        if device_type == DeviceType.ACCELERATOR:
            if self._accel is None:
                self._accel = [d for d in self.pci if not d.pci_class.startswith(_BRIDGE_CLASS)]
            return self._accel
        if self._net is None:
            pf = Role.PF
            self._net = [
                d for d in self.pci if d.pci_class.startswith("02") and not (d.role == pf and d.num_vfs > 0)
            ]
        return self._net

    def narrowed(self, device_type: DeviceType, key: str, values: Iterable[str]) -> list[Device]:
        """Return the base devices whose attribute ``key`` is one of ``values``, in base order."""
        index = self._indexes.get((device_type, key))
        if index is None:
            index = {}
            # A PF's VFs sit next to each other in address order: one dict step per run, not per device.
            for value, run in groupby(self.base(device_type), _KEY_OF.get(key) or attrgetter(key)):
                index.setdefault(value, []).extend(run)
            self._indexes[(device_type, key)] = index
        hits = [index[v] for v in set(values) if v in index]
        if len(hits) == 1:
            return list(hits[0])  # callers may sort what they are given; the index stays as built
        out = [d for hit in hits for d in hit]
        if len(hits) > 1:
            positions = self._positions.get(device_type)
            if positions is None:
                positions = {d.id: i for i, d in enumerate(self.base(device_type))}
                self._positions[device_type] = positions
            out.sort(key=lambda d: positions[d.id])
        return out

    def pf_link(self) -> dict[str, str]:
        """Return each function's link type by address, so a VF without a host netdev inherits its PF's."""
        if self._pf_link is None:
            self._pf_link = {d.id: d.link_type for d in self.pci if d.link_type}
        return self._pf_link

    def parent_link(self, parent: str) -> str:
        """Return the link type of function ``parent`` (``pf_link`` is built when first asked)."""
        return self.pf_link().get(parent, "")


def _type_reason(device_type: DeviceType, d: Device) -> str | None:
    """Return why a pool of ``device_type`` never takes ``d`` whatever its selectors, or None."""
    if device_type == DeviceType.AUX_NET_DEVICE:
        return None if d.role == Role.SF else "not a subfunction: auxNetDevice pools take SFs only"
    if d.role == Role.SF:
        return f"a subfunction: only auxNetDevice pools take SFs, this pool is {device_type}"
    if device_type == DeviceType.ACCELERATOR and d.pci_class.startswith(_BRIDGE_CLASS):
        return f"PCI class {d.pci_class} is a bridge (06xxxx): part of the fabric, never handed to a pod"
    if device_type == DeviceType.NET_DEVICE:
        if not d.pci_class.startswith("02"):
            return f"PCI class {d.pci_class} is not a network controller (02xxxx), as netDevice needs"
        if d.role == Role.PF and d.num_vfs > 0:
            return f"PF with {d.num_vfs} VFs enabled: netDevice pools skip it (its VFs are the devices)"
    return None


def _folded_pf_netdev(d: Device) -> str:
    return d.pf_netdev.lower()


# Derived keys ``narrowed`` can index by: the SR-IOV network device plugin compares pfNames with the
# PF's interface name case-insensitively (strings.EqualFold), so "ENS1F0#0-1" selects ens1f0's VFs.
_KEY_OF: dict[str, Callable[[Device], str]] = {"pf_netdev_folded": _folded_pf_netdev}


def _merge_ranges(ranges: Iterable[IndexRange], fold: bool = False) -> dict[str, IndexSpans | None]:
    """Fold ``name#indexes`` entries into name → indexes (None: every VF), unioning repeats of one name."""
    out: dict[str, IndexSpans | None] = {}
    for r in ranges:
        if fold:
            r = IndexRange(r.name.lower(), r.indexes)
        if r.name in out and out[r.name] is None:
            continue
        if r.indexes is None or r.name not in out:
            out[r.name] = r.indexes
        else:
            prev = out[r.name]
            out[r.name] = r.indexes | prev if prev is not None else None
    return out


def _range_filter(parent: Callable[[Device], str], ranges: dict[str, IndexSpans | None]) -> Filter:
    every = frozenset(name for name, indexes in ranges.items() if indexes is None)
    ranged = {name: indexes for name, indexes in ranges.items() if indexes is not None}
    empty = IndexSpans()
    return lambda devs: [d for d in devs if (p := parent(d)) in every or d.vf_index in ranged.get(p, empty)]


def _compile(sel: Selector, device_type: DeviceType, table: _Table) -> list[Filter] | None:
    """Turn a selector into list filters; None when it can never match (unsupported keys)."""
    if sel.pkeys or sel.ddp_profiles:
        return None
    filters: list[Filter] = []
    if sel.vendors:
        vendors = frozenset(sel.vendors)
        filters.append(lambda devs: [d for d in devs if d.vendor in vendors])
    if sel.devices:
        codes = frozenset(sel.devices)
        filters.append(lambda devs: [d for d in devs if d.device in codes])
    if sel.drivers:
        drivers = frozenset(sel.drivers)
        filters.append(lambda devs: [d for d in devs if d.driver in drivers])
    if sel.pci_addresses:
        addresses = frozenset(sel.pci_addresses)
        if device_type == DeviceType.AUX_NET_DEVICE:
            # A subfunction has no address of its own: the plugin matches its parent PCI function.
            filters.append(lambda devs: [d for d in devs if d.pf in addresses])
        else:
            filters.append(lambda devs: [d for d in devs if d.id in addresses])
    if sel.acpi_indexes:
        acpi = frozenset(int(a) for a in sel.acpi_indexes)
        filters.append(lambda devs: [d for d in devs if d.acpi_index in acpi])
    if sel.pf_names:
        filters.append(_range_filter(_folded_pf_netdev, _merge_ranges(sel.pf_names, fold=True)))
    if sel.root_devices:
        filters.append(_range_filter(attrgetter("pf"), _merge_ranges(sel.root_devices)))
    if sel.link_types:
        links = frozenset(sel.link_types)
        # Only a device without a host netdev asks its parent's: most never build that table.
        inherit = table.parent_link
        filters.append(lambda devs: [d for d in devs if (d.link_type or inherit(d.pf)) in links])
    if sel.is_rdma:
        filters.append(lambda devs: [d for d in devs if d.rdma_device])
    if sel.vdpa_type:
        vdpa = VdpaType(sel.vdpa_type).driver
        filters.append(lambda devs: [d for d in devs if d.vdpa_driver == vdpa])
    if sel.aux_types:
        aux_types = frozenset(sel.aux_types)
        filters.append(lambda devs: [d for d in devs if d.aux_type in aux_types])
    if sel.if_names:
        # The RDMA shared device plugin names a function by its first netdev (utils.GetNetNames()[0],
        # in directory order, which Go's ReadDir sorts, as the scan sorts netdevs).
        if_names = frozenset(sel.if_names)
        filters.append(lambda devs: [d for d in devs if d.netdevs and d.netdevs[0] in if_names])
    return filters


def _candidates(sel: Selector, device_type: DeviceType, table: _Table, base: list[Device]) -> list[Device]:
    """The part of ``base`` a selector that names devices can match (its filters still decide)."""
    if sel.pci_addresses:
        key = "pf" if device_type == DeviceType.AUX_NET_DEVICE else "id"
        return table.narrowed(device_type, key, sel.pci_addresses)
    if sel.pf_names:
        return table.narrowed(device_type, "pf_netdev_folded", (r.name.lower() for r in sel.pf_names))
    if sel.root_devices:
        return table.narrowed(device_type, "pf", (r.name for r in sel.root_devices))
    return base


def _select(pc: PoolConfig, table: _Table, taken: set[str]) -> list[Device]:
    """Return the devices any of the pool's selectors matches that no earlier pool took, in stable order."""
    base = table.base(pc.device_type)
    chosen: list[Device] | None = None
    for sel in pc.selectors:
        filters = _compile(sel, pc.device_type, table)
        if filters is None:
            continue
        devs = _candidates(sel, pc.device_type, table, base)
        if taken:
            # First match wins: what earlier pools took is out before the filters run over it.
            devs = [d for d in devs if d.id not in taken]
        for f in filters:
            devs = f(devs)
        if chosen is None:
            chosen = devs
        elif devs:
            seen = {d.id for d in chosen}
            chosen = chosen + [d for d in devs if d.id not in seen]
            chosen.sort(key=_sort_key)
    return chosen if chosen is not None else []


def build_pools(config: Config, devices: Sequence[Device]) -> tuple[Pool, ...]:
    """Select every pool's members from one device table (pool order = config order, members in ID order)."""
    table = _Table(devices)
    taken: set[str] = set()
    pools: list[Pool] = []
    for pc in config.pools:
        chosen = _select(pc, table, taken)
        if pc.rdma_shared > 0:
            # A shared pool hands out one RDMA device to many pods (rdmaHcaMax): it needs one to share.
            chosen = [d for d in chosen if d.rdma_device]
        chosen_ids = [d.id for d in chosen]
        if pc.rdma_shared > 0 and pc.rdma_scope == SharedScope.POOL:
            # rdmaHcaMax IDs for the whole resource, named as the RDMA shared device plugin names them;
            # each brings every HCA at allocation (alloc.respond), and is laid on one HCA in turn so
            # that every HCA's health and port state is watched through some ID.
            members = (
                tuple(PoolMember(str(k), chosen[k % len(chosen)]) for k in range(pc.rdma_shared))
                if chosen
                else ()
            )
        elif pc.rdma_shared > 0:
            shares = range(pc.rdma_shared)
            members = tuple(PoolMember(shared_id(d.id, k), d) for d in chosen for k in shares)
        else:
            members = tuple(map(_make_member, zip(chosen_ids, chosen, strict=True)))
        taken.update(chosen_ids)
        pools.append(Pool(pc, members, tuple(chosen) if pc.rdma_scope == SharedScope.POOL else ()))
    return tuple(pools)


# --- explain: the slow, talkative twin of the selection above -----------------------------------------


def _show(values: Iterable[object]) -> str:
    # Bounded: a selector may list thousands of names, and the reason is repeated per excluded device.
    return "[" + listing(values) + "]"


def _ranges_reason(key: str, value: str, vf_index: int, ranges: dict[str, IndexSpans | None]) -> str | None:
    if not value:
        return f"{key}: not a VF or SF (no parent PF)"
    if value not in ranges:
        return f"{key}: parent {value} not in {_show(ranges)}"
    allowed = ranges[value]
    if allowed is not None and vf_index not in allowed:
        return f"{key}: index {vf_index} of {value} not in the selected range"
    return None


def selector_reason(sel: Selector, device_type: DeviceType, d: Device, pf_link: dict[str, str]) -> str | None:
    """Return the first key of ``sel`` that rejects ``d`` and why, or None when the selector matches it."""
    if sel.pkeys:
        return "pKeys: not supported (the device table has no partition keys)"
    if sel.ddp_profiles:
        return "ddpProfiles: not supported (DDP profiles are not queried)"
    if sel.vendors and d.vendor not in sel.vendors:
        return f"vendors: {d.vendor} not in {_show(sel.vendors)}"
    if sel.devices and d.device not in sel.devices:
        return f"devices: {d.device} not in {_show(sel.devices)}"
    if sel.drivers and d.driver not in sel.drivers:
        return f"drivers: {d.driver or 'unbound'} not in {_show(sel.drivers)}"
    if sel.pci_addresses:
        address = d.pf if device_type == DeviceType.AUX_NET_DEVICE else d.id
        if address not in sel.pci_addresses:
            return f"pciAddresses: {address or 'no address'} not in {_show(sel.pci_addresses)}"
    if sel.acpi_indexes and str(d.acpi_index) not in sel.acpi_indexes:
        shown = d.acpi_index if d.acpi_index >= 0 else "none"
        return f"acpiIndexes: {shown} not in {_show(sel.acpi_indexes)}"
    if sel.pf_names:
        # Case-insensitive, as selection is (see _KEY_OF).
        why = _ranges_reason("pfNames", d.pf_netdev.lower(), d.vf_index, _merge_ranges(sel.pf_names, True))
        if why is not None:
            return why
    if sel.root_devices:
        why = _ranges_reason("rootDevices", d.pf, d.vf_index, _merge_ranges(sel.root_devices))
        if why is not None:
            return why
    if sel.link_types:
        link = d.link_type or pf_link.get(d.pf, "")
        if link not in sel.link_types:
            return f"linkTypes: {link or 'no link type'} not in {_show(sel.link_types)}"
    if sel.is_rdma and not d.rdma_device:
        return "isRdma: no RDMA device"
    if sel.vdpa_type and d.vdpa_driver != VdpaType(sel.vdpa_type).driver:
        return f"vdpaType: vDPA driver {d.vdpa_driver or 'none'} is not {VdpaType(sel.vdpa_type).driver}"
    if sel.aux_types and d.aux_type not in sel.aux_types:
        return f"auxTypes: {d.aux_type or 'none'} not in {_show(sel.aux_types)}"
    if sel.if_names and (not d.netdevs or d.netdevs[0] not in sel.if_names):
        return f"ifNames: {d.netdevs[0] if d.netdevs else 'no netdev'} not in {_show(sel.if_names)}"
    return None


def pool_reason(pc: PoolConfig, d: Device, pf_link: dict[str, str]) -> str | None:
    """Return why the pool's type and selectors reject ``d`` (other pools aside), or None if they take it."""
    why = _type_reason(pc.device_type, d)
    if why is not None:
        return why
    reasons = [selector_reason(sel, pc.device_type, d, pf_link) for sel in pc.selectors]
    if not reasons:
        return "no selector"
    if any(r is None for r in reasons):
        if pc.rdma_shared > 0 and not d.rdma_device:
            return "no RDMA device to share (rdmaShared pool)"
        return None
    if len(reasons) == 1:
        return reasons[0]
    return "no selector matches: " + "; ".join(f"selectors[{i}] {r}" for i, r in enumerate(reasons))


def _describe(member_id: str, d: Device) -> dict[str, Any]:
    return {
        "id": member_id,
        "device_id": d.id,  # the device behind the member ID (scan --json's "id")
        "role": d.role,
        "vendor": d.vendor,
        "device_code": d.device,
        "driver": d.driver or None,
        "numa": d.numa_node if d.numa_node >= 0 else None,
        "pf": d.pf or None,
        "vf_index": d.vf_index if d.vf_index >= 0 else None,
        "netdev": d.netdevs[0] if d.netdevs else None,
        "link_type": d.link_type or None,
        "rdma_device": d.rdma_device or None,
        "pcie_root": d.pcie_root or None,
    }


def explain(config: Config, devices: Sequence[Device]) -> dict[str, Any]:
    """Return the ``densedev scan --config --json`` object: each pool's devices and why others are not."""
    pools = build_pools(config, devices)
    table = _Table(devices)
    ordered = table.pci + table.sfs
    pf_link = table.pf_link()
    owner: dict[str, str] = {}
    out_pools: list[dict[str, Any]] = []
    for pool in pools:
        pc = pool.config
        members = {m.device.id for m in pool.members}
        excluded: list[dict[str, str]] = []
        for d in ordered:
            if d.id in members:
                continue
            why = pool_reason(pc, d, pf_link)
            if why is None:
                first = owner.get(d.id, "an earlier pool")
                why = f"taken by {first} (a device joins the first pool that selects it)"
            excluded.append({"id": d.id, "reason": why})
        for d_id in members:
            owner.setdefault(d_id, pc.full_name)
        out_pools.append(
            {
                "resource": pc.full_name,
                "device_type": pc.device_type,
                "rdma_shared": pc.rdma_shared,
                "count": len(pool.members),
                "devices": [_describe(m.id, m.device) for m in pool.members],
                "excluded": excluded,
            }
        )
    return {
        "devices": len(devices),
        "pools": out_pools,
        "unpooled": [d.id for d in ordered if d.id not in owner],
        "warnings": list(config.warnings),
    }


def format_explain(result: dict[str, Any], *, max_excluded: int = 3) -> str:
    """Render an ``explain`` result for people: a device table per pool and exclusion reasons counted."""
    lines: list[str] = []
    for w in result.get("warnings", ()):
        lines.append(f"warning: {w}")
    cols = ("id", "numa", "pf", "vf_index", "driver", "netdev", "rdma_device")
    for pool in result["pools"]:
        lines.append(f"{pool['resource']} ({pool['device_type']}): {pool['count']} IDs")
        rows = [[_cell(dev[c]) for c in cols] for dev in pool["devices"]]
        if rows:
            lines.extend(columns([cols, *rows], indent="  "))
        by_reason: dict[str, list[str]] = {}
        for ex in pool["excluded"]:
            by_reason.setdefault(ex["reason"], []).append(ex["id"])
        for reason, ids in sorted(by_reason.items(), key=lambda kv: -len(kv[1])):
            shown = ", ".join(ids[:max_excluded]) + (", ..." if len(ids) > max_excluded else "")
            lines.append(f"  excluded {len(ids)}: {reason} ({shown})")
        lines.append("")
    unpooled = result.get("unpooled", [])
    lines.append(f"{result['devices']} devices, {len(unpooled)} in no pool")
    return "\n".join(lines)


def _cell(value: object) -> str:
    return "-" if value is None else str(value)
