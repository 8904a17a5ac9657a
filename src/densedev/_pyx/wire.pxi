# Protobuf bytes of v1beta1.Device and ListAndWatchResponse, written straight into one allocation.
# Twin and spec: densedev/_fast_py/wire.py.  Proto3 rules reproduced so the bytes equal
# SerializeToString(): fields in number order, scalars equal to their default (b"", 0) omitted.
#
#   message Device { string ID = 1; string health = 2; TopologyInfo topology = 3; }
#   message TopologyInfo { repeated NUMANode nodes = 1; }
#   message NUMANode { int64 ID = 1; }
#   message ListAndWatchResponse { repeated Device devices = 1; }

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.string cimport memcpy

cdef enum WireTag:
    # (field_number << 3) | wire_type; wire type 2 = length-delimited, 0 = varint
    WIRE_TAG_ID = 0x0A        # Device.ID = 1
    WIRE_TAG_HEALTH = 0x12    # Device.health = 2
    WIRE_TAG_TOPOLOGY = 0x1A  # Device.topology = 3
    WIRE_TAG_NODES = 0x0A     # TopologyInfo.nodes = 1
    WIRE_TAG_NODE_ID = 0x08   # NUMANode.ID = 1
    WIRE_TAG_DEVICES = 0x0A   # ListAndWatchResponse.devices = 1


cdef inline Py_ssize_t varint_len(unsigned long long value) noexcept nogil:
    cdef Py_ssize_t n = 1
    while value > 0x7F:
        value >>= 7
        n += 1
    return n


cdef inline char* put_varint(char* out, unsigned long long value) noexcept nogil:
    while value > 0x7F:
        out[0] = <char>((value & 0x7F) | 0x80)
        out += 1
        value >>= 7
    out[0] = <char>value
    return out + 1


def encode_device(bytes device_id not None, bint healthy, long long numa):
    """Return the protobuf bytes of one ``Device``; ``numa < 0`` leaves out the topology."""
    cdef const char* health = b"Healthy" if healthy else b"Unhealthy"
    cdef Py_ssize_t health_len = 7 if healthy else 9
    cdef Py_ssize_t id_len = PyBytes_GET_SIZE(device_id)
    cdef Py_ssize_t node_len = 0, topology_len = 0, total = 0
    if id_len:
        total += 1 + varint_len(id_len) + id_len
    total += 1 + 1 + health_len
    if numa >= 0:
        if numa:
            node_len = 1 + varint_len(<unsigned long long>numa)
        topology_len = 1 + varint_len(node_len) + node_len
        total += 1 + varint_len(topology_len) + topology_len
    cdef bytes result = PyBytes_FromStringAndSize(NULL, total)
    cdef char* out = PyBytes_AS_STRING(result)
    if id_len:
        out[0] = WIRE_TAG_ID
        out = put_varint(out + 1, id_len)
        memcpy(out, PyBytes_AS_STRING(device_id), id_len)
        out += id_len
    out[0] = WIRE_TAG_HEALTH
    out[1] = <char>health_len
    memcpy(out + 2, health, health_len)
    out += 2 + health_len
    if numa >= 0:
        out[0] = WIRE_TAG_TOPOLOGY
        out = put_varint(out + 1, topology_len)
        out[0] = WIRE_TAG_NODES
        out = put_varint(out + 1, node_len)
        if numa:
            out[0] = WIRE_TAG_NODE_ID
            put_varint(out + 1, <unsigned long long>numa)
    return result


def encode_list(list parts not None):
    """Return the ``ListAndWatchResponse`` bytes whose ``devices`` are the given encoded ``Device`` parts."""
    cdef Py_ssize_t i, n = len(parts), total = 0, size
    cdef object part
    for i in range(n):
        part = parts[i]
        if type(part) is not bytes:
            raise TypeError(f"encode_list: part {i} is {type(part).__name__}, not bytes")
        size = PyBytes_GET_SIZE(part)
        total += 1 + varint_len(size) + size
    cdef bytes result = PyBytes_FromStringAndSize(NULL, total)
    cdef char* out = PyBytes_AS_STRING(result)
    for i in range(n):
        part = parts[i]
        size = PyBytes_GET_SIZE(part)
        out[0] = WIRE_TAG_DEVICES
        out = put_varint(out + 1, size)
        memcpy(out, PyBytes_AS_STRING(part), size)
        out += size
    return result
