"""The instance lock (``<kubelet-dir>/densedev.lock``) between real processes: one holder at a time, also
when a holder lets go while another is taking it, and ``run --wait-for-lock``'s stand-by.

The race: a holder removes the file while it still holds the lock, then unlocks; a process that had
opened the file just before locks that removed file and holds nothing a third process would see, which
then creates a new file and locks it too.  Against the lock before the fix, the third ``acquire`` of
``test_a_lock_taken_on_a_file_its_holder_removed_is_taken_again`` succeeds (two holders).
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.child import Child, run_args

from densedev.ops import preflight
from densedev.ops.preflight import LOCK_NAME, InstanceLock, LockHeld
from densedev.pools import config as config_mod
from densedev.testing import simnode
from densedev.testing.kubelet import HEALTHY, KubeletEmulator

GUARD = 60.0  # hang guard only

# A holder in its own process: takes the lock, says so, lets go when its stdin closes.
HOLDER = """
import sys
from pathlib import Path
from densedev.ops.preflight import InstanceLock
lock = InstanceLock(Path(sys.argv[1]))
assert lock.acquire() is None
print("held", flush=True)
sys.stdin.read()
lock.release()
"""


@pytest.fixture
def kdir() -> Iterator[Path]:
    """A short kubelet directory for unix sockets (sun_path holds 108 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="dd-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _holder(kdir: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(kdir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def _let_go(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.close()
    assert proc.wait(timeout=GUARD) == 0
    proc.stdout.close()


def test_a_held_lock_is_refused_as_lock_held_naming_the_holder(kdir: Path, child_env: dict[str, str]) -> None:
    holder = _holder(kdir, child_env)
    try:
        with pytest.raises(LockHeld) as info:
            InstanceLock(kdir).acquire()
        assert info.value.holder == holder.pid
        assert f"pid {holder.pid}" in str(info.value)
    finally:
        _let_go(holder)
    lock = InstanceLock(kdir)
    assert lock.acquire() is None
    lock.release()


# ``densedev run`` as far as the lock, in a child; then whether the API client library was imported.
RUN_TO_THE_LOCK = """
import sys
from densedev import cli
code = cli.main(["run", "--kubelet-dir", sys.argv[1], "--config", sys.argv[2], "--sysfs-root", sys.argv[3]])
print(code, "kubernetes_asyncio.client" in sys.modules, flush=True)
"""


@pytest.mark.parametrize("api", ["dra", "devicePlugin"])
def test_run_imports_the_api_client_before_the_scan_is_waited_for_only_with_a_dra_pool(
    kdir: Path, child_env: dict[str, str], tmp_path: Path, api: str
) -> None:
    # The import (~0.5 s) overlaps the scan-ahead child's scan instead of following it; a node without
    # a DRA pool never pays it.  Refused at the lock (another daemon holds it), run stops right after.
    node = simnode.build_node(tmp_path / "sys", pfs=1, vfs_per_pf=2)
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"resourceList": [{"resourceName": "vfs", "api": api}]}))
    holder = _holder(kdir, child_env)
    try:
        out = subprocess.run(
            [sys.executable, "-c", RUN_TO_THE_LOCK, str(kdir), str(cfg), str(node.root)],
            capture_output=True,
            text=True,
            env=child_env,
            timeout=GUARD,
        )
    finally:
        _let_go(holder)
    assert out.stdout.split() == ["1", str(api == "dra")], out.stderr[-500:]
    assert "Traceback" not in out.stderr


def test_a_lock_taken_on_a_file_its_holder_removed_is_taken_again(
    kdir: Path, child_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    holder = _holder(kdir, child_env)
    real_flock = fcntl.flock
    calls = 0

    def flock_after_the_holder_let_go(fd: int, op: int) -> None:
        # Between this process's open() and its flock(): the holder removes the file and unlocks.
        nonlocal calls
        calls += 1
        if calls == 1:
            _let_go(holder)
        real_flock(fd, op)

    monkeypatch.setattr(preflight.fcntl, "flock", flock_after_the_holder_let_go)
    second = InstanceLock(kdir)
    try:
        assert second.acquire() is None
        monkeypatch.setattr(preflight.fcntl, "flock", real_flock)
        # What it holds is the file the path names now, so a third process is refused.
        assert (kdir / LOCK_NAME).read_text().strip() == str(os.getpid())
        with pytest.raises(LockHeld):
            InstanceLock(kdir).acquire()
    finally:
        second.release()
        if holder.poll() is None:
            _let_go(holder)
    assert calls >= 2  # the first lock was on the removed file, and was taken again on a new one


async def test_a_stand_by_serves_only_once_the_old_daemon_has_gone(
    tmp_path: Path, kdir: Path, child_env: dict[str, str]
) -> None:
    """A DaemonSet surge: the new process prepares beside the old one, registers only after it stopped.

    Both on one metrics address, as two pods of a DaemonSet in the host's network namespace are: the
    stand-by binds it only once the old daemon has let go of it (and of the lock).
    """
    simnode.simulate(tmp_path / "node", pfs=2, vfs_per_pf=4, rdma=True)
    node = tmp_path / "node"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        metrics = f"127.0.0.1:{s.getsockname()[1]}"
    pools = {p.full_name for p in config_mod.load(node / "config.json").pools}
    sizes = dict.fromkeys(pools, 0)
    emu = KubeletEmulator(kdir, strict=True)
    await emu.start()
    old = Child(run_args(node, kdir, "--metrics-addr", metrics), child_env)
    new: Child | None = None
    try:
        await emu.wait_for(lambda: pools <= set(emu.resources()), GUARD)
        await emu.wait_for(lambda: all(emu.devices(p) for p in pools), GUARD)  # every pool has some
        for name in pools:
            sizes[name] = len(emu.devices(name))
        new = Child(run_args(node, kdir, "--wait-for-lock", "--metrics-addr", metrics), child_env)
        standing = await new.line_with("standing by")
        assert f"pid {old.proc.pid}" in standing
        await new.line_with("prepared")
        await asyncio.sleep(0.5)  # a stand-by that served anyway would have registered by now
        assert all(emu.registrations(p) == 1 for p in pools)
        assert new.proc.poll() is None
        assert (kdir / LOCK_NAME).read_text().strip() == str(old.proc.pid)
        assert old.stop() == 0
        await new.line_with("daemon started")
        assert (kdir / LOCK_NAME).read_text().strip() == str(new.proc.pid)
        assert new.proc.poll() is None  # its metrics address was free by then
        await emu.wait_for(lambda: all(emu.registrations(p) == 2 for p in pools), GUARD)

        def listed() -> bool:
            return all(
                len(d := emu.devices(p)) == sizes[p] and all(h == HEALTHY for h in d.values()) for p in pools
            )

        await emu.wait_for(listed, GUARD)
        await emu.create_pod("after", dict.fromkeys(sorted(pools), 1))
    finally:
        old.stop()
        if new is not None:
            assert new.stop() == 0
        await emu.stop()
    assert emu.double_holdings == []


async def test_sigterm_ends_a_stand_by_at_once_and_leaves_the_old_daemon_serving(
    tmp_path: Path, kdir: Path, child_env: dict[str, str]
) -> None:
    simnode.simulate(tmp_path / "node", pfs=1, vfs_per_pf=4)
    node = tmp_path / "node"
    emu = KubeletEmulator(kdir)
    await emu.start()
    old = Child(run_args(node, kdir), child_env)
    try:
        await old.line_with("daemon started")
        sockets = sorted(p.name for p in kdir.iterdir() if p.is_socket())
        new = Child(run_args(node, kdir, "--wait-for-lock"), child_env)
        await new.line_with("standing by")
        new.proc.send_signal(signal.SIGTERM)
        assert new.proc.wait(timeout=5) == 0  # promptly: not after the old one let go
        assert new.stop() == 0
        assert not any("Traceback" in line for line in new.lines)
        # The stand-by touched none of what the old daemon serves.
        assert sorted(p.name for p in kdir.iterdir() if p.is_socket()) == sockets
        assert (kdir / LOCK_NAME).read_text().strip() == str(old.proc.pid)
        assert old.proc.poll() is None
    finally:
        assert old.stop() == 0
        await emu.stop()


async def test_sigterm_while_the_first_dra_publish_is_awaited_ends_the_daemon_at_once(
    tmp_path: Path, kdir: Path, child_env: dict[str, str]
) -> None:
    # `densedev run` keeps the collector off until its DRA pools are first published (bounded at
    # 30 s): with an API server that never answers, a stop signal must still end it at once.
    simnode.simulate(tmp_path / "node", pfs=1, vfs_per_pf=4)
    node = tmp_path / "node"
    doc = {"resourceList": [{"resourceName": "vfs", "api": "dra"}]}
    (node / "config.json").write_text(json.dumps(doc))
    with socket.socket() as s:  # a port nobody listens on: connections refused, retried with backoff
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "x",
        "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
    }))  # fmt: skip
    extra = ["--node-name", "node-a", "--kubeconfig", str(kubeconfig),
             "--kubelet-plugins-dir", str(kdir / "plugins"),
             "--kubelet-registry-dir", str(kdir / "registry")]  # fmt: skip
    child = Child(run_args(node, kdir, *extra), child_env)
    try:
        await child.line_with("daemon started")
        await asyncio.sleep(0.5)  # into the wait for the first publish
        child.proc.send_signal(signal.SIGTERM)
        assert child.proc.wait(timeout=5) == 0
    finally:
        assert child.stop() == 0
    assert not any("Traceback" in line for line in child.lines)
