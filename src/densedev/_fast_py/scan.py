"""Plain-Python twin of ``_pyx/scan.pxi``: the sysfs scan of PCI functions, subfunctions and RDMA ports.

This file is the spec.  ``scan_sysfs`` returns ``(devices, warnings)`` where each device is a
``densedev.model.Device``, sorted by id, and each warning a string naming the
device and the reason it was skipped or a field left empty.  Nothing here raises for a messy tree:
devices vanish mid-scan, files are half-written, symlinks dangle or loop on real nodes.

The scan is syscall-bound (each open, read, close or readlink costs 1-3 us on a VM), so it reads what
the kernel keeps per device only once and takes the rest from where the kernel says it is the same:

- netdevs and RDMA devices come from one pass over ``class/net`` and ``class/infiniband`` (one
  readlink per interface, naming its function) instead of listing every function's ``net/`` and
  ``infiniband/``: both views are the same kobjects, filtered by the same network namespace.
- A VF's NUMA node is its PF's: pci_device_add() sets a function's node from its bus
  (``pcibus_to_node``), a VF's bus is its PF's or a child bus sharing its host bridge data
  (drivers/pci/iov.c virtfn_add_bus), and a VF has no ACPI companion of its own.
- A VF's directory is a sibling of its PF's (drivers/pci/iov.c pci_iov_add_virtfn sets
  ``virtfn->dev.parent = dev->dev.parent``; the PF's ``virtfn<k>`` links say ``../<vf>``), so once its
  PF has been read, a VF is read relative to that parent: its driver link, IOMMU group and link type,
  with the PF's PCIe root.  Its ids are the ones all VFs of the PF share, read once from VF 0's uevent
  (see ``_vf_ids``).  Sorted addresses put every PF before its VFs (a VF's routing ID is the PF's
  plus a positive offset, PCIe SR-IOV spec 3.3.9-10).  Anything odd falls back to the full read.
- A PF's VFs are where its SR-IOV capability puts them: VF k's routing ID is the PF's plus First VF
  Offset plus k x VF Stride (PCIe SR-IOV spec 3.3.9-10; drivers/pci/iov.c pci_iov_virtfn_bus() and
  pci_iov_virtfn_devfn(), which make the ``virtfn<k>`` links), read from ``sriov_offset`` and
  ``sriov_stride`` (the values for the current ``sriov_numvfs``: pci_iov_set_numvfs() re-reads them).
  When every such address is on the bus, that is two reads per PF instead of a listing and one
  readlink per VF; otherwise (a VF removed on its own, odd numbers, a partial scan) the links decide.
- A VF's driver comes from its driver's directory: drivers/base/dd.c driver_sysfs_add() links
  ``bus/pci/drivers/<driver>/<address>`` to every device it binds, beside the device's own ``driver``
  link, so listing the drivers (a full scan lists them all, with the bus and the classes) names the
  driver of thousands of VFs in a few getdents calls instead of one readlink each.  A VF no driver
  lists (or two do) reads its own link.
"""

from __future__ import annotations

import os

from ..model import Device

_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_O_FILE = os.O_RDONLY | os.O_CLOEXEC
_READ_MAX = 255  # every attribute read here is one short line; sysfs hands out at most a page
_UEVENT_MAX = 1023  # a PCI device's uevent is ~150 bytes (DRIVER, PCI_*, MODALIAS)
# include/uapi/linux/if_arp.h: ARPHRD_ETHER 1, ARPHRD_INFINIBAND 32.
_LINK_TYPES = {1: "ether", 32: "infiniband"}
# RDMA character-device classes and the /dev/infiniband node each entry names (its ibdev file says whose).
_RDMA_CLASSES = (b"infiniband_verbs", b"infiniband_mad", b"infiniband_cm")

_ABSENT = -1  # sentinel status codes of _read, shared with the Cython version
_EMPTY = -2


def _read(dirfd: int, name: bytes, cap: int = _READ_MAX) -> tuple[int, bytes]:
    """Read a small attribute; return (0, stripped text) or (errno | _EMPTY, b"")."""
    try:
        fd = os.open(name, _O_FILE, dir_fd=dirfd)
    except OSError as e:
        return e.errno or 1, b""
    try:
        data = os.read(fd, cap)
    except OSError as e:
        return e.errno or 1, b""
    finally:
        os.close(fd)
    data = data.strip()
    if not data:
        return _EMPTY, b""
    return 0, data


def _readlink(dirfd: int, name: bytes) -> tuple[int, bytes]:
    try:
        return 0, os.readlink(name, dir_fd=dirfd)
    except OSError as e:
        return e.errno or 1, b""


def _entries(fd: int) -> list[bytes]:
    """Sorted entry names of an open directory, as bytes (``os.listdir(fd)`` hands out str)."""
    return sorted(os.fsencode(n) for n in os.listdir(fd))


def _listdir(dirfd: int, name: bytes) -> list[bytes]:
    """Sorted entries of a subdirectory; empty when it is absent or unreadable."""
    try:
        fd = os.open(name, _O_DIR, dir_fd=dirfd)
    except OSError:
        return []
    try:
        return _entries(fd)
    except OSError:
        return []
    finally:
        os.close(fd)


def _why(status: int) -> str:
    if status == _EMPTY:
        return "empty"
    if status == 2:  # ENOENT
        return "missing"
    return f"unreadable ({os.strerror(status)})"


def _hex_id(data: bytes, digits: int) -> str | None:
    """``0x15b3`` → ``15b3``; None unless it is 0x followed by exactly ``digits`` hex digits."""
    if len(data) != digits + 2 or data[:2] not in (b"0x", b"0X"):
        return None
    body = data[2:]
    for c in body:
        if not (48 <= c <= 57 or 97 <= c <= 102 or 65 <= c <= 70):
            return None
    return body.decode().lower()


def _is_hex(data: bytes) -> bool:
    return bool(data) and all(48 <= c <= 57 or 97 <= c <= 102 or 65 <= c <= 70 for c in data)


def _pair(value: bytes) -> tuple[str, str] | None:
    """``15B3:101E`` → ("15b3", "101e")."""
    if len(value) != 9 or value[4:5] != b":" or not _is_hex(value[:4]) or not _is_hex(value[5:]):
        return None
    return value[:4].decode().lower(), value[5:].decode().lower()


def _uevent_fields(data: bytes) -> tuple[list[str], bytes] | None:
    """Vendor, device, class and subsystem ids and the bound driver from a PCI device's ``uevent``.

    drivers/pci/pci-driver.c pci_uevent() writes PCI_CLASS=%04X, PCI_ID=%04X:%04X and
    PCI_SUBSYS_ID=%04X:%04X, and the driver core's dev_uevent() (drivers/base/core.c) DRIVER=<name>
    while a driver is bound: one read instead of five attribute files and the driver link (the scan
    is syscall-bound).  None if the ids are incomplete; the driver is b"" without a DRIVER= line.
    """
    pci_id = subsys = pci_class = None
    driver = b""
    for line in data.split(b"\n"):
        key, _, value = line.partition(b"=")
        if key == b"PCI_ID":
            pci_id = value
        elif key == b"PCI_SUBSYS_ID":
            subsys = value
        elif key == b"PCI_CLASS":
            pci_class = value
        elif key == b"DRIVER":
            driver = value
    if pci_id is None or subsys is None or pci_class is None:
        return None
    ids, sub = _pair(pci_id), _pair(subsys)
    if ids is None or sub is None or not (1 <= len(pci_class) <= 6 and _is_hex(pci_class)):
        return None
    return [ids[0], ids[1], pci_class.decode().lower().zfill(6), sub[0], sub[1]], driver


def _int(data: bytes) -> int | None:
    """A decimal integer with optional sign (the kernel's %d); None for anything else."""
    body = data[1:] if data[:1] == b"-" else data
    if not body or len(body) > 9 or not body.isdigit():
        return None
    return int(data)


def _basename(link: bytes) -> bytes:
    return link[link.rfind(b"/") + 1 :]


def _pcie_root(link: bytes) -> str:
    """First component after ``devices/`` of a resolved sysfs device path ("pci0000:3a")."""
    parts = [p for p in link.split(b"/") if p not in (b"", b".", b"..")]
    for i, p in enumerate(parts[:-1]):
        if p == b"devices":
            return os.fsdecode(parts[i + 1])
    return ""


def _parent(link: bytes) -> bytes:
    """The component before the last of a link target: the parent device of a bus entry."""
    parts = link.rstrip(b"/").split(b"/")
    return parts[-2] if len(parts) >= 2 else b""


def _numbered(name: bytes, prefix: bytes) -> bool:
    """Whether ``name`` is ``prefix`` followed by a decimal number (``virtio2``, ``vdpa0``)."""
    return len(name) > len(prefix) and name.startswith(prefix) and name[len(prefix) :].isdigit()


def _class_owner(link: bytes, cls: bytes) -> bytes:
    """``../../devices/.../<function>/<cls>/<node>`` → ``<function>``; b"" for any other shape.

    A virtio NIC's interface is not the function's own: virtio_net binds the virtio device the
    transport registers below it (drivers/virtio/virtio_pci_common.c virtio_pci_probe sets
    ``vp_dev->vdev.dev.parent = &pci_dev->dev``; virtio.c names it ``virtio<N>``), so the link reads
    ``<function>/virtio<N>/net/<if>``, and the function owns it.  virtio_vdpa parents its virtio device on
    the vDPA device's DMA device (virtio_vdpa.c virtio_vdpa_probe): the function for a hardware vDPA
    device, the ``vdpa<N>`` device itself for a software one, ``<function>/vdpa<N>/virtio<M>/net/<if>``.
    """
    parts = link.rstrip(b"/").split(b"/")
    if len(parts) < 3 or parts[-2] != cls:
        return b""
    owner = parts[-3]
    if cls == b"net" and len(parts) >= 4 and _numbered(owner, b"virtio"):
        owner = parts[-4]
        if len(parts) >= 5 and _numbered(owner, b"vdpa"):
            owner = parts[-5]
    return owner


def _rdma_map(rootfd: int) -> dict[bytes, list[str]]:
    """Function (PCI address or SF name) → its /dev/infiniband nodes, from each class read once per scan.

    A uverbs/umad/issm/ucm class device's parent is its ib_device's parent, the function itself
    (drivers/infiniband/core/uverbs_main.c ib_uverbs_add_one: ``uverbs_dev->dev.parent =
    device->dev.parent``; user_mad.c and ucma likewise), so its class link names the function: one
    readlink per node instead of opening, reading and closing its ``ibdev`` file.
    """
    out: dict[bytes, list[str]] = {}
    for cls in _RDMA_CLASSES:
        for owner, entries in _class_map(rootfd, cls).items():
            out.setdefault(owner, []).extend("/dev/infiniband/" + os.fsdecode(e) for e in entries)
    return out


def _class_map(rootfd: int, cls: bytes) -> dict[bytes, list[bytes]]:
    """Function → sorted names of its ``class/<cls>`` devices (netdevs or RDMA devices), one readlink each.

    ``class/net/<if>`` → ``../../devices/.../<function>/net/<if>`` (and likewise ``class/infiniband``):
    the component before ``<cls>`` names the function that owns it, the view a listing of the
    function's own ``net/`` or ``infiniband/`` directory would give.
    """
    out: dict[bytes, list[bytes]] = {}
    try:
        cfd = os.open(b"class/" + cls, _O_DIR, dir_fd=rootfd)
    except OSError:
        return out
    try:
        for entry in _entries(cfd):
            status, link = _readlink(cfd, entry)
            owner = _class_owner(link, cls) if status == 0 else b""
            if owner:
                out.setdefault(owner, []).append(entry)
    except OSError:
        pass
    finally:
        os.close(cfd)
    return out


def _vdpa_map(rootfd: int) -> dict[bytes, tuple[str, str]]:
    """Parent device name → (vdpaN, driver) from bus/vdpa/devices (first vDPA device per parent)."""
    out: dict[bytes, tuple[str, str]] = {}
    try:
        bfd = os.open(b"bus/vdpa/devices", _O_DIR, dir_fd=rootfd)
    except OSError:
        return out
    try:
        for entry in _entries(bfd):
            status, link = _readlink(bfd, entry)
            if status != 0:
                continue
            parent = _parent(link)
            if parent in out:
                continue
            status, drv = _readlink(bfd, entry + b"/driver")
            out[parent] = (os.fsdecode(entry), os.fsdecode(_basename(drv)) if status == 0 else "")
    except OSError:
        pass
    finally:
        os.close(bfd)
    return out


def _virtfns(devfd: int, pf: str, vf_map: dict[bytes, tuple[str, int]], warnings: list[str]) -> bytes:
    """Record VF address → (PF, index) from a PF's ``virtfn<k>`` links, each read once; return VF 0's."""
    first = b""
    for entry in _listdir(devfd, b"."):
        if not entry.startswith(b"virtfn"):
            continue
        k = _int(entry[6:])
        status, link = _readlink(devfd, entry)
        if k is None or k < 0 or status != 0:
            warnings.append(f"{pf}: {os.fsdecode(entry)}: {_why(status) if status else 'not a VF link'}")
            continue
        vf_map[_basename(link)] = (pf, k)
        if k == 0:
            first = _basename(link)
    return first


def _computed_virtfns(
    devfd: int, pf: str, numvfs: int, present: set[bytes] | None, vf_map: dict[bytes, tuple[str, int]]
) -> bytes | None:
    """Record a PF's VFs from its routing ID, ``sriov_offset`` and ``sriov_stride``; return VF 0's address.

    None when that cannot be trusted (no bus listing to check against, unusable numbers, or an address
    not on the bus): the caller reads the ``virtfn<k>`` links instead.
    """
    if present is None or numvfs <= 0:
        return None
    status, data = _read(devfd, b"sriov_offset")
    offset = _int(data) if status == 0 else None
    status, data = _read(devfd, b"sriov_stride")
    stride = _int(data) if status == 0 else None
    address = os.fsencode(pf)
    rid = _routing_id(address)
    if offset is None or stride is None or rid is None or offset <= 0 or stride < 0:
        return None
    if stride == 0 and numvfs > 1:  # every VF at one address: not a capability to trust
        return None
    domain = address[: address.index(b":")]
    found = []
    for k in range(numvfs):
        r = rid + offset + k * stride
        name = b"%s:%02x:%02x.%d" % (domain, r >> 8, (r >> 3) & 0x1F, r & 7)
        if r > 0xFFFF or name not in present:
            return None
        found.append(name)
    for k, name in enumerate(found):
        vf_map[name] = (pf, k)
    return found[0]


def _routing_id(address: bytes) -> int | None:
    """``0000:3b:00.1`` → bus << 8 | device << 3 | function; None for anything else."""
    parts = address.split(b":")
    if len(parts) != 3 or len(parts[1]) != 2 or len(parts[2]) != 4 or parts[2][2:3] != b".":
        return None
    bus, dev, fn = parts[1], parts[2][:2], parts[2][3:]
    if not (_is_hex(parts[0]) and _is_hex(bus) and _is_hex(dev) and fn.isdigit()):
        return None
    device, function = int(dev, 16), int(fn)
    if device > 0x1F or function > 7:
        return None
    return int(bus, 16) << 8 | device << 3 | function


def _vf_ids(parentfd: int, vf0: bytes) -> list[str] | None:
    """The ids every VF of a PF shares, from its VF 0's uevent (None if that is not usable).

    drivers/pci/iov.c gives each VF its PF's vendor and the SR-IOV capability's VF device ID, and
    pci_read_vf_config_common() reads class, revision and subsystem ids once and copies them to every
    VF, as the SR-IOV spec requires them identical across a PF's VFs.
    """
    if not vf0:
        return None
    status, data = _read(parentfd, vf0 + b"/uevent", _UEVENT_MAX)
    fields = _uevent_fields(data) if status == 0 else None
    return fields[0] if fields is not None else None


def _driver_map(rootfd: int) -> dict[bytes, bytes]:
    """Device address → its driver, from every ``bus/pci/drivers/<driver>`` directory's device links.

    A device two directories claim (a torn tree) maps to b"": neither is trusted, its own link decides.
    Entries without ':' are the driver core's attribute files (bind, unbind, new_id, uevent, module).
    """
    out: dict[bytes, bytes] = {}
    for driver in _listdir(rootfd, b"bus/pci/drivers"):
        for name in _listdir(rootfd, b"bus/pci/drivers/" + driver):
            if b":" in name:
                out[name] = b"" if name in out else driver
    return out


def _link_type(
    dirfd: int, prefix: bytes, ifname: bytes, dev: str, warnings: list[str], rootfd: int = -1
) -> str:
    """``ether``/``infiniband`` from ``<prefix>net/<if>/type`` (ARPHRD); "" for any other type.

    An interface the class map gave the function that is not in its ``net/`` sits deeper (a virtio
    NIC's ``virtio<N>/net/<if>``: see _class_owner): then, and only then, ``class/net/<if>`` names the
    same directory, so a function whose ``net/`` holds it never pays for the second open.
    """
    status, data = _read(dirfd, prefix + b"net/" + ifname + b"/type")
    if status == 2 and rootfd >= 0:
        status, data = _read(rootfd, b"class/net/" + ifname + b"/type")
    if status != 0:
        return ""  # the interface left the host namespace between listing and reading: no link type
    value = _int(data)
    if value is None:
        warnings.append(f"{dev}: net/{os.fsdecode(ifname)}/type: not an integer")
        return ""
    return _LINK_TYPES.get(value, "")


class _Maps:
    """What one scan reads once and every device looks up: class maps, vDPA parents, PFs' VFs."""

    __slots__ = (
        "drivers",
        "ibs",
        "nets",
        "parents",
        "pfs",
        "present",
        "rdma",
        "rootfd",
        "vdpa",
        "vf_map",
        "wanted",
    )

    def __init__(self, rootfd: int, full: bool) -> None:
        self.rootfd = rootfd
        self.present: set[bytes] | None = None  # every address on the bus (full scans only)
        self.wanted: set[bytes] | None = None  # the addresses a partial scan reads (full scans: None)
        # Device address → driver (full scans: a partial one reads fewer links than the listings hold).
        self.drivers = _driver_map(rootfd) if full else {}
        self.rdma = _rdma_map(rootfd)
        self.vdpa = _vdpa_map(rootfd)
        self.nets = _class_map(rootfd, b"net")
        self.ibs = _class_map(rootfd, b"infiniband")
        self.vf_map: dict[bytes, tuple[str, int]] = {}  # VF address → (PF, index), from virtfn links
        # PF read in this scan → (parent dir fd, PCIe root, the ids its VFs share or None, has a group,
        # NUMA node, first netdev): what a VF read beside it takes from it
        self.pfs: dict[str, tuple[int, str, list[str] | None, bool, int, str]] = {}
        self.parents: dict[bytes, int] = {}  # parent dir (link text) → open fd, shared by its PFs

    def parent_fd(self, busfd: int, link: bytes) -> int:
        """An open fd of the directory holding a function's real directory (-1 if it will not open)."""
        parent = link[: link.rfind(b"/")] if b"/" in link else b"."
        fd = self.parents.get(parent)
        if fd is None:
            try:
                fd = os.open(parent, _O_DIR, dir_fd=busfd)
            except OSError:
                fd = -1
            self.parents[parent] = fd
        return fd

    def close(self) -> None:
        for fd in self.parents.values():
            if fd >= 0:
                os.close(fd)
        self.parents.clear()


def _functions(maps: _Maps, name: bytes) -> tuple[tuple[str, ...], bytes, tuple[str, ...]]:
    """A function's netdevs, first RDMA device and its /dev/infiniband nodes, from the class maps."""
    netdevs = tuple(os.fsdecode(n) for n in maps.nets.get(name, ()))
    ibdevs = maps.ibs.get(name)
    ibdev = ibdevs[0] if ibdevs else b""
    nodes = tuple(sorted(maps.rdma.get(name, ()))) if ibdev else ()
    return netdevs, ibdev, nodes


def _scan_vf(maps: _Maps, name: bytes, warnings: list[str]) -> Device | None:
    """A VF whose PF this scan has read, relative to the PF's parent, complete; None to take the full read."""
    pf, index = maps.vf_map[name]
    parentfd, pcie_root, vf_ids, pf_grouped, numa, pf_netdev = maps.pfs[pf]
    listed = b""
    if vf_ids is not None:
        # Ids are its PF's VFs' (see _vf_ids): the driver alone is this VF's own, from its driver's
        # listing or else its link.  Unbound (or gone) takes the full read, which tells the two apart.
        listed = maps.drivers.get(name, b"")
        if listed:
            drv = listed
        else:
            status, drv = _readlink(parentfd, name + b"/driver")
            if status != 0:
                return None
        ids, driver = vf_ids, os.fsdecode(_basename(drv))
    else:
        status, data = _read(parentfd, name + b"/uevent", _UEVENT_MAX)
        fields = _uevent_fields(data) if status == 0 else None
        if fields is None:
            return None
        ids, uevent_driver = fields
        driver = os.fsdecode(uevent_driver)
        if not driver:
            status, drv = _readlink(parentfd, name + b"/driver")
            driver = os.fsdecode(_basename(drv)) if status == 0 else ""
    dev = os.fsdecode(name)
    said: list[str] = []
    group, noiommu = _iommu_group(parentfd, name + b"/", driver, dev, said)
    if listed and group < 0 and pf_grouped and not said:
        # Nothing of its own has been read yet: no group where its PF has one may be a VF that is
        # gone (the IOMMU puts every VF in a group when it does its PF), which the full read tells.
        return None
    warnings.extend(said)
    netdevs, ibdev, nodes = _functions(maps, name)
    link_type = (
        _link_type(parentfd, name + b"/", os.fsencode(netdevs[0]), dev, warnings, maps.rootfd)
        if netdevs
        else ""
    )
    uios = _listdir(parentfd, name + b"/uio") if "uio" in driver else []
    vdpa_name, vdpa_driver = maps.vdpa.get(name, ("", ""))
    # NUMA node and PF netdev are its PF's (see the module docstring), its index its virtfn link's.
    return Device(
        id=dev, role="vf", vendor=ids[0], device=ids[1], pci_class=ids[2], subsystem_vendor=ids[3],
        subsystem_device=ids[4], driver=driver, numa_node=numa, iommu_group=group, noiommu=noiommu,
        acpi_index=-1, total_vfs=0, num_vfs=0, pf=pf, vf_index=index, pf_netdev=pf_netdev, netdevs=netdevs,
        link_type=link_type, rdma_device=os.fsdecode(ibdev), rdma_nodes=nodes,
        uio=os.fsdecode(uios[0]) if uios else "", vdpa=vdpa_name, vdpa_driver=vdpa_driver,
        pcie_root=pcie_root, aux_type="",
    )  # fmt: skip


def _iommu_group(dirfd: int, prefix: bytes, driver: str, dev: str, warnings: list[str]) -> tuple[int, bool]:
    """The function's IOMMU group number (-1 without one) and whether it is a vfio no-IOMMU group."""
    status, glink = _readlink(dirfd, prefix + b"iommu_group")
    if status != 0:
        return -1, False
    g = _int(_basename(glink))
    if g is None or g < 0:
        warnings.append(f"{dev}: iommu_group: not a group number")
        return -1, False
    # drivers/vfio/group.c makes a no-IOMMU group (named "vfio-noiommu") only for a device a vfio
    # driver binds, so only those are asked.
    if driver.startswith("vfio"):
        status, gname = _read(dirfd, prefix + b"iommu_group/name")
        return g, status == 0 and gname == b"vfio-noiommu"
    return g, False


def _scan_pci(busfd: int, name: bytes, maps: _Maps, warnings: list[str]) -> Device | None:
    """One PCI function as a Device (a VF's PF netdev, index and NUMA node are filled in later)."""
    dev = os.fsdecode(name)
    link_status, link = _readlink(busfd, name)
    pcie_root = _pcie_root(link) if link_status == 0 else ""
    try:
        devfd = os.open(name, _O_DIR, dir_fd=busfd)
    except OSError as e:
        warnings.append(f"{dev}: skipped: {os.strerror(e.errno or 1)}")
        return None
    try:
        status, data = _read(devfd, b"uevent", _UEVENT_MAX)
        from_uevent = _uevent_fields(data) if status == 0 else None
        uevent_driver = b""
        if from_uevent is not None:
            ids = from_uevent[0][:3]
            subsys = from_uevent[0][3:]
            uevent_driver = from_uevent[1]
        else:
            # No usable uevent (half-written or odd tree): the individual attribute files decide.
            ids = []
            for attr, digits in ((b"vendor", 4), (b"device", 4), (b"class", 6)):
                status, data = _read(devfd, attr)
                value = _hex_id(data, digits) if status == 0 else None
                if value is None:
                    why = _why(status) if status else "not a hex id"
                    warnings.append(f"{dev}: skipped: {attr.decode()}: {why}")
                    return None
                ids.append(value)
            subsys = []
            for attr in (b"subsystem_vendor", b"subsystem_device"):
                status, data = _read(devfd, attr)
                hex_id = _hex_id(data, 4) if status == 0 else None
                if hex_id is None:
                    if status != 2:
                        why = _why(status) if status else "not a hex id"
                        warnings.append(f"{dev}: {attr.decode()}: {why}")
                    hex_id = ""
                subsys.append(hex_id)
        # A VF has no SR-IOV capability of its own (PCIe SR-IOV spec) and no ACPI companion, so the
        # kernel shows neither sriov_* nor acpi_index on it, and its NUMA node is its PF's (see the
        # module docstring): once physfn is found, skip those probes.
        status, plink = _readlink(devfd, b"physfn")
        pf = os.fsdecode(_basename(plink)) if status == 0 else ""
        if status not in (0, 2):
            warnings.append(f"{dev}: physfn: {_why(status)}")
        attrs = () if pf else ((b"numa_node", -1), (b"acpi_index", -1), (b"sriov_totalvfs", -2))
        ints: list[int] = [-1, -1, -2]
        for i, (attr, default) in enumerate(attrs):
            status, data = _read(devfd, attr)
            number = _int(data) if status == 0 else None
            if number is None:
                if status != 2:
                    warnings.append(f"{dev}: {attr.decode()}: {_why(status) if status else 'not an integer'}")
                # absent: the default (-2 for sriov_totalvfs means "not a PF"); present but bad: -1
                number = default if status == 2 else max(default, -1)
            ints[i] = number
        numa, acpi, total = ints
        if uevent_driver:
            driver = os.fsdecode(uevent_driver)
        else:
            # No DRIVER= line (unbound, or the attribute files decided): the driver link says.
            status, drv = _readlink(devfd, b"driver")
            driver = os.fsdecode(_basename(drv)) if status == 0 else ""
        group, noiommu = _iommu_group(devfd, b"", driver, dev, warnings)
        role = "vf" if pf else "pci"
        num = 0
        netdevs, ibdev, nodes = _functions(maps, name)
        if total != -2:
            role = "pf"
            total = max(total, 0)
            status, data = _read(devfd, b"sriov_numvfs")
            numvfs = _int(data) if status == 0 else None
            if numvfs is None:
                warnings.append(f"{dev}: sriov_numvfs: {_why(status) if status else 'not an integer'}")
                numvfs = 0
            num = numvfs
            vf0 = _computed_virtfns(devfd, dev, num, maps.present, maps.vf_map)
            if vf0 is None:
                vf0 = _virtfns(devfd, dev, maps.vf_map, warnings)
            parentfd = maps.parent_fd(busfd, link) if link_status == 0 else -1
            if parentfd >= 0:
                pf_netdev = netdevs[0] if netdevs else ""
                # A partial scan reads VF 0's uevent only if VF 0 is among its devices: one left out (its
                # files do not answer: node.stuck) must not be read for its siblings either; they then
                # read their own.
                read_ids = maps.wanted is None or vf0 in maps.wanted
                vf_ids = _vf_ids(parentfd, vf0) if read_ids else None
                maps.pfs[dev] = (parentfd, pcie_root, vf_ids, group >= 0, numa, pf_netdev)
        else:
            total = 0
        link_type = (
            _link_type(devfd, b"", os.fsencode(netdevs[0]), dev, warnings, maps.rootfd) if netdevs else ""
        )
        # uio/uioN exists only under a uio driver (igb_uio, uio_pci_generic, ...): drivers/uio/uio.c.
        uios = _listdir(devfd, b"uio") if "uio" in driver else []
        vdpa_name, vdpa_driver = maps.vdpa.get(name, ("", ""))
        return Device(
            id=dev, role=role, vendor=ids[0], device=ids[1], pci_class=ids[2], subsystem_vendor=subsys[0],
            subsystem_device=subsys[1], driver=driver, numa_node=numa, iommu_group=group, noiommu=noiommu,
            acpi_index=acpi, total_vfs=total, num_vfs=num, pf=pf, vf_index=-1, pf_netdev="",
            netdevs=netdevs, link_type=link_type, rdma_device=os.fsdecode(ibdev), rdma_nodes=nodes,
            uio=os.fsdecode(uios[0]) if uios else "", vdpa=vdpa_name, vdpa_driver=vdpa_driver,
            pcie_root=pcie_root, aux_type="",
        )  # fmt: skip
    finally:
        os.close(devfd)


def _pf_facts(busfd: int, pf: str, maps: _Maps, warnings: list[str]) -> tuple[tuple[str, ...], int]:
    """For a partial scan: a PF outside the set still gives its VFs their index, netdev and NUMA node."""
    try:
        devfd = os.open(os.fsencode(pf), _O_DIR, dir_fd=busfd)
    except OSError:
        return (), -1
    try:
        _virtfns(devfd, pf, maps.vf_map, warnings)
        status, data = _read(devfd, b"numa_node")
        numa = _int(data) if status == 0 else None
        return tuple(os.fsdecode(n) for n in maps.nets.get(os.fsencode(pf), ())), -1 if numa is None else numa
    finally:
        os.close(devfd)


def _scan_sfs(rootfd: int, by_id: dict[str, Device], maps: _Maps, warnings: list[str]) -> list[Device]:
    """Auxiliary-bus subfunctions (``*.sf.<n>``) whose parent PF is among the scanned devices."""
    out: list[Device] = []
    try:
        afd = os.open(b"bus/auxiliary/devices", _O_DIR, dir_fd=rootfd)
    except OSError:
        return out
    try:
        names = _entries(afd)
    except OSError:
        names = []
    try:
        for name in names:
            # mlx5 also puts .eth/.rdma/.eth-rep devices on the auxiliary bus; only .sf. are subfunctions.
            if b".sf." not in name:
                continue
            sf = os.fsdecode(name)
            status, link = _readlink(afd, name)
            if status != 0:
                warnings.append(f"{sf}: skipped: {_why(status)}")
                continue
            parent = by_id.get(os.fsdecode(_parent(link)))
            if parent is None:
                continue  # parent PF not scanned (partial scan) or skipped with its own warning
            try:
                devfd = os.open(name, _O_DIR, dir_fd=afd)
            except OSError as e:
                warnings.append(f"{sf}: skipped: {os.strerror(e.errno or 1)}")
                continue
            netdevs, ibdev, nodes = _functions(maps, name)
            try:
                status, drv = _readlink(devfd, b"driver")
                # mlx5's SF device shows its SF number (sf/dev/dev.c sfnum_show); ranged pfNames select
                # SFs by it, so it goes where a VF keeps its index.
                sf_status, data = _read(devfd, b"sfnum")
                sfnum = _int(data) if sf_status == 0 else None
                if sfnum is None or sfnum < 0:
                    if sf_status != 2:
                        why = _why(sf_status) if sf_status else "not an integer"
                        warnings.append(f"{sf}: sfnum: {why}")
                    sfnum = -1
                link_type = (
                    _link_type(devfd, b"", os.fsencode(netdevs[0]), sf, warnings, maps.rootfd)
                    if netdevs
                    else ""
                )
            finally:
                os.close(devfd)
            vdpa_name, vdpa_driver = maps.vdpa.get(name, ("", ""))
            # An SF shares its parent function's ids and NUMA node; its sfnum goes where a VF's index does.
            out.append(Device(
                id=sf, role="sf", vendor=parent.vendor, device=parent.device, pci_class=parent.pci_class,
                subsystem_vendor=parent.subsystem_vendor, subsystem_device=parent.subsystem_device,
                driver=os.fsdecode(_basename(drv)) if status == 0 else "", numa_node=parent.numa_node,
                iommu_group=-1, noiommu=False, acpi_index=-1, total_vfs=0, num_vfs=0, pf=parent.id,
                vf_index=sfnum, pf_netdev=parent.netdevs[0] if parent.netdevs else "", netdevs=netdevs,
                link_type=link_type, rdma_device=os.fsdecode(ibdev), rdma_nodes=nodes, uio="",
                vdpa=vdpa_name, vdpa_driver=vdpa_driver, pcie_root=_pcie_root(link), aux_type="sf",
            ))  # fmt: skip
    finally:
        os.close(afd)
    return out


def scan_sysfs(
    root: bytes, addresses: tuple[bytes, ...] | None = None, threads: bool = True, gate: int = -1
) -> tuple[tuple[Device, ...], tuple[str, ...]]:
    """Scan PCI functions (all, or only ``addresses``) and their subfunctions under a sysfs root.

    Returns ``(devices, warnings)``: ``Device``s sorted by id, and one string per skipped device or
    field left empty.  ``threads`` lets the extension share the reads with helper threads (less time,
    a little more CPU), and ``gate`` (a file descriptor) holds those helpers back until it is readable;
    the twin reads on this thread either way.
    """
    warnings: list[str] = []
    try:
        rootfd = os.open(root, _O_DIR)
    except OSError as e:
        return (), (f"{os.fsdecode(root)}: cannot open sysfs root: {os.strerror(e.errno or 1)}",)
    try:
        try:
            busfd = os.open(b"bus/pci/devices", _O_DIR, dir_fd=rootfd)
        except OSError as e:
            return (), (f"{os.fsdecode(root)}/bus/pci/devices: {os.strerror(e.errno or 1)}",)
        maps = _Maps(rootfd, addresses is None)
        try:
            names = _entries(busfd) if addresses is None else sorted(set(addresses))
            if addresses is None:
                maps.present = set(names)
            else:
                maps.wanted = set(names)
            rows: list[Device] = []
            for name in names:
                hit = maps.vf_map.get(name)
                row = _scan_vf(maps, name, warnings) if hit is not None and hit[0] in maps.pfs else None
                if row is None:
                    row = _scan_pci(busfd, name, maps, warnings)
                if row is not None:
                    rows.append(row)
            by_id = {row.id: row for row in rows}
            pf_facts: dict[str, tuple[tuple[str, ...], int]] = {}
            for i, row in enumerate(rows):
                if row.role != "vf" or row.vf_index >= 0:
                    continue  # not a VF, or one read beside its PF: complete already
                pf = row.pf
                parent = by_id.get(pf)
                if parent is not None:
                    facts = (parent.netdevs, parent.numa_node)
                elif pf in pf_facts:
                    facts = pf_facts[pf]
                else:
                    facts = pf_facts[pf] = _pf_facts(busfd, pf, maps, warnings)
                netdevs, numa = facts
                hit = maps.vf_map.get(os.fsencode(row.id))
                # by_id too: an SF on a VF (below) takes the VF's NUMA node and PF netdev.
                rows[i] = by_id[row.id] = row._replace(
                    pf_netdev=netdevs[0] if netdevs else "",
                    numa_node=numa,
                    vf_index=hit[1] if hit is not None and hit[0] == pf else -1,
                )
            rows.extend(_scan_sfs(rootfd, by_id, maps, warnings))
        finally:
            maps.close()
            os.close(busfd)
    finally:
        os.close(rootfd)
    rows.sort(key=lambda r: r.id)
    return tuple(rows), tuple(warnings)


def _leading_int(data: bytes) -> int:
    """``4: ACTIVE`` → 4; -1 when the text does not start with a number."""
    head = data.split(b":", 1)[0].strip()
    value = _int(head)
    return -1 if value is None else value


def read_rdma_ports(root: bytes, ibdevs: tuple[bytes, ...]) -> tuple[tuple[str, int, int, int], ...]:
    """Read ``(ibdev, port, state, phys_state)`` for every port of each RDMA device (absent ones skipped)."""
    out: list[tuple[str, int, int, int]] = []
    try:
        cfd = os.open(os.path.join(root, b"class/infiniband"), _O_DIR)
    except OSError:
        return ()
    try:
        for ibdev in ibdevs:
            pdir = ibdev + b"/ports"
            for port in _listdir(cfd, pdir):
                n = _int(port)
                if n is None:
                    continue
                status, state = _read(cfd, pdir + b"/" + port + b"/state")
                if status != 0:
                    continue
                status, phys = _read(cfd, pdir + b"/" + port + b"/phys_state")
                out.append(
                    (os.fsdecode(ibdev), n, _leading_int(state), _leading_int(phys) if status == 0 else -1)
                )
    finally:
        os.close(cfd)
    return tuple(out)
