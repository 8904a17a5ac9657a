"""VF settings through the PF's rtnetlink: our encoder against pyroute2's, byte for byte; our decoders on
pyroute2-built and kernel-captured replies; the client on a fake kernel (timeouts, stale and oversized
replies) and on the real kernel in a network namespace, where a veth has no VFs and refuses them.

The golden answers under ``tests/data/netlink/vf_veth_*`` come from ``tests/data/netlink/capture_vf.py``.
"""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pyroute2.netlink.rtnl.ifinfmsg import ifinfmsg

from densedev.node.vfnetlink import (
    NLMSG_ERROR,
    RTEXT_FILTER_VF,
    RTM_GETLINK,
    RTM_NEWLINK,
    RTM_SETLINK,
    LinkState,
    VfNetlink,
    VfNetlinkError,
    VfSettings,
    VfState,
    decode_ack,
    decode_mtu,
    decode_vfs,
    encode_getlink,
    encode_set_mtu,
    encode_set_vf,
)

DATA = Path(__file__).parent / "data" / "netlink"
REQUEST_ACK = 0x1 | 0x4  # NLM_F_REQUEST | NLM_F_ACK


# ------------------------------------------------------------------------------ pyroute2 as reference
def _pr2_vf_attrs(vf: int, s: VfSettings) -> list[tuple[str, dict[str, Any]]]:
    attrs: list[tuple[str, dict[str, Any]]] = []
    if s.mac is not None:
        attrs.append(("IFLA_VF_MAC", {"vf": vf, "mac": s.mac}))
    if s.vlan is not None:
        attrs.append(("IFLA_VF_VLAN", {"vf": vf, "vlan": s.vlan, "qos": s.qos or 0}))
    if s.min_tx_rate is not None:
        attrs.append(("IFLA_VF_RATE", {"vf": vf, "min_tx_rate": s.min_tx_rate, "max_tx_rate": s.max_tx_rate}))
    if s.spoofchk is not None:
        attrs.append(("IFLA_VF_SPOOFCHK", {"vf": vf, "spoofchk": int(s.spoofchk)}))
    if s.link_state is not None:
        attrs.append(("IFLA_VF_LINK_STATE", {"vf": vf, "link_state": int(s.link_state)}))
    if s.trust is not None:
        attrs.append(("IFLA_VF_TRUST", {"vf": vf, "trust": int(s.trust)}))
    return attrs


def _pr2(msg_type: int, index: int, seq: int, attrs: list[Any], flags: int = REQUEST_ACK) -> bytes:
    msg = ifinfmsg()
    msg["header"]["type"] = msg_type
    msg["header"]["flags"] = flags
    msg["header"]["sequence_number"] = seq
    msg["index"] = index
    msg["attrs"] = attrs
    msg.encode()
    return bytes(msg.data)


def pr2_set_vf(index: int, vf: int, s: VfSettings, seq: int) -> bytes:
    vfinfo = ("IFLA_VF_INFO", {"attrs": _pr2_vf_attrs(vf, s)})
    return _pr2(RTM_SETLINK, index, seq, [("IFLA_VFINFO_LIST", {"attrs": [vfinfo]})])


def pr2_reply(states: list[VfState], extra: bool = True) -> bytes:
    """An RTM_NEWLINK as the kernel sends it for a PF, built by pyroute2, with what we must skip."""
    infos = []
    for st_ in states:
        vf = st_.vf
        attrs: list[tuple[str, Any]] = [
            ("IFLA_VF_MAC", {"vf": vf, "mac": st_.mac}),
            ("IFLA_VF_VLAN", {"vf": vf, "vlan": st_.vlan, "qos": st_.qos}),
        ]
        if extra:  # rtnl_fill_vfinfo() also sends these; the decoder must step over them
            attrs.append(
                (
                    "IFLA_VF_VLAN_LIST",
                    {
                        "attrs": [
                            (
                                "IFLA_VF_VLAN_INFO",
                                {"vf": vf, "vlan": st_.vlan, "qos": st_.qos, "proto": st_.vlan_proto},
                            )
                        ]
                    },
                )
            )
            attrs.append(("IFLA_VF_TX_RATE", {"vf": vf, "tx_rate": 7}))
        attrs += [
            (
                "IFLA_VF_SPOOFCHK",
                {"vf": vf, "spoofchk": 0xFFFFFFFF if st_.spoofchk is None else int(st_.spoofchk)},
            ),
            ("IFLA_VF_LINK_STATE", {"vf": vf, "link_state": st_.link_state}),
            ("IFLA_VF_RATE", {"vf": vf, "min_tx_rate": st_.min_tx_rate, "max_tx_rate": st_.max_tx_rate}),
            ("IFLA_VF_TRUST", {"vf": vf, "trust": 0xFFFFFFFF if st_.trust is None else int(st_.trust)}),
        ]
        if extra:
            attrs.append(("IFLA_VF_STATS", {"attrs": [("IFLA_VF_STATS_RX_PACKETS", 5)]}))
        infos.append(("IFLA_VF_INFO", {"attrs": attrs}))
    head: list[Any] = [("IFLA_IFNAME", "ens1f0"), ("IFLA_MTU", 9000), ("IFLA_NUM_VF", len(states))]
    return _pr2(RTM_NEWLINK, 4, 9, [*head, ("IFLA_VFINFO_LIST", {"attrs": infos})], flags=0)


def pr2_decode_vf(data: bytes) -> tuple[int, int, dict[str, dict[str, Any]]]:
    msg = ifinfmsg(data)
    msg.decode()
    vflist = msg.get_attr("IFLA_VFINFO_LIST")
    infos = vflist.get_attrs("IFLA_VF_INFO")
    assert len(infos) == 1
    return msg["header"]["type"], msg["index"], {name: dict(value) for name, value in infos[0]["attrs"]}


# ---------------------------------------------------------------------------------- encoders, exactly
EACH = [
    VfSettings(mac="02:00:5e:10:00:ff"),
    VfSettings(mac="AA:BB:CC:DD:EE:0F"),
    VfSettings(vlan=100),
    VfSettings(vlan=4095, qos=7),
    VfSettings(vlan=0, qos=0),
    VfSettings(min_tx_rate=100, max_tx_rate=10000),
    VfSettings(min_tx_rate=0, max_tx_rate=0),
    VfSettings(spoofchk=True),
    VfSettings(spoofchk=False),
    VfSettings(link_state=LinkState.AUTO),
    VfSettings(link_state=LinkState.ENABLE),
    VfSettings(link_state=LinkState.DISABLE),
    VfSettings(trust=True),
    VfSettings(trust=False),
    VfSettings("02:00:00:00:00:01", 10, 3, 1, 2, False, LinkState.DISABLE, True),
    VfSettings(mac="02:00:00:00:00:02", trust=True),
    VfSettings(vlan=7, spoofchk=True, link_state=LinkState.ENABLE),
]


@pytest.mark.parametrize("s", EACH, ids=[str(i) for i in range(len(EACH))])
@pytest.mark.parametrize(("index", "vf", "seq"), [(3, 0, 1), (0x7FFFFFFF, 0x7FFFFFFE, 0xFFFFFFFF)])
def test_set_vf_matches_pyroute2(s: VfSettings, index: int, vf: int, seq: int) -> None:
    assert encode_set_vf(index, vf, s, seq) == pr2_set_vf(index, vf, s, seq)


@pytest.mark.parametrize(("index", "mtu", "seq"), [(1, 1500, 0), (42, 9000, 7), (5, 0xFFFFFFFF, 0xFFFFFFFF)])
def test_set_mtu_matches_pyroute2(index: int, mtu: int, seq: int) -> None:
    assert encode_set_mtu(index, mtu, seq) == _pr2(RTM_SETLINK, index, seq, [("IFLA_MTU", mtu)])


@pytest.mark.parametrize("seq", [0, 1, 0xFFFFFFFF])
def test_getlink_matches_pyroute2(seq: int) -> None:
    expected = _pr2(RTM_GETLINK, 12, seq, [("IFLA_EXT_MASK", RTEXT_FILTER_VF)])
    assert encode_getlink(12, seq) == expected
    assert encode_getlink(12, seq, 0) == _pr2(RTM_GETLINK, 12, seq, [])


def test_set_vf_layout_as_the_reference_states() -> None:
    # Independent of pyroute2: nlmsghdr, ifinfomsg, IFLA_VFINFO_LIST(22) > IFLA_VF_INFO(1) > IFLA_VF_TRUST(9).
    data = encode_set_vf(6, 2, VfSettings(trust=True), 77)
    assert struct.unpack_from("=IHHII", data) == (len(data), 19, REQUEST_ACK, 77, 0)
    assert struct.unpack_from("=BxHiII", data, 16) == (0, 0, 6, 0, 0)
    assert struct.unpack_from("=HHHHHHII", data, 32) == (20, 22, 16, 1, 12, 9, 2, 1)
    assert len(data) == 52


MAC_VLAN = VfSettings(mac="02:00:00:00:00:01", vlan=1)


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda: encode_set_vf(1, 0, VfSettings(), 1), "no VF setting"),
        (lambda: encode_set_vf(1, 0, VfSettings(vlan=4096), 1), "vlan 4096"),
        (lambda: encode_set_vf(1, 0, VfSettings(vlan=-1), 1), "vlan -1"),
        (lambda: encode_set_vf(1, 0, VfSettings(vlan=1, qos=8), 1), "qos 8"),
        (lambda: encode_set_vf(1, 0, VfSettings(qos=1), 1), "qos needs vlan"),
        (lambda: encode_set_vf(1, 0, VfSettings(vlan=True), 1), "vlan True"),
        (lambda: encode_set_vf(1, 0, VfSettings(max_tx_rate=5), 1), "go together"),
        (lambda: encode_set_vf(1, 0, VfSettings(min_tx_rate=0, max_tx_rate=1 << 32), 1), "max_tx_rate"),
        (lambda: encode_set_vf(1, 0, VfSettings(mac="02:00:00:00:00"), 1), "mac"),
        (lambda: encode_set_vf(1, 0, VfSettings(mac="02:00:00:00:00:0g"), 1), "mac"),
        (lambda: encode_set_vf(1, 0, VfSettings(mac="x" * 10_000), 1), "more characters"),
        (lambda: encode_set_vf(1, 0, VfSettings(link_state=3), 1), "LinkState"),  # type: ignore[arg-type]
        (lambda: encode_set_vf(1, 0x7FFFFFFF, MAC_VLAN, 1), "vf 2147483647"),
        (lambda: encode_set_vf(0, 0, MAC_VLAN, 1), "ifindex 0"),
        (lambda: encode_set_vf(1, 0, MAC_VLAN, 1 << 32), "sequence number"),
        (lambda: encode_set_mtu(1, -1, 1), "mtu -1"),
    ],
)
def test_refused_before_encoding(call: Any, words: str) -> None:
    with pytest.raises(ValueError, match=words) as info:
        call()
    assert "\n" not in str(info.value) and len(str(info.value)) < 200


# ------------------------------------------------------------------------------------------- decoders
STATES = [
    VfState(0, "02:00:00:00:00:01", 100, 3, 10, 1000, True, LinkState.ENABLE, False),
    VfState(1, "00:00:00:00:00:00", 0, 0, 0, 0, None, LinkState.AUTO, None),
    VfState(63, "fe:dc:ba:98:76:54", 4095, 7, 0, 0, False, LinkState.DISABLE, True),
]


@pytest.mark.parametrize("extra", [True, False])
def test_decode_pyroute2_reply(extra: bool) -> None:
    data = pr2_reply(STATES, extra)
    assert decode_vfs(data) == tuple(STATES)
    assert decode_mtu(data) == 9000


def test_restore_settings_put_back_every_value() -> None:
    # What a restore sends is exactly what was read, field by field; an unreported tri-state is not sent.
    sent = pr2_decode_vf(encode_set_vf(4, 0, STATES[0].settings(), 1))[2]
    assert sent == {
        "IFLA_VF_MAC": {"vf": 0, "mac": "02:00:00:00:00:01"},
        "IFLA_VF_VLAN": {"vf": 0, "vlan": 100, "qos": 3},
        "IFLA_VF_RATE": {"vf": 0, "min_tx_rate": 10, "max_tx_rate": 1000},
        "IFLA_VF_SPOOFCHK": {"vf": 0, "spoofchk": 1},
        "IFLA_VF_LINK_STATE": {"vf": 0, "link_state": 1},
        "IFLA_VF_TRUST": {"vf": 0, "trust": 0},
    }
    assert set(pr2_decode_vf(encode_set_vf(4, 1, STATES[1].settings(), 1))[2]) == {
        "IFLA_VF_MAC",
        "IFLA_VF_VLAN",
        "IFLA_VF_RATE",
        "IFLA_VF_LINK_STATE",
    }


def test_8021ad_vlan_is_read_and_not_restorable() -> None:
    # IFLA_VF_VLAN always sets 802.1Q: a VF on a QinQ VLAN cannot be put back by it, so reading its
    # restore settings refuses — before the caller has changed anything.
    qinq = STATES[0]._replace(vlan_proto=0x88A8)
    (got,) = decode_vfs(pr2_reply([qinq]))
    assert got == qinq
    with pytest.raises(ValueError, match="0x88a8"):
        got.settings()
    assert STATES[1]._replace(vlan_proto=0x88A8).settings().vlan == 0  # no VLAN: nothing to lose


def test_decode_link_without_vfs() -> None:
    assert decode_vfs(_pr2(RTM_NEWLINK, 3, 1, [("IFLA_IFNAME", "veth0"), ("IFLA_MTU", 1500)], 0)) == ()


@pytest.mark.parametrize("cut", [1, 4, 20, 40, 100, 200])
def test_decode_truncated_reply_is_one_error(cut: int) -> None:
    data = bytearray(pr2_reply(STATES[:1]))
    whole = len(data)
    # A reply whose header says more than it holds, or whose attribute runs past its end, is refused.
    struct.pack_into("=I", data, 0, whole + 8)
    with pytest.raises(VfNetlinkError) as info:
        decode_vfs(bytes(data[: whole - cut]))
    assert info.value.errno == 74 and "\n" not in info.value.reason  # EBADMSG


def test_decode_vf_info_without_mac_is_refused() -> None:
    data = _pr2(
        RTM_NEWLINK,
        3,
        1,
        [
            (
                "IFLA_VFINFO_LIST",
                {"attrs": [("IFLA_VF_INFO", {"attrs": [("IFLA_VF_TRUST", {"vf": 0, "trust": 1})]})]},
            )
        ],
        0,
    )
    with pytest.raises(VfNetlinkError, match="IFLA_VF_MAC"):
        decode_vfs(data)


def _golden() -> list[tuple[bytes, dict[str, Any]]]:
    datagrams = [bytes.fromhex(line) for line in (DATA / "vf_veth_answers.hex").read_text().split()]
    expected = json.loads((DATA / "vf_veth_answers.json").read_text())
    assert len(datagrams) == len(expected) > 0
    return list(zip(datagrams, expected, strict=True))


def test_golden_kernel_answers() -> None:
    errors = 0
    for data, expected in _golden():
        assert int.from_bytes(data[4:6], "little") == expected["type"]
        if expected["type"] == NLMSG_ERROR:
            assert decode_ack(data) == (expected["errno"], expected["reason"])
            errors += expected["errno"] != 0
        else:
            assert decode_vfs(data) == ()  # a veth lists no VFs, even when asked for them
            assert decode_mtu(data) == 1500
    assert errors == 3
    # The extack text (NLM_F_ACK_TLVS) made it into the reason of the MTU refusal.
    assert any("greater than device maximum" in e["reason"] for _, e in _golden() if "reason" in e)


def _error_msg(err: int, flags: int, tail: bytes) -> bytes:
    body = struct.pack("=i", -err) + struct.pack("=IHHII", 16, RTM_SETLINK, REQUEST_ACK, 5, 0) + tail
    return struct.pack("=IHHII", 16 + len(body), NLMSG_ERROR, flags, 5, 0) + body


def test_ack_reason_is_one_bounded_line() -> None:
    said = ("bad\nthing\x1b[2J" + "x" * 5000).encode() + b"\0"
    tlv = struct.pack("=HH", 4 + len(said), 1) + said + b"\0" * (-len(said) & 3)
    err, reason = decode_ack(_error_msg(22, 0x300, tlv))  # NLM_F_CAPPED | NLM_F_ACK_TLVS
    assert err == 22 and reason.startswith("EINVAL (Invalid argument): bad\\nthing\\x1b[2J")
    assert "\n" not in reason and len(reason) < 250
    # A garbled TLV keeps the errno and drops the explanation.
    assert decode_ack(_error_msg(22, 0x300, b"\xff\xff\x01\x00")) == (22, "EINVAL (Invalid argument)")
    assert decode_ack(_error_msg(1 << 30, 0, b""))[1].startswith("E? ")
    with pytest.raises(VfNetlinkError):
        decode_ack(b"\x00" * 18)


# ------------------------------------------------------------------------------------------- property
macs = st.binary(min_size=6, max_size=6).map(lambda b: ":".join(f"{x:02x}" for x in b))
u32 = st.integers(0, 0xFFFFFFFF)


@st.composite
def vf_settings(draw: st.DrawFn) -> VfSettings:
    vlan = draw(st.none() | st.integers(0, 4095))
    rate = draw(st.none() | st.tuples(u32, u32))
    s = VfSettings(
        mac=draw(st.none() | macs),
        vlan=vlan,
        qos=None if vlan is None else draw(st.none() | st.integers(0, 7)),
        min_tx_rate=None if rate is None else rate[0],
        max_tx_rate=None if rate is None else rate[1],
        spoofchk=draw(st.none() | st.booleans()),
        link_state=draw(st.none() | st.sampled_from(LinkState)),
        trust=draw(st.none() | st.booleans()),
    )
    return s if any(v is not None for v in s) else s._replace(trust=True)


@settings(max_examples=300, deadline=None)
@given(s=vf_settings(), index=st.integers(1, 0x7FFFFFFF), vf=st.integers(0, 0x7FFFFFFE), seq=u32)
def test_encode_round_trips_through_pyroute2(s: VfSettings, index: int, vf: int, seq: int) -> None:
    data = encode_set_vf(index, vf, s, seq)
    assert data == pr2_set_vf(index, vf, s, seq)
    msg_type, got_index, attrs = pr2_decode_vf(data)
    assert (msg_type, got_index) == (RTM_SETLINK, index)
    assert dict(attrs) == dict(_pr2_vf_attrs(vf, s)) | (
        {"IFLA_VF_MAC": {"vf": vf, "mac": s.mac.lower()}} if s.mac is not None else {}
    )


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            macs,
            st.integers(0, 4095),
            st.integers(0, 7),
            u32,
            u32,
            st.none() | st.booleans(),
            st.sampled_from(LinkState),
            st.none() | st.booleans(),
            st.sampled_from([0x8100, 0x88A8]),
        ),
        max_size=8,
    )
)
def test_decode_round_trips_pyroute2_replies(rows: list[tuple[Any, ...]]) -> None:
    states = [VfState(i, *row) for i, row in enumerate(rows)]
    assert decode_vfs(pr2_reply(states)) == tuple(states)


@settings(max_examples=500, deadline=None)
@given(data=st.data())
def test_decoders_refuse_garbage_with_one_error(data: st.DataObject) -> None:
    # Hostile or corrupted bytes: a reply that decodes, or VfNetlinkError — never another exception.
    base = bytearray(pr2_reply(STATES[:2]))
    for _ in range(data.draw(st.integers(1, 8))):
        base[data.draw(st.integers(0, len(base) - 1))] = data.draw(st.integers(0, 255))
    raw = data.draw(st.sampled_from([bytes(base), bytes(base[: data.draw(st.integers(0, len(base)))])]))
    for decode in (decode_vfs, decode_mtu, decode_ack):
        try:
            decode(raw)
        except VfNetlinkError as exc:
            assert "\n" not in exc.reason and len(exc.reason) < 200


# ------------------------------------------------------------------------------ client on a fake kernel
class FakeKernel:
    """The far end of a datagram socketpair standing in for the kernel: answers with what a test scripts."""

    def __init__(self) -> None:
        self.ours, self.theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.requests: list[bytes] = []
        self.script: list[Any] = []  # per request: a function seq -> list of datagrams
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                request = self.theirs.recv(1 << 16)
            except OSError:
                return
            if not request:
                return
            self.requests.append(request)
            seq = struct.unpack_from("=I", request, 8)[0]
            try:
                for datagram in self.script.pop(0)(seq) if self.script else []:
                    self.theirs.send(datagram)
            except OSError:  # the test already has its answer and closed us
                return

    def close(self) -> None:
        self.theirs.shutdown(socket.SHUT_RDWR)
        self.theirs.close()
        self._thread.join(5)
        self.ours.close()


def ack(seq: int, err: int = 0) -> bytes:
    return struct.pack("=IHHIIi", 20, NLMSG_ERROR, 0, seq, 0, -err) + struct.pack("=IHHII", 16, 0, 0, seq, 0)


def with_seq(data: bytes, seq: int) -> bytes:
    return data[:8] + struct.pack("=I", seq) + data[12:]


@pytest.fixture
def fake() -> Iterator[FakeKernel]:
    k = FakeKernel()
    yield k
    k.close()


def client(fake: FakeKernel, **kw: Any) -> VfNetlink:
    return VfNetlink(sock=fake.ours, timeout_s=kw.pop("timeout_s", 5.0), **kw)


def test_client_reads_past_stale_answers(fake: FakeKernel) -> None:
    # An answer to an earlier request that timed out arrives first; ours follows, reply then ACK apart.
    reply = pr2_reply(STATES)
    fake.script.append(
        lambda seq: [
            ack(seq - 1, 95),
            with_seq(reply, seq - 1) + ack(seq - 1),
            with_seq(reply, seq),
            ack(seq),
        ]
    )
    c = client(fake)
    assert c.read_vfs(4) == tuple(STATES)
    assert fake.requests[0] == encode_getlink(4, struct.unpack_from("=I", fake.requests[0], 8)[0])


def test_client_refusal_is_one_error(fake: FakeKernel) -> None:
    fake.script.append(lambda seq: [ack(seq, 95)])
    with pytest.raises(VfNetlinkError) as info:
        client(fake).set_vf(3, 1, VfSettings(trust=True))
    assert (
        info.value.errno == 95 and info.value.reason == "set VF 1 of 3: EOPNOTSUPP (Operation not supported)"
    )


def test_client_times_out(fake: FakeKernel) -> None:
    fake.script.append(lambda seq: [ack(seq + 1)])  # only someone else's answer
    with pytest.raises(VfNetlinkError, match=r"no answer from the kernel within 0.2 s") as info:
        client(fake, timeout_s=0.2).set_mtu(3, 1500)
    assert info.value.errno == 110  # ETIMEDOUT


def test_client_refuses_oversized_reply(fake: FakeKernel) -> None:
    fake.script.append(lambda seq: [with_seq(pr2_reply(STATES), seq), ack(seq)])
    with pytest.raises(VfNetlinkError, match="exceeds 256") as info:
        client(fake, max_reply=256).read_vfs(4)
    assert info.value.errno == 90  # EMSGSIZE


def test_client_refuses_malformed_framing(fake: FakeKernel) -> None:
    fake.script.append(lambda seq: [struct.pack("=IHHII", 4096, NLMSG_ERROR, 0, seq, 0)])
    with pytest.raises(VfNetlinkError, match="malformed") as info:
        client(fake).set_mtu(3, 1500)
    assert info.value.errno == 74


async def test_client_runs_on_its_worker_pool(fake: FakeKernel) -> None:
    # The way the event loop calls it: on the NETLINK pool's threads, never on the loop's.
    from densedev import workers
    from densedev.workers import Work

    fake.script.append(lambda seq: [with_seq(pr2_reply(STATES), seq), ack(seq)])
    c = client(fake)
    assert await workers.run(Work.NETLINK, c.read_vfs, 4) == tuple(STATES)
    assert workers.pool(Work.NETLINK).size == workers.SIZES[Work.NETLINK]


def test_client_missing_namespace_is_the_same_error(tmp_path: Path) -> None:
    with pytest.raises(VfNetlinkError, match=r"open rtnetlink in namespace gone: ENOENT") as info:
        VfNetlink("gone", netns_dir=tmp_path)
    assert info.value.errno == 2 and "\n" not in info.value.reason  # ENOENT


def test_client_sends_nothing_for_a_bad_value(fake: FakeKernel) -> None:
    with pytest.raises(ValueError):
        client(fake, timeout_s=0.2).set_vf(3, 0, VfSettings(vlan=5000))
    fake.script.append(lambda seq: [ack(seq)])
    client(fake).set_mtu(3, 1400)
    assert len(fake.requests) == 1 and fake.requests[0][16 + 16 + 4 :] == struct.pack("=I", 1400)


# ------------------------------------------------------------------------------- the real kernel
def _show(ns: str, name: str) -> Any:
    out = subprocess.run(
        ["ip", "-n", ns, "-d", "-s", "-j", "link", "show", "dev", name],
        check=True,
        capture_output=True,
        text=True,
    )
    link = json.loads(out.stdout)[0]
    link.pop("stats64", None)  # counters may tick; every setting stays
    return link


@pytest.fixture
def veth(netns: str) -> tuple[str, int]:
    """A veth pair pf0/pf0p in a fresh namespace (the ``netns`` fixture skips without root): no VFs."""
    from densedev.testing.netns import ifindexes, ip

    ip(netns, "link", "add", "pf0", "type", "veth", "peer", "name", "pf0p")
    return netns, ifindexes(netns)["pf0"]


@pytest.mark.parametrize("s", EACH, ids=[str(i) for i in range(len(EACH))])
@pytest.mark.netns
def test_kernel_refuses_vf_settings_on_veth_and_changes_nothing(veth: tuple[str, int], s: VfSettings) -> None:
    ns, index = veth
    before = _show(ns, "pf0")
    with VfNetlink(ns) as c:
        with pytest.raises(VfNetlinkError) as info:
            c.set_vf(index, 0, s)
        assert c.read_vfs(index) == ()
    assert info.value.errno != 0 and info.value.reason.startswith(f"set VF 0 of {index}: E")
    assert "\n" not in info.value.reason
    assert _show(ns, "pf0") == before


@pytest.mark.netns
def test_kernel_sets_and_restores_mtu(veth: tuple[str, int]) -> None:
    ns, index = veth
    before = _show(ns, "pf0")
    with VfNetlink(ns) as c:
        old = c.read_mtu(index)
        assert old == before["mtu"]
        c.set_mtu(index, 9000)
        assert c.read_mtu(index) == 9000 == _show(ns, "pf0")["mtu"]
        with pytest.raises(VfNetlinkError) as info:  # above veth's max_mtu
            c.set_mtu(index, before["max_mtu"] + 1)
        assert info.value.errno == 22 and c.read_mtu(index) == 9000
        c.set_mtu(index, old)
    assert _show(ns, "pf0") == before


@pytest.mark.netns
def test_kernel_unknown_link(veth: tuple[str, int]) -> None:
    ns, index = veth
    with VfNetlink(ns) as c:
        for call in (lambda: c.read_vfs(index + 1000), lambda: c.set_mtu(index + 1000, 1500)):
            with pytest.raises(VfNetlinkError) as info:
                call()
            assert info.value.errno == 19  # ENODEV


@pytest.mark.netns
def test_kernel_answer_only_from_the_kernel(veth: tuple[str, int]) -> None:
    # Another process (here a second netlink socket) may write to our port: its forged refusal, queued
    # ahead of the kernel's answer with our next sequence number, must not be taken for the answer.
    from densedev.node.events import NETLINK_ROUTE, open_netlink_socket, resolve_netns

    ns, index = veth
    with VfNetlink(ns) as c:
        port = c._sock.getsockname()[0]
        forger = open_netlink_socket(NETLINK_ROUTE, 0, resolve_netns(ns))
        try:
            forger.sendto(ack(c._seq % 0xFFFFFFFF + 1, 1), (port, 0))  # EPERM
            c.set_mtu(index, 1400)
            assert c.read_mtu(index) == 1400
        finally:
            forger.close()
