"""Plain-Python twin of ``densedev._fast``: same functions, same signatures, same results."""

from __future__ import annotations

from .alloc import pick_devices as pick_devices
from .bitmap import diff_bitmaps as diff_bitmaps
from .bitmap import or_bitmaps as or_bitmaps
from .bitmap import select_bits as select_bits
from .bitmap import set_bits as set_bits
from .netlink import parse_links as parse_links
from .netlink import parse_uevent as parse_uevent
from .scan import read_rdma_ports as read_rdma_ports
from .scan import scan_sysfs as scan_sysfs
from .wire import encode_device as encode_device
from .wire import encode_list as encode_list

# The mirrored surface, listed once: accel re-exports it and the extension's ``__all__`` is it;
# tests/test_accel_fallback.py holds both modules and _fast.pyi to it, signatures too.  A literal list,
# so type checkers read it (accel's typing star-imports it).  Grouped by include: _pyx/<group>.pxi and
# its twin _fast_py/<group>.py.
__all__ = [  # noqa: RUF022 (grouped by include, not sorted)
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
]
MIRRORED: tuple[str, ...] = tuple(__all__)
