"""The inotify watch of the kubelet's directory, and runners that wake on it instead of polling."""

from __future__ import annotations

import asyncio
import os
import shutil
import struct
from pathlib import Path

from helpers.plugin import RESOURCE, FakePool, pci_ids

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
