"""Link and uevent monitors against the real kernel, inside a network namespace each test creates.

Needs root (``ip netns add``; the ``netns`` fixture is conftest's); skipped with the reason otherwise.
Waits are bounded by generous timeouts that only turn a hang into a failure; nothing asserts how fast
the kernel or loop is.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers.devices import dev

from densedev.health.coalesce import Coalescer
from densedev.health.tracker import HealthTracker
from densedev.model import Device, HealthPolicy, Pool, PoolConfig, PoolMember, Role
from densedev.node.events import (
    DEFAULT_RCVBUF,
    NETLINK_KOBJECT_UEVENT,
    RTM_DELLINK,
    LinkMonitor,
    LinkTuple,
    UeventMonitor,
    UeventTuple,
    link_states,
    open_netlink_socket,
    resolve_netns,
)
from densedev.testing.netns import aip, ip

GUARD_S = 20.0  # only turns a hang into a failure

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(os.geteuid() != 0, reason="creating a network namespace needs root"),
    pytest.mark.skipif(shutil.which("ip") is None, reason="iproute2's ip is not installed"),
]


class Links:
    """Collects link batches from a monitor and lets a test wait for a condition on them."""

    def __init__(self) -> None:
        self.rows: list[LinkTuple] = []
        self.batches = 0
        self.overruns = 0
        self._changed = asyncio.Event()

    def on_links(self, batch: tuple[LinkTuple, ...]) -> None:
        self.rows.extend(batch)
        self.batches += 1
        self._changed.set()

    def on_overrun(self) -> None:
        self.overruns += 1
        self._changed.set()

    def state(self, name: str) -> bool | None:
        """Return the last up/down seen for a link (None: never seen)."""
        seen = None
        for row in self.rows:
            if row[2] == name and row[0] != RTM_DELLINK:
                seen = link_states((row,))[0][0][1]
        return seen

    async def until(self, cond: Callable[[], bool]) -> None:
        async def wait() -> None:
            while not cond():
                self._changed.clear()
                await self._changed.wait()

        await asyncio.wait_for(wait(), GUARD_S)


async def test_dump_then_link_flips(netns: str) -> None:
    ip(netns, "link", "add", "ens0f0", "type", "veth", "peer", "name", "ens0f0p")
    ip(netns, "link", "set", "ens0f0p", "up")
    ip(netns, "link", "set", "ens0f0", "up")

    links = Links()
    monitor = LinkMonitor(links.on_links, links.on_overrun, netns=netns)
    await monitor.start()
    try:
        await links.until(lambda: links.state("ens0f0") is True)  # from the initial dump
        assert {r[2] for r in links.rows} >= {"lo", "ens0f0", "ens0f0p"}
        await aip(netns, "link", "set", "ens0f0", "down")
        await links.until(lambda: links.state("ens0f0") is False)
        await aip(netns, "link", "set", "ens0f0", "up")
        await links.until(lambda: links.state("ens0f0") is True)
        await aip(netns, "link", "del", "ens0f0")
        await links.until(lambda: any(r[0] == RTM_DELLINK and r[2] == "ens0f0" for r in links.rows))
        assert links.overruns == 0
    finally:
        monitor.stop()
        monitor.stop()  # idempotent
    assert monitor.fileno == -1


async def test_resync_during_a_dump_is_deferred_not_refused(
    netns: str, caplog: pytest.LogCaptureFixture
) -> None:
    # The kernel refuses a second dump on a socket while one runs (EBUSY); the monitor must owe it.
    links = Links()
    monitor = LinkMonitor(links.on_links, links.on_overrun, netns=netns)
    await monitor.start()
    monitor.resync()  # the start() dump is still running
    monitor.resync()  # folded into the same owed dump
    try:
        await links.until(lambda: monitor.dumps >= 2)
        await asyncio.sleep(0.1)  # a third dump, if one were wrongly sent, would show up here
    finally:
        monitor.stop()
    assert sum(1 for r in links.rows if r[2] == "lo") == 2  # two dumps, not three
    assert "link dump refused" not in caplog.text


async def test_overrun_is_reported_and_resync_recovers(netns: str) -> None:
    for k in range(8):
        ip(netns, "link", "add", f"p{k}", "type", "veth", "peer", "name", f"p{k}r")

    links = Links()
    marks: list[int] = []

    def on_overrun() -> None:
        marks.append(len(links.rows))  # rows after this point come from the resync
        links.on_overrun()
        monitor.resync()

    monitor = LinkMonitor(links.on_links, on_overrun, netns=netns, rcvbuf=1)
    await monitor.start()
    try:
        await links.until(lambda: links.state("p7") is not None)
        # Block the loop (deliberately, synchronously) while the kernel queues hundreds of link
        # events into a receive buffer at its minimum size: it must overflow.
        script = "".join(f"link set p{k} {'up' if j % 2 else 'down'}\n" for j in range(40) for k in range(8))
        subprocess.run(["ip", "-n", netns, "-batch", "-"], input=script, text=True, check=True)
        ip(netns, "link", "set", "p3r", "up")  # the final truth: p3 and its peer up, carrier on
        ip(netns, "link", "set", "p3", "up")
        await links.until(lambda: links.overruns > 0)

        def resynced() -> bool:
            after = links.rows[marks[-1] :]
            names = {r[2] for r in after}
            p3 = [link_states((r,))[0][0][1] for r in after if r[2] == "p3"]
            return {f"p{k}" for k in range(8)} <= names and p3[-1:] == [True]

        # The dump requested from on_overrun brings every link back, in its final state.
        await links.until(resynced)
    finally:
        monitor.stop()
    assert monitor.overruns == links.overruns


async def test_uevent_injected_in_the_namespace(netns: str) -> None:
    events: list[UeventTuple] = []
    got = asyncio.Event()

    def on_event(event: UeventTuple) -> None:
        events.append(event)
        if event[1].startswith("/devices/pci"):
            got.set()

    monitor = UeventMonitor(on_event, lambda: None, netns=netns)
    await monitor.start()
    sender = open_netlink_socket(NETLINK_KOBJECT_UEVENT, 0, resolve_netns(netns))
    try:
        devpath = "/devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0/0000:3b:02.1"
        # udev's re-broadcast format is ignored; the kernel's record is decoded.
        sender.sendto(b"libudev\0\xfe\xed\xca\xfe" + bytes(32), (0, 1))
        sender.sendto(
            f"add@{devpath}\0ACTION=add\0DEVPATH={devpath}\0SUBSYSTEM=pci\0"
            "PCI_SLOT_NAME=0000:3b:02.1\0DRIVER=iavf\0SEQNUM=4242\0".encode(),
            (0, 1),
        )
        await asyncio.wait_for(got.wait(), GUARD_S)
    finally:
        sender.close()
        monitor.stop()
    assert len(events) == 1
    action, devpath, pairs = events[0]
    assert action == "add" and devpath.endswith("0000:3b:02.1")
    assert dict(pairs)["PCI_SLOT_NAME"] == "0000:3b:02.1" and dict(pairs)["DRIVER"] == "iavf"


async def test_kernel_uevents_for_a_new_link(netns: str) -> None:
    # A net device's uevents go to its own namespace's listeners: creating a veth makes real ones.
    events: list[UeventTuple] = []
    got = asyncio.Event()

    def on_event(event: UeventTuple) -> None:
        events.append(event)
        if event[1] == "/devices/virtual/net/ens9f0":
            got.set()

    monitor = UeventMonitor(on_event, lambda: None, netns=netns)
    await monitor.start()
    try:
        await aip(netns, "link", "add", "ens9f0", "type", "veth", "peer", "name", "ens9f0p")
        await asyncio.wait_for(got.wait(), GUARD_S)
    finally:
        monitor.stop()
    add = next(e for e in events if e[1] == "/devices/virtual/net/ens9f0")
    env = dict(add[2])
    assert add[0] == "add" and env["SUBSYSTEM"] == "net" and env["INTERFACE"] == "ens9f0"


async def test_callback_errors_do_not_stop_the_reader(netns: str, caplog: pytest.LogCaptureFixture) -> None:
    ip(netns, "link", "add", "a0", "type", "veth", "peer", "name", "a0p")

    links = Links()
    calls = 0

    def flaky(batch: tuple[LinkTuple, ...]) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("callback bug")
        links.on_links(batch)

    monitor = LinkMonitor(flaky, links.on_overrun, netns=netns)
    await monitor.start()
    try:
        await asyncio.sleep(0.2)
        await aip(netns, "link", "set", "a0", "up")
        await links.until(lambda: links.state("a0") is not None)
    finally:
        monitor.stop()
    assert "netlink monitor callback failed" in caplog.text


async def test_unknown_namespace_is_a_clear_error(tmp_path: Path) -> None:
    monitor = LinkMonitor(lambda _b: None, lambda: None, netns="nope", netns_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match="network namespace 'nope'"):
        await monitor.start()


async def test_pf_down_makes_its_vfs_unhealthy_end_to_end(netns: str) -> None:
    # Real veth links play the PF netdevs; VF records point at them by name.  Monitor → tracker →
    # coalescer → collect, as the daemon wires them.
    for p in range(2):
        ip(netns, "link", "add", f"ens{p}f0", "type", "veth", "peer", "name", f"ens{p}f0p")
        ip(netns, "link", "set", f"ens{p}f0p", "up")
        ip(netns, "link", "set", f"ens{p}f0", "up")

    def vf(p: int, k: int) -> Device:
        return dev(
            f"0000:{p + 0x3B:02x}:02.{k}",
            vendor="8086",
            device="1889",
            subsystem_vendor="8086",
            driver="iavf",
            pf=f"0000:{p + 0x3B:02x}:00.0",
            vf_index=k,
            pf_netdev=f"ens{p}f0",
            link_type="",
        )

    devices = [vf(p, k) for p in range(2) for k in range(4)]
    assert all(d.role == Role.VF and d.role != Role.PF for d in devices)
    cfg = PoolConfig("vfs", "intel.com", health=HealthPolicy(hold_down_s=0.2))
    pools = [Pool(cfg, tuple(PoolMember(d.id, d) for d in devices))]

    tracker = HealthTracker(devices, pools)
    tracker.collect()
    published: list[tuple[bool, ...]] = []
    changed = asyncio.Event()
    loop = asyncio.get_running_loop()

    def flush() -> None:
        for upd in tracker.collect().values():
            published.append(upd.healthy)
            changed.set()
        deadline = tracker.next_deadline()
        if deadline is not None:
            loop.call_at(loop.time() + max(0.0, deadline - loop.time()), flush)

    coalescer = Coalescer(flush, window=0.002)

    def on_links(batch: tuple[LinkTuple, ...]) -> None:
        states, gone = link_states(batch)
        tracker.set_links(states)
        tracker.drop_links(gone)
        coalescer.notify()

    monitor = LinkMonitor(on_links, lambda: None, netns=netns)
    await monitor.start()

    async def until(want: tuple[bool, ...]) -> None:
        async def wait() -> None:
            while not published or published[-1] != want:
                changed.clear()
                await changed.wait()

        await asyncio.wait_for(wait(), GUARD_S)

    try:
        await asyncio.sleep(0.1)  # the initial dump: everything up, nothing to publish
        await aip(netns, "link", "set", "ens1f0", "down")
        await until((True,) * 4 + (False,) * 4)
        await aip(netns, "link", "set", "ens1f0", "up")
        await until((True,) * 8)
    finally:
        monitor.stop()
        coalescer.cancel()
    assert published[-2:] == [(True,) * 4 + (False,) * 4, (True,) * 8]


async def test_host_namespace_dump_and_large_buffer() -> None:
    # Without netns the socket lives in the caller's namespace; only reads, so safe on any host.
    links = Links()
    monitor = LinkMonitor(links.on_links, links.on_overrun)
    await monitor.start()
    try:
        await links.until(lambda: monitor.dumps >= 1)
        probe = socket.fromfd(monitor.fileno, socket.AF_NETLINK, socket.SOCK_RAW, 0)
        try:
            rcvbuf = probe.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        finally:
            probe.close()
    finally:
        monitor.stop()
    names = {r[2] for r in links.rows}
    assert "lo" in names
    # SO_RCVBUFFORCE (root) bypasses net.core.rmem_max; the kernel reports double what was asked.
    assert rcvbuf >= DEFAULT_RCVBUF
