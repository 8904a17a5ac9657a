# rtnetlink link messages and kernel uevents; twin and spec: densedev/_fast_py/netlink.py.
# Pure decoders: bytes in, tuples out; never read past the buffer, never raise on hostile input.
# The kernel structs (nlmsghdr, ifinfomsg, rtattr) and constants are declared in _fast.pxd.

from libc.stdint cimport uint8_t, uint16_t, uint32_t, int32_t
from libc.string cimport memcpy, memchr
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE


cdef inline Py_ssize_t align4(Py_ssize_t n) noexcept nogil:
    # NLMSG_ALIGN / RTA_ALIGN: messages and attributes start on 4-byte boundaries.
    return (n + 3) & ~3


cdef object decode_link(const uint8_t* buf, Py_ssize_t start, Py_ssize_t end, int msg_type):
    # One RTM_NEWLINK/RTM_DELLINK body between start and end; None when malformed.
    cdef ifinfomsg ifi
    cdef rtattr rta
    cdef uint32_t u32
    cdef Py_ssize_t pos, payload, size, namelen
    cdef const uint8_t* nul
    cdef long long operstate = -1, carrier = -1, parent = -1
    cdef object name = None
    if end - start < <Py_ssize_t>sizeof(ifinfomsg):
        return None
    memcpy(&ifi, buf + start, sizeof(ifinfomsg))
    pos = start + align4(sizeof(ifinfomsg))
    while pos + <Py_ssize_t>sizeof(rtattr) <= end:
        memcpy(&rta, buf + pos, sizeof(rtattr))
        if rta.rta_len < sizeof(rtattr) or pos + rta.rta_len > end:
            return None
        payload = pos + sizeof(rtattr)
        size = rta.rta_len - sizeof(rtattr)
        # The kernel emits each attribute once; a forged repeat keeps the first (as pyroute2 does).
        if rta.rta_type == IFLA_IFNAME:
            if name is None:
                nul = <const uint8_t*>memchr(buf + payload, 0, size)
                namelen = size if nul == NULL else nul - (buf + payload)
                name = (<const char*>buf)[payload:payload + namelen].decode("utf-8", "surrogateescape")
        elif rta.rta_type == IFLA_OPERSTATE:
            if size < 1:
                return None
            if operstate == -1:
                operstate = buf[payload]
        elif rta.rta_type == IFLA_CARRIER:
            if size < 1:
                return None
            if carrier == -1:
                carrier = buf[payload]
        elif rta.rta_type == IFLA_LINK:
            if size < 4:
                return None
            if parent == -1:
                memcpy(&u32, buf + payload, 4)
                parent = u32
        pos += align4(rta.rta_len)
    return (msg_type, ifi.ifi_index, name if name is not None else "", ifi.ifi_flags,
            operstate, carrier, parent)


def parse_links(bytes buf):
    """Decode every RTM_NEWLINK/RTM_DELLINK in a netlink datagram into
    ``(msg_type, ifindex, ifname, ifi_flags, operstate, carrier, parent_ifindex)``; -1 where absent.
    """
    cdef const uint8_t* p = <const uint8_t*>PyBytes_AS_STRING(buf)
    cdef Py_ssize_t n = PyBytes_GET_SIZE(buf)
    cdef Py_ssize_t pos = 0
    cdef nlmsghdr hdr
    cdef list out = []
    while pos + <Py_ssize_t>sizeof(nlmsghdr) <= n:
        memcpy(&hdr, p + pos, sizeof(nlmsghdr))
        if hdr.nlmsg_len < sizeof(nlmsghdr) or <Py_ssize_t>hdr.nlmsg_len > n - pos:
            break  # malformed or truncated: keep what decoded before it
        if hdr.nlmsg_type == RTM_NEWLINK or hdr.nlmsg_type == RTM_DELLINK:
            link = decode_link(p, pos + sizeof(nlmsghdr), pos + hdr.nlmsg_len, hdr.nlmsg_type)
            if link is None:
                break
            out.append(link)
        # NLMSG_DONE, NLMSG_ERROR, NLMSG_NOOP and other families' messages are skipped.
        pos += align4(hdr.nlmsg_len)
    return tuple(out)


def parse_uevent(bytes buf):
    """Decode a kernel uevent ``ACTION@DEVPATH\\0KEY=VALUE\\0...`` into ``(action, devpath, pairs)``;
    ``None`` for udev's ``libudev`` monitor format or anything else not in the kernel's format.
    """
    cdef const char* p = PyBytes_AS_STRING(buf)
    cdef Py_ssize_t n = PyBytes_GET_SIZE(buf)
    cdef Py_ssize_t start = 0, end, at, eq, k
    # udev's re-broadcast (group 2) starts with a binary "libudev\0" header: not ours.
    if n >= 8 and has_prefix(p, b"libudev\0", 8):
        return None
    end = 0
    while end < n and p[end] != 0:
        end += 1
    at = -1
    for k in range(end):
        if p[k] == 64:  # '@'
            at = k
            break
    if at <= 0 or at + 1 >= end:
        return None
    action = p[0:at].decode("utf-8", "surrogateescape")
    devpath = p[at + 1:end].decode("utf-8", "surrogateescape")
    cdef list pairs = []
    start = end + 1
    while start <= n:
        end = start
        while end < n and p[end] != 0:
            end += 1
        eq = -1
        for k in range(start, end):
            if p[k] == 61:  # '='
                eq = k
                break
        if eq > start:
            pairs.append((p[start:eq].decode("utf-8", "surrogateescape"),
                          p[eq + 1:end].decode("utf-8", "surrogateescape")))
        start = end + 1
    return (action, devpath, tuple(pairs))


cdef inline bint has_prefix(const char* p, const char* prefix, Py_ssize_t n) noexcept:
    cdef Py_ssize_t k
    for k in range(n):
        if p[k] != prefix[k]:
            return False
    return True
