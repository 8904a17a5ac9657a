"""The daemon run end to end with its DRA side: a simulated node and the three emulated parties.

The DRA kubelet emulator (registration, Prepare/Unprepare, the health stream), the API-server stand-in
(ResourceSlices validated against the official schema, the ResourceClaims) and the device-plugin kubelet
emulator (pods, PodResources), started in the order a node starts them.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from densedev.daemon import Daemon
from densedev.dra import DraSettings, names
from densedev.dra.apiclient import ResourceClient
from densedev.dra.driver import ClientFactory
from densedev.dra.names import DEFAULT_DRIVER_NAME as DRIVER
from densedev.pools import config as config_mod
from densedev.testing import simnode
from densedev.testing.apiserver import ApiServerStandIn
from densedev.testing.dra_kubelet import DraKubelet, allocated_claim
from densedev.testing.kubelet import KubeletEmulator
from helpers import node as node_helpers
from helpers.node import PREFIX

GUARD_S = 30.0  # the DRA path crosses three emulated parties: a wider hang guard than helpers.node's
NODE = "node-a"
DP = f"{PREFIX}/dp"
DRA = f"{PREFIX}/dra"


def config(pools: list[dict[str, Any]], driver: str | None = None) -> dict[str, Any]:
    """The node's config document with these pools (and this ``draDriverName`` when given)."""
    doc: dict[str, Any] = {"resourceList": pools, "rdmaPollSeconds": 0.05}
    if driver is not None:
        doc["draDriverName"] = driver
    return doc


def pool(name: str, pf_names: list[str], api: str | None = None) -> dict[str, Any]:
    """A pool of the VFs of these PFs, served through ``api`` (the device-plugin API when None)."""
    return node_helpers.pool(name, pf_names, **({} if api is None else {"api": api}))


class Node(node_helpers.Node):
    """A simulated node: PF 0's VFs in pool ``dp`` (device plugin), PF 1's in pool ``dra`` (DRA)."""

    def __init__(self, tmp: Path, pfs: int = 2, vfs_per_pf: int = 8) -> None:
        # unix socket paths are limited to 107 bytes: short dirs, as the kubelet's own.
        self.short = Path(tempfile.mkdtemp(prefix="dd-", dir="/tmp"))
        (self.short / "dp").mkdir()
        super().__init__(
            tmp,
            pfs,
            vfs_per_pf,
            rdma=False,
            config=lambda layout: config([pool("dp", [layout.pfs[0].netdev])]),
            kubelet_dir=self.short / "dp",
        )
        self.plugins_dir = self.short / "plugins"
        self.registry_dir = self.short / "registry"
        self.pr_socket = self.short / "pr.sock"
        self.cdi_dir = tmp / "cdi"
        self.devinfo_dir = tmp / "devinfo"
        self.api: ApiServerStandIn | None = None

    def cleanup(self) -> None:
        """Remove the short dirs outside the test's temp dir."""
        shutil.rmtree(self.short, ignore_errors=True)

    @property
    def pf0(self) -> simnode.SimPF:
        return self.layout.pfs[0]

    @property
    def pf1(self) -> simnode.SimPF:
        return self.layout.pfs[1]

    def write(self, pools: list[dict[str, Any]], driver: str | None = None) -> None:
        """Replace the config with these pools (and this ``draDriverName`` when given)."""
        self.write_config(config(pools, driver))

    def daemon(self, client: ClientFactory | None = None, **kw: Any) -> Daemon:
        """A daemon with its DRA driver talking to the stand-in (or to ``client``)."""
        assert self.api is not None
        url = self.api.url

        async def standin() -> ResourceClient:
            return ResourceClient.for_url(url)

        dra = DraSettings(
            node_name=NODE,
            plugins_dir=self.plugins_dir,
            registry_dir=self.registry_dir,
            min_write_interval_s=0.05,
        )
        settings = self.settings(pod_resources_socket=self.pr_socket, dra=dra, **kw)
        cfg = config_mod.load(self.config_path, default_prefix=PREFIX)
        return Daemon(settings, cfg, dra_client=client or standin)

    # -- what the API server and the kubelets see --------------------------------------------------
    def published(self, driver: str | None = None) -> dict[str, str]:
        """Device name -> PCI address of every device in the node's slices (of ``driver``) at the stand-in."""
        assert self.api is not None
        out: dict[str, str] = {}
        for s in self.api.node_slices(NODE):
            if driver is not None and s["spec"]["driver"] != driver:
                continue
            for d in s["spec"].get("devices") or []:
                out[d["name"]] = d["attributes"]["pciAddress"]["string"]
        return out

    def drivers(self) -> set[str]:
        """The drivers of the node's slices at the stand-in."""
        assert self.api is not None
        return {s["spec"]["driver"] for s in self.api.node_slices(NODE)}

    def claim(self, address: str, name: str = "", driver: str = DRIVER) -> tuple[str, str, str]:
        """Store at the stand-in a claim allocated the device at ``address``; return its reference."""
        assert self.api is not None
        uid = str(uuid.uuid4())
        name = name or f"claim-{uid[:8]}"
        result = {"request": "nic", "driver": driver, "pool": NODE, "device": names.device_name(address)}
        self.api.put_claim(allocated_claim("default", name, uid, [result]))
        return ("default", name, uid)

    def spec(self, uid: str, driver: str = DRIVER) -> Path:
        """The CDI spec file Prepare writes for a claim of ``driver``."""
        return self.cdi_dir / f"densedev_dra_{driver}_{uid}.json"

    def sockets(self, driver: str) -> list[Path]:
        """The registration and DRA sockets of ``driver`` that exist now."""
        paths = (self.registry_dir / f"{driver}-reg.sock", self.plugins_dir / driver / "dra.sock")
        return [p for p in paths if p.exists()]


class Cluster:
    """The three emulated parties and the daemon, started in the order a node starts them."""

    def __init__(self, node: Node) -> None:
        self.node = node
        assert node.api is not None
        self.api = node.api
        self.kubelet = KubeletEmulator(node.kubelet_dir, pod_resources_socket=node.pr_socket, strict=True)
        self.dra_kubelet = DraKubelet(node.registry_dir, on_start=self._wipe)
        self.daemon: Daemon | None = None

    async def _wipe(self) -> None:
        # The kubelet deletes the node's slices at its start (DRA manager, deletecollection).
        self.api.wipe_node(NODE)

    async def start_daemon(self) -> Daemon:
        self.daemon = self.node.daemon()
        await self.daemon.start()
        return self.daemon

    async def stop_daemon(self) -> None:
        if self.daemon is not None:
            await self.daemon.stop()
            self.daemon = None

    async def until(self, cond: Callable[[], bool], what: str) -> None:
        try:
            await self.dra_kubelet.wait_for(cond, GUARD_S)
        except TimeoutError:
            raise AssertionError(f"never happened: {what}") from None


@contextlib.asynccontextmanager
async def cluster(node: Node) -> AsyncIterator[Cluster]:
    api = ApiServerStandIn()
    await api.start()
    api.add_node(NODE)
    node.api = api
    c = Cluster(node)
    await c.kubelet.start()
    await c.dra_kubelet.start()
    try:
        await c.start_daemon()
        yield c
    finally:
        await c.stop_daemon()
        await c.dra_kubelet.stop()
        await c.kubelet.stop()
        await api.stop()
        assert api.rejected == [], api.rejected


def by_name(addresses: list[str]) -> dict[str, str]:
    return {names.device_name(a): a for a in addresses}
