"""Bitmaps over device-table indexes: bit ``i`` is bit ``i % 8`` of byte ``i // 8`` (little-endian).

The readable twin of ``_pyx/bitmap.pxi``.  A bitmap is plain ``bytes``; a *mask* selects the bits an
operation looks at (a pool's members).  All bitmaps given to one call must have the same length.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def _check_lengths(**bitmaps: bytes) -> int:
    sizes = {len(b) for b in bitmaps.values()}
    if len(sizes) > 1:
        shown = ", ".join(f"{name} {len(b)} bytes" for name, b in bitmaps.items())
        raise ValueError(f"bitmaps differ in length: {shown}")
    return sizes.pop() if sizes else 0


def _indexes(x: int) -> tuple[int, ...]:
    # Lowest set bit first, so indexes come out ascending; cost is per set bit, not per word.
    out = []
    while x:
        low = x & -x
        out.append(low.bit_length() - 1)
        x ^= low
    return tuple(out)


def diff_bitmaps(old: bytes, new: bytes, mask: bytes) -> tuple[int, ...]:
    """Return the ascending indexes of bits that differ between ``old`` and ``new`` within ``mask``."""
    _check_lengths(old=old, new=new, mask=mask)
    x = (int.from_bytes(old, "little") ^ int.from_bytes(new, "little")) & int.from_bytes(mask, "little")
    return _indexes(x)


def select_bits(bitmap: bytes, mask: bytes) -> tuple[int, ...]:
    """Return the ascending indexes of bits set in ``bitmap`` within ``mask``."""
    _check_lengths(bitmap=bitmap, mask=mask)
    return _indexes(int.from_bytes(bitmap, "little") & int.from_bytes(mask, "little"))


def or_bitmaps(bitmaps: Sequence[bytes], mask: bytes) -> bytes:
    """Return the OR of ``bitmaps`` restricted to ``mask`` (bits outside the mask are clear)."""
    _check_lengths(mask=mask, **{f"bitmaps[{i}]": b for i, b in enumerate(bitmaps)})
    acc = 0
    for b in bitmaps:
        acc |= int.from_bytes(b, "little")
    return (acc & int.from_bytes(mask, "little")).to_bytes(len(mask), "little")


def set_bits(bitmap: bytes, indexes: Iterable[int], value: bool) -> bytes:
    """Return a copy of ``bitmap`` with the bits at ``indexes`` set (``value`` true) or cleared."""
    out = bytearray(bitmap)
    size = len(out) * 8
    for i in indexes:
        if not 0 <= i < size:
            raise IndexError(f"bit index {i} outside a bitmap of {size} bits")
        if value:
            out[i >> 3] |= 1 << (i & 7)
        else:
            out[i >> 3] &= ~(1 << (i & 7)) & 0xFF
    return bytes(out)
