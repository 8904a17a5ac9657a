"""Fuzzing the dump-tracking path: the header walk that follows our RTM_GETLINK dump, alone against a
model, and live — arbitrary datagrams sent by another socket into a real monitor's running dump, on
uvloop, after which the reader must still complete a dump (conftest fails the test on any exception
the loop saw).  The link and uevent decoders themselves are fuzzed in tests/test_netlink_parse.py.
"""

from __future__ import annotations

import asyncio
import errno
import socket
import struct

import pytest
from helpers.waiting import until as _until
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from densedev.node.events import (
    NETLINK_ROUTE,
    NLM_F_DUMP_INTR,
    NLMSG_DONE,
    NLMSG_ERROR,
    NLMSG_NOOP,
    RTM_NEWLINK,
    DumpProgress,
    LinkMonitor,
    LinkTuple,
    dump_progress,
    open_netlink_socket,
    resolve_netns,
)

GUARD_S = 15.0
SEQ = 7
FIXTURE_SAFE = settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

pytestmark = pytest.mark.faults


def nlmsg(mtype: int, body: bytes, flags: int = 0, seq: int = 0) -> bytes:
    """One well-formed netlink message, padded to 4 bytes as the kernel aligns them (NLMSG_ALIGN)."""
    return struct.pack("=IHHII", 16 + len(body), mtype, flags, seq, 0) + body + b"\0" * (-len(body) % 4)


class Msg:
    """A generated message and what the dump tracker must conclude from it."""

    def __init__(self, mtype: int, flags: int, seq: int, body: bytes) -> None:
        self.mtype, self.flags, self.seq, self.body = mtype, flags, seq, body
        self.data = nlmsg(mtype, body, flags, seq)


@st.composite
def messages(draw: st.DrawFn) -> Msg:
    mtype = draw(st.sampled_from([RTM_NEWLINK, NLMSG_DONE, NLMSG_ERROR, NLMSG_NOOP, 20]))
    seq = draw(st.sampled_from([SEQ, SEQ - 1, 0]))
    flags = draw(st.sampled_from([0, 0x2, NLM_F_DUMP_INTR, 0x2 | NLM_F_DUMP_INTR]))
    if mtype == NLMSG_ERROR:
        # struct nlmsgerr.error: a negative errno from the kernel, anything at all from elsewhere.
        codes = [0, -errno.EBUSY, -errno.EINTR, -errno.EPERM, -(2**31), 2**31 - 1]
        body = struct.pack("=i", draw(st.sampled_from(codes)))
        body += draw(st.binary(max_size=32))
    elif mtype == NLMSG_DONE:
        body = struct.pack("=i", 0)
    else:
        body = draw(st.binary(max_size=48))
    return Msg(mtype, flags, seq, body)


def model(msgs: list[Msg]) -> DumpProgress:
    """What a header walk over well-formed messages must find for sequence ``SEQ``."""
    interrupted = False
    for m in msgs:
        if m.seq != SEQ:
            continue
        interrupted = interrupted or bool(m.flags & NLM_F_DUMP_INTR)
        if m.mtype in (NLMSG_DONE, NLMSG_ERROR):
            error = -struct.unpack_from("=i", m.body)[0] if m.mtype == NLMSG_ERROR else 0
            return DumpProgress(True, interrupted, error, False)
    return DumpProgress(False, interrupted, 0, False)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=400), st.integers(0, 2**32 - 1))
def test_arbitrary_bytes_never_raise(data: bytes, seq: int) -> None:
    got = dump_progress(data, seq)
    assert isinstance(got, DumpProgress)
    assert got.error == 0 or got.done  # an errno only ever comes with the end of the dump


@settings(max_examples=300, deadline=None)
@given(st.lists(messages(), max_size=10))
def test_well_formed_streams_match_the_model(msgs: list[Msg]) -> None:
    assert dump_progress(b"".join(m.data for m in msgs), SEQ) == model(msgs)


@settings(max_examples=300, deadline=None)
@given(st.lists(messages(), min_size=1, max_size=10), st.data())
def test_truncated_streams_are_malformed_never_an_exception(msgs: list[Msg], data: st.DataObject) -> None:
    stream = b"".join(m.data for m in msgs)
    cut = data.draw(st.integers(0, len(stream)))
    got = dump_progress(stream[:cut], SEQ)
    # The messages wholly inside the cut decide; a cut inside a later message is malformed unless
    # the dump had already ended before it.
    whole: list[Msg] = []
    end = 0  # where the first message not wholly inside the cut starts
    for m in msgs:
        if end + 16 + len(m.body) > cut:  # nlmsg_len: the padding after it is not part of it
            break
        whole.append(m)
        end += len(m.data)
    expected = model(whole)
    if expected.done or cut <= end:
        assert got == expected
    else:
        assert got.malformed


def test_lying_headers() -> None:
    # The bug that escaped into the loop: an NLMSG_ERROR for our dump shorter than its header says.
    assert dump_progress(struct.pack("=IHHII", 36, NLMSG_ERROR, 0, SEQ, 0) + b"\0\0", SEQ) == DumpProgress(
        True, False, 0, True
    )
    # A length below the header's own size, and trailing bytes too short for a header.
    assert dump_progress(struct.pack("=IHHII", 8, RTM_NEWLINK, 0, SEQ, 0), SEQ).malformed
    assert dump_progress(nlmsg(RTM_NEWLINK, b"x" * 8, seq=SEQ) + b"\0" * 5, SEQ).malformed
    done = nlmsg(NLMSG_DONE, struct.pack("=i", 0), seq=SEQ)
    assert dump_progress(done, SEQ) == DumpProgress(True, False, 0, False)
    assert dump_progress(done, SEQ + 1) == DumpProgress(False, False, 0, False)


@st.composite
def injected(draw: st.DrawFn) -> list[tuple[bool, bytes]]:
    """Datagrams to inject: (carries the dump's sequence number, bytes), structured or raw garbage."""
    out: list[tuple[bool, bytes]] = []
    for _ in range(draw(st.integers(1, 4))):
        if draw(st.booleans()):
            m = draw(messages())
            raw = bytearray(m.data)
            if draw(st.booleans()):  # make the header lie about the length
                struct.pack_into("=I", raw, 0, draw(st.integers(0, 200)))
            if draw(st.booleans()) and len(raw) > 16:
                raw = raw[: draw(st.integers(16, len(raw)))]
            out.append((m.seq == SEQ, bytes(raw)))
        else:
            out.append((False, draw(st.binary(min_size=1, max_size=120))))
    return out


@pytest.mark.netns
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(injected())
async def test_live_dump_survives_injected_datagrams(netns: str, datagrams: list[tuple[bool, bytes]]) -> None:
    rows: list[LinkTuple] = []
    monitor = LinkMonitor(rows.extend, lambda: None, netns=netns, probe_interval_s=0)
    await monitor.start()
    sender = open_netlink_socket(NETLINK_ROUTE, 0, resolve_netns(netns))
    probe = socket.socket(fileno=socket.dup(monitor.fileno))
    try:
        await asyncio.wait_for(_until(lambda: monitor.dumps >= 1), GUARD_S)
        port = probe.getsockname()[0]
        monitor.resync()
        for ours, data in datagrams:
            if ours:  # give structured messages the running dump's sequence number
                raw = bytearray(data)
                struct.pack_into("=I", raw, 8, monitor.dump_seq)
                data = bytes(raw)
            sender.sendto(data, (port, 0))
        # Whatever the datagrams did to that dump, the reader goes on and completes a new one.
        before = monitor.dumps
        await asyncio.sleep(0)
        monitor.resync()
        await asyncio.wait_for(_until(lambda: monitor.dumps > before), GUARD_S)
        assert any(r[2] == "lo" for r in rows)
    finally:
        probe.close()
        sender.close()
        monitor.stop()
