"""Driver rebinding over the simulated kernel: the kernel's sequence, bounded waits, refusals, put-back."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from densedev import workers
from densedev.node import rebind
from densedev.node.rebind import Binding, Reason, RebindError
from densedev.testing import netns, simnode
from densedev.testing.simkernel import FaultRule, SimKernel, write_faults
from densedev.workers import Work

TIMEOUT = 2.0


class Node:
    """A small simulated node with its kernel running in a thread."""

    def __init__(self, tmp: Path, extras: bool = False) -> None:
        self.sys = tmp / "sys"
        self.dev = tmp / "dev"
        self.layout = simnode.build_node(self.sys, pfs=2, vfs_per_pf=4, rdma=True, extras=extras)
        self.kernel = SimKernel(self.sys, self.dev)
        pf = self.layout.pfs[0]
        self.vf, self.ifname = pf.vf_addresses[1], pf.vf_netdevs[1]
        self.other = pf.vf_addresses[2]

    def faults(self, *rules: FaultRule) -> None:
        write_faults(self.sys, list(rules))

    def log(self) -> list[str]:
        return (self.sys / ".simnode/kernel/log").read_text().splitlines()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    n = Node(tmp_path)
    n.kernel.start()
    try:
        yield n
    finally:
        n.kernel.stop()


def test_rebind_to_vfio_and_back_follows_the_kernel_sequence(node: Node) -> None:
    before = rebind.binding_of(node.sys, node.vf)
    assert before.driver == "mlx5_core" and before.netdevs == (node.ifname,) and before.iommu_group
    assert rebind.override_of(node.sys, node.vf) is None
    after = rebind.rebind(node.sys, node.vf, "vfio-pci", timeout=TIMEOUT, dev_root=node.dev)
    assert after == Binding("vfio-pci", before.iommu_group, ())
    assert (node.dev / "vfio" / before.iommu_group).exists()
    assert rebind.override_of(node.sys, node.vf) == "vfio-pci"
    assert not (node.sys / "class/net" / node.ifname).exists()
    # The driver's own link to the device moved with it (drivers/base/dd.c driver_sysfs_add()).
    assert (node.sys / "bus/pci/drivers/vfio-pci" / node.vf).is_symlink()
    assert not (node.sys / "bus/pci/drivers/mlx5_core" / node.vf).exists()
    ops = [line.split()[1] for line in node.log()]
    assert ops == ["driver_override", "unbind", "drivers_probe"]

    back = rebind.restore(node.sys, node.vf, before, None, timeout=TIMEOUT)
    assert back.driver == "mlx5_core" and back.netdevs == (node.ifname,)
    assert rebind.override_of(node.sys, node.vf) is None
    assert not (node.dev / "vfio" / before.iommu_group).exists()
    assert (node.sys / "class/net" / node.ifname / "operstate").read_text() == "up\n"
    # The RDMA device came back with mlx5_core.
    assert any((Path(os.path.realpath(node.sys / "bus/pci/devices" / node.vf)) / "infiniband").iterdir())


def test_already_bound_writes_nothing(node: Node) -> None:
    assert (
        rebind.rebind(node.sys, node.vf, "mlx5_core", timeout=TIMEOUT, dev_root=node.dev).driver
        == "mlx5_core"
    )
    assert not (node.sys / ".simnode/kernel/log").exists()


def test_a_refused_probe_puts_the_old_driver_back(node: Node) -> None:
    node.faults(FaultRule(op="drivers_probe", errno=19))
    with pytest.raises(RebindError) as info:
        rebind.rebind(node.sys, node.vf, "vfio-pci", timeout=TIMEOUT, dev_root=node.dev)
    assert info.value.reason is Reason.REFUSED and info.value.errno == 19 and info.value.restored is True
    assert "\n" not in str(info.value) and "drivers_probe" in str(info.value) and node.vf in str(info.value)
    now = rebind.binding_of(node.sys, node.vf)
    assert now.driver == "mlx5_core" and now.netdevs == (node.ifname,)
    assert rebind.override_of(node.sys, node.vf) is None


def test_a_failing_probe_times_out_and_is_put_back(node: Node) -> None:
    # drivers_probe succeeds but vfio-pci's probe() fails: the kernel leaves the VF unbound.
    node.faults(FaultRule(op="drivers_probe", probe_fails=True))
    t0 = time.monotonic()
    with pytest.raises(RebindError) as info:
        rebind.rebind(node.sys, node.vf, "vfio-pci", timeout=0.3, dev_root=node.dev)
    assert info.value.reason is Reason.TIMEOUT and info.value.restored is True
    assert 0.3 <= time.monotonic() - t0 < 0.3 + TIMEOUT
    assert rebind.binding_of(node.sys, node.vf).driver == "mlx5_core"


def test_a_probe_slower_than_the_timeout_fails_bounded_and_is_put_back_later(node: Node) -> None:
    # The kernel holds the device's lock while the probe runs, so the put-back (bounded like the
    # rebind) waits behind it and fails too: the caller keeps the VF withheld and retries.
    node.faults(FaultRule(op="drivers_probe", delay_ms=600, times=1))
    before = rebind.binding_of(node.sys, node.vf)
    t0 = time.monotonic()
    with pytest.raises(RebindError) as info:
        rebind.rebind(node.sys, node.vf, "vfio-pci", timeout=0.2, dev_root=node.dev)
    took = time.monotonic() - t0
    assert info.value.reason is Reason.TIMEOUT and "drivers_probe" in info.value.detail
    assert 0.4 <= took < 0.4 + TIMEOUT  # the forward wait's bound, then the put-back's own
    assert info.value.restored is False and "putting back mlx5_core failed" in str(info.value)
    # The probe lands (binding vfio-pci), then the put-back's override write; a retry puts it back.
    time.sleep(0.5)
    back = rebind.restore(node.sys, node.vf, before, None, timeout=TIMEOUT)
    assert (back.driver, back.netdevs) == ("mlx5_core", (node.ifname,))
    assert rebind.override_of(node.sys, node.vf) is None
    assert not (node.dev / "vfio" / str(before.iommu_group)).exists()


def test_a_delayed_probe_within_the_timeout_succeeds(node: Node) -> None:
    node.faults(FaultRule(op="drivers_probe", delay_ms=50))
    t0 = time.monotonic()
    assert (
        rebind.rebind(node.sys, node.vf, "vfio-pci", timeout=TIMEOUT, dev_root=node.dev).driver == "vfio-pci"
    )
    assert time.monotonic() - t0 >= 0.05


def test_a_failed_put_back_says_so(node: Node) -> None:
    node.faults(FaultRule(op="drivers_probe", errno=5), FaultRule(op="bind", errno=5))
    with pytest.raises(RebindError) as info:
        rebind.rebind(node.sys, node.vf, "vfio-pci", timeout=0.5, dev_root=node.dev)
    assert info.value.restored is False and "putting back mlx5_core failed" in str(info.value)
    assert rebind.binding_of(node.sys, node.vf).driver is None


def test_refused_unbind_keeps_the_driver(node: Node) -> None:
    node.faults(FaultRule(op="unbind", errno=16, times=1))
    with pytest.raises(RebindError) as info:
        rebind.rebind(node.sys, node.vf, "vfio-pci", timeout=TIMEOUT, dev_root=node.dev)
    assert info.value.errno == 16 and info.value.restored is True
    assert rebind.binding_of(node.sys, node.vf).driver == "mlx5_core"
    assert rebind.override_of(node.sys, node.vf) is None


def test_busy_netdevs_are_refused_before_any_write(node: Node) -> None:
    assert rebind.busy_reason(node.sys, node.vf) is None
    simnode.set_addresses(node.sys, node.ifname, ["fe80::1/64"])
    assert rebind.busy_reason(node.sys, node.vf) is None  # link-local: the kernel's own, not use
    simnode.set_addresses(node.sys, node.ifname, ["10.1.2.3/24", "fe80::1/64"])
    reason = rebind.busy_reason(node.sys, node.vf)
    assert reason == f"netdev {node.ifname} is up with 10.1.2.3/24"
    with pytest.raises(RebindError) as info:
        rebind.rebind(node.sys, node.vf, "vfio-pci", timeout=TIMEOUT, dev_root=node.dev)
    assert info.value.reason is Reason.BUSY and info.value.restored is None
    assert not (node.sys / ".simnode/kernel/log").exists()
    # Down, the addresses carry no traffic: the VF may go.
    simnode.set_link(node.sys, node.ifname, up=False)
    assert rebind.busy_reason(node.sys, node.vf) is None
    simnode.set_link(node.sys, node.ifname, up=True)
    simnode.set_addresses(node.sys, node.ifname, [])
    simnode.enslave(node.sys, node.ifname, "bond0")
    assert rebind.busy_reason(node.sys, node.vf) == f"netdev {node.ifname} is enslaved to bond0"
    with pytest.raises(RebindError, match=r"in use by the host: netdev .* is enslaved to bond0"):
        rebind.rebind(node.sys, node.vf, "vfio-pci", timeout=TIMEOUT, dev_root=node.dev)
    assert rebind.binding_of(node.sys, node.vf).driver == "mlx5_core"


def test_an_unreadable_address_record_fails_closed(node: Node) -> None:
    (node.sys / simnode.ADDRESSES).write_text("{not json")
    assert "unreadable" in (rebind.busy_reason(node.sys, node.vf) or "")


def test_planted_symlinks_are_refused(node: Node, tmp_path: Path) -> None:
    dev = Path(os.path.realpath(node.sys / "bus/pci/devices" / node.vf))
    target = tmp_path / "elsewhere"
    target.write_text("keep\n")
    (dev / "driver_override").unlink()
    (dev / "driver_override").symlink_to(target)
    with pytest.raises(RebindError) as info:
        rebind.rebind(node.sys, node.vf, "vfio-pci", timeout=TIMEOUT, dev_root=node.dev)
    assert info.value.reason is Reason.UNSAFE and target.read_text() == "keep\n"
    # Nor is a FIFO planted at a command file opened (it would block) or written.
    (dev / "driver_override").unlink()
    os.mkfifo(dev / "driver_override")
    with pytest.raises(RebindError) as info:
        rebind.rebind(node.sys, node.vf, "vfio-pci", timeout=TIMEOUT, dev_root=node.dev)
    assert info.value.reason is Reason.UNSAFE
    # A driver link leading out of bus/pci/drivers is not a driver.
    other = Path(os.path.realpath(node.sys / "bus/pci/devices" / node.other))
    (other / "driver").unlink()
    (other / "driver").symlink_to(tmp_path)
    with pytest.raises(RebindError) as info:
        rebind.binding_of(node.sys, node.other)
    assert info.value.reason is Reason.UNSAFE
    # Nor is a device link leading out of devices/.
    (node.sys / "bus/pci/devices" / node.other).unlink()
    (node.sys / "bus/pci/devices" / node.other).symlink_to(tmp_path)
    with pytest.raises(RebindError, match="does not lead to a PCI function"):
        rebind.binding_of(node.sys, node.other)


def test_bad_input_and_refusals_before_writes(node: Node) -> None:
    cases = [
        ("../../etc", "vfio-pci", Reason.BAD_INPUT),
        (node.vf, "vfio-pci\nmlx5_core", Reason.BAD_INPUT),
        (node.vf, "../x", Reason.BAD_INPUT),
        ("0000:ff:1f.7", "vfio-pci", Reason.NO_DEVICE),
        (node.layout.pfs[0].address, "vfio-pci", Reason.NOT_VF),
        (node.vf, "nvme", Reason.NO_DRIVER),
    ]
    for pci, driver, reason in cases:
        with pytest.raises(RebindError) as info:
            rebind.rebind(node.sys, pci, driver, timeout=TIMEOUT, dev_root=node.dev)
        assert info.value.reason is reason, (pci, driver, info.value)
        assert "\n" not in str(info.value)
    assert not (node.sys / ".simnode/kernel/log").exists()


def test_a_group_shared_with_a_kernel_bound_device_is_refused(node: Node) -> None:
    group = rebind.binding_of(node.sys, node.vf).iommu_group
    assert group is not None
    gdir = node.sys / "kernel/iommu_groups" / group / "devices"
    other = Path(os.path.realpath(node.sys / "bus/pci/devices" / node.other))
    (gdir / node.other).symlink_to(os.path.relpath(other, gdir))
    with pytest.raises(RebindError) as info:
        rebind.rebind(node.sys, node.vf, "vfio-pci", timeout=TIMEOUT, dev_root=node.dev)
    assert info.value.reason is Reason.GROUP and node.other in str(info.value)


def test_no_iommu_group_node_is_named_noiommu(tmp_path: Path) -> None:
    node = Node(tmp_path, extras=True)
    extras = node.layout.extras
    assert extras is not None
    vf = extras.noiommu_vf
    assert rebind.binding_of(node.sys, vf).driver == "vfio-pci"
    with node.kernel:
        assert rebind.rebind(node.sys, vf, "iavf", timeout=TIMEOUT, dev_root=node.dev).netdevs
        assert not (node.dev / "vfio" / f"noiommu-{extras.noiommu_group}").exists()
        rebind.rebind(node.sys, vf, "vfio-pci", timeout=TIMEOUT, dev_root=node.dev)
        assert (node.dev / "vfio" / f"noiommu-{extras.noiommu_group}").exists()


def test_without_a_kernel_the_wait_is_bounded(tmp_path: Path) -> None:
    n = Node(tmp_path)  # no kernel answers
    t0 = time.monotonic()
    with pytest.raises(RebindError) as info:
        rebind.rebind(n.sys, n.vf, "vfio-pci", timeout=0.2, dev_root=n.dev)
    assert info.value.reason is Reason.TIMEOUT and info.value.restored is False
    assert time.monotonic() - t0 < 1.0


async def test_concurrent_rebinds_on_the_rebind_pool(node: Node) -> None:
    vfs = node.layout.pfs[1].vf_addresses
    node.faults(FaultRule(op="drivers_probe", delay_ms=20))
    calls = [
        workers.run(Work.REBIND, rebind.rebind, node.sys, vf, "vfio-pci", timeout=5.0, dev_root=node.dev)
        for vf in vfs
    ]
    results = await asyncio.gather(*calls)
    assert [r.driver for r in results] == ["vfio-pci"] * len(vfs)
    groups = {r.iommu_group for r in results}
    assert {p.name for p in (node.dev / "vfio").iterdir()} >= {g for g in groups if g}


@pytest.mark.skipif(netns.available() is not None, reason=str(netns.available()))
def test_a_real_node_reads_addresses_by_rtnetlink(tmp_path: Path) -> None:
    # A tree without .simnode is a real node's: addresses come from an RTM_GETADDR dump of the
    # namespace, matched by the ifindex sysfs shows.  The VF's interface is one end of a veth pair here.
    layout = simnode.build_node(tmp_path / "sys", pfs=1, vfs_per_pf=2)
    root = tmp_path / "sys"
    vf, ifname = layout.pfs[0].vf_addresses[0], layout.pfs[0].vf_netdevs[0]
    shutil.rmtree(root / ".simnode")
    with netns.namespace() as ns:
        netns.ip(ns, "link", "add", ifname, "type", "veth", "peer", "name", "peer0")
        netns.ip(ns, "link", "set", ifname, "up")
        (root / "class/net" / ifname / "ifindex").write_text(f"{netns.ifindexes(ns)[ifname]}\n")
        assert rebind.busy_reason(root, vf, netns=ns) is None  # up, but only the kernel's link-local
        netns.ip(ns, "addr", "add", "10.9.8.7/24", "dev", ifname)
        netns.ip(ns, "addr", "add", "fd00::7/64", "dev", ifname, "nodad")
        assert sorted(rebind.host_addresses(root, (ifname,), netns=ns)[ifname]) == [
            "10.9.8.7/24",
            "fd00::7/64",
        ]
        assert rebind.busy_reason(root, vf, netns=ns) == f"netdev {ifname} is up with 10.9.8.7/24, fd00::7/64"
        netns.ip(ns, "addr", "flush", "dev", ifname)
        assert rebind.busy_reason(root, vf, netns=ns) is None
        # An interface sysfs cannot give an ifindex for: cannot tell, so in use (fail closed).
        (root / "class/net" / ifname / "ifindex").unlink()
        assert "ifindex unreadable" in (rebind.busy_reason(root, vf, netns=ns) or "")


@pytest.mark.parametrize("killed_in", ["driver_override", "unbind", "drivers_probe", "done"])
def test_a_rebinder_killed_at_any_step_is_put_back_by_the_next(tmp_path: Path, killed_in: str) -> None:
    # What a restarted daemon does with its journal: the process that was rebinding is SIGKILLed while
    # the kernel works on one command (or after the last), and a fresh call puts the VF back.
    node = Node(tmp_path)
    before = rebind.binding_of(node.sys, node.vf)
    order = ["driver_override", "unbind", "drivers_probe"]
    node.faults(*(FaultRule(op=op, delay_ms=400) for op in order))
    code = (
        "import sys; from densedev.node import rebind; "
        f"rebind.rebind({str(node.sys)!r}, {node.vf!r}, 'vfio-pci', timeout=30, dev_root={str(node.dev)!r})"
    )
    with node.kernel:
        child = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": SRC})
        try:
            # The kernel has taken the commands before `killed_in`: its log has their lines.
            done = order if killed_in == "done" else order[: order.index(killed_in)]
            deadline = time.monotonic() + 30
            while True:
                seen = [line.split()[1] for line in node.log()] if (node.sys / LOG).exists() else []
                if seen == done and (killed_in == "done" or _pending(node, killed_in)):
                    break
                assert time.monotonic() < deadline, (seen, killed_in)
                time.sleep(0.005)
        finally:
            child.kill()
            child.wait()
        node.faults()
        back = rebind.restore(node.sys, node.vf, before, None, timeout=5.0)
        assert back == before or (back.driver, back.netdevs) == (before.driver, before.netdevs)
        assert rebind.override_of(node.sys, node.vf) is None
        time.sleep(0.5)  # a command the kernel still had in hand lands now: it must not undo the put-back
        assert rebind.binding_of(node.sys, node.vf).driver == "mlx5_core"
        assert rebind.override_of(node.sys, node.vf) is None
    assert not (node.dev / "vfio" / str(before.iommu_group)).exists()


LOG = ".simnode/kernel/log"
SRC = str(Path(__file__).resolve().parents[1] / "src")


def _pending(node: Node, op: str) -> bool:
    """Whether the command file of ``op`` holds a write the kernel has not answered yet."""
    dev = Path(os.path.realpath(node.sys / "bus/pci/devices" / node.vf))
    path = {
        "driver_override": dev / "driver_override",
        "unbind": node.sys / "bus/pci/drivers/mlx5_core/unbind",
        "drivers_probe": node.sys / "bus/pci/drivers_probe",
    }[op]
    text = path.read_text()
    return text == ("vfio-pci" if op == "driver_override" else node.vf)


def test_vfio_without_an_iommu_group_needs_no_iommu_mode(node: Node) -> None:
    dev = Path(os.path.realpath(node.sys / "bus/pci/devices" / node.vf))
    group = os.path.realpath(dev / "iommu_group")
    (dev / "iommu_group").unlink()
    shutil.rmtree(group)
    with pytest.raises(RebindError) as info:
        rebind.rebind(node.sys, node.vf, "vfio-pci", timeout=TIMEOUT, dev_root=node.dev)
    assert info.value.reason is Reason.GROUP and info.value.restored is None
    assert rebind.binding_of(node.sys, node.vf).driver == "mlx5_core"
    # vfio's enable_unsafe_noiommu_mode: the bind makes a vfio-noiommu group and its node.
    mode = node.sys / "module/vfio/parameters/enable_unsafe_noiommu_mode"
    mode.parent.mkdir(parents=True)
    mode.write_text("Y\n")
    after = rebind.rebind(node.sys, node.vf, "vfio-pci", timeout=TIMEOUT, dev_root=node.dev)
    assert after.driver == "vfio-pci" and after.iommu_group is not None
    assert (node.dev / "vfio" / f"noiommu-{after.iommu_group}").exists()
