"""Sysfs files that do not answer (issue 23, item 3): the scanner leaves their device out with one warning,
reads every other device, loses no further thread to a file still hung, and reads the device again once
its read has returned or its file was replaced.

A FIFO no one writes stands in for a hung driver's attribute: opening it blocks (fifo(7)) as a hung
``show()`` does, and nothing but a writer wakes the reader.  Each test opens its FIFOs for writing as it
ends, so no thread of the test process stays blocked.  Run under both implementations (the suite's
``DENSEDEV_NO_EXTENSIONS=1`` run covers the twin).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.interpreter import fresh_interpreter

from densedev.node import stuck
from densedev.node.scanner import Scanner
from densedev.testing import simnode

SCANNER_LOG = "densedev.node.scanner"


class Fifos:
    """FIFOs planted in place of sysfs files; ``release`` wakes every reader blocked in one."""

    def __init__(self) -> None:
        self.paths: list[Path] = []

    def plant(self, path: Path) -> Path:
        path.unlink()
        os.mkfifo(path)
        self.paths.append(path)
        return path

    def answer(self, path: Path, text: bytes = b"") -> None:
        """Open the FIFO for writing (the blocked open returns), write ``text`` and close (end of file)."""
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            return  # no reader (ENXIO): nothing blocked in it
        try:
            if text:
                os.write(fd, text)
        finally:
            os.close(fd)

    def release(self) -> None:
        for path in self.paths:
            if path.exists():
                self.answer(path)


@pytest.fixture
def fifos() -> Iterator[Fifos]:
    planted = Fifos()
    yield planted
    # A reader woken with an empty file may read it again (a VF with no usable uevent reads its own):
    # answer until none is left.
    for _ in range(100):
        planted.release()
        alive = _readers()
        if not alive:
            break
        for t in alive:
            t.join(0.1)


@pytest.fixture
def node(tmp_path: Path) -> tuple[Path, simnode.NodeLayout]:
    root = tmp_path / "sys"
    return root, simnode.build_node(root, pfs=2, vfs_per_pf=4, rdma=True)


def _readers() -> list[threading.Thread]:
    """The bounded calls' threads still alive (each blocked in a file, once its caller has returned)."""
    return [t for t in threading.enumerate() if t.name.startswith("densedev-dd-sysfs")]


def _dir(root: Path, address: str) -> Path:
    return (root / "bus/pci/devices" / address).resolve()


def test_a_pf_whose_file_does_not_answer_is_left_out_once_and_read_again_when_it_answers(
    node: tuple[Path, simnode.NodeLayout], fifos: Fifos, caplog: pytest.LogCaptureFixture
) -> None:
    root, layout = node
    full = Scanner(root).scan()
    pf = layout.pfs[1].address
    numvfs = _dir(root, pf) / "sriov_numvfs"
    numvfs_text = numvfs.read_bytes()
    fifos.plant(numvfs)
    scanner = Scanner(root)
    with caplog.at_level(logging.WARNING, logger=SCANNER_LOG):
        first = scanner.scan()
    # Every other device read, each as a scan of the whole node reads it (its VFs too: they do not read
    # their PF's sriov_numvfs).
    assert first.devices == tuple(d for d in full.devices if d.id != pf)
    assert len(caplog.records) == 1
    record = caplog.records[0]
    assert record.levelno == logging.WARNING and record.getMessage() == "sysfs read does not answer"
    assert pf in str(record.__dict__) and "sriov_numvfs" in str(record.__dict__)
    assert len(_readers()) == 1  # the one thread blocked in it

    # Still hung: left out again, without a new warning or another thread blocked in the same file.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=SCANNER_LOG):
        again = scanner.scan(first)
    assert again.devices == first.devices
    assert caplog.records == []
    assert len(_readers()) == 1

    # The driver answers: the blocked read returns, and the next scan reads the PF again.
    fifos.answer(numvfs, numvfs_text)
    for t in _readers():
        t.join(30)
    numvfs.unlink()
    numvfs.write_bytes(numvfs_text)
    assert scanner.scan(again).devices == full.devices


def test_a_vf0_uevent_that_does_not_answer_leaves_out_that_vf_alone(
    node: tuple[Path, simnode.NodeLayout], fifos: Fifos, caplog: pytest.LogCaptureFixture
) -> None:
    # VF 0's uevent is read for the ids all its siblings share: left out, VF 0 is not read for them
    # either, and they read their own.
    root, layout = node
    full = Scanner(root).scan()
    vf0 = layout.pfs[0].vf_addresses[0]
    fifos.plant(_dir(root, vf0) / "uevent")
    with caplog.at_level(logging.WARNING, logger=SCANNER_LOG):
        table = Scanner(root).scan()
    assert table.devices == tuple(d for d in full.devices if d.id != vf0)
    assert len(caplog.records) == 1 and vf0 in str(caplog.records[0].__dict__)


def test_a_pf_numa_node_that_does_not_answer_takes_its_vfs_along_and_no_more_threads(
    node: tuple[Path, simnode.NodeLayout], fifos: Fifos, caplog: pytest.LogCaptureFixture
) -> None:
    # Its VFs take their NUMA node from it: read without it, they block in its numa_node too.
    root, layout = node
    full = Scanner(root).scan()
    pf = layout.pfs[0]
    fifos.plant(_dir(root, pf.address) / "numa_node")
    scanner = Scanner(root)
    with caplog.at_level(logging.WARNING, logger=SCANNER_LOG):
        first = scanner.scan()
    gone = {pf.address, *pf.vf_addresses}
    assert first.devices == tuple(d for d in full.devices if d.id not in gone)
    assert len(caplog.records) == 1  # one warning, for the PF
    lost = len(_readers())
    assert lost == 2  # its own read, and its VFs' read through it
    assert scanner.scan(first).devices == first.devices
    assert len(_readers()) == lost  # the family is left out while the file is hung: no thread more


def test_a_hung_file_replaced_is_read_again(
    node: tuple[Path, simnode.NodeLayout], fifos: Fifos, tmp_path: Path
) -> None:
    root, layout = node
    full = Scanner(root).scan()
    pf = layout.pfs[1].address
    numvfs = _dir(root, pf) / "sriov_numvfs"
    text = numvfs.read_bytes()
    fifos.plant(numvfs)
    scanner = Scanner(root)
    assert pf not in scanner.scan().by_id()
    # The hung file renamed away (its reader still blocked in it) and a good one in its place.
    aside = tmp_path / "aside"
    numvfs.rename(aside)
    fifos.paths.append(aside)
    numvfs.write_bytes(text)
    assert scanner.scan().devices == full.devices


def test_rdma_ports_and_link_states_leave_out_what_does_not_answer(
    node: tuple[Path, simnode.NodeLayout], fifos: Fifos, caplog: pytest.LogCaptureFixture
) -> None:
    root, _ = node
    scanner = Scanner(root)
    table = scanner.scan()
    ibdevs = sorted({d.rdma_device for d in table.devices if d.rdma_device})
    ports = scanner.rdma_ports(ibdevs)
    hung_ib = ibdevs[0]
    fifos.plant((root / "class/infiniband" / hung_ib / "ports/1/state").resolve())
    names = sorted({n for d in table.devices for n in d.netdevs})
    links = scanner.operstates(names)
    fifos.plant((root / "class/net" / names[0] / "operstate").resolve())
    with caplog.at_level(logging.WARNING, logger=SCANNER_LOG):
        assert scanner.rdma_ports(ibdevs) == tuple(p for p in ports if p[0] != hung_ib)
        assert scanner.operstates(names) == [s for s in links if s[0] != names[0]]
        # Still hung: left out again, with no new warning and no new thread.
        threads = len(_readers())
        assert scanner.rdma_ports(ibdevs) == tuple(p for p in ports if p[0] != hung_ib)
        assert scanner.operstates(names) == [s for s in links if s[0] != names[0]]
        assert len(_readers()) == threads == 2
    said = [str(r.__dict__) for r in caplog.records]
    assert len(said) == 2
    assert hung_ib in said[0] and names[0] in said[1]


def test_a_call_that_raises_hands_its_exception_to_the_caller(tmp_path: Path) -> None:
    def fail() -> None:
        raise ValueError("no")

    with pytest.raises(ValueError, match="no"):
        stuck.call(fail, tmp_path, stuck.HungFiles())


def test_device_of_names_the_last_pci_function_in_a_path() -> None:
    path = "/sys/devices/pci0000:3a/0000:3a:00.0/0000:3b:00.1/mlx5_core.sf.2/sfnum"
    assert stuck.device_of(path) == "0000:3b:00.1"
    assert stuck.device_of("/sys/devices/virtual/net/lo/operstate") == ""
    assert (
        stuck.after("/sys/devices/x/0000:3b:00.0/infiniband/mlx5_0/ports/1/state", "infiniband") == "mlx5_0"
    )


# Reads one interface's operstate in a fresh interpreter and prints how much its peak RSS grew (KiB).
RSS = """
import resource, sys
from densedev.node.scanner import Scanner
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
states = Scanner(sys.argv[1]).operstates([sys.argv[2]])
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before, states)
"""


def test_an_operstate_read_is_bounded_by_a_page(
    node: tuple[Path, simnode.NodeLayout], tmp_path: Path
) -> None:
    """A 256 MiB operstate (sysfs hands out one page at most) took the RSS up by its size: read whole."""
    root, layout = node
    ifname = layout.pfs[0].netdev
    operstate = (root / "class/net" / ifname / "operstate").resolve()
    with open(operstate, "r+b") as f:
        f.write(b"up\n")
        f.truncate(256 << 20)  # sparse: no disk, but a reader of the whole file holds all of it
    grew_kib = int(fresh_interpreter(RSS, str(root), ifname).stdout.split()[0])
    assert grew_kib < 32 << 10, grew_kib  # KiB: a page read, not 256 MiB
