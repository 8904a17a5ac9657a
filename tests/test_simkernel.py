"""The simulated kernel answers rebinding writes as the PCI driver core does, in a thread or a process."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from densedev import accel
from densedev.node import rebind
from densedev.node.events import NETLINK_KOBJECT_UEVENT, open_netlink_socket, resolve_netns
from densedev.testing import netns, simnode
from densedev.testing.simkernel import FaultRule, SimKernel, write_faults

GUARD = 30.0  # hang guard only


def ask(path: Path, text: str) -> str:
    """Write a command as a process would and return the kernel's answer (the file once it changed)."""
    with open(path, "w") as f:
        f.write(text)
    deadline = time.monotonic() + GUARD
    while path.read_text() == text:
        assert time.monotonic() < deadline, f"no answer to {text!r} in {path}"
        time.sleep(0.001)
    return path.read_text()


class Tree:
    """A two-PF simulated node."""

    def __init__(self, tmp: Path) -> None:
        self.sys = tmp / "sys"
        self.dev = tmp / "dev"
        self.layout = simnode.build_node(self.sys, pfs=2, vfs_per_pf=3)
        self.vf = self.layout.pfs[0].vf_addresses[0]
        self.ifname = self.layout.pfs[0].vf_netdevs[0]
        self.dir = Path(os.path.realpath(self.sys / "bus/pci/devices" / self.vf))
        self.probe = self.sys / "bus/pci/drivers_probe"

    def drv(self, name: str, attr: str) -> Path:
        return self.sys / "bus/pci/drivers" / name / attr

    def driver(self) -> str | None:
        return rebind.binding_of(self.sys, self.vf).driver


@pytest.fixture
def tree(tmp_path: Path) -> Iterator[Tree]:
    t = Tree(tmp_path)
    with SimKernel(t.sys, t.dev):
        yield t


def test_simnode_writes_the_rebinding_files(tmp_path: Path) -> None:
    t = Tree(tmp_path)
    assert (t.dir / "driver_override").read_text() == "(null)\n"
    assert t.probe.read_text() == ""
    assert t.drv("vfio-pci", "bind").exists() and t.drv("vfio-pci", "unbind").exists()
    assert (t.sys / "class/net" / t.ifname / "flags").read_text() == "0x1003\n"
    simnode.set_link(t.sys, t.ifname, up=False)
    assert (t.sys / "class/net" / t.ifname / "flags").read_text() == "0x1002\n"


def test_driver_override_is_shown_as_the_kernel_shows_it(tree: Tree) -> None:
    override = tree.dir / "driver_override"
    assert ask(override, "vfio-pci") == "vfio-pci\n"
    assert ask(override, "\n") == "(null)\n"
    assert rebind.override_of(tree.sys, tree.vf) is None
    # driver_set_override(): a value of a page or more is refused (EINVAL), the old one stays.
    assert ask(override, "x" * 5000) == "!22\n"
    assert ask(override, "mlx5_core") == "mlx5_core\n"
    assert rebind.override_of(tree.sys, tree.vf) == "mlx5_core"


def test_unbind_and_bind_answer_with_the_driver_cores_errnos(tree: Tree) -> None:
    # unbind_store(): ENODEV unless that driver holds the device.
    assert ask(tree.drv("vfio-pci", "unbind"), tree.vf) == "!19\n"
    assert tree.driver() == "mlx5_core"
    # bind_store() on a bound device: EBUSY.
    assert ask(tree.drv("mlx5_core", "bind"), tree.vf) == "!16\n"
    assert ask(tree.drv("mlx5_core", "unbind"), tree.vf) == ""
    assert tree.driver() is None and not (tree.sys / "class/net" / tree.ifname).exists()
    assert not (tree.dir / "net").exists()
    # vfio-pci has no ID table: without an override it does not match.
    assert ask(tree.drv("vfio-pci", "bind"), tree.vf) == "!19\n"
    # An unknown address: ENODEV.
    assert ask(tree.drv("mlx5_core", "bind"), "0000:ff:00.0") == "!19\n"
    assert ask(tree.drv("mlx5_core", "bind"), tree.vf) == ""
    assert tree.driver() == "mlx5_core" and (tree.sys / "class/net" / tree.ifname).is_symlink()


def test_drivers_probe_matches_by_id_table_or_override(tree: Tree) -> None:
    assert ask(tree.drv("mlx5_core", "unbind"), tree.vf) == ""
    # No override: the driver whose ID table has 15b3:101e.
    assert ask(tree.probe, tree.vf) == ""
    assert tree.driver() == "mlx5_core"
    assert ask(tree.drv("mlx5_core", "unbind"), tree.vf) == ""
    # An override naming a driver that is not loaded: the write succeeds, nothing binds.
    assert ask(tree.dir / "driver_override", "igb_uio") == "igb_uio\n"
    assert ask(tree.probe, tree.vf) == ""
    assert tree.driver() is None
    assert ask(tree.dir / "driver_override", "vfio-pci") == "vfio-pci\n"
    assert ask(tree.probe, tree.vf) == ""
    assert tree.driver() == "vfio-pci"
    group = rebind.binding_of(tree.sys, tree.vf).iommu_group
    assert (tree.dev / "vfio" / str(group)).exists()
    # An already bound device: drivers_probe does nothing and succeeds.
    assert ask(tree.probe, tree.vf) == ""
    assert ask(tree.drv("vfio-pci", "unbind"), tree.vf) == ""
    assert not (tree.dev / "vfio" / str(group)).exists()
    log = (tree.sys / ".simnode/kernel/log").read_text().splitlines()
    assert any("drivers_probe" in line and "no driver matched" in line for line in log)
    assert all(line.split()[1] in {"driver_override", "unbind", "bind", "drivers_probe"} for line in log)


def test_faults_are_read_live_and_counted(tree: Tree) -> None:
    write_faults(tree.sys, [FaultRule(op="unbind", pci=tree.vf, errno=5, times=1)])
    assert ask(tree.drv("mlx5_core", "unbind"), tree.vf) == "!5\n"
    assert tree.driver() == "mlx5_core"  # refused: nothing changed
    assert ask(tree.drv("mlx5_core", "unbind"), tree.vf) == ""  # the rule fired its one time
    write_faults(tree.sys, [FaultRule(op="bind", driver="mlx5_core", delay_ms=150)])
    t0 = time.monotonic()
    assert ask(tree.drv("mlx5_core", "bind"), tree.vf) == ""
    assert time.monotonic() - t0 >= 0.15
    write_faults(tree.sys, [FaultRule(op="bind", probe_fails=True)])
    assert ask(tree.drv("mlx5_core", "unbind"), tree.vf) == ""
    assert ask(tree.drv("mlx5_core", "bind"), tree.vf) == "!6\n"  # the probe's error (ENXIO)
    assert tree.driver() is None


def test_new_vfs_are_answered_too(tree: Tree) -> None:
    pf = tree.layout.pfs[1].address
    simnode.set_num_vfs(tree.sys, pf, 0)
    (vf,) = simnode.set_num_vfs(tree.sys, pf, 1)
    deadline = time.monotonic() + GUARD
    while True:  # the kernel adds its watch when the bus link appears
        try:
            b = rebind.rebind(tree.sys, vf, "vfio-pci", timeout=0.5, dev_root=tree.dev)
            break
        except rebind.RebindError:
            assert time.monotonic() < deadline
    assert b.driver == "vfio-pci"


def test_the_kernel_as_a_process(tmp_path: Path) -> None:
    t = Tree(tmp_path)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "densedev.cli",
            "simulate-kernel",
            "--sysfs-root",
            str(t.sys),
            "--dev-root",
            str(t.dev),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("simulate-kernel: answering rebinds of"), line
        assert (t.sys / ".simnode/kernel/ready").read_text() == f"{proc.pid}\n"
        b = rebind.rebind(t.sys, t.vf, "vfio-pci", timeout=5.0, dev_root=t.dev)
        assert b.driver == "vfio-pci" and (t.dev / "vfio" / str(b.iommu_group)).exists()
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=GUARD)
    assert proc.returncode == 0, err
    assert not (t.sys / ".simnode/kernel/ready").exists()


def test_the_command_refuses_a_tree_that_is_not_simulated(tmp_path: Path) -> None:
    (tmp_path / "sys/bus/pci/devices").mkdir(parents=True)
    out = subprocess.run(
        [sys.executable, "-m", "densedev.cli", "simulate-kernel", "--sysfs-root", str(tmp_path / "sys"),
         "--dev-root", str(tmp_path / "dev")],
        capture_output=True, text=True, timeout=GUARD,
    )  # fmt: skip
    assert out.returncode == 1
    why = "is not a simulated node (no .simnode/; see densedev simulate)"
    assert out.stderr.strip().splitlines() == [f"densedev simulate-kernel: error: {tmp_path / 'sys'} {why}"]


@pytest.mark.skipif(netns.available() is not None, reason=str(netns.available()))
def test_uevents_are_sent_as_the_kernel_sends_them(tmp_path: Path) -> None:
    t = Tree(tmp_path)
    with netns.namespace() as ns:
        listener = open_netlink_socket(NETLINK_KOBJECT_UEVENT, 1, resolve_netns(ns))
        try:
            with SimKernel(t.sys, t.dev, uevent_netns=ns):
                before = rebind.binding_of(t.sys, t.vf)
                rebind.rebind(t.sys, t.vf, "vfio-pci", timeout=5.0, dev_root=t.dev)
                rebind.restore(t.sys, t.vf, before, None, timeout=5.0)
            events = []
            while len(events) < 6:
                assert select.select([listener], [], [], GUARD)[0], events
                parsed = accel.parse_uevent(listener.recv(65536))
                assert parsed is not None
                events.append(parsed)
        finally:
            listener.close()
    devpath = "/" + os.path.relpath(t.dir, t.sys)
    netpath = f"{devpath}/net/{t.ifname}"
    # Unbinding mlx5_core: its remove() unregisters the netdev, then KOBJ_UNBIND; binding vfio-pci:
    # KOBJ_BIND; back: vfio-pci's unbind, mlx5_core's probe() registering the netdev, KOBJ_BIND.
    assert [(action, path) for action, path, _ in events] == [
        ("remove", netpath),
        ("unbind", devpath),
        ("bind", devpath),
        ("unbind", devpath),
        ("add", netpath),
        ("bind", devpath),
    ]
    pairs = [dict(p) for _, _, p in events]
    assert pairs[2]["DRIVER"] == "vfio-pci" and pairs[5]["DRIVER"] == "mlx5_core"
    assert pairs[0]["INTERFACE"] == t.ifname and pairs[0]["SUBSYSTEM"] == "net"
    assert [int(p["SEQNUM"]) for p in pairs] == sorted(int(p["SEQNUM"]) for p in pairs)
    assert all(p["PCI_SLOT_NAME"] == t.vf for p in pairs if p["SUBSYSTEM"] == "pci")


def test_lost_events_are_made_up_by_reading_every_command_file(tmp_path: Path) -> None:
    # An inotify queue overflow loses the events that told of writes: the kernel then reads every
    # command file, takes the unanswered ones and leaves the values it shows alone.
    t = Tree(tmp_path)
    kernel = SimKernel(t.sys, t.dev)
    kernel.prepare()
    (t.dir / "driver_override").write_text("vfio-pci")
    os.read(kernel._fd, 1 << 16)  # the event is gone, as after IN_Q_OVERFLOW
    kernel._resync()
    with kernel:
        deadline = time.monotonic() + GUARD
        while (t.dir / "driver_override").read_text() != "vfio-pci\n":
            assert time.monotonic() < deadline
            time.sleep(0.001)
    log = (t.sys / ".simnode/kernel/log").read_text().splitlines()
    assert len(log) == 1 and log[0].split()[1:3] == ["driver_override", f"pci={t.vf}"]
    other = t.layout.pfs[1].vf_addresses[0]
    assert rebind.override_of(t.sys, other) is None
