"""ResourceSlices of one node: pure functions from pools, health and withheld devices to API objects.

Layout (resource.k8s.io ResourcePool and ResourceSlice, api v0.35 resource/v1/types.go):

* one pool per node, named after the node, ``spec.nodeName`` set: node-local devices, as every
  node-local driver publishes them;
* split into slices of at most ``MAX_DEVICES`` (128) devices, or ``MAX_DEVICES_TAINTED`` (64) when devices
  may carry taints (the 1.35+ limit for a slice with any tainted device; we cannot tell 1.34 from 1.35
  by the API version, so the lower limit holds whenever taints are on);
* **stable assignment**: a device's slice depends only on where it sits among the DRA pools' members of
  its PF (VFs are grouped by PF, then cut into fixed chunks), never on health or on what is withheld.
  Withdrawing a PF's 256 VFs rewrites that PF's two slices and no other; a device never moves between
  slices while the pools stay as they are, so slices can be rewritten in place one by one at the same
  pool generation without a consumer ever seeing a device twice (the generation moves only when the set
  of slices or a device's slice changes, see ``publisher.py``);
* a slice whose every device is withdrawn stays, empty: the slice count and names stay put, and an
  empty pool differs from no pool for the scheduler (dra-lib resourceslice ``Pool.Slices`` doc).

Attributes: unprefixed names live in the driver's domain (resource.k8s.io QualifiedName: a C identifier
of at most 32 characters, optionally ``<DNS subdomain>/``); string values hold at most 64 characters, so
longer ones are left out rather than refused by the API server.  v1 (1.34+) devices are flat; v1beta1
(1.32-1.33) wraps attributes in ``basic`` and gets neither taints nor the standard
``resource.kubernetes.io/pcieRoot`` attribute (defined by dra-lib from 1.34).
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from ..model import Device, Pool, PoolApi, Role
from . import names

GROUP = "resource.k8s.io"
MAX_DEVICES = 128  # devices per slice (ResourceSliceMaxDevices)
MAX_DEVICES_TAINTED = 64  # 1.35+: per slice when any device has taints (ResourceSliceMaxDevicesWithTaints…)
MAX_STRING = 64  # DeviceAttribute string / version values
MAX_NAME = 253  # metadata.name: a DNS subdomain
TAINT_KEY = "unhealthy"  # "<driver>/unhealthy": a label name, as DeviceTaint.key must be
LABEL_NODE = "densedev.io/node"  # lets a reader find our slices without parsing names


class ApiVersion(Enum):
    """The resource.k8s.io version slices are written in: v1 (1.34+) or v1beta1 (1.32-1.33)."""

    V1 = "v1"
    V1BETA1 = "v1beta1"


@dataclass(frozen=True)
class SliceGroup:
    """The fixed set of device positions one slice holds: its name and its members in order."""

    name: str
    members: tuple[tuple[str, Device, str], ...]  # (DRA device name, device, pool's full resource name)


@dataclass(frozen=True)
class SliceState:
    """What one slice shows right now: its name and, in order, each device shown and whether tainted."""

    name: str
    devices: tuple[tuple[str, bool], ...]


def dra_pools(pools: Iterable[Pool]) -> tuple[Pool, ...]:
    """Return the pools the config serves through DRA (``"api": "dra"``), in config order."""
    return tuple(p for p in pools if p.config.api is PoolApi.DRA)


def slice_name(node: str, driver: str, suffix: str) -> str:
    """Return a slice's name: node, driver and group, hashed down when longer than a DNS subdomain allows."""
    name = f"{node}-{driver.replace('.', '-')}-{suffix}"
    if len(name) <= MAX_NAME:
        return name
    digest = hashlib.sha256(f"{node}/{driver}".encode()).hexdigest()[:16]
    return f"{node[: MAX_NAME - len(suffix) - 18].rstrip('.-')}-{digest}-{suffix}"


def plan(
    node: str, driver: str, pools: Sequence[Pool], per_slice: int = MAX_DEVICES
) -> tuple[SliceGroup, ...]:
    """Assign every member of ``pools`` to a slice, stably: VFs by PF then in chunks, other functions last.

    Members whose ID is no PCI address (subfunctions, shared RDMA IDs) have no DRA name and are left
    out; the config refuses such pools with ``"api": "dra"``.
    """
    by_parent: dict[str, list[tuple[str, Device, str]]] = {}
    for pool in pools:
        full = pool.config.full_name
        for m in pool.members:
            try:
                name = names.device_name(m.id)
            except ValueError:
                continue
            d = m.device
            parent = d.pf if d.role == Role.VF and d.pf else ""
            by_parent.setdefault(parent, []).append((name, d, full))
    groups: list[SliceGroup] = []
    # PFs in address order, then the functions that are not VFs ("" sorts first, so it is put last).
    for parent in sorted(by_parent, key=lambda p: (p == "", p)):
        members = sorted(by_parent[parent], key=lambda t: t[1].id)
        tag = names.device_name(parent)[len(names.PREFIX) :] if parent else "fn"
        for k in range(0, len(members), per_slice):
            suffix = f"{'pf-' if parent else ''}{tag}-{k // per_slice}"
            groups.append(SliceGroup(slice_name(node, driver, suffix), tuple(members[k : k + per_slice])))
    return tuple(groups)


def _valid(value: str) -> bool:
    return bool(value) and len(value) <= MAX_STRING


def _string(attrs: dict[str, Any], key: str, value: str) -> None:
    if _valid(value):
        attrs[key] = {"string": value}


def device_attributes(d: Device, full_name: str, version: ApiVersion) -> dict[str, Any]:
    """Return the attributes of one device (QualifiedName → exactly one of string, int, bool)."""
    a: dict[str, Any] = {}
    _string(a, "resourceName", full_name)
    _string(a, "pciAddress", d.id)
    _string(a, "pfName", d.pf_netdev)
    _string(a, "pfPciAddress", d.pf)
    if d.role == Role.VF and d.vf_index >= 0:
        a["vfIndex"] = {"int": d.vf_index}
    _string(a, "vendor", d.vendor)
    _string(a, "deviceID", d.device)
    _string(a, "driver", d.driver)
    _string(a, "linkType", d.link_type)
    if d.numa_node >= 0:
        a["numaNode"] = {"int": d.numa_node}
        # The de-facto cross-driver NUMA attribute (dranet, dra-driver-sriov): matchAttribute across drivers.
        a["dra.net/numaNode"] = {"int": d.numa_node}
    a["rdma"] = {"bool": bool(d.rdma_device)}
    _string(a, "rdmaDevice", d.rdma_device)
    if d.netdevs:
        _string(a, "netdev", d.netdevs[0])
    if version is ApiVersion.V1:
        # "pci<domain>:<bus>" of the root complex, as dra-lib's deviceattribute (1.34+) defines it.
        _string(a, "resource.kubernetes.io/pcieRoot", d.pcie_root)
    # Multus reads these two from the allocated device to find the network attachment's resource.
    _string(a, "k8s.cni.cncf.io/resourceName", full_name)
    _string(a, "k8s.cni.cncf.io/deviceID", d.id)
    return a


class _Attributes:
    """Builds ``device_attributes`` results, sharing what the functions of one PF have in common.

    Of a VF's ~17 attributes only its address, index, netdev and RDMA device are its own: the rest
    (pool, PF, vendor, driver, NUMA node, PCIe root) are one dict per PF, copied, and the values are
    objects shared between devices.  At 65,536 devices, calling ``device_attributes`` for each was
    1.3 s of a node's first publish; equal results, key order included (tests pin it).
    """

    def __init__(self, version: ApiVersion) -> None:
        self.version = version
        self._templates: dict[tuple[Any, ...], dict[str, Any]] = {}
        self._ints: dict[int, dict[str, int]] = {}

    def __call__(self, d: Device, full_name: str) -> dict[str, Any]:
        """Return what ``device_attributes(d, full_name, version)`` returns."""
        vf = d.role == Role.VF
        key: tuple[Any, ...] = (full_name, d.pf_netdev, d.pf, d.vendor, d.device, d.driver, d.link_type)
        key += (d.numa_node, d.pcie_root, vf)
        template = self._templates.get(key)
        if template is None:
            # Every per-device key present (in its place) with a stand-in value, replaced below.
            stand_in = d._replace(id="-", vf_index=0, rdma_device="-", netdevs=("-",))
            template = self._templates[key] = device_attributes(stand_in, full_name, self.version)
        a = dict(template)
        if _valid(d.id):
            a["pciAddress"] = a["k8s.cni.cncf.io/deviceID"] = {"string": d.id}
        else:
            del a["pciAddress"], a["k8s.cni.cncf.io/deviceID"]
        if vf:
            if d.vf_index >= 0:
                index = self._ints.get(d.vf_index)
                if index is None:
                    index = self._ints[d.vf_index] = {"int": d.vf_index}
                a["vfIndex"] = index
            else:
                del a["vfIndex"]
        a["rdma"] = _TRUE if d.rdma_device else _FALSE
        if _valid(d.rdma_device):
            a["rdmaDevice"] = {"string": d.rdma_device}
        else:
            del a["rdmaDevice"]
        if d.netdevs and _valid(d.netdevs[0]):
            a["netdev"] = {"string": d.netdevs[0]}
        else:
            del a["netdev"]
        return a


_TRUE, _FALSE = {"bool": True}, {"bool": False}


class SliceBuilder:
    """Renders a node's slices from a fixed plan, caching each device's rendering across health changes."""

    def __init__(
        self,
        node: str,
        driver: str,
        pools: Sequence[Pool],
        *,
        version: ApiVersion = ApiVersion.V1,
        taints: bool = False,
    ) -> None:
        self.node = node
        self.driver = driver
        self.version = version
        # Taints exist on v1 only here: v1beta1 slices withdraw unhealthy devices instead.
        self.taints = taints and version is ApiVersion.V1
        self.per_slice = MAX_DEVICES_TAINTED if self.taints else MAX_DEVICES
        self.groups = plan(node, driver, pools, self.per_slice)
        self.by_name = {g.name: g for g in self.groups}
        # Every slice as shown with nothing unhealthy or withheld, and which slice holds each device:
        # a change then costs the devices it names, not a pass over the node (16k devices: 6 ms).
        self._full = tuple(
            SliceState(g.name, tuple((name, False) for name, _d, _f in g.members)) for g in self.groups
        )
        self._group_of = {d.id: k for k, g in enumerate(self.groups) for _n, d, _f in g.members}
        # The sets of the last states() call and what every slice showed for them.
        self._last: tuple[frozenset[str], frozenset[str], list[SliceState]] | None = None
        self._devices: dict[str, dict[str, Any]] = {}
        self._attributes = _Attributes(self.version)
        self._taint = [{"key": f"{driver}/{TAINT_KEY}", "effect": "NoSchedule"}]

    def states(
        self, unhealthy: Collection[str] = (), withheld: Collection[str] = ()
    ) -> tuple[SliceState, ...]:
        """Return what every slice shows for these unhealthy and withheld device IDs (PCI addresses)."""
        bad, held = frozenset(unhealthy), frozenset(withheld)
        group_of = self._group_of
        last = self._last
        if last is None:
            out = list(self._full)
            changed: Iterable[str] = (i for ids in (bad, held) for i in ids)
        else:
            # Only the slices of the devices that changed since the last call are shown anew: the
            # publisher asks at every pass (a write's end makes one), and with a 65,536-device node
            # mostly down, going over every unhealthy ID each time was 20 ms of the loop per pass.
            last_bad, last_held, out = last
            if bad is last_bad and held is last_held:
                return tuple(out)
            out = list(out)
            changed = (i for diff in (bad ^ last_bad, held ^ last_held) for i in diff)
        touched = {group_of[i] for i in changed if i in group_of}
        taints = self.taints
        for k in sorted(touched):
            g = self.groups[k]
            shown: list[tuple[str, bool]] = []
            for name, d, _full in g.members:
                if d.id in held:
                    continue  # held by a pod under the other API (ownership): not offered at all
                sick = d.id in bad
                if sick and not taints:
                    continue
                shown.append((name, sick))
            out[k] = SliceState(g.name, tuple(shown))
        self._last = (bad, held, out)
        return tuple(out)

    def _device(self, name: str, d: Device, full: str, tainted: bool) -> dict[str, Any]:
        entry = self._devices.get(name)
        if entry is None:
            attrs = self._attributes(d, full)
            entry = {"name": name, "attributes": attrs}
            if self.version is ApiVersion.V1BETA1:
                entry = {"name": name, "basic": {"attributes": attrs}}
            self._devices[name] = entry
        return {**entry, "taints": self._taint} if tainted else entry

    def render(
        self,
        state: SliceState,
        generation: int,
        count: int,
        owner: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Return the ResourceSlice object of one slice state at a pool generation and slice count."""
        g = self.by_name[state.name]
        members = {name: (d, full) for name, d, full in g.members}
        devices = [self._device(name, *members[name], tainted) for name, tainted in state.devices]
        metadata: dict[str, Any] = {"name": state.name, "labels": {LABEL_NODE: _label_value(self.node)}}
        if owner is not None:
            # The Node owns its slices: they go with it (what the official helper sets).
            metadata["ownerReferences"] = [owner]
        return {
            "apiVersion": f"{GROUP}/{self.version.value}",
            "kind": "ResourceSlice",
            "metadata": metadata,
            "spec": {
                "driver": self.driver,
                "pool": {"name": self.node, "generation": generation, "resourceSliceCount": count},
                "nodeName": self.node,
                "devices": devices,
            },
        }

    def render_all(
        self,
        states: Sequence[SliceState],
        generation: int = 1,
        owner: dict[str, Any] | None = None,
    ) -> list[dict[str, Any]]:
        """Return every slice of ``states`` at one generation."""
        return [self.render(s, generation, len(states), owner) for s in states]


def _label_value(text: str) -> str:
    # Label values are at most 63 characters; node names may be longer (DNS subdomains of 253).
    return text if len(text) <= 63 else hashlib.sha256(text.encode()).hexdigest()[:63]


def node_owner(node: str, uid: str) -> dict[str, Any]:
    """Return the ownerReference of a Node (its UID comes from a nodes/get)."""
    return {"apiVersion": "v1", "kind": "Node", "name": node, "uid": uid, "controller": True}


def build_slices(
    node: str,
    driver: str,
    pools: Sequence[Pool],
    *,
    unhealthy: Collection[str] = (),
    withheld: Collection[str] = (),
    version: ApiVersion = ApiVersion.V1,
    taints: bool = False,
    generation: int = 1,
    owner: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Return a node's ResourceSlices: its DRA pools less withheld and (untainted) unhealthy devices."""
    builder = SliceBuilder(node, driver, pools, version=version, taints=taints)
    return builder.render_all(builder.states(unhealthy, withheld), generation, owner)


__all__ = [
    "ApiVersion",
    "SliceBuilder",
    "SliceGroup",
    "SliceState",
    "build_slices",
    "device_attributes",
    "dra_pools",
    "node_owner",
    "plan",
]
