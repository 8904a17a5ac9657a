"""The event intake: the kernel's link events, uevents and overruns, and the RDMA port polls, taken in.

Which stage owns it follows from where its output goes: every link state and RDMA port state it reads
becomes a mark in the ``HealthTracker`` (and a note to the hand-off that a fact arrived), so it sits at
the health stage's entrance, not in ``node/``, which stays ignorant of health.  ``node/`` is upstream:
it gives the monitors (``node/events.py``), the uevent rule and the ``Scanner`` this class reads with,
and what a uevent or an overrun asks of ``node/`` goes back as a request on its ``RescanRequests``
queue, never as a call into another stage.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable, Sequence

from .. import workers
from ..model import Device
from ..node import scanner as discovery
from ..node.events import LinkMonitor, LinkTuple, MonitorOptions, UeventMonitor, UeventTuple, link_states
from ..node.rescans import RescanRequests
from ..ops.logs import log_event
from ..ops.metrics import Metrics
from ..workers import Work
from .handoff import Handoff
from .tracker import HealthTracker

log = logging.getLogger("densedev.daemon")  # the daemon's lines, as they were before they moved here


class EventIntake:
    """Turns kernel events and RDMA port polls into tracker marks and rescan requests; owns the monitors."""

    def __init__(
        self,
        scanner: discovery.Scanner,
        tracker: HealthTracker,
        handoff: Handoff,
        requests: RescanRequests,
        metrics: Metrics,
        *,
        monitors: MonitorOptions | None,
        devices: Callable[[], Sequence[Device]],
        rdma_devices: Callable[[], list[str]],
        rdma_poll_s: Callable[[], float],
    ) -> None:
        self.scanner = scanner
        self.tracker = tracker
        self.handoff = handoff
        self.metrics = metrics
        self._rescans = requests
        # What both netlink monitors are given (namespace, buffer, metrics); None: no netlink, link
        # states come from sysfs (simulated nodes).
        self._monitors = monitors
        self._devices = devices  # the current table's devices (their netdevs, for sysfs link states)
        self._rdma_devices = rdma_devices  # the RDMA devices whose ports are polled
        self._rdma_poll_s = rdma_poll_s  # from the config in force: a reload changes it
        self._link_monitor: LinkMonitor | None = None
        self._uevent_monitor: UeventMonitor | None = None

    def stop(self) -> None:
        """Close the netlink monitors' sockets (the daemon stops)."""
        for mon in (self._link_monitor, self._uevent_monitor):
            if mon is not None:
                with contextlib.suppress(Exception):
                    mon.stop()

    async def resync(self, changed: bool) -> None:
        """After a rescan: read link states and RDMA ports again for the table, and note a possible change."""
        if changed and self._monitors is None:
            await self.read_sysfs_links()
        if self._link_monitor is not None:
            self._link_monitor.resync()  # netlink is the truth on a real node: ask for every link again
        await self.refresh_ports()
        self.handoff.note(0)

    async def read_sysfs_links(self) -> None:
        """Take link state from sysfs ``operstate`` (only without netlink: simulated nodes), read in a
        worker thread (a file may not answer: the scanner bounds it)."""
        names = discovery.netdev_names(self._devices())
        self.tracker.set_links(await workers.run(Work.SCAN, self.scanner.operstates, names))

    def request_rescan(self, address: str | None = None) -> None:
        """Ask for a rescan soon: of one PCI device (and its VFs if a PF), or of everything."""
        self._rescans.request(address)

    def on_links(self, links: tuple[LinkTuple, ...]) -> None:
        """Take parsed rtnetlink link messages (from the monitor, or injected by the demo)."""
        states, gone = link_states(links)
        self.metrics.record_netlink("link", len(links))
        if not (states or gone):
            return
        self.tracker.set_links(states)
        # RTM_DELLINK: a VF netdev moved into a pod's namespace leaves the host's view; gone is not down.
        self.tracker.drop_links(gone)
        self.handoff.note(len(states) + len(gone))

    def set_links(self, states: Sequence[tuple[str, bool]]) -> None:
        """Take link states by interface name (the demo's and tests' way in)."""
        self.tracker.set_links(states)
        self.handoff.note(len(states))

    def on_overrun(self, source: str = "link") -> None:
        """Netlink events were lost (overrun, socket error, stall): resynchronise everything, never guess.

        The monitor counted the fault and reopened its socket; the link monitor dumps every link itself.
        A uevent monitor's resync is this full rescan, timed until it is applied.
        """
        log_event(log, "netlink events lost, resyncing", level=logging.WARNING, source=source)
        if source == "uevent":
            self._rescans.lost()
        else:
            self.request_rescan()

    def on_uevent(self, event: UeventTuple) -> None:
        """A kernel uevent: PCI add/remove/bind/unbind/change and net moves trigger a rescan."""
        self.metrics.record_netlink("uevent")
        relevant, address = discovery.uevent_target(event)
        if relevant:
            self.request_rescan(address)

    def _take_ports(self, ports: Sequence[tuple[str, int, int, int]]) -> None:
        self.tracker.set_rdma_ports((ib, port, state) for ib, port, state, _phys in ports)

    async def refresh_ports(self) -> None:
        """Read the RDMA ports of pooled devices in a worker thread (32k files at 16k devices)."""
        ibdevs = self._rdma_devices()
        if ibdevs:
            self._take_ports(await workers.run(Work.SCAN, self.scanner.rdma_ports, ibdevs))

    async def rdma_loop(self) -> None:
        """Poll the RDMA ports every ``rdmaPollSeconds`` and note the hand-off (runs until cancelled)."""
        # RDMA port state has no event source (sysfs-sriov-rdma reference): poll it.
        while True:
            await asyncio.sleep(self._rdma_poll_s())
            try:
                await self.refresh_ports()
            except Exception:
                log.exception("RDMA port poll failed")
                continue
            self.handoff.note(0)

    async def start_netlink(self) -> None:
        """Open the link and uevent monitors; one that cannot open leaves its events to rescans (logged)."""
        options = self._monitors
        if options is None:
            return
        try:
            links = LinkMonitor(self.on_links, self.on_overrun, **options)
            await links.start()
            self._link_monitor = links
        except OSError as exc:
            log.error("cannot watch rtnetlink links (%s): link health comes from rescans only", exc)
        try:
            uevents = UeventMonitor(self.on_uevent, functools.partial(self.on_overrun, "uevent"), **options)
            await uevents.start()
            self._uevent_monitor = uevents
        except OSError as exc:
            log.error("cannot watch kernel uevents (%s): devices change only on reconcile", exc)
