"""SIGKILL during an allocation storm, then restart: the end state is exactly what it was, and no device
is ever in two pods.

The daemon runs as its own process (``python -m densedev.cli run`` on a simulated node) against a
strict kubelet emulator serving the PodResources API: the emulator raises on the first device held by
two running pods, so every pod admitted in the storms below is checked against the invariant.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
from helpers import node as node_helpers
from helpers.node import GUARD_S, PREFIX, pool, res

from densedev.alloc import cdi, devinfo
from densedev.kubelet.sockets import socket_name_for
from densedev.testing import simnode
from densedev.testing.kubelet import CHECKPOINT, KubeletEmulator, KubeletError

pytestmark = pytest.mark.faults

NAMES = ("p0", "p1", "p2")


class Node(node_helpers.Node):
    """Four PFs of 16 VFs; pools p0, p1 take a PF each, p2 the other two."""

    def __init__(self, tmp: Path, kubelet_dir: Path, pr_dir: Path) -> None:
        self.pools: dict[str, list[str]] = {}  # pool name -> its PFs' netdevs, once the tree is built
        super().__init__(tmp, pfs=4, vfs_per_pf=16, rdma=False, config=self._first, kubelet_dir=kubelet_dir)
        self.cdi_dir = tmp / "cdi"
        self.devinfo_dir = tmp / "devinfo"
        self.pr_dir = pr_dir

    def _first(self, layout: simnode.NodeLayout) -> dict[str, Any]:
        pfs = [pf.netdev for pf in layout.pfs]
        self.pools = {"p0": [pfs[0]], "p1": [pfs[1]], "p2": pfs[2:]}
        return self.config(NAMES)

    def config(self, names: tuple[str, ...]) -> dict[str, Any]:
        """The config document with the named pools."""
        return {"resourceList": [pool(n, self.pools[n]) for n in names], "rdmaPollSeconds": 0.05}

    def write(self, names: tuple[str, ...]) -> None:
        """Replace the config with the named pools."""
        self.write_config(self.config(names))

    def start(self, env: dict[str, str]) -> subprocess.Popen[bytes]:
        # subprocess (vfork), not the loop's spawner: see densedev.testing.netns on gRPC and fork.
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "densedev.cli",
                "run",
                "--config",
                str(self.config_path),
                "--sysfs-root",
                str(self.sysfs),
                "--kubelet-dir",
                str(self.kubelet_dir),
                "--dev-root",
                str(self.tmp / "dev"),
                "--cdi-dir",
                str(self.cdi_dir),
                "--devinfo-dir",
                str(self.devinfo_dir),
                "--pod-resources-socket",
                str(self.pr_dir / "kubelet.sock"),
                "--resource-prefix",
                PREFIX,
                "--no-netlink",
                "--log-level",
                "warning",
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )


@pytest.fixture
def node(tmp_path: Path, sock_dir: Path, pr_dir: Path) -> Node:
    """This module's node (in place of conftest's): its daemon runs as a process."""
    return Node(tmp_path, sock_dir, pr_dir)


async def storm(emu: KubeletEmulator, names: tuple[str, ...], pods: int, seed: int, tag: str) -> list[str]:
    """Admit ``pods`` pods of 1-3 devices from random pools, 6 at a time, deleting every fourth again.

    A pod the dead (or restarting) plugin cannot serve fails admission, as with the kubelet; the
    strict emulator's InvariantViolation is an AssertionError and is never swallowed.
    """
    rng = random.Random(seed)
    gate = asyncio.Semaphore(6)
    admitted: list[str] = []

    async def one(k: int) -> None:
        async with gate:
            uid = f"{tag}-{k}"
            try:
                await emu.create_pod(uid, {res(rng.choice(names)): rng.randint(1, 3)}, uid=uid)
            except (KubeletError, grpc.aio.AioRpcError):
                return
            admitted.append(uid)
            if k % 4 == 3:
                emu.delete_pod(uid)

    await asyncio.gather(*(one(k) for k in range(pods)))
    return admitted


def sockets_in(d: Path) -> set[str]:
    return {e.name for e in os.scandir(d) if stat.S_ISSOCK(e.stat(follow_symlinks=False).st_mode)}


def check_files(node: Node, emu: KubeletEmulator, names: tuple[str, ...]) -> None:
    """Every listed device has its CDI entry; every device a running pod holds keeps its device-info file."""
    for n in names:
        spec = json.loads((node.cdi_dir / cdi.spec_file_name(f"{PREFIX}/{n}")).read_text())
        assert {d["name"] for d in spec["devices"]} >= set(emu.devices(res(n))), n
    for device, holders in emu.holders().items():
        for _uid, resource in holders:
            name = resource.split("/", 1)[1]
            doc = json.loads((node.devinfo_dir / devinfo.file_name(PREFIX, name, device)).read_text())
            assert doc["pci"]["pci-address"] == device


async def test_sigkill_during_an_allocation_storm_then_restart(node: Node, child_env: dict[str, str]) -> None:
    emu = KubeletEmulator(node.kubelet_dir, pod_resources_socket=node.pr_dir / "kubelet.sock", strict=True)
    await emu.start()
    proc = node.start(child_env)
    try:
        await emu.wait_for(lambda: all(emu.allocatable(res(n)) for n in NAMES), GUARD_S)
        before = {n: dict(emu.devices(res(n))) for n in NAMES}
        assert [len(before[n]) for n in NAMES] == [16, 16, 32]

        # 1. SIGKILL in the middle of a storm of admissions.
        running = asyncio.create_task(storm(emu, NAMES, 60, seed=1, tag="a"))
        await emu.wait_for(lambda: len(emu.pods()) >= 12, GUARD_S)
        proc.send_signal(signal.SIGKILL)
        await asyncio.to_thread(proc.wait, GUARD_S)
        admitted = await running
        assert 12 <= len(admitted) < 60

        # 2. Restart, same config: same IDs, all healthy, counts equal, one socket per pool.
        regs = {n: emu.registrations(res(n)) for n in NAMES}
        proc = node.start(child_env)
        await emu.wait_for(
            lambda: all(
                emu.registrations(res(n)) > regs[n] and emu.devices(res(n)) == before[n] for n in NAMES
            ),
            GUARD_S,
        )
        assert sockets_in(node.kubelet_dir) == {"kubelet.sock"} | {
            socket_name_for(res(n), node.kubelet_dir) for n in NAMES
        }
        check_files(node, emu, NAMES)
        # A second storm takes devices while the first's pods still hold theirs.
        await storm(emu, NAMES, 40, seed=2, tag="b")

        # 3. SIGKILL again; restart with p1 removed: its socket goes, its held VFs are withheld from
        # p2 (which now selects PF 1 too) until released.
        proc.send_signal(signal.SIGKILL)
        await asyncio.to_thread(proc.wait, GUARD_S)
        held_p1 = {i for per in emu.pods().values() for i in per.get(res("p1"), [])}
        assert held_p1
        node.pools["p2"] = node.pools["p1"] + node.pools["p2"]
        node.write(("p0", "p2"))
        proc = node.start(child_env)
        pf1 = set(node.layout.pfs[1].vf_addresses)
        await emu.wait_for(
            lambda: (
                emu.registrations(res("p2")) > regs["p2"] + 1
                and (pf1 - held_p1) <= set(emu.devices(res("p2")))
            ),
            GUARD_S,
        )
        assert not held_p1 & set(emu.devices(res("p2")))
        assert len(emu.devices(res("p2"))) == 48 - len(held_p1)
        assert sockets_in(node.kubelet_dir) == {"kubelet.sock"} | {
            socket_name_for(res(n), node.kubelet_dir) for n in ("p0", "p2")
        }
        check_files(node, emu, ("p0", "p2"))
        # Every free device of every pool, taken: none of them is held by anyone else.
        for n in ("p0", "p2"):
            if emu.free(res(n)):
                await emu.create_pod(f"all-{n}", {res(n): len(emu.free(res(n)))})
        # Released: p1's pods end, and their VFs join p2.
        for uid, per in emu.pods().items():
            if res("p1") in per:
                emu.delete_pod(uid)
        await emu.wait_for(lambda: held_p1 <= set(emu.devices(res("p2"))), GUARD_S)
        assert emu.double_holdings == []
        assert json.loads((node.kubelet_dir / CHECKPOINT).read_text())["Data"]["PodDeviceEntries"]
    finally:
        if proc.poll() is None:
            proc.kill()
            await asyncio.to_thread(proc.wait)
        await emu.stop()
