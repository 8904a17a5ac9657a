"""One pod per device across reloads, rescans and restarts, asserted on a strict kubelet emulator.

The kubelet accounts devices per resource name, so a device held by a pod under one resource and then
listed under another is handed to a second pod: the strict emulator raises ``InvariantViolation`` on
the first such double holding.  Each scenario moves in-use VFs to another pool and then lets a second
pod take every device that pool lists.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from helpers.node import GUARD_S, NO_FILES, PREFIX, Node, daemon_on, pool

from densedev._proto import api_pb2
from densedev.alloc import cdi, devinfo
from densedev.daemon import Daemon
from densedev.kubelet.guard import GuardedService
from densedev.kubelet.sockets import remove_stale_sockets, socket_name_for
from densedev.model import RequestError
from densedev.node.holdings import CHECKPOINT, PodResourcesClient, SourceUnavailable, read_checkpoint
from densedev.pools.ownership import Ownership, Source
from densedev.testing import simnode
from densedev.testing.kubelet import KubeletEmulator

P1 = f"{PREFIX}/p1"
REST = f"{PREFIX}/rest"


def config(pools: list[dict[str, Any]]) -> dict[str, Any]:
    """The node's config document with these pools."""
    return {"resourceList": pools, "rdmaPollSeconds": 0.05}


@pytest.fixture
def node_options() -> dict[str, Any]:
    """Two PFs of 8 VFs; pool p1 takes PF 0's VFs, pool rest every VF left (first match wins)."""

    def pools(layout: simnode.NodeLayout) -> dict[str, Any]:
        pf0, pf1 = layout.pfs
        return config([pool("p1", [pf0.netdev]), pool("rest", [pf0.netdev, pf1.netdev])])

    return {"pfs": 2, "vfs_per_pf": 8, "rdma": False, "config": pools}


@pytest.fixture
def kubelet_options(pr_dir: Path) -> dict[str, Any]:
    """A strict emulator (a double holding raises) serving PodResources."""
    return {"pod_resources_socket": pr_dir / "kubelet.sock", "strict": True}


@pytest.fixture
def daemon_settings(pr_dir: Path) -> dict[str, Any]:
    """A daemon asking the emulator's PodResources who holds what."""
    return {**NO_FILES, "pod_resources_socket": pr_dir / "kubelet.sock"}


async def take_everything_listed(emu: KubeletEmulator, resource: str, pod: str) -> list[str]:
    """A second pod asks for every device the resource lists (strict: a double holding raises)."""
    got = await emu.create_pod(pod, {resource: emu.allocatable(resource)})
    return got[resource]


async def released_within(emu: KubeletEmulator, uid: str, resource: str, ids: list[str]) -> float:
    """Delete the pod and return how long until every one of ``ids`` is listed under ``resource``."""
    t0 = time.monotonic()
    emu.delete_pod(uid)
    await emu.wait_for(lambda: all(emu.devices(resource).get(i) == "Healthy" for i in ids), GUARD_S)
    return time.monotonic() - t0


async def test_reload_moving_in_use_vfs_withholds_them_until_released(
    node: Node, kubelet: KubeletEmulator, daemon_settings: dict[str, Any]
) -> None:
    emu = kubelet
    pf0, pf1 = node.layout.pfs
    vfs = pf0.vf_addresses
    held = [vfs[6], vfs[7]]
    cdi_dir, devinfo_dir = node.tmp / "cdi", node.tmp / "devinfo"

    def entries(resource: str) -> set[str]:
        return {
            d["name"] for d in json.loads((cdi_dir / cdi.spec_file_name(resource)).read_text())["devices"]
        }

    def infos() -> set[str]:
        # Hidden files are densedev's own bookkeeping (the ownership record), not device-info files.
        return {p.name for p in devinfo_dir.iterdir() if not p.name.startswith(".")}

    files = {"cdi_dir": cdi_dir, "devinfo_dir": devinfo_dir}
    async with daemon_on(node, emu, **{**daemon_settings, **files}) as daemon:
        await emu.create_pod("c1", {P1: held})
        held_infos = {devinfo.file_name(PREFIX, "p1", i) for i in held}
        assert infos() == held_infos
        # p1 shrinks to VFs 0-4: VF 5 (free) and VFs 6-7 (held by c1) fall into rest.
        node.write_config(config([pool("p1", [f"{pf0.netdev}#0-4"]), pool("rest", [pf0.netdev, pf1.netdev])]))
        await emu.wait_for(lambda: len(emu.devices(P1)) == 5 and vfs[5] in emu.devices(REST), GUARD_S)
        listed = set(emu.devices(REST))
        assert listed == {vfs[5], *pf1.vf_addresses}
        assert daemon.ownership.withheld == {REST: tuple(held)}
        # c1's containers restart from the checkpointed response naming p1's CDI devices: p1 keeps
        # their entries, and the device-info files stay, while c1 holds them.
        assert entries(P1) == {*vfs[:5], *held} and held_infos <= infos()
        await take_everything_listed(emu, REST, "c2")
        assert emu.double_holdings == []
        took = await released_within(emu, "uid-c1", REST, held)
        print(f"withheld-device release latency (PodResources poll): {took * 1e3:.0f} ms")
        assert daemon.ownership.withheld == {}
        await emu.wait_for(lambda: entries(P1) == set(vfs[:5]) and not held_infos & infos(), GUARD_S)
        assert set(held) <= entries(REST)
        await emu.create_pod("c3", {REST: held})  # free now: the kubelet may give them out


async def test_pool_removed_while_in_use(
    node: Node, kubelet: KubeletEmulator, daemon_settings: dict[str, Any]
) -> None:
    emu = kubelet
    pf0, pf1 = node.layout.pfs
    spec = node.tmp / "cdi" / cdi.spec_file_name(P1)
    async with daemon_on(node, emu, **{**daemon_settings, "cdi_dir": node.tmp / "cdi"}) as daemon:
        got = (await emu.create_pod("c1", {P1: 3}))[P1]
        node.write_config(config([pool("rest", [pf0.netdev, pf1.netdev])]))
        free = [a for a in pf0.vf_addresses if a not in got]
        await emu.wait_for(lambda: set(free) <= set(emu.devices(REST)), GUARD_S)
        assert not set(got) & set(emu.devices(REST))
        assert len(emu.devices(REST)) == 13
        metrics = daemon.metrics.render().decode()
        assert f'densedev_pool_withheld_devices{{resource="{REST}"}} 3.0' in metrics
        # The kubelet would not ask for an unlisted device; asked anyway, the plugin refuses it.
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await emu.allocate(REST, [got[0]], check=False)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        # c1's containers restart from the kubelet's checkpointed response, which names p1's CDI
        # devices: the removed pool's spec stays while they are held, and goes once released.
        assert {d["name"] for d in json.loads(spec.read_text())["devices"]} >= set(got)
        await take_everything_listed(emu, REST, "c2")
        await released_within(emu, "uid-c1", REST, got)
        await emu.wait_for(lambda: not spec.exists(), GUARD_S)
        assert emu.double_holdings == []


def _kern_and_vfio(layout: simnode.NodeLayout) -> dict[str, Any]:
    pf0 = layout.pfs[0]
    return config(
        [
            pool("kern", [pf0.netdev], {"drivers": ["mlx5_core"]}),
            pool("vfio", [pf0.netdev], {"drivers": ["vfio-pci"]}),
        ]
    )


@pytest.mark.parametrize(
    "node_options", [{"pfs": 2, "vfs_per_pf": 8, "rdma": False, "config": _kern_and_vfio}]
)
async def test_driver_rebind_moving_a_vf_between_pools_while_in_use(
    node: Node, kubelet: KubeletEmulator, daemon: Daemon
) -> None:
    emu = kubelet
    vfs = node.layout.pfs[0].vf_addresses
    kern, vfio = f"{PREFIX}/kern", f"{PREFIX}/vfio"

    def rebind(address: str) -> None:
        simnode.bind_driver(node.sysfs, address, "vfio-pci")
        # The nodes the kernel makes for a vfio-pci device (plain files stand in for them).
        group = os.path.basename(os.readlink(node.sysfs / "bus/pci/devices" / address / "iommu_group"))
        for rel in ("vfio/vfio", f"vfio/{group}"):
            (node.tmp / "dev" / rel).parent.mkdir(parents=True, exist_ok=True)
            (node.tmp / "dev" / rel).touch()
        daemon.events.on_uevent(("bind", f"/devices/pci0000:00/{address}", (("SUBSYSTEM", "pci"),)))

    await emu.create_pod("c1", {kern: [vfs[1]]})
    rebind(vfs[1])  # the pod's VF, rebound: it now matches vfio
    rebind(vfs[2])  # a free VF, rebound too: it joins vfio at once
    await emu.wait_for(lambda: vfs[2] in emu.devices(vfio) and vfs[1] not in emu.devices(kern), GUARD_S)
    assert vfs[1] not in emu.devices(vfio)
    await take_everything_listed(emu, vfio, "c2")
    await released_within(emu, "uid-c1", vfio, [vfs[1]])
    assert emu.double_holdings == []


@pytest.mark.parametrize("source", ["podresources", "checkpoint"])
async def test_daemon_restarted_in_between_still_withholds(
    node: Node, kubelet: KubeletEmulator, daemon_settings: dict[str, Any], source: str
) -> None:
    """The kubelet keeps the allocations across a daemon restart; the new daemon never lists them."""
    kw = dict(daemon_settings)
    if source == "checkpoint":
        kw["pod_resources_socket"] = None
    emu = kubelet
    pf0, pf1 = node.layout.pfs
    async with daemon_on(node, emu, **kw) as first:
        got = (await emu.create_pod("c1", {P1: 3}))[P1]
        await first.stop()
    node.write_config(config([pool("rest", [pf0.netdev, pf1.netdev])]))
    seen = len(emu.updates(REST))
    async with daemon_on(node, emu, **kw) as daemon:
        assert daemon.ownership.source.value == source
        await emu.wait_for(lambda: emu.registrations(REST) == 2 and len(emu.updates(REST)) > seen, GUARD_S)
        # Not even the first list of the new run names a held device.
        assert all(not set(got) & set(u.devices) for u in emu.updates(REST)[seen:])
        assert len(emu.devices(REST)) == 13
        await take_everything_listed(emu, REST, "c2")
        if source == "podresources":
            await released_within(emu, "uid-c1", REST, got)
        else:
            # The kubelet rewrites its checkpoint after the next admission (not when a pod ends):
            # only then does the fallback see the release, woken by inotify.
            emu.delete_pod("uid-c1")
            await emu.create_pod("c3", {})  # any admission
            await emu.wait_for(lambda: all(i in emu.devices(REST) for i in got), GUARD_S)
        assert emu.double_holdings == []


# ---------------------------------------------------------------------------- the parts alone


class _Inner:
    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def options(self) -> tuple[bool, bool]:
        return False, True

    def allocate(self, ids: Any) -> api_pb2.ContainerAllocateResponse:
        self.calls.append(list(ids))
        return api_pb2.ContainerAllocateResponse()

    def preferred(self, available: Any, must_include: Any, size: int) -> list[str]:
        return list(available)[:size]

    def prestart(self, ids: Any) -> None:
        pass


def test_allocate_refuses_a_device_held_under_another_resource() -> None:
    own = Ownership(None)
    own.note_allocated("a.com/x", ["0000:3b:00.2", "0000:3b:00.3/1"])
    inner = _Inner()
    guarded = GuardedService("a.com/y", inner, own)
    with pytest.raises(RequestError) as refused:
        guarded.allocate(["0000:3b:00.4", "0000:3b:00.2", "0000:3b:00.3/0"])
    assert refused.value.kind == RequestError.PRECONDITION
    assert "0000:3b:00.2" in refused.value.message and "a.com/x" in refused.value.message
    assert inner.calls == []
    guarded.allocate(["0000:3b:00.4"])
    assert own.held["0000:3b:00.4"] == {"a.com/y"}
    # The same resource may be asked again (a container restart re-allocates its own devices).
    GuardedService("a.com/x", inner, own).allocate(["0000:3b:00.2"])


async def test_own_answers_fill_the_gap_until_a_later_source_read(tmp_path: Path) -> None:
    now = [100.0]
    path = tmp_path / CHECKPOINT
    own = Ownership(path, clock=lambda: now[0], grace_s=5.0)

    def write(entries: list[dict[str, Any]] | None) -> None:
        path.write_text(
            json.dumps({"Data": {"PodDeviceEntries": entries, "RegisteredDevices": {}}, "Checksum": 1})
        )

    assert not await own.refresh() and own.source is Source.OWN  # no checkpoint: nothing known
    own.note_allocated("a.com/x", ["0000:3b:00.2"])
    assert await own.refresh() is False and own.held == {"0000:3b:00.2": {"a.com/x"}}
    write(None)  # the checkpoint does not show it yet (written just before the answer)
    now[0] += 1
    assert not await own.refresh() and own.source is Source.CHECKPOINT
    assert own.held == {"0000:3b:00.2": {"a.com/x"}}  # kept: within the grace
    now[0] += 10
    assert await own.refresh() and own.held == {}  # a read well after the answer: released
    # An answer a later read shows is covered by the source: released as soon as the source says.
    own.note_allocated("a.com/x", ["0000:3b:00.3"])
    now[0] += 0.1
    write(
        [
            {
                "PodUID": "u",
                "ContainerName": "c",
                "ResourceName": "a.com/x",
                "DeviceIDs": {"0": ["0000:3b:00.3"]},
            }
        ]
    )
    assert not await own.refresh() and own.held == {"0000:3b:00.3": {"a.com/x"}}
    now[0] += 0.1
    write(None)
    assert await own.refresh() and own.held == {}


def test_read_checkpoint_takes_the_kubelets_shape_and_refuses_planted_files(tmp_path: Path) -> None:
    path = tmp_path / CHECKPOINT
    doc = {
        "Data": {
            "PodDeviceEntries": [
                {
                    "PodUID": "u",
                    "ContainerName": "c",
                    "ResourceName": "a.com/x",
                    "DeviceIDs": {"0": ["A"], "1": ["B"]},
                },
                {
                    "PodUID": "u",
                    "ContainerName": "c",
                    "ResourceName": "a.com/y",
                    "DeviceIDs": {"-1": ["C", 7]},
                },
                {"ResourceName": 3, "DeviceIDs": {"0": ["D"]}},
                "junk",
            ],
            "RegisteredDevices": {"a.com/x": ["A", "B"]},
        },
        "Checksum": 123,
    }
    path.write_text(json.dumps(doc))
    assert read_checkpoint(path) == {("a.com/x", "A"), ("a.com/x", "B"), ("a.com/y", "C")}
    path.write_text(json.dumps({"Data": {"PodDeviceEntries": None, "RegisteredDevices": None}}))
    assert read_checkpoint(path) == frozenset()
    for bad in ("{", "[]", '{"Data": 3}', "[" * 100_000):
        path.write_text(bad)
        with pytest.raises(SourceUnavailable):
            read_checkpoint(path)
    path.unlink()
    target = tmp_path / "elsewhere.json"
    target.write_text(json.dumps(doc))
    path.symlink_to(target)
    with pytest.raises(SourceUnavailable, match=r"symbolic link|Too many"):
        read_checkpoint(path)
    path.unlink()
    os.mkfifo(path)  # would block a plain open() forever
    with pytest.raises(SourceUnavailable, match="not a regular file"):
        read_checkpoint(path)


async def test_pod_resources_client_lists_what_running_pods_hold(
    node: Node, kubelet_options: dict[str, Any], daemon_settings: dict[str, Any]
) -> None:
    client = PodResourcesClient(kubelet_options["pod_resources_socket"], timeout=5)
    with pytest.raises(SourceUnavailable):
        await client.list()  # no kubelet yet
    emu = node.emulator(**kubelet_options)
    await emu.start()
    try:
        async with daemon_on(node, emu, **daemon_settings):
            got = await emu.create_pod("c1", {P1: 2, REST: 1})
            assert await client.list() == {(P1, i) for i in got[P1]} | {(REST, i) for i in got[REST]}
            emu.delete_pod("uid-c1")
            assert await client.list() == frozenset()
    finally:
        await emu.stop()
    with pytest.raises(SourceUnavailable):
        await client.list()  # kubelet gone
    await client.close()


def test_stale_sockets_of_removed_pools_go_and_nothing_else(sock_dir: Path) -> None:
    d = sock_dir
    keep = socket_name_for(P1, d)
    dead = socket_name_for(f"{PREFIX}/gone", d)
    socks = []
    for name in (keep, dead, "densedev-live.sock", "other-plugin.sock"):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(str(d / name))
        if name == "densedev-live.sock":
            s.listen()  # someone serves it: not ours to remove
        socks.append(s)
    for s in socks:
        if s.fileno() >= 0 and not s.getsockname().endswith("live.sock"):
            s.close()  # the killed run's sockets: nobody listens any more
    (d / "densedev-file.sock").write_text("not a socket")
    (d / "densedev-link.sock").symlink_to(d / dead)
    assert remove_stale_sockets(d, {keep}) == [dead]
    assert sorted(os.listdir(d)) == sorted(
        [keep, "densedev-live.sock", "other-plugin.sock", "densedev-file.sock", "densedev-link.sock"]
    )
    for s in socks:
        s.close()


async def test_start_removes_the_socket_of_a_pool_removed_meanwhile(
    node: Node, daemon_settings: dict[str, Any]
) -> None:
    stale = node.kubelet_dir / socket_name_for(f"{PREFIX}/gone", node.kubelet_dir)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(stale))
    s.close()
    daemon = node.daemon(**daemon_settings)
    await daemon.start()
    try:
        assert not stale.exists()
        await asyncio.sleep(0)
    finally:
        await daemon.stop()
