"""A pool's first ListAndWatch answer is its whole list, filtered by ownership, however early it is asked.

The kubelet takes every ListAndWatch message as the whole device set of the resource
(devicemanager ``genericDeviceUpdateCallback``): a first answer sent before the pool's list exists
would withdraw its devices, and one sent before ownership filtered it would offer a device a pod holds.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from helpers.node import GUARD_S, Node, daemon_on, pool, res
from helpers.plugin import RESOURCE, FakePool, pci_ids, serving

from densedev._proto import api_pb2
from densedev.kubelet.feed import PoolFeed
from densedev.node.scanner import DeviceTable, Scanner
from densedev.testing.kubelet import KubeletEmulator


def _raw_stream(channel: grpc.aio.Channel) -> Any:
    return channel.unary_stream(
        "/v1beta1.DevicePlugin/ListAndWatch",
        request_serializer=api_pb2.Empty.SerializeToString,
        response_deserializer=lambda data: data,  # the bytes exactly as sent
    )


async def _until(condition: Callable[[], bool]) -> None:
    """Wait until ``condition`` holds (GUARD_S is a hang guard, not a timing assertion)."""
    async with asyncio.timeout(GUARD_S):
        while not condition():
            await asyncio.sleep(0.005)


async def test_a_stream_opened_before_the_first_list_waits_for_it(sock_dir: Path) -> None:
    """Fails before the fix: the stream got the feed's default, an empty list, at once."""
    pool = FakePool(pci_ids(64))
    feed = PoolFeed()  # served before any list exists
    async with (
        serving(RESOURCE, sock_dir / "vf.sock", pool, feed) as server,
        grpc.aio.insecure_channel(f"unix:{sock_dir / 'vf.sock'}") as channel,
    ):
        stream = _raw_stream(channel)(api_pb2.Empty())
        # The handler runs (the stream is counted) before the list exists ...
        await _until(lambda: server.streams == 1)
        feed.publish(pool.message())
        # ... and its first answer is the whole list published after it opened.
        first = await stream.read()
        assert first == pool.message()
        assert [d.ID for d in api_pb2.ListAndWatchResponse.FromString(first).devices] == pool.ids
        stream.cancel()


async def test_an_empty_pool_list_is_a_list(sock_dir: Path) -> None:
    """A pool with no devices answers its (empty) list at once, as before: b"" published is a list."""
    pool = FakePool([])
    feed = PoolFeed()
    feed.publish(pool.message())
    assert feed.listed and feed.latest() == (1, b"")
    async with (
        serving(RESOURCE, sock_dir / "vf.sock", pool, feed),
        grpc.aio.insecure_channel(f"unix:{sock_dir / 'vf.sock'}") as channel,
    ):
        stream = _raw_stream(channel)(api_pb2.Empty())
        assert await stream.read() == b""
        stream.cancel()


async def test_a_stream_waiting_for_the_first_list_ends_with_the_server(sock_dir: Path) -> None:
    """Stopping the server ends a stream still waiting for its first list: no hang, nothing sent."""
    pool = FakePool(pci_ids(8))
    async with (
        serving(RESOURCE, sock_dir / "vf.sock", pool, PoolFeed()) as server,
        grpc.aio.insecure_channel(f"unix:{sock_dir / 'vf.sock'}") as channel,
    ):
        stream = _raw_stream(channel)(api_pb2.Empty())
        await _until(lambda: server.streams == 1)
        await server.stop()
        assert await stream.read() == grpc.aio.EOF
        assert server.streams == 0


class _SlowScanner(Scanner):
    """A scanner whose full scans take as long as a big node's (kernel-bound, ~0.2 s at 16k devices)."""

    def __init__(self, root: Path, delay_s: float) -> None:
        super().__init__(root)
        self.delay_s = delay_s
        self.scans = 0

    def scan(self, previous: DeviceTable | None = None, *, threads: bool = True) -> DeviceTable:
        self.scans += 1
        time.sleep(self.delay_s)  # blocking, as the real scan's syscalls are
        return super().scan(previous, threads=threads)


P1, P2, REST = res("p1"), res("p2"), res("rest")


async def test_the_kubelet_asking_at_once_gets_the_whole_filtered_list_first(
    node: Node, kubelet: KubeletEmulator
) -> None:
    """A kubelet that is there from the start, a slow scan, VFs a pod of an earlier run holds under a
    resource the config no longer has: each pool's first message lists its whole membership but the
    held VFs (a start that serves or registers while the scan runs must keep this)."""
    emu = kubelet
    pf0, pf1 = node.layout.pfs[:2]
    node.write_config({"resourceList": [pool("p1", [pf0.netdev])]})
    async with daemon_on(node, emu, pod_resources_socket=None) as first:
        pf0_vfs = set(emu.devices(P1))
        held = set((await emu.create_pod("c1", {P1: 2}))[P1])
        await first.stop()
    # The held VFs now fall to another resource: only the ownership read keeps them out of its list.
    node.write_config({"resourceList": [pool("rest", [pf0.netdev]), pool("p2", [pf1.netdev])]})
    daemon = node.daemon(pod_resources_socket=None)
    slow = _SlowScanner(node.sysfs, 0.3)
    daemon.rediscovery.scanner = slow  # the start's full scan is the rediscovery's
    try:
        await daemon.start()
        await node.wait_listed(emu, daemon)
        assert slow.scans == 1
        assert emu.updates(REST)[0].devices and set(emu.updates(REST)[0].devices) == pf0_vfs - held
        assert set(emu.updates(P2)[0].devices) == set(pf1.vf_addresses)
    finally:
        await daemon.stop()
    assert emu.double_holdings == []
