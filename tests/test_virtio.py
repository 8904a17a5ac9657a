"""virtio NICs and vDPA devices whose interface sits below a ``virtio<N>`` device, not in ``net/``.

On a VM, virtio-pci binds the PCI function and registers a ``virtio<N>`` device below it, which
virtio_net binds: the interface is ``<function>/virtio<N>/net/<if>`` (issue 24, section 3).  virtio_vdpa
does the same for a vDPA device, below the function (hardware vDPA) or below ``vdpa<N>`` (software).
Each test runs under both scan implementations (the ``impl`` fixture) and checks what follows from the
netdev: link type, link health, pools and the device-info document.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

from densedev import cli
from densedev.alloc.devinfo import info_document
from densedev.health.tracker import HealthTracker
from densedev.model import Device
from densedev.node import scanner
from densedev.node.events import LinkMonitor, LinkTuple, link_states
from densedev.node.scanner import Scanner, netdev_names
from densedev.pools import config as config_mod
from densedev.pools import select
from densedev.testing import simnode
from densedev.testing.netns import aip, ip

REAL_PCI = Path("/sys/bus/pci/devices")


def _rows(impl: ModuleType, root: Path) -> tuple[dict[str, Device], tuple[str, ...]]:
    devices, warnings = impl.scan_sysfs(os.fsencode(root), None)
    return {d.id: d for d in devices}, warnings


def _real_virtio_nics() -> dict[str, set[str]]:
    """Each virtio-net function of this machine's /sys → the interfaces below its ``virtio<N>/net/``."""
    out: dict[str, set[str]] = {}
    if not REAL_PCI.is_dir():
        return out
    for dev in sorted(REAL_PCI.iterdir()):
        try:
            ids = ((dev / "vendor").read_text().strip(), (dev / "device").read_text().strip())
        except OSError:
            continue
        if ids != ("0x1af4", "0x1041") or (dev / "net").exists():
            continue
        names = {n.name for net in dev.glob("virtio*/net") for n in net.iterdir()}
        if names:
            out[dev.name] = names
    return out


def _ip_link_names() -> set[str]:
    """Interface names ``ip -o link`` shows (the host network namespace, through rtnetlink)."""
    try:
        text = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"ip link unavailable: {exc}")
    # "2: eth0: <BROADCAST,...> ..."; a VLAN or veth shows "eth0.1@eth0": the name ends before '@'.
    return {line.split(":")[1].strip().split("@")[0] for line in text.splitlines() if line.count(":") >= 2}


def test_the_real_virtio_nic_of_this_vm_has_the_netdev_ip_link_shows(impl: ModuleType) -> None:
    nics = _real_virtio_nics()
    if not nics:
        pytest.skip("no virtio-net function with a virtio<N>/net/ interface in this machine's /sys")
    shown = _ip_link_names()
    rows, _warnings = _rows(impl, Path("/sys"))
    for address, names in nics.items():
        assert names <= shown, f"{address}: {names} not all in ip link's {shown}"
        d = rows[address]
        assert set(d.netdevs) == names
        assert d.driver == "virtio-pci" and d.link_type == "ether" and d.role == "pci"


@pytest.fixture
def vm(tmp_path: Path) -> simnode.NodeLayout:
    """A simulated VM node: three virtio-net NICs (``densedev simulate --vendor virtio``)."""
    layout = simnode.simulate(tmp_path / "node", pfs=3, vendor="virtio")
    return layout


def test_the_simulated_virtio_nic_is_laid_out_as_on_a_vm(vm: simnode.NodeLayout) -> None:
    dev = Path(os.path.realpath(vm.root / "bus/pci/devices" / vm.pfs[0].address))
    assert dev.parent.name == "pci0000:00"
    assert {(dev / f).read_text() for f in ("vendor", "device", "class")} == {
        "0x1af4\n",
        "0x1041\n",
        "0x020000\n",
    }
    assert os.readlink(dev / "driver") == "../../../bus/pci/drivers/virtio-pci"
    assert not (dev / "net").exists() and not (dev / "sriov_totalvfs").exists()
    (vdev,) = dev.glob("virtio*")
    assert os.readlink(vdev / "driver") == "../../../../bus/virtio/drivers/virtio_net"
    assert (vdev / "device").read_text() == "0x0001\n"
    assert os.listdir(vdev / "net") == [vm.pfs[0].netdev]
    link = os.readlink(vm.root / "class/net" / vm.pfs[0].netdev)
    assert link == f"../../devices/pci0000:00/{dev.name}/{vdev.name}/net/{vm.pfs[0].netdev}"
    # The tree's link shapes are the kernel's: the same as this VM's own, where it has one.
    real = _real_virtio_nics()
    if real:
        address = next(iter(real))
        rdev = REAL_PCI / address
        (rvdev,) = (v for v in rdev.glob("virtio*") if (v / "net").is_dir())
        assert os.readlink(rdev / "driver") == os.readlink(dev / "driver")
        assert os.readlink(rvdev / "driver") == os.readlink(vdev / "driver")
        assert os.readlink(rvdev / "subsystem") == os.readlink(vdev / "subsystem")
        rname = next(iter(real[address]))
        assert os.readlink(rvdev / "net" / rname / "device") == f"../../../{rvdev.name}"
        assert os.readlink(vdev / "net" / vm.pfs[0].netdev / "device") == f"../../../{vdev.name}"


def test_scan_gives_each_virtio_nic_its_netdev(impl: ModuleType, vm: simnode.NodeLayout) -> None:
    rows, warnings = _rows(impl, vm.root)
    assert warnings == ()
    for pf in vm.pfs:
        d = rows[pf.address]
        assert (d.role, d.vendor, d.device, d.driver) == ("pci", "1af4", "1041", "virtio-pci")
        assert d.netdevs == (pf.netdev,) and d.link_type == "ether"


def test_a_partial_rescan_and_a_netdev_moved_to_a_pod(vm: simnode.NodeLayout) -> None:
    s = Scanner(vm.root)
    table = s.scan()
    nic = vm.pfs[1]
    simnode.move_netdev_to_pod(vm.root, nic.address)
    result = s.rescan(table, {nic.address})
    assert not result.full and result.changed
    assert result.table.by_id()[nic.address].netdevs == ()
    assert result.table.devices == scanner.scan(vm.root).devices


def test_link_health_follows_the_virtio_netdev(vm: simnode.NodeLayout) -> None:
    s = Scanner(vm.root)
    table = s.scan()
    pools = select.build_pools(config_mod.load(vm.root / "config.json"), table.devices)
    tracker = HealthTracker(table.devices, pools)
    tracker.collect()
    nic = vm.pfs[0]
    simnode.set_link(vm.root, nic.netdev, False)
    names = netdev_names(table.devices)
    assert nic.netdev in names
    tracker.set_links(s.operstates(names))
    (first,) = (p for p in pools if any(m.device.id == nic.address for m in p.members))
    assert tracker.unhealthy_devices(first.config.full_name) == (nic.address,)


def test_pools_select_virtio_nics_and_the_device_info_names_them(vm: simnode.NodeLayout) -> None:
    table = scanner.scan(vm.root)
    pools = {
        p.config.resource_name: p
        for p in select.build_pools(config_mod.load(vm.root / "config.json"), table.devices)
    }
    assert [m.device.id for m in pools["virtio_first"].members] == [vm.pfs[0].address]
    assert [m.device.id for m in pools["virtio_nics"].members] == [pf.address for pf in vm.pfs[1:]]
    member = pools["virtio_first"].members[0].device
    assert member.netdevs == (vm.pfs[0].netdev,)
    assert info_document(member, False, "") == {
        "type": "pci",
        "version": info_document(member, False, "")["version"],
        "pci": {"pci-address": vm.pfs[0].address},
    }


@pytest.mark.parametrize("software", [False, True], ids=["hardware", "software"])
def test_a_virtio_vdpa_device_gives_its_function_the_netdev(
    impl: ModuleType, tmp_path: Path, software: bool
) -> None:
    layout = simnode.build_node(tmp_path, pfs=2, vfs_per_pf=2)
    vf = layout.pfs[0].vf_addresses[1]
    simnode.bind_driver(tmp_path, vf, None)  # its mlx5 netdev gone: only the vDPA one is left
    name = simnode.add_virtio_vdpa(tmp_path, vf, "vdpaeth0", software=software)
    rows, warnings = _rows(impl, tmp_path)
    assert warnings == ()
    d = rows[vf]
    assert (d.vdpa, d.vdpa_driver, d.netdevs, d.link_type) == (name, "virtio_vdpa", ("vdpaeth0",), "ether")
    # Its PF's netdev still selects it by pfNames, the function of the netdev found below vdpa/virtio.
    assert d.pf_netdev == layout.pfs[0].netdev
    doc = info_document(d, False, "")
    assert doc["type"] == "vdpa" and doc["vdpa"]["driver"] == "virtio" and doc["vdpa"]["pci-address"] == vf


def test_densedev_simulate_vendor_virtio(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "vm"
    assert cli.main(["simulate", "--out", str(out), "--vendor", "virtio", "--pfs", "2"]) == 0
    assert "2 PFs, 0 VFs" in capsys.readouterr().out
    assert cli.main(["scan", "--sysfs-root", str(out), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["devices"]
    assert [(r["id"], r["netdevs"]) for r in rows] == [("0000:00:03.0", ["eth0"]), ("0000:00:04.0", ["eth1"])]
    # More NICs than bus 0 has slots: one line, no traceback, nothing written.
    assert cli.main(["simulate", "--out", str(tmp_path / "big"), "--vendor", "virtio", "--pfs", "30"]) == 1
    err = capsys.readouterr().err
    assert "do not fit bus 0" in err and "Traceback" not in err and not (tmp_path / "big").exists()


@pytest.mark.netns
@pytest.mark.skipif(os.geteuid() != 0, reason="creating a network namespace needs root")
@pytest.mark.skipif(shutil.which("ip") is None, reason="iproute2's ip is not installed")
async def test_rtnetlink_link_down_of_the_virtio_netdev_makes_its_nic_unhealthy(
    vm: simnode.NodeLayout, netns: str
) -> None:
    """The kernel's own link events, for a veth named as the virtio NIC's interface, reach its function."""
    table = scanner.scan(vm.root)
    pools = select.build_pools(config_mod.load(vm.root / "config.json"), table.devices)
    tracker = HealthTracker(table.devices, pools)
    tracker.collect()
    nic = vm.pfs[0]
    (pool,) = (p for p in pools if any(m.device.id == nic.address for m in p.members))
    ip(netns, "link", "add", nic.netdev, "type", "veth", "peer", "name", "peer0")
    ip(netns, "link", "set", "peer0", "up")
    ip(netns, "link", "set", nic.netdev, "up")
    seen: dict[str, bool] = {}
    changed = asyncio.Event()

    def on_links(batch: tuple[LinkTuple, ...]) -> None:
        states, _gone = link_states(batch)
        tracker.set_links(states)
        seen.update(states)
        changed.set()

    async def until(name: str, up: bool) -> None:
        while seen.get(name) is not up:
            changed.clear()
            await changed.wait()

    monitor = LinkMonitor(on_links, lambda: None, netns=netns)
    await monitor.start()
    try:
        await asyncio.wait_for(until(nic.netdev, True), 20.0)
        assert tracker.unhealthy_devices(pool.config.full_name) == ()
        await aip(netns, "link", "set", nic.netdev, "down")
        await asyncio.wait_for(until(nic.netdev, False), 20.0)
        assert tracker.unhealthy_devices(pool.config.full_name) == (nic.address,)
    finally:
        monitor.stop()


def test_pfnames_selects_the_vfs_of_a_pf_whose_netdev_is_below_its_virtio_device(
    impl: ModuleType, tmp_path: Path
) -> None:
    """A virtio-net PF with VFs (VIRTIO_F_SR_IOV: virtio_pci_common.c virtio_pci_sriov_configure).

    pfNames selects a PF's children by the PF's interface name (docs/config.md): the VFs take it from
    the PF's netdev, which here sits at ``<pf>/virtio<N>/net/<if>``.
    """
    layout = simnode.build_node(tmp_path, pfs=2, vfs_per_pf=3)
    pf = layout.pfs[0]
    dev = Path(os.path.realpath(tmp_path / "bus/pci/devices" / pf.address))
    (dev / "virtio7").mkdir()
    os.rename(dev / "net", dev / "virtio7/net")
    (tmp_path / "class/net" / pf.netdev).unlink()
    os.symlink(
        os.path.relpath(dev / "virtio7/net" / pf.netdev, tmp_path / "class/net"),
        tmp_path / "class/net" / pf.netdev,
    )
    devices, warnings = impl.scan_sysfs(os.fsencode(tmp_path), None)
    assert warnings == ()
    rows = {d.id: d for d in devices}
    assert rows[pf.address].netdevs == (pf.netdev,) and rows[pf.address].link_type == "ether"
    assert all(rows[vf].pf_netdev == pf.netdev for vf in pf.vf_addresses)
    cfg = config_mod.parse(
        json.dumps({"resourceList": [{"resourceName": "v", "selectors": {"pfNames": [f"{pf.netdev}#0-1"]}}]})
    )
    (pool,) = select.build_pools(cfg, devices)
    assert [m.device.id for m in pool.members] == list(pf.vf_addresses[:2])
