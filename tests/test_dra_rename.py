"""Renaming the DRA driver (``draDriverName``) without a restart, and never losing a claim to it.

The daemon runs end to end against the emulators (the DRA kubelet, the API-server stand-in, the
device-plugin kubelet), as in tests/test_dra_daemon.py; the driver starts as ``A`` (the default name)
and the config renames it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.dra_daemon import DP, GUARD_S, Node, by_name, cluster, pool

from densedev.dra.names import DEFAULT_DRIVER_NAME as A

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
