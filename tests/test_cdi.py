"""CDI: one spec per pool, valid against the spec's required fields, written atomically, only on change."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
from helpers.cdi import QUALIFIED_RE, validate_spec
from helpers.devices import DPDK, RDMA, dev, pool_of, touch

from densedev.alloc import cdi
from densedev.alloc.respond import AllocationSettings, PoolAllocator
from densedev.model import PoolConfig, RequestError


def settings(tmp_path: Path, dev_root: Path, annotations: bool = False) -> AllocationSettings:
    return AllocationSettings(
        cdi_dir=tmp_path / "cdi",
        devinfo_dir=tmp_path / "devinfo",
        dev_root=dev_root,
        cdi_annotations=annotations,
    )


@pytest.fixture
def dev_root(tmp_path: Path) -> Path:
    root = tmp_path / "dev"
    touch(root, "/dev/vfio/vfio", "/dev/vfio/83", "/dev/vfio/noiommu-84")
    touch(root, "/dev/infiniband/uverbs3", "/dev/infiniband/umad3", "/dev/infiniband/rdma_cm")
    return root


def spec_path(tmp_path: Path, name: str) -> Path:
    return tmp_path / "cdi" / name


def test_rdma_pool_spec_and_allocate(tmp_path: Path, dev_root: Path) -> None:
    vf = dev("0000:3b:00.3", rdma_device="mlx5_3", rdma_nodes=("uverbs3", "umad3", "issm3"))
    alloc = PoolAllocator(pool_of(RDMA, [vf]), settings(tmp_path, dev_root), lambda _id: True)
    path = spec_path(tmp_path, "densedev-nvidia.com-mlnx_sriov_rdma.json")
    doc = json.loads(path.read_text())
    validate_spec(doc)
    info = (
        '{"0000:3b:00.3":{"generic":{"deviceID":"0000:3b:00.3"},"rdma":{"rdma_cm":"/dev/infiniband/rdma_cm",'
    )
    info += '"rdma_dev":"mlx5_3","umad":"/dev/infiniband/umad3","uverbs":"/dev/infiniband/uverbs3"}}}'
    assert doc == {
        "cdiVersion": "0.5.0",
        "kind": "nvidia.com/mlnx_sriov_rdma",
        "devices": [
            {
                "name": "0000:3b:00.3",
                "containerEdits": {
                    "deviceNodes": [
                        {"path": p, "hostPath": p, "permissions": "rw"}
                        for p in (
                            "/dev/infiniband/uverbs3",
                            "/dev/infiniband/umad3",
                            "/dev/infiniband/rdma_cm",
                        )
                    ],
                    "env": [f"PCIDEVICE_NVIDIA_COM_MLNX_SRIOV_RDMA_0000_3B_00_3_INFO={info}"],
                },
            }
        ],
    }
    resp = alloc.allocate(["0000:3b:00.3"])
    assert [c.name for c in resp.cdi_devices] == ["nvidia.com/mlnx_sriov_rdma=0000:3b:00.3"]
    assert list(resp.devices) == []  # the runtime injects the nodes from the spec; not twice
    assert resp.envs["PCIDEVICE_NVIDIA_COM_MLNX_SRIOV_RDMA"] == "0000:3b:00.3"
    assert dict(resp.annotations) == {}
    for c in resp.cdi_devices:  # every returned name resolves to an entry of the spec on disk
        m = QUALIFIED_RE.match(c.name)
        assert m and m["kind"] == doc["kind"] and m["name"] in {d["name"] for d in doc["devices"]}


def test_vfio_spec_with_and_without_iommu(tmp_path: Path, dev_root: Path) -> None:
    a = dev("0000:18:02.0", driver="vfio-pci", iommu_group=83)
    b = dev("0000:18:02.1", driver="vfio-pci", iommu_group=84, noiommu=True)
    PoolAllocator(pool_of(DPDK, [b, a]), settings(tmp_path, dev_root), lambda _id: True)
    doc = json.loads(spec_path(tmp_path, "densedev-intel.com-intel_sriov_dpdk.json").read_text())
    validate_spec(doc)
    assert [d["name"] for d in doc["devices"]] == ["0000:18:02.0", "0000:18:02.1"]  # sorted: stable bytes
    assert doc["devices"][1]["containerEdits"]["deviceNodes"] == [
        {"path": "/dev/vfio/vfio", "hostPath": "/dev/vfio/vfio", "permissions": "rw"},
        {"path": "/dev/vfio/84", "hostPath": "/dev/vfio/noiommu-84", "permissions": "rw"},
    ]


def test_annotation_for_older_runtimes(tmp_path: Path, dev_root: Path) -> None:
    vfs = [
        dev("0000:18:02.0", driver="vfio-pci", iommu_group=83),
        dev("0000:18:02.1", driver="vfio-pci", iommu_group=84),
    ]
    touch(dev_root, "/dev/vfio/84")
    alloc = PoolAllocator(
        pool_of(DPDK, vfs), settings(tmp_path, dev_root, annotations=True), lambda _id: True
    )
    resp = alloc.allocate(["0000:18:02.1", "0000:18:02.0"])
    assert dict(resp.annotations) == {
        "cdi.k8s.io/densedev_intel_sriov_dpdk_intel_sriov_dpdk": (
            "intel.com/intel_sriov_dpdk=0000:18:02.1,intel.com/intel_sriov_dpdk=0000:18:02.0"
        )
    }
    key = next(iter(resp.annotations)).split("/", 1)[1]
    assert len(key) <= 63 and re.match(r"^[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?$", key)


def test_spec_is_rewritten_only_when_devices_change(tmp_path: Path, dev_root: Path) -> None:
    a = dev("0000:18:02.0", driver="vfio-pci", iommu_group=83)
    alloc = PoolAllocator(pool_of(DPDK, [a]), settings(tmp_path, dev_root), lambda _id: True)
    path = spec_path(tmp_path, "densedev-intel.com-intel_sriov_dpdk.json")
    inode = path.stat().st_ino
    alloc.update(pool_of(DPDK, [a]))
    alloc.allocate(["0000:18:02.0"])
    assert path.stat().st_ino == inode  # atomic rename gives a new inode: none happened
    # a new device joins: a new file replaces the old one whole
    b = dev("0000:18:02.1", driver="vfio-pci", iommu_group=84, noiommu=True)
    alloc.update(pool_of(DPDK, [a, b]))
    assert path.stat().st_ino != inode
    assert [d["name"] for d in json.loads(path.read_text())["devices"]] == ["0000:18:02.0", "0000:18:02.1"]
    # one leaves
    alloc.update(pool_of(DPDK, [b]))
    assert [d["name"] for d in json.loads(path.read_text())["devices"]] == ["0000:18:02.1"]
    assert sorted(p.name for p in (tmp_path / "cdi").iterdir()) == [path.name]  # no temp file left behind
    # none left: the spec needs at least one device, so the file goes
    alloc.update(pool_of(DPDK, []))
    assert not path.exists()


def test_half_gone_device_has_no_entry_until_whole(
    tmp_path: Path, dev_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    a = dev("0000:18:02.0", driver="vfio-pci", iommu_group=83)
    b = dev("0000:18:02.5", driver="vfio-pci", iommu_group=90)  # /dev/vfio/90 not there (yet)
    with caplog.at_level(logging.WARNING):
        alloc = PoolAllocator(pool_of(DPDK, [a, b]), settings(tmp_path, dev_root), lambda _id: True)
    assert "0000:18:02.5" in caplog.text and "/dev/vfio/90" in caplog.text
    path = spec_path(tmp_path, "densedev-intel.com-intel_sriov_dpdk.json")
    assert [d["name"] for d in json.loads(path.read_text())["devices"]] == ["0000:18:02.0"]
    with pytest.raises(RequestError, match="/dev/vfio/90"):
        alloc.allocate(["0000:18:02.5"])
    touch(dev_root, "/dev/vfio/90")
    resp = alloc.allocate(["0000:18:02.5"])
    assert [c.name for c in resp.cdi_devices] == ["intel.com/intel_sriov_dpdk=0000:18:02.5"]
    doc = json.loads(path.read_text())
    validate_spec(doc)
    assert [d["name"] for d in doc["devices"]] == ["0000:18:02.0", "0000:18:02.5"]


def test_unwritable_cdi_dir_fails_allocate_clearly(tmp_path: Path, dev_root: Path) -> None:
    (tmp_path / "cdi").write_text("not a directory")
    a = dev("0000:18:02.0", driver="vfio-pci", iommu_group=83)
    alloc = PoolAllocator(pool_of(DPDK, [a]), settings(tmp_path, dev_root), lambda _id: True)
    with pytest.raises(RequestError, match="cannot write CDI spec") as e:
        alloc.allocate(["0000:18:02.0"])
    assert e.value.kind == RequestError.PRECONDITION


def test_close_keeps_the_spec_unless_the_pool_is_removed(tmp_path: Path, dev_root: Path) -> None:
    a = dev("0000:18:02.0", driver="vfio-pci", iommu_group=83)
    alloc = PoolAllocator(pool_of(DPDK, [a]), settings(tmp_path, dev_root), lambda _id: True)
    path = spec_path(tmp_path, "densedev-intel.com-intel_sriov_dpdk.json")
    alloc.close()
    assert path.exists()  # restarted containers still resolve their CDI names while we restart
    alloc.close(remove_cdi=True)
    assert not path.exists()


def test_names_the_spec_rejects_are_refused() -> None:
    assert cdi.make_kind("intel.com", "sriov_net.a") == "intel.com/sriov_net.a"
    with pytest.raises(cdi.CdiError, match="vendor"):
        cdi.make_kind("Intel.com", "x")
    with pytest.raises(cdi.CdiError, match="class"):
        cdi.make_kind("intel.com", "-x")
    with pytest.raises(cdi.CdiError, match="device name"):
        cdi.qualified_name("intel.com/x", "0000:18:02.0/")
    assert cdi.qualified_name("intel.com/x", "mlx5_core.sf.4") == "intel.com/x=mlx5_core.sf.4"


def test_reload_with_new_settings_replaces_the_old_files(tmp_path: Path, dev_root: Path) -> None:
    a = dev("0000:18:02.0", driver="vfio-pci", iommu_group=83)
    alloc = PoolAllocator(pool_of(DPDK, [a]), settings(tmp_path, dev_root), lambda _id: True)
    old = spec_path(tmp_path, "densedev-intel.com-intel_sriov_dpdk.json")
    assert old.exists()
    renamed = PoolConfig("dpdk_renamed", "intel.com", preferred="spread")
    alloc.update(pool_of(renamed, [a]))
    assert not old.exists()
    doc = json.loads(spec_path(tmp_path, "densedev-intel.com-dpdk_renamed.json").read_text())
    validate_spec(doc)
    assert doc["kind"] == "intel.com/dpdk_renamed"
    resp = alloc.allocate(["0000:18:02.0"])
    assert [c.name for c in resp.cdi_devices] == ["intel.com/dpdk_renamed=0000:18:02.0"]
    assert "PCIDEVICE_INTEL_COM_DPDK_RENAMED" in resp.envs
    assert alloc.options() == (False, True)


def test_name_cdi_refuses_serves_device_specs(
    tmp_path: Path, dev_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    a = dev("0000:18:02.0", driver="vfio-pci", iommu_group=83)
    odd = PoolConfig("dpdk", "Intel.Com")  # upper case: not a CDI vendor
    with caplog.at_level(logging.ERROR):
        alloc = PoolAllocator(pool_of(odd, [a]), settings(tmp_path, dev_root), lambda _id: True)
    assert "CDI off" in caplog.text
    resp = alloc.allocate(["0000:18:02.0"])
    assert list(resp.cdi_devices) == []
    assert [d.container_path for d in resp.devices] == ["/dev/vfio/vfio", "/dev/vfio/83"]


def test_a_rebound_device_gets_its_new_nodes(tmp_path: Path, dev_root: Path) -> None:
    kernel = dev("0000:18:02.0", driver="iavf", iommu_group=83)
    alloc = PoolAllocator(pool_of(DPDK, [kernel]), settings(tmp_path, dev_root), lambda _id: True)
    path = spec_path(tmp_path, "densedev-intel.com-intel_sriov_dpdk.json")
    (entry,) = json.loads(path.read_text())["devices"]
    assert "deviceNodes" not in entry["containerEdits"]  # a kernel netdev: env only
    alloc.update(pool_of(DPDK, [kernel._replace(driver="vfio-pci")]))  # rebound for DPDK
    doc = json.loads(path.read_text())
    validate_spec(doc)
    assert [n["path"] for n in doc["devices"][0]["containerEdits"]["deviceNodes"]] == [
        "/dev/vfio/vfio",
        "/dev/vfio/83",
    ]
