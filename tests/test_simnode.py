"""The simulated node writes sysfs shapes exactly like Linux, and its mutators act as the kernel would."""

from __future__ import annotations

import errno
import io
import json
import os
from pathlib import Path

import pytest

from densedev.testing import simnode
from densedev.testing.simnode import (
    bind_driver,
    build_node,
    move_netdev_to_pod,
    set_link,
    set_num_vfs,
    set_rdma_port,
    simulate,
    write_config,
)


def _read(path: Path) -> str:
    return path.read_text()


def _links(root: Path) -> list[Path]:
    out = []
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            p = Path(d) / n
            if p.is_symlink():
                out.append(p)
    return out


def test_every_link_is_relative_and_resolves_inside_the_tree(tmp_path: Path) -> None:
    build_node(tmp_path, pfs=2, vfs_per_pf=3, rdma=True, extras=True)
    links = _links(tmp_path)
    assert len(links) > 50
    root = tmp_path.resolve()
    for link in links:
        target = os.readlink(link)
        assert not target.startswith("/"), f"{link} -> {target} is absolute"
        resolved = link.resolve(strict=True)
        assert resolved.is_relative_to(root), f"{link} escapes the tree"


def test_pci_device_shape(tmp_path: Path) -> None:
    layout = build_node(tmp_path, pfs=2, vfs_per_pf=4)
    pf = layout.pfs[0]
    link = tmp_path / "bus/pci/devices" / pf.address
    # bus/pci/devices/<bdf> -> ../../../devices/pci0000:<bus>/<root port>/<bdf>
    target = os.readlink(link)
    parts = target.split("/")
    assert parts[:4] == ["..", "..", "..", "devices"]
    assert parts[4].startswith("pci0000:") and parts[-1] == pf.address and len(parts) == 7
    dev = link.resolve()
    assert _read(dev / "vendor") == "0x15b3\n"
    assert _read(dev / "device") == "0x101d\n"
    assert _read(dev / "class") == "0x020000\n"
    assert _read(dev / "sriov_totalvfs") == "4\n"
    assert _read(dev / "sriov_numvfs") == "4\n"
    assert _read(dev / "modalias").startswith("pci:v000015B3d0000101Dsv")
    assert os.readlink(dev / "driver") == "../../../../bus/pci/drivers/mlx5_core"
    assert (dev / "driver").resolve() == (tmp_path / "bus/pci/drivers/mlx5_core").resolve()
    group = os.readlink(dev / "iommu_group")
    assert group.startswith("../../../../kernel/iommu_groups/")
    assert (dev / "iommu_group/type").is_file()
    for k, vf in enumerate(pf.vf_addresses):
        assert os.readlink(dev / f"virtfn{k}") == f"../{vf}"
        vdev = (tmp_path / "bus/pci/devices" / vf).resolve()
        assert os.readlink(vdev / "physfn") == f"../{pf.address}"
        assert vdev.parent == dev.parent  # VFs sit beside their PF
        assert _read(vdev / "device") == "0x101e\n"
    ndir = dev / "net" / pf.netdev
    for name in ("operstate", "carrier", "type", "address", "ifindex", "phys_port_name"):
        assert (ndir / name).is_file()
    assert (tmp_path / "class/net" / pf.netdev).resolve() == ndir.resolve()


def test_vf_addresses_follow_offset_and_stride_onto_next_buses(tmp_path: Path) -> None:
    layout = build_node(tmp_path, pfs=2, vfs_per_pf=300)
    pf0, pf1 = layout.pfs
    dev = (tmp_path / "bus/pci/devices" / pf0.address).resolve()
    offset, stride = int(_read(dev / "sriov_offset")), int(_read(dev / "sriov_stride"))

    def rid(bdf: str) -> int:
        bus, devfn = bdf[5:].split(":")
        d, f = devfn.split(".")
        return int(bus, 16) << 8 | int(d, 16) << 3 | int(f)

    for k, vf in enumerate(pf0.vf_addresses):
        assert rid(vf) == rid(pf0.address) + offset + k * stride
    buses = {a[5:7] for a in pf0.vf_addresses + pf1.vf_addresses}
    assert len(buses) == 3  # 600 VFs + 2 PFs need three buses
    assert len(set(pf0.vf_addresses) | set(pf1.vf_addresses)) == 600


def test_netdev_names_fit_ifnamsiz(tmp_path: Path) -> None:
    layout = build_node(tmp_path, pfs=4, vfs_per_pf=16, extras=True)
    names = os.listdir(tmp_path / "class/net")
    # extras: SF host PF + its 2 VFs + 2 SFs, the E810 PF (its VFs are on uio/vfio), IPoIB, eno1
    assert len(names) == 4 + 64 + 8
    assert all(len(n) <= 15 for n in names)
    assert layout.pfs[1].vf_netdevs[3] == f"{layout.pfs[1].netdev}v3"


def test_numa_spread(tmp_path: Path) -> None:
    layout = build_node(tmp_path, pfs=4, vfs_per_pf=1, numa_nodes=2)
    assert [pf.numa_node for pf in layout.pfs] == [0, 0, 1, 1]


def test_rdma_roce_shape(tmp_path: Path) -> None:
    layout = build_node(tmp_path, pfs=2, vfs_per_pf=2, rdma=True)
    pf = layout.pfs[0]
    ib = tmp_path / "class/infiniband" / pf.ibdev
    assert _read(ib / "ports/1/state") == "4: ACTIVE\n"
    assert _read(ib / "ports/1/phys_state") == "5: LinkUp\n"
    assert _read(ib / "ports/1/link_layer") == "Ethernet\n"
    assert _read(ib / "ports/1/pkeys/0") == "0xffff\n"
    verbs = {_read(p / "ibdev").strip() for p in (tmp_path / "class/infiniband_verbs").iterdir()}
    assert verbs == {pf.ibdev for pf in layout.pfs} | {i for pf in layout.pfs for i in pf.vf_ibdevs}
    mad = [p.name for p in (tmp_path / "class/infiniband_mad").iterdir()]
    assert mad and all(n.startswith("umad") for n in mad)  # RoCE: no issm


def test_intel_has_no_rdma_by_default(tmp_path: Path) -> None:
    layout = build_node(tmp_path, pfs=2, vfs_per_pf=2, vendor="intel")
    vf = (tmp_path / "bus/pci/devices" / layout.pfs[0].vf_addresses[0]).resolve()
    assert _read(vf / "vendor") == "0x8086\n" and _read(vf / "device") == "0x1889\n"
    assert os.readlink(vf / "driver").endswith("/iavf")
    assert not any((tmp_path / "class/infiniband").iterdir())


def test_extras_has_one_of_each_kind(tmp_path: Path) -> None:
    layout = build_node(tmp_path, pfs=2, vfs_per_pf=2, extras=True)
    ex = layout.extras
    assert ex is not None
    for sf in ex.sfs:
        target = os.readlink(tmp_path / "bus/auxiliary/devices" / sf)
        assert target.split("/")[-2] == ex.sf_pf
    vdpa = tmp_path / "bus/vdpa/devices" / ex.vdpa
    assert os.readlink(vdpa).split("/")[-2] == ex.vdpa_vf
    assert (vdpa / "driver").resolve().name == "vhost_vdpa"
    uio_vf = (tmp_path / "bus/pci/devices" / ex.uio_vf).resolve()
    assert (uio_vf / "uio" / ex.uio).is_dir() and not (uio_vf / "net").exists()
    vfio = (tmp_path / "bus/pci/devices" / ex.vfio_vf).resolve()
    assert (vfio / "driver").resolve().name == "vfio-pci" and not (vfio / "net").exists()
    noiommu = (tmp_path / "bus/pci/devices" / ex.noiommu_vf).resolve()
    assert _read(noiommu / "iommu_group/name") == "vfio-noiommu\n"
    qat = (tmp_path / "bus/pci/devices" / ex.accel_pf).resolve()
    assert _read(qat / "class") == "0x120000\n"
    for vf in ex.accel_vfs:
        assert ((tmp_path / "bus/pci/devices" / vf).resolve() / "driver").resolve().name == "vfio-pci"
    ib = (tmp_path / "bus/pci/devices" / ex.ib_pf).resolve()
    assert _read(ib / "net" / ex.ib_netdev / "type") == "32\n"
    mad = {p.name for p in (tmp_path / "class/infiniband_mad").iterdir()}
    assert any(n.startswith("issm") for n in mad)
    assert any((tmp_path / "class/infiniband_cm").iterdir())


def test_set_link(tmp_path: Path) -> None:
    layout = build_node(tmp_path, pfs=2, vfs_per_pf=1)
    name = layout.pfs[0].netdev
    set_link(tmp_path, name, False)
    assert _read(tmp_path / "class/net" / name / "operstate") == "down\n"
    assert _read(tmp_path / "class/net" / name / "carrier") == "0\n"
    set_link(tmp_path, name, True)
    assert _read(tmp_path / "class/net" / name / "operstate") == "up\n"
    with pytest.raises(FileNotFoundError, match="nosuch"):
        set_link(tmp_path, "nosuch", True)


def test_set_num_vfs_like_the_kernel(tmp_path: Path) -> None:
    layout = build_node(tmp_path, pfs=2, vfs_per_pf=4, rdma=True)
    pf = layout.pfs[0]
    with pytest.raises(OSError) as e:
        set_num_vfs(tmp_path, pf.address, 2)
    assert e.value.errno == errno.EBUSY
    assert set_num_vfs(tmp_path, pf.address, 0) == ()
    dev = (tmp_path / "bus/pci/devices" / pf.address).resolve()
    assert not [p for p in os.listdir(dev) if p.startswith("virtfn")]
    for vf, ifname in zip(pf.vf_addresses, pf.vf_netdevs, strict=True):
        assert not os.path.lexists(tmp_path / "bus/pci/devices" / vf)
        assert not os.path.lexists(tmp_path / "class/net" / ifname)
    vfs = set_num_vfs(tmp_path, pf.address, 3)
    assert vfs == pf.vf_addresses[:3]
    assert _read(dev / "sriov_numvfs") == "3\n"
    assert os.path.lexists(tmp_path / "class/net" / pf.vf_netdevs[2])
    with pytest.raises(OSError):
        set_num_vfs(tmp_path, layout.pfs[1].address, 5)  # more than sriov_totalvfs (after 0)
    assert not [p for p in _links(tmp_path) if not p.exists()]


def test_bind_driver_and_move_to_pod(tmp_path: Path) -> None:
    layout = build_node(tmp_path, pfs=2, vfs_per_pf=2, rdma=True)
    vf, ifname = layout.pfs[0].vf_addresses[0], layout.pfs[0].vf_netdevs[0]
    dev = (tmp_path / "bus/pci/devices" / vf).resolve()
    bind_driver(tmp_path, vf, "vfio-pci")
    assert (dev / "driver").resolve().name == "vfio-pci"
    assert not (dev / "net").exists() and not os.path.lexists(tmp_path / "class/net" / ifname)
    bind_driver(tmp_path, vf, None)
    assert not os.path.lexists(dev / "driver")
    bind_driver(tmp_path, vf, "mlx5_core")
    assert (dev / "net" / ifname).is_dir() and (dev / "infiniband").is_dir()
    move_netdev_to_pod(tmp_path, vf)
    assert not (dev / "net" / ifname).exists() and not os.path.lexists(tmp_path / "class/net" / ifname)
    assert os.readlink(dev / "physfn") == f"../{layout.pfs[0].address}"
    with pytest.raises(FileNotFoundError):
        move_netdev_to_pod(tmp_path, vf)
    assert not [p for p in _links(tmp_path) if not p.exists()]


def _uevent_drivers(dev: Path) -> list[str]:
    return [line[7:] for line in _read(dev / "uevent").splitlines() if line.startswith("DRIVER=")]


def test_uevent_driver_line_follows_every_bind(tmp_path: Path) -> None:
    # The kernel generates uevent on read, so its DRIVER= line (drivers/base/core.c dev_uevent) always
    # names the bound driver, first, and is absent while unbound; the simulated file must keep up.
    layout = build_node(tmp_path, pfs=1, vfs_per_pf=1, extras=True)
    assert layout.extras is not None
    pf, vf = layout.pfs[0].address, layout.pfs[0].vf_addresses[0]
    for address in (pf, vf, layout.extras.uio_vf, layout.extras.vfio_vf, layout.extras.plain):
        dev = (tmp_path / "bus/pci/devices" / address).resolve()
        assert _uevent_drivers(dev) == [(dev / "driver").resolve().name]
        assert _read(dev / "uevent").startswith("DRIVER=")
    port = (tmp_path / "bus/pci/devices" / pf).resolve().parent
    assert _uevent_drivers(port) == ["pcieport"]
    dev = (tmp_path / "bus/pci/devices" / vf).resolve()
    before = _read(dev / "uevent")
    bind_driver(tmp_path, vf, None)
    assert _uevent_drivers(dev) == [] and "PCI_ID=15B3:101E" in _read(dev / "uevent")
    bind_driver(tmp_path, vf, "vfio-pci")
    assert _uevent_drivers(dev) == ["vfio-pci"]
    bind_driver(tmp_path, vf, "mlx5_core")
    assert _read(dev / "uevent") == before


def test_set_rdma_port(tmp_path: Path) -> None:
    layout = build_node(tmp_path, pfs=2, vfs_per_pf=1, rdma=True)
    ibdev = layout.pfs[0].ibdev
    set_rdma_port(tmp_path, ibdev, 1, 1)
    assert _read(tmp_path / "class/infiniband" / ibdev / "ports/1/state") == "1: DOWN\n"
    assert _read(tmp_path / "class/infiniband" / ibdev / "ports/1/phys_state") == "3: Disabled\n"
    with pytest.raises(ValueError, match="state 9"):
        set_rdma_port(tmp_path, ibdev, 1, 9)


def test_write_config_in_the_sriov_plugin_format(tmp_path: Path) -> None:
    layout = build_node(tmp_path / "node", pfs=2, vfs_per_pf=2, rdma=True)
    write_config(tmp_path / "config.json", layout, prefix="example.com", top={"coalesceMs": 5})
    doc = json.loads((tmp_path / "config.json").read_text())
    pools = doc["resourceList"]
    assert doc["coalesceMs"] == 5
    assert pools[0] == {
        "resourceName": f"sriov_{layout.pfs[0].netdev}",
        "resourcePrefix": "example.com",
        "selectors": {"pfNames": [layout.pfs[0].netdev]},
    }
    assert pools[1]["selectors"] == {"vendors": ["15b3"], "devices": ["101e"], "drivers": ["mlx5_core"]}
    assert pools[2]["selectors"]["isRdma"] is True and pools[2]["rdmaShared"] == 16
    # Every pool selects something (first match wins, so later pools only take what is left).
    from densedev.node import scanner as discovery
    from densedev.pools import config as config_mod
    from densedev.pools import select as selectors

    built = selectors.build_pools(
        config_mod.load(tmp_path / "config.json"), discovery.scan(layout.root).devices
    )
    assert [len(p.members) for p in built] == [2, 2, 2 * 16]


def test_simulate_writes_tree_and_config(tmp_path: Path) -> None:
    layout = simulate(tmp_path / "out", pfs=2, vfs_per_pf=3, vendor="intel", rdma=False, numa_nodes=1)
    assert len(layout.vf_addresses) == 6
    assert (tmp_path / "out/config.json").is_file()
    assert len(os.listdir(tmp_path / "out/class/net")) == 8


def test_65536_devices_spill_into_a_second_pci_domain() -> None:
    # 64 PFs x 1,024 VFs: 32 dual-port NICs of 10 buses each (a root port's bus, then 2 PFs + 2,048 VFs
    # over 9 buses); domain 0 (buses 0x18-0xff) holds 23 of them, the rest go to domain 0001 from bus 0.
    plan = simnode.nic_buses(32, 1024)
    assert plan[:2] == [(0, 0x18), (0, 0x22)]
    assert [d for d, _ in plan].count(0) == 23 and plan[23] == (1, 0x00) and plan[-1] == (1, 0x50)
    assert all(bus + 9 <= 0xFF for _, bus in plan)  # every NIC's last VF bus has an 8-bit number
    # The spill is only where the bus numbers run out: 16 PFs x 1,024 stay in domain 0.
    assert {d for d, _ in simnode.nic_buses(8, 1024)} == {0}


def test_spilled_functions_live_in_their_own_domain_and_scan(tmp_path: Path) -> None:
    from densedev.node import scanner

    # 1 VF per PF: a NIC takes 2 buses, so domain 0 holds 116 NICs (232 PFs); 4 more PFs spill.
    layout = build_node(tmp_path, pfs=236, vfs_per_pf=1, extras=True)
    spilled = [pf for pf in layout.pfs if pf.address.startswith("0001:")]
    assert len(spilled) == 4 and layout.pfs[231].address.startswith("0000:")
    assert spilled[0].address == "0001:01:00.0" and spilled[0].vf_addresses == ("0001:01:00.2",)
    target = os.readlink(tmp_path / "bus/pci/devices" / spilled[0].vf_addresses[0])
    assert target.split("/")[4:6] == ["pci0001:00", "0001:00:00.0"]
    assert layout.extras is not None and layout.extras.sf_pf.startswith("0001:")
    table = scanner.scan(tmp_path)
    by_id = {d.id: d for d in table.devices}
    vf = by_id[spilled[-1].vf_addresses[0]]
    assert vf.pf == spilled[-1].address and vf.pcie_root.startswith("pci0001:")
    assert sum(1 for pf in layout.pfs for a in pf.vf_addresses if a in by_id) == 236


def test_bad_arguments_are_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vendor 'acme'"):
        build_node(tmp_path, vendor="acme")
    with pytest.raises(ValueError, match="do not fit"):
        build_node(tmp_path, pfs=2, vfs_per_pf=40000)
    assert simnode.__all__


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_build_progress_prints_a_line_per_quarter_off_a_terminal() -> None:
    out = io.StringIO()
    bar = simnode.BuildProgress(out, "building", " PFs")
    for done in range(9):
        bar(done, 8)
    bar.done()
    assert out.getvalue().splitlines() == [
        "building: 0% (0/8 PFs)",
        "building: 25% (2/8 PFs)",
        "building: 50% (4/8 PFs)",
        "building: 75% (6/8 PFs)",
        "building: 100% (8/8 PFs)",
    ]


def test_build_progress_redraws_one_line_on_a_terminal_and_ends_it() -> None:
    out = _Tty()
    bar = simnode.BuildProgress(out, "building")
    bar(0, 2)
    bar(1, 2)
    bar(2, 2)
    bar.done()
    bar.done()  # a second done adds no empty line
    assert out.getvalue() == (
        f"\rbuilding [{'':<25}]   0% (0/2)\rbuilding [{'#' * 12:<25}]  50% (1/2)"
        f"\rbuilding [{'#' * 25}] 100% (2/2)\n"
    )
