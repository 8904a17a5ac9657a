"""Protobuf wire-format primitives for the messages densedev encodes or decodes by hand.

A few messages are written and read without the generated classes, so that the protobuf runtime is not
loaded on the path to the first list (issue 14): the registration request, the device-plugin options,
ListAndWatch replies (the twin of ``_pyx/wire.pxi``), the DRA health stream, the PodResources List reply.
The encoding is the one the protobuf documentation's "Encoding" page specifies: base-128 varints, tags
``(field_number << 3) | wire_type``, length-delimited fields as tag, length, bytes.
"""

from __future__ import annotations

from collections.abc import Iterator


def varint(value: int) -> bytes:
    """Return the base-128 varint encoding of a non-negative integer."""
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def varint_len(value: int) -> int:
    """Return how many bytes the varint encoding of a non-negative integer takes."""
    return max(1, (value.bit_length() + 6) // 7)


def length_delimited(number: int, value: bytes) -> bytes:
    """Return one field of wire type 2 (string, bytes, message): tag, length, bytes."""
    size = len(value)
    if number < 16 and size < 0x80:
        # Tag and length one byte each: most fields written here (a 65,536-device health list frames
        # 131,072 of them at a DRA start, ~0.1 s of it in the two varint calls).
        return bytes((number << 3 | 2, size)) + value
    return varint(number << 3 | 2) + varint(size) + value


def read_varint(data: bytes, pos: int) -> tuple[int, int]:
    """Return the base-128 varint at ``pos`` and the position after it; ValueError if cut short."""
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise ValueError("truncated or overlong varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def fields(data: bytes) -> Iterator[tuple[int, bytes | None]]:
    """Yield each field of one protobuf message: its number, and its bytes if length-delimited.

    Scalars (wire types 0, 1, 5) are skipped over with their value None; groups, long deprecated and
    absent from these messages, and anything cut short raise ValueError.
    """
    pos, end = 0, len(data)
    while pos < end:
        key, pos = read_varint(data, pos)
        number, kind = key >> 3, key & 7
        value = None
        if not 0 < number < 1 << 29:  # a tag is a uint32 and a field number 1 .. 2^29 - 1
            raise ValueError(f"field number {number}")
        if kind == 0:
            _, pos = read_varint(data, pos)
        elif kind == 1:
            pos += 8
        elif kind == 2:
            size, pos = read_varint(data, pos)
            value = data[pos : pos + size]
            pos += size
        elif kind == 5:
            pos += 4
        else:
            raise ValueError(f"wire type {kind}")
        if pos > end:
            raise ValueError("field runs past the end of its message")
        yield number, value
