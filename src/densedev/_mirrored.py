"""The names of the hot-path functions ``densedev._fast`` and its twin ``densedev._fast_py`` both export."""

from __future__ import annotations

# The mirrored surface, listed once: accel re-exports it, and the extension's and the twin's ``__all__``
# are it; tests/test_accel_fallback.py holds both modules and _fast.pyi to it, signatures too.  Grouped
# by include: _pyx/<group>.pxi and its twin _fast_py/<group>.py.
MIRRORED: tuple[str, ...] = (
    # alloc: preferred-allocation ranking (alloc/respond.py)
    "pick_devices",
    # bitmap: health bitmaps over device-table indexes (health/tracker.py)
    "diff_bitmaps",
    "or_bitmaps",
    "select_bits",
    "set_bits",
    # netlink: rtnetlink link messages and kernel uevents (node/events.py)
    "parse_links",
    "parse_uevent",
    # scan: the sysfs scan of PCI functions, subfunctions and RDMA ports (node/scanner.py)
    "read_rdma_ports",
    "scan_sysfs",
    # wire: Device and ListAndWatchResponse bytes (kubelet/wire.py)
    "encode_device",
    "encode_list",
)
