"""The data densedev passes between its stages: devices, selectors, pool configs, pools.

Models are immutable.  ``Device`` is a ``NamedTuple`` rather than a frozen dataclass on purpose: a node
carries up to ~16k of them and a frozen dataclass costs ~2 µs per construction against ~0.2 µs for a
named tuple built from the scanner's tuple, which is a tenth of the whole scan budget at 4,096 devices.
The config's records and ``Pool`` are named tuples too, for start-up: Python 3.11 builds a dataclass's
methods by exec'ing each one at import, ~0.3-1 ms a class, against ~0.05 ms for a named tuple.  This
module imports no dataclass at all: the child that reads the first scan (``node.ahead``) loads it
through the scanner, and ``dataclasses`` would bring ``inspect`` and ``ast`` with it (~7 ms of that
child's start, which is on the daemon's critical path).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable
from enum import Enum, StrEnum
from typing import Any, NamedTuple

# A pool's resourcePrefix when the file gives none: the SR-IOV network device plugin's --resource-prefix
# default, so its ConfigMaps name the same resources here (the CLI's --resource-prefix overrides it).
DEFAULT_PREFIX = "intel.com"
# A pool's draDriverName when the file gives none: the DRA driver the node's ResourceSlices name.
DEFAULT_DRIVER_NAME = "net.densedev.io"


class Health(StrEnum):
    """A device's health as the device plugin API spells it (v1beta1's Healthy and Unhealthy constants)."""

    HEALTHY = "Healthy"
    UNHEALTHY = "Unhealthy"


class Role(StrEnum):
    """What a device is to SR-IOV, as the scan names it in ``Device.role`` (and ``scan --json`` prints it)."""

    PF = "pf"  # SR-IOV capable function (has sriov_totalvfs)
    VF = "vf"  # virtual function (has physfn)
    PCI = "pci"  # plain PCI function without SR-IOV
    SF = "sf"  # auxiliary-bus subfunction (mlx5_core.sf.N)


class DeviceType(StrEnum):
    """A pool's ``deviceType`` (the SR-IOV plugin's): which devices it may take, what containers get."""

    NET_DEVICE = "netDevice"  # network controllers (class 02): VFs, and PFs without VFs enabled
    ACCELERATOR = "accelerator"  # any PCI function but bridges (class 06)
    AUX_NET_DEVICE = "auxNetDevice"  # auxiliary-bus subfunctions


class Preferred(StrEnum):
    """A pool's ``preferredAllocation``: how GetPreferredAllocation ranks devices, or not offered at all."""

    PACK = "pack"  # a pod's devices share a PF and a NUMA node whenever they can
    SPREAD = "spread"  # one device per PF before any PF gives a second
    NONE = "none"  # GetPreferredAllocation not offered: the kubelet picks


class SharedScope(StrEnum):
    """What one ID of a shared RDMA pool stands for: one RDMA device, or every RDMA device of the pool."""

    DEVICE = "device"  # densedev's rdmaShared: N IDs per RDMA device, an ID brings its own device
    # The RDMA shared device plugin's rdmaHcaMax: N IDs for the whole resource ("0" … "N-1"), and each
    # ID brings the char devices of every HCA the resource selected (its Allocate returns them all).
    POOL = "pool"


class VdpaType(StrEnum):
    """A selector's ``vdpaType``: the vDPA bus driver a device's vDPA device must be bound to."""

    VHOST = "vhost"  # vhost_vdpa: a /dev/vhost-vdpa-N node for user space (drivers/vhost/vdpa.c)
    VIRTIO = "virtio"  # virtio_vdpa: a virtio device of the kernel's own (drivers/virtio/virtio_vdpa.c)

    @property
    def driver(self) -> str:
        """Return the bus driver's name as ``Device.vdpa_driver`` holds it (``vhost_vdpa``)."""
        return f"{self.value}_vdpa"


class Device(NamedTuple):
    """One function of the node as discovery saw it; ``id`` (PCI address or aux name) is stable."""

    id: str  # "0000:3b:00.2"; for subfunctions the aux device name "mlx5_core.sf.4"
    role: str  # a Role's value: the scan's plain string, equal to the Role member
    vendor: str  # "15b3" (lower-case hex, no 0x)
    device: str  # "101e"
    pci_class: str  # "020000"
    subsystem_vendor: str
    subsystem_device: str
    driver: str  # "" when unbound
    numa_node: int  # -1 when unknown (the kernel writes -1)
    iommu_group: int  # -1 when none
    noiommu: bool  # group is a vfio no-IOMMU group (/dev/vfio/noiommu-N)
    acpi_index: int  # -1 when absent
    total_vfs: int  # PF: sriov_totalvfs; 0 otherwise
    num_vfs: int  # PF: sriov_numvfs; 0 otherwise
    pf: str  # VF/SF: parent PF address; "" otherwise
    vf_index: int  # VF: k of the PF's virtfn<k>; SF: its sfnum; -1 otherwise
    pf_netdev: str  # VF/SF: the PF's first netdev name; "" when none
    netdevs: tuple[str, ...]  # interface names under net/ (host namespace only)
    link_type: str  # "ether", "infiniband", or "" when no netdev
    rdma_device: str  # ibdev name under infiniband/ ("mlx5_3"), "" when none
    rdma_nodes: tuple[str, ...]  # /dev/infiniband/uverbsN, umadN, issmN, ucmN (those that exist)
    uio: str  # "uio3" when bound to a uio driver, "" otherwise
    vdpa: str  # "vdpa2" when a vDPA device sits on this function, "" otherwise
    vdpa_driver: str  # a VdpaType's driver ("vhost_vdpa", "virtio_vdpa"), or "" (none, or another driver)
    pcie_root: str  # first component of the resolved /sys/devices path: "pci0000:3a"
    aux_type: str  # SF: "sf"; "" otherwise


class IndexSpans:
    """VF indexes kept as sorted, disjoint inclusive spans, so ``0-65535`` costs one span, not 65,536 ints.

    ``starts[i]..ends[i]`` is one span; spans never overlap or touch (``of`` merges them), so two equal
    sets of indexes always have equal spans.  Immutable and compared by value, like a frozen
    dataclass (see the module's docstring for why it is not one); not a named tuple, because its
    ``len`` and ``in`` are the indexes', which a tuple's own methods (``_make``) would trip over.
    """

    __slots__ = ("ends", "starts")
    starts: tuple[int, ...]
    ends: tuple[int, ...]

    def __init__(self, starts: tuple[int, ...] = (), ends: tuple[int, ...] = ()) -> None:
        object.__setattr__(self, "starts", starts)
        object.__setattr__(self, "ends", ends)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"IndexSpans is immutable: cannot set {name}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"IndexSpans is immutable: cannot delete {name}")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, IndexSpans):
            return NotImplemented
        return self.starts == other.starts and self.ends == other.ends

    def __hash__(self) -> int:
        return hash((self.starts, self.ends))

    def __repr__(self) -> str:
        return f"IndexSpans(starts={self.starts!r}, ends={self.ends!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (IndexSpans, (self.starts, self.ends))  # copy and pickle without __setattr__

    @classmethod
    def of(cls, spans: Iterable[tuple[int, int]]) -> IndexSpans:
        """Return the normalised spans of inclusive ``(start, end)`` pairs, in any order, overlapping or not.

        Raises ValueError for a pair whose start is above its end.
        """
        starts: list[int] = []
        ends: list[int] = []
        for start, end in sorted(spans):
            if start > end:
                raise ValueError(f"span {start}-{end}: start > end")
            if ends and start <= ends[-1] + 1:
                ends[-1] = max(ends[-1], end)
            else:
                starts.append(start)
                ends.append(end)
        return cls(tuple(starts), tuple(ends))

    @classmethod
    def from_indexes(cls, indexes: Iterable[int]) -> IndexSpans:
        """Return the spans of a collection of single indexes."""
        return cls.of((i, i) for i in indexes)

    def __contains__(self, index: object) -> bool:
        if not isinstance(index, int):
            return False
        k = bisect_right(self.starts, index)
        return k > 0 and index <= self.ends[k - 1]

    def __or__(self, other: IndexSpans) -> IndexSpans:
        return IndexSpans.of(
            (*zip(self.starts, self.ends, strict=True), *zip(other.starts, other.ends, strict=True))
        )

    def __len__(self) -> int:
        return sum(e - s + 1 for s, e in zip(self.starts, self.ends, strict=True))

    def __str__(self) -> str:
        return ",".join(f"{s}" if s == e else f"{s}-{e}" for s, e in zip(self.starts, self.ends, strict=True))


class IndexRange(NamedTuple):
    """A ``name#0,2-7`` selector value: an interface or PCI address and optional VF indexes."""

    name: str
    indexes: IndexSpans | None = None  # None: every VF (or the device itself)


class Selector(NamedTuple):
    """One selector object of the SR-IOV network device plugin's config; empty keys match anything."""

    vendors: tuple[str, ...] = ()
    devices: tuple[str, ...] = ()
    drivers: tuple[str, ...] = ()
    pci_addresses: tuple[str, ...] = ()
    acpi_indexes: tuple[str, ...] = ()
    pf_names: tuple[IndexRange, ...] = ()
    root_devices: tuple[IndexRange, ...] = ()
    link_types: tuple[str, ...] = ()
    is_rdma: bool | None = None
    need_vhost_net: bool = False
    vdpa_type: VdpaType | None = None
    pkeys: tuple[str, ...] = ()
    aux_types: tuple[str, ...] = ()
    ddp_profiles: tuple[str, ...] = ()
    # The RDMA shared device plugin's ifNames (and its older "devices"): the function's first netdev.
    if_names: tuple[str, ...] = ()


class HealthPolicy(NamedTuple):
    """Which facts make a pool's device Unhealthy, and how long recovery must hold before it is told."""

    pf_link: bool = True  # the VF's PF netdev is down
    own_link: bool = True  # the device's own host netdev is down (never for a VF moved into a pod)
    rdma_port: bool = True  # an RDMA port is not ACTIVE
    driver: bool = True  # the driver is unbound or differs from the one it was selected with
    hold_down_s: float = 1.0  # healthy must hold this long before it is reported (unhealthy: at once)


class PoolApi(Enum):
    """Which kubelet API serves a pool: the device plugin API (the default) or DRA (ResourceSlices)."""

    DEVICE_PLUGIN = "devicePlugin"
    DRA = "dra"


class PoolConfig(NamedTuple):
    """One resource pool of the config file: what it selects and how it behaves."""

    resource_name: str  # "intel_sriov_netdevice"
    resource_prefix: str  # "intel.com" (DEFAULT_PREFIX unless the pool sets one)
    device_type: DeviceType = DeviceType.NET_DEVICE
    selectors: tuple[Selector, ...] = (Selector(),)
    exclude_topology: bool = False
    additional_info: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = ()  # address|"*" → k/v
    rdma_shared: int = 0  # >0: a shared RDMA pool with this many IDs per RDMA device (rdmaHcaMax)
    rdma_scope: SharedScope = SharedScope.DEVICE  # POOL: rdma_shared IDs for the whole pool (rdmaHcaMax)
    health: HealthPolicy = HealthPolicy()
    preferred: Preferred = Preferred.PACK
    prestart: bool = False  # offer PreStartContainer (verifies presence and health before start)
    api: PoolApi = PoolApi.DEVICE_PLUGIN  # "api": "dra" publishes the pool as ResourceSlices instead

    @property
    def full_name(self) -> str:
        """Return the extended resource name the kubelet sees: ``<prefix>/<name>``."""
        return f"{self.resource_prefix}/{self.resource_name}"


class Config(NamedTuple):
    """The whole validated config: pools plus node-wide timing knobs."""

    pools: tuple[PoolConfig, ...]
    coalesce_ms: float = 2.0  # window that folds a burst of events into one message per pool
    rdma_poll_s: float = 1.0  # RDMA port state has no event source: poll it
    reconcile_s: float = 60.0  # full rescan as a safety net
    dra_driver_name: str = DEFAULT_DRIVER_NAME  # "draDriverName": the DRA driver the node's slices name
    warnings: tuple[str, ...] = ()  # accepted but unsupported keys (pKeys, ddpProfiles): log them at load


class PoolMember(NamedTuple):
    """One ID a pool advertises and the device behind it (shared RDMA pools map many IDs to one).

    A named tuple for the same reason as ``Device``: pools of a 16k-device node build one per ID on
    every rescan and reload.
    """

    id: str
    device: Device


class Pool(NamedTuple):
    """A pool's selection result: its config and its members in a stable order."""

    config: PoolConfig
    members: tuple[PoolMember, ...]
    # A pool-wide shared RDMA pool (SharedScope.POOL): every HCA an ID brings, which may be more than
    # its members name when rdmaHcaMax is below the number of HCAs.  Empty for every other pool.
    shared: tuple[Device, ...] = ()


class RequestKind(StrEnum):
    """Why a kubelet request is refused; the server maps each kind to a gRPC status code."""

    INVALID = "invalid"  # → INVALID_ARGUMENT (unknown IDs, IDs of another pool, bad sizes)
    PRECONDITION = "precondition"  # → FAILED_PRECONDITION (unhealthy or vanished devices)


class RequestError(Exception):
    """A kubelet request the plugin refuses; the server maps ``kind`` to a gRPC status code."""

    # The kinds, reachable from the exception every refusal already imports.
    INVALID = RequestKind.INVALID
    PRECONDITION = RequestKind.PRECONDITION

    def __init__(self, kind: RequestKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
