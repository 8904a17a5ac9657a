"""PluginRunner against the kubelet emulator: register, follow feeds, survive kubelet restarts."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest
from helpers.plugin import RESOURCE, FakePool, pci_ids

from densedev._proto import api_pb2
from densedev.kubelet.feed import PoolFeed
from densedev.kubelet.registration import KUBELET_SOCKET, PluginRunner
from densedev.testing.kubelet import KubeletEmulator

GUARD = 10.0  # hang guards only: nothing here asserts on speed


def _runner(sock_dir: Path, pool: FakePool, feed: PoolFeed, resource: str = RESOURCE) -> PluginRunner:
    name = resource.replace("/", "_") + ".sock"
    return PluginRunner(resource, sock_dir, name, feed, pool)


@asynccontextmanager
async def _registered(sock_dir: Path, pool: FakePool, feed: PoolFeed) -> AsyncIterator[PluginRunner]:
    """A runner for ``pool``, started after the ``kubelet`` fixture's emulator, stopped on exit."""
    runner = _runner(sock_dir, pool, feed)
    await runner.start()
    try:
        yield runner
    finally:
        await runner.stop()


async def test_registers_and_the_kubelet_gets_the_full_list(kubelet: KubeletEmulator, sock_dir: Path) -> None:
    pool = FakePool(pci_ids(1024))
    feed = PoolFeed(pool.message())

    async with _registered(sock_dir, pool, feed) as runner:
        await kubelet.wait_for(lambda: kubelet.capacity(RESOURCE) == 1024, GUARD)
        assert runner.registered and runner.registrations == 1
        assert kubelet.resources() == [RESOURCE]
        assert list(kubelet.devices(RESOURCE)) == pool.ids
        assert kubelet.allocatable(RESOURCE) == 1024
        assert kubelet.updates(RESOURCE)[0].numa[pool.ids[1]] == (1,)
        # A health flip published to the feed reaches the kubelet as a new whole list.
        for device in pool.ids[256:512]:
            pool.health[device] = False
        feed.publish(pool.message())
        await kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) == 768, GUARD)
        assert kubelet.capacity(RESOURCE) == 1024
        assert kubelet.devices(RESOURCE)[pool.ids[300]] == "Unhealthy"
        last = kubelet.updates(RESOURCE)[-1]
        assert last.capacity == 1024 and last.allocatable == 768
        # Allocate through the kubelet: healthy works, unhealthy/unknown refused as the kubelet does.
        response = await kubelet.allocate(RESOURCE, [pool.ids[0]])
        assert response.envs["PCIDEVICE_EXAMPLE_COM_VF"] == pool.ids[0]
    assert not runner.socket_path.exists()


async def test_waits_for_an_absent_kubelet(sock_dir: Path) -> None:
    pool = FakePool(pci_ids(8))
    feed = PoolFeed(pool.message())

    runner = _runner(sock_dir, pool, feed)
    await runner.start()
    try:
        await asyncio.sleep(0.3)  # a few failed attempts with backoff
        assert not runner.registered and runner.last_error == ""  # no kubelet.sock: nothing tried
        kubelet = KubeletEmulator(sock_dir)
        await kubelet.start()  # deletes our socket, as the kubelet does at start
        try:
            # The kubelet dials ListAndWatch as soon as its Register handler returns, which may be
            # before our side has read that answer: wait for both, not the first.
            await kubelet.wait_for(lambda: kubelet.capacity(RESOURCE) == 8 and runner.registered, GUARD)
            assert runner.registrations == 1
        finally:
            await kubelet.stop()
    finally:
        await runner.stop()


async def test_kubelet_restart_leads_to_reregistration_and_a_fresh_list(
    kubelet: KubeletEmulator, sock_dir: Path
) -> None:
    pool = FakePool(pci_ids(512))
    feed = PoolFeed(pool.message())

    async with _registered(sock_dir, pool, feed) as runner:
        await kubelet.wait_for(lambda: len(kubelet.updates(RESOURCE)) == 1, GUARD)
        first = runner.socket_path.stat()
        await kubelet.restart()
        await kubelet.wait_for(lambda: kubelet.registrations(RESOURCE) == 2, GUARD)
        await kubelet.wait_for(lambda: len(kubelet.updates(RESOURCE)) == 2, GUARD)
        assert runner.registrations == 2 and runner.registered
        fresh = kubelet.updates(RESOURCE)[-1]
        assert list(fresh.devices) == pool.ids and fresh.allocatable == 512
        assert not kubelet.stream_ended(RESOURCE)
        # A fresh server on a fresh socket (the inode number itself may be reused on ext4).
        now = runner.socket_path.stat()
        assert (now.st_ino, now.st_ctime_ns) != (first.st_ino, first.st_ctime_ns)
        # The new stream is live: a flip still arrives.
        pool.health[pool.ids[0]] = False
        feed.publish(pool.message())
        await kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) == 511, GUARD)


async def test_own_socket_deleted_leads_to_a_new_server(kubelet: KubeletEmulator, sock_dir: Path) -> None:
    pool = FakePool(pci_ids(16))
    feed = PoolFeed(pool.message())

    async with _registered(sock_dir, pool, feed) as runner:
        await kubelet.wait_for(lambda: runner.registrations == 1, GUARD)
        runner.socket_path.unlink()
        await kubelet.wait_for(lambda: kubelet.registrations(RESOURCE) == 2, GUARD)
        assert runner.socket_path.is_socket()
        await kubelet.wait_for(lambda: len(kubelet.updates(RESOURCE)) == 2, GUARD)
        assert kubelet.allocatable(RESOURCE) == 16


async def test_refused_name_is_logged_and_other_pools_register(
    kubelet: KubeletEmulator, sock_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    good = FakePool(pci_ids(4))
    bad = FakePool(pci_ids(4, bus=0x5E))
    bad_name = "example.com/-bad-name"

    with caplog.at_level(logging.INFO):
        bad_runner = _runner(sock_dir, bad, PoolFeed(bad.message()), bad_name)
        good_runner = _runner(sock_dir, good, PoolFeed(good.message()))
        await bad_runner.start()
        await good_runner.start()
        try:
            await kubelet.wait_for(lambda: bool(kubelet.refusals) and good_runner.registered, GUARD)
            await kubelet.wait_for(lambda: bad_runner.last_error != "", GUARD)
            assert not bad_runner.registered and bad_runner.registrations == 0
            assert (
                "-bad-name" in bad_runner.last_error
                and "start and end with an alphanumeric" in bad_runner.last_error
            )
            assert kubelet.resources() == [RESOURCE]
            assert kubelet.capacity(RESOURCE) == 4 or await _wait_capacity(kubelet, 4)
        finally:
            await bad_runner.stop()
            await good_runner.stop()
        refused = [r for r in caplog.records if r.levelno == logging.ERROR and "refused" in r.getMessage()]
        assert refused and "-bad-name" in refused[0].getMessage()


async def _wait_capacity(kubelet: KubeletEmulator, count: int) -> bool:
    await kubelet.wait_for(lambda: kubelet.capacity(RESOURCE) == count, GUARD)
    return True


async def test_stop_removes_socket_and_ends_the_stream(kubelet: KubeletEmulator, sock_dir: Path) -> None:
    pool = FakePool(pci_ids(8))

    async with _registered(sock_dir, pool, PoolFeed(pool.message())) as runner:
        await kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) == 8, GUARD)
        await runner.stop()
        assert not runner.socket_path.exists() and not runner.registered
        # The kubelet sees the stream end: capacity kept, nothing allocatable, no redial.
        await kubelet.wait_for(lambda: kubelet.stream_ended(RESOURCE), GUARD)
        assert kubelet.capacity(RESOURCE) == 8 and kubelet.allocatable(RESOURCE) == 0


async def test_registers_again_when_the_kubelet_drops_the_stream(
    kubelet: KubeletEmulator, sock_dir: Path
) -> None:
    pool = FakePool(pci_ids(64))
    feed = PoolFeed(pool.message())

    async with _registered(sock_dir, pool, feed) as runner:
        await kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) == 64, GUARD)
        # The kubelet ends the stream without restarting (kubelet.sock unchanged) and never redials.
        await kubelet.disconnect(RESOURCE)
        assert kubelet.stream_ended(RESOURCE) and kubelet.allocatable(RESOURCE) == 0
        await kubelet.wait_for(lambda: kubelet.registrations(RESOURCE) == 2, GUARD)
        await kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) == 64, GUARD)
        assert runner.registrations == 2 and not kubelet.stream_ended(RESOURCE)


async def test_the_demo_counts_a_device_refused_before_the_kubelet_heard_it_went_unhealthy(
    kubelet: KubeletEmulator, sock_dir: Path
) -> None:
    import random

    from densedev.demo import _allocate_one

    pool = FakePool(pci_ids(1))
    feed = PoolFeed(pool.message())

    async with _registered(sock_dir, pool, feed):
        await kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) == 1, GUARD)
        assert await _allocate_one(kubelet, random.Random(0)) == (1, 0)
        pool.health[pool.ids[0]] = False  # the plugin knows; its update has not gone out yet
        assert await _allocate_one(kubelet, random.Random(0)) == (0, 1)


HAMMERED_POOLS = 12
HAMMER_ROUNDS = 60


async def _options(path: Path) -> tuple[bool, bool]:
    """Ask the device plugin serving on ``path`` for its options."""
    async with grpc.aio.insecure_channel(f"unix:{path}") as channel:
        call = channel.unary_unary(
            "/v1beta1.DevicePlugin/GetDevicePluginOptions",
            request_serializer=api_pb2.Empty.SerializeToString,
            response_deserializer=api_pb2.DevicePluginOptions.FromString,
        )
        got = await call(api_pb2.Empty(), timeout=GUARD)
        return got.pre_start_required, got.get_preferred_allocation_available


async def test_pools_hammered_by_kubelet_restarts_reloads_and_stops_during_start_all_end_registered(
    sock_dir: Path,
) -> None:
    # Every way a pool's server is replaced, at once and over and over, on one loop as in the daemon:
    # kubelet restarts (every socket deleted, every pool serving and registering afresh), reloads that
    # re-register a pool (its runner stopped, a new one started), and a reload's stop arriving while
    # the new runner is still starting (the daemon's start retries run beside reloads).
    import random

    rng = random.Random(14)
    resources = [f"example.com/pool{i}" for i in range(HAMMERED_POOLS)]
    pools = [FakePool(pci_ids(32, bus=0x10 + i)) for i in range(HAMMERED_POOLS)]
    feeds = [PoolFeed(p.message()) for p in pools]

    from densedev.node.watch import DirectoryWatch

    watch = DirectoryWatch(sock_dir)
    assert watch.start()
    # Back-to-back restarts here are milliseconds apart, unlike a real kubelet's: a Register sent
    # after one kubelet.sock was looked at may reach the next kubelet, whose sweep deleted the
    # socket it dials.  The kubelet then fails the call after its dial timeout and the runner
    # registers again at once (kubelet.sock changed); a short timeout keeps that wait short.
    kubelet = KubeletEmulator(sock_dir, dial_timeout=1.0)

    def runner_for(i: int) -> PluginRunner:
        # On a loaded machine a dial of a live socket can outlast that 1 s too, and the kubelet then
        # refuses the registration: retried after 1 s here, not the 30 s a refusal otherwise waits (the
        # settle below would time out waiting when no restart came in between; seen in CI under xdist).
        return PluginRunner(
            resources[i], sock_dir, f"pool{i}.sock", feeds[i], pools[i], watch=watch, refused_retry=1.0
        )

    async def reload(i: int) -> None:
        await runners[i].stop()
        runners[i] = runner_for(i)
        await runners[i].start()

    async def stop_during_start(i: int) -> None:
        await runners[i].stop()
        doomed = runner_for(i)
        starting = asyncio.ensure_future(doomed.start())
        for _ in range(1 + rng.randrange(6)):  # the start has begun: the stop comes after it
            await asyncio.sleep(0)
        await doomed.stop()
        await starting
        runners[i] = runner_for(i)  # the next reload brings the pool back
        await runners[i].start()

    def settled() -> bool:
        return all(
            r.registered and kubelet.allocatable(res) == 32 and not kubelet.stream_ended(res)
            for r, res in zip(runners, resources, strict=True)
        )

    await kubelet.start()
    runners = [runner_for(i) for i in range(HAMMERED_POOLS)]
    await asyncio.gather(*(r.start() for r in runners))
    try:
        for n in range(HAMMER_ROUNDS):
            chosen = rng.sample(range(HAMMERED_POOLS), rng.randrange(1, 5))
            work = [reload(i) if rng.random() < 0.5 else stop_during_start(i) for i in chosen]
            if rng.random() < 0.5:
                work.append(kubelet.restart())
            await asyncio.wait_for(asyncio.gather(*work), GUARD)
            if n % 10 == 9:  # now and then the whole node settles, mid-storm
                await kubelet.wait_for(settled, GUARD)
        await kubelet.wait_for(settled, GUARD)
        # One registration task per pool: no runner stopped while starting lives on.
        names = sorted(t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("registration "))
        assert names == sorted(f"registration {res}" for res in resources)
        # The sockets are exactly the kubelet's and the pools', and a live server answers on each:
        # none belongs to a dead server (connecting to a dead one is refused).
        found = sorted(p.name for p in sock_dir.iterdir() if p.is_socket())
        assert found == sorted([KUBELET_SOCKET, *(r.socket_name for r in runners)])
        for r, pool in zip(runners, pools, strict=True):
            assert await _options(r.socket_path) == pool.options()
    finally:
        await asyncio.gather(*(r.stop() for r in runners))
        await kubelet.stop()
        watch.close()
    assert sorted(p.name for p in sock_dir.iterdir() if p.is_socket()) == []


async def test_registers_again_when_the_kubelet_drops_it_for_a_replaced_instance(
    kubelet: KubeletEmulator, sock_dir: Path
) -> None:
    # Two instances of one pool (a DaemonSet surge): the second registers while the first still streams;
    # the first then stops, and the kubelet (v1.32) disconnects the second.  The second must notice its
    # stream gone and register again, or the resource would stay Unhealthy for good.
    pool = FakePool(pci_ids(8))
    old = PluginRunner(RESOURCE, sock_dir, "old.sock", PoolFeed(pool.message()), pool, stream_grace=0.1)
    new = PluginRunner(RESOURCE, sock_dir, "new.sock", PoolFeed(pool.message()), pool, stream_grace=0.1)
    await old.start()
    try:
        await kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) == 8, GUARD)
        await new.start()
        await kubelet.wait_for(lambda: kubelet.registrations(RESOURCE) == 2, GUARD)
    finally:
        await old.stop()
    try:
        await kubelet.wait_for(lambda: kubelet.registrations(RESOURCE) == 3, GUARD)
        await kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) == 8, GUARD)
        got = await kubelet.create_pod("after", {RESOURCE: 1})
        assert got[RESOURCE][0] in pool.ids and not kubelet.double_holdings
    finally:
        await new.stop()
