"""The daemon's first minutes on a misconfigured node: it says what it waits for, refuses to share a
kubelet directory, retries pools that could not start, and says why on /readyz and in its exit code."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.child import Child, run_args

from densedev.daemon import Daemon, DaemonSettings
from densedev.kubelet.sockets import socket_name_for
from densedev.ops.preflight import LOCK_NAME
from densedev.pools import config as config_mod
from densedev.testing import simnode
from densedev.testing.kubelet import KubeletEmulator

GUARD = 60.0  # hang guard only


@pytest.fixture
def kdir() -> Iterator[Path]:
    """A short kubelet directory for unix sockets (sun_path holds 108 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="dd-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def node(tmp_path: Path) -> Path:
    """A small simulated node with its config (3 pools)."""
    simnode.simulate(tmp_path / "node", pfs=2, vfs_per_pf=4, rdma=True)
    return tmp_path / "node"


async def test_the_first_scan_is_read_by_a_child_process_that_is_gone_after(
    node: Path, kdir: Path, child_env: dict[str, str]
) -> None:
    """``densedev run`` forks its first scan (node.ahead) and reaps the child once it has the table."""
    child = Child(run_args(node, kdir, "--log-level", "debug"), child_env)
    try:
        took = await child.line_with("scan ahead: took child")
        started = await child.line_with("daemon started")
        children = Path(f"/proc/{child.proc.pid}/task/{child.proc.pid}/children").read_text().split()
    finally:
        assert child.stop() == 0
    devices = sum(1 for p in (node / "bus/pci/devices").iterdir())
    assert f"scan of {devices} devices" in took
    assert f"devices={devices}" in started
    assert children == []  # the scanning child reaped: no zombie beside the daemon


async def test_waits_aloud_for_the_kubelet_and_refuses_a_second_daemon(
    node: Path, kdir: Path, child_env: dict[str, str]
) -> None:
    child_env = dict(child_env)
    child_env.pop("GRPC_VERBOSITY", None)  # the daemon's own default must keep gRPC core quiet
    pools = {p.full_name for p in config_mod.load(node / "config.json").pools}

    first = Child(run_args(node, kdir), child_env)
    try:
        # Before, nothing was logged at any level while kubelet.sock was missing.
        await first.line_with(f"waiting for {kdir}/kubelet.sock")
        assert (kdir / LOCK_NAME).read_text().strip() == str(first.proc.pid)
        # Two daemons on one directory replaced each other's sockets every ~2 s without a word.
        second = subprocess.run(
            [sys.executable, "-m", "densedev.cli", "run", *run_args(node, kdir)],
            capture_output=True,
            text=True,
            timeout=GUARD,
            env=child_env,
        )
        assert second.returncode == 1
        lines = second.stderr.strip().splitlines()
        assert "level=error" in lines[-1]
        assert f"another densedev (pid {first.proc.pid}) already serves {kdir}" in lines[-1]
        assert "Traceback" not in second.stderr
        emulator = KubeletEmulator(kdir)
        await emulator.start()
        try:
            await first.line_with(f"{kdir}/kubelet.sock appeared")
            await emulator.wait_for(lambda: pools <= set(emulator.resources()), GUARD)
            # A kubelet restart: the daemon's connections get GOAWAY, which gRPC core used to log raw.
            await emulator.restart()
            await first.line_with(f"waiting for {kdir}/kubelet.sock")
            await emulator.wait_for(lambda: all(emulator.registrations(p) >= 2 for p in pools), GUARD)
        finally:
            await emulator.stop()
    finally:
        code = first.stop()
    assert code == 0
    assert not (kdir / LOCK_NAME).exists()
    # Every line in the daemon's own format: gRPC core's "E1201 ... chttp2_transport.cc" lines are off.
    assert first.lines and all(line.startswith("ts=") for line in first.lines), first.lines


def _plant_sockets(node: Path, kdir: Path) -> list[Path]:
    """Put a plain file where every pool's socket goes: the server refuses to remove it and fails."""
    planted = []
    for pool in config_mod.load(node / "config.json").pools:
        path = kdir / socket_name_for(pool.full_name, kdir)
        path.write_text("not a socket")
        planted.append(path)
    return planted


async def test_pools_that_cannot_start_are_retried_and_readyz_says_why(
    node: Path, kdir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = config_mod.load(node / "config.json")
    planted = _plant_sockets(node, kdir)
    settings = DaemonSettings(
        sysfs_root=node,
        kubelet_dir=kdir,
        config_path=None,
        netlink=False,
        metrics_addr="127.0.0.1:0",
        start_timeout_s=0.0,
        start_retry_s=(0.05, 0.2),
    )

    async def readyz(port: int) -> tuple[int, str]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        data = await reader.read()
        writer.close()
        head, _, body = data.decode().partition("\r\n\r\n")
        return int(head.split()[1]), body.strip()

    with caplog.at_level(logging.INFO, logger="densedev"):
        emulator = KubeletEmulator(kdir)
        daemon = Daemon(settings, cfg)
        await emulator.start()
        await daemon.start()
        try:
            port = daemon.metrics_port
            assert port is not None
            status, body = await readyz(port)
            assert status == 503
            assert body.startswith("no pool could start for 0 s:") and "is not a socket" in body
            assert daemon.exit_code() == 1
            # The directory heals (here: the planted files go); the retries bring every pool up.
            for path in planted:
                path.unlink()
            names = {p.full_name for p in cfg.pools}
            await emulator.wait_for(lambda: names <= set(emulator.resources()), GUARD)
            while (await readyz(port))[0] != 200:
                await asyncio.sleep(0.05)
            assert daemon.exit_code() == 0
        finally:
            await daemon.stop()
            await emulator.stop()
    failed = [r for r in caplog.records if r.getMessage() == "pool failed to start; retrying"]
    assert len(failed) >= len(planted)
    # One line each, never a traceback.
    assert all(r.exc_info is None and r.levelno == logging.WARNING for r in failed)
    assert not [r for r in caplog.records if r.exc_info]
    started = [r for r in caplog.records if r.getMessage() == "pool started"]
    assert len(started) == len(planted)


async def test_exit_code_says_no_pool_could_start(node: Path, kdir: Path, child_env: dict[str, str]) -> None:
    _plant_sockets(node, kdir)

    child = Child(run_args(node, kdir, "--start-timeout", "0"), child_env)
    try:
        line = await child.line_with("pool failed to start; retrying")
        assert "is not a socket; not removing it" in line
    finally:
        code = child.stop()
    assert code == 1
    assert not [line for line in child.lines if "Traceback" in line]


def _can_unshare_mounts() -> str | None:
    if os.geteuid() != 0:
        return "needs root for a private mount namespace"
    if shutil.which("unshare") is None or shutil.which("nsenter") is None:
        return "needs unshare and nsenter (util-linux)"
    return None


async def test_a_read_only_kubelet_dir_is_retried_until_it_heals(
    node: Path, kdir: Path, child_env: dict[str, str]
) -> None:
    why = _can_unshare_mounts()
    if why is not None:
        pytest.skip(why)
    child_env = dict(child_env)
    child_env.pop("GRPC_VERBOSITY", None)  # the daemon's own default must keep gRPC core quiet
    pools = {p.full_name for p in config_mod.load(node / "config.json").pools}
    # The daemon sees the kubelet's directory read-only (a bind mount in its own mount namespace), as
    # a hostPath mounted readOnly would be; bind(2) of its sockets fails with EROFS for real.
    script = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"'
    wrapper = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, str(kdir)]

    child = Child(run_args(node, kdir), child_env, wrapper=wrapper)
    emulator = KubeletEmulator(kdir)  # outside the namespace: the directory is writable here
    try:
        line = await child.line_with("cannot create the lock file")
        assert "Read-only file system" in line and "level=warning" in line
        failed = await child.line_with("pool failed to start; retrying")
        assert "level=warning" in failed and f'error="{kdir} is not writable"' in failed
        await emulator.start()
        await child.line_with(f"{kdir}/kubelet.sock appeared")
        # Before, the daemon never retried: it served nothing until restarted.
        heal = ["nsenter", "-t", str(child.proc.pid), "-m", "mount", "-o", "remount,bind,rw", str(kdir)]
        subprocess.run(heal, check=True, timeout=GUARD)
        await emulator.wait_for(lambda: pools <= set(emulator.resources()), GUARD)
        await child.line_with("pool started")
    finally:
        code = child.stop()
        await emulator.stop()
    assert code == 0
    assert not [line for line in child.lines if "Traceback" in line]
    # gRPC core's own "E1201 ... add_port.cc:83] Failed to add port" lines used to appear raw here.
    assert all(line.startswith("ts=") for line in child.lines), child.lines
