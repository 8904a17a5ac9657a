"""Hand-built device records and pools, shaped like what discovery reads from a real node."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from densedev.model import Device, Pool, PoolConfig, PoolMember, Role, Selector


def dev(address: str, role: Role = Role.VF, **fields: Any) -> Device:
    """Return a Device: an mlx5 VF of PF 0000:3b:00.0 on NUMA 0, with any field overridden by ``fields``.

    The one place tests build a Device by hand; the presets of test modules (an Intel E810 function, a
    function linked to no PF) call it with their defaults.
    """
    base: dict[str, Any] = dict(
        id=address,
        role=role,
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
    if "vf_index" not in fields:
        base["vf_index"] = int(address.rsplit(".", 1)[-1])  # a VF's function number stands in for its index
    base.update(fields)
    return Device(**base)


def unlinked(
    address: str,
    role: Role = Role.VF,
    *,
    vendor: str = "15b3",
    numa: int = 0,
    rdma: str = "",
    netdevs: tuple[str, ...] = (),
    link_type: str = "",
    **fields: Any,
) -> Device:
    """Return a Device linked to no PF (no PF address, VF index, PF netdev) unless ``fields`` say so.

    Its subsystem IDs are the vendor's, its link type follows its netdevs and its PCIe root its bus:
    the shape selector tests build nodes from.
    """
    base: dict[str, Any] = dict(
        vendor=vendor,
        subsystem_vendor=vendor,
        subsystem_device="0001",
        numa_node=numa,
        rdma_device=rdma,
        pf="",
        vf_index=-1,
        pf_netdev="",
        netdevs=netdevs,
        link_type=link_type or ("ether" if netdevs else ""),
        pcie_root="pci0000:" + address[5:7] if role != Role.SF else "",
    )
    return dev(address, role, **{**base, **fields})


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
