"""Device-info files for Multus / SR-IOV CNI: exact contents, atomic writes, cleanup, nothing half written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.devices import NET, RDMA, dev, pool_of, touch

from densedev.alloc.respond import AllocationSettings, PoolAllocator
from densedev.model import PoolConfig, RequestError, Selector


def settings(tmp_path: Path, dev_root: Path) -> AllocationSettings:
    return AllocationSettings(cdi_dir=None, devinfo_dir=tmp_path / "devinfo", dev_root=dev_root)


@pytest.fixture
def dev_root(tmp_path: Path) -> Path:
    root = tmp_path / "dev"
    touch(root, "/dev/vhost-net", "/dev/net/tun", "/dev/vhost-vdpa-0", "/dev/infiniband/uverbs3")
    return root


def files(tmp_path: Path) -> dict[str, dict[str, object]]:
    """The device-info files (hidden names are densedev's ownership record and temporary files)."""
    d = tmp_path / "devinfo"
    listed = sorted(p for p in d.iterdir() if not p.name.startswith(".")) if d.exists() else []
    return {p.name: json.loads(p.read_text()) for p in listed}


def test_vf_file(tmp_path: Path, dev_root: Path) -> None:
    alloc = PoolAllocator(pool_of(NET, [dev("0000:3b:00.2")]), settings(tmp_path, dev_root), lambda _id: True)
    assert files(tmp_path) == {}  # written at Allocate, not before
    alloc.allocate(["0000:3b:00.2"])
    assert files(tmp_path) == {
        "nvidia.com-mlnx_sriov_netdevice-0000:3b:00.2-device.json": {
            "type": "pci",
            "version": "1.1.0",
            "pci": {"pci-address": "0000:3b:00.2", "pf-pci-address": "0000:3b:00.0"},
        }
    }


def test_rdma_vf_file_names_its_rdma_device(tmp_path: Path, dev_root: Path) -> None:
    vf = dev("0000:3b:00.3", rdma_device="mlx5_3", rdma_nodes=("uverbs3",))
    PoolAllocator(pool_of(RDMA, [vf]), settings(tmp_path, dev_root), lambda _id: True).allocate(
        ["0000:3b:00.3"]
    )
    (doc,) = files(tmp_path).values()
    assert doc["pci"] == {
        "pci-address": "0000:3b:00.3",
        "pf-pci-address": "0000:3b:00.0",
        "rdma-device": "mlx5_3",
    }


def test_vhost_net_and_plain_pci(tmp_path: Path, dev_root: Path) -> None:
    config = PoolConfig("sriov_vhost", "intel.com", selectors=(Selector(need_vhost_net=True),))
    nic = dev("0000:af:00.0", role="pci", pf="", vf_index=-1, driver="ice")
    PoolAllocator(pool_of(config, [nic]), settings(tmp_path, dev_root), lambda _id: True).allocate(
        ["0000:af:00.0"]
    )
    assert files(tmp_path) == {
        "intel.com-sriov_vhost-0000:af:00.0-device.json": {
            "type": "pci",
            "version": "1.1.0",
            "pci": {"pci-address": "0000:af:00.0", "vhost-net": "/dev/vhost-net"},
        }
    }


def test_vdpa_file(tmp_path: Path, dev_root: Path) -> None:
    vhost = dev("0000:65:00.2", vdpa="vdpa0", vdpa_driver="vhost_vdpa", pf="0000:65:00.0")
    virtio = dev("0000:65:00.3", vdpa="vdpa1", vdpa_driver="virtio_vdpa", pf="0000:65:00.0")
    alloc = PoolAllocator(pool_of(NET, [vhost, virtio]), settings(tmp_path, dev_root), lambda _id: True)
    alloc.allocate(["0000:65:00.2", "0000:65:00.3"])
    got = files(tmp_path)
    assert got["nvidia.com-mlnx_sriov_netdevice-0000:65:00.2-device.json"] == {
        "type": "vdpa",
        "version": "1.1.0",
        "vdpa": {
            "parent-device": "vdpa0",
            "driver": "vhost",
            "path": "/dev/vhost-vdpa-0",
            "pci-address": "0000:65:00.2",
            "pf-pci-address": "0000:65:00.0",
        },
    }
    assert got["nvidia.com-mlnx_sriov_netdevice-0000:65:00.3-device.json"]["vdpa"] == {
        "parent-device": "vdpa1",
        "driver": "virtio",
        "pci-address": "0000:65:00.3",
        "pf-pci-address": "0000:65:00.0",
    }


def test_cleanup_on_leave_and_shutdown(tmp_path: Path, dev_root: Path) -> None:
    vfs = [dev(f"0000:3b:00.{i}") for i in (2, 3, 4)]
    alloc = PoolAllocator(pool_of(NET, vfs), settings(tmp_path, dev_root), lambda _id: True)
    alloc.allocate(["0000:3b:00.2", "0000:3b:00.3"])
    alloc.allocate(["0000:3b:00.4"])
    assert len(files(tmp_path)) == 3
    alloc.update(pool_of(NET, vfs[1:]))  # 3b:00.2 left the pool (VF destroyed, or no longer selected)
    assert sorted(files(tmp_path)) == [
        "nvidia.com-mlnx_sriov_netdevice-0000:3b:00.3-device.json",
        "nvidia.com-mlnx_sriov_netdevice-0000:3b:00.4-device.json",
    ]
    foreign = tmp_path / "devinfo" / "intel.com-other-0000:18:02.0-device.json"  # another plugin's file
    foreign.write_text("{}")
    alloc.close()
    assert [p.name for p in (tmp_path / "devinfo").iterdir()] == [foreign.name]


def test_failed_request_leaves_nothing_behind(tmp_path: Path, dev_root: Path) -> None:
    vfs = [dev(f"0000:3b:00.{i}") for i in (2, 3)]
    bad = {"0000:3b:00.3"}
    alloc = PoolAllocator(pool_of(NET, vfs), settings(tmp_path, dev_root), lambda i: i not in bad)
    with pytest.raises(RequestError):
        alloc.allocate(["0000:3b:00.2", "0000:3b:00.3"])
    assert files(tmp_path) == {}
    # the second file cannot be written (a directory sits at its path): the first is taken back
    bad.clear()
    blocker = tmp_path / "devinfo" / "nvidia.com-mlnx_sriov_netdevice-0000:3b:00.3-device.json"
    blocker.mkdir(parents=True)
    with pytest.raises(RequestError, match="cannot write device-info") as e:
        alloc.allocate(["0000:3b:00.2", "0000:3b:00.3"])
    assert e.value.kind == RequestError.PRECONDITION
    assert [p.name for p in (tmp_path / "devinfo").iterdir()] == [blocker.name]
    assert not [p for p in (tmp_path / "devinfo").iterdir() if p.name.startswith(".")]


def test_devinfo_off(tmp_path: Path, dev_root: Path) -> None:
    s = AllocationSettings(cdi_dir=None, devinfo_dir=None, dev_root=dev_root)
    PoolAllocator(pool_of(NET, [dev("0000:3b:00.2")]), s, lambda _id: True).allocate(["0000:3b:00.2"])
    assert not (tmp_path / "devinfo").exists()


def test_reload_with_a_new_name_drops_the_old_files(tmp_path: Path, dev_root: Path) -> None:
    vf = dev("0000:3b:00.2")
    alloc = PoolAllocator(pool_of(NET, [vf]), settings(tmp_path, dev_root), lambda _id: True)
    alloc.allocate(["0000:3b:00.2"])
    alloc.update(pool_of(PoolConfig("renamed", "nvidia.com"), [vf]))
    assert files(tmp_path) == {}
    alloc.allocate(["0000:3b:00.2"])
    assert list(files(tmp_path)) == ["nvidia.com-renamed-0000:3b:00.2-device.json"]
