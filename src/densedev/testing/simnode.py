"""A simulated node: a directory tree shaped exactly like Linux sysfs for SR-IOV NICs and RDMA devices.

The tree mirrors what the kernel shows under ``/sys`` (PCI functions as real directories under
``devices/pci<domain>:<bus>/<root port>/``, every other view a *relative* symlink into them), so the one
scanner that reads ``/sys`` on a node reads this tree in tests, the demo and the benchmarks unchanged.
Mutators change the tree the way the kernel would (writing ``sriov_numvfs``, binding drivers, moving a
netdev into a pod's namespace, RDMA port state changes).

A small bookkeeping directory ``.simnode/`` at the root remembers names the kernel would derive (udev's
interface names, ibdev names) and counters; the scanner never reads it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from ..model import DEFAULT_PREFIX
from ..node import layout

__all__ = [
    "NodeLayout",
    "SimExtras",
    "SimPF",
    "bind_driver",
    "build_node",
    "enslave",
    "move_netdev_to_pod",
    "nic_buses",
    "set_addresses",
    "set_link",
    "set_num_vfs",
    "set_rdma_port",
    "simulate",
    "write_config",
]

_FILE_MODE = 0o644
NULL_OVERRIDE = "(null)"  # driver_override with none set (drivers/pci/pci-sysfs.c driver_override_show)
# include/uapi/linux/if.h: IFF_UP | IFF_BROADCAST | IFF_MULTICAST, what an Ethernet netdev's flags show up
_FLAGS_UP = 0x1003
ADDRESSES = ".simnode/addresses.json"  # the host's addresses per interface (rtnetlink's, for a real node)
_WFLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC


@dataclass(frozen=True)
class _Vendor:
    vendor: int
    pf_device: int
    vf_device: int
    pf_driver: str
    vf_driver: str
    subsystem_device: int
    rdma: bool  # RDMA-capable by default (mlx5 exposes an ibdev on every function)


_VENDORS = {
    # ConnectX-6 Dx: PF 101d, VF 101e (ConnectX family VF), mlx5_core drives both.
    "mellanox": _Vendor(0x15B3, 0x101D, 0x101E, "mlx5_core", "mlx5_core", 0x0016, True),
    # E810-C: PF 1592 (ice), adaptive VF 1889 (iavf); iRDMA exists but is off by default.
    "intel": _Vendor(0x8086, 0x1592, 0x1889, "ice", "iavf", 0x0002, False),
    # A VM's virtio-net NIC (modern, non-transitional 1af4:1041, QEMU's subsystem 1af4:1041): virtio-pci
    # binds the function, virtio_net the virtio<N> device below it; no VFs.  See _Writer.virtio_nic.
    "virtio": _Vendor(0x1AF4, 0x1041, 0x1041, "virtio-pci", "", 0x1041, False),
}
# The virtio device id of a network card (virtio spec 5 "Device Types": 1) and its transport's bus.
_VIRTIO_NET_ID = 1
_VIRTIO_DEVICES = "bus/virtio/devices"
_VIRTIO_DRIVERS = "bus/virtio/drivers"
# PF vendor:device → the driver its VFs bind to when created (what the kernel's autoprobe would pick).
_VF_DRIVERS = {
    (0x15B3, 0x101D): "mlx5_core",
    (0x15B3, 0x1017): "mlx5_core",
    (0x8086, 0x1592): "iavf",
    (0x8086, 0x4940): "vfio-pci",
}
_NET_DRIVERS = frozenset({"mlx5_core", "ice", "iavf", "i40e", "ixgbe", "ixgbevf", "igb", "igbvf"})
_UIO_DRIVERS = frozenset({"igb_uio", "uio_pci_generic"})
# include/uapi/rdma/ib_user_verbs.h port states and the IBTA phys states shown in ports/<n>/phys_state.
_PORT_STATES = {1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}


@dataclass(frozen=True)
class SimPF:
    """One simulated physical function and the virtual functions it has enabled."""

    address: str
    netdev: str
    numa_node: int
    vf_addresses: tuple[str, ...]
    vf_netdevs: tuple[str, ...]
    ibdev: str  # "" without RDMA
    vf_ibdevs: tuple[str, ...] = ()
    vendor: str = "mellanox"


@dataclass(frozen=True)
class SimExtras:
    """Addresses of the special kinds ``build_node(extras=True)`` adds, for tests that need one of each."""

    sf_pf: str  # Mellanox PF that carries the subfunctions
    sfs: tuple[str, ...]  # auxiliary device names "mlx5_core.sf.<n>"
    sf_netdevs: tuple[str, ...]
    sf_ibdevs: tuple[str, ...]
    vdpa_vf: str  # VF with vdpa0 (vhost_vdpa) on it
    vdpa: str
    uio_vf: str  # VF bound to igb_uio (uio/uio0)
    uio: str
    vfio_vf: str  # VF bound to vfio-pci in an IOMMU group
    noiommu_vf: str  # VF bound to vfio-pci in a vfio-noiommu group
    noiommu_group: int
    accel_pf: str  # Intel QAT 4xxx PF (class 0x120000)
    accel_vfs: tuple[str, ...]  # its VFs, bound to vfio-pci
    ib_pf: str  # InfiniBand ConnectX PF (class 0x020700, link layer InfiniBand, with issm and ucm)
    ib_netdev: str
    ib_ibdev: str
    plain: str  # plain PCI NIC without SR-IOV (I210, igb)
    plain_netdev: str


@dataclass(frozen=True)
class NodeLayout:
    """What ``build_node`` wrote: the root and every PF with its VFs (and the extras when asked)."""

    root: Path
    pfs: tuple[SimPF, ...]
    vendor: str = "mellanox"
    rdma: bool = False
    extras: SimExtras | None = None

    @property
    def vf_addresses(self) -> tuple[str, ...]:
        """Return every VF address of the main PFs, PF by PF."""
        return tuple(a for pf in self.pfs for a in pf.vf_addresses)


# ---------------------------------------------------------------------------------------------- writer


# Bus numbers of a PCI domain: domain 0 starts past the buses its chipset devices use (as on common
# servers, where the first add-in root ports sit at 0x17-0x18 on); a further segment starts at 0.
_FIRST_BUS = (0x18, 0x00)
_LAST_BUS = 0xFF
_EXTRA_BUSES = 10  # the extras' five NICs, each a root port's bus and the NIC's own
_LAST_DOMAIN = 0xFFFF  # sysfs names hold 4 hex digits of domain (VMD's 10000: and up are not modelled)


def _next_domain(domain: int) -> tuple[int, int]:
    """Return the next PCI domain and its first bus number (ValueError past the last one)."""
    if domain >= _LAST_DOMAIN:
        raise ValueError("the node's functions do not fit in 65,536 PCI domains")
    return domain + 1, _FIRST_BUS[1]


def _buses_per_nic(vfs_per_pf: int) -> int:
    # Routing IDs a dual-port NIC's functions use: 2 PFs then 2 x vfs_per_pf VFs (offset 2, stride 1),
    # plus the bus of the root port in front of it.
    return 1 + (2 + 2 * vfs_per_pf + 255) // 256


def nic_buses(nics: int, vfs_per_pf: int) -> list[tuple[int, int]]:
    """Return each dual-port NIC's (PCI domain, root port bus), spilling into the next domain when full.

    A NIC's VFs take consecutive bus numbers after its PFs (SR-IOV: VF routing ID = PF RID + offset +
    k x stride), so 2 x 1,024 VFs need 9 buses; one domain's 8-bit bus number runs out after ~23 such
    NICs.  Servers with more devices than that have more PCI segment groups (ACPI MCFG), which Linux
    shows as domains 0001:, 0002: ... each with its own host bridges ``pci<domain>:<bus>``.
    """
    per_nic = _buses_per_nic(vfs_per_pf)
    if _FIRST_BUS[1] + per_nic - 1 > _LAST_BUS:
        raise ValueError(f"{vfs_per_pf} VFs per PF do not fit in one PCI domain's 256 buses")
    out = []
    domain, bus = 0, _FIRST_BUS[0]
    for _ in range(nics):
        if bus + per_nic - 1 > _LAST_BUS:
            domain, bus = _next_domain(domain)
        out.append((domain, bus))
        bus += per_nic
    return out


def _bdf(domain: int, rid: int) -> str:
    # A routing ID is bus<<8 | device<<3 | function (PCIe base spec, "Routing ID").
    return f"{domain:04x}:{rid >> 8:02x}:{(rid >> 3) & 0x1F:02x}.{rid & 7}"


def _rid(bdf: str) -> int:
    bus, devfn = bdf[5:].split(":")
    dev, fn = devfn.split(".")
    return int(bus, 16) << 8 | int(dev, 16) << 3 | int(fn)


class _Writer:
    """Writes sysfs shapes under one root; keeps the bookkeeping counters of one node."""

    def __init__(self, root: Path) -> None:
        self.root = str(root)
        self.state_dir = os.path.join(self.root, ".simnode")
        self.state_path = os.path.join(self.state_dir, "state.json")
        try:
            with open(self.state_path) as f:
                self.state: dict[str, object] = json.load(f)
        except FileNotFoundError:
            self.state = {
                "ifindex": 2,  # 1 is lo
                "ibdev": {},  # prefix → next number
                "uverbs": 0,
                "umad": 0,
                "ucm": 0,
                "iommu": 0,
                "uio": 0,
                "vdpa": 0,
                "virtio": 0,
                "names": {},  # device id → [ifname, ibdev]: what udev / the RDMA core would name it again
            }
        self._made: set[str] = set()

    def save(self) -> None:
        os.makedirs(self.state_dir, exist_ok=True)
        tmp = self.state_path + ".tmp"
        with open(tmp, "w") as f:
            f.write(json.dumps(self.state))  # one C-encoded string: json.dump's chunks cost ~10x
        os.replace(tmp, self.state_path)

    def counter(self, key: str) -> int:
        value = int(self.state[key])  # type: ignore[call-overload]
        self.state[key] = value + 1
        return value

    @property
    def names(self) -> dict[str, list[str]]:
        return self.state["names"]  # type: ignore[return-value]

    # -- primitives: os-level calls, no pathlib in the inner loop (16k VFs x ~30 entries each)
    def mkdir(self, path: str) -> None:
        if path in self._made:
            return
        os.makedirs(path, exist_ok=True)
        self._made.add(path)

    def write(self, path: str, text: str) -> None:
        fd = os.open(path, _WFLAGS, _FILE_MODE)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)

    def link(self, target: str, path: str) -> None:
        try:
            os.symlink(target, path)
        except FileExistsError:
            os.unlink(path)
            os.symlink(target, path)

    def up_to_root(self, path: str) -> str:
        # The relative prefix from a directory back to the sysfs root ("../../../..").
        depth = os.path.relpath(path, self.root).count("/") + 1
        return "/".join([".."] * depth)

    # -- kernel objects
    def root_port(self, domain: int, bus: int) -> str:
        """Create host bridge pci<dom>:<bus> and its root port <bus>:00.0; return the port's dir."""
        top = f"pci{domain:04x}:{bus:02x}"
        port_bdf = _bdf(domain, bus << 8)
        path = os.path.join(self.root, "devices", top, port_bdf)
        self.mkdir(path)
        self.pci_files(path, port_bdf, 0x8086, 0x347A, 0x060400, 0x8086, 0x0000, -1, None)
        self.bind(path, "pcieport")
        self.bus_link(path, port_bdf)
        return path

    def bus_link(self, path: str, bdf: str) -> None:
        rel = os.path.relpath(path, self.root)
        self.link(f"../../../{rel}", os.path.join(self.root, layout.PCI_DEVICES, bdf))

    def pci_files(
        self,
        path: str,
        bdf: str,
        vendor: int,
        device: int,
        pci_class: int,
        sub_vendor: int,
        sub_device: int,
        numa: int,
        acpi_index: int | None,
        driver: str = "",
    ) -> None:
        w = self.write
        w(path + "/vendor", f"0x{vendor:04x}\n")
        w(path + "/device", f"0x{device:04x}\n")
        w(path + "/class", f"0x{pci_class:06x}\n")
        w(path + "/subsystem_vendor", f"0x{sub_vendor:04x}\n")
        w(path + "/subsystem_device", f"0x{sub_device:04x}\n")
        w(path + "/numa_node", f"{numa}\n")
        w(path + "/enable", "1\n")
        w(path + "/driver_override", f"{NULL_OVERRIDE}\n")
        modalias = (
            f"pci:v{vendor:08X}d{device:08X}sv{sub_vendor:08X}sd{sub_device:08X}"
            f"bc{pci_class >> 16:02X}sc{(pci_class >> 8) & 0xFF:02X}i{pci_class & 0xFF:02X}"
        )
        w(path + "/modalias", modalias + "\n")
        # The driver core's dev_uevent() (drivers/base/core.c) puts DRIVER=<name> first while a driver
        # is bound, then the bus's vars: drivers/pci/pci-driver.c pci_uevent().  bind() keeps DRIVER=
        # in step with the driver link, as the kernel's (generated on read) uevent is.
        w(
            path + "/uevent",
            (f"DRIVER={driver}\n" if driver else "")
            + f"PCI_CLASS={pci_class:X}\nPCI_ID={vendor:04X}:{device:04X}\n"
            f"PCI_SUBSYS_ID={sub_vendor:04X}:{sub_device:04X}\nPCI_SLOT_NAME={bdf}\nMODALIAS={modalias}\n",
        )
        if acpi_index is not None:
            w(path + "/acpi_index", f"{acpi_index}\n")

    def bind(self, path: str, driver: str | None) -> None:
        link = path + "/driver"
        if os.path.islink(link):
            self.unbind_view(path)
            os.unlink(link)
        self.uevent_driver(path, driver)
        if driver is None:
            return
        self.driver_dir(driver)
        self.link(f"{self.up_to_root(path)}/{layout.PCI_DRIVERS}/{driver}", link)
        self.bind_view(path, driver)

    def driver_dir(self, driver: str) -> None:
        """``bus/pci/drivers/<driver>`` with the driver core's attribute files beside its device links."""
        path = os.path.join(self.root, layout.PCI_DRIVERS, driver)
        if path in self._made:
            return
        self.mkdir(path)
        for attr in ("bind", "unbind", "new_id", "remove_id", "uevent"):
            # Only the missing ones: a command written to bind/unbind waits there for its answer.
            if not os.path.exists(os.path.join(path, attr)):
                self.write(os.path.join(path, attr), "")

    def bind_view(self, path: str, driver: str) -> None:
        """The driver's side of a binding: ``bus/pci/drivers/<driver>/<bdf>`` → the device.

        drivers/base/dd.c driver_sysfs_add() makes this link beside the device's ``driver`` link.
        """
        rel = os.path.relpath(path, self.root)
        os.symlink(
            f"../../../../{rel}", os.path.join(self.root, layout.PCI_DRIVERS, driver, os.path.basename(path))
        )

    def unbind_view(self, path: str) -> None:
        """Remove the driver's link to a bound device (driver_sysfs_remove()), if there is one."""
        try:
            driver = os.path.basename(os.readlink(path + "/driver"))
        except OSError:
            return
        _unlink(os.path.join(self.root, layout.PCI_DRIVERS, driver, os.path.basename(path)))

    def uevent_driver(self, path: str, driver: str | None) -> None:
        """Rewrite the DRIVER= line of a function's uevent (dropped when unbound) in place."""
        try:
            with open(path + "/uevent", "rb") as f:
                lines = f.read().splitlines()
        except (FileNotFoundError, IsADirectoryError):
            return  # a test broke the file on purpose: leave it broken
        kept = [line for line in lines if not line.startswith(b"DRIVER=")]
        head = [b"DRIVER=" + driver.encode()] if driver else []
        _write_bytes(path + "/uevent", b"".join(line + b"\n" for line in head + kept))

    def iommu(self, path: str, bdf: str, noiommu: bool = False) -> int:
        group = self.counter("iommu")
        gdir = os.path.join(self.root, layout.IOMMU_GROUPS, str(group))
        self.mkdir(gdir + "/devices")
        if noiommu:
            # drivers/vfio/group.c names a no-IOMMU group "vfio-noiommu" (node /dev/vfio/noiommu-<n>).
            self.write(gdir + "/name", "vfio-noiommu\n")
        self.write(gdir + "/type", "DMA-FQ\n" if not noiommu else "identity\n")
        rel = os.path.relpath(path, self.root)
        self.link(f"../../../../{rel}", f"{gdir}/devices/{bdf}")
        self.link(f"{self.up_to_root(path)}/{layout.IOMMU_GROUPS}/{group}", path + "/iommu_group")
        return group

    def netdev(self, path: str, ifname: str, arphrd: int = 1, port_name: str = "") -> None:
        ndir = f"{path}/net/{ifname}"
        self.mkdir(ndir)
        index = self.counter("ifindex")
        w = self.write
        w(ndir + "/operstate", "up\n")
        w(ndir + "/carrier", "1\n")
        w(ndir + "/flags", f"0x{_FLAGS_UP:x}\n")
        w(ndir + "/type", f"{arphrd}\n")
        if arphrd == 32:
            w(
                ndir + "/address",
                f"00:00:10:87:fe:80:00:00:00:00:00:00:00:00:00:00:00:00:{index & 0xFF:02x}\n",
            )
        else:
            w(
                ndir + "/address",
                f"02:00:{index >> 24 & 0xFF:02x}:{index >> 16 & 0xFF:02x}:"
                f"{index >> 8 & 0xFF:02x}:{index & 0xFF:02x}\n",
            )
        w(ndir + "/ifindex", f"{index}\n")
        w(ndir + "/phys_port_name", f"{port_name}\n")
        rel = os.path.relpath(ndir, self.root)
        self.link(f"../../{rel}", os.path.join(self.root, layout.NET_CLASS, ifname))

    def virtio_dev(self, parent: str, driver: str) -> str:
        """A ``virtio<N>`` device below ``parent`` bound to ``driver``, as a VM's /sys has it; return its dir.

        drivers/virtio/virtio.c register_virtio_device() names it ``virtio<N>`` (one index over the
        node) and puts it on the virtio bus; its ``driver`` link is its own (virtio_net), not the
        parent's.  The files are the ones a real virtio-net device shows (device, vendor, features,
        modalias, status, uevent).
        """
        self.state.setdefault("virtio", 0)  # a node written before virtio devices existed here
        n = self.counter("virtio")
        path = f"{parent}/virtio{n}"
        self.mkdir(path)
        w = self.write
        w(path + "/device", f"0x{_VIRTIO_NET_ID:04x}\n")
        w(path + "/vendor", "0x1af4\n")
        w(path + "/features", "1" * 8 + "0" * 120 + "\n")
        modalias = f"virtio:d{_VIRTIO_NET_ID:08X}v00001AF4"
        w(path + "/modalias", modalias + "\n")
        w(path + "/status", "0x0000000f\n")  # ACKNOWLEDGE | DRIVER | DRIVER_OK | FEATURES_OK
        w(path + "/uevent", f"DRIVER={driver}\nMODALIAS={modalias}\n")
        up = self.up_to_root(path)
        self.mkdir(os.path.join(self.root, _VIRTIO_DRIVERS, driver))
        self.link(f"{up}/{_VIRTIO_DRIVERS}/{driver}", path + "/driver")
        self.link(f"{up}/bus/virtio", path + "/subsystem")
        rel = os.path.relpath(path, self.root)
        self.mkdir(os.path.join(self.root, _VIRTIO_DEVICES))
        self.link(f"../../../{rel}", os.path.join(self.root, _VIRTIO_DEVICES, f"virtio{n}"))
        self.link(f"../../../../{rel}", os.path.join(self.root, _VIRTIO_DRIVERS, driver, f"virtio{n}"))
        return path

    def virtio_netdev(self, vdev: str, ifname: str) -> None:
        """virtio_net's interface on a virtio device: ``net/<if>`` whose ``device`` link names that device."""
        self.netdev(vdev, ifname)
        self.link(f"../../../{os.path.basename(vdev)}", f"{vdev}/net/{ifname}/device")

    def virtio_nic(self, parent: str, bdf: str, numa: int, ifname: str) -> str:
        """A virtio-net PCI function as on a VM: its interface is ``<bdf>/virtio<N>/net/<if>``, not ``net/``.

        drivers/virtio/virtio_pci_common.c virtio_pci_probe() registers the virtio device with the
        function as its parent; virtio_net (drivers/net/virtio_net.c) registers the netdev on that
        device.  No SR-IOV files, no IOMMU group (a VM without a vIOMMU), as on this kind of VM.
        """
        spec = _VENDORS["virtio"]
        path = f"{parent}/{bdf}"
        self.mkdir(path)
        self.pci_files(
            path, bdf, spec.vendor, spec.pf_device, 0x020000, spec.vendor, spec.subsystem_device, numa, None
        )
        self.bind(path, spec.pf_driver)
        self.bus_link(path, bdf)
        self.virtio_netdev(self.virtio_dev(path, "virtio_net"), ifname)
        self.names[bdf] = [ifname, ""]
        return path

    def next_ibdev(self, prefix: str) -> str:
        numbers: dict[str, int] = self.state["ibdev"]  # type: ignore[assignment]
        n = numbers.get(prefix, 0)
        numbers[prefix] = n + 1
        return f"{prefix}{n}"

    def rdma(self, path: str, ibdev: str, infiniband: bool = False, ucm: bool = False) -> None:
        """Create infiniband/<ibdev> with port 1 and its uverbs/umad(/issm/ucm) class devices."""
        idir = f"{path}/infiniband/{ibdev}"
        pdir = idir + "/ports/1"
        self.mkdir(pdir + "/pkeys")
        w = self.write
        w(pdir + "/state", "4: ACTIVE\n")
        w(pdir + "/phys_state", "5: LinkUp\n")
        w(pdir + "/link_layer", "InfiniBand\n" if infiniband else "Ethernet\n")
        w(pdir + "/pkeys/0", "0xffff\n")
        w(idir + "/node_type", "1: CA\n")
        rel = os.path.relpath(idir, self.root)
        self.link(f"../../{rel}", os.path.join(self.root, layout.INFINIBAND_CLASS, ibdev))
        kinds = [("infiniband_verbs", "uverbs", "uverbs"), ("infiniband_mad", "umad", "umad")]
        if infiniband:
            # The subnet-management node exists per IB port only (drivers/infiniband/core/user_mad.c).
            kinds.append(("infiniband_mad", "issm", "umad"))
        if ucm:
            kinds.append(("infiniband_cm", "ucm", "ucm"))
        numbers: dict[str, int] = {}
        for cls, prefix, counter in kinds:
            # umadN and issmN share one number: both are minors of the same port.
            n = numbers[counter] if counter in numbers else self.counter(counter)
            numbers[counter] = n
            cdir = f"{path}/{cls}/{prefix}{n}"
            self.mkdir(cdir)
            w(cdir + "/ibdev", f"{ibdev}\n")
            if prefix == "umad":
                w(cdir + "/port", "1\n")
            crel = os.path.relpath(cdir, self.root)
            self.mkdir(os.path.join(self.root, "class", cls))
            self.link(f"../../{crel}", os.path.join(self.root, "class", cls, f"{prefix}{n}"))

    def ensure_base(self) -> None:
        for d in (
            layout.PCI_DEVICES,
            layout.PCI_DRIVERS,
            layout.AUX_DEVICES,
            layout.AUX_DRIVERS,
            layout.VDPA_DEVICES,
            layout.VDPA_DRIVERS,
            layout.NET_CLASS,
            layout.INFINIBAND_CLASS,
            layout.INFINIBAND_VERBS_CLASS,
            layout.INFINIBAND_MAD_CLASS,
            layout.IOMMU_GROUPS,
            "devices",
        ):
            self.mkdir(os.path.join(self.root, d))
        # The bus's probe trigger (drivers/base/bus.c drivers_probe_store()) and vfio-pci, loaded on a
        # node that hands out vfio VFs: testing.simkernel answers writes to them.
        probe = os.path.join(self.root, "bus", "pci", "drivers_probe")
        if not os.path.exists(probe):
            self.write(probe, "")
        self.driver_dir("vfio-pci")

    def pf(
        self,
        parent: str,
        bdf: str,
        spec: _Vendor,
        pci_class: int,
        numa: int,
        total_vfs: int,
        offset: int,
        stride: int,
        ifname: str,
        ibdev: str,
        acpi_index: int | None,
        infiniband: bool = False,
    ) -> str:
        path = f"{parent}/{bdf}"
        self.mkdir(path)
        self.pci_files(
            path,
            bdf,
            spec.vendor,
            spec.pf_device,
            pci_class,
            spec.vendor,
            spec.subsystem_device,
            numa,
            acpi_index,
        )
        w = self.write
        w(path + "/sriov_totalvfs", f"{total_vfs}\n")
        w(path + "/sriov_numvfs", "0\n")
        w(path + "/sriov_offset", f"{offset}\n")
        w(path + "/sriov_stride", f"{stride}\n")
        w(path + "/sriov_vf_device", f"{spec.vf_device:x}\n")
        w(path + "/sriov_drivers_autoprobe", "1\n")
        self.bind(path, spec.pf_driver)
        self.iommu(path, bdf)
        self.bus_link(path, bdf)
        if ifname:
            self.netdev(path, ifname, 32 if infiniband else 1, "p0" if not infiniband else "")
        if ibdev:
            self.rdma(path, ibdev, infiniband=infiniband, ucm=infiniband)
        self.names[bdf] = [ifname, ibdev]
        return path

    def create_vfs(self, pf_bdf: str, n: int) -> tuple[str, ...]:
        """Create VFs 0..n-1 of a PF as the kernel does when sriov_numvfs goes 0 → n."""
        pf_path = os.path.realpath(os.path.join(self.root, layout.PCI_DEVICES, pf_bdf))
        parent = os.path.dirname(pf_path)
        total = _read_int(pf_path + "/sriov_totalvfs")
        if n > total:
            raise OSError(errno.ERANGE, f"{pf_bdf}: {n} VFs requested, sriov_totalvfs is {total}")
        offset = _read_int(pf_path + "/sriov_offset")
        stride = _read_int(pf_path + "/sriov_stride")
        vf_device = int(_read_text(pf_path + "/sriov_vf_device"), 16)
        vendor = int(_read_text(pf_path + "/vendor"), 16)
        device = int(_read_text(pf_path + "/device"), 16)
        sub_device = int(_read_text(pf_path + "/subsystem_device"), 16)
        pci_class = int(_read_text(pf_path + "/class"), 16)
        numa = _read_int(pf_path + "/numa_node")
        pf_if, pf_ib = self.names.get(pf_bdf, ["", ""])
        vf_driver = _VF_DRIVERS.get((vendor, device), "")
        ib_prefix = pf_ib.rstrip("0123456789") if pf_ib else ""
        domain = int(pf_bdf[:4], 16)
        base = _rid(pf_bdf)
        up = self.up_to_root(pf_path)
        rel_parent = os.path.relpath(parent, self.root)
        bus_dir = os.path.join(self.root, layout.PCI_DEVICES)
        out = []
        for k in range(n):
            # PCIe SR-IOV: VF k's routing ID = PF RID + First VF Offset + k x VF Stride; the
            # addresses run past function 7 and spill onto the next bus numbers.
            bdf = _bdf(domain, base + offset + k * stride)
            path = f"{parent}/{bdf}"
            os.mkdir(path)
            self.pci_files(path, bdf, vendor, vf_device, pci_class, vendor, sub_device, numa, None, vf_driver)
            os.symlink(f"../{pf_bdf}", path + "/physfn")
            os.symlink(f"../{bdf}", f"{pf_path}/virtfn{k}")
            os.symlink(f"../../../{rel_parent}/{bdf}", f"{bus_dir}/{bdf}")
            if vf_driver:
                self.driver_dir(vf_driver)
                os.symlink(f"{up}/{layout.PCI_DRIVERS}/{vf_driver}", path + "/driver")
                self.bind_view(path, vf_driver)
            self.iommu(path, bdf)
            ifname = f"{pf_if}v{k}" if pf_if and vf_driver in _NET_DRIVERS else ""
            if ifname:
                self.netdev(path, ifname)
            ibdev = self.next_ibdev(ib_prefix) if ib_prefix else ""
            if ibdev:
                self.rdma(path, ibdev)
            self.names[bdf] = [ifname, ibdev]
            out.append(bdf)
        self.write(pf_path + "/sriov_numvfs", f"{n}\n")
        return tuple(out)

    def remove_function(self, path: str, bdf: str) -> None:
        """Tear down a function and every view of it (class links, bus link, IOMMU group)."""
        self.drop_views(path)
        self.unbind_view(path)
        group = os.path.join(path, "iommu_group")
        if os.path.islink(group):
            shutil.rmtree(os.path.realpath(group), ignore_errors=True)
        _unlink(os.path.join(self.root, layout.PCI_DEVICES, bdf))
        shutil.rmtree(path)

    def drop_views(self, path: str, keep_rdma: bool = False) -> None:
        """Remove net/, infiniband/, uio/ and the class links pointing at them (driver unbind)."""
        for ifname in _listdir(path + "/net"):
            _unlink(os.path.join(self.root, layout.NET_CLASS, ifname))
        shutil.rmtree(path + "/net", ignore_errors=True)
        if not keep_rdma:
            for ibdev in _listdir(path + "/infiniband"):
                _unlink(os.path.join(self.root, layout.INFINIBAND_CLASS, ibdev))
            shutil.rmtree(path + "/infiniband", ignore_errors=True)
            for cls in ("infiniband_verbs", "infiniband_mad", "infiniband_cm"):
                for name in _listdir(f"{path}/{cls}"):
                    _unlink(os.path.join(self.root, "class", cls, name))
                shutil.rmtree(f"{path}/{cls}", ignore_errors=True)
        for name in _listdir(path + "/uio"):
            _unlink(os.path.join(self.root, layout.UIO_CLASS, name))
        shutil.rmtree(path + "/uio", ignore_errors=True)


def _write(path: str, text: str) -> None:
    _write_bytes(path, text.encode())


def _write_bytes(path: str, data: bytes) -> None:
    # Attribute writes replace the content in place, as a sysfs store does (no rename: readers
    # holding the path must see the new value).
    fd = os.open(path, _WFLAGS, _FILE_MODE)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def _read_text(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def _read_int(path: str) -> int:
    return int(_read_text(path))


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except FileNotFoundError:
        return []


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class BuildProgress:
    """A progress callback for long builds: a redrawn bar on a terminal, a line per quarter otherwise."""

    def __init__(self, stream: TextIO, what: str, unit: str = "") -> None:
        self.stream = stream
        self.what = what
        self.unit = unit  # after the count: " PFs" shows "(3/16 PFs)"
        self.tty = stream.isatty()
        self._shown = -1
        self._drawn = False

    def __call__(self, done: int, total: int) -> None:
        """Report that ``done`` of ``total`` steps are finished."""
        pct = 100 * done // total if total else 100
        count = f"({done}/{total}{self.unit})"
        if self.tty:
            # Redrawn at every step, not only when the percentage moves: the count changes each time.
            bar = "#" * (pct // 4)
            self.stream.write(f"\r{self.what} [{bar:<25}] {pct:3d}% {count}")
            self.stream.flush()
            self._drawn = True
        elif pct // 25 != self._shown // 25 or done == total:
            self.stream.write(f"{self.what}: {pct}% {count}\n")
            self.stream.flush()
        self._shown = pct

    def done(self) -> None:
        """End the bar's line."""
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False


def build_node(
    root: Path,
    *,
    pfs: int = 16,
    vfs_per_pf: int = 256,
    vendor: str = "mellanox",
    rdma: bool = False,
    numa_nodes: int = 2,
    extras: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> NodeLayout:
    """Write a simulated node of ``pfs`` SR-IOV PFs with ``vfs_per_pf`` VFs each under ``root``.

    Two PFs share one dual-port NIC behind its own root port; NICs are spread over ``numa_nodes``.
    ``vendor="virtio"`` writes a VM's node instead: ``pfs`` virtio-net functions and no VFs
    (``vfs_per_pf`` and ``rdma`` do not apply; see _build_virtio).
    ``progress(done, total)`` is called after each PF's VFs are written (the slow part).
    """
    if vendor not in _VENDORS:
        raise ValueError(f"vendor {vendor!r}: expected one of {sorted(_VENDORS)}")
    if pfs < 0 or vfs_per_pf < 0 or numa_nodes < 1:
        raise ValueError(f"pfs={pfs}, vfs_per_pf={vfs_per_pf}, numa_nodes={numa_nodes}: must be >= 0/1")
    spec = _VENDORS[vendor]
    use_rdma = rdma
    root = Path(root)
    w = _Writer(root)
    w.ensure_base()
    if vendor == "virtio":
        return _build_virtio(w, pfs, numa_nodes, extras)
    nics = (pfs + 1) // 2
    plan = nic_buses(nics, vfs_per_pf)
    layout_pfs: list[tuple[str, str, int, str]] = []
    ib_prefix = "mlx5_" if vendor == "mellanox" else "irdma"
    for nic, (domain, bus) in enumerate(plan):
        numa = nic * numa_nodes // max(nics, 1)
        port = w.root_port(domain, bus)
        slot = nic + 1
        nic_bus = bus + 1
        for func in range(min(2, pfs - 2 * nic)):
            bdf = _bdf(domain, nic_bus << 8 | func)
            # PF f's VFs follow both PFs and the VFs of lower PFs (as mlx5/ice firmware lays them out).
            offset = 2 - func + func * vfs_per_pf
            ifname = f"ens{slot}f{func}"
            ibdev = w.next_ibdev(ib_prefix) if use_rdma else ""
            w.pf(port, bdf, spec, 0x020000, numa, vfs_per_pf, offset, 1, ifname, ibdev, None)
            layout_pfs.append((bdf, ifname, numa, ibdev))
    out: list[SimPF] = []
    if progress is not None:
        progress(0, len(layout_pfs))
    for bdf, ifname, numa, ibdev in layout_pfs:
        vfs = w.create_vfs(bdf, vfs_per_pf)
        if progress is not None:
            progress(len(out) + 1, len(layout_pfs))
        out.append(
            SimPF(
                address=bdf,
                netdev=ifname,
                numa_node=numa,
                vf_addresses=vfs,
                vf_netdevs=tuple(w.names[a][0] for a in vfs),
                ibdev=ibdev,
                vf_ibdevs=tuple(w.names[a][1] for a in vfs) if ibdev else (),
                vendor=vendor,
            )
        )
    extra = None
    if extras:
        domain, bus = plan[-1] if plan else (0, _FIRST_BUS[0])
        bus += _buses_per_nic(vfs_per_pf) if plan else 0
        if bus + _EXTRA_BUSES > _LAST_BUS:
            domain, bus = _next_domain(domain)
        extra = _build_extras(w, domain, bus, numa_nodes)
    w.save()
    return NodeLayout(root=root, pfs=tuple(out), vendor=vendor, rdma=rdma, extras=extra)


def _build_virtio(w: _Writer, nics: int, numa_nodes: int, extras: bool) -> NodeLayout:
    """A VM's node: ``nics`` virtio-net functions on the host bridge's bus 0 (slots 3 on), ``eth0`` on.

    As QEMU lays them out (and this project's CI VM shows): ``devices/pci0000:00/0000:00:<slot>.0``,
    no root port in between; each function standalone, with no VFs (virtio-net offers SR-IOV only with
    VIRTIO_F_SR_IOV, which QEMU's virtio-net does not).
    """
    if extras:
        raise ValueError("vendor 'virtio': the extras are SR-IOV hardware; a VM's node has none")
    if nics > 29:
        raise ValueError(f"{nics} virtio NICs do not fit bus 0 (slots 3-31)")
    top = os.path.join(w.root, "devices", "pci0000:00")
    w.mkdir(top)
    out = []
    for i in range(nics):
        bdf = _bdf(0, (3 + i) << 3)
        ifname = f"eth{i}"
        numa = i * numa_nodes // max(nics, 1)
        w.virtio_nic(top, bdf, numa, ifname)
        out.append(SimPF(address=bdf, netdev=ifname, numa_node=numa, vf_addresses=(), vf_netdevs=(),
                         ibdev="", vendor="virtio"))  # fmt: skip
    w.save()
    return NodeLayout(root=Path(w.root), pfs=tuple(out), vendor="virtio")


def _build_extras(w: _Writer, domain: int, bus: int, numa_nodes: int) -> SimExtras:
    """Add one of each special kind on NICs of their own (after the main ones, on the last NUMA node)."""
    numa = numa_nodes - 1
    mlx = _VENDORS["mellanox"]
    intel = _VENDORS["intel"]
    if bus + _EXTRA_BUSES > _LAST_BUS:
        raise ValueError("no PCI buses left for the extras")
    # 1. A ConnectX PF with subfunctions (mlx5 SFs on the auxiliary bus) and 2 VFs: one carries vDPA.
    port = w.root_port(domain, bus)
    sf_pf = _bdf(domain, (bus + 1) << 8)
    w.pf(port, sf_pf, mlx, 0x020000, numa, 8, 2, 1, "ens90f0", w.next_ibdev("mlx5_"), 90)
    sf_pf_path = f"{port}/{sf_pf}"
    vfs = w.create_vfs(sf_pf, 2)
    sfs, sf_netdevs, sf_ibdevs = [], [], []
    for n in (1, 2):
        name = f"mlx5_core.sf.{n}"
        path = f"{sf_pf_path}/{name}"
        w.mkdir(path)
        w.write(path + "/sfnum", f"{n}\n")
        w.mkdir(os.path.join(w.root, layout.AUX_DRIVERS, "mlx5_core.sf"))
        w.link(f"{w.up_to_root(path)}/{layout.AUX_DRIVERS}/mlx5_core.sf", path + "/driver")
        rel = os.path.relpath(path, w.root)
        w.link(f"../../../{rel}", os.path.join(w.root, layout.AUX_DEVICES, name))
        ifname, ibdev = f"ens90f0s{n}", w.next_ibdev("mlx5_")
        w.netdev(path, ifname)
        w.rdma(path, ibdev)
        w.names[name] = [ifname, ibdev]
        sfs.append(name)
        sf_netdevs.append(ifname)
        sf_ibdevs.append(ibdev)
    # Non-SF auxiliary devices exist beside them on real nodes and must not be taken for SFs.
    eth = f"{sf_pf_path}/mlx5_core.eth.0"
    w.mkdir(eth)
    w.link(
        f"../../../{os.path.relpath(eth, w.root)}",
        os.path.join(w.root, layout.AUX_DEVICES, "mlx5_core.eth.0"),
    )
    vdpa_vf = vfs[1]
    vdpa_path = os.path.realpath(os.path.join(w.root, layout.PCI_DEVICES, vdpa_vf)) + "/vdpa0"
    w.mkdir(vdpa_path)
    w.mkdir(os.path.join(w.root, layout.VDPA_DRIVERS, "vhost_vdpa"))
    w.link(f"{w.up_to_root(vdpa_path)}/{layout.VDPA_DRIVERS}/vhost_vdpa", vdpa_path + "/driver")
    w.link(
        f"../../../{os.path.relpath(vdpa_path, w.root)}", os.path.join(w.root, layout.VDPA_DEVICES, "vdpa0")
    )
    w.counter("vdpa")
    bus += 2
    # 2. An E810 with 3 VFs: VF0 on igb_uio, VF1 on vfio-pci, VF2 on vfio-pci in a no-IOMMU group.
    port = w.root_port(domain, bus)
    e810 = _bdf(domain, (bus + 1) << 8)
    w.pf(port, e810, intel, 0x020000, numa, 8, 0x10, 1, "ens91f0", "", 91)
    uio_vf, vfio_vf, noiommu_vf = w.create_vfs(e810, 3)
    bind_driver(w.root, uio_vf, "igb_uio", _writer=w)
    bind_driver(w.root, vfio_vf, "vfio-pci", _writer=w)
    nvf_path = os.path.realpath(os.path.join(w.root, layout.PCI_DEVICES, noiommu_vf))
    shutil.rmtree(os.path.realpath(nvf_path + "/iommu_group"))
    os.unlink(nvf_path + "/iommu_group")
    noiommu_group = w.iommu(nvf_path, noiommu_vf, noiommu=True)
    bind_driver(w.root, noiommu_vf, "vfio-pci", _writer=w)
    bus += 2
    # 3. An accelerator: Intel QAT 4xxx PF 4940 (class 0x120000) with VFs 4941 on vfio-pci.
    port = w.root_port(domain, bus)
    qat = _bdf(domain, (bus + 1) << 8)
    qspec = _Vendor(0x8086, 0x4940, 0x4941, "4xxx", "vfio-pci", 0x0000, False)
    w.pf(port, qat, qspec, 0x120000, numa, 16, 1, 1, "", "", None)
    accel_vfs = w.create_vfs(qat, 4)
    bus += 2
    # 4. An InfiniBand ConnectX-5 PF (class 0x020700): IPoIB netdev (ARPHRD_INFINIBAND 32), issm, ucm.
    port = w.root_port(domain, bus)
    ib_pf = _bdf(domain, (bus + 1) << 8)
    ibspec = _Vendor(0x15B3, 0x1017, 0x1018, "mlx5_core", "mlx5_core", 0x0007, True)
    ib_ibdev = w.next_ibdev("mlx5_")
    w.pf(port, ib_pf, ibspec, 0x020700, numa, 8, 2, 1, "ibs92f0", ib_ibdev, 92, infiniband=True)
    bus += 2
    # 5. A plain NIC without SR-IOV (I210 on igb).
    port = w.root_port(domain, bus)
    plain = _bdf(domain, (bus + 1) << 8)
    ppath = f"{port}/{plain}"
    w.mkdir(ppath)
    w.pci_files(ppath, plain, 0x8086, 0x1533, 0x020000, 0x8086, 0x0000, numa, 1)
    w.bind(ppath, "igb")
    w.iommu(ppath, plain)
    w.bus_link(ppath, plain)
    w.netdev(ppath, "eno1")
    w.names[plain] = ["eno1", ""]
    return SimExtras(
        sf_pf=sf_pf,
        sfs=tuple(sfs),
        sf_netdevs=tuple(sf_netdevs),
        sf_ibdevs=tuple(sf_ibdevs),
        vdpa_vf=vdpa_vf,
        vdpa="vdpa0",
        uio_vf=uio_vf,
        uio="uio0",
        vfio_vf=vfio_vf,
        noiommu_vf=noiommu_vf,
        noiommu_group=noiommu_group,
        accel_pf=qat,
        accel_vfs=accel_vfs,
        ib_pf=ib_pf,
        ib_netdev="ibs92f0",
        ib_ibdev=ib_ibdev,
        plain=plain,
        plain_netdev="eno1",
    )


# -------------------------------------------------------------------------------------------- mutators


def _device_path(root: str | Path, address: str) -> str:
    link = os.path.join(str(root), layout.PCI_DEVICES, address)
    if not os.path.lexists(link):
        raise FileNotFoundError(errno.ENOENT, f"no PCI device {address} under {root}")
    return os.path.realpath(link)


def set_link(root: Path | str, ifname: str, up: bool) -> None:
    """Set a host interface's operstate/carrier as an admin up/down (``ip link set``) would."""
    path = os.path.join(str(root), layout.NET_CLASS, ifname)
    if not os.path.isdir(path):
        raise FileNotFoundError(errno.ENOENT, f"no interface {ifname} under {root}/{layout.NET_CLASS}")
    # carrier is unreadable (EINVAL) while the link is admin-down; "0" stands in for that.
    _write(path + "/operstate", "up\n" if up else "down\n")
    _write(path + "/carrier", "1\n" if up else "0\n")
    if os.path.exists(path + "/flags"):
        flags = int(_read_text(path + "/flags"), 16)
        _write(path + "/flags", f"0x{flags | 1 if up else flags & ~1:x}\n")


def set_addresses(root: Path | str, ifname: str, addresses: list[str]) -> None:
    """Record the addresses (``10.0.0.1/24``) the host gives an interface, as ``ip addr add`` would.

    Kept in ``.simnode/addresses.json`` (the scanner never reads it): what an ``RTM_GETADDR`` dump
    would answer on a real node.  An empty list removes the interface's entry.
    """
    path = os.path.join(str(root), ADDRESSES)
    try:
        with open(path) as f:
            doc: dict[str, list[str]] = json.load(f)
    except FileNotFoundError:
        doc = {}
    if addresses:
        doc[ifname] = list(addresses)
    else:
        doc.pop(ifname, None)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    _write_json(path, doc)


def enslave(root: Path | str, ifname: str, master: str) -> None:
    """Make a host interface a port of ``master`` (a bond or bridge) as the kernel shows it.

    net/core/dev.c netdev_upper_dev_link() adds ``master`` and ``upper_<master>`` links in the port's
    directory and ``lower_<port>`` in the master's; a software master lives under ``devices/virtual``.
    """
    port = os.path.realpath(os.path.join(str(root), layout.NET_CLASS, ifname))
    if not os.path.isdir(port):
        raise FileNotFoundError(errno.ENOENT, f"no interface {ifname} under {root}/{layout.NET_CLASS}")
    mdir = os.path.join(str(root), "devices", "virtual", "net", master)
    os.makedirs(mdir, exist_ok=True)
    w = _Writer(Path(root))
    w.link(f"../../{os.path.relpath(mdir, w.root)}", os.path.join(w.root, layout.NET_CLASS, master))
    w.link(os.path.relpath(mdir, port), os.path.join(port, "master"))
    w.link(os.path.relpath(mdir, port), os.path.join(port, f"upper_{master}"))
    w.link(os.path.relpath(port, mdir), os.path.join(mdir, f"lower_{ifname}"))


def set_num_vfs(root: Path | str, pf_address: str, n: int) -> tuple[str, ...]:
    """Change a PF's enabled VFs as writing ``sriov_numvfs`` does; return the VF addresses now present.

    As in drivers/pci/iov.c, going from one non-zero count to another fails with EBUSY: write 0 first.
    """
    w = _Writer(Path(root))
    path = _device_path(root, pf_address)
    if not os.path.exists(path + "/sriov_totalvfs"):
        raise OSError(errno.ENOENT, f"{pf_address} is not an SR-IOV PF (no sriov_totalvfs)")
    current = _read_int(path + "/sriov_numvfs")
    if n < 0:
        raise ValueError(f"{pf_address}: VF count {n} is negative")
    if n == current:
        return tuple(os.path.basename(os.readlink(f"{path}/virtfn{k}")) for k in range(n))
    if current and n:
        raise OSError(errno.EBUSY, f"{pf_address}: {current} VFs enabled; write 0 before {n}")
    if n == 0:
        for k in range(current):
            vlink = f"{path}/virtfn{k}"
            bdf = os.path.basename(os.readlink(vlink))
            w.remove_function(os.path.join(os.path.dirname(path), bdf), bdf)
            w.names.pop(bdf, None)
            os.unlink(vlink)
        w.write(path + "/sriov_numvfs", "0\n")
        w.save()
        return ()
    vfs = w.create_vfs(pf_address, n)
    w.save()
    return vfs


def bind_driver(
    root: Path | str, address: str, driver: str | None, *, _writer: _Writer | None = None
) -> None:
    """Unbind a PCI function and bind it to ``driver`` (``None``: leave it unbound), as the kernel would.

    Network drivers bring the interface (and mlx5's RDMA device) back; vfio-pci and uio drivers take
    them away; uio drivers add ``uio/uio<N>``.
    """
    w = _writer or _Writer(Path(root))
    path = _device_path(root, address)
    w.drop_views(path)
    w.bind(path, driver)
    ifname, ibdev = w.names.get(address, ["", ""])
    if driver in _NET_DRIVERS and ifname:
        arphrd = 32 if _read_text(path + "/class").startswith("0x0207") else 1
        w.netdev(path, ifname, arphrd)
        if ibdev and driver == "mlx5_core":
            w.rdma(path, ibdev, infiniband=arphrd == 32)
    elif driver in _UIO_DRIVERS:
        n = w.counter("uio")
        udir = f"{path}/uio/uio{n}"
        w.mkdir(udir)
        w.write(udir + "/name", f"{driver}\n")
        w.mkdir(os.path.join(w.root, layout.UIO_CLASS))
        w.link(f"../../{os.path.relpath(udir, w.root)}", os.path.join(w.root, layout.UIO_CLASS, f"uio{n}"))
    if _writer is None:
        w.save()


def _net_dirs(path: str) -> list[str]:
    """A function's ``net/``, or where a virtio NIC's or a vDPA device's netdev sits deeper instead."""
    if os.path.isdir(path + "/net"):
        return [path + "/net"]
    found = []
    for entry in _listdir(path):
        if entry.startswith("virtio"):
            found.append(f"{path}/{entry}/net")
        elif entry.startswith("vdpa"):
            found.extend(
                f"{path}/{entry}/{sub}/net" for sub in _listdir(f"{path}/{entry}") if sub.startswith("virtio")
            )
    return [d for d in found if os.path.isdir(d)]


def move_netdev_to_pod(root: Path | str, address: str) -> None:
    """Move a function's interface into a pod's network namespace: net/ and class/net go, identity stays."""
    path = _device_path(root, address)
    dirs = _net_dirs(path)
    names = [(d, n) for d in dirs for n in _listdir(d)]
    if not names:
        raise FileNotFoundError(errno.ENOENT, f"{address} has no host interface to move")
    for d, ifname in names:
        _unlink(os.path.join(str(root), layout.NET_CLASS, ifname))
        shutil.rmtree(f"{d}/{ifname}")


def add_virtio_vdpa(root: Path | str, address: str, ifname: str, *, software: bool = False) -> str:
    """Give a function a vDPA device bound to virtio_vdpa, whose netdev virtio_net makes; return its name.

    drivers/virtio/virtio_vdpa.c virtio_vdpa_probe() parents the virtio device on the vDPA device's DMA
    device: the function itself for a hardware vDPA device (mlx5_vdpa, ifcvf), so the netdev is at
    ``<function>/virtio<N>/net/<if>``; the ``vdpa<N>`` device for a software one (vdpa_sim, VDUSE:
    ``software=True``), at ``<function>/vdpa<N>/virtio<M>/net/<if>``.
    """
    w = _Writer(Path(root))
    path = _device_path(root, address)
    name = f"vdpa{w.counter('vdpa')}"
    vdpa_path = f"{path}/{name}"
    w.mkdir(vdpa_path)
    w.mkdir(os.path.join(w.root, layout.VDPA_DRIVERS, "virtio_vdpa"))
    w.link(f"{w.up_to_root(vdpa_path)}/{layout.VDPA_DRIVERS}/virtio_vdpa", vdpa_path + "/driver")
    w.link(f"../../../{os.path.relpath(vdpa_path, w.root)}", os.path.join(w.root, layout.VDPA_DEVICES, name))
    w.virtio_netdev(w.virtio_dev(vdpa_path if software else path, "virtio_net"), ifname)
    w.save()
    return name


def set_rdma_port(root: Path | str, ibdev: str, port: int, state: int) -> None:
    """Set an RDMA port's state (1 DOWN … 4 ACTIVE) and a matching physical state."""
    if state not in _PORT_STATES:
        raise ValueError(f"RDMA port state {state}: expected one of {sorted(_PORT_STATES)}")
    pdir = os.path.join(str(root), layout.INFINIBAND_CLASS, ibdev, "ports", str(port))
    if not os.path.isdir(pdir):
        raise FileNotFoundError(errno.ENOENT, f"no RDMA port {ibdev}/{port} under {root}")
    _write(pdir + "/state", f"{state}: {_PORT_STATES[state]}\n")
    _write(pdir + "/phys_state", "5: LinkUp\n" if state >= 2 else "3: Disabled\n")


# ---------------------------------------------------------------------------------------------- config


def write_config(
    path: Path | str,
    layout: NodeLayout,
    prefix: str = DEFAULT_PREFIX,
    top: Mapping[str, object] | None = None,
) -> None:
    """Write an SR-IOV-network-device-plugin ``config.json`` whose every pool selects something.

    Pools, in order (the first pool that selects a device keeps it, as in that plugin): one per PF for
    the first half of the PFs (``pfNames``), one for every other VF of the vendor (``vendors``,
    ``devices``, ``drivers``; spread over PFs), and with RDMA a shared RDMA pool of the PFs.  ``top``
    adds top-level keys (``coalesceMs``, ``rdmaPollSeconds`` ...).
    """
    spec = _VENDORS[layout.vendor]
    half = max(1, len(layout.pfs) // 2)
    if layout.vendor == "virtio":
        # No VFs to select by pfNames (which selects a PF's children): the NICs themselves, half by
        # address, the rest by their ids and driver.
        nics: list[dict[str, object]] = [
            {"resourceName": "virtio_first", "resourcePrefix": prefix,
             "selectors": {"pciAddresses": [pf.address for pf in layout.pfs[:half]]}},
            {"resourceName": "virtio_nics", "resourcePrefix": prefix,
             "selectors": {"vendors": [f"{spec.vendor:04x}"], "devices": [f"{spec.pf_device:04x}"],
                           "drivers": [spec.pf_driver]}},
        ]  # fmt: skip
        _write_json(path, {"resourceList": nics, **(top or {})})
        return
    resources: list[dict[str, object]] = [
        {
            "resourceName": f"sriov_{pf.netdev}",
            "resourcePrefix": prefix,
            "selectors": {"pfNames": [pf.netdev]},
        }
        for pf in layout.pfs[:half]
    ]
    resources.append(
        {
            "resourceName": f"{layout.vendor}_vfs",
            "resourcePrefix": prefix,
            "preferredAllocation": "spread",
            "selectors": {
                "vendors": [f"{spec.vendor:04x}"],
                "devices": [f"{spec.vf_device:04x}"],
                "drivers": [spec.vf_driver],
            },
        }
    )
    if layout.rdma:
        resources.append(
            {
                "resourceName": "rdma_shared",
                "resourcePrefix": prefix,
                "deviceType": "accelerator",
                "rdmaShared": 16,
                "selectors": {"pciAddresses": [pf.address for pf in layout.pfs], "isRdma": True},
            }
        )
    _write_json(path, {"resourceList": resources, **(top or {})})


def _write_json(path: Path | str, doc: Mapping[str, object]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def simulate(
    out: Path | str,
    pfs: int = 16,
    vfs_per_pf: int = 256,
    vendor: str = "mellanox",
    rdma: bool = False,
    numa_nodes: int = 2,
    progress: Callable[[int, int], None] | None = None,
) -> NodeLayout:
    """Build a simulated node under ``out`` and write ``out/config.json`` for it (``densedev simulate``)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    layout = build_node(
        out,
        pfs=pfs,
        vfs_per_pf=vfs_per_pf,
        vendor=vendor,
        rdma=rdma,
        numa_nodes=numa_nodes,
        progress=progress,
    )
    write_config(out / "config.json", layout)
    return layout
