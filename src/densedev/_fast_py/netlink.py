"""Decoders for rtnetlink link messages and kernel uevents; the readable twin of ``_pyx/netlink.pxi``.

Both are pure: bytes in, tuples out.  They never raise on hostile input: a link datagram is decoded up
to its first malformed message, and a uevent that is not in the kernel's format decodes to ``None``.
"""

from __future__ import annotations

import struct

# <linux/netlink.h>
#   struct nlmsghdr { __u32 nlmsg_len; __u16 nlmsg_type; __u16 nlmsg_flags;
#                     __u32 nlmsg_seq; __u32 nlmsg_pid; };
# <linux/rtnetlink.h>
#   struct ifinfomsg { unsigned char ifi_family; unsigned char __ifi_pad; unsigned short ifi_type;
#                      int ifi_index; unsigned ifi_flags; unsigned ifi_change; };
#   struct rtattr { unsigned short rta_len; unsigned short rta_type; };
# Netlink is in host byte order ("=": native order, standard sizes).
_NLMSGHDR = struct.Struct("=IHHII")
_IFINFOMSG = struct.Struct("=BBHiII")
_RTATTR = struct.Struct("=HH")
_U32 = struct.Struct("=I")

RTM_NEWLINK = 16
RTM_DELLINK = 17
IFLA_IFNAME = 3
IFLA_LINK = 5
IFLA_OPERSTATE = 16
IFLA_CARRIER = 33


def _align4(n: int) -> int:
    # NLMSG_ALIGN / RTA_ALIGN: messages and attributes start on 4-byte boundaries.
    return (n + 3) & ~3


LinkTuple = tuple[int, int, str, int, int, int, int]


def _decode_link(buf: bytes, start: int, end: int, msg_type: int) -> LinkTuple | None:
    # One RTM_NEWLINK/RTM_DELLINK body between start and end; None when malformed.
    if end - start < _IFINFOMSG.size:
        return None
    _family, _pad, _ifi_type, index, flags, _change = _IFINFOMSG.unpack_from(buf, start)
    name: str | None = None
    operstate = carrier = parent = -1
    pos = start + _align4(_IFINFOMSG.size)
    while pos + _RTATTR.size <= end:
        rta_len, rta_type = _RTATTR.unpack_from(buf, pos)
        if rta_len < _RTATTR.size or pos + rta_len > end:
            return None
        payload = pos + _RTATTR.size
        size = rta_len - _RTATTR.size
        # The kernel emits each attribute once; if a forged message repeats one, the first wins
        # (as pyroute2's get_attr does).
        if rta_type == IFLA_IFNAME:
            if name is None:
                raw = buf[payload : payload + size]
                nul = raw.find(b"\0")
                name = (raw if nul < 0 else raw[:nul]).decode("utf-8", "surrogateescape")
        elif rta_type == IFLA_OPERSTATE:
            if size < 1:
                return None
            if operstate == -1:
                operstate = buf[payload]
        elif rta_type == IFLA_CARRIER:
            if size < 1:
                return None
            if carrier == -1:
                carrier = buf[payload]
        elif rta_type == IFLA_LINK:
            if size < 4:
                return None
            if parent == -1:
                parent = _U32.unpack_from(buf, payload)[0]
        pos += _align4(rta_len)
    return (msg_type, index, name if name is not None else "", flags, operstate, carrier, parent)


def parse_links(buf: bytes) -> tuple[LinkTuple, ...]:
    """Decode every RTM_NEWLINK/RTM_DELLINK in a netlink datagram into
    ``(msg_type, ifindex, ifname, ifi_flags, operstate, carrier, parent_ifindex)``; -1 where absent.
    """
    out = []
    pos = 0
    n = len(buf)
    while pos + _NLMSGHDR.size <= n:
        length, msg_type, _flags, _seq, _pid = _NLMSGHDR.unpack_from(buf, pos)
        if length < _NLMSGHDR.size or pos + length > n:
            break  # malformed or truncated: keep what decoded before it
        if msg_type in (RTM_NEWLINK, RTM_DELLINK):
            link = _decode_link(buf, pos + _NLMSGHDR.size, pos + length, msg_type)
            if link is None:
                break
            out.append(link)
        # NLMSG_DONE, NLMSG_ERROR, NLMSG_NOOP and other families' messages are skipped.
        pos += _align4(length)
    return tuple(out)


def parse_uevent(buf: bytes) -> tuple[str, str, tuple[tuple[str, str], ...]] | None:
    """Decode a kernel uevent ``ACTION@DEVPATH\\0KEY=VALUE\\0...`` into ``(action, devpath, pairs)``;
    ``None`` for udev's ``libudev`` monitor format or anything else not in the kernel's format.
    """
    # udev re-broadcasts on group 2 with a binary header starting "libudev\0"; we only want the
    # kernel's own records (group 1), and that header contains no "@" before its first NUL anyway.
    if buf.startswith(b"libudev\0"):
        return None
    fields = buf.split(b"\0")
    action, at, devpath = fields[0].partition(b"@")
    if not at or not action or not devpath:
        return None
    pairs = []
    for field in fields[1:]:
        key, eq, value = field.partition(b"=")
        if eq and key:
            pairs.append((key.decode("utf-8", "surrogateescape"), value.decode("utf-8", "surrogateescape")))
    return (
        action.decode("utf-8", "surrogateescape"),
        devpath.decode("utf-8", "surrogateescape"),
        tuple(pairs),
    )
