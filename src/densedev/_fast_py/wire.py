"""Plain-Python twin of ``_pyx/wire.pxi``: protobuf bytes of ``v1beta1.Device`` and ``ListAndWatchResponse``.

Proto3 rules reproduced exactly so the bytes equal ``SerializeToString()``: fields are written in field
number order, and a scalar equal to its default (empty string, 0) is omitted.  So ``NUMANode{ID: 0}``
is the empty message and ``Device{ID: ""}`` has no field 1.
"""

from __future__ import annotations

from ..protowire import varint

_HEALTHY = b"Healthy"
_UNHEALTHY = b"Unhealthy"

# Tags: (field_number << 3) | wire_type; wire type 2 = length-delimited, 0 = varint.
_TAG_ID = b"\x0a"  # Device.ID = 1 (string)
_TAG_HEALTH = b"\x12"  # Device.health = 2 (string)
_TAG_TOPOLOGY = b"\x1a"  # Device.topology = 3 (TopologyInfo)
_TAG_NODES = b"\x0a"  # TopologyInfo.nodes = 1 (repeated NUMANode)
_TAG_NODE_ID = b"\x08"  # NUMANode.ID = 1 (int64, varint)
_TAG_DEVICES = b"\x0a"  # ListAndWatchResponse.devices = 1 (repeated Device)


# Most parts are shorter than 128 bytes: their whole "tag + length" prefix comes from a table.
_DEVICE_PREFIX = [_TAG_DEVICES + bytes((n,)) for n in range(128)]


def encode_device(device_id: bytes, healthy: bool, numa: int) -> bytes:
    """Return the protobuf bytes of one ``Device``; ``numa < 0`` leaves out the topology."""
    if type(device_id) is not bytes:
        raise TypeError(f"encode_device: device_id is {type(device_id).__name__}, not bytes")
    out = bytearray()
    if device_id:
        out += _TAG_ID + varint(len(device_id)) + device_id
    health = _HEALTHY if healthy else _UNHEALTHY
    out += _TAG_HEALTH + varint(len(health)) + health
    if numa >= 0:
        node = _TAG_NODE_ID + varint(numa) if numa else b""
        topology = _TAG_NODES + varint(len(node)) + node
        out += _TAG_TOPOLOGY + varint(len(topology)) + topology
    return bytes(out)


def encode_list(parts: list[bytes]) -> bytes:
    """Return the ``ListAndWatchResponse`` bytes whose ``devices`` are the given encoded ``Device`` parts."""
    if type(parts) is not list:
        raise TypeError(f"encode_list: parts is {type(parts).__name__}, not list")
    pieces = []
    prefix = _DEVICE_PREFIX
    for index, part in enumerate(parts):
        if type(part) is not bytes:
            raise TypeError(f"encode_list: part {index} is {type(part).__name__}, not bytes")
        size = len(part)
        pieces.append(prefix[size] if size < 128 else _TAG_DEVICES + varint(size))
        pieces.append(part)
    return b"".join(pieces)
