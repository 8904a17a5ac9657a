"""Plain-Python twin of ``densedev._fast``: same functions, same signatures, same results."""

from __future__ import annotations

# alloc: preferred-allocation ranking (allocation.py)
from .alloc import pick_devices as pick_devices

# bitmap: health bitmaps over device-table indexes
from .bitmap import diff_bitmaps as diff_bitmaps
from .bitmap import or_bitmaps as or_bitmaps
from .bitmap import select_bits as select_bits
from .bitmap import set_bits as set_bits

# netlink: rtnetlink link messages and kernel uevents
from .netlink import parse_links as parse_links
from .netlink import parse_uevent as parse_uevent

# scan: the sysfs scan of PCI functions, subfunctions and RDMA ports (discovery.py)
from .scan import read_rdma_ports as read_rdma_ports
from .scan import scan_sysfs as scan_sysfs

# wire: Device and ListAndWatchResponse bytes
from .wire import encode_device as encode_device
from .wire import encode_list as encode_list
