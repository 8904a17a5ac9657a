"""The kubelet emulator behaves like the kubelet: validation, dial-back, limits, stream end, restart."""

from __future__ import annotations

import asyncio
import base64
import json
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from helpers.node import Node
from helpers.plugin import RESOURCE, FakePool, pci_ids, serving
from hypothesis import given, settings
from hypothesis import strategies as st

from densedev._proto import api_pb2, podresources_pb2
from densedev.pools import sriov_format
from densedev.pools.config import validate_resource_name
from densedev.testing.kubelet import (
    CHECKPOINT,
    MAX_RECEIVE,
    InvariantViolation,
    KubeletEmulator,
    KubeletError,
    extended_resource_name_error,
)

GUARD = 10.0  # hang guard only


async def _register(plugin_dir: Path, resource: str, endpoint: str, version: str = "v1beta1") -> None:
    async with grpc.aio.insecure_channel(f"unix:{plugin_dir / 'kubelet.sock'}") as channel:
        register = channel.unary_unary(
            "/v1beta1.Registration/Register",
            request_serializer=api_pb2.RegisterRequest.SerializeToString,
            response_deserializer=api_pb2.Empty.FromString,
        )
        await register(
            api_pb2.RegisterRequest(version=version, endpoint=endpoint, resource_name=resource), timeout=GUARD
        )


async def _refusal(plugin_dir: Path, resource: str, endpoint: str, version: str = "v1beta1") -> str:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _register(plugin_dir, resource, endpoint, version)
    assert err.value.code() == grpc.StatusCode.UNKNOWN  # the kubelet answers with a plain Go error
    return err.value.details() or ""


async def test_start_deletes_sockets_only(sock_dir: Path) -> None:
    old = socket.socket(socket.AF_UNIX)
    old.bind(str(sock_dir / "old-plugin.sock"))
    old.close()
    (sock_dir / "notes.txt").write_text("stays")
    kubelet = KubeletEmulator(sock_dir)
    await kubelet.start()
    try:
        assert not (sock_dir / "old-plugin.sock").exists()
        assert (sock_dir / "notes.txt").read_text() == "stays"
        assert (sock_dir / "kubelet.sock").is_socket()
    finally:
        await kubelet.stop()
    assert not (sock_dir / "kubelet.sock").exists()


@pytest.mark.parametrize(
    ("resource", "version", "fragment"),
    [
        ("example.com/vf", "v1alpha", "unsupported API version 'v1alpha'"),
        ("vf", "v1beta1", "no '/': an unprefixed name is a native resource"),
        ("kubernetes.io/vf", "v1beta1", "'kubernetes.io/' in it: a native resource"),
        ("requests.example.com/vf", "v1beta1", "starts with 'requests.'"),
        ("Example.com/vf", "v1beta1", "prefix part must be a lowercase RFC 1123 subdomain"),
        ("example.com/" + "v" * 64, "v1beta1", "name part must be no more than 63 characters"),
        ("example.com/vf_", "v1beta1", "must start and end with an alphanumeric character"),
        ("example.com/v f", "v1beta1", "name part must consist of alphanumeric characters"),
        ("example.com/vf/0", "v1beta1", "a qualified name has at most one '/'"),
        ("/vf", "v1beta1", "prefix part must be a lowercase RFC 1123 subdomain"),  # "requests." + "/vf"
        ("example.com/", "v1beta1", "name part must be non-empty"),
        ("e" * 245 + "/vf", "v1beta1", "prefix part must be no more than 253 characters"),
    ],
)
async def test_register_validation(
    kubelet: KubeletEmulator, sock_dir: Path, resource: str, version: str, fragment: str
) -> None:
    message = await _refusal(sock_dir, resource, "x.sock", version)
    assert fragment in message
    if version == "v1beta1":  # the kubelet's own words come first (errInvalidResourceName)
        assert message.startswith(f"the ResourceName {resource!r} is invalid: ")
    assert kubelet.resources() == [] and kubelet.refusals[0][0] == resource


# Names at the edges of the kubelet's rules, each the same in both checks.
_EDGES = [
    "example.com/vf",
    "e" * 244 + "/vf",  # "requests." + 244 = 253: the longest prefix
    "example.com/" + "v" * 63,
    "a-b.c/A_b.C-1",
    "1.2.3/4",
    "example.com/vf\n",
    "example.com./vf",
    "-example.com/vf",
    "example..com/vf",
    "x.kubernetes.io/vf",
    "requests/vf",
]


@given(
    st.one_of(
        st.sampled_from(_EDGES),
        st.text(alphabet="aZ0-._/.k\n é", max_size=20),
        st.builds(
            lambda p, n: f"{p}/{n}",
            st.text(alphabet="az09-.", min_size=0, max_size=12),
            st.text(alphabet="aZ09-._ ", min_size=0, max_size=70),
        ),
    )
)
@settings(max_examples=300, deadline=None)
def test_the_emulator_and_the_daemon_agree_on_resource_names(name: str) -> None:
    # Two implementations written apart (the daemon's config check, the emulator's from the kubelet's
    # sources): a disagreement is a bug in one of them.
    assert (extended_resource_name_error(name) is None) == (validate_resource_name(name) is None), name


@pytest.mark.parametrize(
    ("prefix", "name"),
    [
        ("Example.com", "vf"),
        ("example.com", "vf_"),
        ("requests.example.com", "vf"),
        ("example.com", "v" * 64),
    ],
)
async def test_the_emulator_refuses_what_a_broken_daemon_check_lets_through(
    node: Node, kubelet: KubeletEmulator, monkeypatch: pytest.MonkeyPatch, prefix: str, name: str
) -> None:
    # The daemon's check is broken on purpose: the config loads with the bad name and the daemon
    # registers it; the emulator, checking by the kubelet's rules on its own, refuses it.
    monkeypatch.setattr(sriov_format, "validate_resource_name", lambda _name: None)
    pf = node.layout.pfs[0]
    pool = {"resourceName": name, "resourcePrefix": prefix, "selectors": {"pfNames": [pf.netdev]}}
    node.write_config({"resourceList": [pool]})
    daemon = node.daemon()
    assert [p.full_name for p in daemon.config.pools] == [f"{prefix}/{name}"]
    await daemon.start()
    try:
        await kubelet.wait_for(lambda: bool(kubelet.refusals), GUARD)
    finally:
        await daemon.stop()
    resource, message = kubelet.refusals[0]
    assert resource == f"{prefix}/{name}" and message.startswith(
        f"the ResourceName {resource!r} is invalid: "
    )
    assert kubelet.resources() == []


@pytest.mark.parametrize("kubelet_options", [{"dial_timeout": 0.3}])
async def test_an_endpoint_longer_than_sun_path_is_refused(kubelet: KubeletEmulator, sock_dir: Path) -> None:
    # Go's SockaddrUnix refuses a path of 108 bytes or more (sun_path), so the kubelet cannot dial it.
    endpoint = "x" * (108 - len(str(sock_dir)) - 1)
    assert len(str(sock_dir / endpoint)) == 108
    message = await _refusal(sock_dir, RESOURCE, endpoint)
    assert "invalid argument" in message and "at most 107" in message
    fits = "y" * (107 - len(str(sock_dir)) - 1)
    assert len(str(sock_dir / fits)) == 107
    message = await _refusal(sock_dir, RESOURCE, fits)  # allowed, then the dial fails: nothing serves it
    assert "failed to dial device plugin" in message and "invalid argument" not in message


@pytest.mark.parametrize("kubelet_options", [{"dial_timeout": 0.3}])
async def test_register_dials_the_plugin_and_fails_when_it_is_not_there(
    kubelet: KubeletEmulator, sock_dir: Path
) -> None:
    message = await _refusal(sock_dir, RESOURCE, "missing.sock")
    assert "failed to dial device plugin" in message and "missing.sock" in message
    assert kubelet.resources() == []


async def test_options_from_the_plugin_and_optional_calls(kubelet: KubeletEmulator, sock_dir: Path) -> None:
    pool = FakePool(pci_ids(8), pre_start=True, preferred=False)
    pool.health[pool.ids[7]] = False
    async with serving(RESOURCE, sock_dir / "vf.sock", pool):
        await _register(sock_dir, RESOURCE, "vf.sock")
        await kubelet.wait_for(lambda: kubelet.capacity(RESOURCE) == 8, GUARD)
        options = kubelet.options(RESOURCE)
        assert options is not None and options.pre_start_required
        assert not options.get_preferred_allocation_available
        with pytest.raises(KubeletError, match="does not offer GetPreferredAllocation"):
            await kubelet.preferred(RESOURCE, pool.ids, [], 2)
        await kubelet.prestart(RESOURCE, pool.ids[:2])
        assert pool.prestarted == [pool.ids[:2]]
        # The kubelet's own checks refuse unknown and unhealthy devices without asking the plugin.
        with pytest.raises(KubeletError, match=r"unknown devices \['0000:99:00.0'\]"):
            await kubelet.allocate(RESOURCE, ["0000:99:00.0"])
        with pytest.raises(KubeletError, match="unhealthy devices"):
            await kubelet.allocate(RESOURCE, [pool.ids[7]])
        # check=False sends them anyway, so the plugin's own refusal can be seen.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await kubelet.allocate(RESOURCE, [pool.ids[7]], check=False)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert pool.ids[7] in (err.value.details() or "")
        with pytest.raises(KubeletError, match="no device plugin registered"):
            await kubelet.allocate("example.com/other", [pool.ids[0]])


async def test_preferred_when_offered(kubelet: KubeletEmulator, sock_dir: Path) -> None:
    pool = FakePool(pci_ids(8))
    async with serving(RESOURCE, sock_dir / "vf.sock", pool):
        await _register(sock_dir, RESOURCE, "vf.sock")
        answer = await kubelet.preferred(RESOURCE, pool.ids[2:], [pool.ids[5]], 3)
        assert answer == [pool.ids[5], pool.ids[2], pool.ids[3]]
        with pytest.raises(KubeletError, match="does not require PreStartContainer"):
            await kubelet.prestart(RESOURCE, pool.ids[:1])


async def test_stream_end_marks_devices_unhealthy_and_never_redials(
    kubelet: KubeletEmulator, sock_dir: Path
) -> None:
    pool = FakePool(pci_ids(32))
    async with serving(RESOURCE, sock_dir / "vf.sock", pool):
        await _register(sock_dir, RESOURCE, "vf.sock")
        await kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) == 32, GUARD)
    await kubelet.wait_for(lambda: kubelet.stream_ended(RESOURCE), GUARD)
    assert kubelet.capacity(RESOURCE) == 32 and kubelet.allocatable(RESOURCE) == 0
    # A new server on the same socket is not dialled: the plugin must register again.
    async with serving(RESOURCE, sock_dir / "vf.sock", pool):
        await asyncio.sleep(0.2)
        assert kubelet.allocatable(RESOURCE) == 0 and kubelet.registrations(RESOURCE) == 1
        await _register(sock_dir, RESOURCE, "vf.sock")
        await kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) == 32, GUARD)
        assert kubelet.registrations(RESOURCE) == 2 and not kubelet.stream_ended(RESOURCE)


async def test_a_new_registration_replaces_the_old(kubelet: KubeletEmulator, sock_dir: Path) -> None:
    first = FakePool(pci_ids(4))
    second = FakePool(pci_ids(6, bus=0x5E))
    async with (
        serving(RESOURCE, sock_dir / "one.sock", first),
        serving(RESOURCE, sock_dir / "two.sock", second),
    ):
        await _register(sock_dir, RESOURCE, "one.sock")
        await kubelet.wait_for(lambda: kubelet.capacity(RESOURCE) == 4, GUARD)
        await _register(sock_dir, RESOURCE, "two.sock")
        await kubelet.wait_for(lambda: set(kubelet.devices(RESOURCE)) == set(second.ids), GUARD)
        assert kubelet.registrations(RESOURCE) == 2 and kubelet.resources() == [RESOURCE]
        response = await kubelet.allocate(RESOURCE, [second.ids[0]])
        assert response.envs["PCIDEVICE_EXAMPLE_COM_VF"] == second.ids[0]


async def test_a_replaced_clients_stream_end_disconnects_the_newer_one(
    kubelet: KubeletEmulator, sock_dir: Path
) -> None:
    # The v1.32 device manager keeps following the replaced client; when its stream ends, runClient finds
    # the newer client under the resource name and disconnects it (the reference's re-registration race).
    first = FakePool(pci_ids(4))
    second = FakePool(pci_ids(6, bus=0x5E))
    async with serving(RESOURCE, sock_dir / "two.sock", second):
        async with serving(RESOURCE, sock_dir / "one.sock", first):
            await _register(sock_dir, RESOURCE, "one.sock")
            await kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) == 4, GUARD)
            await _register(sock_dir, RESOURCE, "two.sock")
            await kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) == 6, GUARD)
            assert not kubelet.stream_ended(RESOURCE)
        # one.sock's server stopped: its stream ended, and the kubelet dropped two.sock's in turn.
        await kubelet.wait_for(lambda: kubelet.stream_ended(RESOURCE), GUARD)
        assert set(kubelet.devices(RESOURCE)) == set(second.ids) and kubelet.allocatable(RESOURCE) == 0
        assert "replaced client" in kubelet.stream_error(RESOURCE)
        with pytest.raises(KubeletError):
            await kubelet.create_pod("late", {RESOURCE: 1})


@pytest.mark.parametrize("kubelet_options", [{"stop_grace": 1.0}])
async def test_a_resource_without_a_plugin_is_removed_after_the_grace_period(
    kubelet: KubeletEmulator, sock_dir: Path
) -> None:
    pool = FakePool(pci_ids(4))
    async with serving(RESOURCE, sock_dir / "vf.sock", pool):
        await _register(sock_dir, RESOURCE, "vf.sock")
        await kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) == 4, GUARD)
    await kubelet.wait_for(lambda: kubelet.stream_ended(RESOURCE), GUARD)
    assert kubelet.resources() == [RESOURCE] and kubelet.capacity(RESOURCE) == 4  # listed, unhealthy
    await kubelet.wait_for(lambda: not kubelet.resources(), GUARD)
    assert kubelet.capacity(RESOURCE) == 0
    with pytest.raises(KubeletError, match="no device plugin"):
        await kubelet.create_pod("late", {RESOURCE: 1})
    # A plugin registering again within the grace period keeps the resource.
    async with serving(RESOURCE, sock_dir / "vf.sock", pool):
        await _register(sock_dir, RESOURCE, "vf.sock")
        await kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) == 4, GUARD)
    await kubelet.wait_for(lambda: kubelet.stream_ended(RESOURCE), GUARD)
    async with serving(RESOURCE, sock_dir / "vf.sock", pool):
        await _register(sock_dir, RESOURCE, "vf.sock")
        await kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) == 4, GUARD)
        await asyncio.sleep(1.5)  # past the first stream end's grace period
        assert kubelet.allocatable(RESOURCE) == 4


async def _oversized_server(path: Path, messages: list[bytes]) -> grpc.aio.Server:
    """A plugin that ignores the limit (sends up to 8 MiB), to see the kubelet side enforce it."""

    async def list_and_watch(request: Any, context: Any) -> AsyncIterator[bytes]:
        for message in messages:
            yield message
        await asyncio.Event().wait()  # like a real plugin, never return

    async def options(request: Any, context: Any) -> api_pb2.DevicePluginOptions:
        return api_pb2.DevicePluginOptions()

    server = grpc.aio.server(options=(("grpc.max_send_message_length", 8 * 1024 * 1024),))
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "v1beta1.DevicePlugin",
                {
                    "GetDevicePluginOptions": grpc.unary_unary_rpc_method_handler(
                        options,
                        request_deserializer=api_pb2.Empty.FromString,
                        response_serializer=api_pb2.DevicePluginOptions.SerializeToString,
                    ),
                    "ListAndWatch": grpc.unary_stream_rpc_method_handler(
                        list_and_watch,
                        request_deserializer=api_pb2.Empty.FromString,
                        response_serializer=lambda data: data,
                    ),
                },
            ),
        )
    )
    server.add_insecure_port(f"unix:{path}")
    await server.start()
    return server


async def test_receive_limit_ends_the_stream(kubelet: KubeletEmulator, sock_dir: Path) -> None:
    small = api_pb2.ListAndWatchResponse(
        devices=[api_pb2.Device(ID="a", health="Healthy")]
    ).SerializeToString()
    # One device whose ID alone pushes the message past 4 MiB.
    big = api_pb2.ListAndWatchResponse(
        devices=[api_pb2.Device(ID="x" * MAX_RECEIVE, health="Healthy")]
    ).SerializeToString()
    assert len(big) > MAX_RECEIVE
    server = await _oversized_server(sock_dir / "big.sock", [small, big])
    try:
        await _register(sock_dir, RESOURCE, "big.sock")
        await kubelet.wait_for(lambda: kubelet.stream_ended(RESOURCE), GUARD)
        assert "RESOURCE_EXHAUSTED" in kubelet.stream_error(RESOURCE)
        assert kubelet.devices(RESOURCE) == {"a": "Unhealthy"}
        assert len(kubelet.updates(RESOURCE)) == 1
    finally:
        await server.stop(0)


async def test_restart_writes_a_checkpoint_and_recreates_the_socket(
    kubelet: KubeletEmulator, sock_dir: Path
) -> None:
    pool = FakePool(pci_ids(4))
    pool.health[pool.ids[3]] = False
    async with serving(RESOURCE, sock_dir / "vf.sock", pool):
        await _register(sock_dir, RESOURCE, "vf.sock")
        await kubelet.wait_for(lambda: kubelet.capacity(RESOURCE) == 4, GUARD)
        await kubelet.allocate(RESOURCE, pool.ids[:2])
        before = (sock_dir / "kubelet.sock").stat()
        await kubelet.restart()
        after = (sock_dir / "kubelet.sock").stat()
        assert (before.st_ino, before.st_ctime_ns) != (after.st_ino, after.st_ctime_ns)
        assert not (sock_dir / "vf.sock").exists()  # plugin sockets deleted, as the kubelet does
        assert kubelet.stream_ended(RESOURCE) and kubelet.allocatable(RESOURCE) == 0
        checkpoint = json.loads((sock_dir / CHECKPOINT).read_text())
        data = checkpoint["Data"]
        assert data["RegisteredDevices"] == {RESOURCE: pool.ids[:3]}
        [entry] = data["PodDeviceEntries"]
        # DeviceIDs are keyed by each device's NUMA node, as the device manager checkpoints them.
        assert entry["ResourceName"] == RESOURCE
        assert entry["DeviceIDs"] == {"0": [pool.ids[0]], "1": [pool.ids[1]]}
        response = api_pb2.ContainerAllocateResponse.FromString(base64.b64decode(entry["AllocResp"]))
        assert response.envs["PCIDEVICE_EXAMPLE_COM_VF"] == ",".join(pool.ids[:2])
        assert isinstance(checkpoint["Checksum"], int)
    await kubelet.stop()
    # A fresh kubelet reads the checkpoint: the resource is back with no devices until it registers.
    fresh = KubeletEmulator(sock_dir)
    await fresh.start()
    try:
        assert fresh.resources() == [RESOURCE] and fresh.capacity(RESOURCE) == 0
    finally:
        await fresh.stop()


@pytest.mark.parametrize("strict", [False, True])
async def test_pods_are_accounted_per_resource_and_double_holdings_recorded(
    sock_dir: Path, pr_dir: Path, strict: bool
) -> None:
    """Like the kubelet, a device listed under two resources is free under the second: it is handed out
    again, and the emulator records (strict: raises on) the device held by two running pods."""
    shared = pci_ids(3)
    a, b = "example.com/a", "example.com/b"
    kubelet = KubeletEmulator(sock_dir, pod_resources_socket=pr_dir / "kubelet.sock", strict=strict)
    await kubelet.start()
    try:
        async with (
            serving(a, sock_dir / "a.sock", FakePool(shared)),
            serving(b, sock_dir / "b.sock", FakePool(shared)),
        ):
            for r in (a, b):
                await _register(sock_dir, r, f"{r[-1]}.sock")
            await kubelet.wait_for(lambda: kubelet.capacity(a) == 3 and kubelet.capacity(b) == 3, GUARD)
            got = await kubelet.create_pod("one", {a: 2})
            assert kubelet.pods() == {"uid-one": {a: got[a]}}
            with pytest.raises(KubeletError, match="not free"):
                await kubelet.create_pod("again", {a: [got[a][0]]})  # per resource, it is accounted
            if strict:
                with pytest.raises(InvariantViolation, match=got[a][0]):
                    await kubelet.create_pod("two", {b: [got[a][0]]})
            else:
                await kubelet.create_pod("two", {b: 3})  # all three: two of them are one's
                assert {d.device for d in kubelet.double_holdings} == set(got[a])
                assert all(
                    d.pod == "uid-two" and d.holders == (("uid-one", a),) for d in kubelet.double_holdings
                )
            # Deleted pods free their devices at the next UpdateAllocatedDevices (a List here), and
            # the checkpoint is not rewritten for it.
            kubelet.delete_pod("uid-one")
            kubelet.delete_pod("uid-two")
            checkpoint = json.loads((sock_dir / CHECKPOINT).read_text())
            assert {e["PodUID"] for e in checkpoint["Data"]["PodDeviceEntries"]} == {"uid-one", "uid-two"}
            async with grpc.aio.insecure_channel(f"unix:{pr_dir / 'kubelet.sock'}") as channel:
                listed = await channel.unary_unary(
                    "/v1.PodResourcesLister/List",
                    request_serializer=podresources_pb2.ListPodResourcesRequest.SerializeToString,
                    response_deserializer=podresources_pb2.ListPodResourcesResponse.FromString,
                )(podresources_pb2.ListPodResourcesRequest(), timeout=GUARD)
            assert list(listed.pod_resources) == []
            await kubelet.create_pod("three", {a: 3})  # everything is free again
            # The checkpoint is rewritten at the admission: only the running pod is left.
            checkpoint = json.loads((sock_dir / CHECKPOINT).read_text())
            assert [e["PodUID"] for e in checkpoint["Data"]["PodDeviceEntries"]] == ["uid-three"]
    finally:
        await kubelet.stop()


def _count_fsyncs(monkeypatch: pytest.MonkeyPatch, delay: float = 0.0) -> list[str]:
    """Record the file each os.fsync call syncs (sleeping ``delay`` in it, as a slow disk would)."""
    import os
    import time

    synced: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        time.sleep(delay)
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return synced


async def test_each_update_is_applied_with_a_synced_checkpoint(
    kubelet: KubeletEmulator, sock_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from densedev.kubelet.feed import PoolFeed

    # The kubelet's genericDeviceUpdateCallback writes the checkpoint (temp file, fsync, rename) for
    # every ListAndWatch message before reading the next: an update counts as applied only after it.
    synced = _count_fsyncs(monkeypatch, delay=0.15)
    pool = FakePool(pci_ids(8))
    feed = PoolFeed(pool.message())
    async with serving(RESOURCE, sock_dir / "vf.sock", pool, feed):
        await _register(sock_dir, RESOURCE, "vf.sock")
        await kubelet.wait_for(lambda: len(kubelet.updates(RESOURCE)) == 1, GUARD)
        pool.health[pool.ids[5]] = False
        feed.publish(pool.message())
        await kubelet.wait_for(lambda: len(kubelet.updates(RESOURCE)) == 2, GUARD)
        # Read at once: the file already holds the list the update carried.
        data = json.loads((sock_dir / CHECKPOINT).read_text())["Data"]
    assert data["RegisteredDevices"] == {RESOURCE: [i for i in pool.ids if i != pool.ids[5]]}
    assert [s.startswith(str(sock_dir)) and CHECKPOINT in s for s in synced] == [True, True]
    for update in kubelet.updates(RESOURCE):
        assert update.applied - update.received >= 0.15  # the fsync's time is part of each update
    assert (sock_dir / CHECKPOINT).stat().st_mode & 0o777 == 0o600  # as the file store's TempFile


@pytest.mark.parametrize("kubelet_options", [{"update_work": False}])
async def test_update_work_can_be_turned_off(
    kubelet: KubeletEmulator, sock_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced = _count_fsyncs(monkeypatch)
    pool = FakePool(pci_ids(4))
    async with serving(RESOURCE, sock_dir / "vf.sock", pool):
        await _register(sock_dir, RESOURCE, "vf.sock")
        await kubelet.wait_for(lambda: len(kubelet.updates(RESOURCE)) == 1, GUARD)
        await kubelet.wait_for(lambda: (sock_dir / CHECKPOINT).exists(), GUARD)  # still written, once
    [update] = kubelet.updates(RESOURCE)
    assert update.applied == update.received and synced == []


@pytest.mark.parametrize("kubelet_options", [{"update_work": False, "keep_updates": 2}])
async def test_a_bounded_history_keeps_the_last_messages_and_counts_them_all(
    kubelet: KubeletEmulator, sock_dir: Path
) -> None:
    from densedev.kubelet.feed import PoolFeed

    pool = FakePool(pci_ids(4))
    feed = PoolFeed(pool.message())
    async with serving(RESOURCE, sock_dir / "vf.sock", pool, feed):
        await _register(sock_dir, RESOURCE, "vf.sock")
        for n, device in enumerate(pool.ids, start=1):
            await kubelet.wait_for(lambda n=n: kubelet.received(RESOURCE) == n, GUARD)  # type: ignore[misc]
            pool.health[device] = False
            feed.publish(pool.message())
        await kubelet.wait_for(lambda: kubelet.received(RESOURCE) == 5, GUARD)
    kept = kubelet.updates(RESOURCE)
    assert len(kept) == 2
    assert [sum(h == "Unhealthy" for h in u.devices.values()) for u in kept] == [3, 4]
