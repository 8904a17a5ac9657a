"""Discovery over simulated trees: every device kind, the mess cases, partial rescans and RDMA ports."""

from __future__ import annotations

import asyncio
import gc
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType
from typing import get_origin, get_type_hints

import pytest

from densedev.model import Device, Role
from densedev.node import scanner as discovery
from densedev.testing.simnode import (
    NodeLayout,
    bind_driver,
    build_node,
    move_netdev_to_pod,
    set_num_vfs,
    set_rdma_port,
)


def _scan(
    impl: ModuleType, root: Path, addresses: tuple[str, ...] | None = None
) -> tuple[dict[str, Device], tuple[str, ...]]:
    wanted = None if addresses is None else tuple(os.fsencode(a) for a in addresses)
    devices, warnings = impl.scan_sysfs(os.fsencode(root), wanted)
    assert [d.id for d in devices] == sorted(d.id for d in devices)
    return {d.id: d for d in devices}, warnings


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> NodeLayout:
    """One node with RDMA and one of each special kind, shared read-only by the tests below."""
    return build_node(tmp_path_factory.mktemp("node"), pfs=4, vfs_per_pf=6, rdma=True, extras=True)


def test_rows_are_devices_with_the_field_types(impl: ModuleType, node: NodeLayout) -> None:
    # The extension fills a Device's items in place (no constructor, no length check): hold both
    # scans to the exact shape, field by field.
    rows, _ = impl.scan_sysfs(os.fsencode(node.root), None)
    want = [get_origin(t) or t for t in get_type_hints(Device).values()]  # tuple[str, ...] → tuple
    assert rows and all(type(r) is Device and len(r) == len(Device._fields) for r in rows)
    for r in rows:
        assert [type(v) for v in r] == want, r
    table = discovery.scan(node.root)
    assert table.devices == rows


def test_extension_rows_are_left_to_reference_counting(
    both: tuple[ModuleType, ModuleType], node: NodeLayout
) -> None:
    # The rows hold no containers but tuples of str: the extension untracks them from the cyclic
    # collector (CPython would on its first pass over them), so a scan leaves it nothing to walk.
    fast, _twin = both
    rows, _ = fast.scan_sysfs(os.fsencode(node.root), None)
    assert rows and not any(
        gc.is_tracked(r) or gc.is_tracked(r.netdevs) or gc.is_tracked(r.rdma_nodes) for r in rows
    )


def test_scan_leaves_the_collector_as_it_found_it(impl: ModuleType, node: NodeLayout) -> None:
    # The extension pauses the cyclic collector while it scans (every object it makes lives until it
    # returns); it must come back on, and stay off when the application had turned it off itself.
    assert gc.isenabled()
    table = discovery.scan(node.root)
    assert gc.isenabled() and len(table) > 5
    assert impl.scan_sysfs(os.fsencode(node.root), None)[0] == table.devices and gc.isenabled()
    gc.disable()
    try:
        impl.scan_sysfs(os.fsencode(node.root), None)
        discovery.scan(node.root)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_pfs_and_vfs(impl: ModuleType, node: NodeLayout) -> None:
    devs, warnings = _scan(impl, node.root)
    assert warnings == ()
    for pf in node.pfs:
        d = devs[pf.address]
        assert (d.role, d.vendor, d.device, d.pci_class) == (Role.PF, "15b3", "101d", "020000")
        assert (d.total_vfs, d.num_vfs, d.driver, d.netdevs) == (6, 6, "mlx5_core", (pf.netdev,))
        assert d.numa_node == pf.numa_node and d.iommu_group >= 0 and not d.noiommu
        assert d.link_type == "ether" and d.rdma_device == pf.ibdev
        assert d.pcie_root.startswith("pci0000:")
        for k, (vf, ifname, ibdev) in enumerate(
            zip(pf.vf_addresses, pf.vf_netdevs, pf.vf_ibdevs, strict=True)
        ):
            v = devs[vf]
            assert (v.role, v.pf, v.vf_index, v.pf_netdev) == (Role.VF, pf.address, k, pf.netdev)
            assert (v.device, v.subsystem_vendor, v.netdevs, v.rdma_device) == (
                "101e",
                "15b3",
                (ifname,),
                ibdev,
            )
            assert v.numa_node == pf.numa_node and v.pcie_root == d.pcie_root
            assert len(v.rdma_nodes) == 2
            assert {n.rsplit("/", 1)[1].rstrip("0123456789") for n in v.rdma_nodes} == {"uverbs", "umad"}
            assert v.acpi_index == -1 and v.total_vfs == 0 and v.aux_type == ""


def test_special_kinds(impl: ModuleType, node: NodeLayout) -> None:
    devs, _ = _scan(impl, node.root)
    ex = node.extras
    assert ex is not None
    for sf, ifname, ibdev in zip(ex.sfs, ex.sf_netdevs, ex.sf_ibdevs, strict=True):
        d = devs[sf]
        assert (d.role, d.aux_type, d.pf, d.pf_netdev) == (Role.SF, "sf", ex.sf_pf, "ens90f0")
        assert (d.netdevs, d.rdma_device, d.driver) == ((ifname,), ibdev, "mlx5_core.sf")
        assert d.vendor == "15b3" and d.pcie_root == devs[ex.sf_pf].pcie_root
        assert d.vf_index == int(sf.rsplit(".", 1)[1])  # the SF number (sfnum), for ranged pfNames
    assert "mlx5_core.eth.0" not in devs  # not a subfunction
    v = devs[ex.vdpa_vf]
    assert (v.vdpa, v.vdpa_driver) == ("vdpa0", "vhost_vdpa")
    u = devs[ex.uio_vf]
    assert (u.uio, u.driver, u.netdevs, u.link_type) == ("uio0", "igb_uio", (), "")
    assert devs[ex.vfio_vf].driver == "vfio-pci" and not devs[ex.vfio_vf].noiommu
    n = devs[ex.noiommu_vf]
    assert n.noiommu and n.iommu_group == ex.noiommu_group
    a = devs[ex.accel_pf]
    assert (a.role, a.pci_class, a.device, a.num_vfs) == (Role.PF, "120000", "4940", 4)
    assert [devs[x].device for x in ex.accel_vfs] == ["4941"] * 4
    ib = devs[ex.ib_pf]
    assert (ib.link_type, ib.pci_class, ib.rdma_device) == ("infiniband", "020700", ex.ib_ibdev)
    kinds = {x.rsplit("/", 1)[1].rstrip("0123456789") for x in ib.rdma_nodes}
    assert kinds == {"uverbs", "umad", "issm", "ucm"}
    p = devs[ex.plain]
    assert (p.role, p.netdevs, p.acpi_index, p.pf) == (Role.PCI, ("eno1",), 1, "")
    bridges = [d for d in devs.values() if d.pci_class == "060400"]
    assert bridges and all(d.driver == "pcieport" for d in bridges)


def test_vf_moved_into_a_pod_keeps_its_identity(impl: ModuleType, tmp_path: Path) -> None:
    layout = build_node(tmp_path, pfs=2, vfs_per_pf=3)
    vf = layout.pfs[1].vf_addresses[2]
    before, _ = _scan(impl, tmp_path)
    move_netdev_to_pod(tmp_path, vf)
    after, warnings = _scan(impl, tmp_path)
    assert warnings == ()
    assert set(after) == set(before)
    assert after[vf]._replace(netdevs=(), link_type="") == after[vf]
    assert before[vf]._replace(netdevs=(), link_type="") == after[vf]
    assert (after[vf].pf, after[vf].vf_index, after[vf].pf_netdev) == (layout.pfs[1].address, 2, "ens1f1")
    # The PF's own netdev moving away leaves its VFs' identity intact too.
    move_netdev_to_pod(tmp_path, layout.pfs[1].address)
    again, _ = _scan(impl, tmp_path)
    assert (again[vf].pf, again[vf].vf_index, again[vf].pf_netdev) == (layout.pfs[1].address, 2, "")


def _dev_dir(root: Path, address: str) -> Path:
    return (root / "bus/pci/devices" / address).resolve()


def test_mess_skips_or_empties_with_a_warning(impl: ModuleType, tmp_path: Path) -> None:
    layout = build_node(tmp_path, pfs=2, vfs_per_pf=8)
    vfs = layout.pfs[0].vf_addresses
    # 0: vanished mid-scan: its bus link dangles
    os.rename(_dev_dir(tmp_path, vfs[0]), tmp_path / "gone")
    # 1: looping symlink (where the function's directory was: a VF is read beside its PF's)
    os.rename(_dev_dir(tmp_path, vfs[1]), tmp_path / "gone1")
    os.symlink(vfs[1], _dev_dir(tmp_path, vfs[0]).parent / vfs[1])
    # 2-6: the uevent is half-written (no usable ids), so the attribute files decide, and then:
    for vf in vfs[2:7]:
        (_dev_dir(tmp_path, vf) / "uevent").write_text("PCI_CLASS=20000\nPCI_ID=15B3:10")
    # 2: empty vendor; 3: garbage device; 4: vendor replaced by a directory (read fails: EISDIR)
    (_dev_dir(tmp_path, vfs[2]) / "vendor").write_text("")
    (_dev_dir(tmp_path, vfs[3]) / "device").write_text("0xzz1e\n")
    (_dev_dir(tmp_path, vfs[4]) / "vendor").unlink()
    (_dev_dir(tmp_path, vfs[4]) / "vendor").mkdir()
    # 5: garbage subsystem id: kept, field emptied; its numa_node is not read (a VF's is its PF's)
    (_dev_dir(tmp_path, vfs[5]) / "numa_node").write_text("banana\n")
    (_dev_dir(tmp_path, vfs[5]) / "subsystem_device").write_text("\n")
    # the second PF's garbage numa_node: kept, field emptied, and its VFs' with it
    pf1 = layout.pfs[1]
    (_dev_dir(tmp_path, pf1.address) / "numa_node").write_text("banana\n")
    # 6: half-written class (missing): skipped
    (_dev_dir(tmp_path, vfs[6]) / "class").unlink()
    # 7: dangling driver link (driver dir removed under us): the link's basename still names it;
    # its uevent is garbage but its attribute files are sound, so it is found all the same
    (_dev_dir(tmp_path, vfs[7]) / "uevent").write_bytes(b"\x00\xff garbage")
    os.unlink(_dev_dir(tmp_path, vfs[7]) / "driver")
    os.symlink("../../../../bus/pci/drivers/ghost", _dev_dir(tmp_path, vfs[7]) / "driver")
    devs, warnings = _scan(impl, tmp_path)
    for bad in (*vfs[:5], vfs[6]):
        assert bad not in devs
    assert devs[vfs[5]].numa_node == devs[layout.pfs[0].address].numa_node >= 0
    assert devs[vfs[5]].subsystem_device == ""
    assert {devs[a].numa_node for a in (pf1.address, *pf1.vf_addresses)} == {-1}
    assert devs[vfs[5]].vf_index == 5
    assert (devs[vfs[7]].vf_index, devs[vfs[7]].driver) == (7, "ghost")
    assert devs[vfs[7]][2:7] == ("15b3", "101e", "020000", "15b3", "0016")
    assert layout.pfs[1].vf_addresses[0] in devs
    expected = [
        f"{vfs[0]}: skipped: No such file or directory",
        f"{vfs[1]}: skipped: Too many levels of symbolic links",
        f"{vfs[2]}: skipped: vendor: empty",
        f"{vfs[3]}: skipped: device: not a hex id",
        f"{vfs[4]}: skipped: vendor: unreadable (Is a directory)",
        f"{vfs[5]}: subsystem_device: empty",
        f"{pf1.address}: numa_node: not an integer",
        f"{vfs[6]}: skipped: class: missing",
    ]
    assert sorted(warnings) == sorted(expected)


def test_driver_from_uevent_or_else_the_driver_link(impl: ModuleType, tmp_path: Path) -> None:
    layout = build_node(tmp_path, pfs=1, vfs_per_pf=4)
    a, b, c, d = layout.pfs[0].vf_addresses
    listing = tmp_path / "bus/pci/drivers/mlx5_core"
    # a: the uevent's DRIVER= line names the driver (the link is not read: it would say "linkonly"),
    # and the driver's directory no longer lists it
    dev = _dev_dir(tmp_path, a)
    os.unlink(dev / "driver")
    os.symlink("../../../../bus/pci/drivers/linkonly", dev / "driver")
    os.unlink(listing / a)
    # b: no DRIVER= line (as while unbound) but a driver link: the link decides
    dev = _dev_dir(tmp_path, b)
    text = (dev / "uevent").read_text()
    (dev / "uevent").write_text("".join(x for x in text.splitlines(True) if not x.startswith("DRIVER=")))
    # c: unbound through the simulator: neither
    bind_driver(tmp_path, c, None)
    assert not (listing / c).exists()
    # d: its link says "linkonly" but mlx5_core's directory lists it
    dev = _dev_dir(tmp_path, d)
    os.unlink(dev / "driver")
    os.symlink("../../../../bus/pci/drivers/linkonly", dev / "driver")
    # Scanned on their own (the full read, as targeted rescans do): the uevent first, then the link.
    devs, warnings = _scan(impl, tmp_path, (a, b, c, d))
    assert [devs[x].driver for x in (a, b, c, d)] == ["mlx5_core", "mlx5_core", "", "mlx5_core"]
    assert warnings == ()
    # After their PF in a full scan a VF's ids are the ones its PF's VFs share (VF 0's uevent) and its
    # driver is the one whose directory lists it, else its own link: the kernel keeps all three in
    # step, this tree does not.
    devs, warnings = _scan(impl, tmp_path)
    assert [devs[x].driver for x in (a, b, c, d)] == ["linkonly", "mlx5_core", "", "mlx5_core"]
    assert devs[b][2:7] == devs[a][2:7] == devs[c][2:7] == devs[d][2:7]
    assert warnings == ()


def test_driver_listing_skips_attribute_files_and_torn_claims(impl: ModuleType, tmp_path: Path) -> None:
    layout = build_node(tmp_path, pfs=2, vfs_per_pf=3)
    first = layout.pfs[0].vf_addresses[0]
    a, b, c = layout.pfs[1].vf_addresses
    listing = tmp_path / "bus/pci/drivers/mlx5_core"
    # The simulated driver directory is shaped like the kernel's: attribute files beside device links.
    assert {"bind", "unbind", "new_id", "remove_id", "uevent"} <= {p.name for p in listing.iterdir()}
    assert os.readlink(listing / b) == os.path.relpath(os.path.realpath(_dev_dir(tmp_path, b)), listing)
    # The first PF's VF 0 is bound to "other", whose directory also claims b (a torn tree): neither
    # listing is trusted for b, its own link decides.
    bind_driver(tmp_path, first, "other")
    os.symlink(os.readlink(listing / b), tmp_path / "bus/pci/drivers/other" / b)
    dev = _dev_dir(tmp_path, b)
    os.unlink(dev / "driver")
    os.symlink("../../../../bus/pci/drivers/third", dev / "driver")
    devs, warnings = _scan(impl, tmp_path)
    assert [devs[x].driver for x in (first, a, b, c)] == ["other", "mlx5_core", "third", "mlx5_core"]
    assert warnings == ()


def test_vfs_come_from_the_sriov_capability_or_else_the_virtfn_links(
    impl: ModuleType, tmp_path: Path
) -> None:
    layout = build_node(tmp_path, pfs=3, vfs_per_pf=20)
    p0, p1, p2 = layout.pfs
    full, warnings = _scan(impl, tmp_path)
    assert warnings == ()
    # The simulated PF puts VF k at routing ID + offset + k x stride (past function 7, onto the next
    # device numbers), and the scan finds the same VFs and indexes from those numbers.
    assert [full[a].vf_index for a in p0.vf_addresses] == list(range(20))
    # p1: a junk virtfn link is never read while the capability's numbers hold.
    pf1 = _dev_dir(tmp_path, p1.address)
    os.symlink("../nowhere", pf1 / "virtfnX")
    # p2: VF 5 removed on its own (echo 1 > remove): its address is gone from the bus, so the links
    # decide, and the other VFs keep their indexes.
    pf2 = _dev_dir(tmp_path, p2.address)
    gone = p2.vf_addresses[5]
    shutil.rmtree(_dev_dir(tmp_path, gone))
    os.unlink(tmp_path / "bus/pci/devices" / gone)
    os.unlink(pf2 / "virtfn5")
    devs, warnings = _scan(impl, tmp_path)
    assert warnings == ()
    assert gone not in devs
    assert [devs[a].vf_index for a in p2.vf_addresses if a != gone] == [k for k in range(20) if k != 5]
    assert [devs[a].vf_index for a in p1.vf_addresses] == list(range(20))
    # A stride that is not a number: the links decide, and the junk one warns.
    (pf1 / "sriov_stride").write_text("two\n")
    devs, warnings = _scan(impl, tmp_path)
    assert [devs[a].vf_index for a in p1.vf_addresses] == list(range(20))
    assert warnings == (f"{p1.address}: virtfnX: not a VF link",)
    # A capability pointing elsewhere than its links (a torn tree): its addresses are not on the bus.
    (pf1 / "sriov_stride").write_text("1\n")
    (pf1 / "sriov_offset").write_text("200\n")
    devs, _ = _scan(impl, tmp_path)
    assert [devs[a].vf_index for a in p1.vf_addresses] == list(range(20))


def test_listed_vf_without_its_group_takes_the_full_read(impl: ModuleType, tmp_path: Path) -> None:
    layout = build_node(tmp_path, pfs=1, vfs_per_pf=3)
    a, b, c = layout.pfs[0].vf_addresses
    # b's directory went away mid-scan (its driver's listing still names it): skipped, as the full
    # read finds; c merely lost its IOMMU group link: the full read keeps it, without a group.
    shutil.rmtree(_dev_dir(tmp_path, b))
    os.unlink(_dev_dir(tmp_path, c) / "iommu_group")
    devs, warnings = _scan(impl, tmp_path)
    assert b not in devs
    assert (devs[c].iommu_group, devs[c].driver, devs[a].driver) == (-1, "mlx5_core", "mlx5_core")
    assert warnings == (f"{b}: skipped: No such file or directory",)


def test_bad_roots_warn_instead_of_raising(impl: ModuleType, tmp_path: Path) -> None:
    rows, warnings = impl.scan_sysfs(os.fsencode(tmp_path / "nope"), None)
    assert rows == () and "cannot open sysfs root" in warnings[0]
    rows, warnings = impl.scan_sysfs(os.fsencode(tmp_path), None)
    assert rows == () and "bus/pci/devices" in warnings[0]


def test_partial_scan_matches_the_full_scan(impl: ModuleType, node: NodeLayout) -> None:
    full, _ = _scan(impl, node.root)
    pf = node.pfs[2]
    part, warnings = _scan(impl, node.root, pf.vf_addresses[1:3])  # VFs without their PF
    assert warnings == () and set(part) == set(pf.vf_addresses[1:3])
    assert all(part[a] == full[a] for a in part)
    ex = node.extras
    assert ex is not None
    part, _ = _scan(impl, node.root, (ex.sf_pf, "0000:ff:1f.7"))  # a PF brings its SFs; unknown: absent
    assert set(part) == {ex.sf_pf, *ex.sfs}
    assert all(part[a] == full[a] for a in part)


def test_device_table_and_rescan_pf(tmp_path: Path) -> None:
    layout = build_node(tmp_path, pfs=2, vfs_per_pf=4)
    table = discovery.scan(tmp_path)
    pf = layout.pfs[0]
    assert table.by_id()[pf.address].role == Role.PF
    assert table.devices[table.index_of(pf.vf_addresses[3])].id == pf.vf_addresses[3]
    assert len(table.by_id()) == len(table) == 1 + 2 + 8  # one NIC: its root port, 2 PFs, 8 VFs
    with pytest.raises(KeyError, match="nosuch"):
        table.index_of("nosuch")
    set_num_vfs(tmp_path, pf.address, 0)
    set_num_vfs(tmp_path, pf.address, 2)
    bind_driver(tmp_path, pf.vf_addresses[1], "vfio-pci")
    updated = discovery.rescan_pf(tmp_path, pf.address, table)
    assert updated == discovery.scan(tmp_path)
    assert updated.by_id()[pf.address].num_vfs == 2
    assert pf.vf_addresses[3] not in updated.by_id()
    assert discovery.pf_family(tmp_path, pf.address)[0] == pf.address
    assert discovery.rescan_devices(tmp_path, ()) == discovery.DeviceTable(())


def test_read_rdma_ports(impl: ModuleType, tmp_path: Path) -> None:
    layout = build_node(tmp_path, pfs=2, vfs_per_pf=1, rdma=True)
    a, b = layout.pfs[0].ibdev, layout.pfs[1].ibdev
    set_rdma_port(tmp_path, b, 1, 1)
    ports = impl.read_rdma_ports(os.fsencode(tmp_path), (a.encode(), b.encode(), b"mlx5_99"))
    assert ports == ((a, 1, 4, 5), (b, 1, 1, 3))
    assert discovery.read_rdma_ports(tmp_path, [a]) == ((a, 1, 4, 5),)
    assert impl.read_rdma_ports(os.fsencode(tmp_path / "nope"), (a.encode(),)) == ()


def test_pci_names_are_optional_and_lazy(tmp_path: Path) -> None:
    ids = tmp_path / "pci.ids"
    ids.write_text(
        "# comment\n15b3  Mellanox Technologies\n\t101e  ConnectX Family mlx5Gen Virtual Function\n"
        "\t\t15b3 0016  Some subsystem\n8086  Intel Corporation\n\t1889  Ethernet Adaptive Virtual Function\n"
        "C 02  Network controller\n\t00  Ethernet controller\n"
    )
    names = discovery.PciNames(ids)
    assert names.vendor("15B3") == "Mellanox Technologies"
    assert names.device("15b3", "101e") == "ConnectX Family mlx5Gen Virtual Function"
    assert names.device("8086", "1889") == "Ethernet Adaptive Virtual Function"
    assert names.device("02", "00") == ""
    missing = discovery.PciNames(tmp_path / "absent")
    assert missing.vendor("15b3") == "" and missing.device("15b3", "101e") == ""


def test_format_devices_lists_every_device_with_names(tmp_path: Path) -> None:
    layout = build_node(tmp_path / "sys", pfs=2, vfs_per_pf=2, extras=True)
    ids = tmp_path / "pci.ids"
    ids.write_text("15b3  Mellanox Technologies\n\t101e  ConnectX Family mlx5Gen Virtual Function\n")
    table = discovery.scan(tmp_path / "sys")
    text = discovery.format_devices(table, discovery.PciNames(ids))
    lines = text.splitlines()
    assert len(lines) == len(table) + 2 and lines[-1] == f"{len(table)} devices, 0 warnings"
    vf = next(line for line in lines if line.startswith(layout.pfs[0].vf_addresses[1]))
    assert f"{layout.pfs[0].address}#1" in vf and "ConnectX Family mlx5Gen Virtual Function" in vf
    assert layout.pfs[0].vf_netdevs[1] in vf
    ex = layout.extras
    assert ex is not None
    assert "uio0" in next(line for line in lines if line.startswith(ex.uio_vf))
    assert "noiommu" in next(line for line in lines if line.startswith(ex.noiommu_vf))


def test_subfunction_number_mess(impl: ModuleType, tmp_path: Path) -> None:
    layout = build_node(tmp_path, pfs=0, vfs_per_pf=0, extras=True)
    ex = layout.extras
    assert ex is not None
    sf1, sf2 = (tmp_path / "bus/auxiliary/devices" / n for n in ex.sfs)
    (sf1 / "sfnum").write_text("one\n")
    (sf2 / "sfnum").unlink()
    devs, warnings = _scan(impl, tmp_path)
    assert devs[ex.sfs[0]].vf_index == -1 and devs[ex.sfs[1]].vf_index == -1
    assert warnings == (f"{ex.sfs[0]}: sfnum: not an integer",)  # absent is not worth a warning


def test_subfunction_of_a_vf(impl: ModuleType, tmp_path: Path) -> None:
    # mlx5 makes SFs on PFs, but nothing in the auxiliary bus says a parent cannot be a VF: one made
    # on a VF is found with that VF as its parent, like any other.
    layout = build_node(tmp_path, pfs=0, vfs_per_pf=0, extras=True)
    ex = layout.extras
    assert ex is not None
    vf_dir = (tmp_path / "bus/pci/devices" / ex.vdpa_vf).resolve()
    sf_dir = vf_dir / "mlx5_core.sf.7"
    sf_dir.mkdir()
    (sf_dir / "sfnum").write_text("7\n")
    os.symlink(
        os.path.relpath(sf_dir, tmp_path / "bus/auxiliary/devices"),
        tmp_path / "bus/auxiliary/devices/mlx5_core.sf.7",
    )
    devs, warnings = _scan(impl, tmp_path)
    assert warnings == ()
    sf, vf = devs["mlx5_core.sf.7"], devs[ex.vdpa_vf]
    assert (sf.role, sf.pf, sf.vf_index, sf.numa_node, sf.vendor) == (
        Role.SF,
        vf.id,
        7,
        vf.numa_node,
        vf.vendor,
    )
    assert all(devs[name].pf == ex.sf_pf for name in ex.sfs)  # the PF's own are unchanged


async def test_scan_in_a_worker_thread_lets_the_event_loop_run(impl: ModuleType, node: NodeLayout) -> None:
    # The daemon scans with asyncio.to_thread so that health messages keep flowing: that needs the
    # scan to let go of the GIL while it waits on the kernel.  CPython would also force a hand-over
    # every sys.getswitchinterval() (5 ms) from code that calls back into Python; a 60 s interval
    # turns that off, so the count below shows only the GIL releases of the scan itself (a scan
    # holding the GIL throughout would leave the counter at 0 or 1, and take a minute to do so).
    root = os.fsencode(node.root)
    scans = 20

    def scan_repeatedly() -> int:
        return sum(len(impl.scan_sysfs(root, None)[0]) for _ in range(scans))

    async def count_ticks_during_scans() -> tuple[int, int]:
        ticks = 0
        done = False

        async def counter() -> None:
            nonlocal ticks
            while not done:
                await asyncio.sleep(0.0005)
                ticks += 1

        task = asyncio.create_task(counter())
        await asyncio.sleep(0)
        start = ticks
        found = await asyncio.to_thread(scan_repeatedly)
        during = ticks - start
        done = True
        await task
        return found, during

    old = sys.getswitchinterval()
    sys.setswitchinterval(60.0)
    try:
        found, ticks = await count_ticks_during_scans()
    finally:
        sys.setswitchinterval(old)
    assert found == scans * len(_scan(impl, node.root)[0])
    # ~20 scans of ~60 devices: thousands of GIL releases, each a chance for the loop to wake up.
    assert ticks >= 5, f"the event loop ran only {ticks} times during {scans} scans in a worker thread"


def test_rows_are_compared_with_a_table_slice_by_slice() -> None:
    # The reconcile's "unchanged?" test runs in slices so the event loop can take the GIL between them;
    # a difference in any slice, or a different count, is still a difference.
    devices = tuple(Device(*(f"{i:05x}", *([""] * (len(Device._fields) - 1)))) for i in range(1300))
    rows = tuple(Device(*d) for d in devices)
    assert discovery._same(rows, devices)
    for at in (0, 511, 512, 1299):
        changed = (*rows[:at], rows[at]._replace(aux_type="x"), *rows[at + 1 :])
        assert not discovery._same(changed, devices), at
    assert not discovery._same(rows[:-1], devices) and not discovery._same((*rows, rows[0]), devices)


def test_an_unchanged_node_gives_back_the_previous_table(tmp_path: Path) -> None:
    layout = build_node(tmp_path, pfs=2, vfs_per_pf=4)
    first = discovery.scan(tmp_path)
    again = discovery.scan(tmp_path, first)
    assert again is first
    # A change makes a new table holding it.
    vf = layout.pfs[0].vf_addresses[2]
    bind_driver(tmp_path, vf, "vfio-pci")
    changed = discovery.scan(tmp_path, first)
    assert changed is not first and changed.by_id()[vf].driver == "vfio-pci"
    assert changed.devices == discovery.scan(tmp_path).devices
    # New warnings alone keep the devices and carry the warnings.
    pf = (tmp_path / "bus/pci/devices" / layout.pfs[1].address).resolve()
    # Unusable SR-IOV numbers make the scan read the PF's virtfn links, and a junk one warns.
    (pf / "sriov_stride").write_text("?\n")
    os.symlink("../nowhere", pf / "virtfnX")  # not a VF link: a warning, no device change
    warned = discovery.scan(tmp_path, changed)
    assert warned.devices is changed.devices and warned.warnings and warned is not changed
