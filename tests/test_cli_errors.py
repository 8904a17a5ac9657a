"""Every command as a user runs it, with the mistakes users make: the real entry point in a subprocess,
one clear line on stderr, the right exit code, never a traceback."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

GUARD = 120.0  # hang guard only


def densedev(
    args: Sequence[str], env: dict[str, str], cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``densedev ARGS`` as a user would, to completion."""
    return subprocess.run(
        [sys.executable, "-m", "densedev.cli", *args],
        capture_output=True,
        text=True,
        timeout=GUARD,
        env=env,
        cwd=cwd,
    )


def one_line(stderr: str) -> str:
    """Return stderr's only line, failing when it has more (a traceback, a usage block)."""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--bogus"], "densedev: error: unrecognized arguments: --bogus"),
        (
            [],
            "densedev: error: a command is required: one of run, scan, check-config, simulate, simulate-kernel, "
            "demo, "
            "kubelet-emulator, dra-slices, dra-manifests, dra-check-params",
        ),
        (["run", "--metrics-addr", "bogus"], "argument --metrics-addr: metrics address 'bogus' has no port"),
        (["run", "--metrics-addr", ":99999"], "port 99999 is out of range 0-65535"),
        (["run", "--log-level", "bogus"], "argument --log-level: log level 'bogus' is not one of"),
        (["scan", "--log-level", "loud"], "argument --log-level: log level 'loud'"),
        (["simulate", "--out", "x", "--pfs", "-1"], "argument --pfs: -1 is below the minimum 0"),
        (["simulate", "--out", "x", "--vfs-per-pf", "many"], "argument --vfs-per-pf: 'many' is not a whole"),
        (["demo", "--seconds", "-1"], "argument --seconds: '-1' must be a finite number of seconds"),
        (["demo", "--flip-interval", "nan"], "argument --flip-interval: 'nan' must be a finite number"),
        (["scan", "--sysfs-root", "/nonexistent-root"], "argument --sysfs-root: /nonexistent-root does not"),
        (["run", "--sysfs-root", "/nonexistent-root"], "argument --sysfs-root: /nonexistent-root does not"),
        (
            ["kubelet-emulator", "d", "--allocate", "x=2"],
            "argument --allocate: 'x=2': expected RESOURCE=COUNT",
        ),
    ],
)
def test_a_bad_flag_is_one_line_and_exit_2(
    args: list[str], expected: str, tmp_path: Path, child_env: dict[str, str]
) -> None:
    proc = densedev(args, child_env, cwd=tmp_path)
    assert proc.returncode == 2
    assert expected in one_line(proc.stderr)
    assert not (tmp_path / "x").exists()


def test_scan_and_run_refuse_a_root_that_is_not_sysfs(tmp_path: Path, child_env: dict[str, str]) -> None:
    # An existing directory that is not a sysfs tree: before, scan printed "0 devices" and exited 0.
    (tmp_path / "etc").mkdir()
    for cmd in ("scan", "run"):
        proc = densedev([cmd, "--sysfs-root", str(tmp_path)], child_env)
        assert proc.returncode == 2, proc.stderr
        assert "is not a sysfs tree: it has no bus/pci/devices directory" in one_line(proc.stderr)
    # A node with no matching devices is fine: an empty PCI bus is still a sysfs tree.
    (tmp_path / "bus" / "pci" / "devices").mkdir(parents=True)
    proc = densedev(["scan", "--sysfs-root", str(tmp_path)], child_env)
    assert proc.returncode == 0, proc.stderr
    assert "0 devices" in proc.stdout


def test_a_root_that_is_a_symlink_loop_is_called_one(tmp_path: Path, child_env: dict[str, str]) -> None:
    # Path.exists() is False for a loop (ELOOP) as for a missing path: it was reported as "does not exist".
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    for cmd in ("scan", "run"):
        proc = densedev([cmd, "--sysfs-root", str(tmp_path / "a")], child_env)
        assert proc.returncode == 2, proc.stderr
        line = one_line(proc.stderr)
        assert f"argument --sysfs-root: {tmp_path / 'a'} is a symlink loop" in line
        assert "does not exist" not in line


def test_help_shows_descriptions_defaults_and_examples(child_env: dict[str, str]) -> None:
    top = densedev(["--help"], child_env)
    assert top.returncode == 0
    assert "``" not in top.stdout and "densedev demo --seconds 20" in top.stdout
    for cmd in ("run", "scan", "check-config", "simulate", "demo"):
        assert cmd in top.stdout
    run = densedev(["run", "--help"], child_env)
    assert "(default: the first of /etc/pcidp/config.json," in " ".join(run.stdout.split())
    assert "(default: None)" not in run.stdout  # no default: the help says what happens instead
    assert "example:" in run.stdout and "Run the device plugin daemon." in run.stdout
    sim = densedev(["simulate", "--help"], child_env)
    assert "(default: 256)" in sim.stdout and "--force" in sim.stdout


def test_simulate_refuses_to_overwrite_and_force_replaces(tmp_path: Path, child_env: dict[str, str]) -> None:
    out = tmp_path / "node"
    first = densedev(["simulate", "--out", str(out), "--pfs", "2", "--vfs-per-pf", "2"], child_env)
    assert first.returncode == 0, first.stderr
    # Twice: before, a FileExistsError traceback half-way through the tree.
    again = densedev(["simulate", "--out", str(out), "--pfs", "4", "--vfs-per-pf", "2"], child_env)
    assert again.returncode == 1
    assert one_line(again.stderr) == (
        f"densedev simulate: error: --out {out} already holds a simulated node; add --force to replace it"
    )
    forced = densedev(
        ["simulate", "--out", str(out), "--pfs", "4", "--vfs-per-pf", "2", "--force"], child_env
    )
    assert forced.returncode == 0, forced.stderr
    assert "4 PFs, 8 VFs" in forced.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["node"]  # no temp or old tree left beside it


@pytest.mark.parametrize("kind", ["file", "foreign-dir", "under-a-file"])
def test_simulate_never_writes_over_what_it_did_not_make(
    kind: str, tmp_path: Path, child_env: dict[str, str]
) -> None:
    target = tmp_path / "target"
    if kind == "file":
        target.write_text("mine")
        expected = f"--out {target} exists and is not a directory"
    elif kind == "foreign-dir":
        target.mkdir()
        (target / "keep.txt").write_text("mine")
        expected = f"--out {target} exists and is not a simulated node"
    else:
        (tmp_path / "file").write_text("mine")
        target = tmp_path / "file" / "node"
        expected = f"cannot write {target}: {target.parent} is not a directory"
    proc = densedev(
        ["simulate", "--out", str(target), "--force", "--pfs", "1", "--vfs-per-pf", "1"], child_env
    )
    assert proc.returncode == 1
    assert expected in one_line(proc.stderr)
    if kind == "foreign-dir":
        assert [p.name for p in target.iterdir()] == ["keep.txt"]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_simulate_leaves_no_partial_tree(
    sig: signal.Signals, tmp_path: Path, child_env: dict[str, str]
) -> None:
    out = tmp_path / "node"
    proc = subprocess.Popen(
        [sys.executable, "-m", "densedev.cli", "simulate", "--out", str(out), "--pfs", "40", "--rdma"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env,
    )
    try:
        assert proc.stderr is not None
        # The first progress line comes once the PFs exist and their 10,240 VFs are being written.
        assert proc.stderr.readline().startswith("building the simulated node: 0%")
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=GUARD)
    finally:
        if proc.poll() is None:  # a failed step above: no 10,240-VF build left running past the test
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130
    assert one_line(err) == "densedev simulate: error: interrupted"
    assert list(tmp_path.iterdir()) == []


def test_run_reports_a_busy_metrics_port_in_one_line(
    tmp_path: Path, child_env: dict[str, str], sock_dir: Path
) -> None:
    node = tmp_path / "node"
    assert (
        densedev(["simulate", "--out", str(node), "--pfs", "1", "--vfs-per-pf", "1"], child_env).returncode
        == 0
    )
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        args = ["run", "--config", str(node / "config.json"), "--sysfs-root", str(node), "--no-netlink"]
        args += ["--kubelet-dir", str(sock_dir), "--metrics-addr", f"127.0.0.1:{port}"]
        args += ["--devinfo-dir", "", "--log-level", "error"]
        proc = densedev(args, child_env)
    assert proc.returncode == 1
    line = one_line(proc.stderr)
    assert line.startswith("ts=") and "level=error" in line and "cannot start:" in line
    assert "address already in use" in line
    assert sorted(p.name for p in sock_dir.iterdir()) == []  # its sockets and lock are gone


def test_run_refuses_a_missing_kubelet_dir(tmp_path: Path, child_env: dict[str, str]) -> None:
    missing = tmp_path / "device-plugins"
    proc = densedev(["run", "--kubelet-dir", str(missing), "--log-level", "error"], child_env)
    assert proc.returncode == 2
    assert f"--kubelet-dir {missing} does not exist: the kubelet creates it" in one_line(proc.stderr)
    assert not missing.exists()


def test_bad_config_and_missing_files_are_one_line(tmp_path: Path, child_env: dict[str, str]) -> None:
    node = tmp_path / "node"
    assert (
        densedev(["simulate", "--out", str(node), "--pfs", "1", "--vfs-per-pf", "1"], child_env).returncode
        == 0
    )
    proc = densedev(["scan", "--sysfs-root", str(node), "--config", str(tmp_path / "none.json")], child_env)
    assert proc.returncode == 1
    assert "none.json" in one_line(proc.stderr)


def test_check_config_strict_turns_warnings_into_errors(tmp_path: Path, child_env: dict[str, str]) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text('{"resourceList": [{"resourceName": "sriov-net_0", "selectors": {"vendors": ["15B3"]}}]}')
    loose = densedev(["check-config", str(cfg)], child_env)
    assert loose.returncode == 0 and loose.stdout.rstrip().endswith("OK")
    assert loose.stdout.count(": warning: ") == 2
    strict = densedev(["check-config", "--strict", str(cfg)], child_env)
    assert strict.returncode == 1
    assert strict.stdout.count(": error: ") == 2 and "OK" not in strict.stdout
