"""rtnetlink and uevent decoders: golden captures, pyroute2 as the reference, and fuzzing.

The golden files under ``tests/data/netlink/`` were captured from real veth links in a network
namespace by ``tests/data/netlink/capture.py``; each ``.json`` holds the expected decode.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from densedev.testing.reference import LinkRow, pyroute2_links

DATA = Path(__file__).parent / "data" / "netlink"
FIXTURE_SAFE = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def _golden(name: str) -> list[tuple[bytes, list[object]]]:
    datagrams = [bytes.fromhex(line) for line in (DATA / f"{name}.hex").read_text().split()]
    expected = json.loads((DATA / f"{name}.json").read_text())
    assert len(datagrams) == len(expected) > 0
    return list(zip(datagrams, expected, strict=True))


# ------------------------------------------------------------------------------------------- goldens
@pytest.mark.parametrize("name", ["dump_veth", "events_flip_del"])
def test_golden_links(impl: ModuleType, name: str) -> None:
    for data, expected in _golden(name):
        got = impl.parse_links(data)
        assert [list(row) for row in got] == expected
        assert list(got) == pyroute2_links(data)


def test_golden_dump_content(impl: ModuleType) -> None:
    # What the capture made: four veth pairs; ens0f0 up with its peer up, ens1f0 up without carrier.
    links = {row[2]: row for data, _ in _golden("dump_veth") for row in impl.parse_links(data)}
    assert {f"ens{k}f0" for k in range(4)} <= set(links)
    ens0, ens0p, ens1 = links["ens0f0"], links["ens0f0p"], links["ens1f0"]
    assert (ens0[4], ens0[5]) == (6, 1)  # IF_OPER_UP, carrier
    assert ens0[6] == ens0p[1] and ens0p[6] == ens0[1]  # veth peers name each other in IFLA_LINK
    assert ens1[3] & 0x1 and ens1[5] == 0 and ens1[4] != 6  # IFF_UP, no carrier, not oper-up


def test_golden_events_show_the_flip_and_delete(impl: ModuleType) -> None:
    rows = [row for data, _ in _golden("events_flip_del") for row in impl.parse_links(data)]
    ens0 = [(r[4], r[5]) for r in rows if r[2] == "ens0f0"]
    assert ens0[0] == (2, 0) and ens0[-1] == (6, 1)  # DOWN without carrier, then UP with carrier
    assert [r[2] for r in rows if r[0] == 17] == ["ens3f0", "ens3f0p"]


@pytest.mark.parametrize("name", ["uevent_veth_add", "uevent_veth_remove"])
def test_golden_uevents(impl: ModuleType, name: str) -> None:
    for data, expected in _golden(name):
        action, devpath, pairs = impl.parse_uevent(data)
        assert [action, devpath, [list(p) for p in pairs]] == expected
        env = dict(pairs)
        assert env["ACTION"] == action and env["DEVPATH"] == devpath and env["SEQNUM"].isdigit()


def test_uevent_libudev_and_garbage_are_none(impl: ModuleType) -> None:
    assert impl.parse_uevent(b"libudev\0\xfe\xed\xca\xfe" + bytes(32)) is None
    assert impl.parse_uevent(b"") is None
    assert impl.parse_uevent(b"no-at-sign\0A=B\0") is None
    assert impl.parse_uevent(b"@/devices/x\0") is None  # no action
    assert impl.parse_uevent(b"add@\0") is None  # no devpath
    assert impl.parse_uevent(b"bind@/devices/pci0000:00/0000:00:03.0\0DRIVER=mlx5_core\0junk\0=x\0") == (
        "bind",
        "/devices/pci0000:00/0000:00:03.0",
        (("DRIVER", "mlx5_core"),),
    )


# ---------------------------------------------------------------------------------------- generated
def _attr(kind: int, payload: bytes) -> bytes:
    rta_len = 4 + len(payload)
    return struct.pack("=HH", rta_len, kind) + payload + b"\0" * ((4 - rta_len % 4) % 4)


def _nlmsg(mtype: int, body: bytes, flags: int = 0, seq: int = 0) -> bytes:
    # nlmsg_len excludes the trailing pad; the next message starts at NLMSG_ALIGN(nlmsg_len).
    return struct.pack("=IHHII", 16 + len(body), mtype, flags, seq, 0) + body + b"\0" * (-len(body) % 4)


_names = st.text("abcdefghijklmnopqrstuvwxyz0123456789._-", min_size=1, max_size=15)


@st.composite
def _link_message(draw: st.DrawFn) -> tuple[bytes, LinkRow | None]:
    kind = draw(st.sampled_from([16, 17, 2, 20]))  # NEWLINK, DELLINK, ERROR, NEWADDR
    if kind == 2:  # struct nlmsgerr: error, then the whole request (no NETLINK_CAP_ACK)
        request = struct.pack("=IHHII", 32, 18, 0x301, 1, 0) + struct.pack("=BBHiII", 0, 0, 0, 0, 0, 0)
        return _nlmsg(kind, struct.pack("=i", -19) + request), None
    if kind == 20:  # struct ifaddrmsg + IFA_ADDRESS: another rtnetlink family the parser must skip
        addr = draw(st.binary(min_size=4, max_size=4))
        return _nlmsg(kind, struct.pack("=BBBBI", 2, 24, 0, 0, 1) + _attr(1, addr)), None
    index = draw(st.integers(1, 2**31 - 1))
    flags = draw(st.integers(0, 2**32 - 1))
    attrs = []
    name = oper = carrier = parent = None
    if draw(st.booleans()):
        name = draw(_names)
        attrs.append(_attr(3, name.encode() + b"\0"))
    if draw(st.booleans()):
        oper = draw(st.integers(0, 6))
        attrs.append(_attr(16, bytes([oper])))
    if draw(st.booleans()):
        carrier = draw(st.integers(0, 1))
        attrs.append(_attr(33, bytes([carrier])))
    if draw(st.booleans()):
        parent = draw(st.integers(0, 2**31 - 1))
        attrs.append(_attr(5, struct.pack("=I", parent)))
    # Attributes we do not decode, as the kernel interleaves them: MTU, ADDRESS, TXQLEN, QDISC.
    attrs.append(_attr(4, struct.pack("=I", draw(st.integers(68, 9000)))))
    attrs.append(_attr(1, draw(st.binary(min_size=6, max_size=6))))
    attrs.append(_attr(13, struct.pack("=I", 1000)))
    attrs.append(_attr(6, b"noqueue\0"))
    attrs = draw(st.permutations(attrs))
    body = struct.pack("=BBHiII", 0, 0, 1, index, flags, 0) + b"".join(attrs)
    row = (
        kind,
        index,
        name or "",
        flags,
        -1 if oper is None else oper,
        -1 if carrier is None else carrier,
        -1 if parent is None else parent,
    )
    return _nlmsg(kind, body, flags=0x2), row


@st.composite
def _datagrams(draw: st.DrawFn) -> tuple[bytes, list[LinkRow]]:
    messages = draw(st.lists(_link_message(), max_size=12))
    # A multi-part dump ends with NLMSG_DONE; the kernel sends nothing after it in that datagram.
    done = _nlmsg(3, struct.pack("=i", 0)) if draw(st.booleans()) else b""
    return b"".join(m for m, _ in messages) + done, [row for _, row in messages if row is not None]


@FIXTURE_SAFE
@given(_datagrams())
def test_generated_streams_match_model_and_pyroute2(impl: ModuleType, d: tuple[bytes, list[LinkRow]]) -> None:
    data, rows = d
    assert list(impl.parse_links(data)) == rows
    assert pyroute2_links(data) == rows


@FIXTURE_SAFE
@given(_datagrams(), st.data())
def test_truncation_keeps_whole_messages_only(
    impl: ModuleType, d: tuple[bytes, list[LinkRow]], data: st.DataObject
) -> None:
    stream, rows = d
    cut = data.draw(st.integers(0, len(stream)))
    got = impl.parse_links(stream[:cut])
    assert list(got) == rows[: len(got)]


@FIXTURE_SAFE
@given(st.binary(max_size=600))
def test_garbage_never_crashes_and_implementations_agree(
    both: tuple[ModuleType, ModuleType], data: bytes
) -> None:
    fast, twin = both
    assert fast.parse_links(data) == twin.parse_links(data)
    assert fast.parse_uevent(data) == twin.parse_uevent(data)


@FIXTURE_SAFE
@given(_datagrams(), st.data())
def test_corrupted_streams_agree(
    both: tuple[ModuleType, ModuleType], d: tuple[bytes, list[LinkRow]], data: st.DataObject
) -> None:
    # Flip bytes inside valid streams, where lengths and attribute headers get damaged.
    stream = bytearray(d[0])
    for _ in range(data.draw(st.integers(1, 4))):
        if stream:
            stream[data.draw(st.integers(0, len(stream) - 1))] = data.draw(st.integers(0, 255))
    fast, twin = both
    assert fast.parse_links(bytes(stream)) == twin.parse_links(bytes(stream))


def test_bad_attribute_stops_at_that_message(impl: ModuleType) -> None:
    good = _nlmsg(16, struct.pack("=BBHiII", 0, 0, 1, 7, 1, 0) + _attr(3, b"eth0\0"))
    # rta_len claims 200 bytes inside a 40-byte message: malformed, so decoding stops there.
    bad_body = struct.pack("=BBHiII", 0, 0, 1, 8, 1, 0) + struct.pack("=HH", 200, 3) + b"eth1\0\0\0\0"
    after = _nlmsg(16, struct.pack("=BBHiII", 0, 0, 1, 9, 1, 0))
    got = impl.parse_links(good + _nlmsg(16, bad_body) + after)
    assert got == ((16, 7, "eth0", 1, -1, -1, -1),)
    assert impl.parse_links(_nlmsg(16, b"\0" * 8)) == ()  # body shorter than struct ifinfomsg
    assert impl.parse_links(struct.pack("=IHHII", 8, 16, 0, 0, 0)) == ()  # nlmsg_len below the header


@FIXTURE_SAFE
@given(
    st.sampled_from(["add", "remove", "bind", "unbind", "change", "move"]),
    st.text("abcdefghijklmnopqrstuvwxyz0123456789/:.-_", min_size=1, max_size=60),
    st.lists(
        st.tuples(
            st.text("ABCDEFGHIJKLMNOPQRSTUVWXYZ_", min_size=1, max_size=20),
            st.text(max_size=30).filter(lambda v: "\0" not in v),
        ),
        max_size=10,
    ),
)
def test_generated_uevents_round_trip(
    impl: ModuleType, action: str, devpath: str, pairs: list[tuple[str, str]]
) -> None:
    data = f"{action}@{devpath}\0".encode() + b"".join(f"{k}={v}\0".encode() for k, v in pairs)
    assert impl.parse_uevent(data) == (action, devpath, tuple(pairs))
