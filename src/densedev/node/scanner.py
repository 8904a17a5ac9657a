"""Discovery: scan a sysfs root into one device table that every resource pool selects from.

The scan itself is the accelerator's ``scan_sysfs`` (Cython, or its plain-Python twin); this module
turns its tuples into ``Device`` named tuples, offers partial rescans for the event path (one PF and
its VFs after a ``sriov_numvfs`` write or a driver bind) and the cheap RDMA port poll, and looks up
optional human-readable names in ``pci.ids``.
"""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Iterable
from functools import partial
from pathlib import Path

from .. import accel
from ..model import Device
from ..printable import columns
from .layout import PCI_DEVICES, SYSFS_ROOT
from .table import DeviceTable

__all__ = [
    "DeviceTable",
    "PciNames",
    "format_devices",
    "pf_family",
    "read_rdma_ports",
    "rescan_devices",
    "rescan_pf",
    "scan",
]

log = logging.getLogger(__name__)

# Where distributions install the PCI ID database (pciutils / hwdata); optional.
PCI_IDS_PATHS = ("/usr/share/misc/pci.ids", "/usr/share/hwdata/pci.ids", "/usr/share/pci.ids")


_make_device = partial(tuple.__new__, Device)


def _root(sysfs_root: str | Path) -> bytes:
    return os.fsencode(sysfs_root)


def _table(
    result: tuple[tuple[tuple[object, ...], ...], tuple[str, ...]], previous: DeviceTable | None = None
) -> DeviceTable:
    rows, warnings = result
    for w in warnings:
        # A vanishing or half-written entry is normal on a busy node: never fail the scan.  Callers
        # report the warnings (summarised); here they are only traced.
        log.debug("discovery: %s", w)
    if previous is not None and _same(rows, previous.devices):
        # Nothing changed (a Device is a tuple and compares equal to its row): keep the table the
        # daemon already holds instead of making 16k new objects for the collector to walk.
        if warnings == previous.warnings:
            return previous
        return DeviceTable(previous.devices, warnings)
    return DeviceTable(_devices(rows), warnings)


# Rows compared or converted per C call: one call over a 16k-row table holds the GIL for ~10 ms (a
# compare walks ~400k fields), so the event loop's thread, waiting for it, could not run meanwhile.
# Between slices CPython may hand the GIL over (sys.getswitchinterval()).
_SLICE = 512


def _same(rows: tuple[tuple[object, ...], ...], devices: tuple[Device, ...]) -> bool:
    """Return whether a scan's rows equal a table's devices (a Device is a tuple), a slice at a time."""
    if len(rows) != len(devices):
        return False
    return all(rows[i : i + _SLICE] == devices[i : i + _SLICE] for i in range(0, len(rows), _SLICE))


def _devices(rows: tuple[tuple[object, ...], ...]) -> tuple[Device, ...]:
    # Device._make is a Python-level call per row; the scan's rows have exactly Device's fields (the
    # accelerator's tests hold both scans to that), so the tuple constructor alone makes them.
    # Each Device is a new tuple the cyclic collector tracks: with it running, every 700 of them set
    # off a young collection that walks them (half the time of making 4k).  They live as long as the
    # table, and the daemon freezes them (gc.freeze) once its pools are built, so it waits till then.
    enabled = gc.isenabled()
    gc.disable()
    try:
        out: list[Device] = []
        for i in range(0, len(rows), _SLICE):
            out.extend(map(_make_device, rows[i : i + _SLICE]))
        return tuple(out)
    finally:
        if enabled:
            gc.enable()


def scan(
    sysfs_root: str | Path = SYSFS_ROOT, previous: DeviceTable | None = None, *, threads: bool = True
) -> DeviceTable:
    """Scan every PCI function and auxiliary subfunction under ``sysfs_root`` into a device table.

    With ``previous`` (the table of the last scan), an unchanged node returns that same table.
    ``threads=False`` reads on the calling thread alone: slower, but the least CPU (for reconciles).
    """
    return _table(accel.scan_sysfs(_root(sysfs_root), None, threads), previous)


def rescan_devices(sysfs_root: str | Path, addresses: Iterable[str]) -> DeviceTable:
    """Scan only the given PCI addresses (and the subfunctions of any PF among them).

    An address that no longer exists is absent from the result (with a warning); merge the result
    into the full table with ``DeviceTable.merged(result, addresses)``.
    """
    wanted = tuple(sorted({os.fsencode(a) for a in addresses}))
    if not wanted:
        return DeviceTable(())
    return _table(accel.scan_sysfs(_root(sysfs_root), wanted))


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


def rescan_pf(sysfs_root: str | Path, pf_address: str, previous: DeviceTable | None = None) -> DeviceTable:
    """Rescan one PF and all its VFs (after a ``sriov_numvfs`` write or a rebind).

    With ``previous`` the result is that table with the PF's old and new family replaced; VFs that
    disappeared are dropped.
    """
    family = pf_family(sysfs_root, pf_address)
    # Only what exists now is scanned: VFs the kernel destroyed are dropped from the table, not warned.
    fresh = rescan_devices(sysfs_root, family)
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
