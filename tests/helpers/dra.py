"""A DRA NodeService over temp dirs, with the state its gate reads, and an in-memory claim store."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from densedev.dra import names
from densedev.dra.claims import ClaimRef, PoolGate
from densedev.dra.node import NodeService, NodeSettings
from densedev.model import Device, PoolConfig
from densedev.testing.dra_kubelet import ClaimStore, allocated_claim
from helpers.devices import DPDK, RDMA, dev, pool_of, touch

if TYPE_CHECKING:
    from densedev.dra.plugin import KubeletPlugin

DRIVER = "net.densedev.io"
NODE = "node-a"
NET = PoolConfig("vf_pool", "example.com")
VF = "0000:3b:00.2"
VF2 = "0000:3b:00.3"
VFIO = "0000:18:02.0"
RDMA_VF = "0000:5e:00.1"
OFF_POOL = "0000:3b:00.7"  # on the node, in no DRA pool
KIND = f"{DRIVER}/claim"


def devices() -> dict[str, tuple[Device, PoolConfig]]:
    """The node's DRA devices: two kernel VFs, a vfio-pci VF and an RDMA VF, each with its pool."""
    return {
        VF: (dev(VF, netdevs=("ens1f0v2",)), NET),
        VF2: (dev(VF2, netdevs=("ens1f0v3",)), NET),
        VFIO: (dev(VFIO, vendor="8086", device="154c", driver="vfio-pci", iommu_group=83), DPDK),
        RDMA_VF: (
            dev(RDMA_VF, rdma_device="mlx5_3", rdma_nodes=("uverbs3", "umad3")),
            RDMA,
        ),
    }


class Node:
    """A NodeService over temp dirs, with the state its gate reads, and an in-memory claim store."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.dev_root = root / "dev"
        touch(self.dev_root, "/dev/vfio/vfio", "/dev/vfio/83", "/dev/infiniband/uverbs3")
        touch(self.dev_root, "/dev/infiniband/umad3", "/dev/infiniband/rdma_cm")
        self.table = devices()
        self.unhealthy: set[str] = set()
        self.holders: dict[str, str] = {}
        self.store = ClaimStore()
        self.settings = NodeSettings(
            DRIVER,
            NODE,
            plugin_dir=root / "plugins" / DRIVER,
            cdi_dir=root / "cdi",
            devinfo_dir=root / "devinfo",
            dev_root=self.dev_root,
        )
        self.service = self.fresh()

    def gate(self) -> PoolGate:
        by_config: dict[PoolConfig, list[Device]] = {}
        for d, config in self.table.values():
            by_config.setdefault(config, []).append(d)
        return PoolGate(
            lambda i: i in self.table or i == OFF_POOL,
            [pool_of(c, ds) for c, ds in by_config.items()],
            lambda i: i not in self.unhealthy,
            self.holders.get,
        )

    def kubelet_plugin(self) -> KubeletPlugin:
        """The DRA kubelet plugin over this node (its sockets under ``root``), not yet started."""
        from densedev.dra.plugin import KubeletPlugin

        return KubeletPlugin(
            DRIVER,
            NODE,
            self.store,
            self.gate(),
            plugins_dir=self.root / "plugins",
            registry_dir=self.root / "registry",
            cdi_dir=self.settings.cdi_dir,
            devinfo_dir=self.settings.devinfo_dir,
            dev_root=self.dev_root,
            poll=0.05,
        )

    def fresh(self) -> NodeService:
        """A new service over the same files (a restarted daemon), not yet recovered."""
        return NodeService(self.settings, self.store, self.gate())

    def claim(self, *results: tuple[str, str], name: str = "", uid: str = "", pool: str = NODE) -> ClaimRef:
        """Store an allocated claim of (request, device ID) results on this node's pool; return its ref."""
        uid = uid or str(uuid.uuid4())
        name = name or f"claim-{uid[:8]}"
        self.store.put(
            allocated_claim(
                "default",
                name,
                uid,
                [
                    {"request": r, "driver": DRIVER, "pool": pool, "device": names.device_name(d)}
                    for r, d in results
                ],
            )
        )
        return ClaimRef("default", name, uid)

    def spec(self, uid: str) -> dict[str, Any]:
        return json.loads((self.settings.cdi_dir / f"densedev_dra_{DRIVER}_{uid}.json").read_text())
