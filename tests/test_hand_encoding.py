"""The messages encoded or decoded by hand so a start never loads protobuf, against the generated classes.

``wire.encode_register_request`` and ``wire.encode_options`` must give exactly the bytes
``SerializeToString()`` gives (the kubelet parses them with the real classes), and
``node.holdings.decode_held`` must read what the real classes write, and agree with them on anything both
accept.  Each direction is checked on messages hypothesis builds.
"""

from __future__ import annotations

import threading
from pathlib import Path

import grpc
import pytest
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from densedev._proto import api_pb2
from densedev._proto import podresources_pb2 as pr
from densedev.kubelet.wire import encode_options, encode_register_request
from densedev.node.holdings import (
    MAX_RECEIVE,
    ClaimUse,
    PodHoldings,
    PodResourcesClient,
    SourceUnavailable,
    decode_held,
    decode_pod_resources,
)
from densedev.protowire import length_delimited

text = st.text(max_size=300)  # past 127 bytes the lengths take two varint bytes
flags = st.booleans()


@pytest.mark.parametrize("pre_start", [False, True])
@pytest.mark.parametrize("preferred", [False, True])
def test_options_are_the_bytes_protobuf_writes(pre_start: bool, preferred: bool) -> None:
    real = api_pb2.DevicePluginOptions(
        pre_start_required=pre_start, get_preferred_allocation_available=preferred
    )
    assert encode_options(pre_start, preferred) == real.SerializeToString()
    back = api_pb2.DevicePluginOptions.FromString(encode_options(pre_start, preferred))
    assert (back.pre_start_required, back.get_preferred_allocation_available) == (pre_start, preferred)


@hypothesis_settings(max_examples=300, deadline=None)
@given(text, text, text, flags, flags)
def test_register_request_is_the_bytes_protobuf_writes(
    version: str, endpoint: str, resource: str, pre_start: bool, preferred: bool
) -> None:
    real = api_pb2.RegisterRequest(
        version=version,
        endpoint=endpoint,
        resource_name=resource,
        options=api_pb2.DevicePluginOptions(
            pre_start_required=pre_start, get_preferred_allocation_available=preferred
        ),
    )
    mine = encode_register_request(version, endpoint, resource, pre_start, preferred)
    assert mine == real.SerializeToString()
    assert api_pb2.RegisterRequest.FromString(mine) == real


def test_register_request_of_a_pool_reads_back_as_the_kubelet_reads_it() -> None:
    data = encode_register_request("v1beta1", "densedev-vfs.sock", "intel.com/vfs", False, True)
    got = api_pb2.RegisterRequest.FromString(data)
    assert (got.version, got.endpoint, got.resource_name) == ("v1beta1", "densedev-vfs.sock", "intel.com/vfs")
    assert got.HasField("options") and got.options.get_preferred_allocation_available
    assert not got.options.pre_start_required


ids = st.lists(st.text(max_size=40), max_size=5)
devices = st.builds(
    lambda name, device_ids, nodes: pr.ContainerDevices(
        resource_name=name,
        device_ids=device_ids,
        topology=pr.TopologyInfo(nodes=[pr.NUMANode(ID=n) for n in nodes]),
    ),
    st.text(max_size=40),
    ids,
    st.lists(st.integers(-(2**63), 2**63 - 1), max_size=3),
)
containers = st.builds(
    lambda name, devs, cpus: pr.ContainerResources(
        name=name,
        devices=devs,
        cpu_ids=cpus,
        memory=[pr.ContainerMemory(memory_type="hugepages-1Gi", size=2**30)],
        dynamic_resources=[
            pr.DynamicResource(
                claim_name="c",
                claim_resources=[pr.ClaimResource(cdi_devices=[pr.CDIDevice(name="k/x=y")], driver_name="d")],
            )
        ],
    ),
    st.text(max_size=20),
    st.lists(devices, max_size=3),
    st.lists(st.integers(0, 2**40), max_size=4),
)
responses = st.builds(
    lambda pods: pr.ListPodResourcesResponse(
        pod_resources=[pr.PodResources(name=n, namespace=ns, containers=cs) for n, ns, cs in pods]
    ),
    st.lists(
        st.tuples(st.text(max_size=20), st.text(max_size=20), st.lists(containers, max_size=3)), max_size=4
    ),
)


def held_by_protobuf(response: pr.ListPodResourcesResponse) -> frozenset[tuple[str, str]]:
    """What the earlier client (the generated classes) read from a reply."""
    return frozenset(
        (d.resource_name, i)
        for pod in response.pod_resources
        for container in pod.containers
        for d in container.devices
        for i in d.device_ids
    )


@hypothesis_settings(max_examples=300, deadline=None)
@given(responses)
def test_list_reply_decodes_as_the_generated_classes_read_it(response: pr.ListPodResourcesResponse) -> None:
    assert decode_held(response.SerializeToString()) == held_by_protobuf(response)


@hypothesis_settings(max_examples=500, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_both_accept_decode_alike(data: bytes) -> None:
    # Garbage from a socket that is not the kubelet's: where protobuf reads a reply, the hand decoder
    # reads the same devices or refuses it (ValueError, one line at the caller); it never makes one up.
    try:
        real = held_by_protobuf(pr.ListPodResourcesResponse.FromString(data))
    except Exception:
        real = None
    try:
        mine = decode_held(data)
    except ValueError:
        return
    assert real is not None and mine == real


OURS = "vf.densedev.io"
DRIVERS = frozenset({OURS, "dra.example.com"})
claim_resources = st.builds(
    lambda driver, pool, device, cdi: pr.ClaimResource(
        driver_name=driver,
        pool_name=pool,
        device_name=device,
        cdi_devices=[pr.CDIDevice(name=n) for n in cdi],
    ),
    st.sampled_from([OURS, "dra.example.com", "gpu.example.com", ""]),
    st.text(max_size=20),
    st.text(max_size=30),
    st.lists(st.text(max_size=30), max_size=2),
)
dynamic = st.builds(
    lambda name, namespace, resources: pr.DynamicResource(
        claim_name=name, claim_namespace=namespace, claim_resources=resources
    ),
    st.text(max_size=20),
    st.text(max_size=20),
    st.lists(claim_resources, max_size=3),
)
dra_containers = st.builds(
    lambda name, devs, dyn: pr.ContainerResources(name=name, devices=devs, dynamic_resources=dyn),
    st.text(max_size=10),
    st.lists(devices, max_size=2),
    st.lists(dynamic, max_size=3),
)
dra_responses = st.builds(
    lambda pods: pr.ListPodResourcesResponse(
        pod_resources=[pr.PodResources(name=n, namespace=ns, containers=cs) for n, ns, cs in pods]
    ),
    st.lists(
        st.tuples(st.text(max_size=10), st.text(max_size=10), st.lists(dra_containers, max_size=3)),
        max_size=3,
    ),
)


def holdings_by_protobuf(response: pr.ListPodResourcesResponse, drivers: frozenset[str]) -> PodHoldings:
    """What the generated classes read from a reply: devices, and the claim devices of ``drivers``."""
    return PodHoldings(
        held_by_protobuf(response),
        frozenset(
            ClaimUse(r.driver_name, d.claim_namespace, d.claim_name, r.pool_name, r.device_name)
            for pod in response.pod_resources
            for container in pod.containers
            for d in container.dynamic_resources
            for r in d.claim_resources
            if r.driver_name in drivers
        ),
    )


@hypothesis_settings(max_examples=300, deadline=None)
@given(dra_responses)
def test_dynamic_resources_decode_as_the_generated_classes_read_them(
    response: pr.ListPodResourcesResponse,
) -> None:
    data = response.SerializeToString()
    assert decode_pod_resources(data, DRIVERS) == holdings_by_protobuf(response, DRIVERS)
    # Without drivers asked for, no claim is read (the device-plugin side's decode costs no more).
    assert decode_pod_resources(data) == PodHoldings(held_by_protobuf(response))
    assert decode_held(data) == held_by_protobuf(response)


@hypothesis_settings(max_examples=500, deadline=None)
@given(st.binary(max_size=300))
def test_any_bytes_decode_with_claims_alike_or_are_refused(data: bytes) -> None:
    # Never an exception but ValueError (the client's one line); where both read the bytes, they agree.
    try:
        real: PodHoldings | None = holdings_by_protobuf(pr.ListPodResourcesResponse.FromString(data), DRIVERS)
    except Exception:
        real = None
    try:
        mine = decode_pod_resources(data, DRIVERS)
    except ValueError:
        return
    assert real is not None and mine == real


@hypothesis_settings(max_examples=300, deadline=None)
@given(dra_responses, st.data())
def test_dynamic_resources_mangled_decode_alike_or_are_refused(
    response: pr.ListPodResourcesResponse, data: st.DataObject
) -> None:
    # Real replies with a byte flipped or cut: near-valid input reaches the nested claim messages.
    raw = bytearray(response.SerializeToString())
    if raw:
        at = data.draw(st.integers(0, len(raw) - 1))
        raw[at] = data.draw(st.integers(0, 255))
        raw = raw[: data.draw(st.integers(at, len(raw)))]
    try:
        real: PodHoldings | None = holdings_by_protobuf(
            pr.ListPodResourcesResponse.FromString(bytes(raw)), DRIVERS
        )
    except Exception:
        real = None
    try:
        mine = decode_pod_resources(bytes(raw), DRIVERS)
    except ValueError:
        return
    if real is not None:
        assert mine == real


def test_claim_fields_in_any_order_and_of_wrong_wire_types_are_read_as_protobuf_reads_them() -> None:
    resource = (
        length_delimited(3, b"node-a")
        + length_delimited(4, b"pci-0000-3b-02-2")
        + length_delimited(2, OURS.encode())
    )
    other = length_delimited(2, b"gpu.example.com") + length_delimited(4, b"gpu-0")
    # claim_resources first, then the namespace, a claim_name as a varint (skipped), then the name.
    claim = (
        length_delimited(4, resource)
        + length_delimited(4, other)
        + length_delimited(3, b"team")
        + b"\x10\x07"
        + length_delimited(2, b"nic")
    )
    container = length_delimited(5, claim)
    data = length_delimited(1, length_delimited(3, container))
    expected = ClaimUse(OURS, "team", "nic", "node-a", "pci-0000-3b-02-2")
    assert decode_pod_resources(data, DRIVERS).claims == {expected}
    assert decode_pod_resources(data, DRIVERS) == holdings_by_protobuf(
        pr.ListPodResourcesResponse.FromString(data), DRIVERS
    )
    for cut in range(1, len(data)):
        with pytest.raises(ValueError):
            decode_pod_resources(data[:cut], DRIVERS)
    with pytest.raises(ValueError):
        decode_pod_resources(data.replace(b"team", b"te\xffm"), DRIVERS)


def test_a_reply_cut_short_or_not_utf8_is_refused() -> None:
    whole = pr.ListPodResourcesResponse(
        pod_resources=[
            pr.PodResources(
                containers=[
                    pr.ContainerResources(
                        devices=[pr.ContainerDevices(resource_name="a/b", device_ids=["x"])]
                    )
                ]
            )
        ]
    ).SerializeToString()
    assert decode_held(whole) == {("a/b", "x")}
    for cut in range(1, len(whole)):
        with pytest.raises(ValueError):
            decode_held(whole[:cut])
    bad = whole.replace(b"a/b", b"a\xffb")
    with pytest.raises(ValueError):
        decode_held(bad)


def test_resource_name_after_the_ids_still_names_them() -> None:
    # Protobuf lets fields come in any order; the earlier reader paired the IDs with the final name.
    devices = b"\x12\x01x" + b"\x0a\x03a/b" + b"\x12\x01y"  # device_ids "x", resource_name, device_ids "y"
    container = b"\x12" + bytes([len(devices)]) + devices
    pod = b"\x1a" + bytes([len(container)]) + container
    data = b"\x0a" + bytes([len(pod)]) + pod
    assert decode_held(data) == held_by_protobuf(pr.ListPodResourcesResponse.FromString(data))
    assert decode_held(data) == {("a/b", "x"), ("a/b", "y")}


async def test_the_client_refuses_an_undecodable_reply_in_one_line_and_reconnects(pr_dir: Path) -> None:
    # A socket whose server answers List with bytes that are no ListPodResourcesResponse.
    replies = [b"\x0a\x05\x1a\x03\x12\x01", held_reply()]

    async def list_(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        assert request == b""  # the empty ListPodResourcesRequest
        return replies.pop(0)

    server = grpc.aio.server()
    handler = grpc.method_handlers_generic_handler(
        "v1.PodResourcesLister", {"List": grpc.unary_unary_rpc_method_handler(list_)}
    )
    server.add_generic_rpc_handlers((handler,))
    socket = pr_dir / "kubelet.sock"
    server.add_insecure_port(f"unix:{socket}")
    await server.start()
    client = PodResourcesClient(socket, timeout=10)
    try:
        with pytest.raises(SourceUnavailable, match="undecodable reply") as refused:
            await client.list()
        assert "\n" not in str(refused.value)
        assert client._channel is None  # a fresh channel next time, as after an RPC error
        assert await client.list() == {("a/b", "x")}
    finally:
        await client.close()
        await server.stop(None)


def held_reply() -> bytes:
    """A List reply: one pod, one container, device "x" of resource "a/b"."""
    devices = pr.ContainerDevices(resource_name="a/b", device_ids=["x"])
    pod = pr.PodResources(containers=[pr.ContainerResources(devices=[devices])])
    return bytes(pr.ListPodResourcesResponse(pod_resources=[pod]).SerializeToString())


EIGHT_VFS = [f"0000:{b:02x}:{d:02x}.{f}" for b in (0x3B, 0x5E) for d in range(2) for f in (2, 3)]


def large_reply(size: int) -> bytes:
    """A List reply of at least ``size`` bytes: many pods, each one container holding 8 VFs and a DRA
    claim's CDI devices (skipped whole by the decoder, which keeps this test's decode short)."""
    names = b"".join(length_delimited(2, i.encode()) for i in EIGHT_VFS)
    devices = length_delimited(1, b"example.com/sriov_a") + names
    cdi = b"".join(
        length_delimited(1, length_delimited(1, f"dra.example.com/vf=claim-{k:03d}".encode()))
        for k in range(128)
    )
    claim = length_delimited(2, b"claim") + length_delimited(3, b"default") + length_delimited(4, cdi)
    container = length_delimited(1, b"main") + length_delimited(2, devices) + length_delimited(5, claim)
    pod = length_delimited(1, b"pod") + length_delimited(2, b"default") + length_delimited(3, container)
    one = length_delimited(1, pod)
    return one * (size // len(one) + 1)


async def serve_list(socket: Path, reply: bytes) -> grpc.aio.Server:
    """A PodResources socket whose List answers ``reply``."""

    async def list_(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return reply

    server = grpc.aio.server()
    handler = grpc.method_handlers_generic_handler(
        "v1.PodResourcesLister", {"List": grpc.unary_unary_rpc_method_handler(list_)}
    )
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"unix:{socket}")
    await server.start()
    return server


async def test_a_60_mib_reply_is_decoded_off_the_event_loop(pr_dir: Path) -> None:
    """Issue 23 item 7: a 60 MiB List reply decoded on the loop stalled it for most of a second."""
    reply = large_reply(60 << 20)
    assert 60 << 20 < len(reply) < MAX_RECEIVE
    ran_in: list[str] = []

    def decode(data: bytes) -> frozenset[tuple[str, str]]:
        ran_in.append(threading.current_thread().name)
        return decode_held(data)

    server = await serve_list(pr_dir / "kubelet.sock", reply)
    client = PodResourcesClient(pr_dir / "kubelet.sock", timeout=60, decode=decode)
    try:
        held = await client.list()
    finally:
        await client.close()
        await server.stop(None)
    assert held == {
        ("example.com/sriov_a", f"0000:{b:02x}:{d:02x}.{f}")
        for b in (0x3B, 0x5E)
        for d in range(2)
        for f in (2, 3)
    }
    assert len(ran_in) == 1 and ran_in[0].startswith("densedev-kubelet-")


@pytest.mark.parametrize("number", [1, 2, 15, 16, 17, 2047, 2048])
@pytest.mark.parametrize("size", [0, 1, 127, 128, 129, 300, 16384])
def test_length_delimited_is_tag_length_bytes_at_every_varint_boundary(number: int, size: int) -> None:
    # The one-byte fast path (field < 16, length < 128) and the general one must agree with the spec:
    # the tag is varint(number << 3 | 2), the length varint(len); protobuf's own bytes for a message
    # with one bytes field of that number (fields 1 and 2 of DeviceIdentifier are strings).
    from densedev.protowire import varint

    value = bytes(range(256)) * (size // 256) + bytes(range(size % 256))
    assert length_delimited(number, value) == varint(number << 3 | 2) + varint(size) + value
    if number in (1, 2):
        from densedev._proto import dra_health_v1alpha1_pb2 as pb

        text = "a" * size
        field = "pool_name" if number == 1 else "device_name"
        want = pb.DeviceIdentifier(**{field: text}).SerializeToString()
        assert (length_delimited(number, text.encode()) if size else b"") == want
