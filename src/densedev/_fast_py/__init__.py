"""Plain-Python twin of ``densedev._fast``: same functions, same signatures, same results."""

from __future__ import annotations

# wire: Device and ListAndWatchResponse bytes
from .wire import encode_device as encode_device
from .wire import encode_list as encode_list

# alloc: preferred-allocation ranking (allocation.py)
from .alloc import pick_devices as pick_devices
