"""The daemon: the lifecycle and the loops that keep one device table, its pools and their health current.

Data flows one way: sysfs/netlink → device table (node.scanner) → pools (pools.select) → health
(health.tracker, handed on by health.handoff) → kubelet (kubelet.pools: one plugin server per pool,
or the DRA driver).  This module starts and stops the stages, runs the loops (rescan, reload, RDMA
poll, in-use, housekeeping) and takes the events; rescans, reloads and releases all end in one
pool-set diff (``poolset``) that ``Daemon._apply`` hands to the stages.  Each stage stays ignorant of
the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import accel, poolset
from .alloc import leftovers
from .backoff import Backoff
from .dra import DraSettings
from .dra.hooks import DraHooks
from .health.handoff import Handoff
from .health.intake import EventIntake
from .health.tracker import HealthTracker, PoolUpdate
from .kubelet.podresources import CHECKPOINT, PodResourcesClient
from .kubelet.pools import PoolSet
from .kubelet.registration import announce_kubelet
from .kubelet.watch import DirectoryWatch
from .model import DEFAULT_PREFIX, Config, Device, Pool
from .node import scanner as discovery
from .node.events import DEFAULT_RCVBUF, LinkTuple, MonitorOptions, UeventTuple
from .node.layout import SYSFS_ROOT
from .node.rescans import RescanRequests
from .ops.logs import log_event
from .ops.metrics import Metrics, MetricsServer, parse_addr
from .pools import select as selectors
from .pools.ownership import Ownership
from .reload import ConfigReloader

if TYPE_CHECKING:
    # The DRA driver (gRPC DRA services, the API-server client) is imported where it is built, only
    # when a pool is DRA or prepared claims are on record: a device-plugin-only node never loads it.
    from .dra.driver import ClientFactory, DraDriver

log = logging.getLogger("densedev.daemon")


@dataclass(frozen=True)
class DaemonSettings:
    """Where the daemon reads and writes; every path is a parameter so tests and the demo relocate it."""

    sysfs_root: Path = Path(SYSFS_ROOT)
    kubelet_dir: Path = Path("/var/lib/kubelet/device-plugins")
    dev_root: Path = Path("/dev")
    cdi_dir: Path | None = None
    devinfo_dir: Path | None = None
    cdi_annotations: bool = False  # also return cdi.k8s.io/ annotations (runtimes without CRI CDI fields)
    resource_prefix: str = DEFAULT_PREFIX
    config_path: Path | None = None  # watched for changes when set
    metrics_addr: str | None = None
    netlink: bool = True  # watch rtnetlink links and kernel uevents
    netns: str | None = None  # watch links and uevents in this named network namespace (tests)
    netlink_rcvbuf: int = DEFAULT_RCVBUF  # each netlink socket's receive buffer (fault tests shrink it)
    config_poll_s: float = 1.0
    housekeeping_s: float = 1.0  # how often registration state is copied into metrics
    registration_poll_s: float = 0.2  # how often each pool checks kubelet.sock and its own socket
    pod_resources_socket: Path | None = None  # the kubelet's PodResources API (None: checkpoint only)
    in_use_poll_s: float = 5.0  # PodResources poll while no device is withheld (0.25 s while some are)
    start_timeout_s: float = 60.0  # no pool served this long: /readyz and the exit code say so
    start_retry_s: tuple[float, float] = (0.5, 10.0)  # backoff of a pool that failed to start
    dra: DraSettings | None = None  # None: no DRA side (pools with "api": "dra" are not served)


SUPERVISE_MIN_S, SUPERVISE_MAX_S = 0.1, 30.0  # backoff of a daemon loop restarted after an exception
SUPERVISE_RESET_S = 60.0  # a loop that ran this long before failing starts again from the shortest


class Daemon:
    """Starts the stages, runs the loops that keep them current, and stops them."""

    def __init__(
        self,
        settings: DaemonSettings,
        config: Config,
        clock: Callable[[], float] = time.monotonic,
        metrics: Metrics | None = None,
        dra_client: ClientFactory | None = None,
    ) -> None:
        self.settings = settings
        self.config = config
        self.metrics = metrics or Metrics(accel.IMPLEMENTATION)
        self.scanner = discovery.Scanner(settings.sysfs_root)
        self.table = discovery.DeviceTable(())
        self._rescans = RescanRequests()
        self._ibdev_cache: list[str] | None = None
        self._pools: tuple[Pool, ...] = ()  # the pool set last applied (what the next diff starts from)
        # Empty until start() gives it the first table and pools (replace() on an empty tracker builds
        # exactly what the constructor would).
        self.tracker = HealthTracker((), (), clock=clock)
        self.started = False
        self._tasks: list[asyncio.Task[None]] = []
        # Facts given to the tracker are handed on to the pools and the DRA driver once per burst.
        self.handoff = Handoff(self.tracker, self._deliver, config.coalesce_ms / 1e3, clock)
        self._reload_lock = asyncio.Lock()
        self._metrics_server: MetricsServer | None = None
        self._kubelet_watch = DirectoryWatch(settings.kubelet_dir)
        self.ownership = Ownership(
            settings.kubelet_dir / CHECKPOINT,
            PodResourcesClient(settings.pod_resources_socket) if settings.pod_resources_socket else None,
            registry=self.metrics.registry,
            poll_s=settings.in_use_poll_s,
        )
        self._leftovers = leftovers.Leftovers(settings.cdi_dir, settings.devinfo_dir)
        self._reloader = ConfigReloader(
            settings.config_path,
            default_prefix=settings.resource_prefix,
            poll_s=settings.config_poll_s,
            metrics=self.metrics,
            current=lambda: self.config,
            apply=self.apply_config,
        )
        self._dra = DraHooks(
            settings.dra,
            self.ownership,
            lambda device_id: device_id in self.table.by_id(),
            cdi_dir=settings.cdi_dir,
            devinfo_dir=settings.devinfo_dir,
            dev_root=settings.dev_root,
            client_factory=dra_client,
            metrics=self.metrics,
        )
        self.pools = PoolSet(
            settings,
            self.metrics,
            self._kubelet_watch,
            self.ownership,
            self.tracker,
            clock=clock,
            spawn=self._spawn,
        )
        self.events = EventIntake(
            self.scanner,
            self.tracker,
            self.handoff,
            self._rescans,
            self.metrics,
            monitors=(
                MonitorOptions(netns=settings.netns, rcvbuf=settings.netlink_rcvbuf, observer=self.metrics)
                if settings.netlink
                else None
            ),
            devices=lambda: self.devices,
            rdma_devices=self._ibdevs,
            rdma_poll_s=lambda: self.config.rdma_poll_s,
        )

    # ----------------------------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Scan, build pools, serve and register every pool, then start the event sources."""
        self._kubelet_watch.start()
        self._spawn(announce_kubelet(self.settings.kubelet_dir), "kubelet-presence")
        if self.settings.metrics_addr:
            host, port = parse_addr(self.settings.metrics_addr)
            self._metrics_server = MetricsServer(self.metrics, self.registered, host, port)
            await self._metrics_server.start()
        for warning in self.config.warnings:
            log_event(log, "config warning", level=logging.WARNING, problem=warning)
        table = self._scan()
        # What running pods hold is known before any pool lists a device (the kubelet kept the
        # allocations of pods that outlived a previous run of this daemon).
        with contextlib.suppress(Exception):
            await self.ownership.refresh()
        self.table = table
        # Devices of prepared DRA claims are held before any pool of either API lists anything.
        self._dra.recover(self.config)
        raw = selectors.build_pools(self.config, table.devices)
        pools = self.ownership.filter(raw)
        self.tracker.replace(self.devices, pools)
        if not self.settings.netlink:
            self.events.read_sysfs_links()
        self.events.poll_rdma()
        # Each pool's first list carries its whole health: nothing of it is news for the first flush.
        self.tracker.collect()
        started = self.pools.take(pools, ())  # DRA pools are served by the DRA driver
        self._pools = pools
        self._dra.take(raw, pools, self.tracker)
        self._retain_held()
        # Files of devices pods or prepared DRA claims still hold stay, whichever pool wrote them
        # (issue 12, section 5).
        self._leftovers.reconcile(list(self.pools.allocators().values()), self.ownership.by_resource())
        self.pools.remove_stale_sockets(self.config.pools)
        await self._dra.start(self.config)
        await self.pools.start(started)
        if self.settings.netlink:
            await self.events.start_netlink()
        self._spawn_loop(self.events.rdma_loop, "rdma-poll")
        self._spawn_loop(
            functools.partial(self.ownership.run, self._on_ownership_change, self._kubelet_watch), "in-use"
        )
        self._spawn_loop(self._rescan_loop, "rescan")
        self._spawn_loop(self._reloader.run, "reload")
        self._spawn_loop(self._housekeeping_loop, "housekeeping")
        if self.settings.config_path is not None:
            self._spawn_loop(self._reloader.watch, "config-watch")
        self.started = True
        # The device table, pools and caches live as long as the daemon: keep the cyclic GC from walking
        # 16k devices' objects on every full collection (a 50 ms stall of the loop at 16k devices).
        gc.freeze()
        log_event(
            log,
            "daemon started",
            devices=len(self.devices),
            pools=len(self.pools),
            implementation=accel.IMPLEMENTATION,
            sizes=",".join(f"{n}={len(r.pool.members)}" for n, r in self.pools.items()),
        )

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        self._tasks.append(asyncio.create_task(coro, name=name))

    def _spawn_loop(self, body: Callable[[], Coroutine[Any, Any, None]], name: str) -> None:
        """Run one of the daemon's loops for its whole life under ``_supervise``."""
        self._spawn(self._supervise(body, name), name)

    async def _supervise(self, body: Callable[[], Coroutine[Any, Any, None]], name: str) -> None:
        """Run ``body`` again whenever it raises: no task of the daemon may die on an exception.

        A loop that died would leave its duty undone for good (a dead rescan loop: no device ever
        added again) while the daemon looks healthy; so the failure is logged with its traceback (it
        is our bug, not the user's), counted, and the loop restarts after a backoff that grows while
        it keeps failing at once and resets once it has run a while.
        """
        backoff = Backoff(SUPERVISE_MIN_S, SUPERVISE_MAX_S)
        while True:
            began = time.monotonic()
            try:
                await body()
                return
            except Exception:
                if time.monotonic() - began > SUPERVISE_RESET_S:
                    backoff.reset()
                delay = backoff.next()
                self.metrics.record_task_restart(name)
                log.exception("daemon task %s failed; restarting it in %.1f s", name, delay)
            await asyncio.sleep(delay)

    async def stop(self) -> None:
        """Stop event sources and servers, remove our sockets and files."""
        self.started = False
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()
        self.handoff.cancel()
        self.events.stop()
        await self.pools.close()
        await self._dra.stop()
        self._kubelet_watch.close()
        if self._metrics_server is not None:
            await self._metrics_server.stop()
        log_event(log, "daemon stopped")

    def exit_code(self) -> int:
        """Return the process exit code after a stop: 1 when no pool could start in time, else 0."""
        return 1 if self.pools.start_failed() else 0

    async def _on_ownership_change(self) -> None:
        """Held devices were released (or newly seen held): list or withhold them in their pools."""
        async with self._reload_lock:
            if self.ownership.would_change():
                await self._apply(self.config)
                self.handoff.note(0)
            else:
                self._retain_held()
            self._leftovers.prune(list(self.pools.allocators().values()), self.ownership.by_resource())

    def _retain_held(self) -> None:
        """Keep the CDI entries and device-info files of devices pods hold under a pool they left."""
        self._leftovers.retain(self.pools.allocators(), self.ownership.by_resource(), self.table.by_id)

    @property
    def dra(self) -> DraDriver | None:
        """Return the DRA driver once this node needs one (DRA pools, or claims still prepared), else None."""
        return self._dra.driver

    @property
    def metrics_port(self) -> int | None:
        """Return the port /metrics is served on (an ephemeral one when asked for port 0), or None."""
        return self._metrics_server.port if self._metrics_server is not None else None

    def registered(self) -> tuple[bool, str]:
        """Return whether every pool is registered with the kubelet, and which are not (for /readyz)."""
        if not self.started:
            return False, "starting"
        problem = self.pools.not_serving()
        if problem is not None:
            return False, problem
        if self._dra.waiting():
            return False, "the DRA driver has not started (see the log)"
        missing = self.pools.unregistered()
        if missing:
            return False, "not registered: " + ", ".join(missing)
        return True, f"{len(self.pools)} pools registered"

    async def _housekeeping_loop(self) -> None:
        while True:
            self.pools.record_registrations()
            await asyncio.sleep(self.settings.housekeeping_s)

    # ----------------------------------------------------------------------------------- scanning
    def _scan(self) -> discovery.DeviceTable:
        t0 = time.perf_counter()
        table = self.scanner.scan()
        self._note_scan(table, time.perf_counter() - t0)
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

    def _ibdevs(self) -> list[str]:
        # RDMA ports are polled only for RDMA devices some pool advertises; the list changes only with
        # the pools, so it is kept rather than rebuilt from 16k members every poll.
        if self._ibdev_cache is None:
            self._ibdev_cache = discovery.rdma_devices((r.pool for r in self.pools.values()), self.devices)
        return self._ibdev_cache

    @property
    def devices(self) -> tuple[Device, ...]:
        """Return the current device table's devices."""
        return self.table.devices

    def request_rescan(self, address: str | None = None) -> None:
        """Ask for a rescan soon: of one PCI device (and its VFs if a PF), or of everything."""
        self._rescans.request(address)

    async def _rescan_loop(self) -> None:
        while True:
            await self._rescans.wait(self.config.reconcile_s)
            try:
                await self.rescan()
            except Exception:
                log.exception("rescan failed; keeping the previous device table")

    async def rescan(self) -> None:
        """Rescan what changed (or everything) and apply it to every pool: grow, shrink, no restart.

        The sysfs reading runs in a worker thread so the loop keeps serving the kubelet meanwhile; the
        result is applied on the loop, and only when the device table really changed.
        """
        targets, full, reconcile = self._rescans.take()
        lost = self.events.uevent_lost_at if full else None
        t0 = time.perf_counter()
        # The periodic reconcile finds nothing changed nearly always: it reads on one thread, which
        # takes longer but the least CPU (the idle daemon's biggest cost at 16k devices).
        result = await asyncio.to_thread(
            functools.partial(self.scanner.rescan, threads=not reconcile), self.table, targets
        )
        self.metrics.record_resync("rescan" if result.full else "targeted")
        self._note_scan(result.table, time.perf_counter() - t0)
        if result.changed:
            with contextlib.suppress(Exception):
                await self.ownership.refresh()  # a device that moved pools may be held by a pod
        self.table = result.table
        if result.changed:
            async with self._reload_lock:
                await self._apply(self.config)
            gc.freeze()
        await self.events.resync(result.changed)
        if lost is not None and lost == self.events.uevent_lost_at:
            self.events.uevent_lost_at = None
            self.metrics.observe_netlink_resync("uevent", time.monotonic() - lost)

    async def _apply(self, config: Config) -> poolset.PoolChanges:
        """Select pools from the device table and ``config``, diff them with the set applied last, apply that.

        The one path of rescans, reloads and changes in what pods hold: servers of removed,
        re-registering and DRA-bound pools stop; pools that keep theirs take the new membership in
        place; every device-plugin pool without a server gets one.  The caller holds ``_reload_lock``
        and has refreshed the ownership map (``filter`` withholds what it says is held).
        """
        devices = self.devices
        raw = selectors.build_pools(config, devices)
        pools = self.ownership.filter(raw)
        changes = poolset.diff(self._pools, pools)
        await self.pools.stop_changed(changes)
        self._ibdev_cache = None  # RDMA ports are polled for the pools' devices
        self.tracker.replace(devices, pools)
        self._dra.take(raw, pools, self.tracker)
        started = self.pools.take(pools, changes.replaced)
        self._retain_held()
        # Last: should anything above fail, the next apply diffs from the set before and redoes it.
        self._pools = pools
        await self.pools.start(started)
        return changes

    # ----------------------------------------------------------------------------------- events
    def on_links(self, links: tuple[LinkTuple, ...]) -> None:
        """Take parsed rtnetlink link messages (the event intake's; kept for the demo and tests)."""
        self.events.on_links(links)

    def set_links(self, states: Sequence[tuple[str, bool]]) -> None:
        """Take link states by interface name (the demo's and tests' way in)."""
        self.events.set_links(states)

    def on_overrun(self, source: str = "link") -> None:
        """Netlink events were lost: resynchronise everything (the event intake's; kept for tests)."""
        self.events.on_overrun(source)

    def on_uevent(self, event: UeventTuple) -> None:
        """A kernel uevent (the event intake's; kept for tests)."""
        self.events.on_uevent(event)

    def _deliver(self, updates: Mapping[str, PoolUpdate], latency: float | None, events: int) -> None:
        """Hand a health flush to the device-plugin pools and to the DRA driver."""
        self.pools.publish(updates, latency, events)
        self._dra.take_changes(updates, self.tracker)

    # ----------------------------------------------------------------------------------- reload
    def request_reload(self) -> None:
        """Reload the config file soon (SIGHUP or a change seen on disk)."""
        self._reloader.request()

    async def reload(self) -> bool:
        """Load the config file again and apply it; False (logged) when refused or applying it failed."""
        return await self._reloader.reload()

    async def apply_config(self, new: Config) -> None:
        """Diff pool definitions and apply them; untouched pools keep their streams and registration.

        Should it fail, the config stays the last good one: pools already stopped or started stay so,
        and the next reload diffs against it again and finishes the job.
        """
        last_good = self.config
        try:
            await self._apply_config(new)
        except Exception:
            self.config = last_good
            raise

    async def _apply_config(self, new: Config) -> None:
        async with self._reload_lock:
            with contextlib.suppress(Exception):
                await self.ownership.refresh()  # devices the new config moves may be held by pods
            self.config = new
            self._dra.recover(new)  # the first DRA pool of this run
            self.handoff.set_window(new.coalesce_ms / 1e3)
            changes = await self._apply(new)
            await self._dra.start(self.config)
            self.metrics.record_reload(True)
            log_event(
                log,
                "config reloaded",
                added=",".join(changes.added) or "-",
                removed=",".join(changes.removed) or "-",
                changed=",".join(changes.changed) or "-",
                reregistered=",".join(changes.reregister) or "-",
                pools=len(self.pools),
            )
