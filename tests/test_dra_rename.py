"""Renaming the DRA driver (``draDriverName``) without a restart, and never losing a claim to it.

The daemon runs end to end against the emulators (the DRA kubelet, the API-server stand-in, the
device-plugin kubelet), as in tests/test_dra_daemon.py; the driver starts as ``A`` (the default name)
and the config renames it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.dra import VF, VF2
from helpers.dra import Node as DraNode
from helpers.dra_daemon import DP, DRA, GUARD_S, Node, by_name, cluster, pool
from helpers.metrics import sample
from helpers.node import PREFIX

from densedev.daemon import Daemon
from densedev.dra.checkpoints import find_checkpoints
from densedev.dra.claims import Checkpoint, decode_checkpoint
from densedev.dra.names import DEFAULT_DRIVER_NAME as A
from densedev.node import scanner as discovery
from densedev.pools import config as config_mod
from densedev.pools import select as selectors
from densedev.pools.ownership import DRA_CLAIMS, Ownership, retiring_claims

B = "vf.example.com"
C = "nic.example.org"


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    n = Node(tmp_path)
    n.write(pools(n))
    yield n
    n.cleanup()


def pools(n: Node) -> list[dict[str, object]]:
    """PF 0's VFs through the device-plugin API, PF 1's through DRA."""
    return [pool("dp", [n.pf0.netdev]), pool("dra", [n.pf1.netdev], api="dra")]


@pytest.mark.parametrize("pf1_api", ["dra", "devicePlugin"])
async def test_a_restart_after_a_rename_keeps_the_old_drivers_claims_held(node: Node, pf1_api: str) -> None:
    # The bug (issue 16): after a rename and a restart only <plugins>/<new name>/checkpoint.json was
    # recovered, so the devices of claims prepared under the old name were offered again: in the new
    # driver's slices, or to device-plugin pods.
    pf0, pf1 = node.pf0.vf_addresses, node.pf1.vf_addresses
    async with cluster(node) as c:
        await c.until(lambda: A in c.dra_kubelet.plugins, "A registered")
        held = node.claim(pf1[0], driver=A)
        assert (await c.dra_kubelet.prepare(A, [held]))[held[2]].error == ""
        await c.stop_daemon()
        await c.until(lambda: A not in c.dra_kubelet.plugins, "the stopped plugin dropped")

        if pf1_api == "dra":
            node.write(pools(node), driver=B)
        else:
            node.write([pool("dp", [node.pf0.netdev, node.pf1.netdev])], driver=B)
        daemon = await c.start_daemon()
        # Held before anything is served.
        assert daemon.ownership.held.get(pf1[0]), daemon.ownership.held
        if pf1_api == "dra":
            await c.until(lambda: node.published(B) == by_name(pf1[1:]), "B published without the held VF")
            await c.until(lambda: A not in node.drivers(), "the slices A's previous run left deleted")
            # B's gate refuses the device, naming the claim of A that holds it.
            await c.until(lambda: B in c.dra_kubelet.plugins, "B registered")
            other = node.claim(pf1[0], driver=B)
            refused = (await c.dra_kubelet.prepare(B, [other]))[other[2]].error
            assert "held" in refused and held[1] in refused and A in refused, refused
        else:
            await c.kubelet.wait_for(lambda: set(c.kubelet.devices(DP)) == set(pf0 + pf1[1:]), GUARD_S)
            got = await c.kubelet.create_pod("p1", {DP: c.kubelet.allocatable(DP)})
            assert pf1[0] not in got[DP] and c.kubelet.double_holdings == []
        # The claim of the old name is served for its Unprepare; then A stops and its device is free.
        await c.until(lambda: A in c.dra_kubelet.plugins, "A served for its claim's Unprepare")
        assert (await c.dra_kubelet.unprepare(A, [held])) == {held[2]: ""}
        assert not node.spec(held[2], A).exists()
        await c.until(lambda: not (node.plugins_dir / A).exists(), "A stopped, its files removed")
        assert A not in c.dra_kubelet.plugins and not node.sockets(A)
        if pf1_api == "dra":
            await c.until(lambda: node.published(B) == by_name(pf1), "the released VF published by B")
        else:
            await c.kubelet.wait_for(lambda: pf1[0] in c.kubelet.devices(DP), GUARD_S)


def claims_series(daemon: Daemon) -> list[dict[str, str]]:
    """The labels of every densedev_dra_prepared_claims series."""
    return [
        dict(s.labels)
        for family in daemon.metrics.registry.collect()
        for s in family.samples
        if s.name == "densedev_dra_prepared_claims"
    ]


def events(caplog: pytest.LogCaptureFixture, msg: str) -> list[dict[str, object]]:
    """The structured fields of every log line ``msg`` captured so far."""
    return [dict(getattr(r, "fields", {})) for r in caplog.records if r.msg == msg]


async def test_a_rename_with_nothing_prepared_retires_the_old_driver_at_once(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    pf1 = node.pf1.vf_addresses
    caplog.set_level(logging.INFO, logger="densedev.dra.driver")
    async with cluster(node) as c:
        daemon = c.daemon
        assert daemon is not None
        await c.until(lambda: node.published(A) == by_name(pf1), "A published")
        await c.until(lambda: A in c.dra_kubelet.plugins, "A registered")
        old = daemon.dra

        node.write(pools(node), driver=B)
        assert await daemon.reload()
        assert daemon.dra is not None and daemon.dra is not old and daemon.dra.driver == B
        await c.until(lambda: node.published(B) == by_name(pf1), "B published")
        await c.until(lambda: B in c.dra_kubelet.plugins, "B registered")
        await c.until(lambda: not (node.plugins_dir / A).exists(), "A stopped, its files removed")
        # A's slices were deleted by A's publisher (the kubelet emulator wipes nothing at a
        # deregistration), its sockets are gone and the kubelet dropped it.
        assert A not in node.drivers() and not node.sockets(A)
        await c.until(lambda: A not in c.dra_kubelet.plugins, "A deregistered")
        ready, why = daemon.registered()
        assert ready, why
        assert events(caplog, "draDriverName changed") == [{"old": A, "new": B}]
        [retiring] = events(caplog, "DRA driver retiring")
        assert retiring["driver"] == A and retiring["renamed_to"] == B and retiring["claims"] == 0
        assert events(caplog, "DRA driver stopped") == [{"driver": A, "renamed_to": B}]
        # B serves claims of its own.
        ref = node.claim(pf1[0], driver=B)
        assert (await c.dra_kubelet.prepare(B, [ref]))[ref[2]].error == ""
        assert node.spec(ref[2], B).exists()


async def test_a_rename_with_prepared_claims_keeps_them_held_until_unprepared(node: Node) -> None:
    pf0, pf1 = node.pf0.vf_addresses, node.pf1.vf_addresses
    async with cluster(node) as c:
        daemon = c.daemon
        assert daemon is not None
        await c.until(lambda: A in c.dra_kubelet.plugins, "A registered")
        # Two claims of A: one device stays in a DRA pool after the rename, one moves to the
        # device-plugin pool.
        stays, moves = node.claim(pf1[0], driver=A), node.claim(pf1[5], driver=A)
        answers = await c.dra_kubelet.prepare(A, [stays, moves])
        assert all(a.error == "" for a in answers.values()), answers
        late = node.claim(pf1[1], driver=A)  # allocated from A's slices, not prepared before the rename

        pf1_name = node.pf1.netdev
        node.write(
            [
                pool("dp", [node.pf0.netdev, f"{pf1_name}#4-7"]),
                pool("dra", [f"{pf1_name}#0-3"], api="dra"),
            ],
            driver=B,
        )
        assert await daemon.reload()
        # Neither held device is offered: not in B's slices, not listed to the kubelet.
        await c.until(lambda: node.published(B) == by_name(pf1[1:4]), "B published without the held VF")
        await c.kubelet.wait_for(lambda: set(c.kubelet.devices(DP)) == set(pf0 + pf1[4:5] + pf1[6:]), GUARD_S)
        await c.until(lambda: A not in node.drivers(), "A's slices deleted at once")
        assert sample(daemon, "densedev_dra_prepared_claims", driver=A, state="retiring") == 2
        assert sample(daemon, "densedev_dra_prepared_claims", driver=B, state="active") == 0
        # B's gate refuses the device A's claim holds, naming that claim.
        await c.until(lambda: B in c.dra_kubelet.plugins, "B registered")
        other = node.claim(pf1[0], driver=B)
        refused = (await c.dra_kubelet.prepare(B, [other]))[other[2]].error
        assert "held" in refused and stays[1] in refused and f"driver {A}" in refused, refused
        # A refuses a claim allocated from its withdrawn slices, in one line naming the rename...
        refused = (await c.dra_kubelet.prepare(A, [late]))[late[2]].error
        assert f"renamed to {B}" in refused and "\n" not in refused and not node.spec(late[2], A).exists()
        # ... but answers a repeated Prepare of a claim it prepared (the kubelet re-sends those
        # after its restart) exactly as before.
        assert (await c.dra_kubelet.prepare(A, [stays]))[stays[2]] == answers[stays[2]]
        got = await c.kubelet.create_pod("p1", {DP: c.kubelet.allocatable(DP)})
        assert pf1[5] not in got[DP] and c.kubelet.double_holdings == []

        # Unprepare the first claim: its device joins B's slices; A serves on for the other.
        assert await c.dra_kubelet.unprepare(A, [stays]) == {stays[2]: ""}
        await c.until(lambda: node.published(B) == by_name(pf1[:4]), "the released VF published by B")
        assert A in c.dra_kubelet.plugins and node.sockets(A)
        assert sample(daemon, "densedev_dra_prepared_claims", driver=A, state="retiring") == 1
        # The last one: A stops and the kubelet drops it; its device is listed to the kubelet.
        assert await c.dra_kubelet.unprepare(A, [moves]) == {moves[2]: ""}
        await c.until(lambda: not (node.plugins_dir / A).exists(), "A stopped, its files removed")
        await c.until(lambda: A not in c.dra_kubelet.plugins, "A deregistered")
        assert not node.sockets(A) and not node.spec(stays[2], A).exists()
        await c.kubelet.wait_for(lambda: pf1[5] in c.kubelet.devices(DP), GUARD_S)
        assert not [s for s in claims_series(daemon) if s["driver"] == A]
        assert (await c.dra_kubelet.prepare(B, [other]))[other[2]].error == ""


async def test_renaming_back_while_retiring_makes_the_same_driver_active_again(node: Node) -> None:
    pf1 = node.pf1.vf_addresses
    async with cluster(node) as c:
        daemon = c.daemon
        assert daemon is not None
        await c.until(lambda: A in c.dra_kubelet.plugins, "A registered")
        first = daemon.dra
        held = node.claim(pf1[0], driver=A)
        answer = (await c.dra_kubelet.prepare(A, [held]))[held[2]]
        assert answer.error == ""

        node.write(pools(node), driver=B)
        assert await daemon.reload()
        await c.until(lambda: node.published(B) == by_name(pf1[1:]), "B published without the held VF")
        await c.until(lambda: B in c.dra_kubelet.plugins and A not in node.drivers(), "A retiring")

        node.write(pools(node), driver=A)
        assert await daemon.reload()
        # One instance per name: the very driver that prepared the claim, never unregistered.
        assert daemon.dra is first
        await c.until(lambda: node.published(A) == by_name(pf1), "A publishes again, its claim's VF too")
        await c.until(lambda: not (node.plugins_dir / B).exists(), "B (nothing prepared) stopped at once")
        await c.until(lambda: B not in c.dra_kubelet.plugins, "B deregistered")
        assert B not in node.drivers() and A in c.dra_kubelet.plugins
        # The claim is A's own again (a DRA pool's own claims do not withhold its device), and A
        # prepares new claims once more.
        assert (await c.dra_kubelet.prepare(A, [held]))[held[2]] == answer
        new = node.claim(pf1[1], driver=A)
        assert (await c.dra_kubelet.prepare(A, [new]))[new[2]].error == ""
        assert await c.dra_kubelet.unprepare(A, [held, new]) == {held[2]: "", new[2]: ""}
        assert A in c.dra_kubelet.plugins and node.sockets(A)


async def test_a_second_rename_while_the_first_driver_retires(node: Node) -> None:
    pf1 = node.pf1.vf_addresses
    async with cluster(node) as c:
        daemon = c.daemon
        assert daemon is not None
        await c.until(lambda: A in c.dra_kubelet.plugins, "A registered")
        held_a = node.claim(pf1[0], driver=A)
        assert (await c.dra_kubelet.prepare(A, [held_a]))[held_a[2]].error == ""
        node.write(pools(node), driver=B)
        assert await daemon.reload()
        await c.until(lambda: B in c.dra_kubelet.plugins, "B registered")
        held_b = node.claim(pf1[1], driver=B)
        assert (await c.dra_kubelet.prepare(B, [held_b]))[held_b[2]].error == ""

        node.write(pools(node), driver=C)
        assert await daemon.reload()
        # A and B retire side by side, each holding its claim's device; C publishes the rest.
        await c.until(lambda: node.published(C) == by_name(pf1[2:]), "C published without both VFs")
        await c.until(lambda: node.drivers() == {C}, "A's and B's slices deleted")
        assert daemon.ownership.held.get(pf1[0]) and daemon.ownership.held.get(pf1[1])
        # Both now refuse new claims as renamed to C.
        for old in (A, B):
            late = node.claim(pf1[3], driver=old)
            refused = (await c.dra_kubelet.prepare(old, [late]))[late[2]].error
            assert f"renamed to {C}" in refused, refused
        assert await c.dra_kubelet.unprepare(B, [held_b]) == {held_b[2]: ""}
        await c.until(lambda: not (node.plugins_dir / B).exists(), "B stopped")
        await c.until(lambda: node.published(C) == by_name(pf1[1:]), "B's VF published by C")
        assert A in c.dra_kubelet.plugins
        assert await c.dra_kubelet.unprepare(A, [held_a]) == {held_a[2]: ""}
        await c.until(lambda: not (node.plugins_dir / A).exists(), "A stopped")
        await c.until(lambda: node.published(C) == by_name(pf1), "A's VF published by C")
        await c.until(lambda: set(c.dra_kubelet.plugins) == {C}, "only C registered")


async def test_another_vendors_checkpoint_is_ignored_and_untouched(node: Node) -> None:
    # The official helper's drivers keep checkpoint.json in their own dir under the shared plugins
    # dir (the kubelet checkpointmanager envelope), as does a densedev-looking file of another name.
    foreign = node.plugins_dir / "gpu.example.com" / "checkpoint.json"
    foreign.parent.mkdir(parents=True)
    content = b'{"checksum":1234567,"v1":{"preparedClaims":{"uid-1":{"name":"c"}}}}'
    foreign.write_bytes(content)
    copied = node.plugins_dir / "copy.example.com" / "checkpoint.json"
    copied.parent.mkdir(parents=True)
    copied.write_bytes(b'{"claims":[],"driver":"other.example.com","kind":"DensedevDRACheckpoint"}\n')
    async with cluster(node) as c:
        daemon = c.daemon
        assert daemon is not None
        await c.until(lambda: A in c.dra_kubelet.plugins, "A registered")
        await c.until(lambda: node.published(A) == by_name(node.pf1.vf_addresses), "A published")
        assert set(c.dra_kubelet.plugins) == {A}
        assert foreign.read_bytes() == content and sorted(p.name for p in foreign.parent.iterdir()) == [
            "checkpoint.json"
        ]
        assert len(list(copied.parent.iterdir())) == 1 and copied.exists()
        assert daemon.ownership.held == {}


def test_densedev_checkpoints_are_told_from_other_vendors(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    plugins = tmp_path / "plugins"
    Checkpoint(plugins / A, A).save({})
    Checkpoint(plugins / B, B).save({})
    # Reformatted by hand (still a valid checkpoint of ours: the checksum covers the claims' values).
    doc = json.loads((plugins / B / "checkpoint.json").read_bytes())
    (plugins / B / "checkpoint.json").write_text(json.dumps(doc, indent=2))
    assert decode_checkpoint(B, (plugins / B / "checkpoint.json").read_bytes()) == {}
    (plugins / "gpu.example.com").mkdir()
    (plugins / "gpu.example.com" / "checkpoint.json").write_text('{"checksum": 1, "v1": {}}')
    (plugins / "torn.example.com").mkdir()
    (plugins / "torn.example.com" / "checkpoint.json").write_text('{"kind": "DensedevDRACheckpoint", "dri')
    (plugins / "moved.example.com").mkdir()
    (plugins / "moved.example.com" / "checkpoint.json").write_bytes(
        (plugins / A / "checkpoint.json").read_bytes()
    )
    (plugins / "link.example.com").symlink_to(plugins / A)
    (plugins / "file.example.com").write_text("not a directory")
    (plugins / "empty.example.com").mkdir()
    before = {p: p.read_bytes() for p in plugins.rglob("checkpoint.json") if not p.parent.is_symlink()}

    assert sorted(find_checkpoints(plugins)) == sorted([A, B])
    assert [r for r in caplog.records if "moved.example.com" in r.getMessage()]
    assert {p: p.read_bytes() for p in before} == before  # read only, whatever was found
    assert find_checkpoints(tmp_path / "absent") == []


def test_a_retiring_drivers_claims_are_withheld_from_every_pool(node: Node) -> None:
    pf0, pf1 = node.pf0.vf_addresses, node.pf1.vf_addresses
    cfg = config_mod.load(node.config_path, default_prefix=PREFIX)
    raw = selectors.build_pools(cfg, discovery.scan(node.sysfs).devices)
    own = Ownership(None)
    # The active driver holds pf1[0]; the retiring A holds pf1[1] and pf0[0].
    assert own.set_claimed([pf1[0]], {A: [pf1[1], pf0[0]]}) is True
    assert own.set_claimed([pf1[0]], {A: [pf0[0], pf1[1]]}) is False
    assert own.held[pf1[1]] == frozenset({retiring_claims(A)})
    # The DRA pool keeps its own driver's claim's device (the scheduler counts that allocation) but
    # withholds the retiring driver's: the new slices must not offer it.
    assert own.split(raw)[1] == {DP: (pf0[0],), DRA: (pf1[1],)}
    assert own.conflicts(DP, [pf0[0]]) == {pf0[0]: frozenset({retiring_claims(A)})}
    # A stopped: what it held is free; a retiring driver with no claim holds nothing.
    assert own.set_claimed([pf1[0]], {A: []}) is True
    assert own.held == {pf1[0]: frozenset({DRA_CLAIMS})}


async def test_a_retiring_node_service_refuses_new_claims_and_keeps_its_own(tmp_path: Path) -> None:
    n = DraNode(tmp_path)
    service = n.service
    service.recover()
    mine = n.claim(("nic", VF))
    answer = (await service.prepare([mine]))[mine.uid]
    assert answer.error == ""
    service.refusing = "driver A was renamed to B"
    late = n.claim(("nic", VF2))
    refused = await service.prepare([late, mine])
    assert refused[late.uid].error == f"claim {late}: driver A was renamed to B"
    assert refused[mine.uid] == answer  # a repeated Prepare answers the same
    assert not (n.settings.cdi_dir / f"densedev_dra_{n.settings.driver}_{late.uid}.json").exists()
    assert await service.unprepare([mine]) == {mine.uid: ""}
    # Holding nothing, its state goes: the checkpoint and every CDI spec of its driver.
    assert (n.settings.plugin_dir / "checkpoint.json").exists()
    (n.settings.cdi_dir / f"densedev_dra_{n.settings.driver}_stale.json").write_text("{}")
    service.remove_state()
    assert not (n.settings.plugin_dir / "checkpoint.json").exists()
    assert [p.name for p in n.settings.cdi_dir.iterdir()] == []
