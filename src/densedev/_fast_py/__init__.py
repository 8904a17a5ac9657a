"""Plain-Python twin of ``densedev._fast``: same functions, same signatures, same results."""

from __future__ import annotations

from .._mirrored import MIRRORED as MIRRORED
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

# The mirrored surface is listed once, in densedev/_mirrored.py (light, so that a node running the
# extension never imports this twin just to learn the names).
__all__ = list(MIRRORED)
