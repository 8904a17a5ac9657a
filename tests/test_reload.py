"""Config reload without restart, through the kubelet emulator: untouched pools stay silent."""

from __future__ import annotations

import asyncio
import copy
import json
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest

from densedev import files
from densedev.daemon import Daemon, DaemonSettings
from densedev.pools import config as config_mod
from densedev.testing import simnode
from densedev.testing.kubelet import KubeletEmulator

Run = Callable[[Coroutine[Any, Any, Any]], Any]
GUARD_S = 20.0
PREFIX = "example.com"


def res(name: str) -> str:
    return f"{PREFIX}/{name}"


def reloads(daemon: Daemon, result: str = "success") -> float:
    """Return how many config reloads ended in ``result`` (success, failure), as /metrics counts them."""
    return (
        daemon.metrics.registry.get_sample_value("densedev_config_reloads_total", {"result": result}) or 0.0
    )


class Node:
    """A 4-PF simulated node whose config leaves PF 3 out, so a reload can add a pool for it."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.sysfs = tmp / "sys"
        self.layout = simnode.build_node(self.sysfs, pfs=4, vfs_per_pf=8, rdma=True)
        self.config_path = tmp / "config.json"
        self.kubelet_dir = Path(tempfile.mkdtemp(prefix="dd-", dir="/tmp"))  # sun_path is short
        pfs = self.layout.pfs
        self.doc: dict[str, Any] = {
            "resourceList": [
                self.pool("pf0", [pfs[0].netdev]),
                self.pool("pf1", [pfs[1].netdev]),
                self.pool("pf2", [pfs[2].netdev]),
            ],
            "rdmaPollSeconds": 0.05,
        }
        self.write(self.doc)

    @staticmethod
    def pool(name: str, pf_names: list[str], **extra: Any) -> dict[str, Any]:
        return {"resourceName": name, "resourcePrefix": PREFIX, "selectors": {"pfNames": pf_names}, **extra}

    def write(self, doc: dict[str, Any] | str) -> None:
        """Swap the file in atomically, as a ConfigMap's ..data symlink swap does."""
        tmp = self.config_path.with_suffix(".new")
        tmp.write_text(doc if isinstance(doc, str) else json.dumps(doc))
        tmp.replace(self.config_path)

    def daemon(self) -> Daemon:
        settings = DaemonSettings(
            sysfs_root=self.sysfs,
            kubelet_dir=self.kubelet_dir,
            dev_root=self.tmp / "dev",
            cdi_dir=None,
            devinfo_dir=None,
            resource_prefix=PREFIX,
            config_path=self.config_path,
            netlink=False,
            config_poll_s=0.05,
        )
        return Daemon(settings, config_mod.load(self.config_path, default_prefix=PREFIX))


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    n = Node(tmp_path)
    yield n
    shutil.rmtree(n.kubelet_dir, ignore_errors=True)


def snapshot(emu: KubeletEmulator) -> dict[str, tuple[int, int]]:
    """Registrations and updates received, per resource."""
    return {r: (emu.registrations(r), len(emu.updates(r))) for r in emu.resources()}


def test_add_change_reregister_remove_pools_by_editing_the_file(run: Run, node: Node) -> None:
    pfs = node.layout.pfs

    async def main() -> None:
        emu = KubeletEmulator(node.kubelet_dir)
        await emu.start()
        daemon = node.daemon()
        await daemon.start()
        try:
            first = [res("pf0"), res("pf1"), res("pf2")]
            await emu.wait_for(lambda: all(emu.updates(r) for r in first), GUARD_S)
            base = snapshot(emu)

            # 1. add a pool for PF 3: it registers with its VFs; nobody else hears a thing.
            doc = copy.deepcopy(node.doc)
            doc["resourceList"].append(node.pool("pf3", [pfs[3].netdev]))
            node.write(doc)
            await emu.wait_for(lambda: bool(emu.updates(res("pf3"))), GUARD_S)
            assert set(emu.devices(res("pf3"))) == set(pfs[3].vf_addresses)
            assert {r: snapshot(emu)[r] for r in first} == base

            # 2. change pf1's selection in place: one new list for pf1, no re-registration.
            doc["resourceList"][1]["selectors"]["pfNames"] = [f"{pfs[1].netdev}#0-3"]
            node.write(doc)
            await emu.wait_for(lambda: len(emu.devices(res("pf1"))) == 4, GUARD_S)
            now = snapshot(emu)
            assert now[res("pf1")] == (1, base[res("pf1")][1] + 1)
            assert now[res("pf0")] == base[res("pf0")] and now[res("pf2")] == base[res("pf2")]

            # 3. change pf0's options: the kubelet reads them only at registration, so it re-registers.
            doc["resourceList"][0]["preferredAllocation"] = "none"
            node.write(doc)
            await emu.wait_for(lambda: emu.registrations(res("pf0")) == 2, GUARD_S)
            # The new registration's stream opens with one full list.
            await emu.wait_for(lambda: len(emu.updates(res("pf0"))) == base[res("pf0")][1] + 1, GUARD_S)
            assert not emu.options(res("pf0")).get_preferred_allocation_available  # type: ignore[union-attr]
            assert snapshot(emu)[res("pf2")] == base[res("pf2")]

            # 4. remove pf3: its stream ends (the kubelet marks its devices unhealthy); others silent.
            before = snapshot(emu)
            doc["resourceList"].pop()
            node.write(doc)
            await emu.wait_for(lambda: emu.stream_ended(res("pf3")), GUARD_S)
            await emu.wait_for(lambda: reloads(daemon) == 4, GUARD_S)
            assert res("pf3") not in daemon.pools
            after = snapshot(emu)
            assert {r: after[r] for r in first} == {r: before[r] for r in first}
            text = daemon.metrics.render().decode()
            assert "densedev_config_reloads_total" in text
        finally:
            await daemon.stop()
            await emu.stop()

    run(main())


def test_invalid_config_keeps_the_last_good_one(run: Run, node: Node) -> None:
    async def main() -> None:
        emu = KubeletEmulator(node.kubelet_dir)
        await emu.start()
        daemon = node.daemon()
        await daemon.start()
        try:
            await emu.wait_for(lambda: all(emu.updates(res(n)) for n in ("pf0", "pf1", "pf2")), GUARD_S)
            base = snapshot(emu)
            node.write('{"resourceList": [{"resourceName": "bad name!", "selectors": {"drivers": 5}}]}')
            await emu.wait_for(lambda: reloads(daemon, "failure") == 1, GUARD_S)
            await asyncio.sleep(0.2)
            assert snapshot(emu) == base and set(daemon.pools) == set(base)
            # A good file afterwards applies as usual.
            doc = copy.deepcopy(node.doc)
            doc["resourceList"].pop(0)
            node.write(doc)
            await emu.wait_for(lambda: emu.stream_ended(res("pf0")), GUARD_S)
            await emu.wait_for(lambda: reloads(daemon) == 1, GUARD_S)
            assert set(daemon.pools) == {res("pf1"), res("pf2")}
        finally:
            await daemon.stop()
            await emu.stop()

    run(main())


@pytest.mark.skipif(sys.platform != "linux", reason="signals to a child process")
def test_sighup_reloads_and_sigterm_exits_cleanly(run: Run, node: Node, child_env: dict[str, str]) -> None:
    async def main() -> None:
        emu = KubeletEmulator(node.kubelet_dir)
        await emu.start()
        env = child_env
        # subprocess (vfork), not the loop's spawner: see densedev.testing.netns on gRPC and fork.
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "densedev.cli",
                "run",
                "--config",
                str(node.config_path),
                "--sysfs-root",
                str(node.sysfs),
                "--kubelet-dir",
                str(node.kubelet_dir),
                "--devinfo-dir",
                "",
                "--resource-prefix",
                PREFIX,
                "--no-netlink",
            ],
            env=env,
            stderr=subprocess.PIPE,
        )
        try:
            await emu.wait_for(lambda: bool(emu.updates(res("pf2"))), GUARD_S)
            # Same mtime granularity is no problem: SIGHUP reloads whatever the file says now.
            doc = copy.deepcopy(node.doc)
            doc["resourceList"].append(node.pool("pf3", [node.layout.pfs[3].netdev]))
            node.write(doc)
            proc.send_signal(signal.SIGHUP)
            await emu.wait_for(lambda: bool(emu.updates(res("pf3"))), GUARD_S)
            proc.send_signal(signal.SIGTERM)
            code = await asyncio.to_thread(proc.wait, GUARD_S)
            assert code == 0
            assert not [p for p in node.kubelet_dir.iterdir() if p.name.startswith("densedev-")]
        finally:
            if proc.poll() is None:
                proc.kill()
                await asyncio.to_thread(proc.wait)
            assert proc.stderr is not None
            proc.stderr.close()
            await emu.stop()

    run(main())


def test_the_config_watch_tells_a_configmap_swap_from_the_same_file(tmp_path: Path) -> None:
    # A ConfigMap volume: config.json -> ..data/config.json, ..data -> ..<timestamp> (kubelet's
    # atomic writer swaps the ..data symlink on every update).
    mount = tmp_path / "mount"
    mount.mkdir()
    for version in ("..v1", "..v2"):
        (mount / version).mkdir()
        (mount / version / "config.json").write_text('{"resourceList": []}')
    (mount / "..data").symlink_to("..v1")
    (mount / "config.json").symlink_to("..data/config.json")
    path = mount / "config.json"
    first = files.resolved_identity(path)
    assert first is not None and first[0] == str(mount / "..v1" / "config.json")
    assert files.resolved_identity(path) == first
    # Same bytes, another file: a swap is a change even when nothing in the file differs.
    (mount / "..next").symlink_to("..v2")
    (mount / "..next").replace(mount / "..data")
    swapped = files.resolved_identity(path)
    assert swapped is not None and swapped != first and swapped[0].endswith("..v2/config.json")
    # Gone: None, and an identity again once it is back.
    (mount / "..data").unlink()
    assert files.resolved_identity(path) is None
    assert files.identify(path) is None and files.identify(path, follow_symlinks=False) is not None
