"""Link and uevent netlink sockets read on the running asyncio loop (uvloop included).

pyroute2's asyncio transport does not run under uvloop (pyroute2 issue 1335), so the monitors use raw
non-blocking netlink sockets watched with ``loop.add_reader`` and decode datagrams with the
accelerator's pure parsers.  A receive that fails with ``ENOBUFS`` means the kernel dropped messages
because our socket buffer was full: that is reported as an *overrun*, which callers must treat as
"resync everything", never as a few lost events.

An overrun also ends the reader under uvloop: netlink_overrun() sets ``sk_err``, epoll reports
EPOLLIN|EPOLLERR, our callback runs once more and libuv then drops the fd from epoll (strace shows
``EPOLL_CTL_DEL`` right after that callback) without telling anyone — no callback, no exception, the
queue stays full.  The default asyncio loop keeps polling.  So a monitor closes and reopens its socket
after every receive error, and a watchdog reopens it when a dump or a probe it sends itself is not
read back; see :class:`_Monitor`.

Network namespaces: a netlink socket belongs to the namespace of the thread that created it, for its
whole life.  ``open_netlink_socket`` therefore creates the socket in a short-lived helper thread that
first ``setns()``-es into the target namespace (``/var/run/netns/<name>``, where ``ip netns add``
puts it); ``setns`` only changes the calling thread's namespace, so the event loop's thread never
leaves the host namespace and nothing needs restoring.
"""

from __future__ import annotations

import asyncio
import ctypes
import enum
import errno
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple, Protocol, TypedDict, Unpack

from .. import accel
from ..backoff import Backoff

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
NLMSG_NOOP = 1
NLMSG_ERROR = 2
NLMSG_DONE = 3
_NLMSGHDR = struct.Struct("=IHHII")  # struct nlmsghdr (see _pyx/netlink.pxi)
_ERRNO = struct.Struct("=i")  # struct nlmsgerr's first field, the negative errno
_DUMP_RETRY_S = 0.05
DEFAULT_STALL_TIMEOUT_S = 5.0  # a dump of thousands of links takes milliseconds; a probe, microseconds
DEFAULT_PROBE_INTERVAL_S = 30.0  # how often each reader proves it still runs
_REOPEN_RETRY_S = 0.5  # first retry of a reopen that failed, doubling up to the next
_REOPEN_RETRY_MAX_S = 30.0
_MALFORMED_RESYNC_S = 1.0  # at most one resync a second for malformed datagrams
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


def _strerror(err: int) -> str:
    # The errno came off the wire: it may not even fit a C int.
    try:
        return os.strerror(err)
    except (ValueError, OverflowError):
        return f"error {err}"


class ReopenReason(enum.Enum):
    """Why a monitor closed its netlink socket and opened a new one."""

    OVERRUN = "overrun"  # ENOBUFS: the kernel dropped messages for us (netlink_overrun())
    ERROR = "error"  # any other receive error, or a bug in the reader itself
    STALLED = "stalled"  # the watchdog: a dump or a probe sent to ourselves never came back


class NetlinkObserver(Protocol):
    """Where monitors report faults and recoveries; :class:`densedev.ops.metrics.Metrics` is one."""

    def record_overrun(self, source: str) -> None:
        """Count an ENOBUFS on ``source``."""

    def record_reopen(self, source: str, reason: str) -> None:
        """Count a socket of ``source`` closed and reopened for ``reason``."""

    def record_malformed(self, source: str) -> None:
        """Count a datagram from ``source`` that could not be decoded."""

    def observe_netlink_resync(self, source: str, seconds: float) -> None:
        """Record the time from a lost event to the completed resync."""


class DumpProgress(NamedTuple):
    """What one datagram says about our running dump (see :func:`dump_progress`)."""

    done: bool  # an NLMSG_DONE or NLMSG_ERROR with our sequence number ended it
    interrupted: bool  # NLM_F_DUMP_INTR: the link list changed while it was read
    error: int  # the errno of an NLMSG_ERROR that ended it (0: none, or unreadable)
    malformed: bool  # a header claimed fewer bytes than a header, or more than the datagram holds


def dump_progress(data: bytes, seq: int) -> DumpProgress:
    """Read only the message headers of a datagram for our dump's sequence number; never raises.

    ``NLM_F_DUMP_INTR`` means the list changed during the dump (nl_dump_check_consistent), so it may be
    inconsistent and must be redone; ``NLMSG_DONE`` or ``NLMSG_ERROR`` ends it.  A message whose header
    lies about its length stops the walk and is reported as malformed: the kernel never sends one, so
    it came from a bug or from another socket, and what follows it cannot be framed.
    """
    interrupted = malformed = False
    error = 0
    pos, end = 0, len(data)
    while pos + _NLMSGHDR.size <= end:
        length, mtype, flags, mseq, _pid = _NLMSGHDR.unpack_from(data, pos)
        if length < _NLMSGHDR.size or pos + length > end:
            malformed = True
        if mseq == seq:
            interrupted = interrupted or bool(flags & NLM_F_DUMP_INTR)
            if mtype in (NLMSG_DONE, NLMSG_ERROR):
                # struct nlmsgerr starts with the (negative) errno right after the header.
                if mtype == NLMSG_ERROR:
                    if not malformed and length >= _NLMSGHDR.size + _ERRNO.size:
                        error = -_ERRNO.unpack_from(data, pos + _NLMSGHDR.size)[0]
                    else:
                        malformed = True
                return DumpProgress(True, interrupted, error, malformed)
        if malformed:
            break
        pos += (length + 3) & ~3
    if 0 < end - pos < _NLMSGHDR.size:
        malformed = True  # trailing bytes too short for a header
    return DumpProgress(False, interrupted, error, malformed)


class MonitorOptions(TypedDict, total=False):
    """What a monitor may be given by keyword besides its callbacks (defaults: :class:`_Monitor`'s)."""

    netns: str | None  # a name from ``ip netns add`` or a path; None: the daemon's own namespace
    rcvbuf: int
    netns_dir: Path
    observer: NetlinkObserver | None
    stall_timeout_s: float  # 0: no watchdog
    probe_interval_s: float  # 0: no probes


class _Monitor:
    """Shared reader: a netlink socket on the loop, reopened whenever it may have lost or stopped.

    Under uvloop a netlink overrun does more than lose messages: the kernel flags it with ``sk_err``,
    epoll reports EPOLLERR on the fd, and libuv stops watching it after our callback returns, silently
    (module docstring) — the reader would never run again.  So every receive error closes the socket
    and opens a new one (new subscription, then the subclass's resync), a watchdog reopens it when a
    dump or a probe sent to ourselves is not read back in time, and nothing the reader meets — a
    malformed datagram, a callback's bug — escapes into the loop.
    """

    source = "netlink"

    def __init__(
        self,
        protocol: int,
        groups: int,
        on_overrun: Callable[[], None],
        netns: str | None = None,
        rcvbuf: int = DEFAULT_RCVBUF,
        netns_dir: Path = DEFAULT_NETNS_DIR,
        observer: NetlinkObserver | None = None,
        stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
        probe_interval_s: float = DEFAULT_PROBE_INTERVAL_S,
    ) -> None:
        self._protocol = protocol
        self._groups = groups
        self._on_overrun = on_overrun
        self._netns = netns
        self._netns_dir = netns_dir
        self._rcvbuf = rcvbuf
        self._observer = observer
        self._stall_s = stall_timeout_s
        self._probe_s = probe_interval_s
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._buf = bytearray(_RECV_SIZE)
        self._probe = b""  # the datagram we send ourselves to prove the reader runs
        self._probe_sent: float | None = None  # loop time of the unanswered probe
        self._probe_blocked = 0  # probes in a row that found our receive queue full
        self._watchdog: asyncio.TimerHandle | None = None
        self._watch_due = 0.0
        self._probe_timer: asyncio.TimerHandle | None = None
        self._reopen_handle: asyncio.Handle | None = None
        self._reopen_soon = False  # a reopen runs on the next turn: the old queue is stale
        self._reopen_reason = ReopenReason.ERROR
        self._reopen_backoff = Backoff(_REOPEN_RETRY_S, _REOPEN_RETRY_MAX_S)
        self._lost_at: float | None = None  # when events were last lost and not yet resynced
        self._resync_handle: asyncio.TimerHandle | None = None
        self._last_malformed_resync = -1e9
        self.overruns = 0
        self.reopens = 0
        self.stalls = 0
        self.malformed = 0
        self.resyncs = 0  # resyncs completed after lost events
        self.last_resync_s: float | None = None

    # ------------------------------------------------------------------------------- socket lifecycle
    def _make_socket(self) -> socket.socket:
        path = resolve_netns(self._netns, self._netns_dir) if self._netns else None
        return open_netlink_socket(self._protocol, self._groups, path, self._rcvbuf)

    def _open(self) -> None:
        if self._sock is not None:
            raise RuntimeError("monitor already started")
        sock = self._make_socket()
        self._loop = asyncio.get_running_loop()
        self._attach(sock)
        if self._probe_s > 0:
            self._probe_timer = self._loop.call_later(self._probe_s, self._send_probe)

    def _attach(self, sock: socket.socket) -> None:
        assert self._loop is not None
        self._sock = sock
        port = sock.getsockname()[0]
        # NLMSG_NOOP from our own port with a random tag: no parser is ever shown it.
        body = os.urandom(8)
        self._probe = _NLMSGHDR.pack(_NLMSGHDR.size + len(body), NLMSG_NOOP, 0, 0, port) + body
        self._probe_sent = None
        self._probe_blocked = 0
        self._loop.add_reader(sock.fileno(), self._readable)

    def _detach(self) -> None:
        sock, self._sock = self._sock, None
        if sock is None:
            return
        if self._loop is not None and not self._loop.is_closed():
            # After libuv stopped the handle this still drops uvloop's record of it (and the epoll
            # registration, if any), so the new socket — possibly with the same fd number — starts clean.
            self._loop.remove_reader(sock.fileno())
        sock.close()

    def stop(self) -> None:
        """Stop reading, cancel every timer and close the socket; safe to call twice."""
        for handle in (self._watchdog, self._probe_timer, self._reopen_handle, self._resync_handle):
            if handle is not None:
                handle.cancel()
        self._watchdog = self._probe_timer = self._reopen_handle = self._resync_handle = None
        self._detach()

    @property
    def fileno(self) -> int:
        """Return the socket's descriptor (-1 when stopped), for tests and diagnostics."""
        return -1 if self._sock is None else self._sock.fileno()

    def _lost(self, reason: ReopenReason) -> None:
        """Events may have been lost and the reader may be dead: reopen the socket on the next turn."""
        if self._lost_at is None:
            self._lost_at = time.monotonic()  # uvloop's loop.time() only counts milliseconds
        if self._reopen_handle is not None or self._loop is None:
            return
        self._reopen_reason = reason
        # Not from inside the reader callback: libuv still holds the old poll handle until it returns.
        self._reopen_soon = True
        self._reopen_handle = self._loop.call_soon(self._reopen)

    def _reopen(self) -> None:
        self._reopen_handle = None
        self._reopen_soon = False  # while retries back off, the old socket is read for what it gives
        assert self._loop is not None
        try:
            sock = self._make_socket()
        except Exception as exc:
            # The namespace may be gone or descriptors exhausted: keep the old socket, try again later.
            delay = self._reopen_backoff.next()
            log.error(
                "netlink %s socket could not be reopened (%s); retrying in %.0f s",
                self.source,
                exc,
                delay,
            )
            self._reopen_handle = self._loop.call_later(delay, self._reopen)
            return
        self._reopen_backoff.reset()
        self._detach()
        self._attach(sock)
        self.reopens += 1
        reason = self._reopen_reason.value
        if self._observer is not None:
            self._observer.record_reopen(self.source, reason)
        log.warning("netlink %s socket reopened after %s; resyncing", self.source, reason)
        # Subscribed again first, then the resync: a change after it is read as an event.
        self._resubscribed()
        self._guard(self._on_overrun)

    def _resubscribed(self) -> None:
        """Hook: the new socket is subscribed; start the subclass's resync."""

    def _resynced(self) -> None:
        """Record a completed resync after lost events (link: the new socket's dump was read)."""
        if self._lost_at is None:
            return
        seconds = time.monotonic() - self._lost_at
        self._lost_at = None
        self.resyncs += 1
        self.last_resync_s = seconds
        if self._observer is not None:
            self._observer.observe_netlink_resync(self.source, seconds)
        log.info("netlink %s resync completed in %.1f ms", self.source, seconds * 1e3)

    # ------------------------------------------------------------------------------- watchdog
    def _outstanding_since(self) -> float | None:
        """Return the loop time of the oldest request still unanswered (a probe here; dumps too)."""
        return self._probe_sent

    def _expect(self) -> None:
        """Arm the watchdog for a request just sent, unless it is armed already."""
        if self._watchdog is None and self._loop is not None and self._stall_s > 0:
            self._watch_due = self._loop.time() + self._stall_s
            self._watchdog = self._loop.call_later(self._stall_s, self._check_stall)

    def _check_stall(self) -> None:
        self._watchdog = None
        assert self._loop is not None
        since = self._outstanding_since()
        if since is None or self._sock is None:
            return
        now = self._loop.time()
        if now - self._watch_due > self._stall_s / 2:
            # The whole loop was held up (a long callback, SIGSTOP).  A loop that runs due timers
            # before it polls I/O would get here before the reader saw the reply: give it one turn.
            self._expect()
            return
        if now - since < self._stall_s:
            self._watch_due = since + self._stall_s
            self._watchdog = self._loop.call_later(self._watch_due - now, self._check_stall)
            return
        self.stalls += 1
        log.error(
            "netlink %s reader stalled (nothing read back for %.1f s): reopening", self.source, now - since
        )
        self._lost(ReopenReason.STALLED)

    def _send_probe(self) -> None:
        assert self._loop is not None
        self._probe_timer = self._loop.call_later(self._probe_s, self._send_probe)
        sock = self._sock
        if sock is None or self._probe_sent is not None or self._reopen_handle is not None:
            return  # the watchdog already waits for the last one, or a reopen is on its way
        try:
            sock.sendto(self._probe, (sock.getsockname()[0], 0))
        except BlockingIOError:
            # netlink_attachskb(): our own receive queue is full.  A live reader empties it within a
            # wakeup or two; full again a whole interval later means nobody reads it.
            self._probe_blocked += 1
            if self._probe_blocked >= 2:
                self.stalls += 1
                log.error("netlink %s receive queue stays full: reopening", self.source)
                self._lost(ReopenReason.STALLED)
            return
        except OSError as exc:
            log.error("netlink %s probe could not be sent (%s): reopening", self.source, exc)
            self._lost(ReopenReason.ERROR)
            return
        self._probe_blocked = 0
        self._probe_sent = self._loop.time()
        self._expect()

    # ------------------------------------------------------------------------------- reading
    def _readable(self) -> None:
        try:
            self._read()
        except Exception:
            # Last line of defence: an exception here would reach the loop (and, under uvloop, close
            # the poll handle).  Whatever went wrong, a fresh socket and a resync put it right.
            log.exception("netlink %s reader failed: reopening", self.source)
            self._lost(ReopenReason.ERROR)

    def _read(self) -> None:
        sock = self._sock
        if sock is None or self._reopen_soon:
            return  # the queue is stale: the new socket and its resync replace it
        view = memoryview(self._buf)
        for _ in range(_MAX_DATAGRAMS_PER_WAKEUP):
            try:
                n = sock.recv_into(self._buf)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.ENOBUFS:
                    # netlink(7): the receive queue overflowed and messages were dropped.  What is
                    # still queued predates the loss; the new socket's resync supersedes it.
                    self.overruns += 1
                    if self._observer is not None:
                        self._observer.record_overrun(self.source)
                    log.warning("netlink %s overrun (ENOBUFS): reopening and resyncing", self.source)
                    self._lost(ReopenReason.OVERRUN)
                else:
                    log.error("netlink %s receive failed (%s): reopening", self.source, exc)
                    self._lost(ReopenReason.ERROR)
                break
            if n == 0:
                break
            data = bytes(view[:n])
            if data == self._probe:
                self._probe_sent = None
                continue
            try:
                self._datagram(data)
            except Exception as exc:
                self._malformed(data, exc)
        self._flush()

    def _malformed(self, data: bytes, exc: Exception | None) -> None:
        """Log and count a datagram the decoders refused, then resync (at most once a second)."""
        self.malformed += 1
        if self._observer is not None:
            self._observer.record_malformed(self.source)
        why = f"{type(exc).__name__}: {str(exc)[:120]}" if exc is not None else "bad message length"
        log.error(
            "malformed netlink message on %s (%d bytes, %s; first bytes %s): resyncing",
            self.source,
            len(data),
            why,
            data[:32].hex(),
        )
        if self._resync_handle is not None or self._loop is None:
            return
        if self._lost_at is None:
            self._lost_at = time.monotonic()
        # A source that keeps sending a bad message must not turn into a resync loop.
        delay = max(0.0, self._last_malformed_resync + _MALFORMED_RESYNC_S - self._loop.time())
        self._resync_handle = self._loop.call_later(delay, self._malformed_resync)

    def _malformed_resync(self) -> None:
        self._resync_handle = None
        assert self._loop is not None
        self._last_malformed_resync = self._loop.time()
        self._after_malformed()

    def _after_malformed(self) -> None:
        """Hook: resync after a malformed datagram."""
        self._guard(self._on_overrun)

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

    source = "link"

    def __init__(
        self,
        on_links: Callable[[tuple[LinkTuple, ...]], None],
        on_overrun: Callable[[], None],
        **options: Unpack[MonitorOptions],
    ) -> None:
        super().__init__(NETLINK_ROUTE, RTMGRP_LINK, on_overrun, **options)
        self._on_links = on_links
        self._pending: list[LinkTuple] = []
        self._seq = 0
        self._dumping = False  # our RTM_GETLINK dump is still streaming in
        self._dump_sent = 0.0  # loop time the running dump was requested
        self._dump_again = False  # another dump is owed once it ends
        self.dumps = 0  # dumps completed, for tests and diagnostics

    @property
    def dump_seq(self) -> int:
        """Return the sequence number of the last dump requested (for tests and diagnostics)."""
        return self._seq

    async def start(self) -> None:
        """Subscribe to link events, then request one dump of all links (so none is missed between)."""
        self._open()
        self.resync()

    def resync(self) -> None:
        """Ask the kernel for every link again (after an overrun); replies arrive through ``on_links``."""
        if self._loop is None:
            raise RuntimeError("link monitor is not started")
        if self._dumping or self._sock is None or self._reopen_handle is not None:
            # A netlink socket runs one dump at a time (a second request gets EBUSY, see
            # netlink_dump_start): owe another, sent when the running one ends, so the state we end
            # with is read after the request.  A socket being reopened dumps anyway.
            self._dump_again = True
            return
        self._send_dump()

    def _resubscribed(self) -> None:
        self._dumping = False  # the old socket's dump died with it
        self._pending.clear()
        self._send_dump()

    def _after_malformed(self) -> None:
        self.resync()

    def _outstanding_since(self) -> float | None:
        since = [t for t in (self._probe_sent, self._dump_sent if self._dumping else None) if t is not None]
        return min(since) if since else None

    def _send_dump(self) -> None:
        assert self._sock is not None and self._loop is not None
        self._seq += 1
        self._dump_again = False
        # nlmsghdr + ifinfomsg (AF_UNSPEC: every family), NLM_F_DUMP: all links, multi-part reply.
        body = struct.pack("=BBHiII", socket.AF_UNSPEC, 0, 0, 0, 0, 0)
        header = _NLMSGHDR.pack(16 + len(body), RTM_GETLINK, NLM_F_REQUEST | NLM_F_DUMP, self._seq, 0)
        try:
            self._sock.send(header + body)
        except BlockingIOError:
            # The kernel could not take the request now; try again shortly rather than lose it.
            self._loop.call_later(_DUMP_RETRY_S, self._retry_dump)
            return
        except OSError as exc:
            log.error("link dump request failed (%s): reopening", exc)
            self._lost(ReopenReason.ERROR)
            return
        self._dumping = True
        self._dump_sent = self._loop.time()
        self._expect()

    def _retry_dump(self) -> None:
        if self._sock is not None and not self._dumping and self._reopen_handle is None:
            self._send_dump()

    def _datagram(self, data: bytes) -> None:
        if self._dumping:
            self._track_dump(data)
        self._pending.extend(accel.parse_links(data))

    def _track_dump(self, data: bytes) -> None:
        progress = dump_progress(data, self._seq)
        if progress.interrupted:
            self._dump_again = True
        if progress.malformed:
            self._malformed(data, None)
            # The dump is not trusted; if it ended here, the resync above will ask for a new one.
            self._dump_again = True
        if not progress.done:
            return
        self._dumping = False
        if progress.error:
            log.error("link dump refused: %s", _strerror(progress.error))
            self._dump_again = self._dump_again or progress.error in (errno.EBUSY, errno.EINTR)
        elif not progress.malformed:
            self.dumps += 1
        if self._dump_again and self._resync_handle is None:
            self._send_dump()
        elif not self._dump_again and not progress.error:
            self._resynced()

    def _flush(self) -> None:
        if self._pending:
            batch, self._pending = tuple(self._pending), []
            self._guard(lambda: self._on_links(batch))


class UeventMonitor(_Monitor):
    """Watches kernel uevents (NETLINK_KOBJECT_UEVENT group 1) and hands each decoded event on.

    Uevents cannot be dumped: after a reopen ``on_overrun`` asks the daemon for a full rescan, and the
    daemon reports when that resync completed.
    """

    source = "uevent"

    def __init__(
        self,
        on_event: Callable[[UeventTuple], None],
        on_overrun: Callable[[], None],
        **options: Unpack[MonitorOptions],
    ) -> None:
        super().__init__(NETLINK_KOBJECT_UEVENT, UEVENT_GROUP_KERNEL, on_overrun, **options)
        self._on_event = on_event

    async def start(self) -> None:
        """Subscribe to kernel uevents."""
        self._open()

    def _resubscribed(self) -> None:
        # The rescan on_overrun asks for is the resync; the daemon times it.
        self._lost_at = None

    def _datagram(self, data: bytes) -> None:
        event = accel.parse_uevent(data)
        if event is None:
            log.debug("ignored a datagram that is not a kernel uevent (%d bytes)", len(data))
            return
        self._guard(lambda: self._on_event(event))
