"""Scanner, the one owner of the sysfs root (rescans, operstates, RDMA ports); the uevent -> target rule."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from densedev.node import scanner
from densedev.node.events import UeventTuple
from densedev.node.scanner import MAX_TARGETED_RESCANS, Scanner
from densedev.pools import config as config_mod
from densedev.pools import select
from densedev.testing import simnode


@pytest.fixture
def sysfs(tmp_path: Path) -> tuple[Path, simnode.NodeLayout]:
    root = tmp_path / "sys"
    return root, simnode.build_node(root, pfs=2, vfs_per_pf=4, rdma=True)


def test_a_targeted_rescan_of_a_pf_takes_its_new_vf_family(sysfs: tuple[Path, simnode.NodeLayout]) -> None:
    root, layout = sysfs
    s = Scanner(root)
    table = s.scan()
    assert s.rescan(table, {layout.pfs[0].address}) == (table, False, False)
    pf = layout.pfs[1]
    simnode.set_num_vfs(root, pf.address, 0)
    simnode.set_num_vfs(root, pf.address, 2)
    result = s.rescan(table, {pf.address})
    assert not result.full and result.changed
    assert sorted(d.id for d in result.table.devices if d.pf == pf.address) == sorted(pf.vf_addresses[:2])
    # The targeted result is what a full scan finds.
    assert result.table.devices == scanner.scan(root).devices


def test_no_target_or_too_many_scan_the_whole_node(sysfs: tuple[Path, simnode.NodeLayout]) -> None:
    root, layout = sysfs
    s = Scanner(root)
    table = s.scan()
    unchanged = s.rescan(table, set())
    assert unchanged.full and not unchanged.changed and unchanged.table.devices is table.devices
    many = {f"0000:ff:{i:02x}.0" for i in range(MAX_TARGETED_RESCANS + 1)}
    simnode.set_num_vfs(root, layout.pfs[0].address, 0)
    result = s.rescan(table, many, threads=False)
    assert result.full and result.changed and len(result.table) == len(table) - 4


def test_operstates_read_up_and_unknown_as_up_and_skip_missing(
    sysfs: tuple[Path, simnode.NodeLayout],
) -> None:
    root, layout = sysfs
    pf0, pf1 = layout.pfs
    simnode.set_link(root, pf1.netdev, False)
    states = dict(Scanner(root).operstates([pf0.netdev, pf1.netdev, "gone0"]))
    assert states == {pf0.netdev: True, pf1.netdev: False}


def test_rdma_ports_and_the_devices_polled(sysfs: tuple[Path, simnode.NodeLayout]) -> None:
    root, layout = sysfs
    s = Scanner(root)
    table = s.scan()
    every = scanner.rdma_devices((), table.devices)
    assert set(every) == {pf.ibdev for pf in layout.pfs} | {i for pf in layout.pfs for i in pf.vf_ibdevs}
    pool = {"resourceName": "a", "selectors": {"pfNames": [layout.pfs[0].netdev]}}
    config = config_mod.parse(json.dumps({"resourceList": [pool]}))
    pools = select.build_pools(config, table.devices)
    assert scanner.rdma_devices(pools, table.devices) == list(layout.pfs[0].vf_ibdevs)
    ports = s.rdma_ports(layout.pfs[0].vf_ibdevs[:1])
    assert [(ib, port) for ib, port, _state, _phys in ports] == [(layout.pfs[0].vf_ibdevs[0], 1)]


def test_netdev_names_include_the_pfs_links(sysfs: tuple[Path, simnode.NodeLayout]) -> None:
    root, layout = sysfs
    names = scanner.netdev_names(Scanner(root).scan().devices)
    assert {pf.netdev for pf in layout.pfs} | {n for pf in layout.pfs for n in pf.vf_netdevs} <= names


@pytest.mark.parametrize(
    ("event", "expected"),
    [
        (("bind", "/devices/pci0000:00/0000:00:02.0/0000:03:00.1", (("SUBSYSTEM", "pci"),)), "0000:03:00.1"),
        (
            (
                "add",
                "/devices/pci0000:00/0000:00:02.0/0000:03:00.1",
                (("SUBSYSTEM", "pci"), ("PCI_SLOT_NAME", "0000:03:00.2")),
            ),
            "0000:03:00.2",
        ),
        (("move", "/devices/pci0000:00/0000:03:00.1/net/eth1", (("SUBSYSTEM", "net"),)), "0000:03:00.1"),
        (("add", "/devices/virtual/net/veth0", (("SUBSYSTEM", "net"),)), None),
    ],
)
def test_uevents_that_change_the_scan_name_their_pci_function(
    event: UeventTuple, expected: str | None
) -> None:
    assert scanner.uevent_target(event) == (True, expected)


@pytest.mark.parametrize(
    "event",
    [
        ("online", "/devices/pci0000:00/0000:03:00.1", (("SUBSYSTEM", "pci"),)),
        ("add", "/devices/virtual/block/loop0", (("SUBSYSTEM", "block"),)),
        ("add", "/devices/pci0000:00/0000:03:00.1", ()),
    ],
)
def test_other_uevents_change_nothing(event: UeventTuple) -> None:
    assert scanner.uevent_target(event) == (False, None)
