"""The DRA plugin against the DRA kubelet emulator: registration per release, sockets, calls, health."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from helpers.dra import DRIVER, NODE, VF, VF2, Node
from hypothesis import given, settings
from hypothesis import strategies as st

from densedev.dra import names
from densedev.dra.health import HealthStream
from densedev.dra.node import handlers
from densedev.dra.registration import DraPlugin, Notification
from densedev.testing.dra_kubelet import DraKubelet, health_of

GUARD = 10.0  # hang guards only: nothing here asserts on speed
ALL_VERSIONS = ("v1.DRAPlugin", "v1beta1.DRAPlugin", "v1alpha1.DRAResourceHealth")


@pytest.fixture
def root(sock_dir: Path) -> Path:
    """The root of the registry and plugin dirs: conftest's short ``sock_dir`` (unix socket paths)."""
    return sock_dir


@dataclass
class Stack:
    """The daemon's DRA side (node service, health stream, plugin) and an emulated kubelet."""

    node: Node
    health: HealthStream
    plugin: DraPlugin
    kubelet: DraKubelet

    def ref(self, *results: tuple[str, str]) -> tuple[str, str, str]:
        r = self.node.claim(*results)
        return (r.namespace, r.name, r.uid)


def _plugin(root: Path, node: Node, health: HealthStream) -> DraPlugin:
    return DraPlugin(
        DRIVER,
        [*handlers(node.service), health.handler()],
        registry_dir=root / "registry",
        plugins_dir=root / "plugins",
        poll=0.05,
    )


@pytest.fixture
def stack_options() -> dict[str, Any]:
    """Keyword arguments of the ``stack`` fixture (parametrize this name to change them)."""
    return {}


@pytest.fixture
async def stack(root: Path, stack_options: dict[str, Any]) -> AsyncIterator[Stack]:
    """The DRA side and a kubelet of ``release`` (1.34 unless ``stack_options`` say), both started."""
    async with _stack(root, **stack_options) as s:
        yield s


@asynccontextmanager
async def _stack(
    root: Path, release: str = "1.34", *, kubelet_first: bool = False, resend: float = 5.0
) -> AsyncIterator[Stack]:
    node = Node(root)
    health = HealthStream(NODE, resend=resend, timeout_seconds=30)
    plugin = _plugin(root, node, health)
    kubelet = DraKubelet(root / "registry", release=release, poll=0.05, health_retry=0.1)
    if kubelet_first:
        await kubelet.start()
        await plugin.start()
    else:
        await plugin.start()
        await kubelet.start()
    try:
        yield Stack(node, health, plugin, kubelet)
    finally:
        health.stop()
        await plugin.stop()
        await kubelet.stop()


# -- registration per release ---------------------------------------------------------------------------


@pytest.mark.parametrize("stack_options", [{"release": "1.34", "kubelet_first": True}])
async def test_a_1_34_kubelet_registers_v1_and_prepares_through_it(stack: Stack, root: Path) -> None:
    await stack.kubelet.wait_for(lambda: DRIVER in stack.kubelet.plugins and stack.plugin.registered, GUARD)
    record = stack.kubelet.plugins[DRIVER]
    assert record.version == "v1.DRAPlugin" and record.versions == ALL_VERSIONS
    assert record.endpoint == str(root / "plugins" / DRIVER / "dra.sock")
    assert record.socket == root / "registry" / f"{DRIVER}-reg.sock"
    assert stack.plugin.notifications == [Notification(True, "")]
    claim = stack.ref(("vf", VF))
    answer = (await stack.kubelet.prepare(DRIVER, [claim]))[claim[2]]
    assert answer.error == ""
    assert answer.devices[0]["device"] == names.device_name(VF)
    assert answer.devices[0]["cdi"][0] == f"{DRIVER}/claim={claim[2]}-{names.device_name(VF)}"
    # A repeat (kubelet retry, or restart) gets exactly the same answer.
    assert (await stack.kubelet.prepare(DRIVER, [claim]))[claim[2]] == answer
    assert await stack.kubelet.unprepare(DRIVER, [claim]) == {claim[2]: ""}
    assert stack.node.service.prepared == {}


@pytest.mark.parametrize("stack_options", [{"release": "1.32"}])
async def test_a_1_32_kubelet_registers_v1beta1_and_opens_no_health_stream(stack: Stack) -> None:
    await stack.kubelet.wait_for(lambda: stack.plugin.registered, GUARD)
    assert stack.kubelet.plugins[DRIVER].version == "v1beta1.DRAPlugin"
    claim = stack.ref(("vf", VF))
    answer = (await stack.kubelet.prepare(DRIVER, [claim]))[claim[2]]
    assert answer.error == "" and len(answer.devices) == 1
    bad = ("default", "x", "not/a/uid")
    assert "is not a Kubernetes UID" in (await stack.kubelet.prepare(DRIVER, [bad]))[bad[2]].error
    assert await stack.kubelet.unprepare(DRIVER, [claim, bad]) == {claim[2]: "", bad[2]: ""}
    assert stack.health.streams_opened == 0


async def test_without_v1beta1_a_1_32_kubelet_falls_back_and_calls_fail(root: Path) -> None:
    # Why both versions are advertised: a 1.32 kubelet silently picks v1alpha3, which nobody serves.
    node = Node(root)
    health = HealthStream(NODE)
    plugin = _plugin(root, node, health)
    plugin.versions = ("v1.DRAPlugin",)
    kubelet = DraKubelet(root / "registry", release="1.32", poll=0.05)
    await plugin.start()
    await kubelet.start()
    try:
        await kubelet.wait_for(lambda: plugin.registered, GUARD)
        assert kubelet.plugins[DRIVER].version == "v1alpha3.NodeService"
        r = node.claim(("vf", VF))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await kubelet.prepare(DRIVER, [(r.namespace, r.name, r.uid)])
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        await plugin.stop()
        await kubelet.stop()


async def test_a_wrong_type_or_unknown_versions_are_refused_then_fixed(root: Path) -> None:
    node = Node(root)
    health = HealthStream(NODE)
    plugin = _plugin(root, node, health)
    plugin.plugin_type = "DRAplugin"  # the kubelet compares exactly
    kubelet = DraKubelet(root / "registry", release="1.34", poll=0.05)
    await plugin.start()
    await kubelet.start()
    try:
        await kubelet.wait_for(lambda: bool(plugin.notifications), GUARD)
        assert plugin.notifications[0] == Notification(
            False, "no handler registered for plugin type: DRAplugin"
        )
        assert not plugin.registered and DRIVER not in kubelet.plugins
        plugin.plugin_type = "DRAPlugin"
        plugin.versions = ("v2.DRAPlugin", "v1alpha1.DRAResourceHealth")
        await kubelet.wait_for(lambda: len(plugin.notifications) >= 2, GUARD)
        assert not plugin.notifications[-1].registered
        assert "none of services supported by the plugin" in plugin.notifications[-1].error
        plugin.versions = ALL_VERSIONS
        # The kubelet retries with backoff while the socket exists.
        await kubelet.wait_for(lambda: plugin.registered, GUARD)
        assert kubelet.plugins[DRIVER].version == "v1.DRAPlugin"
        assert len(kubelet.errors) >= 2
    finally:
        await plugin.stop()
        await kubelet.stop()


# -- sockets ---------------------------------------------------------------------------------------------


async def test_sockets_are_0600_and_new_dirs_0755_under_umask_000(root: Path) -> None:
    old = os.umask(0)
    try:
        node = Node(root)
        health = HealthStream(NODE)
        plugin = _plugin(root, node, health)
        await plugin.start()
    finally:
        os.umask(old)
    try:
        for path in (plugin.endpoint, plugin.registration_socket):
            st = path.lstat()
            assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600, path
        for d in (plugin.registry_dir, plugin.plugin_dir, plugin.plugin_dir.parent):
            assert stat.S_IMODE(d.stat().st_mode) == 0o755, d
    finally:
        await plugin.stop()
    assert not plugin.endpoint.exists() and not plugin.registration_socket.exists()


def _stale_socket(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.close()  # the file stays, nobody listens: what a SIGKILLed plugin leaves


async def test_stale_sockets_are_replaced_and_a_planted_file_is_left_alone(root: Path) -> None:
    node = Node(root)
    plugin = _plugin(root, node, HealthStream(NODE))
    _stale_socket(plugin.endpoint)
    _stale_socket(plugin.registration_socket)
    kubelet = DraKubelet(root / "registry", poll=0.05)
    await plugin.start()
    await kubelet.start()
    try:
        await kubelet.wait_for(lambda: plugin.registered, GUARD)
    finally:
        await plugin.stop()
        await kubelet.stop()
    plugin.endpoint.write_text("not a socket\n")
    with pytest.raises(FileExistsError):
        await _plugin(root, node, HealthStream(NODE)).start()
    assert plugin.endpoint.read_text() == "not a socket\n"
    assert not plugin.registration_socket.exists()  # the DRA socket comes first: nothing else made


async def test_deleted_sockets_are_recreated_and_registered_again(stack: Stack) -> None:
    await stack.kubelet.wait_for(lambda: stack.plugin.registered, GUARD)
    stack.plugin.registration_socket.unlink()
    await stack.kubelet.wait_for(
        lambda: stack.plugin.recreated == 1 and len(stack.plugin.notifications) == 2, GUARD
    )
    assert stack.plugin.notifications[-1].registered and stack.plugin.info_calls == 2
    stack.plugin.endpoint.unlink()
    await stack.kubelet.wait_for(
        lambda: stack.plugin.recreated == 2 and len(stack.plugin.notifications) == 3, GUARD
    )
    await stack.kubelet.wait_for(lambda: DRIVER in stack.kubelet.plugins, GUARD)
    claim = stack.ref(("vf", VF))
    assert (await stack.kubelet.prepare(DRIVER, [claim]))[claim[2]].error == ""


async def test_a_kubelet_restart_registers_again_and_calls_keep_working(stack: Stack) -> None:
    await stack.kubelet.wait_for(lambda: stack.plugin.registered and stack.health.streams == 1, GUARD)
    claim = stack.ref(("vf", VF))
    first = (await stack.kubelet.prepare(DRIVER, [claim]))[claim[2]]
    wiped: list[int] = []

    async def wipe_slices() -> None:
        wiped.append(1)

    stack.kubelet.on_start = wipe_slices
    await stack.kubelet.restart()
    await stack.kubelet.wait_for(lambda: len(stack.plugin.notifications) == 2, GUARD)
    assert wiped == [1] and stack.plugin.info_calls == 2 and stack.plugin.recreated == 0
    # The restarted kubelet prepares its checkpointed claims again: same answer.
    assert (await stack.kubelet.prepare(DRIVER, [claim]))[claim[2]] == first
    # One health stream per kubelet: the old one ended when the new one opened.
    await stack.kubelet.wait_for(
        lambda: stack.health.streams_opened == 2 and stack.health.streams == 1, GUARD
    )


async def test_stop_removes_both_sockets_and_the_kubelet_deregisters(stack: Stack) -> None:
    await stack.kubelet.wait_for(lambda: DRIVER in stack.kubelet.plugins, GUARD)
    await stack.plugin.stop()
    assert not stack.plugin.endpoint.exists() and not stack.plugin.registration_socket.exists()
    await stack.kubelet.wait_for(lambda: DRIVER not in stack.kubelet.plugins, GUARD)


# -- health ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stack_options", [{"resend": 0.1}])
async def test_the_health_stream_sends_the_whole_list_on_change_and_resends_it(stack: Stack) -> None:
    a, b = names.device_name(VF), names.device_name(VF2)

    stack.health.update({VF: True, VF2: True})
    await stack.kubelet.wait_for(
        lambda: stack.kubelet.health(DRIVER) == {(NODE, a): "HEALTHY", (NODE, b): "HEALTHY"}, GUARD
    )
    stack.health.update({VF2: False})
    await stack.kubelet.wait_for(lambda: stack.kubelet.health(DRIVER).get((NODE, b)) == "UNHEALTHY", GUARD)
    record = stack.kubelet.plugins[DRIVER]
    # Every message is the complete list, and without any change it keeps coming (resend).
    seen = record.health_received
    await stack.kubelet.wait_for(lambda: record.health_received >= seen + 3, GUARD)
    for _when, message in list(record.health_messages)[-3:]:
        assert health_of(message) == {(NODE, a): "HEALTHY", (NODE, b): "UNHEALTHY"}
    stack.health.forget([VF])
    await stack.kubelet.wait_for(lambda: stack.kubelet.health(DRIVER) == {(NODE, b): "UNHEALTHY"}, GUARD)
    # stop() ends the stream cleanly: the kubelet forgets the health, then re-opens (5 s; 0.1 here).
    opened = record.health_streams
    stack.health.stop()
    await stack.kubelet.wait_for(lambda: record.health_error == "stream ended", GUARD)
    await stack.kubelet.wait_for(
        lambda: record.health_streams > opened and bool(stack.kubelet.health(DRIVER)), GUARD
    )


def test_health_message_bytes_decode_to_the_full_list() -> None:
    from densedev._proto import dra_health_v1alpha1_pb2 as pb

    stream = HealthStream(NODE, resend=10, timeout_seconds=30, clock=lambda: 1_700_000_000.5)
    stream.update({VF: True, VF2: False, "mlx5_core.sf.4": True})  # a subfunction has no DRA name
    decoded = pb.NodeWatchResourcesResponse.FromString(stream.message())
    assert [(d.device.pool_name, d.device.device_name, d.health) for d in decoded.devices] == [
        (NODE, names.device_name(VF), pb.HEALTHY),
        (NODE, names.device_name(VF2), pb.UNHEALTHY),
    ]
    assert {d.last_updated_time for d in decoded.devices} == {1_700_000_000}
    assert {d.health_check_timeout_seconds for d in decoded.devices} == {30}
    with pytest.raises(ValueError):
        HealthStream(NODE, resend=30, timeout_seconds=30)


@settings(max_examples=200, deadline=None)
@given(
    pool=st.text(min_size=1, max_size=40),
    functions=st.lists(st.integers(0, 255), min_size=1, max_size=6, unique=True),
    healthy=st.lists(st.booleans(), min_size=6, max_size=6),
    now=st.one_of(st.just(0.0), st.floats(-1e6, 4e9)),
    timeout=st.integers(-5, 1 << 40),
)
def test_health_entries_are_protobufs_own_encoding(
    pool: str, functions: list[int], healthy: list[bool], now: float, timeout: int
) -> None:
    from densedev._proto import dra_health_v1alpha1_pb2 as pb

    ids = [f"0000:3b:{f >> 3:02x}.{f & 7}" for f in functions]
    stream = HealthStream(pool, clock=lambda: now)
    stream.timeout_seconds = timeout  # zero and negative too: what a caller may set
    pairs = list(zip(ids, healthy[: len(ids)], strict=True))
    stream.update(dict(pairs))
    want = pb.NodeWatchResourcesResponse(
        devices=[
            pb.DeviceHealth(
                device=pb.DeviceIdentifier(pool_name=pool, device_name=names.device_name(i)),
                health=pb.HEALTHY if h else pb.UNHEALTHY,
                last_updated_time=int(now),
                health_check_timeout_seconds=timeout,
            )
            for i, h in pairs
        ]
    )
    assert stream.message() == want.SerializeToString()


@settings(max_examples=150, deadline=None)
@given(
    steps=st.lists(
        st.tuples(st.booleans(), st.lists(st.tuples(st.integers(0, 20), st.booleans()), max_size=8)),
        max_size=12,
    )
)
def test_the_message_kept_in_chunks_is_the_whole_list_after_any_updates_and_forgets(
    steps: list[tuple[bool, list[tuple[int, bool]]]],
) -> None:
    # Entries are joined per chunk and only changed chunks are joined again: after any mix of updates
    # and forgets, the message must be every streamed device once, in first-seen order, as it is now.
    from densedev._proto import dra_health_v1alpha1_pb2 as pb
    from densedev.dra import health

    original, health.CHUNK = health.CHUNK, 3
    try:
        stream = HealthStream(NODE, clock=lambda: 1_700_000_000)
        model: dict[str, bool] = {}  # insertion order = first seen since last streamed
        for forget, changes in steps:
            ids = {f"0000:3b:{f >> 3:02x}.{f & 7}": h for f, h in changes}
            if forget:
                stream.forget(ids)
                for i in ids:
                    model.pop(i, None)
            else:
                stream.update(ids)
                for i, h in ids.items():
                    model[i] = h
            decoded = pb.NodeWatchResourcesResponse.FromString(stream.message())
            assert [(d.device.device_name, d.health) for d in decoded.devices] == [
                (names.device_name(i), pb.HEALTHY if h else pb.UNHEALTHY) for i, h in model.items()
            ]
    finally:
        health.CHUNK = original


# -- the composed kubelet plugin ----------------------------------------------------------------------------


async def test_the_kubelet_plugin_recovers_claims_before_its_sockets_exist(root: Path) -> None:
    node = Node(root)
    ref = node.claim(("vf", VF))
    assert (await node.service.prepare([ref]))[ref.uid].error == ""
    registry = root / "registry"
    plugin = node.kubelet_plugin()
    registrations: list[int] = []
    plugin.on_registered = lambda: registrations.append(1)
    sockets_at_recovery: list[bool] = []
    recover = plugin.service.recover

    def spy() -> frozenset[str]:
        sockets_at_recovery.append(
            plugin.plugin.endpoint.exists() or plugin.plugin.registration_socket.exists()
        )
        return recover()

    plugin.service.recover = spy  # type: ignore[method-assign]
    assert await plugin.start() == {VF}
    assert sockets_at_recovery == [False]
    kubelet = DraKubelet(registry, poll=0.05, health_retry=0.1)
    await kubelet.start()
    try:
        await kubelet.wait_for(lambda: registrations == [1] and plugin.health.streams == 1, GUARD)
        # The restarted daemon answers the kubelet's repeat Prepare from its checkpoint, and holds VF.
        answer = (await kubelet.prepare(DRIVER, [(ref.namespace, ref.name, ref.uid)]))[ref.uid]
        assert answer.error == "" and answer.devices[0]["device"] == names.device_name(VF)
        other = node.claim(("vf", VF))
        refused = (await kubelet.prepare(DRIVER, [(other.namespace, other.name, other.uid)]))[other.uid]
        assert "held elsewhere" in refused.error
        plugin.health.update({VF: False})
        await kubelet.wait_for(
            lambda: kubelet.health(DRIVER) == {(NODE, names.device_name(VF)): "UNHEALTHY"}, GUARD
        )
    finally:
        await plugin.stop()
        await kubelet.stop()
    assert not plugin.plugin.endpoint.exists() and not plugin.plugin.registration_socket.exists()


async def test_a_failing_gate_fails_the_claim_with_a_bounded_error(stack: Stack) -> None:
    # A bug met while planning one claim is that claim's error (issue 23, item 6), bounded as every
    # per-claim error is; the call and the server live on.
    await stack.kubelet.wait_for(lambda: DRIVER in stack.kubelet.plugins, GUARD)
    healthy_gate = stack.node.service.gate

    def broken(device_id: str) -> Any:
        raise RuntimeError("x" * 100_000)

    stack.node.service.gate = broken
    claim = stack.ref(("vf", VF))
    error = (await stack.kubelet.prepare(DRIVER, [claim]))[claim[2]].error
    assert "RuntimeError" in error and len(error) <= 1000
    stack.node.service.gate = healthy_gate  # the next call works
    assert (await stack.kubelet.prepare(DRIVER, [claim]))[claim[2]].error == ""


_DAEMON = """
import asyncio, sys
sys.path[:0] = {paths!r}
import uvloop
import helpers.dra as t
from pathlib import Path

async def main():
    root = Path({root!r})
    node = t.Node(root)
    node.claim(("vf", t.VF), name="kept", uid={uid!r})
    plugin = node.kubelet_plugin()
    await plugin.start()
    print("serving", flush=True)
    await asyncio.sleep(600)

uvloop.run(main())
"""


async def test_a_killed_daemon_restarts_recovers_its_claims_and_is_registered_again(
    root: Path, child_env: dict[str, str]
) -> None:
    import signal
    import sys
    import uuid

    from densedev.dra.plugin import KubeletPlugin

    uid = str(uuid.uuid4())
    here = str(Path(__file__).parent)
    claim = ("default", "kept", uid)

    kubelet = DraKubelet(root / "registry", poll=0.05, health_retry=0.1)
    await kubelet.start()
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _DAEMON.format(paths=[here, *sys.path], root=str(root), uid=uid),
        stdout=asyncio.subprocess.PIPE,
        env=child_env,
        cwd=here,
    )
    plugin: KubeletPlugin | None = None
    try:
        assert child.stdout is not None
        assert (await asyncio.wait_for(child.stdout.readline(), GUARD)).strip() == b"serving"
        await kubelet.wait_for(lambda: DRIVER in kubelet.plugins, GUARD)
        first = (await kubelet.prepare(DRIVER, [claim]))[uid]
        assert first.error == ""
        registered = kubelet.plugins[DRIVER]
        child.send_signal(signal.SIGKILL)  # no cleanup: both sockets stay behind, unserved
        await child.wait()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await kubelet.prepare(DRIVER, [claim], timeout=2)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        # The restarted daemon: claims first, then fresh sockets the kubelet registers again.
        plugin = Node(root).kubelet_plugin()
        assert await plugin.start() == {VF}
        await kubelet.wait_for(
            lambda: kubelet.plugins.get(DRIVER) not in (None, registered) and plugin.plugin.registered,
            GUARD,
        )
        assert (await kubelet.prepare(DRIVER, [claim]))[uid] == first
        assert await kubelet.unprepare(DRIVER, [claim]) == {uid: ""}
        assert plugin.service.held() == {}
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()
        if plugin is not None:
            await plugin.stop()
        await kubelet.stop()


async def test_a_change_wakes_the_health_stream_at_the_next_loop_turn() -> None:
    # The flush that changes health goes on (the slices' share of it is queued behind) while the
    # stream waits to run: it must run at the next turn of the loop, not behind more of that work.
    stream = HealthStream(NODE, resend=10, timeout_seconds=30)
    stream.update({VF: True})
    watch = stream._watch(None, None)  # type: ignore[arg-type]
    assert await anext(watch)  # the first message, at once
    pending = asyncio.ensure_future(anext(watch))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not pending.done()  # waiting for a change
    stream.update({VF: False})
    turns = 0
    while not pending.done():
        await asyncio.sleep(0)
        turns += 1
    assert turns <= 2, turns
    assert health_of(pending.result()) == {(NODE, names.device_name(VF)): "UNHEALTHY"}
    await watch.aclose()
