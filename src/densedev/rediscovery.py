"""Rediscovery: the device table and the config in force, and the one path that applies a new selection.

Rescans (a uevent, an overrun, the periodic reconcile), reloads and changes in what pods hold all end
here: pools are selected from the table and the config, the ownership map withholds what pods and DRA
claims hold, and ``poolset.diff`` against the pool set applied last says what each stage does — the
device-plugin pools (``kubelet.pools.PoolSet``), the health tracker, the DRA side, the leftovers.  One
at a time: ``lock`` serialises them.  Health it does not read: after a rescan its caller's ``resync``
(the event intake's) reads links and RDMA ports again.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import time
from collections.abc import Awaitable, Callable

from . import poolset, workers
from .alloc.leftovers import Leftovers
from .dra.hooks import DraHooks
from .health.handoff import Handoff
from .health.tracker import HealthTracker
from .kubelet.pools import PoolSet
from .model import Config, Device, Pool
from .node import scanner as discovery
from .node.ahead import ScanAhead
from .node.rescans import RescanRequests
from .ops.logs import log_event
from .ops.metrics import Metrics
from .pools import select as selectors
from .pools.ownership import Ownership
from .workers import Work

log = logging.getLogger("densedev.daemon")  # the daemon's lines, as they were before they moved here

# resync(changed): read link states and RDMA ports again after a rescan (the event intake's)
Resync = Callable[[bool], Awaitable[None]]


def collect_frozen() -> None:
    """Collect the garbage ``gc.freeze`` hid from the collector, then freeze what still lives again.

    Daemon.start (and each rescan) freezes what exists (a full collection walking 16k devices' objects
    stalled the loop 50 ms), and the collector never looks at frozen objects again.  A pool's own
    objects hold no reference cycle, so they go as its last reference does; but grpc's per-call objects
    do (a cycle of a closure and its scope, holding the server's method handlers, hence the pool's
    service), and those frozen at start pinned a stopped pool's memory for ever: 1,000 pools reloaded
    to 0 and back held both sets (704 MiB).  One full collection per apply that stopped pools, nearly
    always a config reload: 70 ms with 1,000 pools, 35-70 ms at 16k devices in 64 pools.
    """
    gc.unfreeze()
    gc.collect()
    gc.freeze()


class Rediscovery:
    """Owns the device table, the config in force and the pool set applied last; applies each new one."""

    def __init__(
        self,
        scanner: discovery.Scanner,
        requests: RescanRequests,
        config: Config,
        *,
        ownership: Ownership,
        tracker: HealthTracker,
        pools: PoolSet,
        dra: DraHooks,
        leftovers: Leftovers,
        handoff: Handoff,
        metrics: Metrics,
    ) -> None:
        self.scanner = scanner
        self.config = config  # the config in force: the last one applied whole (or being applied)
        self.table = discovery.DeviceTable(())
        self.applied: tuple[Pool, ...] = ()  # the pool set last applied (what the next diff starts from)
        self.lock = asyncio.Lock()  # one apply at a time: rescans, reloads, releases
        self.ownership = ownership
        self.tracker = tracker
        self.pools = pools
        self.metrics = metrics
        self._rescans = requests
        self._dra = dra
        self._leftovers = leftovers
        self._handoff = handoff
        self._ibdev_cache: list[str] | None = None

    async def scan(self, ahead: ScanAhead | None = None) -> discovery.DeviceTable:
        """Scan the whole node (start-up): take the scan ``ahead`` read, else scan in a worker thread.

        Both wait in the scan's worker threads, never on the loop's: the loop stays free to take a
        SIGTERM while a child or a read does not answer (issue 23, item 3).
        """
        scanned = await workers.run(Work.SCAN, ahead.result) if ahead is not None else None
        if scanned is not None:
            table = self.scanner.table_of(scanned.devices, scanned.warnings)
            elapsed = scanned.seconds
        else:
            # Timed from here: a child given up may have been waited for up to its timeout.
            t0 = time.perf_counter()
            # Files the child was found blocked in: their devices are left out at once, not found again.
            unanswered = ahead.unanswered if ahead is not None else frozenset()
            scan = (
                functools.partial(self.scanner.scan, unanswered=unanswered)
                if unanswered
                else self.scanner.scan
            )
            table = await workers.run(Work.SCAN, scan)
            elapsed = time.perf_counter() - t0
        self._note_scan(table, elapsed)
        self.table = table
        return table

    def _note_scan(self, table: discovery.DeviceTable, elapsed: float) -> None:
        self.metrics.observe_scan(elapsed, len(table.devices), len(table.warnings))
        if table.warnings:
            log_event(
                log,
                "scan skipped or degraded entries",
                level=logging.WARNING,
                count=len(table.warnings),
                first=" | ".join(table.warnings[:3]),
            )
        log.debug("scan: %d devices in %.1f ms", len(table.devices), elapsed * 1e3)

    def rdma_devices(self) -> list[str]:
        """Return the RDMA devices whose ports are polled: those the pools advertise."""
        # RDMA ports are polled only for RDMA devices some pool advertises; the list changes only with
        # the pools, so it is kept rather than rebuilt from 16k members every poll.
        if self._ibdev_cache is None:
            self._ibdev_cache = discovery.rdma_devices((r.pool for r in self.pools.values()), self.devices)
        return self._ibdev_cache

    @property
    def devices(self) -> tuple[Device, ...]:
        """Return the current device table's devices."""
        return self.table.devices

    async def run(self, resync: Resync) -> None:
        """Rescan whenever asked, or every ``reconcileSeconds`` (runs until cancelled)."""
        while True:
            await self._rescans.wait(self.config.reconcile_s)
            try:
                await self.rescan(resync)
            except Exception:
                log.exception("rescan failed; keeping the previous device table")

    async def rescan(self, resync: Resync) -> None:
        """Rescan what changed (or everything) and apply it to every pool: grow, shrink, no restart.

        The sysfs reading runs in a worker thread so the loop keeps serving the kubelet meanwhile; the
        result is applied on the loop, and only when the device table really changed.
        """
        targets, full, reconcile = self._rescans.take()
        lost = self._rescans.lost_at if full else None
        t0 = time.perf_counter()
        # The periodic reconcile finds nothing changed nearly always: it reads on one thread, which
        # takes longer but the least CPU (the idle daemon's biggest cost at 16k devices).
        result = await workers.run(
            Work.SCAN, functools.partial(self.scanner.rescan, threads=not reconcile), self.table, targets
        )
        self.metrics.record_resync("rescan" if result.full else "targeted")
        self._note_scan(result.table, time.perf_counter() - t0)
        if result.changed:
            with contextlib.suppress(Exception):
                await self.ownership.refresh()  # a device that moved pools may be held by a pod
        self.table = result.table
        if result.changed:
            async with self.lock:
                await self.apply(self.config)
            gc.freeze()
        await resync(result.changed)
        waited = self._rescans.resynced(lost)
        if waited is not None:
            self.metrics.observe_netlink_resync("uevent", waited)

    async def apply(self, config: Config) -> poolset.PoolChanges:
        """Select pools from the device table and ``config``, diff them with the set applied last, apply that.

        The one path of rescans, reloads and changes in what pods hold: servers of removed,
        re-registering and DRA-bound pools stop; pools that keep theirs take the new membership in
        place; every device-plugin pool without a server gets one.  The caller holds ``lock``
        and has refreshed the ownership map (``filter`` withholds what it says is held).
        """
        devices = self.devices
        raw = selectors.build_pools(config, devices)
        pools = self.ownership.filter(raw)
        changes = poolset.diff(self.applied, pools)
        await self.pools.stop_changed(changes)
        self._ibdev_cache = None  # RDMA ports are polled for the pools' devices
        self.tracker.replace(devices, pools, self.table.index)
        self._dra.take(raw, pools, self.tracker)
        started = self.pools.take(pools, changes.replaced)
        self.retain_held()
        # Last: should anything above fail, the next apply diffs from the set before and redoes it.
        self.applied = pools
        await self.pools.start(started)
        if changes.stopped:
            collect_frozen()
        return changes

    def retain_held(self) -> None:
        """Keep the CDI entries and device-info files of devices pods hold under a pool they left."""
        self._leftovers.retain(self.pools.allocators(), self.ownership.by_resource(), self.table.by_id)

    async def released(self) -> None:
        """Held devices were released (or newly seen held): list or withhold them in their pools."""
        async with self.lock:
            if self.ownership.would_change():
                await self.apply(self.config)
                self._handoff.note(0)
            else:
                self.retain_held()
            if self.ownership.known:  # else any spec may be a live pod's: all stay
                self._leftovers.prune(list(self.pools.allocators().values()), self.ownership.by_resource())

    async def reconfigure(self, new: Config) -> poolset.PoolChanges:
        """Apply a new config: untouched pools keep their streams and registration.

        Should it fail, the config stays the last good one: pools already stopped or started stay so,
        and the next reload diffs against it again and finishes the job.
        """
        last_good = self.config
        try:
            async with self.lock:
                with contextlib.suppress(Exception):
                    await self.ownership.refresh()  # devices the new config moves may be held by pods
                self.config = new
                self._dra.recover(new)  # the first DRA pool of this run
                self._handoff.set_window(new.coalesce_ms / 1e3)
                changes = await self.apply(new)
                await self._dra.start(self.config)
                return changes
        except Exception:
            self.config = last_good
            raise
