"""Fault: a real kernel netlink overrun (ENOBUFS) under uvloop, and malformed replies on the dump path.

The daemon runs in-process on the test's uvloop (conftest fails the test on any exception the loop
saw); its netlink sockets get the kernel's minimum receive buffer, the loop is blocked synchronously
while ``ip -batch`` floods the test's network namespace with link changes (or veth add/del for
uevents), so the kernel really drops messages and reports ENOBUFS.  libuv stops a poll handle when
epoll reports EPOLLERR on its fd (netlink raises it with ``sk_err = ENOBUFS``, netlink_overrun()), so
before the fix the reader was never called again.  Each test then shows later changes still reach the
kubelet emulator.  Waits are bounded only to turn a hang into a failure; the recovery time is printed
(``pytest -s``), never asserted.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers.metrics import sample as metric
from helpers.node import PREFIX, numvfs_uevent
from helpers.waiting import until as _until

from densedev.daemon import Daemon, DaemonSettings
from densedev.node.events import (
    NETLINK_KOBJECT_UEVENT,
    NETLINK_ROUTE,
    NLMSG_ERROR,
    LinkMonitor,
    LinkTuple,
    UeventMonitor,
    UeventTuple,
    open_netlink_socket,
    resolve_netns,
)
from densedev.pools import config as config_mod
from densedev.testing import simnode
from densedev.testing.kubelet import HEALTHY, UNHEALTHY, KubeletEmulator
from densedev.testing.netns import aip

GUARD_S = 15.0  # only turns a hang into a failure
SMALL_RCVBUF = 32 * 1024  # the kernel doubles it: ample for a few changes, overrun by a flood
FLOOD_LINKS = 16
FLOOD_ROUNDS = 64  # 16 veths x 64 flips: ~1,000 requests, several thousand link messages

pytestmark = [pytest.mark.faults, pytest.mark.netns]


@pytest.fixture
def kubelet_dir() -> Iterator[Path]:
    # Short and outside pytest's tmp_path: unix socket paths are limited to 107 bytes.
    d = Path(tempfile.mkdtemp(prefix="dd-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def batch(ns: str, lines: list[str]) -> None:
    """Run many ``ip`` commands in one process (``ip -batch``), synchronously: the loop stays blocked."""
    subprocess.run(["ip", "-n", ns, "-batch", "-"], input="".join(lines), text=True, check=True)


def start_node(tmp: Path, ns: str) -> tuple[simnode.NodeLayout, Path]:
    """A simulated node of 4 PFs x 8 VFs whose PF netdevs are real veths in ``ns``, one pool per PF."""
    sysfs = tmp / "sys"
    layout = simnode.build_node(sysfs, pfs=4, vfs_per_pf=8)
    lines = []
    for i, pf in enumerate(layout.pfs):
        lines += [
            f"link add {pf.netdev} type veth peer name peer{i}\n",
            f"link set peer{i} up\n",
            f"link set {pf.netdev} up\n",
        ]
    lines += [f"link add fl{k} type veth peer name fl{k}p\n" for k in range(FLOOD_LINKS)]
    batch(ns, lines)
    doc = {
        "reconcileSeconds": 3600,  # no periodic rescan may hide a dead reader
        "resourceList": [
            {
                "resourceName": f"sriov_{pf.netdev}",
                "resourcePrefix": PREFIX,
                "selectors": {"pfNames": [pf.netdev]},
                "healthPolicy": {"holdDownSeconds": 0.1},
            }
            for pf in layout.pfs
        ],
    }
    (tmp / "config.json").write_text(json.dumps(doc))
    return layout, sysfs


def make_daemon(tmp: Path, sysfs: Path, kubelet_dir: Path, ns: str) -> Daemon:
    settings = DaemonSettings(
        sysfs_root=sysfs,
        kubelet_dir=kubelet_dir,
        dev_root=tmp / "dev",
        devinfo_dir=None,
        resource_prefix=PREFIX,
        netlink=True,
        netns=ns,
        netlink_rcvbuf=SMALL_RCVBUF,
    )
    return Daemon(settings, config_mod.load(tmp / "config.json", default_prefix=PREFIX))


def resyncs(daemon: Daemon, source: str) -> float:
    """Return how many completed netlink resyncs of ``source`` the daemon has timed."""
    return metric(daemon, "densedev_netlink_resync_seconds_count", source=source)


def pool(pf_netdev: str) -> str:
    return f"{PREFIX}/sriov_{pf_netdev}"


def all_health(emu: KubeletEmulator, resource: str, health: str) -> Callable[[], bool]:
    return lambda: len(emu.devices(resource)) == 8 and set(emu.devices(resource).values()) == {health}


async def test_link_flood_while_the_loop_is_blocked_then_pf_changes_still_arrive(
    tmp_path: Path, netns: str, kubelet_dir: Path
) -> None:
    layout, sysfs = start_node(tmp_path, netns)
    pf0, pf2 = layout.pfs[0].netdev, layout.pfs[2].netdev

    emu = KubeletEmulator(kubelet_dir)
    await emu.start()
    daemon = make_daemon(tmp_path, sysfs, kubelet_dir, netns)
    await daemon.start()
    try:
        for pf in layout.pfs:
            await emu.wait_for(all_health(emu, pool(pf.netdev), HEALTHY), GUARD_S)
        # The flood, with the daemon's loop blocked: flips of the spare veths, and last of all the
        # truth the daemon must end with, PF 2 down.  Only a resync can bring that back: the kernel
        # dropped it with everything else that did not fit.
        flips = [
            f"link set fl{k} {'down' if j % 2 == 0 else 'up'}\n"
            for j in range(FLOOD_ROUNDS)
            for k in range(FLOOD_LINKS)
        ]
        batch(netns, [*flips, f"link set {pf2} down\n"])
        resumed = time.monotonic()
        await emu.wait_for(all_health(emu, pool(pf2), UNHEALTHY), GUARD_S)
        recovery = time.monotonic() - resumed
        assert metric(daemon, "densedev_netlink_overruns_total", source="link") >= 1
        # The reader must still be alive: later PF changes reach the kubelet, in both directions,
        # read as events (no further overrun resynced them).
        overruns = metric(daemon, "densedev_netlink_reopens_total", source="link", reason="overrun")
        await aip(netns, "link", "set", pf2, "up")
        await emu.wait_for(all_health(emu, pool(pf2), HEALTHY), GUARD_S)
        await aip(netns, "link", "set", pf0, "down")
        await emu.wait_for(all_health(emu, pool(pf0), UNHEALTHY), GUARD_S)
        await aip(netns, "link", "set", pf0, "up")
        await emu.wait_for(all_health(emu, pool(pf0), HEALTHY), GUARD_S)
        for pf in layout.pfs[1:4:2]:
            assert set(emu.devices(pool(pf.netdev)).values()) == {HEALTHY}
        assert metric(daemon, "densedev_netlink_reopens_total", source="link", reason="overrun") == overruns
        assert metric(daemon, "densedev_netlink_overruns_total", source="link") >= 1
        assert metric(daemon, "densedev_netlink_reopens_total", source="link", reason="overrun") >= 1
        assert resyncs(daemon, "link") >= 1
    finally:
        await daemon.stop()
        await emu.stop()
    print(f"\nlink overrun: loop resumed -> the kubelet holds the resynced state: {recovery * 1e3:.1f} ms")


async def test_uevent_flood_while_the_loop_is_blocked_then_uevents_still_arrive(
    tmp_path: Path, netns: str, kubelet_dir: Path
) -> None:
    layout, sysfs = start_node(tmp_path, netns)
    pf = layout.pfs[1]

    emu = KubeletEmulator(kubelet_dir)
    await emu.start()
    daemon = make_daemon(tmp_path, sysfs, kubelet_dir, netns)
    await daemon.start()
    sender = open_netlink_socket(NETLINK_KOBJECT_UEVENT, 0, resolve_netns(netns))
    try:
        await emu.wait_for(lambda: len(emu.devices(pool(pf.netdev))) == 8, GUARD_S)
        scans = metric(daemon, "densedev_scans_total")
        # Each veth created or deleted sends uevents for both ends and their queues to listeners in
        # the namespace (net devices' uevents are namespace-tagged): far more than the buffer holds.
        churn = [
            line
            for k in range(64)
            for line in (f"link add uv{k} type veth peer name uv{k}p\n", f"link del uv{k}\n")
        ]
        batch(netns, churn)
        await emu.wait_for(
            lambda: metric(daemon, "densedev_netlink_overruns_total", source="uevent") >= 1, GUARD_S
        )
        # The resync the overrun asked for (a full rescan) completes before the node changes, so
        # only a uevent read after it can make the pool follow.
        await emu.wait_for(lambda: resyncs(daemon, "uevent") >= 1, GUARD_S)
        assert metric(daemon, "densedev_scans_total") > scans
        assert metric(daemon, "densedev_netlink_overruns_total", source="uevent") >= 1
        assert metric(daemon, "densedev_netlink_reopens_total", source="uevent", reason="overrun") >= 1
        simnode.set_num_vfs(sysfs, pf.address, 0)
        sender.sendto(numvfs_uevent(pf.address, 9), (0, 1))
        await emu.wait_for(lambda: emu.devices(pool(pf.netdev)) == {}, GUARD_S)
        # The link socket was flooded too (every veth add/del is an RTM_NEWLINK/DELLINK).
        await aip(netns, "link", "set", layout.pfs[3].netdev, "down")
        await emu.wait_for(all_health(emu, pool(layout.pfs[3].netdev), UNHEALTHY), GUARD_S)
    finally:
        sender.close()
        await daemon.stop()
        await emu.stop()


async def test_truncated_error_reply_during_a_dump_is_logged_and_resynced(
    netns: str, caplog: pytest.LogCaptureFixture
) -> None:
    # An NLMSG_ERROR carrying our dump's sequence number whose header claims more bytes than the
    # datagram holds.  Another socket in the namespace sends it to the monitor's port (user-to-user
    # unicast on NETLINK_ROUTE needs no privilege), right behind the first part of a dump of 40 links.
    batch(netns, [f"link add d{k} type veth peer name d{k}p\n" for k in range(20)])

    rows: list[LinkTuple] = []
    monitor = LinkMonitor(rows.extend, lambda: None, netns=netns)
    await monitor.start()
    sender = open_netlink_socket(NETLINK_ROUTE, 0, resolve_netns(netns))
    probe = socket.socket(fileno=socket.dup(monitor.fileno))
    try:
        await asyncio.wait_for(_until(lambda: monitor.dumps >= 1), GUARD_S)
        port = probe.getsockname()[0]
        monitor.resync()  # the kernel queues the dump's first part now, inside send()
        truncated = struct.pack("=IHHII", 36, NLMSG_ERROR, 0, monitor.dump_seq, 0) + b"\x00\x00"
        sender.sendto(truncated, (port, 0))
        # That dump ended unreadable, so it does not count; the resync asked for another one.
        await asyncio.wait_for(_until(lambda: monitor.malformed >= 1 and monitor.dumps >= 2), GUARD_S)
        # The reader lives on: a later change is read.
        rows.clear()
        await aip(netns, "link", "set", "d3", "up")
        await asyncio.wait_for(_until(lambda: any(r[2] == "d3" for r in rows)), GUARD_S)
    finally:
        probe.close()
        sender.close()
        monitor.stop()
    assert "malformed netlink message" in caplog.text


async def test_watchdog_reopens_a_socket_whose_dump_is_never_read(netns: str) -> None:
    rows: list[LinkTuple] = []
    lost: list[int] = []
    monitor = LinkMonitor(
        rows.extend, lambda: lost.append(1), netns=netns, stall_timeout_s=0.3, probe_interval_s=0
    )
    await monitor.start()
    try:
        await asyncio.wait_for(_until(lambda: monitor.dumps >= 1), GUARD_S)
        # What libuv does on EPOLLERR: the poll handle stops and nothing reads the socket again.
        asyncio.get_running_loop().remove_reader(monitor.fileno)
        monitor.resync()
        await asyncio.wait_for(_until(lambda: monitor.reopens == 1), GUARD_S)
        assert monitor.stalls == 1 and lost == [1]
        await asyncio.wait_for(_until(lambda: monitor.dumps >= 2), GUARD_S)
        rows.clear()
        await aip(netns, "link", "add", "w0", "type", "veth", "peer", "name", "w0p")
        await asyncio.wait_for(_until(lambda: any(r[2] == "w0" for r in rows)), GUARD_S)
    finally:
        monitor.stop()


async def test_probe_reopens_a_uevent_socket_nobody_reads(netns: str) -> None:
    # Uevents cannot be dumped: the monitor sends itself a probe now and then and expects it back.
    events: list[UeventTuple] = []
    lost: list[int] = []
    monitor = UeventMonitor(
        events.append, lambda: lost.append(1), netns=netns, stall_timeout_s=0.3, probe_interval_s=0.1
    )
    await monitor.start()
    try:
        asyncio.get_running_loop().remove_reader(monitor.fileno)
        await asyncio.wait_for(_until(lambda: monitor.reopens == 1), GUARD_S)
        assert monitor.stalls == 1 and lost == [1]
        await aip(netns, "link", "add", "w1", "type", "veth", "peer", "name", "w1p")
        await asyncio.wait_for(
            _until(lambda: any(e[1] == "/devices/virtual/net/w1" for e in events)), GUARD_S
        )
        assert monitor.reopens == 1  # probes kept coming back since
    finally:
        monitor.stop()


async def test_a_blocked_loop_is_not_taken_for_a_dead_reader(netns: str) -> None:
    # The outcome, whatever order the loop runs I/O and due timers in after the stall.
    monitor = LinkMonitor(lambda _b: None, lambda: None, netns=netns, stall_timeout_s=0.2, probe_interval_s=0)
    await monitor.start()
    try:
        await asyncio.wait_for(_until(lambda: monitor.dumps >= 1), GUARD_S)
        monitor.resync()
        time.sleep(0.6)  # deliberately blocks the loop past the watchdog's deadline, dump unread
        await asyncio.wait_for(_until(lambda: monitor.dumps >= 2), GUARD_S)
        await asyncio.sleep(0.4)  # a wrongly armed watchdog would fire here
        assert (monitor.reopens, monitor.stalls) == (0, 0)
    finally:
        monitor.stop()


async def test_stopped_daemon_process_and_link_flood(
    tmp_path: Path, netns: str, kubelet_dir: Path, child_env: dict[str, str]
) -> None:
    # The daemon as deployed: its own process (`densedev run`), SIGSTOPped while the namespace floods.
    layout, sysfs = start_node(tmp_path, netns)
    pf1, pf3 = layout.pfs[1].netdev, layout.pfs[3].netdev
    log_path = tmp_path / "daemon.log"

    emu = KubeletEmulator(kubelet_dir)
    await emu.start()
    with log_path.open("w") as log_file:
        daemon = subprocess.Popen(
            [
                sys.executable, "-m", "densedev.cli", "run",
                "--config", str(tmp_path / "config.json"),
                "--sysfs-root", str(sysfs),
                "--kubelet-dir", str(kubelet_dir),
                "--dev-root", str(tmp_path / "dev"),
                "--devinfo-dir", "",
                "--resource-prefix", PREFIX,
                "--netns", netns,
                "--netlink-rcvbuf", str(SMALL_RCVBUF),
            ],
            env=child_env,
            stderr=log_file,
        )  # fmt: skip
    try:
        for pf in layout.pfs:
            await emu.wait_for(all_health(emu, pool(pf.netdev), HEALTHY), 60)
        daemon.send_signal(signal.SIGSTOP)
        flips = [
            f"link set fl{k} {'down' if j % 2 == 0 else 'up'}\n"
            for j in range(FLOOD_ROUNDS)
            for k in range(FLOOD_LINKS)
        ]
        batch(netns, [*flips, f"link set {pf3} down\n"])
        resumed = time.monotonic()
        daemon.send_signal(signal.SIGCONT)
        await emu.wait_for(all_health(emu, pool(pf3), UNHEALTHY), GUARD_S)
        recovery = time.monotonic() - resumed
        await aip(netns, "link", "set", pf3, "up")
        await emu.wait_for(all_health(emu, pool(pf3), HEALTHY), GUARD_S)
        await aip(netns, "link", "set", pf1, "down")
        await emu.wait_for(all_health(emu, pool(pf1), UNHEALTHY), GUARD_S)
    finally:
        daemon.terminate()
        await asyncio.to_thread(daemon.wait, 30)
        await emu.stop()
    text = log_path.read_text()
    assert "link overrun (ENOBUFS)" in text, text[-2000:]  # the fault really happened
    assert "Traceback" not in text, text[-2000:]
    print(f"\nstopped process: SIGCONT -> the kubelet holds the resynced state: {recovery * 1e3:.1f} ms")


async def test_a_reopen_that_fails_is_retried_not_raised(
    netns: str, caplog: pytest.LogCaptureFixture
) -> None:
    monitor = LinkMonitor(lambda _b: None, lambda: None, netns=netns, stall_timeout_s=0.2, probe_interval_s=0)
    await monitor.start()
    try:
        await asyncio.wait_for(_until(lambda: monitor.dumps >= 1), GUARD_S)
        # The namespace disappears, and the reader stops: the watchdog's reopen cannot succeed.
        subprocess.run(["ip", "netns", "del", netns], check=True)
        asyncio.get_running_loop().remove_reader(monitor.fileno)
        monitor.resync()
        await asyncio.wait_for(_until(lambda: caplog.text.count("could not be reopened") >= 2), GUARD_S)
        assert monitor.stalls == 1 and monitor.reopens == 0
    finally:
        monitor.stop()
    assert "does not exist" in caplog.text


async def test_probe_reopens_when_a_dead_reader_leaves_the_queue_full(netns: str) -> None:
    # As observed before the fix: nobody reads, the kernel keeps the queue full and drops the rest.
    # The probe cannot even be queued then (netlink_attachskb: EAGAIN); twice in a row means reopen.
    events: list[UeventTuple] = []
    monitor = UeventMonitor(
        events.append,
        lambda: None,
        netns=netns,
        rcvbuf=SMALL_RCVBUF,
        stall_timeout_s=5.0,
        probe_interval_s=0.2,
    )
    await monitor.start()
    try:
        asyncio.get_running_loop().remove_reader(monitor.fileno)
        batch(netns, [f"link add q{k} type veth peer name q{k}p\n" for k in range(48)])
        await asyncio.wait_for(_until(lambda: monitor.reopens == 1), GUARD_S)
        assert monitor.stalls == 1
        await aip(netns, "link", "add", "w2", "type", "veth", "peer", "name", "w2p")
        await asyncio.wait_for(
            _until(lambda: any(e[1] == "/devices/virtual/net/w2" for e in events)), GUARD_S
        )
    finally:
        monitor.stop()
