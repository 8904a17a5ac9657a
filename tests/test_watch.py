"""The inotify watch of the kubelet's directory, and runners that wake on it instead of polling."""

from __future__ import annotations

import asyncio
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

from helpers.plugin import RESOURCE, FakePool, pci_ids
from helpers.waiting import eventually

from densedev.kubelet.feed import PoolFeed
from densedev.kubelet.registration import PluginRunner
from densedev.node.watch import IN_CREATE, IN_DELETE, IN_IGNORED, DirectoryWatch, parse_events
from densedev.testing.kubelet import KubeletEmulator

GUARD = 10.0  # hang guards only
NEVER = 3600.0  # a poll interval no test waits for: only the watch can wake the runner


def _event(wd: int, mask: int, name: bytes, pad: int = 0) -> bytes:
    body = name + b"\0" * pad
    return struct.pack("<iIII", wd, mask, 0, len(body)) + body


def test_parse_events_splits_records_and_drops_a_truncated_tail() -> None:
    data = _event(1, IN_CREATE, b"kubelet.sock", 4) + _event(1, IN_DELETE, b"") + _event(2, IN_IGNORED, b"x")
    assert parse_events(data) == [(1, IN_CREATE, b"kubelet.sock"), (1, IN_DELETE, b""), (2, IN_IGNORED, b"x")]
    assert parse_events(data[:-1]) == [(1, IN_CREATE, b"kubelet.sock"), (1, IN_DELETE, b"")]
    assert parse_events(b"\x01\x02") == []


async def test_watch_wakes_subscribers_on_create_delete_and_rename(sock_dir: Path) -> None:
    watch = DirectoryWatch(sock_dir)
    assert watch.start() and watch.active
    woken = asyncio.Event()
    calls = []

    def wake() -> None:
        calls.append(1)
        woken.set()

    unsubscribe = watch.subscribe(wake)
    try:
        for change in (
            lambda: (sock_dir / "a").write_bytes(b""),
            lambda: os.rename(sock_dir / "a", sock_dir / "b"),
            lambda: (sock_dir / "b").unlink(),
        ):
            woken.clear()
            change()
            await asyncio.wait_for(woken.wait(), GUARD)
        # Writing into an existing file is no create, delete or move: nobody is woken.
        (sock_dir / "c").write_bytes(b"")
        await asyncio.wait_for(woken.wait(), GUARD)
        woken.clear()
        with open(sock_dir / "c", "ab") as f:
            f.write(b"more")
        await asyncio.sleep(0.2)
        assert not woken.is_set()
        unsubscribe()
        seen = len(calls)
        (sock_dir / "d").write_bytes(b"")
        await asyncio.sleep(0.2)
        assert len(calls) == seen and watch.events > 0
    finally:
        watch.close()


async def test_a_removed_directory_is_watched_again_once_it_is_back(sock_dir: Path) -> None:
    inner = sock_dir / "device-plugins"
    inner.mkdir()
    watch = DirectoryWatch(inner)
    woken = asyncio.Event()
    watch.subscribe(woken.set)
    try:
        assert watch.start()
        shutil.rmtree(inner)
        await asyncio.wait_for(woken.wait(), GUARD)
        assert not watch.active and not watch.rewatch()  # gone: callers poll meanwhile
        inner.mkdir()
        assert watch.rewatch() and watch.active
        woken.clear()
        (inner / "kubelet.sock").write_bytes(b"")
        await asyncio.wait_for(woken.wait(), GUARD)
    finally:
        watch.close()
    assert not watch.active


async def test_a_missing_directory_is_no_error(sock_dir: Path) -> None:
    watch = DirectoryWatch(sock_dir / "absent")
    try:
        assert not watch.start() and not watch.active
    finally:
        watch.close()


def _runner(sock_dir: Path, pool: FakePool, feed: PoolFeed, watch: DirectoryWatch) -> PluginRunner:
    # Polling so slow that no test sees it: every wake-up below comes from the watch or the server.
    return PluginRunner(
        RESOURCE, sock_dir, "example.sock", feed, pool, poll=NEVER, watch=watch, watched_poll=NEVER
    )


async def test_a_watching_runner_follows_kubelet_restarts_without_polling(sock_dir: Path) -> None:
    pool = FakePool(pci_ids(16))
    feed = PoolFeed(pool.message())

    watch = DirectoryWatch(sock_dir)
    assert watch.start()
    runner = _runner(sock_dir, pool, feed, watch)
    await runner.start()  # before the kubelet: it waits for kubelet.sock to appear
    kubelet = KubeletEmulator(sock_dir)
    try:
        await asyncio.sleep(0.1)
        await kubelet.start()
        await kubelet.wait_for(lambda: kubelet.capacity(RESOURCE) == 16, GUARD)
        for n in (2, 3):
            # The runner's Register call must have returned before the kubelet goes again: a restart
            # while it is in flight fails that call (UNAVAILABLE) after the emulator counted it, and the
            # runner's retry is one registration for it, two for the emulator (seen under load).
            await kubelet.wait_for(lambda n=n: runner.registrations == n - 1, GUARD)
            await kubelet.restart()  # our socket deleted, kubelet.sock recreated
            await kubelet.wait_for(lambda n=n: kubelet.registrations(RESOURCE) == n, GUARD)
            await kubelet.wait_for(lambda: kubelet.capacity(RESOURCE) == 16, GUARD)
        await kubelet.wait_for(lambda: runner.registrations == 3, GUARD)
    finally:
        await runner.stop()
        await kubelet.stop()
        watch.close()


async def test_a_watching_runner_registers_again_when_its_stream_is_dropped(sock_dir: Path) -> None:
    pool = FakePool(pci_ids(16))
    feed = PoolFeed(pool.message())

    watch = DirectoryWatch(sock_dir)
    assert watch.start()
    kubelet = KubeletEmulator(sock_dir)
    await kubelet.start()
    runner = _runner(sock_dir, pool, feed, watch)
    await runner.start()
    try:
        await kubelet.wait_for(lambda: kubelet.capacity(RESOURCE) == 16, GUARD)
        # No file changes here: the server's stream-ended hook is what wakes the runner.
        await kubelet.disconnect(RESOURCE)
        await kubelet.wait_for(lambda: kubelet.registrations(RESOURCE) == 2, GUARD)
        await kubelet.wait_for(lambda: not kubelet.stream_ended(RESOURCE), GUARD)
    finally:
        await runner.stop()
        await kubelet.stop()
        watch.close()


async def test_a_subscriber_of_named_entries_is_woken_by_those_only(sock_dir: Path) -> None:
    watch = DirectoryWatch(sock_dir)
    assert watch.start()
    calls: dict[str, int] = {"a": 0, "b": 0, "all": 0}

    def counter(key: str) -> Callable[[], None]:
        def wake() -> None:
            calls[key] += 1

        return wake

    watch.subscribe(counter("a"), names=("kubelet.sock", "a.sock"))
    unsubscribe_b = watch.subscribe(counter("b"), names=("kubelet.sock", "b.sock"))
    watch.subscribe(counter("all"))
    try:
        # Exact counts for the named subscribers; one read may hold several records, so everything-
        # subscribers are woken once or more per batch.
        (sock_dir / "a.sock").write_bytes(b"")
        await _seen(watch, sock_dir)
        assert calls["a"] == 1 and calls["b"] == 0 and calls["all"] >= 1
        (sock_dir / "kubelet.sock").write_bytes(b"")
        await _seen(watch, sock_dir)
        assert calls["a"] == 2 and calls["b"] == 1
        unsubscribe_b()
        (sock_dir / "b.sock").write_bytes(b"")
        (sock_dir / "kubelet.sock").unlink()
        await _seen(watch, sock_dir)
        assert calls["a"] == 3 and calls["b"] == 1
        # The directory itself going names no entry: everyone still subscribed looks.
        everything = calls["all"]
        shutil.rmtree(sock_dir)
        await eventually(lambda: not watch.active, "the directory's removal seen")
        assert calls["a"] >= 4 and calls["all"] > everything and calls["b"] == 1
    finally:
        watch.close()


async def _seen(watch: DirectoryWatch, sock_dir: Path) -> None:
    """Plant a sentinel entry and wait until the watch has read it: every change before it was read too
    (inotify reports a directory's events in order)."""
    before = watch.events
    sentinel = sock_dir / "sentinel"
    if sentinel.exists():
        sentinel.unlink()
    else:
        sentinel.write_bytes(b"")
    await eventually(lambda: watch.events > before, "the sentinel read")


async def test_a_pool_socket_coming_and_going_wakes_no_other_pool(sock_dir: Path) -> None:
    # Each runner looks at kubelet.sock and its own socket only.  Woken by every pool's socket, 1,000
    # pools took 15 s to reload to 0 (each stop woke the 999 others, each of which made two stats).
    watch = DirectoryWatch(sock_dir)
    assert watch.start()
    kubelet = KubeletEmulator(sock_dir, checkpoint=False)
    await kubelet.start()
    runners = []
    for i in range(8):
        pool = FakePool(pci_ids(2, bus=0x10 + i))
        resource = f"example.com/vf{i}"
        runners.append(
            PluginRunner(
                resource,
                sock_dir,
                f"vf{i}.sock",
                PoolFeed(pool.message()),
                pool,
                poll=NEVER,
                watch=watch,
                watched_poll=NEVER,
            )
        )
    try:
        await asyncio.gather(*(r.start() for r in runners))
        await kubelet.wait_for(lambda: all(r.registered for r in runners), GUARD)
        await _seen(watch, sock_dir)
        before = watch.wakeups
        await runners[0].stop()  # its socket goes
        await _seen(watch, sock_dir)
        assert watch.wakeups == before
        await runners[0].start()  # its socket comes back: only it looks
        await kubelet.wait_for(lambda: runners[0].registered, GUARD)
        await _seen(watch, sock_dir)
        assert watch.wakeups - before <= 2
        # A kubelet restart (every socket deleted, kubelet.sock created again) still wakes them all.
        await kubelet.restart()
        await kubelet.wait_for(
            lambda: all(kubelet.registrations(r.resource) == 2 for r in runners[1:]), GUARD
        )
    finally:
        await asyncio.gather(*(r.stop() for r in runners))
        await kubelet.stop()
        watch.close()
