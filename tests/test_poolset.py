"""poolset.diff on pools selected from a scanned simulated node: one diff for rescans and reloads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers.node import Node, pool, res

from densedev.model import Pool
from densedev.node import scanner
from densedev.pools import config as config_mod
from densedev.pools import select
from densedev.poolset import PoolChanges, diff
from densedev.testing import simnode


def two_pools(layout: simnode.NodeLayout) -> dict[str, Any]:
    """One pool per PF for PFs 0 and 1, leaving PF 2 out."""
    return {"resourceList": [pool(f"pf{i}", [layout.pfs[i].netdev]) for i in range(2)]}


class ScannedNode(Node):
    """A 3-PF node with 8 VFs each and the two-pool config, with its last scan to select pools from."""

    def __init__(self, tmp: Path, kubelet_dir: Path) -> None:
        super().__init__(tmp, pfs=3, vfs_per_pf=8, config=two_pools, kubelet_dir=kubelet_dir)
        self.table = scanner.scan(self.sysfs)

    def pools(self, doc: dict[str, Any] | None = None) -> tuple[Pool, ...]:
        """Select the pools of ``doc`` (default: the node's config) from the last scan."""
        config = config_mod.parse(json.dumps(doc if doc is not None else self.doc))
        return select.build_pools(config, self.table.devices)

    def with_pool(self, index: int, **changes: Any) -> dict[str, Any]:
        """Return the config with resourceList[index] updated by ``changes``."""
        doc = json.loads(json.dumps(self.doc))
        doc["resourceList"][index].update(changes)
        return doc


@pytest.fixture
def node(tmp_path: Path, sock_dir: Path) -> ScannedNode:
    """The scanned node (in place of conftest's ``node``)."""
    return ScannedNode(tmp_path, sock_dir)


def test_the_same_pools_twice_change_nothing(node: ScannedNode) -> None:
    assert diff(node.pools(), node.pools()) == PoolChanges()


def test_the_first_apply_adds_every_pool(node: ScannedNode) -> None:
    changes = diff((), node.pools())
    assert changes == PoolChanges(added=(res("pf0"), res("pf1")))
    assert changes.stopped == ()


def test_a_rescan_finding_fewer_vfs_replaces_only_that_pool(node: ScannedNode) -> None:
    before = node.pools()
    pf1 = node.layout.pfs[1]
    simnode.set_num_vfs(node.sysfs, pf1.address, 0)  # as the kernel wants: 0 before another count
    simnode.set_num_vfs(node.sysfs, pf1.address, 4)
    node.table = scanner.rescan_pf(node.sysfs, pf1.address, node.table)
    after = node.pools()
    assert [len(p.members) for p in after] == [8, 4]
    assert diff(before, after) == PoolChanges(replaced=(res("pf1"),))
    # And back: the VFs return, the same pool is replaced again.
    assert diff(after, before) == PoolChanges(replaced=(res("pf1"),))


def test_withheld_devices_replace_the_pool_they_leave(node: ScannedNode) -> None:
    before = node.pools()
    # As ownership.filter hands it over: a device a pod holds under another resource leaves the pool.
    held = Pool(before[0].config, before[0].members[1:])
    changes = diff(before, (held, before[1]))
    assert changes == PoolChanges(replaced=(res("pf0"),))


def test_a_reload_adding_and_removing_pools(node: ScannedNode) -> None:
    pf2 = node.layout.pfs[2]
    doc = {"resourceList": [node.doc["resourceList"][1], pool("pf2", [pf2.netdev])]}
    changes = diff(node.pools(), node.pools(doc))
    assert changes == PoolChanges(added=(res("pf2"),), removed=(res("pf0"),))
    assert changes.stopped == (res("pf0"),)


def test_a_config_change_that_keeps_the_options_is_applied_in_place(node: ScannedNode) -> None:
    # Another policy of preferred allocation still offers GetPreferredAllocation: no re-registration.
    changes = diff(node.pools(), node.pools(node.with_pool(0, preferredAllocation="spread")))
    assert changes == PoolChanges(changed=(res("pf0"),), replaced=(res("pf0"),))
    assert changes.stopped == ()


@pytest.mark.parametrize("option", [{"preStart": True}, {"preferredAllocation": "none"}])
def test_an_option_change_re_registers_instead_of_replacing(
    node: ScannedNode, option: dict[str, Any]
) -> None:
    changes = diff(node.pools(), node.pools(node.with_pool(1, **option)))
    assert changes == PoolChanges(changed=(res("pf1"),), reregister=(res("pf1"),))
    assert changes.stopped == (res("pf1"),)


def test_a_pool_moving_to_dra_stops_its_server_and_back_is_set_up_anew(node: ScannedNode) -> None:
    plugin, dra = node.pools(), node.pools(node.with_pool(0, api="dra"))
    to_dra = diff(plugin, dra)
    assert to_dra == PoolChanges(changed=(res("pf0"),), to_dra=(res("pf0"),))
    assert to_dra.stopped == (res("pf0"),)
    # Back to the device-plugin API: nothing to stop or replace; the daemon sets up a server for every
    # device-plugin pool that has none.
    assert diff(dra, plugin) == PoolChanges(changed=(res("pf0"),))


def test_stopped_lists_removed_then_reregistered_then_dra_bound(node: ScannedNode) -> None:
    pf2 = node.layout.pfs[2]
    old = node.pools({"resourceList": [*node.doc["resourceList"], pool("pf2", [pf2.netdev], preStart=True)]})
    new = node.pools(
        {
            "resourceList": [
                pool("pf2", [pf2.netdev]),
                pool("pf1", [node.layout.pfs[1].netdev], api="dra"),
            ]
        }
    )
    changes = diff(old, new)
    assert changes.removed == (res("pf0"),)
    assert changes.reregister == (res("pf2"),)
    assert changes.to_dra == (res("pf1"),)
    assert changes.stopped == (res("pf0"), res("pf2"), res("pf1"))
    assert changes.replaced == ()
