"""The daemon: builds the stages, starts them in order, runs their loops under supervision, and stops them.

Data flows one way: sysfs/netlink → device table (node.scanner) → pools (pools.select) → health
(health.tracker, handed on by health.handoff) → kubelet (kubelet.pools: one plugin server per pool,
or the DRA driver).  The jobs live with their owners: kernel events and RDMA polls become tracker
marks and rescan requests in ``health.intake``; rescans, reloads and releases all end in one pool-set
diff in ``rediscovery``; ``reload`` loads and watches the config file.  This module holds no fact
beyond what runs: the tasks, readiness, the exit code.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from . import accel
from .alloc import leftovers
from .backoff import Backoff
from .dra.hooks import DraHooks
from .health.handoff import Handoff
from .health.intake import EventIntake
from .health.tracker import HealthTracker, PoolUpdate
from .kubelet.pools import PoolSet
from .kubelet.registration import announce_kubelet
from .model import Config, Device, PoolApi
from .node import scanner as discovery
from .node.ahead import ScanAhead
from .node.events import MonitorOptions
from .node.holdings import CHECKPOINT, PodResourcesClient
from .node.rescans import RescanRequests
from .node.watch import DirectoryWatch
from .ops.logs import log_event
from .ops.metrics import Metrics, MetricsServer, parse_addr
from .pools import select as selectors
from .pools.ownership import Ownership
from .poolset import PoolChanges
from .rediscovery import Rediscovery
from .reload import ConfigReloader
from .settings import DaemonSettings

if TYPE_CHECKING:
    # The DRA driver (gRPC DRA services, the API-server client) is imported where it is built, only
    # when a pool is DRA or prepared claims are on record: a device-plugin-only node never loads it.
    from .dra.driver import ClientFactory, DraDriver

log = logging.getLogger("densedev.daemon")


SUPERVISE_MIN_S, SUPERVISE_MAX_S = 0.1, 30.0  # backoff of a daemon loop restarted after an exception
SUPERVISE_RESET_S = 60.0  # a loop that ran this long before failing starts again from the shortest
CATCH_UP_RESCAN_S = 1.0  # after a start from a child's scan: the full rescan of what changed meanwhile
STANDBY_RESCAN_S = 5.0  # a stand-by's scan is read again this often, so what it serves first is recent


class Daemon:
    """Starts the stages, runs the loops that keep them current, and stops them."""

    def __init__(
        self,
        settings: DaemonSettings,
        config: Config,
        clock: Callable[[], float] = time.monotonic,
        metrics: Metrics | None = None,
        dra_client: ClientFactory | None = None,
        scan_ahead: ScanAhead | None = None,
    ) -> None:
        self.settings = settings
        # The first scan, already under way in a child process (cli: it forks before the imports).
        self._scan_ahead = scan_ahead
        self.metrics = metrics or Metrics(accel.IMPLEMENTATION)
        self.scanner = discovery.Scanner(settings.sysfs_root)
        self._rescans = RescanRequests()
        # Empty until start() gives it the first table and pools (replace() on an empty tracker builds
        # exactly what the constructor would).
        self.tracker = HealthTracker((), (), clock=clock)
        self.started = False
        self._prepared = False  # the first scan is taken (prepare), maybe long before start
        self._tasks: list[asyncio.Task[None]] = []
        # Facts given to the tracker are handed on to the pools and the DRA driver once per burst.
        self.handoff = Handoff(self.tracker, self._deliver, config.coalesce_ms / 1e3, clock)
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
            served=lambda: len(self.pools),
        )
        self._dra = DraHooks(
            settings.dra,
            self.ownership,
            lambda device_id: device_id in self.rediscovery.table.by_id(),
            cdi_dir=settings.cdi_dir,
            devinfo_dir=settings.devinfo_dir,
            dev_root=settings.dev_root,
            client_factory=dra_client,
            metrics=self.metrics,
            pod_resources=settings.pod_resources_socket,
            pod_resources_poll_s=settings.in_use_poll_s,
            sysfs_root=settings.sysfs_root,
            on_health=lambda: self.handoff.note(0),
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
        self.rediscovery = Rediscovery(
            self.scanner,
            self._rescans,
            config,
            ownership=self.ownership,
            tracker=self.tracker,
            pools=self.pools,
            dra=self._dra,
            leftovers=self._leftovers,
            handoff=self.handoff,
            metrics=self.metrics,
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
            devices=lambda: self.rediscovery.devices,
            rdma_devices=self.rediscovery.rdma_devices,
            rdma_poll_s=lambda: self.config.rdma_poll_s,
        )

    # ----------------------------------------------------------------------------------- lifecycle
    async def prepare(self) -> None:
        """Take the first scan: all the start does that needs no instance lock (a stand-by's work).

        It serves nothing, opens no socket and reads nothing pods hold: another daemon may still serve
        this node (cli ``run --wait-for-lock``), and what pods hold is read only once it has gone.
        """
        # Kept on self while it is waited for: a stop meanwhile (SIGTERM) kills the child (stop).
        await self.rediscovery.scan(self._scan_ahead)
        self._scan_ahead = None
        self._prepared = True

    async def stand_by(self) -> None:
        """Keep the prepared scan recent until cancelled (the wait for another daemon's lock)."""
        while True:
            await asyncio.sleep(STANDBY_RESCAN_S)
            try:
                await self.rediscovery.scan()
            except Exception:  # the scan of prepare() stays; start's catch-up rescan reads it again
                log.exception("a stand-by's rescan failed; the last scan stays")

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
        # A scan taken before (prepare) is from a child or from before a wait: caught up as a child's is.
        catch_up = self._prepared or self._scan_ahead is not None
        if not self._prepared:
            await self.prepare()
        table = self.rediscovery.table
        # What running pods hold is known before any pool lists a device (the kubelet kept the
        # allocations of pods that outlived a previous run of this daemon).  If neither PodResources nor
        # the checkpoint can be read, nothing is known: every pool lists nothing and every file stays
        # until a read succeeds (docs/ownership.md, "fail closed").
        try:
            await self.ownership.refresh()
        except Exception:
            log.exception("reading what pods hold failed; every device is withheld until a read succeeds")
        # Devices of prepared DRA claims are held before any pool of either API lists anything.
        self._dra.recover(self.config)
        # ... and so are those of claims only the kubelet's PodResources name (a lost DRA checkpoint).
        await self._dra.first_view()
        raw = selectors.build_pools(self.config, table.devices)
        pools = self.ownership.filter(raw)
        current = self.rediscovery.table
        self.tracker.replace(current.devices, pools, current.index)
        if not self.settings.netlink:
            await self.events.read_sysfs_links()
        await self.events.refresh_ports()
        # Each pool's first list carries its whole health: nothing of it is news for the first flush.
        self.tracker.collect()
        started = self.pools.take(pools, ())  # DRA pools are served by the DRA driver
        self.rediscovery.applied = pools
        self._dra.take(raw, pools, self.tracker)
        self.rediscovery.retain_held()
        # Files of devices pods or prepared DRA claims still hold stay, whichever pool wrote them
        # (issue 12, section 5).  Without a read of what pods hold, any of them may be a live pod's: the
        # earlier run's files all stay (pruned again only at the next start).
        if self.ownership.known:
            self._leftovers.reconcile(list(self.pools.allocators().values()), self.ownership.by_resource())
        else:
            log_event(
                log,
                "files left by an earlier run kept",
                level=logging.WARNING,
                problem="what running pods hold cannot be read",
            )
        self.pools.remove_stale_sockets(self.config.pools)
        await self._dra.start(self.config)
        await self.pools.start(started)
        if self.settings.netlink:
            await self.events.start_netlink()
            if catch_up:
                # A child read the first scan up to ~100 ms before the uevent monitor opened
                # (node.ahead): a device that appeared, left or was rebound meanwhile told no one.  One
                # full rescan once the first lists are out finds it, not the reconcile a minute later.
                asyncio.get_running_loop().call_later(CATCH_UP_RESCAN_S, self._rescans.request)
        self._spawn_loop(self.events.rdma_loop, "rdma-poll")
        self._spawn_loop(
            functools.partial(self.ownership.run, self.rediscovery.released, self._kubelet_watch), "in-use"
        )
        self._spawn_loop(functools.partial(self.rediscovery.run, self.events.resync), "rescan")
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
        if self._scan_ahead is not None:  # stopped before its scan was taken (a failed or cancelled start)
            self._scan_ahead.cancel()
            self._scan_ahead = None
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

    @property
    def config(self) -> Config:
        """Return the config in force (the rediscovery's: the last one applied whole, or being applied)."""
        return self.rediscovery.config

    @property
    def dra(self) -> DraDriver | None:
        """Return the DRA driver once this node needs one (DRA pools, or claims still prepared), else None."""
        return self._dra.driver

    async def first_published(self) -> None:
        """Return once the DRA driver has published every slice of its first plan (at once without DRA)."""
        while True:
            driver = self._dra.driver
            if driver is not None and driver.publisher is not None:
                await driver.publisher.wait_idle()
                return
            if not any(p.api is PoolApi.DRA for p in self.config.pools):
                return
            await asyncio.sleep(0.1)  # the driver or its API connection still starting (retried)

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

    # ----------------------------------------------------------------------------------- entry points
    @property
    def devices(self) -> tuple[Device, ...]:
        """Return the current device table's devices."""
        return self.rediscovery.devices

    def request_rescan(self, address: str | None = None) -> None:
        """Ask for a rescan soon: of one PCI device (and its VFs if a PF), or of everything."""
        self._rescans.request(address)

    def set_links(self, states: Sequence[tuple[str, bool]]) -> None:
        """Take link states by interface name (the demo's and tests' way in; the event intake's)."""
        self.events.set_links(states)

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

    async def apply_config(self, new: Config) -> PoolChanges:
        """Diff pool definitions and apply them (the reloader's hook); on failure the last good one stays."""
        return await self.rediscovery.reconfigure(new)
