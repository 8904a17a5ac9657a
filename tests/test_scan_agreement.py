"""The Cython scanner and its Python twin return identical devices and warnings on generated messy trees."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from densedev.model import Device
from densedev.testing.simnode import add_virtio_vdpa, bind_driver, build_node, move_netdev_to_pod, set_num_vfs

# Ways a real node's sysfs goes wrong under a scanner (device removed, half-written attributes,
# odd links), plus the ordinary changes the kernel makes.
MESS = (
    "vanish",  # device dir gone, bus link dangling (hot-unplug mid-scan)
    "loop",  # bus link points at itself (ELOOP)
    "empty",  # attribute empty
    "garbage",  # attribute holds garbage
    "dir",  # attribute is a directory (read fails with EISDIR)
    "missing",  # attribute absent
    "bad_group",  # iommu_group link names no number
    "bad_virtfn",  # a PF's virtfn link names garbage
    "to_pod",  # netdev moved into a pod
    "unbind",  # driver unbound
    "vfio",  # rebound to vfio-pci
    "bad_type",  # net/<if>/type garbage
    "long_int",  # an integer too long for the kernel's %d
    "sriov_off",  # sriov_numvfs set to 0: the PF's VFs are destroyed
    "class_link",  # an RDMA class link (read to find a node's function) points somewhere odd
    "virtio_vdpa",  # a vDPA device bound to virtio_vdpa: its netdev under <fn>/[vdpaN/]virtioM/net/
    "net_link",  # a class/net link of a virtio-like shape that names no real function or directory
)
ATTRS = (
    "uevent",  # ids and DRIVER= in one file; anything short of complete ids: the files decide
    "vendor",
    "device",
    "class",
    "subsystem_vendor",
    "subsystem_device",
    "numa_node",
    "sriov_numvfs",
    "sriov_totalvfs",
    "acpi_index",
)

trees = st.fixed_dictionaries(
    {
        "pfs": st.integers(0, 3),
        "vfs": st.integers(0, 4),
        "vendor": st.sampled_from(["mellanox", "intel", "virtio"]),
        "rdma": st.booleans(),
        "extras": st.booleans(),
        "numa": st.integers(1, 2),
        "mess": st.lists(
            st.tuples(
                st.sampled_from(MESS), st.integers(0, 10_000), st.sampled_from(ATTRS), st.binary(max_size=8)
            ),
            max_size=6,
        ),
    }
)


def _apply(root: Path, kind: str, pick: int, attr: str, junk: bytes) -> None:
    bus = root / "bus/pci/devices"
    names = sorted(os.listdir(bus))
    if not names:
        return
    name = names[pick % len(names)]
    link = bus / name
    if not link.exists():
        return
    dev = link.resolve()
    if (dev / attr).is_dir() and kind in ("empty", "garbage", "dir", "missing", "long_int"):
        (dev / attr).rmdir()  # an earlier "dir" step: turn it back into a file first
        (dev / attr).write_bytes(b"")
    if kind == "vanish":
        shutil.rmtree(dev)
    elif kind == "loop":
        link.unlink()
        os.symlink(name, link)
    elif kind == "empty":
        (dev / attr).write_bytes(b"\n")
    elif kind == "garbage":
        (dev / attr).write_bytes(junk or b"?")
    elif kind == "dir":
        if (dev / attr).exists():
            (dev / attr).unlink()
        (dev / attr).mkdir()
    elif kind == "missing":
        if (dev / attr).exists():
            (dev / attr).unlink()
    elif kind == "bad_group" and (dev / "iommu_group").is_symlink():
        (dev / "iommu_group").unlink()
        os.symlink("../../../../kernel/iommu_groups/x" + junk.hex(), dev / "iommu_group")
    elif kind == "bad_virtfn" and (dev / "virtfn0").is_symlink() and not (dev / "virtfnX").is_symlink():
        os.symlink("../" + (junk.hex() or "0"), dev / "virtfn-1")
        (dev / "virtfnX").symlink_to("nowhere")
    elif kind == "to_pod":
        with contextlib.suppress(FileNotFoundError):  # no host interface: nothing to move
            move_netdev_to_pod(root, name)
    elif kind == "unbind" and (dev / "driver").is_symlink():
        bind_driver(root, name, None)
    elif kind == "vfio":
        bind_driver(root, name, "vfio-pci")
    elif kind == "bad_type":
        for net in (dev / "net", *dev.glob("virtio*/net"), *dev.glob("vdpa*/virtio*/net")):
            for ifname in os.listdir(net) if net.is_dir() else ():
                (net / ifname / "type").write_bytes(junk)
    elif kind == "virtio_vdpa":
        add_virtio_vdpa(root, name, f"vd{pick}", software=pick % 2 == 1)
    elif kind == "net_link":
        odd = (
            "virtio1/net/e",  # relative, nothing before the virtio device
            "/virtio1/net/e",
            "vdpa0/virtio1/net/e",
            f"../../devices/{name}/virtio1a/net/e",  # not virtio<N>
            f"../../devices/{name}/virtio/net/e",
            f"../../devices/{name}/vdpa0/virtio7/net/e",  # names the function, no such directory
            f"../../devices/{name}/vdpax/virtio7/net/e",
            f"../../devices/{name}//virtio3//net/e/",
        )
        (root / "class/net" / f"odd{pick}").unlink(missing_ok=True)
        os.symlink(odd[pick % len(odd)], root / "class/net" / f"odd{pick}")
    elif kind == "sriov_off" and (dev / "virtfn0").is_symlink():
        with contextlib.suppress(OSError, ValueError):  # earlier mess may have broken the PF's files
            set_num_vfs(root, name, 0)
    elif kind == "class_link":
        cls = root / "class" / ("infiniband_verbs", "infiniband_mad")[pick % 2]
        entries = sorted(os.listdir(cls)) if cls.is_dir() else []
        if entries:
            node = cls / entries[pick % len(entries)]
            node.unlink()
            odd = ("x", "/", "a//b", name + "/", f"../{name}/infiniband_verbs//", junk.hex() + "/umad0")
            os.symlink(odd[pick % len(odd)], node)
    elif kind == "long_int":
        (dev / attr).write_bytes(b"12345678901234567890\n")


# ``both`` only hands out the two modules, so sharing it across examples is safe.
SHARED_FIXTURE = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]


@settings(max_examples=30, deadline=None, suppress_health_check=SHARED_FIXTURE)
@given(trees)
def test_extension_and_twin_agree_on_generated_trees(both: tuple[ModuleType, ModuleType], tree: dict) -> None:  # type: ignore[type-arg]
    fast, twin = both
    with tempfile.TemporaryDirectory(prefix="densedev-scan-") as tmp:
        root = Path(tmp)
        layout = build_node(
            root,
            pfs=tree["pfs"],
            vfs_per_pf=tree["vfs"],
            vendor=tree["vendor"],
            rdma=tree["rdma"],
            numa_nodes=tree["numa"],
            extras=tree["extras"] and tree["vendor"] != "virtio",  # a VM's node has no SR-IOV extras
        )
        for kind, pick, attr, junk in tree["mess"]:
            _apply(root, kind, pick, attr, junk)
        raw = os.fsencode(root)
        a, b = fast.scan_sysfs(raw, None), twin.scan_sysfs(raw, None)
        assert a == b
        # Partial scans agree too (a PF's VFs without the PF, plus an address that does not exist).
        some = (*(os.fsencode(x) for pf in layout.pfs[:1] for x in pf.vf_addresses), b"0000:ff:00.0")
        assert fast.scan_sysfs(raw, some) == twin.scan_sysfs(raw, some)
        ibdevs = (*(d.rdma_device.encode() for d in a[0] if d.rdma_device), b"absent")
        assert fast.read_rdma_ports(raw, ibdevs) == twin.read_rdma_ports(raw, ibdevs)


@pytest.fixture(scope="module")
def small_node(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One PF with one VF and RDMA; each example below overwrites its attributes."""
    root = tmp_path_factory.mktemp("attrs")
    build_node(root, pfs=1, vfs_per_pf=1, rdma=True)
    return root


@settings(max_examples=150, deadline=None, suppress_health_check=SHARED_FIXTURE)
@given(st.binary(max_size=24))
def test_attribute_parsing_agrees_on_arbitrary_bytes(
    both: tuple[ModuleType, ModuleType], small_node: Path, junk: bytes
) -> None:
    fast, twin = both
    dev = (small_node / "bus/pci/devices/0000:19:00.0").resolve()
    # uevent too, so the attribute files decide (junk this short can never be a complete uevent)
    for attr in ("uevent", "vendor", "numa_node", "sriov_numvfs", "subsystem_device", "acpi_index"):
        (dev / attr).write_bytes(junk)
    (small_node / "class/infiniband/mlx5_0/ports/1/state").write_bytes(junk)
    raw = os.fsencode(small_node)
    result = fast.scan_sysfs(raw, None)
    assert result == twin.scan_sysfs(raw, None)
    assert fast.read_rdma_ports(raw, (b"mlx5_0",)) == twin.read_rdma_ports(raw, (b"mlx5_0",))
    # The PF is kept exactly when its vendor reads as 0x + four hex digits (surrounding space ignored).
    kept = any(d.id == "0000:19:00.0" for d in result[0])
    body = junk.strip()
    assert kept == (
        len(body) == 6
        and body[:2] in (b"0x", b"0X")
        and all(c in b"0123456789abcdefABCDEF" for c in body[2:])
    )


_hexish = st.text(alphabet="0123456789abcdefABCDEFxg: ", min_size=0, max_size=10)
_uevent_lines = st.lists(
    st.tuples(
        st.sampled_from(["PCI_ID", "PCI_SUBSYS_ID", "PCI_CLASS", "DRIVER", "PCI_SLOT_NAME", "PCI_IDX"]),
        _hexish,
    ),
    max_size=7,
)


@settings(max_examples=150, deadline=None, suppress_health_check=SHARED_FIXTURE)
@given(_uevent_lines, st.booleans())
def test_uevent_parsing_agrees(
    both: tuple[ModuleType, ModuleType], small_node: Path, lines: list[tuple[str, str]], no_equals: bool
) -> None:
    fast, twin = both
    dev = (small_node / "bus/pci/devices/0000:19:00.0").resolve()
    for attr, text in (("vendor", "0x15b3"), ("device", "0x101d"), ("class", "0x020000")):
        (dev / attr).write_text(text + "\n")
    sep = "" if no_equals else "="
    (dev / "uevent").write_text("".join(f"{k}{sep}{v}\n" for k, v in lines))
    raw = os.fsencode(small_node)
    result = fast.scan_sysfs(raw, None)
    assert result == twin.scan_sysfs(raw, None)
    pf = next(d for d in result[0] if d.id == "0000:19:00.0")
    values = {k: v for k, v in lines}  # the last line of a key wins
    pid, sub, cls = values.get("PCI_ID"), values.get("PCI_SUBSYS_ID"), values.get("PCI_CLASS")
    if (
        not no_equals
        and pid
        and sub
        and cls
        and all(
            len(x) == 9 and x[4] == ":" and all(c in "0123456789abcdefABCDEF" for c in x[:4] + x[5:])
            for x in (pid, sub)
        )
        and 1 <= len(cls) <= 6
        and all(c in "0123456789abcdefABCDEF" for c in cls)
    ):
        assert (pf.vendor, pf.device, pf.pci_class, pf.subsystem_vendor, pf.subsystem_device) == (
            pid[:4].lower(),
            pid[5:].lower(),
            cls.lower().zfill(6),
            sub[:4].lower(),
            sub[5:].lower(),
        )
    else:
        assert (pf.vendor, pf.device, pf.pci_class) == (
            "15b3",
            "101d",
            "020000",
        )  # the attribute files decided


def _rows(result: tuple[tuple[Device, ...], tuple[str, ...]]) -> dict[str, Device]:
    return {row.id: row for row in result[0]}


def test_a_vf_read_beside_its_pf_equals_its_full_read(impl: ModuleType, tmp_path: Path) -> None:
    # A full scan reads each VF relative to its PF's parent directory (after the PF); a VF scanned
    # without its PF takes the full read through its bus link.  Both must say the same.
    layout = build_node(tmp_path, pfs=2, vfs_per_pf=4, rdma=True, extras=True, numa_nodes=2)
    raw = os.fsencode(tmp_path)
    bind_driver(tmp_path, layout.pfs[0].vf_addresses[1], "vfio-pci")
    bind_driver(tmp_path, layout.pfs[1].vf_addresses[2], None)
    full, warnings = impl.scan_sysfs(raw, None)
    assert warnings == ()
    rows = _rows((full, warnings))
    vfs = [a for pf in layout.pfs for a in pf.vf_addresses]
    for vf in vfs:
        alone, alone_warnings = impl.scan_sysfs(raw, (os.fsencode(vf),))
        assert alone_warnings == ()
        assert alone == (rows[vf],)
    assert {rows[vf].numa_node for vf in layout.pfs[1].vf_addresses} == {
        rows[layout.pfs[1].address].numa_node
    }


def test_a_vf_not_beside_its_pf_is_found_through_its_bus_link(impl: ModuleType, tmp_path: Path) -> None:
    layout = build_node(tmp_path, pfs=1, vfs_per_pf=3)
    raw = os.fsencode(tmp_path)
    before = _rows(impl.scan_sysfs(raw, None))
    vf = layout.pfs[0].vf_addresses[1]
    bus = tmp_path / "bus/pci/devices"
    elsewhere = tmp_path / "devices/pci0000:99"
    elsewhere.mkdir(parents=True)
    os.rename((bus / vf).resolve(), elsewhere / vf)
    (bus / vf).unlink()
    os.symlink(f"../../../devices/pci0000:99/{vf}", bus / vf)
    after, warnings = impl.scan_sysfs(raw, None)
    assert warnings == ()
    moved = _rows((after, warnings))[vf]
    assert moved == before[vf]._replace(pcie_root="pci0000:99") and before[vf].pcie_root != "pci0000:99"


def test_parallel_reads_agree_across_batches(both: tuple[ModuleType, ModuleType], tmp_path: Path) -> None:
    # More VFs than one read-ahead batch (512) and than one class-link batch per PF family, with odd
    # VFs spread over the batches: the extension with and without helper threads equals the twin.
    fast, twin = both
    layout = build_node(tmp_path, pfs=2, vfs_per_pf=600, rdma=True)
    vfs = layout.pfs[0].vf_addresses
    for k in (0, 511, 512, 513, 599):
        bind_driver(tmp_path, vfs[k], "vfio-pci" if k % 2 else None)
    for k in (100, 530):
        dev = (tmp_path / "bus/pci/devices" / vfs[k]).resolve()
        for ifname in os.listdir(dev / "net"):
            (dev / "net" / ifname / "type").write_bytes(b"ether\n")
        (dev / "uevent").write_bytes(b"PCI_ID=15B3:\n")  # no usable uevent: the full read decides
    # Class and virtfn links longer than a read-ahead slot holds are read again with room for them.
    pf = (tmp_path / "bus/pci/devices" / layout.pfs[1].address).resolve()
    (pf / "sriov_offset").write_text("-\n")  # unusable: this PF's virtfn links are read
    os.unlink(pf / "virtfn3")
    os.symlink("./" * 200 + "../" + layout.pfs[1].vf_addresses[3], pf / "virtfn3")
    os.symlink(
        "../../devices/" + "./" * 200 + f"{layout.pfs[1].vf_addresses[4]}/net/longif",
        tmp_path / "class/net/longif",
    )
    raw = os.fsencode(tmp_path)
    expected = twin.scan_sysfs(raw, None)
    assert fast.scan_sysfs(raw, None) == expected
    assert fast.scan_sysfs(raw, None, False) == expected == twin.scan_sysfs(raw, None, False)
    rows = _rows(expected)
    assert rows[layout.pfs[1].vf_addresses[3]].vf_index == 3
    assert "longif" in rows[layout.pfs[1].vf_addresses[4]].netdevs
    assert sum(1 for r in expected[0] if r.role == "vf") == 1200
    assert [w for w in expected[1] if "type" in w] == [
        f"{vfs[k]}: net/{rows[vfs[k]].netdevs[0]}/type: not an integer" for k in (100, 530)
    ]
