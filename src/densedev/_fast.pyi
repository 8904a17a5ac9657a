"""Signatures of densedev._fast (the Cython core); each section is added by the module that owns it."""

from collections.abc import Iterable, Mapping, Sequence

# wire: Device and ListAndWatchResponse bytes
def encode_device(device_id: bytes, healthy: bool, numa: int) -> bytes: ...
def encode_list(parts: list[bytes]) -> bytes: ...

# alloc: preferred-allocation ranking (topology = int32 triples (numa, root, pf) per member index)
def pick_devices(
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
    index: Mapping[str, int],
    topology: bytes,
    policy: int,
) -> tuple[str, ...]: ...
