"""The daemon against the real kernel: PF netdevs are veth links in a namespace the test creates.

The simulated sysfs tree names the PFs' interfaces; the same names exist as real links inside the
namespace, so rtnetlink events, parsed by the accelerator, drive the health the kubelet emulator sees.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.metrics import sample
from helpers.node import numvfs_uevent

from densedev.daemon import Daemon, DaemonSettings
from densedev.node.events import NETLINK_KOBJECT_UEVENT, open_netlink_socket, resolve_netns
from densedev.pools import config as config_mod
from densedev.testing import simnode
from densedev.testing.kubelet import HEALTHY, UNHEALTHY, KubeletEmulator
from densedev.testing.netns import aip, ip

GUARD_S = 20.0
PREFIX = "example.com"
pytestmark = pytest.mark.netns


@pytest.fixture
def kubelet_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="dd-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def start_node(tmp: Path, ns: str) -> tuple[simnode.NodeLayout, Path]:
    sysfs = tmp / "sys"
    layout = simnode.build_node(sysfs, pfs=4, vfs_per_pf=8)
    for i, pf in enumerate(layout.pfs):
        ip(ns, "link", "add", pf.netdev, "type", "veth", "peer", "name", f"peer{i}")
        ip(ns, "link", "set", f"peer{i}", "up")
        ip(ns, "link", "set", pf.netdev, "up")
    doc = {
        "resourceList": [
            {
                "resourceName": f"sriov_{pf.netdev}",
                "resourcePrefix": PREFIX,
                "selectors": {"pfNames": [pf.netdev]},
                "healthPolicy": {"holdDownSeconds": 0.3},
            }
            for pf in layout.pfs
        ]
    }
    (tmp / "config.json").write_text(json.dumps(doc))
    return layout, sysfs


def make_daemon(tmp: Path, sysfs: Path, kubelet_dir: Path, ns: str) -> Daemon:
    settings = DaemonSettings(
        sysfs_root=sysfs,
        kubelet_dir=kubelet_dir,
        dev_root=tmp / "dev",
        resource_prefix=PREFIX,
        netlink=True,
        netns=ns,
    )
    return Daemon(settings, config_mod.load(tmp / "config.json", default_prefix=PREFIX))


async def test_pf_down_and_up_on_a_real_link(tmp_path: Path, netns: str, kubelet_dir: Path) -> None:
    layout, sysfs = start_node(tmp_path, netns)
    pf = layout.pfs[2]
    r = f"{PREFIX}/sriov_{pf.netdev}"

    emu = KubeletEmulator(kubelet_dir)
    await emu.start()
    daemon = make_daemon(tmp_path, sysfs, kubelet_dir, netns)
    await daemon.start()
    try:
        other = f"{PREFIX}/sriov_{layout.pfs[0].netdev}"
        await emu.wait_for(lambda: emu.allocatable(r) == 8 and bool(emu.updates(other)), GUARD_S)
        quiet = len(emu.updates(other))
        await aip(netns, "link", "set", pf.netdev, "down")
        await emu.wait_for(lambda: set(emu.devices(r).values()) == {UNHEALTHY}, GUARD_S)
        assert daemon.tracker is not None and "pf-link-down" in daemon.tracker.reasons(pf.vf_addresses[0])
        await aip(netns, "link", "set", pf.netdev, "up")
        await emu.wait_for(lambda: set(emu.devices(r).values()) == {HEALTHY}, GUARD_S)
        # The peer going down takes the carrier away too (veth reports lower-layer down).
        await aip(netns, "link", "set", "peer2", "down")
        await emu.wait_for(lambda: set(emu.devices(r).values()) == {UNHEALTHY}, GUARD_S)
        assert len(emu.updates(other)) == quiet  # other pools heard nothing
    finally:
        await daemon.stop()
        await emu.stop()


async def test_injected_uevent_rescans_and_pools_follow(
    tmp_path: Path, netns: str, kubelet_dir: Path
) -> None:
    layout, sysfs = start_node(tmp_path, netns)
    pf = layout.pfs[1]
    r = f"{PREFIX}/sriov_{pf.netdev}"

    emu = KubeletEmulator(kubelet_dir)
    await emu.start()
    daemon = make_daemon(tmp_path, sysfs, kubelet_dir, netns)
    await daemon.start()
    sender = open_netlink_socket(NETLINK_KOBJECT_UEVENT, 0, resolve_netns(netns))
    try:
        await emu.wait_for(lambda: len(emu.devices(r)) == 8, GUARD_S)
        simnode.set_num_vfs(sysfs, pf.address, 0)
        sender.sendto(numvfs_uevent(pf.address, 7), (0, 1))
        await emu.wait_for(lambda: emu.devices(r) == {}, GUARD_S)
        assert emu.registrations(r) == 1
    finally:
        sender.close()
        await daemon.stop()
        await emu.stop()


async def test_overrun_forces_a_resync(tmp_path: Path, netns: str, kubelet_dir: Path) -> None:
    layout, sysfs = start_node(tmp_path, netns)

    emu = KubeletEmulator(kubelet_dir)
    await emu.start()
    daemon = make_daemon(tmp_path, sysfs, kubelet_dir, netns)
    await daemon.start()
    try:
        scans = sample(daemon, "densedev_scans_total")
        full = {"reason": "rescan"}
        rescans = sample(daemon, "densedev_resyncs_total", **full)
        # A link that went down while we were blind (as during an overrun) is found by the resync.
        ip(netns, "link", "set", layout.pfs[3].netdev, "down")
        daemon.events.on_overrun()
        r = f"{PREFIX}/sriov_{layout.pfs[3].netdev}"
        await emu.wait_for(lambda: set(emu.devices(r).values()) == {UNHEALTHY}, GUARD_S)
        # The resync is a full rescan: a targeted one could not find what changed while blind.
        await emu.wait_for(lambda: (sample(daemon, "densedev_resyncs_total", **full)) > rescans, GUARD_S)
        assert sample(daemon, "densedev_scans_total") > scans
    finally:
        await daemon.stop()
        await emu.stop()
