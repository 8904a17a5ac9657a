"""A DRA checkpoint that cannot be read fails closed: the claims it may have recorded stay held.

Real files are planted at the checkpoint path of a daemon that prepared a claim — one flipped byte, a
truncated file, an empty one, a symlink, a symlink loop, a directory, a FIFO, a 200 MiB (sparse) file,
valid JSON followed by garbage, a valid checkpoint of another driver — and the daemon is started again
end to end against the DRA kubelet emulator, the API-server stand-in and the device-plugin kubelet
emulator (as tests/test_dra_daemon.py).  Before the fix every case freed the claim: its CDI spec and
device-info files were deleted, its VF listed to device-plugin pods and given to a new claim, and the
DRA plugin was not served, so the kubelet could not unprepare it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers.dra_daemon import DP, GUARD_S, Node, by_name, cluster, pool
from helpers.metrics import sample
from helpers.node import PREFIX

from densedev.alloc import devinfo
from densedev.dra.claims import decode_checkpoint, encode_checkpoint
from densedev.dra.names import DEFAULT_DRIVER_NAME as A
from densedev.pools.ownership import retiring_claims
from densedev.testing.kubelet import KubeletError

pytestmark = pytest.mark.faults

B = "vf.example.com"
HUGE = 200 * 1024 * 1024


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    # A byte inside the claims (a device name's digit or letter): still JSON, the checksum fails.
    at = data.index(b'"device":"pci-') + len(b'"device":"pci-')
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _empty(path: Path) -> None:
    path.write_bytes(b"")


def _symlink(path: Path) -> None:
    # To a copy of the valid checkpoint: reading through the link would look fine, and is refused.
    target = path.parent.parent / "elsewhere.json"
    target.write_bytes(path.read_bytes())
    path.unlink()
    path.symlink_to(target)


def _loop(path: Path) -> None:
    path.unlink()
    path.symlink_to(path.name)  # resolves to itself: ELOOP


def _directory(path: Path) -> None:
    path.unlink()
    path.mkdir()


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)  # a blocking open would hang the daemon's start for good


def _huge(path: Path) -> None:
    data = path.read_bytes()
    with path.open("r+b") as f:
        f.truncate(HUGE)  # sparse: 200 MiB that take no disk
        f.seek(0)
        f.write(data)


def _garbage(path: Path) -> None:
    path.write_bytes(path.read_bytes() + b'{"trailing": "garbage"}\n')


def _other_driver(path: Path) -> None:
    # A valid checkpoint, checksum and all, written for another driver's name.
    claims = decode_checkpoint(A, path.read_bytes())
    path.write_bytes(encode_checkpoint("other.example.com", claims))


DAMAGE: dict[str, Callable[[Path], None]] = {
    "flipped-byte": _flip,
    "truncated": _truncate,
    "empty": _empty,
    "symlink": _symlink,
    "symlink-loop": _loop,
    "directory": _directory,
    "fifo": _fifo,
    "huge": _huge,
    "trailing-garbage": _garbage,
    "other-driver": _other_driver,
}


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    n = Node(tmp_path)
    n.write(pools(n))
    yield n
    n.cleanup()


def pools(n: Node) -> list[dict[str, object]]:
    """PF 0's VFs through the device-plugin API, PF 1's through DRA."""
    return [pool("dp", [n.pf0.netdev]), pool("dra", [n.pf1.netdev], api="dra")]


def errors(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.parametrize("damage", list(DAMAGE))
async def test_a_damaged_checkpoint_keeps_the_prepared_claim_held(
    node: Node, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    pf0, pf1 = node.pf0.vf_addresses, node.pf1.vf_addresses
    info = node.devinfo_dir / devinfo.file_name(PREFIX, "dra", pf1[0])
    async with cluster(node) as c:
        await c.until(lambda: A in c.dra_kubelet.plugins, "the DRA plugin registered")
        held = node.claim(pf1[0])
        assert (await c.dra_kubelet.prepare(A, [held]))[held[2]].error == ""
        spec = node.spec(held[2])
        assert spec.exists() and info.exists()
        await c.stop_daemon()
        await c.until(lambda: A not in c.dra_kubelet.plugins, "the stopped plugin dropped")

        DAMAGE[damage](node.plugins_dir / A / "checkpoint.json")
        # The VFs of PF 1 are now in a device-plugin pool: the claimed one must not be listed.
        node.write([pool("dp", [node.pf0.netdev, node.pf1.netdev])])
        caplog.clear()
        with caplog.at_level(logging.ERROR):
            daemon = await c.start_daemon()
        assert daemon.ownership.held.get(pf1[0]), "held before anything is served"
        (line,) = errors(caplog)
        fields = line.fields  # type: ignore[attr-defined]
        assert held[2] in fields["claims"] and fields["devices"] == 1, fields
        assert sample(daemon, "densedev_dra_unsettled", driver=A, what="claims") == 1
        await c.kubelet.wait_for(lambda: set(c.kubelet.devices(DP)) == set(pf0 + pf1[1:]), GUARD_S)
        with pytest.raises(KubeletError, match=r"not free|unknown devices"):
            await c.kubelet.create_pod("p1", {DP: [pf1[0]]})
        # Its files are kept, and the DRA plugin is served so that the kubelet can unprepare it.
        assert spec.exists() and info.exists()
        await c.until(lambda: A in c.dra_kubelet.plugins, "the DRA plugin served for the lost claim")
        await c.stop_daemon()

        # A restart before the kubelet settled it holds it still; back to a DRA pool on PF 1, where
        # every device the driver's pool could give is withheld from every other claim meanwhile.
        node.write(pools(node))
        daemon = await c.start_daemon()
        await c.until(lambda: A in c.dra_kubelet.plugins, "the DRA plugin registered again")
        for address in (pf1[0], pf1[3]):
            other = node.claim(address)
            refused = (await c.dra_kubelet.prepare(A, [other]))[other[2]].error
            assert "record of prepared claims was lost" in refused, refused
            assert not node.spec(other[2]).exists()
        assert c.kubelet.double_holdings == []

        # The kubelet unprepares the old claim: released, its spec gone, the device given again.
        assert await c.dra_kubelet.unprepare(A, [held]) == {held[2]: ""}
        assert not spec.exists()
        assert sample(daemon, "densedev_dra_unsettled", driver=A, what="claims") == 0
        await c.until(lambda: node.published(A) == by_name(pf1), "the whole DRA pool published")
        again = node.claim(pf1[0])
        assert (await c.dra_kubelet.prepare(A, [again]))[again[2]].error == ""


@pytest.mark.parametrize("damage", list(DAMAGE))
async def test_a_damaged_checkpoint_of_a_retired_driver_name_keeps_its_claim_held(
    node: Node, damage: str
) -> None:
    pf1 = node.pf1.vf_addresses
    async with cluster(node) as c:
        await c.until(lambda: A in c.dra_kubelet.plugins, "A registered")
        held = node.claim(pf1[0], driver=A)
        assert (await c.dra_kubelet.prepare(A, [held]))[held[2]].error == ""
        await c.stop_daemon()
        await c.until(lambda: A not in c.dra_kubelet.plugins, "the stopped plugin dropped")

        DAMAGE[damage](node.plugins_dir / A / "checkpoint.json")
        node.write(pools(node), driver=B)  # renamed while the daemon was down
        daemon = await c.start_daemon()
        assert retiring_claims(A) in daemon.ownership.held.get(pf1[0], frozenset())
        await c.until(lambda: node.published(B) == by_name(pf1[1:]), "B published without the held VF")
        await c.until(lambda: B in c.dra_kubelet.plugins, "B registered")
        other = node.claim(pf1[0], driver=B)
        refused = (await c.dra_kubelet.prepare(B, [other]))[other[2]].error
        assert "held" in refused and A in refused, refused
        # A is served for the Unprepare of its lost claim, whose spec was kept; then it stops.
        await c.until(lambda: A in c.dra_kubelet.plugins, "A served for its lost claim's Unprepare")
        assert node.spec(held[2], A).exists()
        assert sample(daemon, "densedev_dra_unsettled", driver=A, what="claims") == 1
        assert await c.dra_kubelet.unprepare(A, [held]) == {held[2]: ""}
        assert not node.spec(held[2], A).exists()
        await c.until(lambda: A not in c.dra_kubelet.plugins, "A stopped once settled")
        await c.until(lambda: node.published(B) == by_name(pf1), "the released VF published by B")
        assert (await c.dra_kubelet.prepare(B, [other]))[other[2]].error == ""


async def test_the_driver_pool_stays_withheld_when_a_reload_moves_it_while_unsettled(node: Node) -> None:
    pf0, pf1 = node.pf0.vf_addresses, node.pf1.vf_addresses
    async with cluster(node) as c:
        await c.until(lambda: A in c.dra_kubelet.plugins, "the DRA plugin registered")
        held = node.claim(pf1[0])
        assert (await c.dra_kubelet.prepare(A, [held]))[held[2]].error == ""
        await c.stop_daemon()
        await c.until(lambda: A not in c.dra_kubelet.plugins, "the stopped plugin dropped")
        _flip(node.plugins_dir / A / "checkpoint.json")
        daemon = await c.start_daemon()
        await c.until(lambda: A in c.dra_kubelet.plugins, "the DRA plugin registered again")
        # Every device of the driver's pool could have been given by the lost record: a reload that
        # moves the pool to the device-plugin API lists none of it until the claim is settled.
        node.write([pool("dp", [node.pf0.netdev, node.pf1.netdev])])
        assert await daemon.reload()
        await c.kubelet.wait_for(lambda: set(c.kubelet.devices(DP)) == set(pf0), GUARD_S)
        assert sample(daemon, "densedev_dra_unsettled", driver=A, what="devices") == len(pf1)
        assert await c.dra_kubelet.unprepare(A, [held]) == {held[2]: ""}
        await c.kubelet.wait_for(lambda: set(c.kubelet.devices(DP)) == set(pf0 + pf1), GUARD_S)
        assert c.kubelet.double_holdings == []


async def test_a_claim_whose_spec_was_lost_too_is_held_while_podresources_show_a_pod_using_it(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    """Checkpoint and CDI spec both lost: only the PodResources name the claim, and that holds it."""
    pf0, pf1 = node.pf0.vf_addresses, node.pf1.vf_addresses
    async with cluster(node) as c:
        await c.until(lambda: A in c.dra_kubelet.plugins, "the DRA plugin registered")
        held = node.claim(pf1[0])
        assert (await c.dra_kubelet.prepare(A, [held]))[held[2]].error == ""
        c.kubelet.run_dra_pod("default", "user", c.dra_kubelet.claim_uses(held[2]))
        await c.stop_daemon()
        await c.until(lambda: A not in c.dra_kubelet.plugins, "the stopped plugin dropped")

        _flip(node.plugins_dir / A / "checkpoint.json")
        node.spec(held[2]).unlink()  # no file of ours names the claim any more
        # PF 1's VFs now in a device-plugin pool: the one the running pod's claim uses must not be listed.
        node.write([pool("dp", [node.pf0.netdev, node.pf1.netdev])])
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            daemon = await c.start_daemon()
        assert daemon.ownership.held.get(pf1[0]), "held before anything is served"
        assert sample(daemon, "densedev_dra_unsettled", driver=A, what="claims") == 1
        (line,) = [r for r in caplog.records if "PodResources were read" in r.getMessage()]
        assert f"default/{held[1]}" in line.fields["held"]  # type: ignore[attr-defined]
        await c.kubelet.wait_for(lambda: set(c.kubelet.devices(DP)) == set(pf0 + pf1[1:]), GUARD_S)
        with pytest.raises(KubeletError, match=r"not free|unknown devices"):
            await c.kubelet.create_pod("p1", {DP: [pf1[0]]})
        await c.stop_daemon()

        # Back to a DRA pool: no other claim gets the device while the pod runs, across a restart.
        node.write(pools(node))
        daemon = await c.start_daemon()
        await c.until(lambda: A in c.dra_kubelet.plugins, "the DRA plugin registered again")
        other = node.claim(pf1[0])
        refused = (await c.dra_kubelet.prepare(A, [other]))[other[2]].error
        assert "record of prepared claims was lost" in refused, refused
        assert c.kubelet.double_holdings == []

        # The pod ends: a successful read that no longer shows the claim releases it (no spec names it).
        c.kubelet.end_dra_pod("default", "user")
        await c.until(lambda: daemon.ownership.held.get(pf1[0]) is None, "released once no pod uses it")
        assert sample(daemon, "densedev_dra_unsettled", driver=A, what="claims") == 0
        assert (await c.dra_kubelet.prepare(A, [other]))[other[2]].error == ""


async def test_a_claim_named_only_by_podresources_is_released_by_its_unprepare(node: Node) -> None:
    pf1 = node.pf1.vf_addresses
    async with cluster(node) as c:
        await c.until(lambda: A in c.dra_kubelet.plugins, "the DRA plugin registered")
        held = node.claim(pf1[2])
        assert (await c.dra_kubelet.prepare(A, [held]))[held[2]].error == ""
        c.kubelet.run_dra_pod("default", "user", c.dra_kubelet.claim_uses(held[2]))
        await c.stop_daemon()
        await c.until(lambda: A not in c.dra_kubelet.plugins, "the stopped plugin dropped")
        _empty(node.plugins_dir / A / "checkpoint.json")
        node.spec(held[2]).unlink()
        daemon = await c.start_daemon()
        await c.until(lambda: A in c.dra_kubelet.plugins, "the DRA plugin served for the lost claim")
        assert daemon.ownership.held.get(pf1[2])
        # The kubelet unprepares it (the pod is terminating; List may still show it meanwhile).
        assert await c.dra_kubelet.unprepare(A, [held]) == {held[2]: ""}
        assert daemon.ownership.held.get(pf1[2]) is None
        assert sample(daemon, "densedev_dra_unsettled", driver=A, what="claims") == 0
