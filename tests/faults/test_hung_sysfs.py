"""``densedev run`` on a node where a sysfs file does not answer (issue 23, item 3), with real processes and
real signals.

A FIFO no one writes stands in for a hung driver's attribute (opening it blocks, as a hung ``show()``
does).  Before: the scanning child blocked for its 30 s timeout, then the daemon read the same file on
its event loop's thread and blocked for good: nothing served, SIGTERM ignored, and a SIGKILLed daemon
left the child behind.  Now the device is left out with one warning and every other one served, SIGTERM
ends the start whatever it waits for, and the child dies with the daemon.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers.child import run_args

from densedev.testing import simnode

GUARD = 60.0  # hang guard only


class Run:
    """``densedev run`` in a child process; its stderr lines collected by a thread as they come."""

    def __init__(self, node: Path, kdir: Path, env: dict[str, str], *extra: str) -> None:
        args = ["run", *run_args(node, kdir, *extra, log_level="debug")]
        # A session of its own: ``kill`` ends the daemon and whatever it forked (a child left blocked
        # holds the stderr pipe open, and the reading thread with it).
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "densedev", *args],
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self._q: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._q.put(line.rstrip("\n"))
        self._q.put("")  # end of file

    def line_with(self, text: str) -> str:
        """Wait for a stderr line containing ``text``."""
        deadline = time.monotonic() + GUARD
        for line in self.lines:
            if text in line:
                return line
        while time.monotonic() < deadline:
            try:
                line = self._q.get(timeout=0.1)
            except queue.Empty:
                continue
            self.lines.append(line)
            if text in line:
                return line
        raise AssertionError(f"no line with {text!r} in {self.lines[-20:]}")

    def scanning_child(self) -> int:
        """The pid of the child reading the first scan (forked as the command starts)."""
        deadline = time.monotonic() + GUARD
        while time.monotonic() < deadline:
            for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
                children = (task / "children").read_text().split()
                if children:
                    return int(children[0])
            time.sleep(0.01)
        raise AssertionError("no scanning child")

    def signal_and_wait(self, sig: int) -> int:
        """Send ``sig`` and return the exit status once the process has ended (-signal if it killed it)."""
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=GUARD)
        finally:
            self.kill()

    def kill(self) -> None:
        """SIGKILL whatever of its session is left, and take the rest of its lines (idempotent)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        assert self.proc.stderr is not None
        if self.proc.stderr.closed:
            return
        while True:
            try:
                line = self._q.get(timeout=GUARD)
            except queue.Empty:
                break
            if not line:
                break
            self.lines.append(line)
        self.proc.stderr.close()


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie is dead: it only waits for its parent to reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


@pytest.fixture
def kdir() -> Iterator[Path]:
    """A short kubelet directory for unix sockets (sun_path holds 108 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="dd-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


class Hung:
    """A simulated node (2 PFs x 4 VFs, RDMA, its config) with FIFOs planted in place of sysfs files."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.layout = simnode.simulate(root, pfs=2, vfs_per_pf=4, rdma=True)
        self.fifos: list[Path] = []

    def dir(self, address: str) -> Path:
        return (self.root / "bus/pci/devices" / address).resolve()

    def plant(self, address: str, name: str) -> Path:
        path = self.dir(address) / name
        path.unlink()
        os.mkfifo(path)
        self.fifos.append(path)
        return path

    def devices(self) -> int:
        return sum(1 for _ in (self.root / "bus/pci/devices").iterdir())

    def release(self) -> None:
        """Wake any reader still blocked in a FIFO (a child not killed yet), so no process is left."""
        for path in self.fifos:
            with contextlib.suppress(OSError):  # ENXIO: no reader left
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


@pytest.fixture
def hung(tmp_path: Path) -> Iterator[Hung]:
    node = Hung(tmp_path / "node")
    yield node
    node.release()


@pytest.fixture
def runs(kdir: Path, child_env: dict[str, str]) -> Iterator[Callable[..., Run]]:
    """Start ``densedev run`` on a node; every run is killed (with its session) as the test ends."""
    started: list[Run] = []

    def start(node: Path, *extra: str) -> Run:
        started.append(Run(node, kdir, child_env, *extra))
        return started[-1]

    yield start
    for run in started:
        run.kill()


def _warned(run: Run, device: str) -> list[str]:
    return [line for line in run.lines if "sysfs read does not answer" in line and f"device={device}" in line]


@pytest.mark.parametrize("where", ["vf0-uevent", "pf-sriov_numvfs"])
def test_run_serves_every_device_but_one_whose_file_does_not_answer(
    hung: Hung, runs: Callable[..., Run], where: str
) -> None:
    pf = hung.layout.pfs[1]
    device, name = (pf.vf_addresses[0], "uevent") if where == "vf0-uevent" else (pf.address, "sriov_numvfs")
    hung.plant(device, name)
    run = runs(hung.root)
    try:
        started = run.line_with("daemon started")
    finally:
        code = run.signal_and_wait(signal.SIGTERM)
    assert f"devices={hung.devices() - 1}" in started
    # The pools of the other PF are whole: the config selects each PF's VFs by its netdev.
    other = hung.layout.pfs[0]
    sizes = dict(pair.split("=") for pair in re.search(r'sizes="([^"]*)"', started)[1].split(","))  # type: ignore[index]
    assert len(other.vf_addresses) in map(int, sizes.values())
    assert len(_warned(run, device)) == 1, run.lines
    assert code == 0, run.lines[-10:]


@pytest.mark.parametrize("phase", ["waiting-for-the-child", "scanning-in-a-thread", "rest-of-the-start"])
def test_sigterm_ends_the_start_in_every_phase(
    hung: Hung, runs: Callable[..., Run], kdir: Path, phase: str
) -> None:
    """Each phase is reached on its own log line, and SIGTERM sent there: the daemon stops, exit 0.

    The last phase waits on a PodResources socket that takes connections and never answers (its
    client's deadline holds the start ~2 s after the scan)."""
    pf = hung.layout.pfs[1]
    hung.plant(pf.vf_addresses[0], "uevent")
    hung.plant(pf.address, "sriov_numvfs")
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.bind(str(kdir / "pr.sock"))
    silent.listen(16)
    try:
        run = runs(hung.root, "--pod-resources-socket", str(kdir / "pr.sock"))
        child = run.scanning_child()
        trigger = {
            "waiting-for-the-child": "scan ahead: waiting for child",
            "scanning-in-a-thread": "scanning in the daemon instead",
            # the daemon's scan is done (both devices left out): the PodResources read comes next
            "rest-of-the-start": f"scan: {hung.devices() - 2} devices in",
        }[phase]
        run.line_with(trigger)
        code = run.signal_and_wait(signal.SIGTERM)
    finally:
        silent.close()
    assert code == 0, run.lines[-10:]
    assert any("stopped while starting" in line for line in run.lines), run.lines[-10:]
    assert not any("daemon started" in line for line in run.lines)
    assert not _alive(child)


def test_the_scanning_child_dies_with_a_killed_daemon(hung: Hung, runs: Callable[..., Run]) -> None:
    """SIGKILL the daemon while its child is blocked in a file: the kernel kills the child too
    (PR_SET_PDEATHSIG), where before it stayed blocked, reparented, for as long as the file did."""
    hung.plant(hung.layout.pfs[0].address, "numa_node")
    run = runs(hung.root)
    child = run.scanning_child()
    assert _alive(child)
    run.proc.kill()  # the daemon alone, not its session
    assert run.proc.wait(timeout=GUARD) == -signal.SIGKILL
    deadline = time.monotonic() + GUARD
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        assert not _alive(child)
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)
