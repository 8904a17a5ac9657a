"""Discovery: scan a sysfs root into one device table that every resource pool selects from.

The scan itself is the accelerator's ``scan_sysfs`` (Cython, or its plain-Python twin), which returns
``Device`` named tuples; this module holds them in a ``DeviceTable``, offers partial rescans for the
event path (one PF and its VFs after a ``sriov_numvfs`` write or a driver bind) and the cheap RDMA port
poll, and looks up optional human-readable names in ``pci.ids``.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Collection, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, TypeVar

from .. import accel, pci
from ..model import Device, Pool, Role
from ..ops.logs import log_event
from ..printable import columns
from . import stuck
from .layout import NET_CLASS, PCI_DEVICES, SYSFS_ROOT
from .table import DeviceTable

if TYPE_CHECKING:
    from .events import UeventTuple

__all__ = [
    "UEVENT_ACTIONS",
    "UEVENT_SUBSYSTEMS",
    "DeviceTable",
    "PciNames",
    "Rescan",
    "ScanRead",
    "Scanner",
    "format_devices",
    "netdev_names",
    "pci_address_in",
    "pf_family",
    "rdma_devices",
    "read_rdma_ports",
    "rescan_devices",
    "rescan_pf",
    "scan",
    "uevent_target",
]

log = logging.getLogger(__name__)

_T = TypeVar("_T")

# A scan's rows and warnings from (addresses or None for all, threads), as ``accel.scan_sysfs`` gives them.
ScanRead = Callable[[tuple[bytes, ...] | None, bool], tuple[tuple[Device, ...], tuple[str, ...]]]

# Devices one read may find hung, one after another, before it gives up (each costs the thread blocked
# in it): more at once is not one bad driver but a sysfs that does not answer.
MAX_UNANSWERED = 16
# The most a sysfs attribute's read hands out: fs/sysfs/file.c sysfs_kf_seq_show() fills one PAGE_SIZE
# buffer (4096 bytes on x86-64 and arm64's default), so one read of a page is all there is; a longer
# file is not a sysfs attribute and its tail is not read.
ATTR_MAX = 4096

# Where distributions install the PCI ID database (pciutils / hwdata); optional.
PCI_IDS_PATHS = ("/usr/share/misc/pci.ids", "/usr/share/hwdata/pci.ids", "/usr/share/pci.ids")


def _root(sysfs_root: str | Path) -> bytes:
    return os.fsencode(sysfs_root)


def _table(
    result: tuple[tuple[Device, ...], tuple[str, ...]], previous: DeviceTable | None = None
) -> DeviceTable:
    rows, warnings = result
    for w in warnings:
        # A vanishing or half-written entry is normal on a busy node: never fail the scan.  Callers
        # report the warnings (summarised); here they are only traced.
        log.debug("discovery: %s", w)
    if previous is not None and _same(rows, previous.devices):
        # Nothing changed: give back the table the daemon already holds (its pools were built from
        # it, and gc.freeze may hold its devices by now) and let the scan's equal Devices go.
        if warnings == previous.warnings:
            return previous
        return DeviceTable(previous.devices, warnings)
    return DeviceTable(rows, warnings)


# Devices compared per C call: one call over a 16k-row table holds the GIL for ~10 ms (a
# compare walks ~400k fields), so the event loop's thread, waiting for it, could not run meanwhile.
# Between slices CPython may hand the GIL over (sys.getswitchinterval()).
_SLICE = 512


def _same(rows: tuple[Device, ...], devices: tuple[Device, ...]) -> bool:
    """Return whether a scan's devices equal a table's, a slice at a time."""
    if len(rows) != len(devices):
        return False
    return all(rows[i : i + _SLICE] == devices[i : i + _SLICE] for i in range(0, len(rows), _SLICE))


def scan(
    sysfs_root: str | Path = SYSFS_ROOT, previous: DeviceTable | None = None, *, threads: bool = True
) -> DeviceTable:
    """Scan every PCI function and auxiliary subfunction under ``sysfs_root`` into a device table.

    With ``previous`` (the table of the last scan), an unchanged node returns that same table.
    ``threads=False`` reads on the calling thread alone: slower, but the least CPU (for reconciles).
    """
    return _table(accel.scan_sysfs(_root(sysfs_root), None, threads), previous)


def rescan_devices(
    sysfs_root: str | Path, addresses: Iterable[str], *, read: ScanRead | None = None
) -> DeviceTable:
    """Scan only the given PCI addresses (and the subfunctions of any PF among them).

    An address that no longer exists is absent from the result (with a warning); merge the result
    into the full table with ``DeviceTable.merged(result, addresses)``.  ``read`` scans instead of
    ``accel.scan_sysfs`` (the ``Scanner``'s, bounded).
    """
    wanted = tuple(sorted({os.fsencode(a) for a in addresses}))
    if not wanted:
        return DeviceTable(())
    if read is None:
        return _table(accel.scan_sysfs(_root(sysfs_root), wanted))
    return _table(read(wanted, True))


def pf_family(sysfs_root: str | Path, pf_address: str) -> tuple[str, ...]:
    """Return the PF's address and the addresses of its current VFs (from its ``virtfn<k>`` links)."""
    path = os.path.join(os.fsdecode(_root(sysfs_root)), PCI_DEVICES, pf_address)
    out = [pf_address]
    try:
        names = os.listdir(path)
    except OSError:
        return tuple(out)
    for name in names:
        if name.startswith("virtfn"):
            try:
                out.append(os.path.basename(os.readlink(os.path.join(path, name))))
            except OSError:
                continue  # VF destroyed while we read: it is gone from the rescan too
    return tuple(out)


def rescan_pf(
    sysfs_root: str | Path,
    pf_address: str,
    previous: DeviceTable | None = None,
    *,
    read: ScanRead | None = None,
) -> DeviceTable:
    """Rescan one PF and all its VFs (after a ``sriov_numvfs`` write or a rebind).

    With ``previous`` the result is that table with the PF's old and new family replaced; VFs that
    disappeared are dropped.
    """
    family = pf_family(sysfs_root, pf_address)
    # Only what exists now is scanned: VFs the kernel destroyed are dropped from the table, not warned.
    fresh = rescan_devices(sysfs_root, family, read=read)
    if previous is None:
        return fresh
    scope = set(family) | {d.id for d in previous.devices if d.pf == pf_address}
    return previous.merged(fresh, scope)


def read_rdma_ports(sysfs_root: str | Path, ibdevs: Iterable[str]) -> tuple[tuple[str, int, int, int], ...]:
    """Return ``(ibdev, port, state, phys_state)`` for every port of the given RDMA devices.

    States are the kernel's numbers (``4`` = ACTIVE; phys ``5`` = LinkUp); devices that vanished are
    absent.  Polled every second (RDMA port state has no event source), so it reads only those files.
    """
    return accel.read_rdma_ports(_root(sysfs_root), tuple(os.fsencode(i) for i in ibdevs))


class PciNames:
    """Vendor and device names from a ``pci.ids`` file, loaded lazily on first lookup; never required."""

    def __init__(self, path: str | Path | None = None) -> None:
        self._path = path
        self._vendors: dict[str, str] | None = None
        self._devices: dict[tuple[str, str], str] = {}

    def _load(self) -> None:
        self._vendors = {}
        paths = (str(self._path),) if self._path is not None else PCI_IDS_PATHS
        for path in paths:
            try:
                with open(path, encoding="utf-8", errors="replace") as f:
                    self._parse(f)
                return
            except OSError:
                continue

    def _parse(self, lines: Iterable[str]) -> None:
        # pci.ids: "vvvv  Vendor", "\tdddd  Device", "\t\tssss ssss  Subsystem"; "C xx  Class" starts the
        # class section, which is not wanted here.
        assert self._vendors is not None
        vendor = ""
        for line in lines:
            if not line or line[0] == "#" or line.isspace():
                continue
            if line.startswith("C "):
                break
            if line[0] != "\t":
                vendor = line[:4].lower()
                self._vendors[vendor] = line[4:].strip()
            elif line[1] != "\t" and vendor:
                self._devices[(vendor, line[1:5].lower())] = line[5:].strip()

    def vendor(self, vendor: str) -> str:
        """Return the vendor's name, or "" when unknown or no ``pci.ids`` is installed."""
        if self._vendors is None:
            self._load()
        assert self._vendors is not None
        return self._vendors.get(vendor.lower(), "")

    def device(self, vendor: str, device: str) -> str:
        """Return the device's name, or "" when unknown or no ``pci.ids`` is installed."""
        if self._vendors is None:
            self._load()
        return self._devices.get((vendor.lower(), device.lower()), "")


def format_devices(table: DeviceTable, names: PciNames | None = None) -> str:
    """Render a device table for people: one line per device, with ``pci.ids`` names when available."""
    names = names if names is not None else PciNames()
    head = ("ID", "ROLE", "VENDOR:DEV", "CLASS", "DRIVER", "NUMA", "PF#VF", "NETDEV", "RDMA", "ROOT", "NAME")
    rows = [head]
    for d in table.devices:
        pf = f"{d.pf}#{d.vf_index}" if d.vf_index >= 0 else d.pf
        extra = d.uio or d.vdpa or ("noiommu" if d.noiommu else "")
        rows.append(
            (
                d.id,
                d.role,
                f"{d.vendor}:{d.device}",
                d.pci_class,
                d.driver or "-",
                str(d.numa_node),
                pf or "-",
                ",".join(d.netdevs) or "-",
                d.rdma_device or "-",
                d.pcie_root or "-",
                " ".join(x for x in (names.device(d.vendor, d.device), extra) if x),
            )
        )
    lines = columns(rows)
    lines.append(f"{len(table.devices)} devices, {len(table.warnings)} warnings")
    return "\n".join(lines)


# --- the sysfs root, owned --------------------------------------------------------------------------

# Kernel uevents that change what a scan would find (lib/kobject_uevent.c action names).
UEVENT_SUBSYSTEMS = frozenset(("pci", "net", "infiniband", "auxiliary", "vdpa"))
UEVENT_ACTIONS = frozenset(("add", "remove", "bind", "unbind", "change", "move"))
# Beyond a few dozen devices one pass over the node is cheaper than many partial ones.
MAX_TARGETED_RESCANS = 32


def pci_address_in(devpath: str) -> str | None:
    """Return the last PCI address among DEVPATH's components, or None (then rescan everything)."""
    found = [part for part in devpath.split("/") if pci.is_address(part)]
    return found[-1] if found else None


def uevent_target(event: UeventTuple) -> tuple[bool, str | None]:
    """Return whether a kernel uevent changes what a scan finds, and the PCI address to rescan (None: all)."""
    action, devpath, env = event
    fields = dict(env)
    if fields.get("SUBSYSTEM", "") not in UEVENT_SUBSYSTEMS or action not in UEVENT_ACTIONS:
        return False, None
    # The device is named by PCI_SLOT_NAME (pci) or is the last PCI function in DEVPATH (net,
    # infiniband, auxiliary and vdpa devices hang below their PCI function).
    return True, fields.get("PCI_SLOT_NAME") or pci_address_in(devpath)


def netdev_names(devices: Iterable[Device]) -> set[str]:
    """Return the host interface names of the devices and of their PFs (whose link state they follow)."""
    names: set[str] = set()
    for d in devices:
        names.update(d.netdevs)
        if d.pf_netdev:
            names.add(d.pf_netdev)
    return names


def rdma_devices(pools: Iterable[Pool], devices: Iterable[Device]) -> list[str]:
    """Return the RDMA devices whose ports are polled: the pools' (all the table's when there is no pool)."""
    seen: dict[str, None] = {}
    any_pool = False
    for pool in pools:
        any_pool = True
        for m in pool.members:
            if m.device.rdma_device:
                seen[m.device.rdma_device] = None
    if not any_pool:
        for d in devices:
            if d.rdma_device:
                seen[d.rdma_device] = None
    return list(seen)


class Rescan(NamedTuple):
    """A rescan's result: the new table, whether it read the whole node, and whether anything changed."""

    table: DeviceTable
    full: bool
    changed: bool


class Scanner:
    """Owns one sysfs root: full scans, targeted rescans, interface operstates and RDMA port states.

    Every read runs on a thread of its own under a deadline (``node.stuck``): a device whose files do
    not answer is left out with one warning, every other device is read, and the device is read again
    once the read blocked in it has returned (or its file was replaced), at the next rescan.
    """

    def __init__(self, sysfs_root: str | Path = SYSFS_ROOT, *, deadline_s: float = stuck.DEADLINE_S) -> None:
        self.root = Path(sysfs_root)
        self._deadline_s = deadline_s
        # Files found hung, one record per reader: a hung RDMA port file leaves its device's scan alone.
        self._hung_scan = stuck.HungFiles()
        self._hung_ports = stuck.HungFiles()
        self._hung_links = stuck.HungFiles()
        # Devices found hung in a file their VFs' reads go through too (a PF's numa_node): while that
        # file is on record, the VFs are left out with the device, not lost to it one thread at a time.
        self._through: set[str] = set()

    def scan(
        self, previous: DeviceTable | None = None, *, threads: bool = True, unanswered: Iterable[str] = ()
    ) -> DeviceTable:
        """Scan the whole node (see ``scan``), leaving out devices whose files do not answer.

        ``unanswered``: files another process was found blocked in (the scanning child, ``node.ahead``);
        their devices are left out of this scan (and read again at the next).
        """
        return _table(self.read(None, threads, unanswered), previous)

    def read(
        self, addresses: tuple[bytes, ...] | None, threads: bool = True, unanswered: Iterable[str] = ()
    ) -> tuple[tuple[Device, ...], tuple[str, ...]]:
        """Return ``accel.scan_sysfs`` of these addresses (None: all), without the devices that do not answer.

        A device found hung is left out and the rest read again; a device read again through another
        (a PF's ``numa_node`` is read for its VFs) takes that other's VFs with it.
        """
        skip = {d for d in map(stuck.device_of, self._hung_scan.outstanding()) if d}
        for path in sorted(unanswered):
            device = stuck.device_of(path)
            if device and device not in skip:
                skip.add(device)
                self._warn(device, path)
        self._through &= skip
        family = set(self._through)  # devices whose VFs are left out too
        for attempt in range(MAX_UNANSWERED + 1):
            wanted = self._without(addresses, skip, family) if skip else addresses
            try:
                return self._bounded(
                    functools.partial(accel.scan_sysfs, _root(self.root), wanted, threads), self._hung_scan
                )
            except stuck.Unanswered as exc:
                for path in sorted(exc.paths):
                    device = stuck.device_of(path)
                    # No device to leave out, or left out with its VFs and still read: give this read up.
                    if not device or device in family or attempt == MAX_UNANSWERED:
                        raise
                    if device in skip:  # warned already: now its VFs go with it
                        log.debug("discovery: %s is read for its VFs too: leaving them out", device)
                        family.add(device)
                        self._through.add(device)
                        continue
                    skip.add(device)
                    self._warn(device, path)
        raise AssertionError("unreachable")

    def _without(
        self, addresses: tuple[bytes, ...] | None, skip: set[str], family: set[str]
    ) -> tuple[bytes, ...]:
        """The addresses (None: every function on the bus) less those skipped and the VFs of ``family``."""
        drop = set(skip)
        for pf in family:
            drop.update(pf_family(self.root, pf))
        if addresses is None:
            try:
                # A listing (getdents) runs no driver code: it does not hang with a driver.
                addresses = tuple(sorted(os.listdir(os.fsencode(self.root / PCI_DEVICES))))
            except OSError:
                addresses = ()
        return tuple(a for a in addresses if os.fsdecode(a) not in drop)

    def _bounded(self, fn: Callable[[], _T], hung: stuck.HungFiles) -> _T:
        return stuck.call(fn, self.root, hung, deadline_s=self._deadline_s)

    def _warn(self, what: str, path: str) -> None:
        log_event(
            log,
            "sysfs read does not answer",
            level=logging.WARNING,
            device=what,
            file=path,
            skipped="until it answers",
        )

    def _skipping(
        self, hung: stuck.HungFiles, key: Callable[[str], str], read: Callable[[frozenset[str]], _T]
    ) -> _T:
        """Return ``read(skipped)``, bounded; each file that hangs adds its name (``key``) to ``skipped``."""
        skip = {k for k in map(key, hung.outstanding()) if k}
        for attempt in range(MAX_UNANSWERED + 1):
            try:
                return self._bounded(functools.partial(read, frozenset(skip)), hung)
            except stuck.Unanswered as exc:
                for path in sorted(exc.paths):
                    name = key(path)
                    if not name or name in skip or attempt == MAX_UNANSWERED:
                        raise
                    skip.add(name)
                    self._warn(name, path)
        raise AssertionError("unreachable")

    def table_of(self, devices: tuple[Device, ...], warnings: tuple[str, ...]) -> DeviceTable:
        """Hold a whole scan's rows read elsewhere (``node.ahead``) as this scanner's scan does."""
        return _table((devices, warnings))

    def rescan(self, table: DeviceTable, targets: Collection[str], *, threads: bool = True) -> Rescan:
        """Rescan the targets (a PF with its whole VF family), or everything when none or too many.

        Blocking: the daemon runs it in a worker thread.  ``threads=False`` is for a full scan that
        most likely finds nothing (the periodic reconcile): one thread, the least CPU.
        """
        if not targets or len(targets) > MAX_TARGETED_RESCANS:
            new = self.scan(table, threads=threads)
            # scan() hands back the devices it was given when none changed (compared slice by slice).
            return Rescan(new, True, new.devices is not table.devices)
        new = table
        for address in sorted(targets):
            known = new.by_id().get(address)
            is_pf = (known is not None and known.role == Role.PF) or os.path.exists(
                os.path.join(self.root, PCI_DEVICES, address, "sriov_totalvfs")
            )
            if is_pf:
                new = rescan_pf(self.root, address, new, read=self.read)
            else:
                new = new.merged(rescan_devices(self.root, [address], read=self.read), [address])
        # A merged table keeps the Devices it did not rescan: mostly identity checks.
        return Rescan(new, False, new.devices != table.devices)

    def operstates(self, ifnames: Iterable[str]) -> list[tuple[str, bool]]:
        """Read ``class/net/<if>/operstate`` for the named interfaces (simulated nodes carry no netlink).

        A real node's first netlink dump overrides these; on a simulated tree they are the only truth.
        Unreadable files are skipped: the interface may just have left the host namespace; so is one
        that does not answer (with one warning).
        """
        names = list(ifnames)
        if not names:
            return []
        return self._skipping(
            self._hung_links,
            functools.partial(stuck.after, directory="net"),
            functools.partial(self._operstates, names),
        )

    def _operstates(self, ifnames: list[str], skip: frozenset[str]) -> list[tuple[str, bool]]:
        out: list[tuple[str, bool]] = []
        base = os.path.join(os.fspath(self.root), NET_CLASS)
        for name in ifnames:
            if name in skip:
                continue
            try:
                fd = os.open(os.path.join(base, name, "operstate"), os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                state = os.read(fd, ATTR_MAX).strip()  # one page at most, as the kernel hands out
            except OSError:
                continue
            finally:
                os.close(fd)
            out.append((name, state in (b"up", b"unknown")))
        return out

    def rdma_ports(self, ibdevs: Iterable[str]) -> tuple[tuple[str, int, int, int], ...]:
        """Return ``(ibdev, port, state, phys_state)`` for every port of these RDMA devices (those whose
        files do not answer left out, with one warning)."""
        names = list(ibdevs)
        return self._skipping(
            self._hung_ports,
            functools.partial(stuck.after, directory="infiniband"),
            lambda skip: read_rdma_ports(self.root, [i for i in names if i not in skip]),
        )
