"""``densedev demo`` stopped the ways users stop it (Ctrl-C, SIGTERM, early or late) and run again on a
kept node: a summary, no traceback, nothing left behind."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

GUARD = 60.0  # hang guard only
OTHER = ["--pfs", "2", "--vfs-per-pf", "8"]
SMALL = ["--pfs", "4", "--vfs-per-pf", "16", "--flip-interval", "0.05"]


@pytest.fixture
def workdir() -> Iterator[Path]:
    """A short --workdir (its kubelet sockets must fit sun_path; tmp_path under xdist may not), on tmpfs
    when there is one, as the demo's own scratch dir is."""
    shm = Path("/dev/shm")
    path = Path(tempfile.mkdtemp(prefix="dd-", dir=shm if os.access(shm, os.W_OK) else "/tmp")) / "work"
    yield path
    shutil.rmtree(path.parent, ignore_errors=True)


@contextlib.contextmanager
def _started(args: list[str], env: dict[str, str], cwd: Path) -> Iterator[subprocess.Popen[str]]:
    """The demo as a child process, killed when the test leaves it running (a failed assert, a timeout)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "densedev.cli", "demo", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=cwd,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()  # a demo left building or running would load the machine for the rest of the suite
        proc.communicate()


def _read_until(proc: subprocess.Popen[str], prefix: str) -> list[str]:
    """Read stdout lines until one starts with ``prefix``; return them all (kill the demo on timeout)."""
    assert proc.stdout is not None
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in iter(proc.stdout.readline, ""):
            lines.put(line)
            if line.startswith(prefix):
                return
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    seen: list[str] = []
    try:
        while (line := lines.get(timeout=GUARD)) is not None:
            seen.append(line)
            if line.startswith(prefix):
                return seen
    except queue.Empty:
        pass
    proc.kill()
    proc.communicate()
    raise AssertionError(f"no line starting {prefix!r} in {seen}")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_ends_the_demo_with_its_summary_and_cleans_up(
    sig: signal.Signals, tmp_path: Path, child_env: dict[str, str]
) -> None:
    with _started(SMALL, child_env, tmp_path) as proc:
        head = "".join(_read_until(proc, "what the numbers mean"))
        work = Path(re.search(r"\((/[^)]+)\)", head).group(1))  # type: ignore[union-attr]
        assert (work / "kubelet" / "kubelet.sock").exists()
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=GUARD)
    assert proc.returncode == 0, err
    assert out.strip().splitlines()[-1].startswith("demo summary: 128 devices in 4 pools")
    assert "Traceback" not in err
    # SIGTERM's default action used to leave the whole tree (26 MB at 4,096 VFs) and the sockets behind.
    assert not work.exists()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stopping_while_the_node_is_built_leaves_nothing(
    sig: signal.Signals, tmp_path: Path, workdir: Path, child_env: dict[str, str]
) -> None:
    # Big enough that the build is still going when the signal lands (it is checked after every PF).
    with _started(
        ["--pfs", "16", "--vfs-per-pf", "128", "--workdir", str(workdir)], child_env, tmp_path
    ) as proc:
        _read_until(proc, "building the simulated node: 0%")
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=GUARD)
    assert proc.returncode == 130, out + err
    assert out.strip().splitlines()[-1] == "demo stopped while building the simulated node"
    assert err == ""  # gRPC's InvalidStateError traceback was here
    assert list(workdir.iterdir()) == []


def test_workdir_keeps_the_node_and_the_next_run_reuses_it(workdir: Path, child_env: dict[str, str]) -> None:
    runs = []
    for _ in range(2):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "densedev.cli",
                "demo",
                "--seconds",
                "0.5",
                "--workdir",
                str(workdir),
                *SMALL,
            ],
            capture_output=True,
            text=True,
            timeout=GUARD,
            env=child_env,
        )
        assert proc.returncode == 0, proc.stderr  # the second run used to stop on FileExistsError
        runs.append(proc.stdout)
    assert "building the simulated node" in runs[0] and "64 VFs built" in runs[0]
    assert "building the simulated node" not in runs[1] and "64 VFs reused" in runs[1]
    assert "demo summary: 128 devices" in runs[1]
    # Another shape rebuilds the kept node rather than reusing the wrong one.
    other = subprocess.run(
        [sys.executable, "-m", "densedev.cli", "demo", "--seconds", "0.5", "--workdir", str(workdir), *OTHER],
        capture_output=True,
        text=True,
        timeout=GUARD,
        env=child_env,
    )
    assert other.returncode == 0, other.stderr
    assert "2 PFs, 16 VFs built" in other.stdout
    assert not [p for p in workdir.iterdir() if p.name.startswith(".sys.partial")]


def test_the_demo_says_what_its_numbers_mean(tmp_path: Path, child_env: dict[str, str]) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "densedev.cli", "demo", "--seconds", "0.3", *SMALL],
        capture_output=True,
        text=True,
        timeout=GUARD,
        env=child_env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    legend = next(line for line in proc.stdout.splitlines() if line.startswith("what the numbers mean"))
    # 4 PFs x 16 VFs, plus the shared RDMA pool's 16 IDs per PF: 128 devices for 64 VFs.
    assert "128 devices = 64 VFs + 64 shared RDMA device IDs (4 PFs x 16 pods each)" in legend
    assert "healthy counts drift" in legend and "not the README's" in legend


# A workdir of 70 bytes: kubelet.sock fits, a pool's socket (30 bytes at least) does not; 100: neither.
@pytest.mark.parametrize("length", [70, 100])
def test_a_workdir_too_long_for_the_kubelet_sockets_is_one_line(
    length: int, sock_dir: Path, child_env: dict[str, str]
) -> None:
    # Its kubelet sockets go in <workdir>/kubelet, and sun_path holds 107 bytes: the demo used to wait
    # out 10 s for registrations that could never come and name only that (70), or end in gRPC's bind
    # traceback (100).
    workdir = sock_dir / ("w" * (length - len(str(sock_dir)) - 1))
    assert len(str(workdir)) == length
    proc = subprocess.run(
        [sys.executable, "-m", "densedev.cli", "demo", "--seconds", "0.3", "--workdir", str(workdir), *OTHER],
        capture_output=True,
        text=True,
        timeout=GUARD,
        env=child_env,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.splitlines() == [
        f"densedev demo: error: {workdir}/kubelet: a socket path there would exceed 107 bytes (sun_path); "
        "use a shorter --workdir"
    ]
    assert "simulated node" not in proc.stdout  # refused before building anything
