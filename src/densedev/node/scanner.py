"""Discovery: scan a sysfs root into one device table that every resource pool selects from.

The scan itself is the accelerator's ``scan_sysfs`` (Cython, or its plain-Python twin), which returns
``Device`` named tuples; this module holds them in a ``DeviceTable``, offers partial rescans for the
event path (one PF and its VFs after a ``sriov_numvfs`` write or a driver bind) and the cheap RDMA port
poll, and looks up optional human-readable names in ``pci.ids``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .. import accel
from ..model import Device

__all__ = [
    "DeviceTable",
    "PciNames",
    "format_table",
    "pf_family",
    "read_rdma_ports",
    "rescan_devices",
    "rescan_pf",
    "scan",
]

log = logging.getLogger(__name__)

DEFAULT_SYSFS = "/sys"
# Where distributions install the PCI ID database (pciutils / hwdata); optional.
PCI_IDS_PATHS = ("/usr/share/misc/pci.ids", "/usr/share/hwdata/pci.ids", "/usr/share/pci.ids")


@dataclass(frozen=True)
class DeviceTable:
    """Every device one scan found, sorted by id, and the warnings about what it skipped or left empty."""

    devices: tuple[Device, ...]
    warnings: tuple[str, ...] = ()
    _index: dict[str, int] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Built once: pools, health and allocation all look devices up by id.
        index = {d.id: i for i, d in enumerate(self.devices)}
        object.__setattr__(self, "_index", index)

    def by_id(self) -> Mapping[str, Device]:
        """Return a read-only mapping of device id → device."""
        devices = self.devices
        return _ById(self._index, devices)

    def index_of(self, device_id: str) -> int:
        """Return the position of ``device_id`` in ``devices`` (raises KeyError naming an unknown id)."""
        try:
            return self._index[device_id]
        except KeyError:
            raise KeyError(f"no device {device_id!r} in the device table") from None

    def __len__(self) -> int:
        return len(self.devices)

    def merged(self, update: DeviceTable, scope: Iterable[str]) -> DeviceTable:
        """Return this table with the ids in ``scope`` replaced by ``update``'s (or dropped)."""
        drop = set(scope) | {d.id for d in update.devices}
        kept = [d for d in self.devices if d.id not in drop]
        kept.extend(update.devices)
        kept.sort(key=lambda d: d.id)
        return DeviceTable(tuple(kept), update.warnings)


class _ById(Mapping[str, Device]):
    """A mapping view over a table's index and devices, so ``by_id`` costs nothing to call."""

    __slots__ = ("_devices", "_index")

    def __init__(self, index: dict[str, int], devices: tuple[Device, ...]) -> None:
        self._index = index
        self._devices = devices

    def __getitem__(self, key: str) -> Device:
        return self._devices[self._index[key]]

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)


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
    sysfs_root: str | Path = DEFAULT_SYSFS, previous: DeviceTable | None = None, *, threads: bool = True
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
    path = os.path.join(os.fsdecode(_root(sysfs_root)), "bus/pci/devices", pf_address)
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


def format_table(table: DeviceTable, names: PciNames | None = None) -> str:
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
    widths = [max(len(r[i]) for r in rows) for i in range(len(head) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1] for r in rows]
    lines.append(f"{len(table.devices)} devices, {len(table.warnings)} warnings")
    return "\n".join(line.rstrip() for line in lines)
