"""A simulated node with its config file and daemon paths, and a kubelet emulator with a daemon on it."""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from densedev.daemon import Daemon, DaemonSettings
from densedev.pools import config as config_mod
from densedev.testing import simnode
from densedev.testing.kubelet import KubeletEmulator

GUARD_S = 20.0
PREFIX = "example.com"


NO_FILES: dict[str, Any] = {"cdi_dir": None, "devinfo_dir": None}  # a daemon writing no CDI, no device-info


def pool(
    name: str, pf_names: list[str], selectors: dict[str, Any] | None = None, **extra: Any
) -> dict[str, Any]:
    """A resourceList entry of this node's prefix taking the VFs of the named PFs (and ``selectors``)."""
    chosen = {"pfNames": pf_names, **(selectors or {})}
    return {"resourceName": name, "resourcePrefix": PREFIX, "selectors": chosen, **extra}


def three_pools(layout: simnode.NodeLayout) -> dict[str, Any]:
    """One pool per PF for PFs 0-2, leaving PF 3 out so that a reload can add a pool for it."""
    pfs = layout.pfs
    return {"resourceList": [pool(f"pf{i}", [pfs[i].netdev]) for i in range(3)], "rdmaPollSeconds": 0.05}


def pools_config(layout: simnode.NodeLayout, **top: object) -> dict[str, Any]:
    """Pools of a typical SR-IOV node: one per PF for two PFs, one for every other VF, shared RDMA."""
    pfs = layout.pfs
    resources: list[dict[str, object]] = [
        {
            "resourceName": f"sriov_{pf.netdev}",
            "resourcePrefix": PREFIX,
            "selectors": {"pfNames": [pf.netdev]},
            "healthPolicy": {"holdDownSeconds": 0.2},
        }
        for pf in pfs[:2]
    ]
    resources.append(
        {
            "resourceName": "other_vfs",
            "resourcePrefix": PREFIX,
            "selectors": {"pfNames": [pf.netdev for pf in pfs[2:]]},
            "healthPolicy": {"holdDownSeconds": 0.2},
        }
    )
    resources.append(
        {
            "resourceName": "rdma_shared",
            "resourcePrefix": PREFIX,
            "deviceType": "accelerator",
            "rdmaShared": 4,
            "selectors": {"pciAddresses": [pf.address for pf in pfs], "isRdma": True},
            "healthPolicy": {"holdDownSeconds": 0.2},
        }
    )
    return {"resourceList": resources, "rdmaPollSeconds": 0.05, "coalesceMs": 2, **top}


class Node:
    """A simulated node, its config file and the paths a daemon on it uses."""

    def __init__(
        self,
        tmp: Path,
        pfs: int = 4,
        vfs_per_pf: int = 8,
        *,
        rdma: bool = True,
        extras: bool = False,
        config: Callable[[simnode.NodeLayout], dict[str, Any]] | None = None,
        kubelet_dir: Path | None = None,
    ) -> None:
        self.sysfs = tmp / "sys"
        self.layout = simnode.build_node(self.sysfs, pfs=pfs, vfs_per_pf=vfs_per_pf, rdma=rdma, extras=extras)
        self.config_path = tmp / "config.json"
        self.doc: dict[str, Any] = {}
        self.write_config((config or pools_config)(self.layout))
        # A short dir like the kubelet's own: unix socket paths are limited to 107 bytes.
        self._own_kubelet_dir = kubelet_dir is None
        self.kubelet_dir = kubelet_dir or Path(tempfile.mkdtemp(prefix="dd-", dir="/tmp"))
        self.tmp = tmp

    def cleanup(self) -> None:
        """Remove what this node made outside the test's temp dir."""
        if self._own_kubelet_dir:
            shutil.rmtree(self.kubelet_dir, ignore_errors=True)

    def write_config(self, doc: dict[str, Any] | str) -> None:
        """Replace the config file atomically, as a ConfigMap update does."""
        tmp = self.config_path.with_suffix(".tmp")
        tmp.write_text(doc if isinstance(doc, str) else json.dumps(doc))
        tmp.replace(self.config_path)
        if not isinstance(doc, str):
            self.doc = doc  # the config last written as a document, for a test to edit and write again

    def settings(self, **kw: Any) -> DaemonSettings:
        """Daemon settings pointing every path into the temp dir."""
        base: dict[str, Any] = dict(
            sysfs_root=self.sysfs,
            kubelet_dir=self.kubelet_dir,
            dev_root=self.tmp / "dev",
            cdi_dir=self.tmp / "cdi",
            devinfo_dir=self.tmp / "devinfo",
            resource_prefix=PREFIX,
            config_path=self.config_path,
            netlink=False,
            config_poll_s=0.05,
        )
        base.update(kw)
        return DaemonSettings(**base)

    def daemon(self, **kw: Any) -> Daemon:
        """A daemon on this node with its current config."""
        return Daemon(self.settings(**kw), config_mod.load(self.config_path, default_prefix=PREFIX))

    def emulator(self, **kw: Any) -> KubeletEmulator:
        """A kubelet emulator serving this node's kubelet dir."""
        return KubeletEmulator(self.kubelet_dir, **kw)

    async def wait_listed(self, emu: KubeletEmulator, daemon: Daemon) -> None:
        """Wait until every pool of the daemon has registered and sent its list."""
        names = {p.full_name for p in daemon.config.pools}
        await emu.wait_for(
            lambda: names <= set(emu.resources()) and all(emu.updates(n) for n in names), GUARD_S
        )


def res(name: str) -> str:
    """The full resource name of a pool of this node's prefix."""
    return f"{PREFIX}/{name}"


@contextlib.asynccontextmanager
async def daemon_on(node: Node, emu: KubeletEmulator, **kw: Any) -> AsyncIterator[Daemon]:
    """A daemon on the node, yielded once every pool has listed at ``emu``; stopped after unless it was."""
    daemon = node.daemon(**kw)
    await daemon.start()
    try:
        await node.wait_listed(emu, daemon)
        yield daemon
    finally:
        if daemon.started:  # a test may stop it itself, to look at what stopping leaves
            await daemon.stop()


def numvfs_uevent(pf_address: str, seqnum: int) -> bytes:
    """Return the uevent the kernel sends when a PF's sriov_numvfs changes (KOBJ_CHANGE, pci/iov.c)."""
    devpath = f"/devices/pci0000:00/{pf_address}"
    return (
        f"change@{devpath}\0ACTION=change\0DEVPATH={devpath}\0SUBSYSTEM=pci\0"
        f"PCI_SLOT_NAME={pf_address}\0SEQNUM={seqnum}\0".encode()
    )
