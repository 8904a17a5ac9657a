"""Link and uevent netlink sockets read on the running asyncio loop (uvloop included).

pyroute2's asyncio transport does not run under uvloop (pyroute2 issue 1335), so the monitors use raw
non-blocking netlink sockets watched with ``loop.add_reader`` and decode datagrams with the
accelerator's pure parsers.  A receive that fails with ``ENOBUFS`` means the kernel dropped messages
because our socket buffer was full: that is reported as an *overrun*, which callers must treat as
"resync everything", never as a few lost events.

Network namespaces: a netlink socket belongs to the namespace of the thread that created it, for its
whole life.  ``open_netlink_socket`` therefore creates the socket in a short-lived helper thread that
first ``setns()``-es into the target namespace (``/var/run/netns/<name>``, where ``ip netns add``
puts it); ``setns`` only changes the calling thread's namespace, so the event loop's thread never
leaves the host namespace and nothing needs restoring.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import logging
import os
import socket
import struct
import threading
from collections.abc import Callable
from pathlib import Path

from . import accel

log = logging.getLogger(__name__)

NETLINK_ROUTE = 0
NETLINK_KOBJECT_UEVENT = 15
RTMGRP_LINK = 0x1  # <linux/rtnetlink.h>: the legacy group bit for RTNLGRP_LINK
UEVENT_GROUP_KERNEL = 1  # kernel uevents; group 2 is udev's re-broadcast (libudev format)
SO_RCVBUFFORCE = 33  # <asm-generic/socket.h>; root may exceed net.core.rmem_max with it
RTM_NEWLINK = 16
RTM_DELLINK = 17
RTM_GETLINK = 18
NLM_F_REQUEST = 0x1
NLM_F_DUMP = 0x300  # NLM_F_ROOT | NLM_F_MATCH
NLM_F_DUMP_INTR = 0x10  # the dump was interrupted by a change: it may be inconsistent
NLMSG_ERROR = 2
NLMSG_DONE = 3
_NLMSGHDR = struct.Struct("=IHHII")  # struct nlmsghdr (see _pyx/netlink.pxi)
_DUMP_RETRY_S = 0.05
IFF_UP = 0x1
CLONE_NEWNET = 0x40000000  # <linux/sched.h>
IF_OPER_UNKNOWN = 0
IF_OPER_UP = 6
DEFAULT_RCVBUF = 8 * 1024 * 1024  # a dump of thousands of links plus a storm of events
DEFAULT_NETNS_DIR = Path("/var/run/netns")
_RECV_SIZE = 1 << 18  # larger than any single netlink datagram the kernel sends (dump parts ≤ 32 KiB)
_MAX_DATAGRAMS_PER_WAKEUP = 256  # bound one reader callback so a storm cannot starve the loop

LinkTuple = tuple[int, int, str, int, int, int, int]
UeventTuple = tuple[str, str, tuple[tuple[str, str], ...]]


def link_up(flags: int, operstate: int, carrier: int) -> bool:
    """Return whether a link counts as up: operstate UP, or (for drivers that leave operstate
    UNKNOWN, RFC 2863 style) administratively up with carrier."""
    if operstate == IF_OPER_UP:
        return True
    if operstate in (IF_OPER_UNKNOWN, -1):
        return bool(flags & IFF_UP) and carrier != 0
    return False


def link_states(links: tuple[LinkTuple, ...]) -> tuple[list[tuple[str, bool]], list[str]]:
    """Split decoded link messages into ``(ifname, up)`` facts and the names that left the namespace."""
    states: list[tuple[str, bool]] = []
    gone: list[str] = []
    for msg_type, _index, name, flags, operstate, carrier, _parent in links:
        if not name:
            continue
        if msg_type == RTM_DELLINK:
            gone.append(name)
        else:
            states.append((name, link_up(flags, operstate, carrier)))
    return states, gone


def resolve_netns(netns: str, netns_dir: Path = DEFAULT_NETNS_DIR) -> Path:
    """Return the namespace file for a name from ``ip netns add`` or an absolute path."""
    path = Path(netns) if netns.startswith("/") else netns_dir / netns
    if not path.exists():
        raise FileNotFoundError(f"network namespace {netns!r}: {path} does not exist")
    return path


def _setns(fd: int, nstype: int) -> None:
    # os.setns arrived in Python 3.12; densedev supports 3.11, so call libc's setns(2) directly.
    setns = getattr(os, "setns", None)
    if setns is not None:
        setns(fd, nstype)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, nstype) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def open_netlink_socket(
    protocol: int, groups: int, netns: Path | None = None, rcvbuf: int = DEFAULT_RCVBUF
) -> socket.socket:
    """Open a non-blocking netlink socket bound to ``groups``, inside ``netns`` when given."""

    def make() -> socket.socket:
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_NONBLOCK, protocol)
        try:
            try:
                sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, rcvbuf)
            except PermissionError:
                # Without CAP_NET_ADMIN the kernel caps the size at net.core.rmem_max.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            sock.bind((0, groups))
        except BaseException:
            sock.close()
            raise
        return sock

    if netns is None:
        return make()
    result: list[socket.socket] = []
    failure: list[BaseException] = []

    def in_thread() -> None:
        try:
            fd = os.open(netns, os.O_RDONLY | os.O_CLOEXEC)
            try:
                _setns(fd, CLONE_NEWNET)  # this thread only; it exits right after
            finally:
                os.close(fd)
            result.append(make())
        except BaseException as exc:  # handed back to the caller's thread
            failure.append(exc)

    thread = threading.Thread(target=in_thread, name=f"netns-open-{netns.name}")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]


class _Monitor:
    """Shared reader: a netlink socket on the loop, datagrams decoded, ENOBUFS turned into overruns."""

    def __init__(
        self,
        protocol: int,
        groups: int,
        on_overrun: Callable[[], None],
        netns: str | None,
        rcvbuf: int,
        netns_dir: Path,
    ) -> None:
        self._protocol = protocol
        self._groups = groups
        self._on_overrun = on_overrun
        self._netns = netns
        self._netns_dir = netns_dir
        self._rcvbuf = rcvbuf
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._buf = bytearray(_RECV_SIZE)
        self.overruns = 0

    def _open(self) -> None:
        if self._sock is not None:
            raise RuntimeError("monitor already started")
        path = resolve_netns(self._netns, self._netns_dir) if self._netns else None
        self._sock = open_netlink_socket(self._protocol, self._groups, path, self._rcvbuf)
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._sock.fileno(), self._readable)

    def stop(self) -> None:
        """Stop reading and close the socket; safe to call twice."""
        if self._sock is None:
            return
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._sock.fileno())
        self._sock.close()
        self._sock = None

    @property
    def fileno(self) -> int:
        """Return the socket's descriptor (-1 when stopped), for tests and diagnostics."""
        return -1 if self._sock is None else self._sock.fileno()

    def _readable(self) -> None:
        sock = self._sock
        if sock is None:
            return
        view = memoryview(self._buf)
        for _ in range(_MAX_DATAGRAMS_PER_WAKEUP):
            try:
                n = sock.recv_into(self._buf)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.ENOBUFS:
                    # netlink(7): the receive queue overflowed and messages were dropped.  The
                    # socket stays usable; what was lost can only be recovered by a resync.
                    self.overruns += 1
                    log.warning("netlink overrun on protocol %d: resync needed", self._protocol)
                    self._guard(self._on_overrun)
                    continue
                log.error("netlink receive failed on protocol %d: %s", self._protocol, exc)
                break
            if n == 0:
                break
            self._datagram(bytes(view[:n]))
        self._flush()

    def _guard(self, fn: Callable[[], None]) -> None:
        # A callback's bug must not kill the reader: the daemon keeps serving the last state.
        try:
            fn()
        except Exception:
            log.exception("netlink monitor callback failed")

    def _datagram(self, data: bytes) -> None:
        raise NotImplementedError

    def _flush(self) -> None:
        pass


class LinkMonitor(_Monitor):
    """Watches rtnetlink link events (RTMGRP_LINK) and hands batches of decoded link tuples on."""

    def __init__(
        self,
        on_links: Callable[[tuple[LinkTuple, ...]], None],
        on_overrun: Callable[[], None],
        netns: str | None = None,
        rcvbuf: int = DEFAULT_RCVBUF,
        netns_dir: Path = DEFAULT_NETNS_DIR,
    ) -> None:
        super().__init__(NETLINK_ROUTE, RTMGRP_LINK, on_overrun, netns, rcvbuf, netns_dir)
        self._on_links = on_links
        self._pending: list[LinkTuple] = []
        self._seq = 0
        self._dumping = False  # our RTM_GETLINK dump is still streaming in
        self._dump_again = False  # another dump is owed once it ends
        self.dumps = 0  # dumps completed, for tests and diagnostics

    async def start(self) -> None:
        """Subscribe to link events, then request one dump of all links (so none is missed between)."""
        self._open()
        self.resync()

    def resync(self) -> None:
        """Ask the kernel for every link again (after an overrun); replies arrive through ``on_links``."""
        if self._sock is None:
            raise RuntimeError("link monitor is not started")
        if self._dumping:
            # A netlink socket runs one dump at a time (a second request gets EBUSY, see
            # netlink_dump_start): owe another, sent when the running one ends, so the state we end
            # with is read after the overrun.
            self._dump_again = True
            return
        self._send_dump()

    def _send_dump(self) -> None:
        assert self._sock is not None
        self._seq += 1
        self._dump_again = False
        # nlmsghdr + ifinfomsg (AF_UNSPEC: every family), NLM_F_DUMP: all links, multi-part reply.
        body = struct.pack("=BBHiII", socket.AF_UNSPEC, 0, 0, 0, 0, 0)
        header = struct.pack("=IHHII", 16 + len(body), RTM_GETLINK, NLM_F_REQUEST | NLM_F_DUMP, self._seq, 0)
        try:
            self._sock.send(header + body)
        except BlockingIOError:
            # The kernel could not take the request now; try again shortly rather than lose it.
            if self._loop is not None:
                self._loop.call_later(_DUMP_RETRY_S, self._retry_dump)
            return
        self._dumping = True

    def _retry_dump(self) -> None:
        if self._sock is not None and not self._dumping:
            self._send_dump()

    def _datagram(self, data: bytes) -> None:
        if self._dumping:
            self._track_dump(data)
        self._pending.extend(accel.parse_links(data))

    def _track_dump(self, data: bytes) -> None:
        # Follow our dump's reply by its sequence number: NLM_F_DUMP_INTR means the link list changed
        # while it was read (nl_dump_check_consistent), so it may be inconsistent and is redone;
        # NLMSG_DONE or NLMSG_ERROR ends it.  Only headers are read, and only while a dump runs.
        pos = 0
        while pos + _NLMSGHDR.size <= len(data):
            length, mtype, flags, seq, _pid = _NLMSGHDR.unpack_from(data, pos)
            if length < _NLMSGHDR.size:
                return
            if seq == self._seq:
                if flags & NLM_F_DUMP_INTR:
                    self._dump_again = True
                if mtype in (NLMSG_DONE, NLMSG_ERROR):
                    if mtype == NLMSG_ERROR and length >= _NLMSGHDR.size + 4:
                        err = -struct.unpack_from("=i", data, pos + _NLMSGHDR.size)[0]
                        log.error("link dump refused: %s", os.strerror(err) if err > 0 else err)
                        self._dump_again = self._dump_again or err in (errno.EBUSY, errno.EINTR)
                    else:
                        self.dumps += 1
                    self._dumping = False
                    if self._dump_again:
                        self._send_dump()
                    return
            pos += (length + 3) & ~3

    def _flush(self) -> None:
        if self._pending:
            batch, self._pending = tuple(self._pending), []
            self._guard(lambda: self._on_links(batch))


class UeventMonitor(_Monitor):
    """Watches kernel uevents (NETLINK_KOBJECT_UEVENT group 1) and hands each decoded event on."""

    def __init__(
        self,
        on_event: Callable[[UeventTuple], None],
        on_overrun: Callable[[], None],
        netns: str | None = None,
        rcvbuf: int = DEFAULT_RCVBUF,
        netns_dir: Path = DEFAULT_NETNS_DIR,
    ) -> None:
        super().__init__(NETLINK_KOBJECT_UEVENT, UEVENT_GROUP_KERNEL, on_overrun, netns, rcvbuf, netns_dir)
        self._on_event = on_event

    async def start(self) -> None:
        """Subscribe to kernel uevents."""
        self._open()

    def _datagram(self, data: bytes) -> None:
        event = accel.parse_uevent(data)
        if event is None:
            log.debug("ignored a datagram that is not a kernel uevent (%d bytes)", len(data))
            return
        self._guard(lambda: self._on_event(event))
