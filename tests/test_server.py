"""PluginServer: raw ListAndWatch bytes from the feed, Allocate status mapping, socket lifecycle."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest
from helpers.plugin import RESOURCE, FakePool, pci_ids, serving

from densedev._proto import api_pb2
from densedev.kubelet.feed import PoolFeed
from densedev.kubelet.server import PluginServer


def _raw_stream(channel: grpc.aio.Channel) -> Any:
    return channel.unary_stream(
        "/v1beta1.DevicePlugin/ListAndWatch",
        request_serializer=api_pb2.Empty.SerializeToString,
        response_deserializer=lambda data: data,  # keep the bytes exactly as sent
    )


def _unary(channel: grpc.aio.Channel, method: str, response: Any) -> Any:
    return channel.unary_unary(
        f"/v1beta1.DevicePlugin/{method}",
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=response.FromString,
    )


async def test_list_and_watch_sends_feed_bytes_unchanged(sock_dir: Path) -> None:
    pool = FakePool(pci_ids(300))
    feed = PoolFeed(pool.message())

    async with (
        serving(RESOURCE, sock_dir / "vf.sock", pool, feed),
        grpc.aio.insecure_channel(f"unix:{sock_dir / 'vf.sock'}") as channel,
    ):
        stream = _raw_stream(channel)(api_pb2.Empty())
        first = await stream.read()
        assert first == feed.latest()[1]
        decoded = api_pb2.ListAndWatchResponse.FromString(first)
        assert [d.ID for d in decoded.devices] == pool.ids
        assert {d.health for d in decoded.devices} == {"Healthy"}
        # Two publishes before the reader looks: it skips straight to the newest.
        pool.health[pool.ids[5]] = False
        feed.publish(pool.message())
        pool.health[pool.ids[6]] = False
        feed.publish(pool.message())
        second = await stream.read()
        assert second == feed.latest()[1]
        decoded = api_pb2.ListAndWatchResponse.FromString(second)
        unhealthy = [d.ID for d in decoded.devices if d.health == "Unhealthy"]
        assert unhealthy == [pool.ids[5], pool.ids[6]]
        stream.cancel()


async def test_unary_calls_and_status_mapping(sock_dir: Path) -> None:
    pool = FakePool(pci_ids(16), pre_start=True)
    pool.health[pool.ids[3]] = False
    feed = PoolFeed(pool.message())

    async with (
        serving(RESOURCE, sock_dir / "vf.sock", pool, feed),
        grpc.aio.insecure_channel(f"unix:{sock_dir / 'vf.sock'}") as channel,
    ):
        options = await _unary(channel, "GetDevicePluginOptions", api_pb2.DevicePluginOptions)(
            api_pb2.Empty()
        )
        assert options.pre_start_required and options.get_preferred_allocation_available
        allocate = _unary(channel, "Allocate", api_pb2.AllocateResponse)

        def request(*groups: list[str]) -> api_pb2.AllocateRequest:
            return api_pb2.AllocateRequest(
                container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=g) for g in groups]
            )

        ok = await allocate(request([pool.ids[0], pool.ids[1]]))
        assert len(ok.container_responses) == 1
        assert ok.container_responses[0].envs["PCIDEVICE_EXAMPLE_COM_VF"] == ",".join(pool.ids[:2])

        async def status(req: api_pb2.AllocateRequest) -> tuple[grpc.StatusCode, str]:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await allocate(req)
            return err.value.code(), err.value.details() or ""

        code, text = await status(request([pool.ids[0], "0000:99:00.1"]))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "0000:99:00.1" in text and RESOURCE in text
        code, text = await status(request([pool.ids[3]]))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and pool.ids[3] in text
        code, text = await status(request([pool.ids[0]], [pool.ids[1]]))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "exactly one container request, got 2" in text
        code, text = await status(request())
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "got 0" in text
        code, text = await status(request(["explode"]))
        assert code == grpc.StatusCode.INTERNAL and "ZeroDivisionError" in text

        preferred = await _unary(channel, "GetPreferredAllocation", api_pb2.PreferredAllocationResponse)(
            api_pb2.PreferredAllocationRequest(
                container_requests=[
                    api_pb2.ContainerPreferredAllocationRequest(
                        available_deviceIDs=pool.ids[4:10],
                        must_include_deviceIDs=[pool.ids[7]],
                        allocation_size=3,
                    )
                ]
            )
        )
        assert list(preferred.container_responses[0].deviceIDs) == [pool.ids[7], *pool.ids[4:6]]

        prestart = _unary(channel, "PreStartContainer", api_pb2.PreStartContainerResponse)
        await prestart(api_pb2.PreStartContainerRequest(devices_ids=[pool.ids[2]]))
        assert pool.prestarted == [[pool.ids[2]]]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await prestart(api_pb2.PreStartContainerRequest(devices_ids=[pool.ids[3]]))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        # The server survived every failure: the stream still opens and sends the list.
        stream = _raw_stream(channel)(api_pb2.Empty())
        assert await stream.read() == feed.latest()[1]
        stream.cancel()


async def test_stop_ends_streams_and_removes_socket(sock_dir: Path) -> None:
    pool = FakePool(pci_ids(4))
    feed = PoolFeed(pool.message())
    path = sock_dir / "vf.sock"

    server = PluginServer(RESOURCE, path, feed, pool)
    await server.start()
    assert path.is_socket() and server.running
    async with grpc.aio.insecure_channel(f"unix:{path}") as channel:
        stream = _raw_stream(channel)(api_pb2.Empty())
        assert await stream.read() == feed.latest()[1]
        await server.stop(grace=5.0)  # the stream must end at once, not after the grace
        assert await stream.read() == grpc.aio.EOF
    assert not path.exists() and not server.running
    await server.stop()  # idempotent


async def test_start_replaces_stale_socket_but_not_other_files(sock_dir: Path) -> None:
    import socket

    pool = FakePool(pci_ids(2))
    stale = sock_dir / "vf.sock"
    leftover = socket.socket(socket.AF_UNIX)
    leftover.bind(str(stale))
    leftover.close()
    regular = sock_dir / "file.sock"
    regular.write_text("not a socket")

    server = PluginServer(RESOURCE, stale, PoolFeed(pool.message()), pool)
    await server.start()
    await server.stop()
    with pytest.raises(FileExistsError, match="not a socket"):
        await PluginServer(RESOURCE, regular, PoolFeed(), pool).start()
    assert regular.read_text() == "not a socket"


async def test_a_socket_deleted_as_the_server_starts_leaves_nothing_running(
    sock_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A kubelet restart deletes every socket in its directory (the device manager's start-up) at any
    # moment, also between our bind and the end of our start.  Seen under load in the 50-restarts fault
    # test: start() raised FileNotFoundError after the gRPC server was up, with the server marked
    # running but never stopped (its finaliser then complained with the loop gone).
    pool = FakePool(pci_ids(2))
    path = sock_dir / "vf.sock"
    real_server = grpc.aio.server

    def server_whose_socket_vanishes(*args: Any, **kw: Any) -> Any:
        inner = real_server(*args, **kw)
        real_start = inner.start

        async def start() -> None:
            await real_start()
            path.unlink()  # the kubelet's clean-up, right as our start completes

        inner.start = start
        return inner

    server = PluginServer(RESOURCE, path, PoolFeed(pool.message()), pool)
    monkeypatch.setattr(grpc.aio, "server", server_whose_socket_vanishes)
    try:
        await server.start()
    except OSError:
        assert not server.running  # a start that failed leaves nothing serving
    else:
        # Started: the identity is the socket we bound, so the registration loop sees it gone.
        assert server.running and not server.intact
    finally:
        monkeypatch.undo()
        await server.stop()


async def test_open_streams_do_not_starve_unary_calls(sock_dir: Path) -> None:
    pools = [FakePool(pci_ids(1024, bus=0x10 + n * 8)) for n in range(4)]
    feeds = [PoolFeed(p.message()) for p in pools]

    servers = [
        PluginServer(f"example.com/pool{n}", sock_dir / f"p{n}.sock", feeds[n], pools[n]) for n in range(4)
    ]
    for server in servers:
        await server.start()
    channels = [grpc.aio.insecure_channel(f"unix:{s.socket_path}") for s in servers]
    streams = [_raw_stream(c)(api_pb2.Empty()) for c in channels]
    received = [0] * 4
    stop = asyncio.Event()

    async def read(n: int) -> None:
        while await streams[n].read() != grpc.aio.EOF:
            received[n] += 1

    async def churn() -> None:
        flip = 0
        while not stop.is_set():
            for pool, feed in zip(pools, feeds, strict=True):
                pool.health[pool.ids[flip % 500]] ^= True  # ids 500+ stay for Allocate
                feed.publish(pool.message())
            flip += 1
            await asyncio.sleep(0)

    readers = [asyncio.create_task(read(n)) for n in range(4)]
    churner = asyncio.create_task(churn())
    try:
        # 80 Allocate calls interleaved with a stream storm on every pool: all must be answered.
        for call in range(80):
            n = call % 4
            allocate = _unary(channels[n], "Allocate", api_pb2.AllocateResponse)
            device = pools[n].ids[500 + call]
            response = await asyncio.wait_for(
                allocate(
                    api_pb2.AllocateRequest(
                        container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=[device])]
                    )
                ),
                60,  # a hang guard, not a speed assertion
            )
            assert response.container_responses[0].envs["PCIDEVICE_EXAMPLE_COM_VF"] == device
        assert all(count > 1 for count in received)
    finally:
        stop.set()
        await churner
        for server in servers:
            await server.stop()
        await asyncio.gather(*readers)
        for channel in channels:
            await channel.close(None)
