"""VF settings through the PF's rtnetlink: encoders, the reply decoders, and a small blocking client.

A VF's MAC, VLAN/QoS, rates, spoof checking, link state and trust are set on its *PF*: ``RTM_SETLINK`` on
the PF's ifindex carrying ``IFLA_VFINFO_LIST`` → ``IFLA_VF_INFO`` → ``IFLA_VF_*`` structs, each led by the
VF's index (include/uapi/linux/if_link.h; the kernel applies them in ``do_setvfinfo()``).  They are read
back with ``RTM_GETLINK`` and ``IFLA_EXT_MASK`` = ``RTEXT_FILTER_VF``.  The VF's MTU is its own netdev's
``IFLA_MTU``.

This is not a hot path (one message per Prepare or Unprepare), so it is plain Python and not in
``_fast.pyx``.  The encoders are pure: values in, bytes out, checked byte for byte against pyroute2's
encoder in the tests.  The client blocks: callers on the event loop run it through
``densedev.workers.run(Work.NETLINK, ...)``.

The kernel applies one message's VF attributes one after the other and stops at the first refusal, so a
message with several settings can be left half-applied on real hardware: whoever sets a VF reads its
values first (:meth:`VfNetlink.read_vfs`) and, on any failure, sets those values back
(:meth:`VfState.settings`).
"""

from __future__ import annotations

import contextlib
import enum
import errno
import os
import re
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import NamedTuple

from ..printable import clip
from .events import DEFAULT_NETNS_DIR, NETLINK_ROUTE, open_netlink_socket, resolve_netns

__all__ = [
    "LinkState",
    "VfNetlink",
    "VfNetlinkError",
    "VfSettings",
    "VfState",
    "decode_ack",
    "decode_mtu",
    "decode_vfs",
    "encode_getlink",
    "encode_set_mtu",
    "encode_set_vf",
]

# <linux/netlink.h>: struct nlmsghdr { __u32 len; __u16 type; __u16 flags; __u32 seq; __u32 pid; };
#   struct nlmsgerr { int error; struct nlmsghdr msg; /* payload unless NETLINK_CAP_ACK, then TLVs */ };
# <linux/rtnetlink.h>: struct ifinfomsg { u8 family; u8 pad; u16 type; int index; u32 flags, change; };
#   struct rtattr { u16 rta_len; u16 rta_type; };
# Netlink and these structs are host-endian ("=": native order, standard sizes).
_NLMSGHDR = struct.Struct("=IHHII")
_IFINFOMSG = struct.Struct("=BxHiII")
_RTATTR = struct.Struct("=HH")
_U32 = struct.Struct("=I")
_I32 = struct.Struct("=i")
# <linux/if_link.h>: struct ifla_vf_mac { __u32 vf; __u8 mac[32]; };  ifla_vf_vlan { vf, vlan, qos };
#   ifla_vf_rate { vf, min_tx_rate, max_tx_rate };  ifla_vf_{spoofchk,link_state,trust} { vf, setting };
_VF_MAC = struct.Struct("=I32s")
_VF_VLAN = struct.Struct("=III")
_VF_RATE = struct.Struct("=III")
_VF_SETTING = struct.Struct("=II")
#   struct ifla_vf_vlan_info { __u32 vf, vlan, qos; __be16 vlan_proto; };  (in IFLA_VF_VLAN_LIST)
_VF_VLAN_INFO = struct.Struct("=III")
_BE16 = struct.Struct(">H")

RTM_NEWLINK = 16
RTM_GETLINK = 18
RTM_SETLINK = 19
NLMSG_ERROR = 2
NLMSG_DONE = 3
NLM_F_REQUEST = 0x1
NLM_F_ACK = 0x4
NLM_F_CAPPED = 0x100  # the error echoes only the request's header (NETLINK_CAP_ACK)
NLM_F_ACK_TLVS = 0x200  # extended-ack attributes follow
NLMSGERR_ATTR_MSG = 1  # the kernel's extack message, a NUL-terminated string
NETLINK_CAP_ACK = 10  # <linux/netlink.h> socket options (SOL_NETLINK)
NETLINK_EXT_ACK = 11
SOL_NETLINK = 270
NLA_TYPE_MASK = 0x3FFF  # without NLA_F_NESTED / NLA_F_NET_BYTEORDER

IFLA_MTU = 4
IFLA_NUM_VF = 21
IFLA_VFINFO_LIST = 22
IFLA_EXT_MASK = 29
IFLA_VF_INFO = 1
IFLA_VF_MAC = 1
IFLA_VF_VLAN = 2
IFLA_VF_SPOOFCHK = 4
IFLA_VF_LINK_STATE = 5
IFLA_VF_RATE = 6
IFLA_VF_TRUST = 9
IFLA_VF_VLAN_LIST = 12
IFLA_VF_VLAN_INFO = 1
ETH_P_8021Q = 0x8100  # the VLAN protocol IFLA_VF_VLAN sets (ndo_set_vf_vlan(..., htons(ETH_P_8021Q)))
RTEXT_FILTER_VF = 1

_U32_MAX = 0xFFFFFFFF
# do_setvfinfo() refuses ``vf >= INT_MAX`` with EINVAL for every IFLA_VF_* attribute.
_VF_MAX = 0x7FFFFFFE
_VLAN_MAX = 4095  # 12-bit VID; the drivers' ndo_set_vf_vlan refuse more
_QOS_MAX = 7  # 3-bit PCP
_MAC_RE = re.compile(r"^[0-9a-fA-F]{2}(:[0-9a-fA-F]{2}){5}$")
_REASON_LIMIT = 120  # characters of the kernel's extack message in a reason

DEFAULT_TIMEOUT_S = 2.0  # a SETLINK answers in microseconds; a driver talking to firmware, milliseconds
DEFAULT_MAX_REPLY = 1 << 20  # a PF with 256 VFs and their stats answers in under 100 KiB


class LinkState(enum.IntEnum):
    """A VF's administrative link state (IFLA_VF_LINK_STATE_*)."""

    AUTO = 0  # follows the PF's link
    ENABLE = 1
    DISABLE = 2


class VfNetlinkError(Exception):
    """An rtnetlink request the kernel refused, did not answer in time, or answered with garbage."""

    def __init__(self, err: int, reason: str) -> None:
        super().__init__(reason)
        self.errno = err  # positive errno; EBADMSG for a reply we could not decode
        self.reason = reason  # one line, bounded


class VfSettings(NamedTuple):
    """What to set on one VF through its PF; a field left None is not sent and stays as it is.

    ``vlan`` and ``qos`` travel in one struct (IFLA_VF_VLAN): ``qos`` needs ``vlan`` and defaults to 0
    with it.  ``min_tx_rate`` and ``max_tx_rate`` (Mbit/s, 0: no limit) travel in one struct
    (IFLA_VF_RATE) that sets both, so both must be given together.
    """

    mac: str | None = None
    vlan: int | None = None
    qos: int | None = None
    min_tx_rate: int | None = None
    max_tx_rate: int | None = None
    spoofchk: bool | None = None
    link_state: LinkState | None = None
    trust: bool | None = None


class VfState(NamedTuple):
    """One VF's current values as its PF reports them (one IFLA_VF_INFO of a GETLINK reply)."""

    vf: int
    mac: str  # the first six bytes of the kernel's 32-byte field, ``aa:bb:cc:dd:ee:ff``
    vlan: int
    qos: int
    min_tx_rate: int
    max_tx_rate: int
    spoofchk: bool | None  # None: the driver does not report it (the kernel sends -1)
    link_state: int  # a LinkState value
    trust: bool | None  # None: the driver does not report it (the kernel sends -1)
    vlan_proto: int = ETH_P_8021Q  # from IFLA_VF_VLAN_LIST; 0x88a8 is an 802.1ad (QinQ) VLAN

    def settings(self) -> VfSettings:
        """Return the settings that put these exact values back (for a restore at Unprepare).

        Raises ValueError for a VF on an 802.1ad VLAN: IFLA_VF_VLAN would put it back as 802.1Q, so a
        caller that reads first refuses to configure such a VF before anything is changed.  A tri-state
        the driver does not report (None) is left out, as it cannot have been changed through it.
        """
        if self.vlan and self.vlan_proto != ETH_P_8021Q:
            raise ValueError(
                f"VF {self.vf} has VLAN {self.vlan} with protocol 0x{self.vlan_proto:04x}, which"
                " IFLA_VF_VLAN (802.1Q only) could not restore"
            )
        return VfSettings(
            mac=self.mac,
            vlan=self.vlan,
            qos=self.qos,
            min_tx_rate=self.min_tx_rate,
            max_tx_rate=self.max_tx_rate,
            spoofchk=self.spoofchk,
            # A state outside the enum (none is defined) is left alone rather than guessed.
            link_state=LinkState(self.link_state) if 0 <= self.link_state <= LinkState.DISABLE else None,
            trust=self.trust,
        )


# ------------------------------------------------------------------------------------------- encoders
def _attr(rta_type: int, payload: bytes) -> bytes:
    # RTA_LENGTH excludes the padding; RTA_ALIGN pads the attribute to 4 bytes.
    length = _RTATTR.size + len(payload)
    return _RTATTR.pack(length, rta_type) + payload + b"\0" * (-length & 3)


def _message(msg_type: int, seq: int, body: bytes) -> bytes:
    if not 0 <= seq <= _U32_MAX:
        raise ValueError(f"sequence number {seq} is not a u32")
    return _NLMSGHDR.pack(_NLMSGHDR.size + len(body), msg_type, NLM_F_REQUEST | NLM_F_ACK, seq, 0) + body


def _ifinfo(ifindex: int) -> bytes:
    if not 0 < ifindex <= 0x7FFFFFFF:
        raise ValueError(f"ifindex {ifindex} is not a positive int")
    # AF_UNSPEC, no flag change (ifi_flags = ifi_change = 0: do_setlink leaves IFF_UP alone).
    return _IFINFOMSG.pack(socket.AF_UNSPEC, 0, ifindex, 0, 0)


def _u32(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _U32_MAX:
        raise ValueError(f"{name} {value!r} is not an integer from 0 to {_U32_MAX}")
    return value


def _in_range(name: str, value: int, top: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= top:
        raise ValueError(f"{name} {value!r} is not an integer from 0 to {top}")
    return value


def _mac_bytes(mac: str) -> bytes:
    if not isinstance(mac, str) or not _MAC_RE.match(mac):
        raise ValueError(f"mac {clip(repr(mac), 40)} is not six hex bytes like 02:00:00:00:00:01")
    return bytes.fromhex(mac.replace(":", ""))


def _vf_attrs(vf: int, settings: VfSettings) -> bytes:
    # Order as do_setvfinfo() applies them: MAC, VLAN, RATE, SPOOFCHK, LINK_STATE, TRUST.
    out = []
    if settings.mac is not None:
        out.append(_attr(IFLA_VF_MAC, _VF_MAC.pack(vf, _mac_bytes(settings.mac))))
    if settings.vlan is not None:
        vlan = _in_range("vlan", settings.vlan, _VLAN_MAX)
        qos = 0 if settings.qos is None else _in_range("qos", settings.qos, _QOS_MAX)
        out.append(_attr(IFLA_VF_VLAN, _VF_VLAN.pack(vf, vlan, qos)))
    elif settings.qos is not None:
        raise ValueError("qos needs vlan: both travel in IFLA_VF_VLAN")
    if (settings.min_tx_rate is None) != (settings.max_tx_rate is None):
        raise ValueError("min_tx_rate and max_tx_rate go together: IFLA_VF_RATE sets both")
    if settings.min_tx_rate is not None and settings.max_tx_rate is not None:
        low = _u32("min_tx_rate", settings.min_tx_rate)
        high = _u32("max_tx_rate", settings.max_tx_rate)
        out.append(_attr(IFLA_VF_RATE, _VF_RATE.pack(vf, low, high)))
    if settings.spoofchk is not None:
        out.append(_attr(IFLA_VF_SPOOFCHK, _VF_SETTING.pack(vf, bool(settings.spoofchk))))
    if settings.link_state is not None:
        out.append(_attr(IFLA_VF_LINK_STATE, _VF_SETTING.pack(vf, LinkState(settings.link_state))))
    if settings.trust is not None:
        out.append(_attr(IFLA_VF_TRUST, _VF_SETTING.pack(vf, bool(settings.trust))))
    return b"".join(out)


def encode_set_vf(pf_ifindex: int, vf: int, settings: VfSettings, seq: int) -> bytes:
    """Return the RTM_SETLINK request that applies ``settings`` to VF ``vf`` of the PF ``pf_ifindex``.

    Raises ValueError for a value the kernel's structs cannot carry or the drivers refuse (VLAN > 4095,
    QoS > 7, a malformed MAC, a VF index ≥ INT_MAX) and for a request that would set nothing.
    """
    _in_range("vf", vf, _VF_MAX)
    attrs = _vf_attrs(vf, settings)
    if not attrs:
        raise ValueError("no VF setting given")
    # The nests carry no NLA_F_NESTED flag, as iproute2 and pyroute2 send them: the kernel's
    # nla_parse_nested_deprecated() takes either.
    body = _ifinfo(pf_ifindex) + _attr(IFLA_VFINFO_LIST, _attr(IFLA_VF_INFO, attrs))
    return _message(RTM_SETLINK, seq, body)


def encode_set_mtu(ifindex: int, mtu: int, seq: int) -> bytes:
    """Return the RTM_SETLINK request that sets the MTU of the netdev ``ifindex``."""
    return _message(RTM_SETLINK, seq, _ifinfo(ifindex) + _attr(IFLA_MTU, _U32.pack(_u32("mtu", mtu))))


def encode_getlink(ifindex: int, seq: int, ext_mask: int = RTEXT_FILTER_VF) -> bytes:
    """Return the RTM_GETLINK request for one link; ``RTEXT_FILTER_VF`` asks for its VFs' values."""
    body = _ifinfo(ifindex)
    if ext_mask:
        body += _attr(IFLA_EXT_MASK, _U32.pack(_u32("ext_mask", ext_mask)))
    return _message(RTM_GETLINK, seq, body)


# ------------------------------------------------------------------------------------------- decoders
def _malformed(what: str) -> VfNetlinkError:
    return VfNetlinkError(errno.EBADMSG, f"malformed rtnetlink reply: {what}")


def _attrs(buf: bytes, start: int, end: int) -> list[tuple[int, int, int]]:
    # (type without flags, payload start, payload end) for each attribute between start and end.
    out = []
    pos = start
    while pos + _RTATTR.size <= end:
        length, rta_type = _RTATTR.unpack_from(buf, pos)
        if length < _RTATTR.size or pos + length > end:
            raise _malformed(f"attribute {rta_type & NLA_TYPE_MASK} claims {length} bytes")
        out.append((rta_type & NLA_TYPE_MASK, pos + _RTATTR.size, pos + length))
        pos += (length + 3) & ~3
    return out


def _first(attrs: list[tuple[int, int, int]], wanted: int) -> tuple[int, int] | None:
    # The kernel emits each attribute once; a forged repeat loses to the first (as pyroute2's get_attr).
    for rta_type, start, end in attrs:
        if rta_type == wanted:
            return start, end
    return None


def _link_attrs(msg: bytes) -> list[tuple[int, int, int]]:
    # The attributes of one RTM_NEWLINK message (header included in ``msg``).
    if len(msg) < _NLMSGHDR.size + _IFINFOMSG.size:
        raise _malformed(f"link message of {len(msg)} bytes")
    length, msg_type, _f, _s, _p = _NLMSGHDR.unpack_from(msg)
    if msg_type != RTM_NEWLINK or length > len(msg):
        raise _malformed(f"message type {msg_type} of {length} bytes where a link was expected")
    return _attrs(msg, _NLMSGHDR.size + _IFINFOMSG.size, length)


def _setting(buf: bytes, span: tuple[int, int] | None, name: str) -> int | None:
    if span is None:
        return None
    if span[1] - span[0] < _VF_SETTING.size:
        raise _malformed(f"IFLA_VF_{name} of {span[1] - span[0]} bytes")
    return int(_VF_SETTING.unpack_from(buf, span[0])[1])


def _tristate(value: int | None) -> bool | None:
    # rtnl_fill_vfinfo() presets spoofchk and trusted to -1 before ndo_get_vf_config(): "not reported".
    return None if value is None or value == _U32_MAX else bool(value)


def _vf_state(buf: bytes, start: int, end: int) -> VfState:
    attrs = _attrs(buf, start, end)
    mac = _first(attrs, IFLA_VF_MAC)
    if mac is None or mac[1] - mac[0] < _VF_MAC.size:
        raise _malformed("IFLA_VF_INFO without a whole IFLA_VF_MAC")
    vf, raw = _VF_MAC.unpack_from(buf, mac[0])
    vlan = qos = low = high = 0
    span = _first(attrs, IFLA_VF_VLAN)
    if span is not None:
        if span[1] - span[0] < _VF_VLAN.size:
            raise _malformed("short IFLA_VF_VLAN")
        _vf, vlan, qos = _VF_VLAN.unpack_from(buf, span[0])
    span = _first(attrs, IFLA_VF_RATE)
    if span is not None:
        if span[1] - span[0] < _VF_RATE.size:
            raise _malformed("short IFLA_VF_RATE")
        _vf, low, high = _VF_RATE.unpack_from(buf, span[0])
    link_state = _setting(buf, _first(attrs, IFLA_VF_LINK_STATE), "LINK_STATE")
    proto = ETH_P_8021Q
    span = _first(attrs, IFLA_VF_VLAN_LIST)
    if span is not None:
        info = _first(_attrs(buf, *span), IFLA_VF_VLAN_INFO)
        if info is not None:
            if info[1] - info[0] < _VF_VLAN_INFO.size + _BE16.size:
                raise _malformed("short IFLA_VF_VLAN_INFO")
            proto = _BE16.unpack_from(buf, info[0] + _VF_VLAN_INFO.size)[0]
    return VfState(
        vf=vf,
        mac=":".join(f"{b:02x}" for b in raw[:6]),
        vlan=vlan,
        qos=qos,
        min_tx_rate=low,
        max_tx_rate=high,
        spoofchk=_tristate(_setting(buf, _first(attrs, IFLA_VF_SPOOFCHK), "SPOOFCHK")),
        link_state=LinkState.AUTO if link_state is None else link_state,
        trust=_tristate(_setting(buf, _first(attrs, IFLA_VF_TRUST), "TRUST")),
        vlan_proto=proto,
    )


def decode_vfs(msg: bytes) -> tuple[VfState, ...]:
    """Return every VF's values from one RTM_NEWLINK reply (nlmsghdr included); () when it lists none.

    A link without SR-IOV (veth, dummy) carries no IFLA_VFINFO_LIST.  Raises VfNetlinkError (EBADMSG)
    for a reply whose lengths do not add up.
    """
    attrs = _link_attrs(msg)
    span = _first(attrs, IFLA_VFINFO_LIST)
    if span is None:
        return ()
    return tuple(
        _vf_state(msg, start, end) for rta_type, start, end in _attrs(msg, *span) if rta_type == IFLA_VF_INFO
    )


def decode_mtu(msg: bytes) -> int:
    """Return the IFLA_MTU of one RTM_NEWLINK reply (nlmsghdr included)."""
    span = _first(_link_attrs(msg), IFLA_MTU)
    if span is None or span[1] - span[0] < _U32.size:
        raise _malformed("link without IFLA_MTU")
    return int(_U32.unpack_from(msg, span[0])[0])


def _strerror(err: int) -> str:
    # errno.errorcode names 95 ENOTSUP, its alias on Linux; the kernel's code says EOPNOTSUPP.
    name = "EOPNOTSUPP" if err == errno.EOPNOTSUPP else errno.errorcode.get(err, "E?")
    try:
        return f"{name} ({os.strerror(err)})"
    except (ValueError, OverflowError):  # an errno off the wire need not fit a C int
        return f"error {err}"


def decode_ack(msg: bytes) -> tuple[int, str]:
    """Return ``(errno, reason)`` of one NLMSG_ERROR message (header included): ``(0, "")`` for an ACK.

    The reason is one bounded line: the errno's name and text, then the kernel's extended-ack message
    when it sent one (NLM_F_ACK_TLVS, with NETLINK_EXT_ACK on the socket).
    """
    if len(msg) < _NLMSGHDR.size + _I32.size:
        raise _malformed(f"NLMSG_ERROR of {len(msg)} bytes")
    length, _t, flags, _s, _p = _NLMSGHDR.unpack_from(msg)
    length = min(length, len(msg))
    err = -_I32.unpack_from(msg, _NLMSGHDR.size)[0]
    if err == 0:
        return 0, ""
    reason = _strerror(err)
    if flags & NLM_F_ACK_TLVS:
        # After the errno: the request's header, and its payload too unless the kernel capped the echo.
        echoed = _NLMSGHDR.size + _I32.size
        if length >= echoed + _NLMSGHDR.size:
            request_len = _NLMSGHDR.unpack_from(msg, echoed)[0]
            echoed += _NLMSGHDR.size if flags & NLM_F_CAPPED else (request_len + 3) & ~3
        try:
            text = _first(_attrs(msg, echoed, length), NLMSGERR_ATTR_MSG)
        except VfNetlinkError:
            text = None  # the errno is what matters; a garbled explanation is dropped
        if text is not None:
            said = msg[text[0] : text[1]].split(b"\0", 1)[0].decode("utf-8", "replace")
            if said:
                reason = f"{reason}: {clip(said, _REASON_LIMIT)}"
    return err, reason


# --------------------------------------------------------------------------------------------- client
class VfNetlink:
    """A blocking rtnetlink client for VF settings and MTUs, one socket, in one network namespace.

    Every call blocks: run it off the event loop with ``densedev.workers.run(Work.NETLINK, ...)``.
    ``timeout_s`` bounds the wait for the answer, but not the send: the kernel runs an rtnetlink request
    in the sending thread (netlink_unicast_kernel() calls rtnetlink_rcv()), under rtnl_lock, so a driver
    whose ndo_set_vf_* waits on its firmware holds the caller's thread until it returns — which is why
    these calls have their own pool.  Calls from several threads take turns on the socket.  Every
    failure — a refusal (NLMSG_ERROR), no answer in time, a reply larger than ``max_reply`` or that does
    not decode, a socket error — raises :class:`VfNetlinkError` with a one-line reason.
    """

    def __init__(
        self,
        netns: str | None = None,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_reply: int = DEFAULT_MAX_REPLY,
        netns_dir: Path = DEFAULT_NETNS_DIR,
        sock: socket.socket | None = None,
    ) -> None:
        self._timeout_s = timeout_s
        self._max_reply = max_reply
        if sock is None:
            sock = self._open(netns, netns_dir, max(max_reply, 1 << 16))
        self._sock = sock
        self._buf = bytearray(max_reply)
        self._lock = threading.Lock()
        self._seq = int.from_bytes(os.urandom(2), "little")  # not 0: tell our replies from stale ones

    @staticmethod
    def _open(netns: str | None, netns_dir: Path, rcvbuf: int) -> socket.socket:
        # The kernel queues one reply even when it is larger than the buffer (netlink_attachskb() only
        # refuses once the queue already exceeds it), so a modest buffer suffices.
        try:
            path = resolve_netns(netns, netns_dir) if netns else None
            sock = open_netlink_socket(NETLINK_ROUTE, 0, path, rcvbuf=rcvbuf)
        except OSError as exc:  # no such namespace, no permission to enter it, no sockets left
            err = exc.errno or errno.ENOENT
            where = f"namespace {clip(netns, 60)}" if netns else "this namespace"
            raise VfNetlinkError(err, f"open rtnetlink in {where}: {_strerror(err)}") from None
        for option in (NETLINK_CAP_ACK, NETLINK_EXT_ACK):
            # Kernels before 4.3 / 4.12 lack these: plain errors then, without an explanation.
            with contextlib.suppress(OSError):
                sock.setsockopt(SOL_NETLINK, option, 1)
        return sock

    def close(self) -> None:
        """Close the socket."""
        self._sock.close()

    def __enter__(self) -> VfNetlink:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def read_vfs(self, pf_ifindex: int) -> tuple[VfState, ...]:
        """Return the current values of every VF of the PF ``pf_ifindex`` (() for a link without VFs)."""
        return decode_vfs(self._ask(lambda seq: encode_getlink(pf_ifindex, seq), f"read VFs of {pf_ifindex}"))

    def read_mtu(self, ifindex: int) -> int:
        """Return the MTU of the netdev ``ifindex`` (read before :meth:`set_mtu`, to restore it)."""
        return decode_mtu(self._ask(lambda seq: encode_getlink(ifindex, seq, 0), f"read MTU of {ifindex}"))

    def set_vf(self, pf_ifindex: int, vf: int, settings: VfSettings) -> None:
        """Apply ``settings`` to VF ``vf`` of the PF ``pf_ifindex``; ValueError before sending a bad value."""
        self._ask(lambda seq: encode_set_vf(pf_ifindex, vf, settings, seq), f"set VF {vf} of {pf_ifindex}")

    def set_mtu(self, ifindex: int, mtu: int) -> None:
        """Set the MTU of the netdev ``ifindex``."""
        self._ask(lambda seq: encode_set_mtu(ifindex, mtu, seq), f"set MTU {mtu} on {ifindex}")

    def _ask(self, build: Callable[[int], bytes], what: str) -> bytes:
        # Send one request and wait for its ACK; return the RTM_NEWLINK that came before it, if any.
        with self._lock:
            self._seq = self._seq % _U32_MAX + 1
            seq = self._seq
            request = build(seq)  # ValueError here: nothing was sent
            try:
                self._sock.send(request)  # unconnected netlink: to the kernel (port 0)
                return self._until_ack(seq, what)
            except OSError as exc:
                if isinstance(exc, TimeoutError):
                    raise VfNetlinkError(
                        errno.ETIMEDOUT, f"{what}: no answer from the kernel within {self._timeout_s:g} s"
                    ) from None
                err = exc.errno or errno.EIO
                raise VfNetlinkError(err, f"{what}: {_strerror(err)}") from None

    def _until_ack(self, seq: int, what: str) -> bytes:
        deadline = time.monotonic() + self._timeout_s
        reply = b""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            self._sock.settimeout(left)
            # MSG_TRUNC: the datagram's real length even when it did not fit, so an oversized reply is
            # refused rather than misread.
            size, sender = self._sock.recvfrom_into(self._buf, self._max_reply, socket.MSG_TRUNC)
            if isinstance(sender, tuple) and sender[0] != 0:
                continue  # another process wrote to our port: only the kernel (port 0) answers
            if size > self._max_reply:
                raise VfNetlinkError(
                    errno.EMSGSIZE, f"{what}: reply of {size} bytes exceeds {self._max_reply}"
                )
            data = bytes(self._buf[:size])
            pos = 0
            while pos + _NLMSGHDR.size <= size:
                length, msg_type, _flags, msg_seq, _pid = _NLMSGHDR.unpack_from(data, pos)
                if length < _NLMSGHDR.size or pos + length > size:
                    raise VfNetlinkError(
                        errno.EBADMSG, f"{what}: malformed reply (message of {length} bytes)"
                    )
                if msg_seq == seq:  # anything else answers an earlier request that timed out
                    msg = data[pos : pos + length]
                    if msg_type == NLMSG_ERROR:
                        err, reason = decode_ack(msg)
                        if err:
                            raise VfNetlinkError(err, f"{what}: {reason}")
                        return reply
                    if msg_type == RTM_NEWLINK and not reply:
                        reply = msg
                pos += (length + 3) & ~3
