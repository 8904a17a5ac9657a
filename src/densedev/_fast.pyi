"""Signatures of densedev._fast (the Cython core): the twin's (densedev._fast_py), which a test checks."""

from collections.abc import Iterable, Mapping, Sequence

from densedev.model import Device

# alloc: preferred-allocation ranking (topology = int32 triples (numa, root, pf) per member index)
def pick_devices(
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
    index: Mapping[str, int],
    topology: bytes,
    policy: int,
    lookup: bytes = b"",
) -> tuple[str, ...]: ...

# bitmap: health bitmaps over device-table indexes (bit i = bit i%8 of byte i//8)
def diff_bitmaps(old: bytes, new: bytes, mask: bytes) -> tuple[int, ...]: ...
def or_bitmaps(bitmaps: Sequence[bytes], mask: bytes) -> bytes: ...
def select_bits(bitmap: bytes, mask: bytes) -> tuple[int, ...]: ...
def set_bits(bitmap: bytes, indexes: Iterable[int], value: bool) -> bytes: ...

# netlink: rtnetlink link messages and kernel uevents
LinkTuple = tuple[int, int, str, int, int, int, int]

def parse_links(buf: bytes) -> tuple[LinkTuple, ...]: ...
def parse_uevent(buf: bytes) -> tuple[str, str, tuple[tuple[str, str], ...]] | None: ...

# scan: the sysfs scan into Devices sorted by id, and warnings
def read_rdma_ports(root: bytes, ibdevs: tuple[bytes, ...]) -> tuple[tuple[str, int, int, int], ...]: ...
def scan_sysfs(
    root: bytes, addresses: tuple[bytes, ...] | None = None, threads: bool = True, gate: int = -1
) -> tuple[tuple[Device, ...], tuple[str, ...]]: ...

# wire: Device and ListAndWatchResponse bytes
def encode_device(device_id: bytes, healthy: bool, numa: int) -> bytes: ...
def encode_list(parts: list[bytes]) -> bytes: ...
