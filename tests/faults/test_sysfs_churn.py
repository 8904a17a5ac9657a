"""Fault: sysfs churns under the scanner (issue 12, section 6).

VFs are destroyed and created (``sriov_numvfs`` 0 <-> n) and single functions vanish and come back
while scans run; attributes hold garbage; symlinks dangle and loop.  Both scanner implementations must
skip what they cannot read with a warning, never raise, agree with each other on a still tree, and the
daemon must keep serving the kubelet throughout and end with exactly the settled devices.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
from helpers.metrics import sample
from helpers.node import GUARD_S, Node, res

from densedev.daemon import Daemon
from densedev.model import Device
from densedev.testing.kubelet import HEALTHY, KubeletEmulator
from densedev.testing.simnode import build_node, set_num_vfs

pytestmark = pytest.mark.faults

_BDF = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")
SCANS = 40  # scans per implementation while the tree churns (a count, never a duration)


def _dev(root: Path, address: str) -> Path:
    return (root / "bus/pci/devices" / address).resolve()


def _check_rows(rows: tuple[tuple[object, ...], ...]) -> None:
    """Every row a whole, well-typed Device: a torn read must skip a device, never half-fill it."""
    ids = [r[0] for r in rows]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    for r in rows:
        d = Device(*r)
        assert _BDF.fullmatch(d.id), d.id
        assert d.role in ("pf", "vf", "pci", "sf")
        assert all(isinstance(x, str) and len(x) in (4, 6) for x in (d.vendor, d.device, d.pci_class))
        assert isinstance(d.numa_node, int) and isinstance(d.vf_index, int)


class Churn:
    """A thread that changes the tree until stopped, counting its rounds."""

    def __init__(self, step: Callable[[int], None]) -> None:
        self._step = step
        self._stop = threading.Event()
        self.rounds = 0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="sysfs-churn", daemon=True)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._step(self.rounds)
                self.rounds += 1
        except BaseException as e:  # surfaced by stop(): a broken churn must fail the test, not hide
            self.error = e

    def __enter__(self) -> Churn:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        if self.error is not None and exc[0] is None:
            raise self.error


def churn_step(root: Path, pfs: list[str], vanishing: list[str], vfs_per_pf: int) -> Callable[[int], None]:
    """Return one round of churn: a PF's VFs destroyed or created, and one VF moved away or back."""
    hidden = root / "hidden"
    hidden.mkdir(exist_ok=True)
    homes = {a: _dev(root, a) for a in vanishing}

    def step(i: int) -> None:
        pf = pfs[i % len(pfs)]
        numvfs = int((_dev(root, pf) / "sriov_numvfs").read_text())
        set_num_vfs(root, pf, 0 if numvfs else vfs_per_pf)
        # A function's directory disappears and reappears (hot-unplug, or the kernel's device_del
        # racing the scan) while its bus link stays: the scan finds a dangling link or a torn device.
        a = vanishing[i % len(vanishing)]
        if homes[a].exists():
            os.rename(homes[a], hidden / a)
        else:
            os.rename(hidden / a, homes[a])

    return step


def settle(root: Path, pfs: list[str], vanishing: list[str], vfs_per_pf: int) -> None:
    """Bring the churned tree back to its built state."""
    for a in vanishing:
        if (root / "hidden" / a).exists():
            os.rename(root / "hidden" / a, _home(root, a))
    for pf in pfs:
        if int((_dev(root, pf) / "sriov_numvfs").read_text()) == 0:
            set_num_vfs(root, pf, vfs_per_pf)


def _home(root: Path, address: str) -> Path:
    # The bus link still names where the function lived (it dangles while the directory is away).
    link = root / "bus/pci/devices" / address
    return (link.parent / os.readlink(link)).resolve()


def test_vfs_vanishing_during_scans_are_skipped_never_raised(impl: ModuleType, tmp_path: Path) -> None:
    vfs_per_pf = 16
    layout = build_node(tmp_path, pfs=4, vfs_per_pf=vfs_per_pf, rdma=True)
    raw = os.fsencode(tmp_path)
    settled = impl.scan_sysfs(raw, None)
    assert settled[1] == ()
    churned_pfs = [layout.pfs[0].address, layout.pfs[1].address]
    vanishing = [*layout.pfs[2].vf_addresses[:4], layout.pfs[3].address]
    stable = set(layout.pfs[2].vf_addresses[4:])
    with Churn(churn_step(tmp_path, churned_pfs, vanishing, vfs_per_pf)) as churn:
        for i in range(SCANS):
            # The extension both with its helper threads and without; the twin reads on one thread.
            rows, warnings = impl.scan_sysfs(raw, None, i % 2 == 0)
            _check_rows(rows)
            assert stable <= {r[0] for r in rows}  # what nobody touched is always found
            assert all(isinstance(w, str) and w for w in warnings)
            # Partial rescans of churning addresses, as the uevent path does them.
            part = tuple(os.fsencode(a) for a in (*vanishing, *layout.pfs[0].vf_addresses[:4]))
            rows, warnings = impl.scan_sysfs(raw, part)
            _check_rows(rows)
    assert churn.rounds > 0
    settle(tmp_path, churned_pfs, vanishing, vfs_per_pf)
    # The settled tree gives every device back in its place (recreated VFs get new interface names).
    rows, warnings = impl.scan_sysfs(raw, None)
    assert warnings == ()
    assert [r[:2] + r[14:16] for r in rows] == [r[:2] + r[14:16] for r in settled[0]]


GARBAGE = [b"", b"\n", b"banana\n", b"-\n", b"99999999999999999999\n", b"\x00\xff\xfe", b"1 2\n", b"0x1\n"]


@pytest.mark.parametrize("junk", GARBAGE)
def test_garbage_in_numa_node_and_sriov_numvfs(
    both: tuple[ModuleType, ModuleType], tmp_path: Path, junk: bytes
) -> None:
    fast, twin = both
    layout = build_node(tmp_path, pfs=2, vfs_per_pf=4)
    pf0, pf1 = layout.pfs
    (_dev(tmp_path, pf0.address) / "numa_node").write_bytes(junk)
    (_dev(tmp_path, pf1.address) / "sriov_numvfs").write_bytes(junk)
    raw = os.fsencode(tmp_path)
    result = twin.scan_sysfs(raw, None)
    assert fast.scan_sysfs(raw, None) == result == fast.scan_sysfs(raw, None, False)
    rows, warnings = result
    _check_rows(rows)
    by_id = {r[0]: Device(*r) for r in rows}
    # Nothing is lost: the PF stays (its field emptied), its VFs are found by their links.
    assert set(pf0.vf_addresses) | set(pf1.vf_addresses) | {pf0.address, pf1.address} <= set(by_id)
    assert {by_id[a].numa_node for a in (pf0.address, *pf0.vf_addresses)} == {-1}
    assert by_id[pf1.address].num_vfs == 0 and by_id[pf1.address].role == "pf"
    assert [by_id[a].vf_index for a in pf1.vf_addresses] == [0, 1, 2, 3]
    assert len(warnings) == 2, warnings
    assert any(w.startswith(pf0.address + ": numa_node") for w in warnings)
    assert any(w.startswith(pf1.address + ": sriov_numvfs") for w in warnings)


def _relink(path: Path, target: str) -> None:
    if path.is_symlink() or path.exists():
        path.unlink()
    os.symlink(target, path)


def test_broken_and_looping_links(both: tuple[ModuleType, ModuleType], tmp_path: Path) -> None:
    fast, twin = both
    layout = build_node(tmp_path, pfs=2, vfs_per_pf=6, rdma=True)
    pf0, pf1 = layout.pfs
    v = pf0.vf_addresses
    bus = tmp_path / "bus/pci/devices"
    d3, d4, dp1 = _dev(tmp_path, v[3]), _dev(tmp_path, v[4]), _dev(tmp_path, pf1.address)
    d5 = _dev(tmp_path, pf1.vf_addresses[3])
    # Looping bus links: to itself, and two links pointing at each other.  The VFs' directories are
    # still there, beside their PF's, where the scan reads a PF's VFs: they are found all the same.
    _relink(bus / v[0], v[0])
    _relink(bus / v[1], "loop-b")
    _relink(bus / "loop-b", v[1])
    # A dangling bus link: the function's directory is gone (hot-unplug between listing and reading).
    shutil.rmtree(_dev(tmp_path, v[2]))
    # A PF whose own bus link loops: it cannot be read at all; its VFs are read through their links.
    _relink(bus / pf1.address, pf1.address)
    # A VF's physfn, driver and iommu_group links loop on themselves.
    _relink(d3 / "physfn", "physfn")
    _relink(d3 / "iommu_group", "iommu_group")
    _relink(d4 / "driver", "driver")
    # A PF's virtfn link loops, another dangles.
    _relink(dp1 / "virtfn0", "virtfn0")
    _relink(dp1 / "virtfn1", "../0000:ff:1f.7")
    # Class links (netdev, RDMA) that loop or dangle, and a driver directory entry that loops.
    netdev = pf1.vf_netdevs[2]
    _relink(tmp_path / "class/net" / netdev, netdev)
    verbs = sorted(os.listdir(tmp_path / "class/infiniband_verbs"))[0]
    _relink(tmp_path / "class/infiniband_verbs" / verbs, "../../nowhere/" + verbs)
    drivers = tmp_path / "bus/pci/drivers"
    driver = sorted(os.listdir(drivers))[0]
    _relink(drivers / driver / v[5], v[5])
    # A directory loop inside a function (net/ -> itself).
    os.symlink(".", d5 / "loopdir")

    raw = os.fsencode(tmp_path)
    result = twin.scan_sysfs(raw, None)
    assert fast.scan_sysfs(raw, None) == result == fast.scan_sysfs(raw, None, False)
    rows, warnings = result
    _check_rows(rows)
    found = {r[0]: Device(*r) for r in rows}
    # What cannot be read is skipped, each with one warning naming it and why.
    assert sorted(warnings) == sorted(
        [
            f"{pf1.address}: skipped: Too many levels of symbolic links",
            "loop-b: skipped: Too many levels of symbolic links",
            f"{v[2]}: skipped: No such file or directory",
            f"{v[3]}: iommu_group: not a group number",
        ]
    )
    assert pf1.address not in found and v[2] not in found
    # Everything else is found, with the broken facts left empty rather than made up.
    assert {pf0.address, v[0], v[1], v[3], v[4], v[5], *pf1.vf_addresses} <= set(found)
    assert found[v[3]].iommu_group == -1
    assert found[v[4]].driver == found[v[5]].driver == found[v[0]].driver != ""
    assert all(found[a].pf == pf1.address for a in pf1.vf_addresses)
    assert found[pf1.vf_addresses[2]].netdevs == ()
    # Partial scans of the same addresses agree and do not raise either.
    part = tuple(os.fsencode(a) for a in (*v, *pf1.vf_addresses, "loop-b"))
    assert fast.scan_sysfs(raw, part) == twin.scan_sysfs(raw, part)


@pytest.fixture
def warnings_captured(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    """Capture densedev's warnings from before the daemon starts."""
    caplog.set_level(logging.WARNING, logger="densedev")
    return caplog


async def test_daemon_keeps_serving_while_sysfs_churns(
    node: Node, warnings_captured: pytest.LogCaptureFixture, kubelet: KubeletEmulator, daemon: Daemon
) -> None:
    caplog = warnings_captured
    emu = kubelet
    pfs = node.layout.pfs
    churned = [pfs[2].address, pfs[3].address]  # the "other_vfs" pool's PFs
    vanishing = [pfs[0].vf_addresses[7]]
    steady = res(f"sriov_{pfs[1].netdev}")
    other = res("other_vfs")
    tasks = list(daemon._tasks)
    allocations = 0
    with Churn(churn_step(node.sysfs, churned, vanishing, 8)) as churn:
        # Garbage and loops planted mid-run, on top of the churn.
        (_dev(node.sysfs, pfs[1].address) / "numa_node").write_bytes(b"banana\n")
        _relink(node.sysfs / "bus/pci/devices" / pfs[0].vf_addresses[6], pfs[0].vf_addresses[6])
        for i in range(30):
            daemon.request_rescan(None if i % 3 == 0 else churned[i % 2])
            await asyncio.sleep(0.02)
            # The kubelet keeps getting answers from an untouched pool throughout.
            await emu.allocate(steady, [pfs[1].vf_addresses[i % 8]])
            allocations += 1
    assert churn.rounds > 0 and allocations == 30
    settle(node.sysfs, churned, vanishing, 8)
    os.unlink(node.sysfs / "bus/pci/devices" / pfs[0].vf_addresses[6])
    os.symlink(
        os.path.relpath(_home_of(node, pfs[0].vf_addresses[6]), node.sysfs / "bus/pci/devices"),
        node.sysfs / "bus/pci/devices" / pfs[0].vf_addresses[6],
    )
    scans = sample(daemon, "densedev_scans_total")
    daemon.request_rescan()
    want_other = {a for pf in pfs[2:] for a in pf.vf_addresses}
    want_first = set(pfs[0].vf_addresses)
    await emu.wait_for(
        lambda: (
            sample(daemon, "densedev_scans_total") > scans
            and set(emu.devices(other)) == want_other
            and set(emu.devices(res(f"sriov_{pfs[0].netdev}"))) == want_first
        ),
        GUARD_S,
    )
    assert set(emu.devices(other).values()) == {HEALTHY}
    assert set(emu.devices(steady)) == set(pfs[1].vf_addresses)
    # Every daemon task is still running; nothing failed on the way.
    assert all(not t.done() for t in tasks)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [
        r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR
    ]
    assert any("scan skipped or degraded entries" in r.getMessage() for r in caplog.records)


def _home_of(node: Node, address: str) -> Path:
    """Where a function's directory lives (its PF's parent: VFs are siblings of their PF)."""
    for pf in node.layout.pfs:
        if address in pf.vf_addresses:
            return _dev(node.sysfs, pf.address).parent / address
    raise KeyError(address)
