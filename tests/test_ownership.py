"""One pod per device across reloads, rescans and restarts, asserted on a strict kubelet emulator.

The kubelet accounts devices per resource name, so a device held by a pod under one resource and then
listed under another is handed to a second pod: the strict emulator raises ``InvariantViolation`` on
the first such double holding.  Each scenario moves in-use VFs to another pool and then lets a second
pod take every device that pool lists.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from helpers.node import GUARD_S, NO_FILES, PREFIX, Node, daemon_on, pool
from helpers.pools import THREE, VF_A, VF_B, VF_C, cfg, ids

from densedev._proto import api_pb2
from densedev.alloc import cdi, devinfo
from densedev.daemon import Daemon
from densedev.kubelet.guard import GuardedService
from densedev.kubelet.sockets import remove_stale_sockets, socket_name_for
from densedev.model import RequestError
from densedev.node.holdings import (
    CHECKPOINT,
    MAX_CHECKPOINT_BYTES,
    PodResourcesClient,
    SourceUnavailable,
    read_checkpoint,
)
from densedev.pools import select as selectors
from densedev.pools.ownership import Ownership, Source
from densedev.testing import simnode
from densedev.testing.kubelet import KubeletEmulator

P1 = f"{PREFIX}/p1"
REST = f"{PREFIX}/rest"
# Two pools of the hand-built sample VFs: x takes the iavf VF, y the other two.
TWO = (
    {"resourceName": "x", "selectors": {"drivers": ["iavf"]}},
    {"resourceName": "y", "selectors": {"drivers": ["vfio-pci", "mlx5_core"]}},
)


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


def break_checkpoint(path: Path, how: str) -> None:
    """Leave the kubelet's checkpoint unreadable the way ``how`` says, for real on disk."""
    if how == "corrupt":
        path.write_bytes(b'{"Data": {"PodDeviceEntries": [{"PodUID": "u", "ResourceName"')  # cut short
    elif how == "symlink":
        target = path.with_name("elsewhere.json")
        target.write_bytes(path.read_bytes())  # a well-formed copy: still refused behind a link
        path.unlink()
        path.symlink_to(target)
    else:  # oversized: a sparse file one byte over the bound, no 64 MiB written
        with path.open("r+b") as f:
            f.truncate(MAX_CHECKPOINT_BYTES + 1)


def unchecked(daemon: Daemon) -> float:
    """The daemon's ``densedev_in_use_unchecked_devices`` gauge."""
    for line in daemon.metrics.render().decode().splitlines():
        if line.startswith("densedev_in_use_unchecked_devices "):
            return float(line.split()[1])
    raise AssertionError("no densedev_in_use_unchecked_devices")


@pytest.mark.parametrize("broken", ["corrupt", "symlink", "oversized"])
async def test_reload_with_no_readable_source_keeps_the_last_known_holdings(
    node: Node,
    kubelet: KubeletEmulator,
    daemon_settings: dict[str, Any],
    pr_dir: Path,
    broken: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 23 item 2: a pod holds two VFs, PodResources and the checkpoint both fail, a reload moves
    the VFs into another pool: they stay withheld, and only a read showing them free releases them."""
    emu = kubelet
    pf0, pf1 = node.layout.pfs
    vfs = pf0.vf_addresses
    held = [vfs[6], vfs[7]]
    async with daemon_on(node, emu, **daemon_settings) as daemon:
        await emu.create_pod("c1", {P1: held})
        # A read after the allocation: from here the holdings are known from PodResources alone (the
        # daemon's own Allocate answers are covered by it and dropped).
        await daemon.ownership.refresh()
        assert daemon.ownership.source is Source.PODRESOURCES
        assert {d: daemon.ownership.held.get(d) for d in held} == {d: {P1} for d in held}
        # Both sources fail: the kubelet's PodResources socket is gone, its checkpoint unreadable (and
        # not rewritten meanwhile, as when the kubelet's writes fail).
        (pr_dir / "kubelet.sock").unlink()
        emu.write_checkpoint = False
        break_checkpoint(node.kubelet_dir / CHECKPOINT, broken)
        with caplog.at_level(logging.INFO, logger="densedev"):
            # p1 shrinks to VFs 0-4: VF 5 (free) and VFs 6-7 (held by c1) fall into rest.
            node.write_config(
                config([pool("p1", [f"{pf0.netdev}#0-4"]), pool("rest", [pf0.netdev, pf1.netdev])])
            )
            await emu.wait_for(lambda: len(emu.devices(P1)) == 5 and vfs[5] in emu.devices(REST), GUARD_S)
        assert not set(held) & set(emu.devices(REST))
        assert daemon.ownership.source is Source.LAST_KNOWN
        assert daemon.ownership.withheld == {REST: tuple(held)}
        said = [r for r in caplog.records if r.getMessage() == "devices withheld: holder cannot be checked"]
        assert len(said) == 1 and unchecked(daemon) == 2
        await take_everything_listed(emu, REST, "c2")  # strict: a double holding raises
        # The pod ends while nothing can be read: no read shows the VFs free, so they stay withheld.
        emu.delete_pod("uid-c1")
        polls = daemon.ownership.refreshes
        await emu.wait_for(lambda: daemon.ownership.refreshes >= polls + 3, GUARD_S)
        assert not set(held) & set(emu.devices(REST)) and unchecked(daemon) == 2
        # The kubelet comes back (it rewrites its checkpoint and serves PodResources again): the first
        # read shows the VFs free, and they join rest.
        emu.write_checkpoint = True
        await emu.restart()
        await emu.wait_for(lambda: all(emu.devices(REST).get(i) == "Healthy" for i in held), GUARD_S)
        assert daemon.ownership.source.checked and unchecked(daemon) == 0  # a read released them
        await emu.create_pod("c3", {REST: held})
        assert emu.double_holdings == []


async def test_start_with_no_readable_source_lists_nothing_until_a_read(
    node: Node,
    kubelet: KubeletEmulator,
    daemon_settings: dict[str, Any],
    pr_dir: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Neither PodResources nor the checkpoint readable at start: any device may be held under the
    resource an earlier run listed it under, so no pool lists anything and no file goes, until a read."""
    emu = kubelet
    pf0, pf1 = node.layout.pfs
    kw = {**daemon_settings, "cdi_dir": node.tmp / "cdi"}
    spec = node.tmp / "cdi" / cdi.spec_file_name(P1)
    async with daemon_on(node, emu, **kw) as first:
        got = (await emu.create_pod("c1", {P1: 3}))[P1]
        await first.stop()
    # While the daemon is down p1 is removed (its VFs fall into rest), the PodResources socket goes
    # and the checkpoint is left cut short.
    node.write_config(config([pool("rest", [pf0.netdev, pf1.netdev])]))
    (pr_dir / "kubelet.sock").unlink()
    emu.write_checkpoint = False
    break_checkpoint(node.kubelet_dir / CHECKPOINT, "corrupt")
    seen = len(emu.updates(REST))
    daemon = node.daemon(**kw)
    with caplog.at_level(logging.INFO, logger="densedev"):
        await daemon.start()
    try:
        await emu.wait_for(lambda: emu.registrations(REST) == 2 and len(emu.updates(REST)) > seen, GUARD_S)
        assert all(not u.devices for u in emu.updates(REST)[seen:])  # not one device, not one message
        assert daemon.ownership.source is Source.UNKNOWN and unchecked(daemon) == 16
        said = [r for r in caplog.records if r.getMessage() == "devices withheld: holder cannot be checked"]
        assert len(said) == 1
        # Asked anyway (the kubelet would not ask for an unlisted device), the plugin refuses.
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await emu.allocate(REST, [pf1.vf_addresses[0]], check=False)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        # c1's containers restart from the kubelet's checkpointed response naming p1's CDI devices.
        assert spec.exists()
        # The kubelet comes back: the first read shows c1's VFs held under p1; rest lists the others.
        emu.write_checkpoint = True
        await emu.restart()
        # Wait for the new registration's list: the old stream may deliver the 13 devices before the
        # restart ends it, and the kubelet then marks them unhealthy until the plugin registers again.
        await emu.wait_for(lambda: emu.registrations(REST) == 3 and emu.allocatable(REST) == 13, GUARD_S)
        assert not set(got) & set(emu.devices(REST))
        assert daemon.ownership.source.checked and unchecked(daemon) == 0  # a read released them
        await take_everything_listed(emu, REST, "c2")
        assert spec.exists() and emu.double_holdings == []
    finally:
        await daemon.stop()


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

    # No checkpoint in its directory is the kubelet's own "nothing allocated": a read, the first one.
    assert await own.refresh() and own.source is Source.CHECKPOINT and own.known
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


async def test_no_readable_source_fails_closed_and_only_a_read_releases(tmp_path: Path) -> None:
    """The parts alone: unknown at start (every member withheld, every Allocate refused), then known,
    then the last known holdings kept through unreadable files, released by a read showing them free."""
    path = tmp_path / CHECKPOINT
    raw = tuple(selectors.build_pools(cfg(*(dict(p, resourcePrefix="a.com") for p in TWO)), THREE))
    x, y = (p.config.full_name for p in raw)
    assert [ids(p) for p in raw] == [[VF_A.id], [VF_B.id, VF_C.id]]

    def write(entries: dict[str, list[str]]) -> None:
        rows = [{"ResourceName": r, "DeviceIDs": {"-1": i}} for r, i in entries.items()]
        path.write_text(json.dumps({"Data": {"PodDeviceEntries": rows or None}, "Checksum": 1}))

    os.mkfifo(path)  # a planted FIFO: not the kubelet's file, and it says nothing
    own = Ownership(path)
    assert not await own.refresh() and own.source is Source.UNKNOWN and not own.known
    pools = own.filter(raw)
    assert [ids(p) for p in pools] == [[], []]
    assert own.withheld == {x: (VF_A.id,), y: (VF_B.id, VF_C.id)}
    assert own.conflicts(x, [VF_A.id]) == {VF_A.id: frozenset({"unchecked"})}
    with pytest.raises(RequestError, match="cannot be read yet") as refused:
        GuardedService(x, _Inner(), own).allocate([VF_A.id])
    assert refused.value.kind == RequestError.PRECONDITION
    # Files: each pool's devices may be held under it by pods an earlier run served.
    assert own.by_resource() == {x: {VF_A.id}, y: {VF_B.id, VF_C.id}} and own.may_be_held("a.com/gone")
    path.unlink()
    write({x: [VF_B.id]})  # a pod holds VF_B under x, which a reload moved into y
    assert await own.refresh() and own.source is Source.CHECKPOINT and own.known
    assert own.would_change()
    own.filter(raw)
    assert own.withheld == {y: (VF_B.id,)} and not own.may_be_held("a.com/gone")
    # Unreadable again, three ways: what was known stays, and so does an answer given meanwhile.
    own.note_allocated(x, [VF_A.id])
    for plant in ("fifo", "symlink", "garbage"):
        path.unlink()
        if plant == "fifo":
            os.mkfifo(path)
        elif plant == "symlink":
            path.symlink_to(tmp_path / "elsewhere")
        else:
            path.write_bytes(b"\x00{")
        assert not await own.refresh() and own.source is Source.LAST_KNOWN and own.known
        assert own.held == {VF_B.id: {x}, VF_A.id: {x}}
        assert not own.would_change()
    # A read that shows VF_B free releases it.
    path.unlink()
    write({x: [VF_A.id]})
    assert await own.refresh() and own.source is Source.CHECKPOINT and own.held == {VF_A.id: {x}}
    assert own.split(raw)[1] == {}


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
