"""The first scan read by a forked child (node.ahead): the same table as a scan in the daemon, and every
way the child can fail — killed, stopped, a result planted in its file — ends in the daemon scanning
itself, with one warning.

``ScanAhead.start`` forks only a single-threaded process (pytest's is not, once gRPC has run), so the
cases that fork run in a fresh interpreter, as ``densedev run`` does before its imports.
"""

from __future__ import annotations

import json
import logging
import marshal
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.interpreter import fresh_interpreter
from helpers.metrics import sample
from helpers.node import PREFIX, Node

from densedev.__main__ import early_scan_root
from densedev.daemon import Daemon
from densedev.node import scanner
from densedev.node.ahead import DONE, FORMAT, ScanAhead
from densedev.pools import config as config_mod
from densedev.testing import simnode

# Runs in a fresh interpreter (the one thread a fork needs); argv: sysfs root, then a case.
CHILD = textwrap.dedent(
    """
    import json, logging, marshal, os, signal, sys, time
    from densedev.node import scanner
    from densedev.node.ahead import ScanAhead
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s", stream=sys.stderr)
    root, case = sys.argv[1], sys.argv[2]
    ahead = ScanAhead.start(root, timeout_s=float(sys.argv[3]) if len(sys.argv) > 3 else 30.0)
    if ahead is None:
        sys.exit("no fork")
    pid = ahead.pid
    if case == "kill":
        os.kill(pid, signal.SIGKILL)
    elif case == "stop":
        os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    got = ahead.result()
    waited = time.monotonic() - t0
    gone = not os.path.exists(f"/proc/{pid}")
    out = {"waited": waited, "gone": gone, "taken": got is not None}
    if got is not None:
        here = scanner.scan(root)
        out["same"] = (got.devices == here.devices, got.warnings == here.warnings)
        out["types"] = sorted({type(d).__name__ for d in got.devices})
        out["count"] = len(got.devices)
        out["warnings"] = len(got.warnings)
        out["seconds"] = got.seconds
    print(json.dumps(out))
    """
)


def _run(root: Path, case: str, *extra: str) -> tuple[dict[str, object], str]:
    proc = fresh_interpreter(CHILD, str(root), case, *extra)
    return json.loads(proc.stdout), proc.stderr


@pytest.fixture
def messy_node(tmp_path: Path) -> Path:
    """A node of 2 PFs x 8 VFs (with RDMA) and entries the scan skips or empties with a warning."""
    root = tmp_path / "sys"
    layout = simnode.build_node(root, pfs=2, vfs_per_pf=8, rdma=True)
    vfs = layout.pfs[0].vf_addresses
    # vanished mid-scan (its bus link dangles): skipped; a garbage numa_node: kept, field emptied
    os.rename((root / "bus/pci/devices" / vfs[2]).resolve(), root / "gone")
    (root / "bus/pci/devices" / layout.pfs[1].address).resolve().joinpath("numa_node").write_text("x\n")
    return root


def test_the_child_reads_the_same_table_as_a_scan_here(messy_node: Path) -> None:
    out, err = _run(messy_node, "plain")
    assert out["taken"], err
    assert out["same"] == [True, True]
    assert out["types"] == ["Device"]  # named tuples again, not the plain tuples it was sent as
    here = scanner.scan(messy_node)
    assert out["count"] == len(here.devices) >= 2 + 15  # the half-written VF skipped here and there
    assert out["warnings"] == 2
    assert 0 < float(out["seconds"]) < 30  # type: ignore[arg-type]
    assert "scan ahead" not in err


@pytest.fixture
def stuck_node(tmp_path: Path) -> Path:
    """A node whose PF's ``numa_node`` is a FIFO no one writes (a hung driver's file): a scan of it
    blocks opening it, so the child is surely still running when the test signals it."""
    root = tmp_path / "sys"
    layout = simnode.build_node(root, pfs=1, vfs_per_pf=4)
    numa = (root / "bus/pci/devices" / layout.pfs[0].address).resolve() / "numa_node"
    numa.unlink()
    os.mkfifo(numa)
    return root


def test_a_killed_child_leaves_the_scan_to_the_daemon(stuck_node: Path) -> None:
    out, err = _run(stuck_node, "kill")
    assert not out["taken"]
    assert out["gone"]
    assert "scan ahead: the scanning child was killed by signal 9: scanning in the daemon instead" in err
    assert err.count("\n") == 1  # one line


def test_a_stopped_child_is_given_up_at_the_first_look_and_reaped(stuck_node: Path) -> None:
    # The default timeout (30 s): a stopped child is not waited for until then (issue 23, item 3).
    out, err = _run(stuck_node, "stop")
    assert not out["taken"]
    assert out["gone"]  # killed and reaped, not left stopped (or a zombie) beside the daemon
    assert "is stopped: scanning in the daemon instead" in err
    assert err.count("\n") == 1


def test_a_child_blocked_in_a_read_is_given_up_naming_the_file(stuck_node: Path) -> None:
    """A child blocked opening a FIFO (a hung driver's file) is not waited for until the timeout: the
    daemon sees where it is blocked, and hands the file on for its own scan to leave out."""
    out, err = _run(stuck_node, "plain")
    assert not out["taken"]
    assert out["gone"]
    pf = next(p for p in (stuck_node / "bus/pci/devices").iterdir() if (p / "sriov_totalvfs").exists())
    assert f"the scanning child's read of {pf.resolve() / 'numa_node'} does not answer" in err


def test_a_slow_child_is_given_up_after_the_timeout(stuck_node: Path) -> None:
    # Blocked, it would be named at the first look; a timeout shorter than that gives it up first.
    out, err = _run(stuck_node, "plain", "0.2")
    assert not out["taken"]
    assert out["gone"]
    assert "gave no result in 0.2 s: scanning in the daemon instead" in err


def _planted(data: bytes, said: bytes = DONE) -> ScanAhead:
    """A ScanAhead whose 'child' left ``data`` in its result file, said ``said`` and exited at once."""
    pid = os.posix_spawn("/bin/true", ["true"], {})
    done_r, done_w = os.pipe2(os.O_CLOEXEC)  # /bin/true holds no copy of the write end
    os.write(done_w, said)
    os.close(done_w)
    memfd = os.memfd_create("planted", os.MFD_CLOEXEC)
    os.write(memfd, data)
    return ScanAhead(pid, done_r, memfd, timeout_s=10.0)


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"", "its result is unreadable"),
        (marshal.dumps((FORMAT, 0.1, ((1, 2),), ())), "not in this version's format"),
        (marshal.dumps((FORMAT + 1, 0.1, (), ())), "not in this version's format"),
        (marshal.dumps((FORMAT, 0.1, (), (b"bytes",))), "not in this version's format"),
        (marshal.dumps((FORMAT, 0.1, ()))[:-3], "its result is unreadable"),
        (b"\x00\xff garbage", "its result is unreadable"),
    ],
)
def test_a_result_not_in_the_format_is_refused(
    data: bytes, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    ahead = _planted(data)
    with caplog.at_level(logging.WARNING, logger="densedev.node.ahead"):
        assert ahead.result() is None
    assert [r.getMessage() for r in caplog.records if why in r.getMessage()], caplog.text
    assert ahead.result() is None  # once taken, never again
    with pytest.raises(ChildProcessError):
        os.waitpid(ahead.pid, os.WNOHANG)  # reaped


def test_a_planted_result_in_the_format_is_taken(tmp_path: Path) -> None:
    simnode.build_node(tmp_path, pfs=1, vfs_per_pf=4)
    here = scanner.scan(tmp_path)
    data = marshal.dumps((FORMAT, 0.25, tuple(map(tuple, here.devices)), here.warnings))
    got = _planted(data).result()
    assert got is not None
    assert (got.devices, got.warnings, got.seconds) == (here.devices, here.warnings, 0.25)


def test_a_result_the_child_did_not_say_done_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A whole result in the file, but the child exited (0) without its word: it may have been cut off
    # mid-write, so the daemon scans itself.
    simnode.build_node(tmp_path, pfs=1, vfs_per_pf=4)
    here = scanner.scan(tmp_path)
    ahead = _planted(marshal.dumps((FORMAT, 0.25, tuple(map(tuple, here.devices)), here.warnings)), b"")
    with caplog.at_level(logging.WARNING, logger="densedev.node.ahead"):
        assert ahead.result() is None
    assert "the scanning child exited 0 without a result: scanning in the daemon instead" in caplog.text


def test_a_process_with_threads_does_not_fork(tmp_path: Path) -> None:
    release = threading.Event()
    other = threading.Thread(target=release.wait)
    other.start()
    try:
        assert ScanAhead.start(tmp_path) is None
    finally:
        release.set()
        other.join()


def test_cancel_kills_and_reaps_a_child_never_taken(tmp_path: Path) -> None:
    pid = os.posix_spawn("/bin/sleep", ["sleep", "30"], {})
    done_r, done_w = os.pipe2(os.O_CLOEXEC)
    os.close(done_w)
    ahead = ScanAhead(pid, done_r, os.memfd_create("x", os.MFD_CLOEXEC), timeout_s=10.0)
    t0 = time.monotonic()
    ahead.cancel()
    ahead.cancel()  # idempotent
    assert time.monotonic() - t0 < 5
    assert not Path(f"/proc/{pid}").exists()
    assert ahead.result() is None


def _processes_naming(text: str) -> list[int]:
    """Pids of live processes whose command line contains ``text`` (a forked child keeps its parent's)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text.encode() in cmdline and state != "Z":
            found.append(int(entry.name))
    return found


BAD_CONFIG = '{"resourceList": [{"resourceName": "x", "selectors": {"pfNames": ["a"]}, "bogus": 1}]}'
GOOD_CONFIG = '{"resourceList": [{"resourceName": "x", "selectors": {"pfNames": ["a"]}}]}'


@pytest.mark.parametrize(
    ("config_text", "flags"),
    [(BAD_CONFIG, []), (GOOD_CONFIG, ["--bogus-flag"])],
    ids=["bad-config", "bad-flag"],
)
def test_a_daemon_that_exits_before_its_scan_takes_the_child_with_it(
    stuck_node: Path, tmp_path: Path, config_text: str, flags: list[str]
) -> None:
    """A bad config ends ``densedev run`` after its imports, a bad flag before the command has loaded,
    both before the scan is taken: the child (forked by the entry point, before either), here stuck
    opening a PF's ``numa_node`` (a FIFO no one writes: a hung driver's file), is killed."""
    root = stuck_node
    config = tmp_path / "config.json"
    config.write_text(config_text)
    kdir = tmp_path / "k"
    kdir.mkdir()
    argv = [
        sys.executable,
        "-m",
        "densedev",
        "run",
        "--config",
        str(config),
        "--sysfs-root",
        str(root),
        *flags,
    ]
    # stderr to a file, not a pipe: a child left behind would hold a pipe open, and the wait for its end
    # would hide the leak behind a timeout.
    with open(tmp_path / "stderr", "w+") as err:
        code = subprocess.run(
            [*argv, "--kubelet-dir", str(kdir), "--no-netlink"], stderr=err, timeout=60
        ).returncode
        err.seek(0)
        text = err.read()
    try:
        assert code == 2, text
        assert "bogus" in text  # the config's field, or the flag
        assert _processes_naming(str(config)) == []
    finally:
        for pid in _processes_naming(str(config)):
            os.kill(pid, 9)


async def test_a_scan_given_up_is_not_timed_as_the_daemons_scan(tmp_path: Path) -> None:
    """The scan metric times the daemon's own scan after a child gave nothing, not the wait for it."""
    node = Node(tmp_path, pfs=1, vfs_per_pf=4, rdma=False)
    pid = os.posix_spawn("/bin/sleep", ["sleep", "30"], {})
    done_r, done_w = os.pipe2(os.O_CLOEXEC)  # the write end stays open here: no end of file, ever
    ahead = ScanAhead(pid, done_r, os.memfd_create("x", os.MFD_CLOEXEC), timeout_s=0.5)
    config = config_mod.load(node.config_path, default_prefix=PREFIX)
    daemon = Daemon(node.settings(), config, scan_ahead=ahead)
    emu = node.emulator()
    await emu.start()
    try:
        await daemon.start()
        await node.wait_listed(emu, daemon)
        assert len(daemon.rediscovery.table.devices) == len(scanner.scan(node.sysfs).devices)
        assert sample(daemon, "densedev_scan_duration_seconds_count") == 1
        assert sample(daemon, "densedev_scan_duration_seconds_sum") < 0.5
        assert not Path(f"/proc/{pid}").exists()  # given up: killed and reaped
    finally:
        os.close(done_w)
        await daemon.stop()
        await emu.stop()
        node.cleanup()


@pytest.mark.parametrize(
    ("argv", "root"),
    [
        (["run", "--config", "c.json"], "/sys"),
        (["run", "--sysfs-root", "/a", "--config", "c.json"], "/a"),
        (["run", "--sysfs-root=/b"], "/b"),
        (["run", "--sysfs-root", "/a", "--sysfs-root=/b", "--sysfs-root", "/c"], "/c"),  # argparse: last wins
        # A list that starts with one of the SR-IOV network device plugin's flags is its command line: a run
        # (argparse then refuses the stray word "run").
        (["--log-level", "debug", "run"], "/sys"),
        (["scan", "--sysfs-root", "/a"], None),
        (["run", "--help"], None),
        (["run", "-h"], None),
        (["run", "--sysfs-root"], "/sys"),  # no value: argparse refuses it, the child is cancelled
        ([], None),
    ],
)
def test_the_entry_point_reads_the_root_of_a_run_from_raw_arguments(
    argv: list[str], root: str | None
) -> None:
    assert early_scan_root(argv) == root


# Runs ``densedev`` through its entry point in a fresh interpreter, recording each fork of the scan:
# whether the command module had loaded by then, and the root.
ENTRY = textwrap.dedent(
    """
    import json, sys
    from densedev.node import ahead
    forks = []
    start = ahead.ScanAhead.start.__func__
    def recorded(cls, root, **kw):
        forks.append(["densedev.cli" in sys.modules, str(root)])
        return start(cls, root, **kw)
    ahead.ScanAhead.start = classmethod(recorded)
    sys.argv = ["densedev", *sys.argv[1:]]
    from densedev.__main__ import main
    code = main()
    print(json.dumps({"code": code, "forks": forks}))
    """
)


@pytest.mark.parametrize("spelling", ["as-parsed", "trailing-slash"])
def test_run_forks_its_scan_before_the_command_loads_and_again_for_another_spelling(
    tmp_path: Path, spelling: str
) -> None:
    root = tmp_path / "sys"
    simnode.build_node(root, pfs=1, vfs_per_pf=4)
    config = tmp_path / "config.json"
    config.write_text(BAD_CONFIG)  # the run ends after its imports, with the scan never taken
    kdir = tmp_path / "k"
    kdir.mkdir()
    given = str(root) + ("/" if spelling == "trailing-slash" else "")
    flags = ["--config", str(config), "--sysfs-root", given, "--kubelet-dir", str(kdir), "--no-netlink"]
    proc = fresh_interpreter(ENTRY, "run", *flags)
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["code"] == 2, proc.stderr
    if spelling == "as-parsed":
        assert out["forks"] == [[False, str(root)]]
    else:
        # argparse makes the path /a/b of "/a/b/": the entry point's child scans another spelling of
        # the root, so the command forks one for the root it parsed (and the first one is killed).
        assert out["forks"] == [[False, given], [True, str(root)]]
    assert _processes_naming(str(config)) == []


# Scans a node in a thread of a fresh interpreter (no thread but its own) with the scan's helpers held
# at a gate, sampling the process's threads meanwhile; argv: sysfs root, when to open the gate ("never",
# "before", or seconds into the scan).  Prints the most helper threads seen before and after it opened.
GATE = textwrap.dedent(
    """
    import json, os, sys, threading, time
    from densedev import _fast
    root, when = os.fsencode(sys.argv[1]), sys.argv[2]
    gate_r, gate_w = os.pipe2(os.O_CLOEXEC)
    if when == "before":
        os.close(gate_w)
    got = {}
    scan = threading.Thread(target=lambda: got.update(rows=_fast.scan_sysfs(root, None, True, gate_r)))
    t0 = time.monotonic()
    scan.start()
    before = after = 0
    opened = when == "before"
    while scan.is_alive():
        helpers = len(os.listdir("/proc/self/task")) - 2  # this thread and the scanning one
        if opened:
            after = max(after, helpers)
        else:
            before = max(before, helpers)
        if not opened and when not in ("never", "before") and time.monotonic() - t0 >= float(when):
            os.close(gate_w)
            opened = True
        time.sleep(0.0002)
    scan.join()
    same = got["rows"] == _fast.scan_sysfs(root, None, True)
    print(json.dumps({"before": before, "after": after, "opened": opened, "same": same}))
    """
)


@pytest.fixture(scope="module")
def big_node() -> Iterator[Path]:
    """4,096 VFs: a scan of ~40-70 ms, long enough to watch its threads (on tmpfs: ~20x faster to build)."""
    top = Path(
        tempfile.mkdtemp(prefix="densedev-gate-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    )
    try:
        simnode.build_node(top / "sys", pfs=16, vfs_per_pf=256, numa_nodes=2)
        yield top / "sys"
    finally:
        shutil.rmtree(top, ignore_errors=True)


def _gated_scan(root: Path, when: str) -> dict[str, object]:
    return json.loads(fresh_interpreter(GATE, str(root), when, timeout=120).stdout)


@pytest.fixture
def helpers(both: tuple[object, object]) -> int:
    """Helper threads a scan may start on this machine (none on one core: nothing to hold back)."""
    n = max(0, min(3, (os.cpu_count() or 1) - 1))
    if n == 0:
        pytest.skip("one core: the scan starts no helper threads")
    return n


def test_a_shut_gate_holds_the_scans_helper_threads_back(helpers: int, big_node: Path) -> None:
    out = _gated_scan(big_node, "never")
    assert out["before"] == 0  # the child shares the cores with the daemon's imports: none until it waits
    assert out["same"]  # and the same rows as a scan with its helpers


def test_an_open_gate_lets_them_run(helpers: int, big_node: Path) -> None:
    out = _gated_scan(big_node, "before")
    assert 1 <= out["after"] <= helpers  # the positive control of the test above
    assert out["same"]


def test_a_gate_opened_mid_scan_lets_them_join(helpers: int, big_node: Path) -> None:
    # The daemon closes its end when it starts waiting, mid-scan at 16k VFs: helpers join at the next
    # batch (of 512 VFs, or 4,096 class links), not only at the next scan.
    out = _gated_scan(big_node, "0.01")
    assert out["opened"]
    assert out["before"] == 0
    assert 1 <= out["after"] <= helpers
    assert out["same"]


def test_both_scans_take_a_gate_and_read_the_same(both: tuple[object, object], messy_node: Path) -> None:
    # The twin reads on one thread whatever the gate says; the extension's rows are the same with it shut.
    ext, twin = both
    gate_r, gate_w = os.pipe2(os.O_CLOEXEC)
    try:
        root = os.fsencode(messy_node)
        assert ext.scan_sysfs(root, None, True, gate_r) == twin.scan_sysfs(root, None, True, gate_r)  # type: ignore[attr-defined]
    finally:
        os.close(gate_r)
        os.close(gate_w)


async def test_a_vf_made_after_the_childs_scan_is_listed_soon_after_the_start(
    tmp_path: Path, netns: str
) -> None:
    """The child reads sysfs up to ~100 ms before the uevent monitor opens: a VF created meanwhile
    (the SR-IOV operator sets sriov_numvfs and restarts the plugin) sends its uevent to no one.  The
    daemon rescans once after such a start, rather than leaving the VF to the reconcile a minute on."""
    node = Node(tmp_path, pfs=1, vfs_per_pf=4, rdma=False)
    here = scanner.scan(node.sysfs)
    stale = tuple(d for d in here.devices if d.id != node.layout.pfs[0].vf_addresses[-1])
    ahead = _planted(marshal.dumps((FORMAT, 0.01, tuple(map(tuple, stale)), here.warnings)))
    config = config_mod.load(node.config_path, default_prefix=PREFIX)
    daemon = Daemon(node.settings(netlink=True, netns=netns), config, scan_ahead=ahead)
    emu = node.emulator()
    await emu.start()
    try:
        await daemon.start()
        await node.wait_listed(emu, daemon)
        pool = next(
            p.full_name for p in config.pools if p.resource_name == f"sriov_{node.layout.pfs[0].netdev}"
        )
        assert len(emu.updates(pool)[0].devices) == 3  # the child's table: one VF short
        await emu.wait_for(lambda: any(len(u.devices) == 4 for u in emu.updates(pool)), 10)
    finally:
        await daemon.stop()
        await emu.stop()
        node.cleanup()
