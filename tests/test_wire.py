"""Wire encoding: the cached Device/ListAndWatchResponse bytes equal protobuf's, under both implementations.

Proof of field numbers and types does not rest on our own stubs alone: messages are also decoded with a
descriptor built here from the public field table, and compared with bytes written out by hand.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from helpers.devices import dev
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from densedev._proto import api_pb2
from densedev.health.tracker import HealthTracker
from densedev.kubelet.wire import KUBELET_MAX_MESSAGE, ListEncoder
from densedev.model import Device, Pool, PoolConfig, PoolMember, Role

F = descriptor_pb2.FieldDescriptorProto


def _independent_classes() -> dict[str, Any]:
    """Build v1beta1's Device messages from the public table in a private pool (not from our .proto)."""
    proto = descriptor_pb2.FileDescriptorProto(
        name="independent_v1beta1.proto", package="indep", syntax="proto3"
    )

    def message(name: str, *fields: tuple[str, int, int, int, str]) -> None:
        msg = proto.message_type.add(name=name)
        for field_name, number, kind, label, type_name in fields:
            field = msg.field.add(name=field_name, number=number, type=kind, label=label)
            if type_name:
                field.type_name = type_name

    opt, rep = F.LABEL_OPTIONAL, F.LABEL_REPEATED
    message("NUMANode", ("ID", 1, F.TYPE_INT64, opt, ""))
    message("TopologyInfo", ("nodes", 1, F.TYPE_MESSAGE, rep, ".indep.NUMANode"))
    message(
        "Device",
        ("ID", 1, F.TYPE_STRING, opt, ""),
        ("health", 2, F.TYPE_STRING, opt, ""),
        ("topology", 3, F.TYPE_MESSAGE, opt, ".indep.TopologyInfo"),
    )
    message("ListAndWatchResponse", ("devices", 1, F.TYPE_MESSAGE, rep, ".indep.Device"))
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return {
        name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"indep.{name}"))
        for name in ("Device", "ListAndWatchResponse")
    }


INDEPENDENT = _independent_classes()


def _ordinary(device_id: str, healthy: bool, numa: int) -> api_pb2.Device:
    device = api_pb2.Device(ID=device_id, health="Healthy" if healthy else "Unhealthy")
    if numa >= 0:
        device.topology.nodes.add(ID=numa)
    return device


def test_encode_device_matches_hand_built_bytes(impl: ModuleType) -> None:
    # Device{ID:"0000:3b:00.2", health:"Healthy", topology:{nodes:[{ID:1}]}} written field by field:
    # 0x0a len "0000:3b:00.2" | 0x12 len "Healthy" | 0x1a len (0x0a len (0x08 0x01))
    expected = b"\x0a\x0c0000:3b:00.2" + b"\x12\x07Healthy" + b"\x1a\x04\x0a\x02\x08\x01"
    assert impl.encode_device(b"0000:3b:00.2", True, 1) == expected
    # NUMA node 0: proto3 omits the zero ID, leaving an empty NUMANode, which still says "node 0".
    assert impl.encode_device(b"a", False, 0) == b"\x0a\x01a\x12\x09Unhealthy\x1a\x02\x0a\x00"
    # Unknown NUMA node (the kernel's -1): no topology at all.
    assert impl.encode_device(b"a", True, -1) == b"\x0a\x01a\x12\x07Healthy"
    # Multi-byte varints: a 300-byte ID and NUMA node 300.
    long_id = b"x" * 300
    assert impl.encode_device(long_id, True, 300) == (
        b"\x0a\xac\x02" + long_id + b"\x12\x07Healthy" + b"\x1a\x05\x0a\x03\x08\xac\x02"
    )


def test_encode_list_matches_hand_built_bytes(impl: ModuleType) -> None:
    parts = [b"\x0a\x01a\x12\x07Healthy", b"", b"y" * 200]
    assert impl.encode_list(parts) == (b"\x0a\x0c" + parts[0] + b"\x0a\x00" + b"\x0a\xc8\x01" + parts[2])
    assert impl.encode_list([]) == b""


def test_encode_rejects_wrong_types(impl: ModuleType) -> None:
    with pytest.raises(TypeError):
        impl.encode_device("0000:3b:00.2", True, 0)
    with pytest.raises(TypeError, match="part 1 is str"):
        impl.encode_list([b"ok", "not bytes"])


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    devices=st.lists(
        st.tuples(st.text(max_size=40), st.booleans(), st.integers(min_value=-3, max_value=2**40)),
        max_size=30,
    )
)
def test_generated_lists_agree_with_protobuf(impl: ModuleType, devices: list[tuple[str, bool, int]]) -> None:
    ordinary = api_pb2.ListAndWatchResponse(devices=[_ordinary(*d) for d in devices]).SerializeToString()
    parts = [impl.encode_device(i.encode(), h, n) for i, h, n in devices]
    message = impl.encode_list(parts)
    assert message == ordinary
    decoded = INDEPENDENT["ListAndWatchResponse"].FromString(message)
    assert [(d.ID, d.health, [n.ID for n in d.topology.nodes]) for d in decoded.devices] == [
        (i, "Healthy" if h else "Unhealthy", [n] if n >= 0 else []) for i, h, n in devices
    ]


def test_extension_and_twin_agree(both: tuple[ModuleType, ModuleType]) -> None:
    fast, twin = both
    parts = []
    for index in range(2000):
        args = (
            f"0000:{index >> 8:02x}:{index & 0xFF:02x}.{index % 8}".encode(),
            index % 3 == 0,
            index % 5 - 1,
        )
        assert fast.encode_device(*args) == twin.encode_device(*args)
        parts.append(twin.encode_device(*args))
    assert fast.encode_list(parts) == twin.encode_list(parts)


def _ids(count: int) -> list[str]:
    return [f"0000:{(i >> 8) + 0x10:02x}:{(i >> 3) & 0x1F:02x}.{i & 7}" for i in range(count)]


def _expected(ids: list[str], numa: list[int], healthy: list[bool]) -> bytes:
    return api_pb2.ListAndWatchResponse(
        devices=[_ordinary(i, h, n) for i, h, n in zip(ids, healthy, numa, strict=True)]
    ).SerializeToString()


def test_list_encoder_follows_health_changes() -> None:
    ids = _ids(1000)
    numa = [i % 2 for i in range(1000)]
    encoder = ListEncoder(ids, numa)
    healthy = [True] * 1000
    assert encoder.encode(healthy) == _expected(ids, numa, healthy)
    for index in (0, 7, 8, 999, 500):
        healthy[index] = False
    assert encoder.encode(healthy, changed=[0, 7, 8, 999, 500]) == _expected(ids, numa, healthy)
    healthy[7] = True
    assert encoder.encode(healthy) == _expected(ids, numa, healthy)  # changed=None: re-encodes all
    decoded = api_pb2.ListAndWatchResponse.FromString(encoder.encode(healthy))
    assert [d.health for d in decoded.devices].count("Unhealthy") == 4
    assert encoder.truncated == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.booleans(), min_size=40, max_size=40), min_size=1, max_size=6))
def test_list_encoder_generated_sequences(states: list[list[bool]]) -> None:
    ids = _ids(40)
    numa = [i % 3 - 1 for i in range(40)]
    encoder = ListEncoder(ids, numa)
    previous: list[bool] | None = None
    for state in states:
        changed = None if previous is None else [i for i in range(40) if state[i] != previous[i]]
        assert encoder.encode(state, changed) == _expected(ids, numa, state)
        previous = state


def test_list_encoder_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="3 ids but 2 NUMA"):
        ListEncoder(_ids(3), [0, 0])
    encoder = ListEncoder(_ids(20), [0] * 20)
    with pytest.raises(ValueError, match="19 health values for 20"):
        encoder.encode([True] * 19)
    with pytest.raises(IndexError, match="changed index 20"):
        encoder.encode([True] * 20, changed=[20])


def test_list_encoder_truncates_to_a_valid_list_over_the_limit(caplog: pytest.LogCaptureFixture) -> None:
    ids = _ids(100)
    numa = [0] * 100
    whole = _expected(ids, numa, [True] * 100)
    limit = len(whole) // 2
    encoder = ListEncoder(ids, numa, limit=limit, name="example.com/vf")
    with caplog.at_level(logging.ERROR, logger="densedev.kubelet.wire"):
        message = encoder.encode([True] * 100)
    assert len(message) <= limit
    decoded = api_pb2.ListAndWatchResponse.FromString(message)
    kept = len(decoded.devices)
    assert 0 < kept < 100 and encoder.truncated == 100 - kept
    assert message == _expected(ids[:kept], numa[:kept], [True] * kept)
    # The longest prefix that fits: one more device would not.
    assert len(_expected(ids[: kept + 1], numa[: kept + 1], [True] * (kept + 1))) > limit
    [record] = caplog.records
    assert "example.com/vf" in record.message and str(len(whole)) in record.message
    assert f"leaving out {100 - kept}" in record.message


def test_kubelet_limit_is_four_mebibytes() -> None:
    assert KUBELET_MAX_MESSAGE == 4 * 1024 * 1024
    # 16,384 devices with PCI IDs and topology fit with a wide margin.
    encoder = ListEncoder(_ids(16384), [1] * 16384)
    assert len(encoder.encode([True] * 16384)) < KUBELET_MAX_MESSAGE // 4
    assert encoder.truncated == 0


# -- fed by the health tracker, as the daemon feeds it ------------------------------------------------


def _device(address: str, role: Role, pf_netdev: str = "", netdevs: tuple[str, ...] = ()) -> Device:
    """An Intel E810 function linked to no PF address: the tracker follows its netdevs and PF netdev."""
    return dev(
        address, role, vendor="8086", device="1889", subsystem_vendor="8086", driver="iavf",
        numa_node=address.endswith("1") - 1, pf="", vf_index=-1, pf_netdev=pf_netdev, netdevs=netdevs,
        pcie_root="pci0000:00",
    )  # fmt: skip


_PFS = ("p0", "p1", "p2")
_TRACKER_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("link"), st.sampled_from([*_PFS, "v0", "v5", "v9"]), st.booleans()),
        st.tuples(st.just("tick"), st.sampled_from([0.0, 0.5, 1.0])),
        st.tuples(st.just("rescan"), st.integers(6, 12)),  # the node now has this many VFs
        st.tuples(st.just("collect")),
    ),
    max_size=30,
)


@settings(max_examples=150, deadline=None)
@given(_TRACKER_OPS)
def test_encoder_fed_by_the_tracker_lists_what_the_tracker_holds(ops: list[tuple[Any, ...]]) -> None:
    # The encoder keeps no health: it re-encodes only the members the tracker says changed.  Through
    # links, hold-downs and rescans that grow and shrink the pools, every message the daemon's path
    # builds (flush: the update; membership change: a new encoder, the whole list) equals protobuf's
    # of the tracker's advertised health.
    now = [0.0]
    pfs = [_device(f"0000:0{k + 1}:00.0", Role.PF, netdevs=(name,)) for k, name in enumerate(_PFS)]

    def table(vfs: int) -> tuple[list[Device], list[Pool]]:
        devices = pfs + [
            _device(f"0000:0{k % 3 + 1}:01.{k // 3}", Role.VF, _PFS[k % 3], (f"v{k}",)) for k in range(vfs)
        ]
        vf_members = [d for d in devices if d.role == Role.VF]
        pools = [
            Pool(PoolConfig("vfs", "example.com"), tuple(PoolMember(d.id, d) for d in vf_members)),
            Pool(PoolConfig("even", "example.com"), tuple(PoolMember(d.id, d) for d in vf_members[::2])),
            Pool(
                PoolConfig("pfs", "example.com", exclude_topology=True),
                tuple(PoolMember(d.id, d) for d in pfs),
            ),
        ]
        return devices, pools

    def encoder_of(p: Pool) -> tuple[ListEncoder, list[str], list[int]]:
        ids = [m.id for m in p.members]
        numa = [-1 if p.config.exclude_topology else m.device.numa_node for m in p.members]
        return ListEncoder(ids, numa), ids, numa

    devices, pools = table(9)
    tracker = HealthTracker(devices, pools, clock=lambda: now[0])
    encoders = {p.config.full_name: encoder_of(p) for p in pools}
    sent: dict[str, bytes] = {}
    for upd in tracker.collect().values():
        sent[upd.pool] = encoders[upd.pool][0].encode(upd.healthy, None)
    for op in [*ops, ("collect",)]:
        if op[0] == "link":
            tracker.set_links([(op[1], op[2])])
        elif op[0] == "tick":
            now[0] += op[1]
        elif op[0] == "rescan":
            devices, new_pools = table(op[1])
            tracker.replace(devices, new_pools)
            for old, p in zip(pools, new_pools, strict=True):
                if old.members != p.members:
                    name = p.config.full_name
                    encoders[name] = encoder_of(p)
                    sent[name] = encoders[name][0].encode(tracker.healthy(name), None)
            pools = new_pools
        else:
            for upd in tracker.collect().values():
                sent[upd.pool] = encoders[upd.pool][0].encode(upd.healthy, upd.changed)
            for name, (_, ids, numa) in encoders.items():
                assert sent[name] == _expected(ids, numa, list(tracker.healthy(name)))


def test_the_encoder_keeps_the_pools_id_strings_not_a_bytes_copy() -> None:
    # 54 bytes a device (0.8 MiB at 16,384) went to a bytes copy of every ID; a changed member's ID is
    # encoded again instead, and the message is the same.
    ids = tuple(f"0000:03:{i >> 3:02x}.{i & 7}" for i in range(16))
    encoder = ListEncoder(ids, [0] * 16)
    assert encoder._ids[5] is ids[5]
    first = encoder.encode([True] * 16)
    health = [True] * 16
    health[5] = False
    again = ListEncoder(ids, [0] * 16)
    assert encoder.encode(health, [5]) == again.encode(health) != first
