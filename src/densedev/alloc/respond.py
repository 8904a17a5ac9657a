"""What a container gets for a pool's devices: env, device nodes, CDI names, device-info files.

``build_response`` and the helpers above it are pure (they only ``stat`` the dev root to learn which
nodes exist); ``PoolAllocator`` is the ``server.PoolService`` the gRPC server calls, and owns the
files written for runtimes (CDI specs) and CNI plugins (device-info files).  The env and ``_INFO``
schema is documented in ``docs/allocation.md``; it matches the SR-IOV network device plugin's, which
CNI plugins and DPDK/RDMA applications already parse.
"""

from __future__ import annotations

import array
import logging
import os
import re
import struct
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from .. import accel, files, pci
from ..model import (
    Device,
    DeviceType,
    Pool,
    PoolConfig,
    Preferred,
    RequestError,
    RequestKind,
    SharedScope,
    VdpaType,
)
from ..node import layout
from ..pools.config import env_var_name
from ..printable import listing
from . import cdi, devinfo, leftovers

if TYPE_CHECKING:
    from .._proto import api_pb2

log = logging.getLogger(__name__)

DEFAULT_DEV_ROOT = Path("/dev")
POLICIES = {Preferred.PACK: 0, Preferred.SPREAD: 1, Preferred.NONE: 2}  # the _fast ranking's POLICY_* values

# Every node is handed over "rw": the runtime creates the node in the container itself, so nothing
# inside needs mknod, and the device cgroup's "m" would only let a container create nodes for the
# same major:minor by hand.
PERMISSIONS = "rw"

# pick_devices packs positions into 20-bit fields; no pool has that many members (16-bit VF counts per PF).
MAX_AVAILABLE = (1 << 20) - 1

VFIO_CONTAINER = "/dev/vfio/vfio"  # the VFIO container node every vfio-pci user opens first
RDMA_CM = "/dev/infiniband/rdma_cm"  # one node for the whole host (rdma_ucm module)
VHOST_NET = "/dev/vhost-net"
TUN = "/dev/net/tun"


class AllocationSettings(NamedTuple):
    """Where allocation writes and looks: CDI dir (None: CDI off), device-info dir, and the /dev root."""

    cdi_dir: Path | None = cdi.DEFAULT_CDI_DIR
    devinfo_dir: Path | None = devinfo.DEFAULT_DEVINFO_DIR
    dev_root: Path = DEFAULT_DEV_ROOT  # where to check which nodes exist (the host's /dev, maybe remounted)
    cdi_annotations: bool = False  # also return the cdi.k8s.io/ annotation (runtimes before CRI CDI fields)
    # Where RDMA char devices are re-read at Allocate (see rdma_now); None: discovery's record is used.
    sysfs_root: Path | None = None


class NodeSpec(NamedTuple):
    """One device node for the container: its path inside, its path on the host, and permissions."""

    container_path: str
    host_path: str
    permissions: str


class DeviceParts(NamedTuple):
    """What one device contributes: its nodes, its ``_INFO`` entry, and required nodes that are missing."""

    device: Device
    nodes: tuple[NodeSpec, ...]
    info: dict[str, dict[str, str]]
    missing: tuple[str, ...]  # host paths (or facts) without which the device cannot work


class ResponseParts(NamedTuple):
    """The parts of a ContainerAllocateResponse, before they become protobuf."""

    envs: dict[str, str]
    devices: tuple[NodeSpec, ...]
    cdi_devices: tuple[str, ...]
    annotations: dict[str, str]


def needs_vhost_net(config: PoolConfig) -> bool:
    """Return whether the pool's containers get /dev/vhost-net and /dev/net/tun (selector needVhostNet)."""
    return any(s.need_vhost_net for s in config.selectors)


def wants_rdma(config: PoolConfig) -> bool:
    """Return whether the pool hands out RDMA char devices: an ``isRdma`` selector, or a shared RDMA pool."""
    return config.rdma_shared > 0 or any(s.is_rdma for s in config.selectors)


def cdi_class(config: PoolConfig) -> str:
    """Return the CDI class of a pool: its resource name."""
    return config.resource_name


def extra_info(config: PoolConfig, device_id: str) -> dict[str, str]:
    """Return the pool's additionalInfo for a device: the ``*`` entry overlaid by the device's own."""
    extra: dict[str, str] = {}
    for key in ("*", device_id):
        for address, pairs in config.additional_info:
            if address == key:
                extra.update(pairs)
    return extra


def _host(dev_root: Path, path: str) -> Path:
    return dev_root / path.removeprefix("/dev/")


def _rdma_path(node: str) -> str:
    # Discovery records either the name ("uverbs3") or the full path; the kernel puts them all under
    # /dev/infiniband (drivers/infiniband/core/{uverbs,user_mad,ucma}.c set the "infiniband/" devnode).
    return node if node.startswith("/") else f"/dev/infiniband/{node}"


def vdpa_path(device: Device) -> str:
    """Return the vhost-vdpa node path of a device, or "" when it has none."""
    if not device.vdpa or device.vdpa_driver != VdpaType.VHOST.driver:
        return ""
    # drivers/vhost/vdpa.c numbers its char devices from its own ida, so the node's number is the
    # vdpa<n> bus number only when devices were bound in order; discovery may record the node name
    # itself (the vhost-vdpa-<m> entry under /sys/bus/vdpa/devices/vdpa<n>/), which is then used as is.
    if device.vdpa.startswith("vhost-vdpa-"):
        return f"/dev/{device.vdpa}"
    return f"/dev/vhost-{device.vdpa.replace('vdpa', 'vdpa-', 1)}"


# The class directories a function holds its RDMA char devices in, as discovery reads them (uverbsN;
# umadN and issmN; ucmN): each class device's parent is the function (drivers/infiniband/core/
# uverbs_main.c, user_mad.c, ucma.c set dev.parent to the ib_device's parent).
RDMA_NODE_CLASSES = ("infiniband_verbs", "infiniband_mad", "infiniband_cm")


_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


def _listing(dirfd: int, name: str) -> list[str]:
    """Return the names in subdirectory ``name`` of ``dirfd`` (not following a symlink there)."""
    fd = os.open(name, _O_DIR | os.O_NOFOLLOW, dir_fd=dirfd)
    try:
        return os.listdir(fd)
    finally:
        os.close(fd)


def rdma_now(sysfs_root: Path, device: Device) -> Device:
    """Return ``device`` with its RDMA device and char devices as sysfs shows them now.

    Discovery's record can be stale by the time a container is allocated: ib_uverbs or ib_umad
    reloaded (its minors, hence the ``uverbsN`` names, renumbered), the RDMA device re-created by a
    driver reset, or renamed (``rdma dev set … name``).  Those class devices raise uevents of their
    own subsystems, which no rescan follows, so the SR-IOV network device plugin (v3.11, its issue
    #565) reads them at Allocate; so does densedev, for RDMA pools only.  What is read: the function's
    directory listing, then the listings of those of its ``infiniband``/``infiniband_*`` directories
    that exist.  Only kernfs directory listings, where no driver callback runs (attribute reads can
    block in a driver; listings cannot), and a function has a few dozen entries at most.  An
    unreadable function counts as one without RDMA: the caller then refuses the device (fail closed).
    """
    bus = layout.PCI_DEVICES if pci.is_address(device.id) else layout.AUX_DEVICES
    ibdev = ""
    nodes: list[str] = []
    try:
        # The bus entry is the kernel's link into devices/: followed, as every scan does.
        fd = os.open(sysfs_root / bus / device.id, _O_DIR)
    except OSError:
        fd = -1
    if fd >= 0:
        try:
            present = set(os.listdir(fd))
            if "infiniband" in present:
                ibdevs = sorted(_listing(fd, "infiniband"))
                ibdev = ibdevs[0] if ibdevs else ""
            for cls in RDMA_NODE_CLASSES:
                if cls in present:
                    nodes += (f"/dev/infiniband/{n}" for n in _listing(fd, cls))
        except OSError:
            # Gone while read (the function removed or its driver unbound): nothing is there now.
            ibdev, nodes = "", []
        finally:
            os.close(fd)
    fresh = tuple(sorted(nodes))
    if ibdev == device.rdma_device and fresh == device.rdma_nodes:
        return device  # the common case: the record is current, the same object goes on
    return device._replace(rdma_device=ibdev, rdma_nodes=fresh)


_RDMA_KEYS = (("uverbs", "uverbs"), ("umad", "umad"), ("issm", "issm"), ("ucm", ""))


def device_parts(
    config: PoolConfig, device: Device, dev_root: Path = DEFAULT_DEV_ROOT, if_name: str = ""
) -> DeviceParts:
    """Return the nodes and ``_INFO`` entry of one device of a pool, checking nodes under ``dev_root``.

    ``if_name`` is the interface name a DRA claim asked for the device (``VfConfig.ifName``): told to the
    container beside the device's ID, so a CNI or the application names the interface as the claim says.
    """
    nodes: list[NodeSpec] = []
    missing: list[str] = []
    info: dict[str, dict[str, str]] = {"generic": {"deviceID": device.id}}
    if if_name:
        info["generic"]["ifName"] = if_name

    def _need(container: str, host: str | None = None) -> None:
        host = host or container
        if os.path.exists(_host(dev_root, host)):
            nodes.append(NodeSpec(container, host, PERMISSIONS))
        else:
            missing.append(host)

    if device.driver == "vfio-pci":
        # A no-IOMMU group (vfio enable_unsafe_noiommu_mode) has node noiommu-<g> on the host; it is
        # given to the container as /dev/vfio/<g>, the name DPDK tries first (eal_vfio.c).
        if device.iommu_group < 0:
            missing.append(f"IOMMU group of {device.id} (bound to vfio-pci without one)")
        else:
            group = f"/dev/vfio/{device.iommu_group}"
            _need(VFIO_CONTAINER)
            _need(group, f"/dev/vfio/noiommu-{device.iommu_group}" if device.noiommu else group)
            info["vfio"] = {"mount": VFIO_CONTAINER, "dev-mount": group}
    if device.uio:
        _need(f"/dev/{device.uio}")
        info["uio"] = {"mount": f"/dev/{device.uio}"}
    if wants_rdma(config) and (device.rdma_device or device.rdma_nodes):
        rdma: dict[str, str] = {}
        if device.rdma_device:
            rdma["rdma_dev"] = device.rdma_device
        # Each node is optional: RoCE functions usually have no issm, ucm is rare (see the sysfs notes).
        for node in (*map(_rdma_path, device.rdma_nodes), RDMA_CM):
            if os.path.exists(_host(dev_root, node)):
                nodes.append(NodeSpec(node, node, PERMISSIONS))
                base = node.rsplit("/", 1)[1]
                for prefix, key in _RDMA_KEYS:
                    if key and base.startswith(prefix) and base[len(prefix) :].isdigit():
                        rdma.setdefault(key, node)
                if node == RDMA_CM:
                    rdma["rdma_cm"] = node
        info["rdma"] = rdma
    if needs_vhost_net(config):
        _need(VHOST_NET)
        _need(TUN)
        info["vhost"] = {"net-mount": VHOST_NET, "tun-mount": TUN}
    path = vdpa_path(device)
    if path:
        _need(path)
        info["vdpa"] = {"mount": path}
    extra = extra_info(config, device.id)
    if extra:
        info["extra"] = extra
    return DeviceParts(device, tuple(nodes), info, tuple(missing))


def merge_nodes(parts: Sequence[DeviceParts]) -> tuple[NodeSpec, ...]:
    """Return the nodes of all devices, de-duplicated by host path, first occurrence first."""
    seen: set[str] = set()
    out: list[NodeSpec] = []
    for p in parts:
        for n in p.nodes:
            if n.host_path not in seen:
                seen.add(n.host_path)
                out.append(n)
    return tuple(out)


def encode_info(parts: Sequence[DeviceParts]) -> str:
    """Return the ``_INFO`` JSON: one object per device address."""
    return files.canonical_json({p.device.id: p.info for p in parts})


def cdi_env(config: PoolConfig, part: DeviceParts) -> dict[str, str]:
    """Return the env a device's CDI entry sets: its own ``<ENV>_<ADDRESS>_INFO`` (unique per device).

    The combined ``PCIDEVICE_*`` variables depend on the whole allocation, so they come with the
    Allocate response; a CDI entry can only carry what is true of its device alone.
    """
    key = f"{env_var_name(config.full_name)}_{re.sub(r'[^A-Za-z0-9_]', '_', part.device.id).upper()}_INFO"
    return {key: files.canonical_json({part.device.id: part.info})}


def build_response(
    config: PoolConfig,
    devices: Sequence[Device],
    dev_root: Path = DEFAULT_DEV_ROOT,
    cdi_kind: str | None = None,
    cdi_annotations: bool = False,
    if_names: Mapping[str, str] | None = None,
) -> tuple[ResponseParts, tuple[DeviceParts, ...]]:
    """Return the response parts for devices of a pool, or raise RequestError if a required node is gone.

    ``if_names`` (device ID → name; DRA claims' ``ifName``) go into the devices' ``_INFO`` entries.

    With ``cdi_kind`` the nodes travel in the CDI spec only (the runtime injects them), so the
    response carries CDI names instead of device specs: passing both would give the runtime every
    node twice.
    """
    names_ = if_names or {}
    parts = tuple(device_parts(config, d, dev_root, names_.get(d.id, "")) for d in devices)
    missing = [f"{p.device.id}: {', '.join(p.missing)}" for p in parts if p.missing]
    if missing:
        # The server names the pool; the message names at most a few devices (gRPC carries a status
        # message in trailers of 8 KiB at most).
        raise RequestError(
            RequestError.PRECONDITION,
            f"required device nodes are missing under {dev_root}: {listing(missing, width=200)}",
        )
    name = env_var_name(config.full_name)
    envs = {name: ",".join(d.id for d in devices), f"{name}_INFO": encode_info(parts)}
    annotations: dict[str, str] = {}
    if cdi_kind is None:
        return ResponseParts(envs, merge_nodes(parts), (), annotations), parts
    names = tuple(cdi.qualified_name(cdi_kind, d.id) for d in devices)
    if cdi_annotations:
        key, value = cdi.annotation(cdi_kind, config.resource_name, names)
        annotations[key] = value
    return ResponseParts(envs, (), names, annotations), parts


def to_proto(parts: ResponseParts) -> api_pb2.ContainerAllocateResponse:
    """Return the protobuf ContainerAllocateResponse for response parts."""
    # Imported at the first Allocate, not at start: see kubelet.server.api.
    from .._proto import api_pb2

    return api_pb2.ContainerAllocateResponse(
        envs=parts.envs,
        devices=[
            api_pb2.DeviceSpec(
                container_path=n.container_path, host_path=n.host_path, permissions=n.permissions
            )
            for n in parts.devices
        ],
        annotations=parts.annotations,
        cdi_devices=[api_pb2.CDIDevice(name=n) for n in parts.cdi_devices],
    )


def topology_of(devices: Sequence[Device]) -> bytes:
    """Return the ``pick_devices`` topology: int32 (numa, root id, pf id) per device, dense ids."""
    roots: dict[str, int] = {}
    pfs: dict[str, int] = {}
    out = bytearray()
    for d in devices:
        root = roots.setdefault(d.pcie_root, len(roots))
        # A VF or SF groups under its PF; anything else is a group of its own.
        pf = pfs.setdefault(d.pf or f"self:{d.id}", len(pfs))
        numa = d.numa_node if -1 <= d.numa_node < 1024 else -1
        out += struct.pack("<iii", numa, root, pf)
    return bytes(out)


# build_lookup's table is 256 KiB per PCI domain whatever the pool's size: 1,000 pools of 4 VFs held 250 MiB
# of it, most of the daemon's memory.  What it saves is hashing the kubelet's fresh ID strings in the dict,
# per GetPreferredAllocation of 8 with the extension (bench/bench_preferred.py's node, shared 2-core box):
# 0.04 ms at 1,024 IDs, 0.26 ms at 4,096, 1.45 ms at 16,384 (2.1 → 0.67 ms, inside the 2 ms target).  So
# only pools of 4,096 members or more get one; at that size it is at most 64 bytes per member.
LOOKUP_MIN_MEMBERS = 4096


def build_lookup(index: dict[str, int]) -> bytes:
    """Return ``pick_devices``' lookup blocks: per PCI domain, a direct table from bus/devfn to member.

    Resolving a canonical PCI address there costs a parse and one array read instead of hashing a fresh
    string and probing a 16k-entry dict, which is most of a GetPreferredAllocation call at 16k devices.
    """
    tables: dict[int, array.array[int]] = {}
    for dev_id, m in index.items():
        # Fixed offsets below: like the accelerator's parse_bdf, the table covers 4-digit domains only.
        if len(dev_id) == pci.CANONICAL_LENGTH and pci.is_address(dev_id):
            domain = int(dev_id[0:4], 16)
            if domain not in tables:
                tables[domain] = array.array("i", [-1]) * 65536
            tables[domain][int(dev_id[5:7], 16) << 8 | int(dev_id[8:10], 16) << 3 | int(dev_id[11])] = m
    out = bytearray()
    for domain, table in sorted(tables.items()):
        if sys.byteorder != "little":
            table.byteswap()
        out += struct.pack("<I", domain) + table.tobytes()
    return bytes(out)


class PoolAllocator:
    """The PoolService of one pool: answers Allocate, GetPreferredAllocation and PreStartContainer."""

    def __init__(self, pool: Pool, settings: AllocationSettings, is_healthy: Callable[[str], bool]) -> None:
        self.settings = settings
        # The health tracker's answer for this pool (the daemon binds it to the pool's name): the
        # allocator keeps no health of its own, so it refuses what the tracker holds unhealthy now.
        self._is_healthy = is_healthy
        self._devices: tuple[Device, ...] = ()
        self._retained: dict[str, Device] = {}  # non-members whose files stay: pods hold them (retain)
        self._configure(pool.config)
        self._load(pool)
        self._refresh_cdi(self._devices)

    def _configure(self, config: PoolConfig) -> None:
        if config.preferred not in POLICIES:
            known = sorted(map(str, POLICIES))
            raise ValueError(f"pool {config.full_name}: preferred {config.preferred!r} is not one of {known}")
        self.config = config
        self._cdi: cdi.SpecWriter | None = None
        self.kind = ""
        if self.settings.cdi_dir is not None:
            try:
                self.kind = cdi.make_kind(config.resource_prefix, cdi_class(config))
                self._cdi = cdi.SpecWriter(self.settings.cdi_dir)
            except cdi.CdiError as e:
                # The kubelet's resource-name rules are nearly CDI's; where they differ, serve the pool
                # with plain device specs rather than not at all.
                log.error("%s: CDI off for this pool: %s", config.full_name, e)
        self._cdi_entries: dict[str, dict[str, Any]] = {}
        self._cdi_current = False
        self._info = (
            devinfo.InfoWriter(self.settings.devinfo_dir, config.resource_prefix, config.resource_name)
            if self.settings.devinfo_dir is not None and config.device_type == DeviceType.NET_DEVICE
            else None
        )

    # -- membership ---------------------------------------------------------------------------------

    def _load(self, pool: Pool) -> None:
        self.pool = pool
        self._members = {m.id: m.device for m in pool.members}
        devices: dict[str, Device] = {}
        for m in pool.members:
            devices.setdefault(m.device.id, m.device)
        for d in pool.shared:  # every HCA of a pool-wide shared RDMA pool, named by an ID or not
            devices.setdefault(d.id, d)
        self._devices = tuple(devices.values())
        self._index = {m.id: i for i, m in enumerate(pool.members)}
        # What GetPreferredAllocation ranks with, built at its first call or by prepare(): ~5 ms of a
        # pool of 4,096 (20 ms at 16k) that the pool's first list need not wait for.
        self._ranking: tuple[bytes, bytes] | None = None

    def prepare(self) -> None:
        """Build now what GetPreferredAllocation needs (the daemon calls it after the first lists)."""
        if self._ranking is None:
            topology = topology_of([m.device for m in self.pool.members])
            # The table pays off only in the extension (the twin would parse every address in Python),
            # and only for a large pool: see LOOKUP_MIN_MEMBERS.
            large = len(self._index) >= LOOKUP_MIN_MEMBERS
            lookup = build_lookup(self._index) if large and accel.IMPLEMENTATION == "cython" else b""
            self._ranking = topology, lookup

    def update(self, pool: Pool) -> None:
        """Take a new membership: rewrite the CDI spec if devices changed, drop files of devices that left."""
        if pool.config != self.config:
            # A reload changed the pool's settings (policy, selectors, additionalInfo, name): start over,
            # first dropping the files named after the old settings.
            old_cdi, old_kind = self._cdi, self.kind
            if self._info is not None:
                self._info.close()
            self._configure(pool.config)
            if old_cdi is not None and old_kind != self.kind:
                old_cdi.remove(old_kind)
            self._load(pool)
            self._refresh_cdi(self._devices)
            return
        old = set(self._devices)
        self._load(pool)
        if old != set(self._devices) or not self._cdi_current:
            present = {d.id for d in self._devices} | self._retained.keys()
            gone = [d for d in self._cdi_entries if d not in present]
            for device_id in gone:
                del self._cdi_entries[device_id]
            # Only new or changed records need their entries rebuilt (a stat per node, 16k devices): a
            # node that appears under an unchanged record is added when the device is allocated; one
            # that vanishes makes that Allocate fail naming it (the stale entry goes with the record).
            todo = [d for d in self._devices if d not in old] if self._cdi_current else self._devices
            self._refresh_cdi(todo, force=bool(gone))
        if self._info is not None:
            present = {d.id for d in self._devices} | self._retained.keys()
            self._info.remove(sorted(d for d in self._info.written if d not in present))

    def retain(self, devices: Sequence[Device]) -> None:
        """Keep the CDI entries and device-info files of these devices after they left the pool.

        Running pods hold them under this pool's resource, and the kubelet restarts their containers
        from its checkpointed Allocate response, which names our CDI devices.  Files of devices neither
        members nor retained any more are removed.
        """
        members = {d.id for d in self._devices}
        extra = {d.id: d for d in devices if d.id not in members}
        if not extra and not self._retained:
            return
        self._retained = extra
        present = members | extra.keys()
        gone = [i for i in self._cdi_entries if i not in present]
        for i in gone:
            del self._cdi_entries[i]
        self._refresh_cdi(tuple(extra.values()), force=bool(gone))
        if self._info is not None:
            self._info.remove(sorted(i for i in self._info.written if i not in present))
            # A settings change starts the writer over; the files of held devices are written again.
            docs = {
                i: devinfo.info_document(d, needs_vhost_net(self.config), vdpa_path(d))
                for i, d in extra.items()
                if i not in self._info.written
            }
            try:
                self._info.write_all(docs)
            except OSError as e:
                log.warning(
                    "%s: cannot write device-info files of held devices: %s", self.config.full_name, e
                )

    def _refresh_cdi(self, devices: Sequence[Device], strict: bool = False, force: bool = False) -> None:
        """Bring the CDI entries of ``devices`` up to date and rewrite the spec if any entry changed."""
        if self._cdi is None:
            return
        changed = force or not self._cdi_current
        for d in devices:
            part = device_parts(self.config, d, self.settings.dev_root)
            if part.missing:
                # A half-gone device (node vanished, group not yet created) gets no entry until it is
                # whole again; Allocate for it fails with the missing nodes named.
                log.warning("%s: no CDI entry for %s: missing %s", self.config.full_name, d.id, part.missing)
                changed |= self._cdi_entries.pop(d.id, None) is not None
                continue
            entry = cdi.device_entry(d.id, part.nodes, cdi_env(self.config, part))
            if self._cdi_entries.get(d.id) != entry:
                self._cdi_entries[d.id] = entry
                changed = True
        if not changed:
            return
        try:
            if self._cdi_entries:
                self._cdi.write(self.kind, self._cdi_entries.values())
            else:
                # The CDI spec requires at least one device: a pool with none has no spec file.
                self._cdi.remove(self.kind)
            self._cdi_current = True
        except OSError as e:
            self._cdi_current = False
            log.warning(
                "%s: cannot write CDI spec %s: %s", self.config.full_name, self._cdi.path_of(self.kind), e
            )
            if strict:
                raise RequestError(
                    RequestError.PRECONDITION, f"cannot write CDI spec {self._cdi.path_of(self.kind)}: {e}"
                ) from e

    # -- PoolService --------------------------------------------------------------------------------

    def options(self) -> tuple[bool, bool]:
        """Return (pre_start_required, get_preferred_allocation_available) from the pool's config."""
        return self.config.prestart, self.config.preferred != Preferred.NONE

    def _check(self, ids: Sequence[str], vanished_kind: RequestKind) -> list[Device]:
        """Validate requested IDs and return their distinct devices, or raise RequestError naming the IDs.

        Messages name a bounded sample of the IDs, escaped ("… and N more"): the server prefixes the
        pool's name once, and gRPC refuses a status message beyond its 8 KiB trailer limit (a refusal of
        100,000 unknown IDs used to reach the kubelet as RESOURCE_EXHAUSTED instead of INVALID_ARGUMENT).
        """
        if not ids:
            raise RequestError(RequestError.INVALID, "the request names no device IDs")
        seen: set[str] = set()
        dupes: set[str] = set()
        for i in ids:
            (dupes if i in seen else seen).add(i)
        if dupes:
            raise RequestError(RequestError.INVALID, f"device IDs requested twice: {listing(sorted(dupes))}")
        unknown = [i for i in ids if i not in self._members]
        if unknown:
            raise RequestError(
                vanished_kind,
                f"IDs not in this pool (unknown, gone, or another pool's): {listing(unknown)}",
            )
        unhealthy = [i for i in ids if not self._is_healthy(i)]
        if unhealthy:
            raise RequestError(RequestError.PRECONDITION, f"devices are unhealthy: {listing(unhealthy)}")
        if self.config.rdma_scope == SharedScope.POOL:
            # The RDMA shared device plugin's rdmaHcaMax: any one ID brings every HCA of the resource
            # (its Allocate returns the char devices of all selected devices to each container).
            return list(self._devices)
        devices: dict[str, Device] = {}
        for i in ids:
            d = self._members[i]
            devices.setdefault(d.id, d)
        return list(devices.values())

    def _current(self, devices: list[Device]) -> list[Device]:
        """Return the devices with their RDMA char devices re-read from sysfs (RDMA pools only).

        A device that had an RDMA device at discovery and has none now (driver reset in progress, or
        the RDMA device moved to a pod's namespace in exclusive mode) is refused rather than handed
        out without it.
        """
        root = self.settings.sysfs_root
        if root is None or not wants_rdma(self.config):
            return devices
        out: list[Device] = []
        lost: list[str] = []
        for d in devices:
            if not (d.rdma_device or d.rdma_nodes):
                out.append(d)
                continue
            now = rdma_now(root, d)
            if d.rdma_device and not now.rdma_device:
                lost.append(f"{d.id} (was {d.rdma_device})")
            out.append(now)
        if lost:
            raise RequestError(
                RequestError.PRECONDITION, f"no RDMA device under sysfs now: {listing(lost, width=120)}"
            )
        return out

    def allocate(self, ids: Sequence[str]) -> api_pb2.ContainerAllocateResponse:
        """Return the container's response for ``ids``; nothing is written unless every check passed."""
        devices = self._current(self._check(ids, RequestError.INVALID))
        kind = self.kind if self._cdi is not None else None
        parts, per_device = build_response(
            self.config, devices, self.settings.dev_root, kind, self.settings.cdi_annotations
        )
        docs = (
            {
                p.device.id: devinfo.info_document(
                    p.device, needs_vhost_net(self.config), vdpa_path(p.device)
                )
                for p in per_device
            }
            if self._info is not None
            else {}
        )
        if self._cdi is not None:
            self._refresh_cdi(devices, strict=True)
        if self._info is not None:
            try:
                self._info.write_all(docs)
            except OSError as e:
                raise RequestError(
                    RequestError.PRECONDITION,
                    f"cannot write device-info files in {self._info.directory}: {e}",
                ) from e
        return to_proto(parts)

    def preferred(self, available: Sequence[str], must_include: Sequence[str], size: int) -> list[str]:
        """Return up to ``size`` IDs: the must-includes, then the best of ``available`` under the policy.

        The kubelet asks with ``must_include`` ⊆ ``available`` and ``allocation_size`` ≥ the number of
        must-includes (devicemanager's devicesToAllocate passes ``available`` plus ``allocated``, then
        ``allocated``, then the container's request); a request breaking its own contract is refused
        rather than answered with IDs the caller did not offer or more than it asked for.
        """
        if size < 0:
            raise RequestError(RequestError.INVALID, f"allocation size {size} < 0")
        if must_include:
            must = dict.fromkeys(must_include)
            if len(must) > size:
                raise RequestError(
                    RequestError.INVALID,
                    f"must_include names {len(must)} devices, more than allocation_size {size}",
                )
            offered = set(available)  # built only with must-includes: most requests have none
            outside = [i for i in must if i not in offered]
            if outside:
                raise RequestError(
                    RequestError.INVALID, f"must_include IDs not in available: {listing(outside)}"
                )
        if len(available) > MAX_AVAILABLE:
            raise RequestError(
                RequestError.INVALID,
                f"{len(available)} available IDs, more than any pool holds ({MAX_AVAILABLE})",
            )
        self.prepare()
        assert self._ranking is not None
        topology, lookup = self._ranking
        return list(
            accel.pick_devices(
                available, must_include, size, self._index, topology, POLICIES[self.config.preferred], lookup
            )
        )

    def prestart(self, ids: Sequence[str]) -> None:
        """Verify the devices are still in the pool, healthy, and have their nodes, just before start."""
        devices = self._current(self._check(ids, RequestError.PRECONDITION))
        build_response(self.config, devices, self.settings.dev_root)

    def claim(self) -> leftovers.PoolClaim:
        """Return what this pool may own on disk (for reconciling an earlier run's leftovers)."""
        return leftovers.PoolClaim(
            kind=self.kind if self._cdi is not None else "",
            info_stem=self._info.stem if self._info is not None else None,
            devices=frozenset(d.id for d in self._devices),
        )

    def adopt_info(self, device_ids: Iterable[str]) -> None:
        """Take device-info files an earlier run left for these devices as this pool's own."""
        if self._info is not None:
            self._info.adopt(device_ids)

    def close(self, remove_cdi: bool = False) -> None:
        """Remove the pool's device-info files; the CDI spec stays unless ``remove_cdi`` (pool deleted).

        Containers of running pods are restarted by the kubelet from its checkpointed response, which
        names our CDI devices; the runtime resolves them from the spec, so a daemon restart (upgrade)
        must not take the spec away.
        """
        if self._info is not None:
            self._info.close()
        if remove_cdi and self._cdi is not None:
            self._cdi.remove(self.kind)
            self._cdi_entries.clear()
            self._cdi_current = False
