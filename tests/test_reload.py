"""Config reload without restart, through the kubelet emulator: untouched pools stay silent."""

from __future__ import annotations

import asyncio
import copy
import gc
import signal
import subprocess
import sys
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from helpers.metrics import sample
from helpers.node import GUARD_S, NO_FILES, PREFIX, Node, pool, res, three_pools
from helpers.waiting import eventually

from densedev.daemon import Daemon
from densedev.testing.kubelet import KubeletEmulator


@pytest.fixture
def node_options() -> dict[str, Any]:
    """A 4-PF node whose config leaves PF 3 out, so a reload can add a pool for it."""
    return {"config": three_pools}


@pytest.fixture
def daemon_settings() -> dict[str, Any]:
    """No CDI or device-info files: reloads are about the kubelet's view."""
    return NO_FILES


def snapshot(emu: KubeletEmulator) -> dict[str, tuple[int, int]]:
    """Registrations and updates received, per resource."""
    return {r: (emu.registrations(r), len(emu.updates(r))) for r in emu.resources()}


async def test_add_change_reregister_remove_pools_by_editing_the_file(
    node: Node, kubelet: KubeletEmulator, daemon: Daemon
) -> None:
    emu = kubelet
    pfs = node.layout.pfs
    first = [res("pf0"), res("pf1"), res("pf2")]
    await emu.wait_for(lambda: all(emu.updates(r) for r in first), GUARD_S)
    base = snapshot(emu)

    # 1. add a pool for PF 3: it registers with its VFs; nobody else hears a thing.
    doc = copy.deepcopy(node.doc)
    doc["resourceList"].append(pool("pf3", [pfs[3].netdev]))
    node.write_config(doc)
    await emu.wait_for(lambda: bool(emu.updates(res("pf3"))), GUARD_S)
    assert set(emu.devices(res("pf3"))) == set(pfs[3].vf_addresses)
    assert {r: snapshot(emu)[r] for r in first} == base

    # 2. change pf1's selection in place: one new list for pf1, no re-registration.
    doc["resourceList"][1]["selectors"]["pfNames"] = [f"{pfs[1].netdev}#0-3"]
    node.write_config(doc)
    await emu.wait_for(lambda: len(emu.devices(res("pf1"))) == 4, GUARD_S)
    now = snapshot(emu)
    assert now[res("pf1")] == (1, base[res("pf1")][1] + 1)
    assert now[res("pf0")] == base[res("pf0")] and now[res("pf2")] == base[res("pf2")]

    # 3. change pf0's options: the kubelet reads them only at registration, so it re-registers.
    doc["resourceList"][0]["preferredAllocation"] = "none"
    node.write_config(doc)
    await emu.wait_for(lambda: emu.registrations(res("pf0")) == 2, GUARD_S)
    # The new registration's stream opens with one full list.
    await emu.wait_for(lambda: len(emu.updates(res("pf0"))) == base[res("pf0")][1] + 1, GUARD_S)
    options = emu.options(res("pf0"))
    assert options is not None and not options.get_preferred_allocation_available
    assert snapshot(emu)[res("pf2")] == base[res("pf2")]

    # 4. remove pf3: its stream ends (the kubelet marks its devices unhealthy); others silent.
    before = snapshot(emu)
    doc["resourceList"].pop()
    node.write_config(doc)
    await emu.wait_for(lambda: emu.stream_ended(res("pf3")), GUARD_S)
    await emu.wait_for(
        lambda: sample(daemon, "densedev_config_reloads_total", result="success") == 4, GUARD_S
    )
    assert res("pf3") not in daemon.pools
    after = snapshot(emu)
    assert {r: after[r] for r in first} == {r: before[r] for r in first}
    text = daemon.metrics.render().decode()
    assert "densedev_config_reloads_total" in text


async def test_invalid_config_keeps_the_last_good_one(
    node: Node, kubelet: KubeletEmulator, daemon: Daemon
) -> None:
    emu = kubelet
    await emu.wait_for(lambda: all(emu.updates(res(n)) for n in ("pf0", "pf1", "pf2")), GUARD_S)
    base = snapshot(emu)
    node.write_config('{"resourceList": [{"resourceName": "bad name!", "selectors": {"drivers": 5}}]}')
    await emu.wait_for(
        lambda: sample(daemon, "densedev_config_reloads_total", result="failure") == 1, GUARD_S
    )
    await asyncio.sleep(0.2)
    assert snapshot(emu) == base and set(daemon.pools) == set(base)
    # A good file afterwards applies as usual.
    doc = copy.deepcopy(node.doc)
    doc["resourceList"].pop(0)
    node.write_config(doc)
    await emu.wait_for(lambda: emu.stream_ended(res("pf0")), GUARD_S)
    await emu.wait_for(
        lambda: sample(daemon, "densedev_config_reloads_total", result="success") == 1, GUARD_S
    )
    assert set(daemon.pools) == {res("pf1"), res("pf2")}


@pytest.mark.skipif(sys.platform != "linux", reason="signals to a child process")
async def test_sighup_reloads_and_sigterm_exits_cleanly(
    node: Node, kubelet: KubeletEmulator, child_env: dict[str, str]
) -> None:
    emu = kubelet
    env = child_env
    # subprocess (vfork), not the loop's spawner: see densedev.testing.netns on gRPC and fork.
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "densedev.cli",
            "run",
            "--config",
            str(node.config_path),
            "--sysfs-root",
            str(node.sysfs),
            "--kubelet-dir",
            str(node.kubelet_dir),
            "--devinfo-dir",
            "",
            "--resource-prefix",
            PREFIX,
            "--no-netlink",
        ],
        env=env,
        stderr=subprocess.PIPE,
    )
    try:
        await emu.wait_for(lambda: bool(emu.updates(res("pf2"))), GUARD_S)
        # Same mtime granularity is no problem: SIGHUP reloads whatever the file says now.
        doc = copy.deepcopy(node.doc)
        doc["resourceList"].append(pool("pf3", [node.layout.pfs[3].netdev]))
        node.write_config(doc)
        proc.send_signal(signal.SIGHUP)
        await emu.wait_for(lambda: bool(emu.updates(res("pf3"))), GUARD_S)
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(proc.wait, GUARD_S)
        assert code == 0
        assert not [p for p in node.kubelet_dir.iterdir() if p.name.startswith("densedev-")]
    finally:
        if proc.poll() is None:
            proc.kill()
            await asyncio.to_thread(proc.wait)
        assert proc.stderr is not None
        proc.stderr.close()


async def test_a_membership_change_sends_its_whole_list_once_not_again_at_the_next_flush(
    node: Node, kubelet: KubeletEmulator, daemon: Daemon
) -> None:
    # The reload publishes pf1's new list itself; the tracker must not owe that pool a second, identical
    # full list at its next flush (any burst: a link event, an RDMA poll), which the kubelet would take
    # as one more update.
    emu = kubelet
    pf1 = node.layout.pfs[1]
    await emu.wait_for(lambda: len(emu.devices(res("pf1"))) == len(pf1.vf_addresses), GUARD_S)
    doc = copy.deepcopy(node.doc)
    doc["resourceList"][1]["selectors"]["pfNames"] = [f"{pf1.netdev}#0-3"]
    node.write_config(doc)
    await emu.wait_for(lambda: len(emu.devices(res("pf1"))) == 4, GUARD_S)
    sent = sample(daemon, "densedev_listandwatch_messages_total", resource=res("pf1"))
    daemon.handoff.flush()  # what the next burst does, here at once
    assert sample(daemon, "densedev_listandwatch_messages_total", resource=res("pf1")) == sent


async def test_a_reload_stops_its_removed_pools_together(
    node: Node, kubelet: KubeletEmulator, daemon: Daemon
) -> None:
    # One after another, each stop waiting for its stream to end, 1,000 pools took seconds to go.
    # Counted, not timed: every stop has begun before any ends.
    active = peak = 0

    def counted(stop: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[None]]:
        async def stop_counted() -> None:
            nonlocal active, peak
            active += 1
            peak = max(peak, active)
            for _ in range(3):  # a few loop turns: stops running together all start meanwhile
                await asyncio.sleep(0)
            try:
                await stop()
            finally:
                active -= 1

        return stop_counted

    names = set(daemon.pools)
    assert len(names) == 3
    for runtime in daemon.pools.values():
        runtime.runner.stop = counted(runtime.runner.stop)  # type: ignore[method-assign]
    node.write_config({"resourceList": []})  # the file watch reloads it
    await reloaded(daemon)
    assert not daemon.pools and peak == 3
    await kubelet.wait_for(lambda: all(kubelet.stream_ended(r) for r in names), GUARD_S)


async def test_a_pool_removed_by_a_reload_is_freed_although_its_start_froze_it(
    node: Node, kubelet: KubeletEmulator, daemon: Daemon
) -> None:
    # Daemon.start gc.freeze()s what it made, and the collector never looks at frozen objects again:
    # a pool's objects in a reference cycle, or held by grpc's per-call cycles frozen with them, were
    # never freed, and 1,000 pools reloaded to 0 and back held both sets (704 MiB).
    runtime = daemon.pools[res("pf0")]
    server = runtime.runner._server
    assert server is not None
    gone = [weakref.ref(o) for o in (runtime, runtime.allocator, runtime.runner, runtime.feed, server)]
    del runtime, server
    doc = copy.deepcopy(node.doc)
    doc["resourceList"].pop(0)
    node.write_config(doc)  # the file watch reloads it
    await reloaded(daemon)
    assert res("pf0") not in daemon.pools
    # Eventually: a timer of the pool's start (the allocator's deferred preparation) may hold it for
    # half a second more; frozen in a cycle, it would be held for ever.
    await eventually(lambda: all(r() is None for r in gone), "the removed pool freed", limit=10)
    assert gc.get_freeze_count() > 0  # and what lives is frozen again


async def reloaded(daemon: Daemon) -> None:
    """Wait until the daemon has applied one reload whole (counted once applied, not when begun)."""
    await eventually(
        lambda: sample(daemon, "densedev_config_reloads_total", result="success") == 1, "the reload applied"
    )
