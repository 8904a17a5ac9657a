"""Allocate: the exact env, device nodes and errors for each device kind (issue 5)."""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from helpers.devices import DPDK, NET, RDMA, dev, pool_of, touch
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from densedev._proto import api_pb2
from densedev.alloc.respond import AllocationSettings, PoolAllocator, build_response
from densedev.health.tracker import HealthTracker
from densedev.kubelet.server import PoolService
from densedev.model import Device, Pool, PoolConfig, PoolMember, RequestError, Role, Selector
from densedev.pools.config import env_var_name
from densedev.testing.kubelet import KubeletEmulator

# -- hand-built device records, shaped like what discovery reads from a real node ------------------


def nodes(resp: api_pb2.ContainerAllocateResponse) -> list[tuple[str, str, str]]:
    return [(d.container_path, d.host_path, d.permissions) for d in resp.devices]


@pytest.fixture
def dev_root(tmp_path: Path) -> Path:
    root = tmp_path / "dev"
    root.mkdir()
    return root


def settings(tmp_path: Path, dev_root: Path, cdi: bool = False) -> AllocationSettings:
    return AllocationSettings(
        cdi_dir=tmp_path / "cdi" if cdi else None, devinfo_dir=tmp_path / "devinfo", dev_root=dev_root
    )


# -- env names ------------------------------------------------------------------------------------


def test_env_name_follows_the_sriov_plugin() -> None:
    # Its GetEnvs: "PCIDEVICE_<prefix>_<name>" upper-cased with "." made "_" and nothing else: "-" stays.
    assert env_var_name("intel.com/sriov_vppdpdk5") == "PCIDEVICE_INTEL_COM_SRIOV_VPPDPDK5"
    assert env_var_name("example.org/mlx-vf.a") == "PCIDEVICE_EXAMPLE_ORG_MLX-VF_A"


def test_allocate_names_the_variables_as_the_config_warns(tmp_path: Path, dev_root: Path) -> None:
    # The config warns that a "-" stays in the variable (shells cannot read it); Allocate must say the
    # same name, or a workload written against the SR-IOV plugin finds no variable.
    config = PoolConfig("sriov-net_0", "my-corp.com")
    alloc = PoolAllocator(
        pool_of(config, [dev("0000:3b:00.2")]), settings(tmp_path, dev_root), lambda _id: True
    )
    resp = alloc.allocate(["0000:3b:00.2"])
    assert sorted(resp.envs) == [
        "PCIDEVICE_MY-CORP_COM_SRIOV-NET_0",
        "PCIDEVICE_MY-CORP_COM_SRIOV-NET_0_INFO",
    ]


# -- one test per device kind ----------------------------------------------------------------------


def test_kernel_netdev_vf(tmp_path: Path, dev_root: Path) -> None:
    vf = dev("0000:3b:00.2", netdevs=("ens1f0v0",))
    alloc = PoolAllocator(pool_of(NET, [vf]), settings(tmp_path, dev_root), lambda _id: True)
    resp = alloc.allocate(["0000:3b:00.2"])
    info = (
        '{"0000:3b:00.2":{"generic":{"deviceID":"0000:3b:00.2"}}}'  # compact, as the SR-IOV plugin writes it
    )
    assert dict(resp.envs) == {
        "PCIDEVICE_NVIDIA_COM_MLNX_SRIOV_NETDEVICE": "0000:3b:00.2",
        "PCIDEVICE_NVIDIA_COM_MLNX_SRIOV_NETDEVICE_INFO": info,
    }
    assert nodes(resp) == []  # a kernel netdev is moved into the pod by the CNI; it has no node
    assert list(resp.cdi_devices) == []


def test_vfio_vf_with_iommu(tmp_path: Path, dev_root: Path) -> None:
    touch(dev_root, "/dev/vfio/vfio", "/dev/vfio/83", "/dev/vfio/84")
    a = dev(
        "0000:18:02.0", vendor="8086", device="154c", driver="vfio-pci", iommu_group=83, pf="0000:18:00.0"
    )
    b = dev(
        "0000:18:02.1", vendor="8086", device="154c", driver="vfio-pci", iommu_group=84, pf="0000:18:00.0"
    )
    alloc = PoolAllocator(pool_of(DPDK, [a, b]), settings(tmp_path, dev_root), lambda _id: True)
    resp = alloc.allocate(["0000:18:02.1", "0000:18:02.0"])
    assert resp.envs["PCIDEVICE_INTEL_COM_INTEL_SRIOV_DPDK"] == "0000:18:02.1,0000:18:02.0"
    assert json.loads(resp.envs["PCIDEVICE_INTEL_COM_INTEL_SRIOV_DPDK_INFO"]) == {
        "0000:18:02.1": {
            "generic": {"deviceID": "0000:18:02.1"},
            "vfio": {"mount": "/dev/vfio/vfio", "dev-mount": "/dev/vfio/84"},
        },
        "0000:18:02.0": {
            "generic": {"deviceID": "0000:18:02.0"},
            "vfio": {"mount": "/dev/vfio/vfio", "dev-mount": "/dev/vfio/83"},
        },
    }
    # /dev/vfio/vfio once, though both devices need it
    assert nodes(resp) == [
        ("/dev/vfio/vfio", "/dev/vfio/vfio", "rw"),
        ("/dev/vfio/84", "/dev/vfio/84", "rw"),
        ("/dev/vfio/83", "/dev/vfio/83", "rw"),
    ]


def test_vfio_vf_without_iommu(tmp_path: Path, dev_root: Path) -> None:
    touch(dev_root, "/dev/vfio/vfio", "/dev/vfio/noiommu-0")
    vf = dev("0000:00:05.0", driver="vfio-pci", iommu_group=0, noiommu=True)
    alloc = PoolAllocator(pool_of(DPDK, [vf]), settings(tmp_path, dev_root), lambda _id: True)
    resp = alloc.allocate(["0000:00:05.0"])
    assert nodes(resp) == [
        ("/dev/vfio/vfio", "/dev/vfio/vfio", "rw"),
        ("/dev/vfio/0", "/dev/vfio/noiommu-0", "rw"),
    ]
    info = json.loads(resp.envs["PCIDEVICE_INTEL_COM_INTEL_SRIOV_DPDK_INFO"])
    assert info["0000:00:05.0"]["vfio"] == {"mount": "/dev/vfio/vfio", "dev-mount": "/dev/vfio/0"}


def test_vfio_group_node_missing_is_a_precondition_error(tmp_path: Path, dev_root: Path) -> None:
    touch(dev_root, "/dev/vfio/vfio")
    vf = dev("0000:18:02.0", driver="vfio-pci", iommu_group=83)
    alloc = PoolAllocator(pool_of(DPDK, [vf]), settings(tmp_path, dev_root), lambda _id: True)
    with pytest.raises(RequestError) as e:
        alloc.allocate(["0000:18:02.0"])
    assert e.value.kind == RequestError.PRECONDITION
    assert "0000:18:02.0" in e.value.message and "/dev/vfio/83" in e.value.message


def test_uio_device(tmp_path: Path, dev_root: Path) -> None:
    touch(dev_root, "/dev/uio3")
    vf = dev("0000:18:02.3", driver="igb_uio", uio="uio3")
    alloc = PoolAllocator(pool_of(DPDK, [vf]), settings(tmp_path, dev_root), lambda _id: True)
    resp = alloc.allocate(["0000:18:02.3"])
    assert nodes(resp) == [("/dev/uio3", "/dev/uio3", "rw")]
    info = json.loads(resp.envs["PCIDEVICE_INTEL_COM_INTEL_SRIOV_DPDK_INFO"])
    assert info["0000:18:02.3"]["uio"] == {"mount": "/dev/uio3"}


def test_rdma_vf_roce_without_issm(tmp_path: Path, dev_root: Path) -> None:
    # RoCE functions have uverbs and umad but usually no issm: the missing node must not fail anything.
    touch(dev_root, "/dev/infiniband/uverbs3", "/dev/infiniband/umad3", "/dev/infiniband/rdma_cm")
    vf = dev(
        "0000:3b:00.3",
        rdma_device="mlx5_3",
        rdma_nodes=("/dev/infiniband/uverbs3", "/dev/infiniband/umad3", "/dev/infiniband/issm3"),
    )
    alloc = PoolAllocator(pool_of(RDMA, [vf]), settings(tmp_path, dev_root), lambda _id: True)
    resp = alloc.allocate(["0000:3b:00.3"])
    assert nodes(resp) == [
        ("/dev/infiniband/uverbs3", "/dev/infiniband/uverbs3", "rw"),
        ("/dev/infiniband/umad3", "/dev/infiniband/umad3", "rw"),
        ("/dev/infiniband/rdma_cm", "/dev/infiniband/rdma_cm", "rw"),
    ]
    assert json.loads(resp.envs["PCIDEVICE_NVIDIA_COM_MLNX_SRIOV_RDMA_INFO"]) == {
        "0000:3b:00.3": {
            "generic": {"deviceID": "0000:3b:00.3"},
            "rdma": {
                "rdma_dev": "mlx5_3",
                "uverbs": "/dev/infiniband/uverbs3",
                "umad": "/dev/infiniband/umad3",
                "rdma_cm": "/dev/infiniband/rdma_cm",
            },
        }
    }


def test_rdma_infiniband_with_issm_and_ucm_by_name(tmp_path: Path, dev_root: Path) -> None:
    touch(dev_root, *(f"/dev/infiniband/{n}" for n in ("uverbs0", "umad0", "issm0", "ucm0", "rdma_cm")))
    vf = dev(
        "0000:5e:00.1",
        link_type="infiniband",
        rdma_device="mlx5_0",
        rdma_nodes=("uverbs0", "umad0", "issm0", "ucm0"),
    )
    resp = PoolAllocator(pool_of(RDMA, [vf]), settings(tmp_path, dev_root), lambda _id: True).allocate(
        ["0000:5e:00.1"]
    )
    assert [n[0] for n in nodes(resp)] == [
        "/dev/infiniband/uverbs0",
        "/dev/infiniband/umad0",
        "/dev/infiniband/issm0",
        "/dev/infiniband/ucm0",
        "/dev/infiniband/rdma_cm",
    ]
    rdma = json.loads(resp.envs["PCIDEVICE_NVIDIA_COM_MLNX_SRIOV_RDMA_INFO"])["0000:5e:00.1"]["rdma"]
    assert rdma["issm"] == "/dev/infiniband/issm0"


def test_rdma_nodes_only_for_rdma_pools(tmp_path: Path, dev_root: Path) -> None:
    touch(dev_root, "/dev/infiniband/uverbs3", "/dev/infiniband/rdma_cm")
    vf = dev("0000:3b:00.3", rdma_device="mlx5_3", rdma_nodes=("/dev/infiniband/uverbs3",))
    resp = PoolAllocator(pool_of(NET, [vf]), settings(tmp_path, dev_root), lambda _id: True).allocate(
        ["0000:3b:00.3"]
    )
    assert nodes(resp) == []


def test_shared_rdma_pool_maps_every_id_to_its_device(tmp_path: Path, dev_root: Path) -> None:
    touch(dev_root, "/dev/infiniband/uverbs0", "/dev/infiniband/umad0", "/dev/infiniband/rdma_cm")
    pf = dev(
        "0000:3b:00.0", role="pf", pf="", vf_index=-1, numa_node=1, rdma_device="mlx5_0",
        rdma_nodes=("uverbs0", "umad0"),
    )  # fmt: skip
    config = PoolConfig("rdma_shared_device_a", "rdma", rdma_shared=100)
    pool = Pool(config, tuple(PoolMember(f"mlx5_0-{i}", pf) for i in range(100)))
    alloc = PoolAllocator(pool, settings(tmp_path, dev_root), lambda _id: True)
    one = alloc.allocate(["mlx5_0-7"])
    two = alloc.allocate(["mlx5_0-8", "mlx5_0-9"])  # the same device twice: its nodes once
    for resp in (one, two):
        assert resp.envs["PCIDEVICE_RDMA_RDMA_SHARED_DEVICE_A"] == "0000:3b:00.0"
        assert nodes(resp) == [
            ("/dev/infiniband/uverbs0", "/dev/infiniband/uverbs0", "rw"),
            ("/dev/infiniband/umad0", "/dev/infiniband/umad0", "rw"),
            ("/dev/infiniband/rdma_cm", "/dev/infiniband/rdma_cm", "rw"),
        ]


def test_vdpa_vhost_device(tmp_path: Path, dev_root: Path) -> None:
    touch(dev_root, "/dev/vhost-vdpa-2")
    vf = dev("0000:65:00.3", vdpa="vdpa2", vdpa_driver="vhost_vdpa")
    config = PoolConfig("mlx_vdpa", "nvidia.com", selectors=(Selector(vdpa_type="vhost"),))
    resp = PoolAllocator(pool_of(config, [vf]), settings(tmp_path, dev_root), lambda _id: True).allocate(
        ["0000:65:00.3"]
    )
    assert nodes(resp) == [("/dev/vhost-vdpa-2", "/dev/vhost-vdpa-2", "rw")]
    info = json.loads(resp.envs["PCIDEVICE_NVIDIA_COM_MLX_VDPA_INFO"])["0000:65:00.3"]
    assert info == {"generic": {"deviceID": "0000:65:00.3"}, "vdpa": {"mount": "/dev/vhost-vdpa-2"}}


def test_vdpa_node_name_recorded_by_discovery_is_used_as_is(tmp_path: Path, dev_root: Path) -> None:
    touch(dev_root, "/dev/vhost-vdpa-5")
    vf = dev("0000:65:00.3", vdpa="vhost-vdpa-5", vdpa_driver="vhost_vdpa")
    parts, _ = build_response(NET, [vf], dev_root)
    assert parts.devices == ((("/dev/vhost-vdpa-5", "/dev/vhost-vdpa-5", "rw")),)


def test_vdpa_virtio_device_has_no_node(tmp_path: Path, dev_root: Path) -> None:
    vf = dev("0000:65:00.4", vdpa="vdpa3", vdpa_driver="virtio_vdpa")
    resp = PoolAllocator(pool_of(NET, [vf]), settings(tmp_path, dev_root), lambda _id: True).allocate(
        ["0000:65:00.4"]
    )
    assert nodes(resp) == []


def test_vhost_net(tmp_path: Path, dev_root: Path) -> None:
    touch(dev_root, "/dev/vhost-net", "/dev/net/tun")
    config = PoolConfig("sriov_vhost", "intel.com", selectors=(Selector(need_vhost_net=True),))
    vfs = [dev("0000:18:02.0", driver="iavf"), dev("0000:18:02.1", driver="iavf")]
    resp = PoolAllocator(pool_of(config, vfs), settings(tmp_path, dev_root), lambda _id: True).allocate(
        ["0000:18:02.0", "0000:18:02.1"]
    )
    assert nodes(resp) == [("/dev/vhost-net", "/dev/vhost-net", "rw"), ("/dev/net/tun", "/dev/net/tun", "rw")]
    info = json.loads(resp.envs["PCIDEVICE_INTEL_COM_SRIOV_VHOST_INFO"])
    assert info["0000:18:02.1"]["vhost"] == {"net-mount": "/dev/vhost-net", "tun-mount": "/dev/net/tun"}


def test_accelerator_with_extra_info(tmp_path: Path, dev_root: Path) -> None:
    touch(dev_root, "/dev/vfio/vfio", "/dev/vfio/120")
    qat = dev(
        "0000:b1:00.1", role=Role.VF, vendor="8086", device="4941", pci_class="0b4000", driver="vfio-pci",
        iommu_group=120, pf="0000:b1:00.0", link_type="", pf_netdev="",
    )  # fmt: skip
    config = PoolConfig(
        "intel_qat",
        "intel.com",
        device_type="accelerator",
        additional_info=(
            ("*", (("token", "abc"), ("kind", "qat"))),
            ("0000:b1:00.1", (("kind", "qat4xxx"),)),
        ),
    )
    alloc = PoolAllocator(pool_of(config, [qat]), settings(tmp_path, dev_root), lambda _id: True)
    resp = alloc.allocate(["0000:b1:00.1"])
    info = json.loads(resp.envs["PCIDEVICE_INTEL_COM_INTEL_QAT_INFO"])["0000:b1:00.1"]
    assert info["extra"] == {"token": "abc", "kind": "qat4xxx"}
    assert info["vfio"] == {"mount": "/dev/vfio/vfio", "dev-mount": "/dev/vfio/120"}
    assert not (tmp_path / "devinfo").exists()  # device-info files are for network devices only


def test_plain_pci_function_gets_generic_only(tmp_path: Path, dev_root: Path) -> None:
    nic = dev("0000:af:00.0", role=Role.PCI, pf="", vf_index=-1, driver="ice")
    parts, _ = build_response(NET, [nic], dev_root)
    assert json.loads(parts.envs["PCIDEVICE_NVIDIA_COM_MLNX_SRIOV_NETDEVICE_INFO"]) == {
        "0000:af:00.0": {"generic": {"deviceID": "0000:af:00.0"}}
    }


# -- errors -----------------------------------------------------------------------------------------


@pytest.fixture
def two_pools(tmp_path: Path, dev_root: Path) -> tuple[PoolAllocator, set[str]]:
    vfs = [dev(f"0000:3b:00.{i}", netdevs=(f"vf{i}",)) for i in range(2, 6)]
    pool = pool_of(NET, vfs)
    # As the daemon wires it: the allocator asks the health tracker, the only holder of health.
    tracker = HealthTracker(vfs, [pool])
    tracker.set_links([("vf5", False)])
    alloc = PoolAllocator(
        pool, settings(tmp_path, dev_root), functools.partial(tracker.is_healthy, NET.full_name)
    )
    return alloc, {"0000:3b:00.5"}


@pytest.mark.parametrize(
    ("ids", "kind", "named"),
    [
        ([], RequestError.INVALID, "no device IDs"),
        (["0000:3b:00.2", "0000:99:00.1"], RequestError.INVALID, "0000:99:00.1"),
        (["0000:3b:00.2", "0000:3b:00.2"], RequestError.INVALID, "twice: 0000:3b:00.2"),
        (["0000:3b:00.2", "0000:3b:00.5"], RequestError.PRECONDITION, "unhealthy: 0000:3b:00.5"),
    ],
)
def test_allocate_errors_name_the_ids(
    two_pools: tuple[PoolAllocator, set[str]], ids: list[str], kind: str, named: str, tmp_path: Path
) -> None:
    alloc, _ = two_pools
    with pytest.raises(RequestError) as e:
        alloc.allocate(ids)
    assert e.value.kind == kind
    assert named in e.value.message
    # The server prefixes the pool's name to the status; the allocator's message must not repeat it.
    assert "nvidia.com/mlnx_sriov_netdevice" not in e.value.message
    # nothing half written for a refused request
    assert not (tmp_path / "devinfo").exists() or not list((tmp_path / "devinfo").iterdir())


def test_id_of_another_pool_is_refused(tmp_path: Path, dev_root: Path) -> None:
    net = PoolAllocator(pool_of(NET, [dev("0000:3b:00.2")]), settings(tmp_path, dev_root), lambda _id: True)
    PoolAllocator(pool_of(RDMA, [dev("0000:3b:00.3")]), settings(tmp_path, dev_root), lambda _id: True)
    with pytest.raises(RequestError) as e:
        net.allocate(["0000:3b:00.3"])
    assert e.value.kind == RequestError.INVALID and "0000:3b:00.3" in e.value.message


# -- options and PreStartContainer -----------------------------------------------------------------


def test_options_follow_the_pool_config(tmp_path: Path, dev_root: Path) -> None:
    s = settings(tmp_path, dev_root)
    assert PoolAllocator(pool_of(NET, []), s, lambda _id: True).options() == (False, True)
    cfg = PoolConfig("a", "example.com", preferred="none", prestart=True)
    assert PoolAllocator(pool_of(cfg, []), s, lambda _id: True).options() == (True, False)


def test_unknown_policy_is_refused_with_the_pool_named(tmp_path: Path, dev_root: Path) -> None:
    cfg = PoolConfig("a", "example.com", preferred="densest")
    with pytest.raises(ValueError, match=r"example.com/a.*'densest'"):
        PoolAllocator(pool_of(cfg, []), settings(tmp_path, dev_root), lambda _id: True)


def test_prestart_verifies_presence_health_and_nodes(tmp_path: Path, dev_root: Path) -> None:
    touch(dev_root, "/dev/vfio/vfio", "/dev/vfio/83")
    healthy = {"0000:18:02.0": True}
    cfg = PoolConfig("dpdk", "intel.com", prestart=True)
    vf = dev("0000:18:02.0", driver="vfio-pci", iommu_group=83)
    alloc = PoolAllocator(pool_of(cfg, [vf]), settings(tmp_path, dev_root), lambda i: healthy[i])
    alloc.prestart(["0000:18:02.0"])  # fine

    healthy["0000:18:02.0"] = False
    with pytest.raises(RequestError, match=r"unhealthy: 0000:18:02\.0") as e:
        alloc.prestart(["0000:18:02.0"])
    assert e.value.kind == RequestError.PRECONDITION

    healthy["0000:18:02.0"] = True
    (dev_root / "vfio" / "83").unlink()  # the group node went away (device unbound, VF destroyed)
    with pytest.raises(RequestError, match="/dev/vfio/83") as e:
        alloc.prestart(["0000:18:02.0"])
    assert e.value.kind == RequestError.PRECONDITION

    alloc.update(pool_of(cfg, []))  # the VF left the pool: a vanished device is a precondition failure
    with pytest.raises(RequestError, match=r"0000:18:02\.0") as e:
        alloc.prestart(["0000:18:02.0"])
    assert e.value.kind == RequestError.PRECONDITION


def test_response_is_the_protocol_message(tmp_path: Path, dev_root: Path) -> None:
    resp = PoolAllocator(
        pool_of(NET, [dev("0000:3b:00.2")]), settings(tmp_path, dev_root), lambda _id: True
    ).allocate(["0000:3b:00.2"])
    assert isinstance(resp, api_pb2.ContainerAllocateResponse)
    again = api_pb2.ContainerAllocateResponse.FromString(resp.SerializeToString())
    assert again == resp


def test_service_protocol_is_satisfied(tmp_path: Path, dev_root: Path) -> None:
    svc: PoolService = PoolAllocator(
        pool_of(NET, [dev("0000:3b:00.2")]), settings(tmp_path, dev_root), lambda _id: True
    )
    assert svc.preferred(["0000:3b:00.2"], [], 1) == ["0000:3b:00.2"]


# -- through the kubelet emulator: the gRPC server, registration and the wire in between -----------


@pytest.mark.parametrize("kubelet_options", [{"checkpoint": False}])
async def test_through_the_kubelet_emulator(tmp_path: Path, sock_dir: Path, kubelet: KubeletEmulator) -> None:
    import grpc

    from densedev.kubelet.feed import PoolFeed
    from densedev.kubelet.registration import PluginRunner
    from densedev.kubelet.wire import ListEncoder

    dev_root = tmp_path / "dev"
    touch(dev_root, "/dev/vfio/vfio", "/dev/vfio/83", "/dev/vfio/noiommu-84", "/dev/infiniband/uverbs3")
    vfs = [
        dev("0000:18:02.0", driver="vfio-pci", iommu_group=83, pf="0000:18:00.0", numa_node=1),
        dev("0000:18:02.1", driver="vfio-pci", iommu_group=84, noiommu=True, pf="0000:18:00.0", numa_node=1),
        dev("0000:18:0a.0", driver="vfio-pci", iommu_group=85, pf="0000:18:00.1", numa_node=1),
    ]
    config = PoolConfig("dpdk", "intel.com", prestart=True, preferred="spread")
    healthy = {d.id: True for d in vfs}
    healthy["0000:18:0a.0"] = False
    s = AllocationSettings(cdi_dir=tmp_path / "cdi", devinfo_dir=tmp_path / "devinfo", dev_root=dev_root)
    alloc = PoolAllocator(pool_of(config, vfs), s, lambda i: healthy[i])
    encoder = ListEncoder([d.id for d in vfs], [d.numa_node for d in vfs])
    feed = PoolFeed(encoder.encode([healthy[d.id] for d in vfs]))
    resource = config.full_name

    runner = PluginRunner(resource, sock_dir, "densedev-intel.com_dpdk.sock", feed, alloc)
    await runner.start()
    try:
        await kubelet.wait_for(lambda: kubelet.allocatable(resource) == 2, 10.0)
        options = kubelet.options(resource)
        assert (
            options is not None and options.pre_start_required and options.get_preferred_allocation_available
        )
        ids = [d.id for d in vfs]
        assert await kubelet.preferred(resource, ids[:2], [], 2) == ids[:2]
        resp = await kubelet.allocate(resource, ["0000:18:02.1"])
        assert [c.name for c in resp.cdi_devices] == ["intel.com/dpdk=0000:18:02.1"]
        assert resp.envs["PCIDEVICE_INTEL_COM_DPDK"] == "0000:18:02.1"
        info = json.loads(resp.envs["PCIDEVICE_INTEL_COM_DPDK_INFO"])
        assert info["0000:18:02.1"]["vfio"] == {"mount": "/dev/vfio/vfio", "dev-mount": "/dev/vfio/84"}
        await kubelet.prestart(resource, ["0000:18:02.1"])
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await kubelet.allocate(resource, ["0000:18:0a.0"], check=False)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "0000:18:0a.0" in (e.value.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await kubelet.allocate(resource, ["0000:99:00.0"], check=False)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        await runner.stop()
        alloc.close()
    assert (tmp_path / "cdi" / "densedev-intel.com-dpdk.json").exists()
    assert not list((tmp_path / "devinfo").iterdir())


# -- properties over mixed allocations --------------------------------------------------------------

_KINDS = st.sampled_from(["netdev", "vfio", "noiommu", "uio", "rdma", "vdpa"])


def _mixed(kind: str, n: int) -> Device:
    address = f"0000:3b:{2 + n // 8:02x}.{n % 8}"
    if kind == "vfio":
        return dev(address, driver="vfio-pci", iommu_group=n)
    if kind == "noiommu":
        return dev(address, driver="vfio-pci", iommu_group=n, noiommu=True)
    if kind == "uio":
        return dev(address, driver="igb_uio", uio=f"uio{n}")
    if kind == "rdma":
        return dev(address, rdma_device=f"mlx5_{n}", rdma_nodes=(f"uverbs{n}", f"umad{n}", f"issm{n}"))
    if kind == "vdpa":
        return dev(address, vdpa=f"vdpa{n}", vdpa_driver="vhost_vdpa")
    return dev(address)


@hypothesis_settings(max_examples=60, deadline=None)
@given(kinds=st.lists(_KINDS, min_size=1, max_size=12), vhost=st.booleans(), data=st.data())
def test_any_mix_of_devices_gives_one_consistent_response(
    kinds: list[str], vhost: bool, data: st.DataObject
) -> None:
    devices = [_mixed(k, n) for n, k in enumerate(kinds)]
    config = PoolConfig("mix", "example.com", selectors=(Selector(is_rdma=True, need_vhost_net=vhost),))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        paths = ["/dev/vfio/vfio", "/dev/infiniband/rdma_cm", "/dev/vhost-net", "/dev/net/tun"]
        for n in range(len(devices)):
            paths += [f"/dev/vfio/{n}", f"/dev/vfio/noiommu-{n}", f"/dev/uio{n}", f"/dev/vhost-vdpa-{n}"]
            # RDMA nodes are optional: some exist, some do not
            paths += [
                f"/dev/infiniband/{x}{n}" for x in ("uverbs", "umad", "issm") if data.draw(st.booleans())
            ]
        touch(root, *paths)
        chosen = data.draw(st.permutations(devices)).copy()
        parts, per_device = build_response(config, chosen, root)
    hosts = [n.host_path for n in parts.devices]
    assert len(hosts) == len(set(hosts)), "a node twice"
    assert set(hosts) == {n.host_path for p in per_device for n in p.nodes}
    assert parts.envs[env_var_name(config.full_name)] == ",".join(d.id for d in chosen)
    info = json.loads(parts.envs[env_var_name(config.full_name) + "_INFO"])
    assert list(info) == sorted(d.id for d in chosen)
    for d in chosen:
        assert info[d.id]["generic"] == {"deviceID": d.id}
        for section in info[d.id].values():
            for value in section.values():
                if value.startswith("/dev/") and value not in hosts:
                    # every node the env names is handed over (container path may differ: no-IOMMU)
                    assert (
                        value.startswith("/dev/vfio/")
                        and value.replace("/dev/vfio/", "/dev/vfio/noiommu-") in hosts
                    )
    assert all(n.permissions == "rw" for n in parts.devices)


def test_subfunctions_that_ask_for_vhost_net_get_it(tmp_path: Path, dev_root: Path) -> None:
    # The SR-IOV plugin's v3.11 takes needVhostNet in an auxNetDevice selector (its PR #682); a file
    # written for it must load here and give the SF's containers /dev/vhost-net and /dev/net/tun.
    from densedev.pools.config import parse

    text = json.dumps(
        {
            "resourceList": [
                {
                    "resourceName": "sf_vhost",
                    "resourcePrefix": "nvidia.com",
                    "deviceType": "auxNetDevice",
                    "selectors": {"auxTypes": ["sf"], "needVhostNet": True},
                }
            ]
        }
    )
    (config,) = parse(text).pools
    touch(dev_root, "/dev/vhost-net", "/dev/net/tun")
    sf = dev("mlx5_core.sf.4", role=Role.SF, aux_type="sf", vf_index=4, netdevs=("enp59s0f0s4",))
    alloc = PoolAllocator(pool_of(config, [sf]), settings(tmp_path, dev_root), lambda _id: True)
    resp = alloc.allocate(["mlx5_core.sf.4"])
    assert nodes(resp) == [("/dev/vhost-net", "/dev/vhost-net", "rw"), ("/dev/net/tun", "/dev/net/tun", "rw")]
    info = json.loads(resp.envs["PCIDEVICE_NVIDIA_COM_SF_VHOST_INFO"])["mlx5_core.sf.4"]
    assert info["vhost"] == {"net-mount": "/dev/vhost-net", "tun-mount": "/dev/net/tun"}
    # Required, as for VFs: a node that is missing fails the request naming it.
    (dev_root / "net" / "tun").unlink()
    with pytest.raises(RequestError) as err:
        alloc.allocate(["mlx5_core.sf.4"])
    assert err.value.kind == RequestError.PRECONDITION and "/dev/net/tun" in err.value.message


# -- RDMA char devices read at Allocate, against a simulated node's tree ---------------------------


@pytest.fixture
def roce(tmp_path: Path, dev_root: Path) -> tuple[Path, list[Device]]:
    """A simulated node's sysfs with 2 PFs x 2 RoCE VFs, scanned; /dev stand-ins for every char device."""
    from densedev.node import scanner
    from densedev.testing import simnode

    sysfs = tmp_path / "sys"
    simnode.build_node(sysfs, pfs=2, vfs_per_pf=2, rdma=True)
    vfs = [d for d in scanner.scan(sysfs).devices if d.rdma_device and d.pf]
    touch(dev_root, "/dev/infiniband/rdma_cm", *(n for d in vfs for n in d.rdma_nodes))
    return sysfs, vfs


def rdma_allocator(tmp_path: Path, dev_root: Path, sysfs: Path, vfs: list[Device]) -> PoolAllocator:
    s = AllocationSettings(
        cdi_dir=None, devinfo_dir=tmp_path / "devinfo", dev_root=dev_root, sysfs_root=sysfs
    )
    return PoolAllocator(pool_of(RDMA, vfs), s, lambda _id: True)


def test_a_symlink_planted_for_a_class_dir_is_refused_not_followed(
    tmp_path: Path, dev_root: Path, roce: tuple[Path, list[Device]]
) -> None:
    # sysfs never has a symlink there; one pointing at another VF's char devices must not hand those
    # out: the VF is refused (fail closed), the other VF still allocates with its own.
    sysfs, vfs = roce
    a, b = vfs[0], vfs[1]
    fn_a = Path(os.path.realpath(sysfs / "bus/pci/devices" / a.id))
    fn_b = Path(os.path.realpath(sysfs / "bus/pci/devices" / b.id))
    shutil.rmtree(fn_a / "infiniband_verbs")
    (fn_a / "infiniband_verbs").symlink_to(fn_b / "infiniband_verbs")
    alloc = rdma_allocator(tmp_path, dev_root, sysfs, vfs)
    with pytest.raises(RequestError) as err:
        alloc.allocate([a.id])
    assert err.value.kind == RequestError.PRECONDITION and a.id in err.value.message
    assert not (tmp_path / "devinfo").exists() or not any((tmp_path / "devinfo").iterdir())
    resp = alloc.allocate([b.id])
    assert {n[1] for n in nodes(resp)} == {*b.rdma_nodes, "/dev/infiniband/rdma_cm"}


def test_a_function_gone_from_sysfs_is_refused(
    tmp_path: Path, dev_root: Path, roce: tuple[Path, list[Device]]
) -> None:
    # The VF was destroyed after the last rescan (sriov_numvfs lowered): its record still names char
    # devices whose numbers the kernel may give to the next function that registers.
    sysfs, vfs = roce
    (sysfs / "bus/pci/devices" / vfs[0].id).unlink()
    alloc = rdma_allocator(tmp_path, dev_root, sysfs, vfs)
    with pytest.raises(RequestError) as err:
        alloc.prestart([vfs[0].id])
    assert err.value.kind == RequestError.PRECONDITION and vfs[0].id in err.value.message


def test_an_unchanged_function_keeps_its_record(
    tmp_path: Path, dev_root: Path, roce: tuple[Path, list[Device]]
) -> None:
    # The common case costs no new record: the same Device object goes on (no CDI entry rebuilt).
    from densedev.alloc.respond import rdma_now

    sysfs, vfs = roce
    assert all(rdma_now(sysfs, d) is d for d in vfs)
