"""Hand-built device records and pools, shaped like what discovery reads from a real node."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from densedev.model import ROLE_VF, Device, Pool, PoolConfig, PoolMember, Selector


def dev(address: str, **kw: Any) -> Device:
    """Return a Device with realistic defaults for an mlx5 VF on NUMA 0 (override any field)."""
    base: dict[str, Any] = dict(
        id=address,
        role=ROLE_VF,
        vendor="15b3",
        device="101e",
        pci_class="020000",
        subsystem_vendor="15b3",
        subsystem_device="0000",
        driver="mlx5_core",
        numa_node=0,
        iommu_group=-1,
        noiommu=False,
        acpi_index=-1,
        total_vfs=0,
        num_vfs=0,
        pf="0000:3b:00.0",
        vf_index=int(address.rsplit(".", 1)[1]),
        pf_netdev="ens1f0np0",
        netdevs=(),
        link_type="ether",
        rdma_device="",
        rdma_nodes=(),
        uio="",
        vdpa="",
        vdpa_driver="",
        pcie_root="pci0000:3a",
        aux_type="",
    )
    base.update(kw)
    return Device(**base)


def pool_of(config: PoolConfig, devices: Iterable[Device]) -> Pool:
    """Return a pool whose member IDs are the device addresses."""
    return Pool(config, tuple(PoolMember(d.id, d) for d in devices))


def touch(root: Path, *paths: str) -> None:
    """Create stand-ins for device nodes under a temp dev root."""
    for p in paths:
        f = root / p.removeprefix("/dev/")
        f.parent.mkdir(parents=True, exist_ok=True)
        f.touch()


NET = PoolConfig("mlnx_sriov_netdevice", "nvidia.com")
RDMA = PoolConfig("mlnx_sriov_rdma", "nvidia.com", selectors=(Selector(is_rdma=True),))
DPDK = PoolConfig("intel_sriov_dpdk", "intel.com", selectors=(Selector(drivers=("vfio-pci",)),))
