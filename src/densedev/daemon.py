"""The daemon: one device table, its pools, their health, one plugin server per pool, kept current.

Data flows one way: sysfs/netlink → device table (discovery) → pools (selectors) → health (health) →
wire (wire) → kubelet (server/registration).  This module owns the only mutable state and wires the
stages together; each stage stays ignorant of the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import hashlib
import logging
import os
import re
import time
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from . import accel
from ._proto import api_pb2
from .alloc import cdi, leftovers
from .alloc.respond import AllocationSettings, PoolAllocator
from .dra.claims import CHECKPOINT_NAME as CLAIMS_CHECKPOINT
from .dra.driver import ClientFactory, DraDriver, DraSettings, DraUnavailable
from .health.coalesce import Coalescer
from .health.tracker import HealthTracker, PoolUpdate
from .kubelet.feed import PoolFeed
from .kubelet.podresources import CHECKPOINT, PodResourcesClient
from .kubelet.registration import PluginRunner, announce_kubelet
from .kubelet.server import MAX_UNIX_PATH, PoolService, status_of
from .kubelet.sockets import remove_stale_sockets
from .kubelet.watch import DirectoryWatch
from .kubelet.wire import ListEncoder
from .model import ROLE_PF, Config, Device, Pool, PoolApi, PoolConfig, RequestError
from .node import scanner as discovery
from .node.events import DEFAULT_RCVBUF, LinkMonitor, LinkTuple, UeventMonitor, UeventTuple, link_states
from .ops.logs import log_event, summarise
from .ops.metrics import ALLOCATE, PREFERRED, PRESTART, Metrics, MetricsServer, parse_addr
from .pools import config as config_mod
from .pools import select as selectors
from .pools.ownership import DRA_CLAIMS, GuardedService, Ownership

log = logging.getLogger("densedev.daemon")
T = TypeVar("T")


@dataclass(frozen=True)
class DaemonSettings:
    """Where the daemon reads and writes; every path is a parameter so tests and the demo relocate it."""

    sysfs_root: Path = Path("/sys")
    kubelet_dir: Path = Path("/var/lib/kubelet/device-plugins")
    dev_root: Path = Path("/dev")
    cdi_dir: Path | None = None
    devinfo_dir: Path | None = None
    cdi_annotations: bool = False  # also return cdi.k8s.io/ annotations (runtimes without CRI CDI fields)
    resource_prefix: str = "intel.com"
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


# Kernel uevents that change what discovery would find (lib/kobject_uevent.c action names).
UEVENT_SUBSYSTEMS = frozenset(("pci", "net", "infiniband", "auxiliary", "vdpa"))
UEVENT_ACTIONS = frozenset(("add", "remove", "bind", "unbind", "change", "move"))
MAX_TARGETED_RESCANS = 32
SUPERVISE_MIN_S, SUPERVISE_MAX_S = 0.1, 30.0  # backoff of a daemon loop restarted after an exception
SUPERVISE_RESET_S = 60.0  # a loop that ran this long before failing starts again from the shortest
_BDF = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")


def pci_address_in(devpath: str) -> str | None:
    """Return the last PCI address among DEVPATH's components, or None (then rescan everything)."""
    found = [part for part in devpath.split("/") if _BDF.fullmatch(part)]
    return found[-1] if found else None


def read_sysfs_links(sysfs_root: Path, ifnames: Iterable[str]) -> list[tuple[str, bool]]:
    """Read ``class/net/<if>/operstate`` for the named interfaces (simulated nodes carry no netlink).

    A real node's first netlink dump overrides these; on a simulated tree they are the only truth.
    Unreadable files are skipped: the interface may just have left the host namespace.
    """
    out: list[tuple[str, bool]] = []
    base = os.path.join(os.fspath(sysfs_root), "class", "net")
    for name in ifnames:
        try:
            with open(os.path.join(base, name, "operstate"), "rb") as f:
                state = f.read().strip()
        except OSError:
            continue
        out.append((name, state in (b"up", b"unknown")))
    return out


def socket_name_for(resource: str, kubelet_dir: Path) -> str:
    """Return the pool's socket file name: readable when it fits ``sun_path``, hashed when it would not.

    Resource names may be 300+ characters while a unix socket path is limited to 107 bytes; the name
    must also be stable across restarts so the kubelet's view does not churn.
    """
    # Only [A-Za-z0-9_.-] of the name reach the file name: no "/" or control character from a config.
    readable = "densedev-" + re.sub(r"[^A-Za-z0-9_.-]", "_", resource) + ".sock"
    if len(os.fsencode(kubelet_dir / readable)) <= MAX_UNIX_PATH:
        return readable
    digest = hashlib.sha256(resource.encode()).hexdigest()[:16]
    return f"densedev-{digest}.sock"


class MeteredService:
    """Wraps a pool's allocator to time every kubelet call and count errors in the metrics."""

    def __init__(self, resource: str, inner: PoolService, metrics: Metrics) -> None:
        self.resource = resource
        self.inner = inner
        self.metrics = metrics

    def options(self) -> tuple[bool, bool]:
        """Return the pool's options (read by the kubelet once per registration)."""
        return self.inner.options()

    def allocate(self, ids: Sequence[str]) -> api_pb2.ContainerAllocateResponse:
        """Answer Allocate, timed."""
        return self._timed(ALLOCATE, self.inner.allocate, ids)

    def preferred(self, available: Sequence[str], must_include: Sequence[str], size: int) -> list[str]:
        """Answer GetPreferredAllocation, timed."""
        return self._timed(PREFERRED, self.inner.preferred, available, must_include, size)

    def prestart(self, ids: Sequence[str]) -> None:
        """Answer PreStartContainer, timed."""
        self._timed(PRESTART, self.inner.prestart, ids)

    def _timed(self, method: str, call: Callable[..., T], *args: Any) -> T:
        """Run one kubelet call, recording its latency and, if it fails, the status it is answered with."""
        t0 = time.perf_counter()
        try:
            result = call(*args)
        except RequestError as exc:
            self.metrics.observe_rpc(self.resource, method, time.perf_counter() - t0, status_of(exc).name)
            raise
        except Exception:
            self.metrics.observe_rpc(self.resource, method, time.perf_counter() - t0, "INTERNAL")
            raise
        self.metrics.observe_rpc(self.resource, method, time.perf_counter() - t0)
        return result


class PoolRuntime:
    """Everything that runs for one pool: its feed, encoder, allocator and kubelet-facing runner."""

    def __init__(
        self,
        pool: Pool,
        settings: DaemonSettings,
        metrics: Metrics,
        watch: DirectoryWatch | None = None,
        ownership: Ownership | None = None,
        *,
        health: HealthTracker,
    ) -> None:
        self.pool = pool
        self.feed = PoolFeed()
        self._health = health  # the only holder of the members' health; the allocator asks it
        self.encoder = self._new_encoder(pool)
        self.allocator = PoolAllocator(
            pool,
            AllocationSettings(
                cdi_dir=settings.cdi_dir,
                devinfo_dir=settings.devinfo_dir,
                dev_root=settings.dev_root,
                cdi_annotations=settings.cdi_annotations,
            ),
            self.is_healthy,
        )
        name = pool.config.full_name
        socket_name = socket_name_for(name, settings.kubelet_dir)
        inner: PoolService = self.allocator
        if ownership is not None:
            inner = GuardedService(name, inner, ownership)  # one pod per device across resources
        service = MeteredService(name, inner, metrics)
        # Each pool watches kubelet.sock and its own socket: woken by the daemon's inotify watch of the
        # kubelet's directory, or (without one) looking 5 times a second, well within the 1 s the
        # kubelet allows a plugin to come back after its restart.
        self.runner = PluginRunner(
            name,
            settings.kubelet_dir,
            socket_name,
            self.feed,
            service,
            poll=settings.registration_poll_s,
            watch=watch,
        )
        self.registrations_seen = 0

    @staticmethod
    def _new_encoder(pool: Pool) -> ListEncoder:
        numa = [-1 if pool.config.exclude_topology else m.device.numa_node for m in pool.members]
        return ListEncoder([m.id for m in pool.members], numa, name=pool.config.full_name)

    @property
    def name(self) -> str:
        """Return the pool's extended resource name."""
        return self.pool.config.full_name

    def is_healthy(self, device_id: str) -> bool:
        """Return whether the ID is a member the health tracker advertises Healthy."""
        return self._health.is_healthy(self.name, device_id)

    def publish(self, healthy: Sequence[bool], changed: Iterable[int] | None) -> int:
        """Encode the health the tracker handed over, hand the message to the streams, return its size."""
        # ``changed``: the members the tracker says changed since its last report (None: all of them).
        message = self.encoder.encode(healthy, changed)
        self.feed.publish(message)
        return len(message)

    def replace(self, pool: Pool, healthy: Sequence[bool]) -> int:
        """Adopt a new membership (rescan or reload) and publish the whole list once."""
        self.pool = pool
        self.encoder = self._new_encoder(pool)
        self.allocator.update(pool)
        return self.publish(healthy, None)


class Daemon:
    """Runs discovery, health and one plugin server per pool, and keeps them current."""

    def __init__(
        self,
        settings: DaemonSettings,
        config: Config,
        clock: Callable[[], float] = time.monotonic,
        metrics: Metrics | None = None,
        dra_client: ClientFactory | None = None,
    ) -> None:
        self.settings = settings
        self._dra_client = dra_client  # the API client's maker (tests); None: from the kubeconfig
        self.dra: DraDriver | None = None
        self.config = config
        self._clock = clock
        self.metrics = metrics or Metrics(accel.IMPLEMENTATION)
        self.table = discovery.DeviceTable(())
        self._rescan_targets: set[str] = set()  # PCI addresses named by uevents since the last rescan
        self._full_rescan = False
        self._ibdev_cache: list[str] | None = None
        self.pools: dict[str, PoolRuntime] = {}
        self.tracker: HealthTracker | None = None
        self.started = False
        self._tasks: list[asyncio.Task[None]] = []
        # Coalescing: the first event of a burst arms one flush `coalesce_ms` later; later events in the
        # window ride along, so a PF taking 256 VFs down becomes one message per pool.
        self._coalescer = Coalescer(self.flush, config.coalesce_ms / 1e3)
        self._burst_start: float | None = None  # when the first event of the pending burst arrived
        self._burst_events = 0
        self._deadline_handle: asyncio.TimerHandle | None = None
        self._reload_requested = asyncio.Event()
        self._rescan_requested = asyncio.Event()
        self._reload_lock = asyncio.Lock()
        self._link_monitor: LinkMonitor | None = None
        self._uevent_monitor: UeventMonitor | None = None
        self._uevent_lost_at: float | None = None  # uevents lost, not yet resynced by a full rescan
        self._metrics_server: MetricsServer | None = None
        self._kubelet_watch = DirectoryWatch(settings.kubelet_dir)
        self.ownership = Ownership(
            settings.kubelet_dir / CHECKPOINT,
            PodResourcesClient(settings.pod_resources_socket) if settings.pod_resources_socket else None,
            registry=self.metrics.registry,
            poll_s=settings.in_use_poll_s,
        )
        self._start_errors: dict[str, str] = {}  # pool -> why its server could not start (retried)
        self._all_failed_since: float | None = None  # since when no configured pool is served
        self._reconcile = False  # the next full rescan is the periodic reconcile
        self.stats = {
            "scans": 0,
            "flushes": 0,
            "events": 0,
            "reloads": 0,
            "reload_failures": 0,
            "overruns": 0,
        }

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
        self._dra_recover()
        raw = selectors.build_pools(self.config, table.devices)
        pools = self.ownership.filter(raw)
        self.tracker = HealthTracker(self.devices, pools, clock=self._clock)
        if not self.settings.netlink:
            self._read_sysfs_links()
        self._poll_rdma()
        initial = self.tracker.collect()
        for pool in pools:
            if pool.config.api is PoolApi.DRA:
                continue  # published as ResourceSlices and served by the DRA driver
            try:
                runtime = PoolRuntime(
                    pool,
                    self.settings,
                    self.metrics,
                    self._kubelet_watch,
                    self.ownership,
                    health=self.tracker,
                )
            except Exception:
                # A failure in one pool (unwritable CDI dir, bad policy) must never take down another.
                log.exception("pool %s could not be set up; the other pools go on", pool.config.full_name)
                continue
            upd = initial.get(runtime.name)
            healthy = upd.healthy if upd is not None else self.tracker.healthy(runtime.name)
            runtime.publish(healthy, None)
            self._report_counts(runtime.name, healthy)
            self.pools[pool.config.full_name] = runtime
        self._dra_take(raw, pools)
        self._retain_held()
        # Files of devices pods or prepared DRA claims still hold stay, whichever pool wrote them
        # (issue 12, section 5).
        self._reconcile_files(frozenset(self.ownership.held))
        self._remove_stale_sockets()
        await self._dra_start()
        await asyncio.gather(*(self._start_runner(r) for r in self.pools.values()))
        if self.settings.netlink:
            await self._start_netlink()
        self._spawn_loop(self._rdma_loop, "rdma-poll")
        self._spawn_loop(
            functools.partial(self.ownership.run, self._on_ownership_change, self._kubelet_watch), "in-use"
        )
        self._spawn_loop(self._rescan_loop, "rescan")
        self._spawn_loop(self._reload_loop, "reload")
        self._spawn_loop(self._housekeeping_loop, "housekeeping")
        if self.settings.config_path is not None:
            self._spawn_loop(self._config_watch_loop, "config-watch")
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
        delay = SUPERVISE_MIN_S
        while True:
            began = time.monotonic()
            try:
                await body()
                return
            except Exception:
                if time.monotonic() - began > SUPERVISE_RESET_S:
                    delay = SUPERVISE_MIN_S
                self.metrics.record_task_restart(name)
                log.exception("daemon task %s failed; restarting it in %.1f s", name, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, SUPERVISE_MAX_S)

    async def stop(self) -> None:
        """Stop event sources and servers, remove our sockets and files."""
        self.started = False
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()
        self._coalescer.cancel()
        if self._deadline_handle is not None:
            self._deadline_handle.cancel()
        for mon in (self._link_monitor, self._uevent_monitor):
            if mon is not None:
                with contextlib.suppress(Exception):
                    mon.stop()
        await asyncio.gather(*(self._stop_runtime(r) for r in self.pools.values()))
        if self.dra is not None:
            try:
                await self.dra.stop()
            except Exception:
                log.exception("the DRA driver failed to stop cleanly")
        self._kubelet_watch.close()
        if self._metrics_server is not None:
            await self._metrics_server.stop()
        log_event(log, "daemon stopped")

    async def _start_runner(self, runtime: PoolRuntime) -> None:
        if await self._try_start(runtime):
            return
        self._spawn(self._retry_start(runtime), f"start-retry {runtime.name}")

    async def _try_start(self, runtime: PoolRuntime, attempt: int = 1) -> bool:
        """Start the pool's server and registration; on failure note why (for /readyz) in one line."""
        name = runtime.name
        try:
            await runtime.runner.start()
        except Exception as exc:
            # A planted file at the socket path, a full or read-only kubelet dir: the environment, which
            # may heal, so one line and a retry (never a traceback, never a pool given up for good).
            error = self._start_error_text(exc)
            previous = self._start_errors.get(name)
            self._start_errors[name] = error
            self._note_failing()
            delay = backoff_delay(attempt, self.settings.start_retry_s)
            # The first failure, a new reason, and then every 10th retry: visible, but no flood.
            if error != previous or attempt % 10 == 0:
                log_event(
                    log,
                    "pool failed to start; retrying",
                    level=logging.WARNING,
                    pool=name,
                    attempt=attempt,
                    retry_in_s=round(delay, 2),
                    error=error,
                )
            return False
        if self._start_errors.pop(name, None) is not None:
            log_event(log, "pool started", pool=name, attempt=attempt)
        self._note_failing()
        return True

    async def _retry_start(self, runtime: PoolRuntime) -> None:
        attempt = 1
        while self.pools.get(runtime.name) is runtime:
            await asyncio.sleep(backoff_delay(attempt, self.settings.start_retry_s))
            if self.pools.get(runtime.name) is not runtime:
                break  # removed or replaced by a reload meanwhile
            attempt += 1
            if await self._try_start(runtime, attempt):
                return
            if self.start_failed() and attempt % 4 == 0:  # a reminder now and then, not every retry
                log_event(
                    log,
                    "no pool could start",
                    level=logging.ERROR,
                    seconds=round(self._clock() - (self._all_failed_since or self._clock())),
                    reasons=self._failure_text(),
                )
        if runtime.name not in self.pools:  # removed by a reload: its failure no longer counts
            self._start_errors.pop(runtime.name, None)
        self._note_failing()

    def _start_error_text(self, exc: Exception) -> str:
        """Say why a pool's server could not start, naming an unwritable kubelet dir plainly."""
        kubelet_dir = self.settings.kubelet_dir
        # bind(2) of a unix socket needs write access to the directory (EACCES, or EROFS on a read-only
        # mount); gRPC reports either as "Failed to bind" without the errno, so look for ourselves.
        if kubelet_dir.is_dir() and not os.access(kubelet_dir, os.W_OK):
            return f"{kubelet_dir} is not writable"
        return f"{type(exc).__name__}: {exc}"

    def _note_failing(self) -> None:
        failing = bool(self.pools) and all(n in self._start_errors for n in self.pools)
        if not failing:
            self._all_failed_since = None
        elif self._all_failed_since is None:
            self._all_failed_since = self._clock()

    def _failure_text(self) -> str:
        return "; ".join(f"{n}: {e}" for n, e in sorted(self._start_errors.items()))

    def start_failed(self) -> bool:
        """Return whether no configured pool has been served for ``start_timeout_s`` seconds."""
        since = self._all_failed_since
        return since is not None and self._clock() - since >= self.settings.start_timeout_s

    def exit_code(self) -> int:
        """Return the process exit code after a stop: 1 when no pool could start in time, else 0."""
        return 1 if self.start_failed() else 0

    async def _stop_runtime(self, runtime: PoolRuntime, deleted: bool = False) -> None:
        try:
            await runtime.runner.stop()
        except Exception:
            log.exception("pool %s failed to stop cleanly", runtime.name)
        try:
            # A daemon restart keeps the CDI spec (the kubelet restarts containers from its checkpointed
            # response, which names our CDI devices); a pool deleted from the config takes it along.
            runtime.allocator.close(remove_cdi=deleted)
        except Exception:
            log.exception("pool %s: cleaning up its files failed", runtime.name)

    def _reconcile_files(self, in_use: frozenset[str] | None = None) -> None:
        """Remove our CDI specs and device-info files an earlier run left that no pool or held device needs.

        ``in_use``: device IDs a pod still holds (their files stay, whichever pool wrote them).
        """
        try:
            result = leftovers.reconcile_pools(
                self.settings.cdi_dir,
                self.settings.devinfo_dir,
                [r.allocator for r in self.pools.values()],
                in_use,
            )
        except Exception:
            log.exception("reconciling files left by an earlier run failed; going on without")
            return
        for problem in result.problems:
            log_event(log, "leftover file not reconciled", level=logging.WARNING, problem=problem)
        if result.removed:
            names = [p.name for p in result.removed]
            log_event(log, "removed files left by an earlier run", files=summarise(names, noun="file"))

    def _prune_cdi(self) -> None:
        """Delete our CDI specs of pools no longer configured once no pod holds their devices."""
        if self.settings.cdi_dir is None:
            return
        # A removed pool's spec stays while pods hold its devices: the kubelet restarts their containers
        # from the checkpointed response, which names the devices by that kind (<prefix>/<name>).
        keep = [r.allocator.kind for r in self.pools.values()] + sorted(self.ownership.resources_held())
        removed = cdi.SpecWriter(self.settings.cdi_dir).prune(keep)
        if removed:
            log_event(log, "removed stale CDI specs", files=summarise([p.name for p in removed], noun="file"))

    def _remove_stale_sockets(self) -> None:
        """Delete dead sockets of pools an earlier run served and the config no longer has."""
        keep = {socket_name_for(p.full_name, self.settings.kubelet_dir) for p in self.config.pools}
        removed = remove_stale_sockets(self.settings.kubelet_dir, keep)
        if removed:
            log_event(log, "removed stale pool sockets", files=summarise(removed, noun="file"))

    async def _on_ownership_change(self) -> None:
        """Held devices were released (or newly seen held): list or withhold them in their pools."""
        async with self._reload_lock:
            if self.ownership.would_change():
                self._apply(self.devices, self.config)
                self._note_event(0)
            else:
                self._retain_held()
            self._prune_cdi()

    def _retain_held(self) -> None:
        """Keep the CDI entries and device-info files of devices pods hold under a pool they left."""
        if self.settings.cdi_dir is None and self.settings.devinfo_dir is None:
            return
        held = self.ownership.by_resource()
        by_id = self.table.by_id() if held else {}
        for name, runtime in self.pools.items():
            try:
                runtime.allocator.retain([by_id[i] for i in sorted(held.get(name, ())) if i in by_id])
            except Exception:
                log.exception("pool %s: keeping the files of held devices failed", name)

    @property
    def metrics_port(self) -> int | None:
        """Return the port /metrics is served on (an ephemeral one when asked for port 0), or None."""
        return self._metrics_server.port if self._metrics_server is not None else None

    def registered(self) -> tuple[bool, str]:
        """Return whether every pool is registered with the kubelet, and which are not (for /readyz)."""
        if not self.started:
            return False, "starting"
        if self.start_failed():
            return (
                False,
                f"no pool could start for {self.settings.start_timeout_s:g} s: {self._failure_text()}",
            )
        if self._start_errors:
            return False, "not serving: " + self._failure_text()
        if self.dra is not None and self.dra.needed() and not self.dra.started:
            return False, "the DRA driver has not started (see the log)"
        missing = [n for n, r in self.pools.items() if not r.runner.registered]
        if missing:
            return False, "not registered: " + ", ".join(missing)
        return True, f"{len(self.pools)} pools registered"

    async def _housekeeping_loop(self) -> None:
        while True:
            for name, r in self.pools.items():
                self.metrics.set_registered(name, r.runner.registered)
                while r.registrations_seen < r.runner.registrations:
                    r.registrations_seen += 1
                    self.metrics.record_registration(name, True)
            await asyncio.sleep(self.settings.housekeeping_s)

    # ----------------------------------------------------------------------------------- scanning
    def _scan(self) -> discovery.DeviceTable:
        t0 = time.perf_counter()
        table = discovery.scan(self.settings.sysfs_root)
        self._note_scan(table, time.perf_counter() - t0)
        return table

    def _note_scan(self, table: discovery.DeviceTable, elapsed: float) -> None:
        self.stats["scans"] += 1
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

    def _ifnames(self) -> set[str]:
        names: set[str] = set()
        for d in self.devices:
            names.update(d.netdevs)
            if d.pf_netdev:
                names.add(d.pf_netdev)
        return names

    def _ibdevs(self) -> list[str]:
        # RDMA ports are polled only for RDMA devices some pool advertises; the list changes only with
        # the pools, so it is kept rather than rebuilt from 16k members every poll.
        if self._ibdev_cache is None:
            seen: dict[str, None] = {}
            for r in self.pools.values():
                for m in r.pool.members:
                    if m.device.rdma_device:
                        seen[m.device.rdma_device] = None
            if not self.pools:
                for d in self.devices:
                    if d.rdma_device:
                        seen[d.rdma_device] = None
            self._ibdev_cache = list(seen)
        return self._ibdev_cache

    @property
    def devices(self) -> tuple[Device, ...]:
        """Return the current device table's devices."""
        return self.table.devices

    def request_rescan(self, address: str | None = None) -> None:
        """Ask for a rescan soon: of one PCI device (and its VFs if a PF), or of everything."""
        if address is None:
            self._full_rescan = True
        else:
            self._rescan_targets.add(address)
        self._rescan_requested.set()

    async def _rescan_loop(self) -> None:
        while True:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a cancellation that
            # arrives as the inner wait completes (cpython gh-86296), and stop() would wait forever.
            try:
                async with asyncio.timeout(self.config.reconcile_s):
                    await self._rescan_requested.wait()
            except TimeoutError:
                self._full_rescan = True  # the safety net: reconcile everything now and then
                self._reconcile = True
            # Events come in bursts (writing sriov_numvfs creates hundreds of VFs): let them settle.
            await asyncio.sleep(0.05)
            self._rescan_requested.clear()
            try:
                await self.rescan()
            except Exception:
                log.exception("rescan failed; keeping the previous device table")

    async def rescan(self) -> None:
        """Rescan what changed (or everything) and apply it to every pool: grow, shrink, no restart.

        The sysfs reading runs in a worker thread so the loop keeps serving the kubelet meanwhile; the
        result is applied on the loop, and only when the device table really changed.
        """
        targets, self._rescan_targets = self._rescan_targets, set()
        full, self._full_rescan = self._full_rescan or not targets, False
        lost = self._uevent_lost_at if full else None
        t0 = time.perf_counter()
        # Beyond a few dozen devices one pass over the node is cheaper than many partial ones.
        if full or len(targets) > MAX_TARGETED_RESCANS:
            # The periodic reconcile finds nothing changed nearly always: it reads on one thread,
            # which takes longer but the least CPU (the idle daemon's biggest cost at 16k devices).
            reconcile, self._reconcile = self._reconcile, False
            table = await asyncio.to_thread(
                functools.partial(discovery.scan, threads=not reconcile),
                self.settings.sysfs_root,
                self.table,
            )
            self.metrics.record_resync("rescan")
            # scan() hands back the devices it was given when none changed (compared in the worker):
            # comparing 16k new Devices again here would hold up the loop for milliseconds.
            changed = table.devices is not self.table.devices
        else:
            table = await asyncio.to_thread(self._rescan_targets_of, self.table, targets)
            self.metrics.record_resync("targeted")
            # A merged table keeps the Devices it did not rescan: mostly identity checks.
            changed = table.devices != self.table.devices
        self._note_scan(table, time.perf_counter() - t0)
        if changed:
            with contextlib.suppress(Exception):
                await self.ownership.refresh()  # a device that moved pools may be held by a pod
        self.table = table
        if changed:
            self._ibdev_cache = None
            self._apply(table.devices, self.config)
            gc.freeze()
            if not self.settings.netlink:
                self._read_sysfs_links()
        if self._link_monitor is not None:
            self._link_monitor.resync()  # netlink is the truth on a real node: ask for every link again
        await self._refresh_ports()
        self._note_event(0)
        if lost is not None and lost == self._uevent_lost_at:
            self._uevent_lost_at = None
            self.metrics.observe_netlink_resync("uevent", time.monotonic() - lost)

    def _read_sysfs_links(self) -> None:
        """Take link state from sysfs ``operstate`` (only without netlink: simulated nodes)."""
        assert self.tracker is not None
        self.tracker.set_links(read_sysfs_links(self.settings.sysfs_root, self._ifnames()))

    def _rescan_targets_of(self, table: discovery.DeviceTable, targets: set[str]) -> discovery.DeviceTable:
        """Rescan only the named devices: a PF with its whole VF family, anything else alone."""
        root = self.settings.sysfs_root
        for address in sorted(targets):
            known = table.by_id().get(address)
            is_pf = (known is not None and known.role == ROLE_PF) or os.path.exists(
                os.path.join(root, "bus/pci/devices", address, "sriov_totalvfs")
            )
            if is_pf:
                table = discovery.rescan_pf(root, address, table)
            else:
                table = table.merged(discovery.rescan_devices(root, [address]), [address])
        return table

    def _apply(self, devices: tuple[Device, ...], config: Config) -> tuple[Pool, ...]:
        """Recompute pools from devices and config, and update pools whose membership changed."""
        raw = selectors.build_pools(config, devices)
        pools = self.ownership.filter(raw)
        assert self.tracker is not None
        self.tracker.replace(devices, pools)
        self._dra_take(raw, pools)
        for pool in pools:
            runtime = self.pools.get(pool.config.full_name)
            if runtime is None:
                continue
            if runtime.pool.members != pool.members or runtime.pool.config != pool.config:
                before = {m.id for m in runtime.pool.members}
                after = {m.id for m in pool.members}
                healthy = self.tracker.healthy(runtime.name)
                try:
                    nbytes = runtime.replace(pool, healthy)
                except Exception:
                    log.exception("pool %s: applying the new membership failed", runtime.name)
                    continue
                self.metrics.record_send(runtime.name, nbytes, None)
                self._report_counts(runtime.name, healthy)
                log_event(
                    log,
                    "pool membership changed",
                    pool=runtime.name,
                    devices=len(pool.members),
                    added=summarise(sorted(after - before)),
                    removed=summarise(sorted(before - after)),
                )
        self._retain_held()
        return pools

    # ----------------------------------------------------------------------------------- health
    def _note_event(self, count: int) -> None:
        if self._burst_start is None:
            self._burst_start = time.monotonic()
        self._burst_events += count
        self._coalescer.notify()

    def on_links(self, links: tuple[LinkTuple, ...]) -> None:
        """Take parsed rtnetlink link messages (from the monitor, or injected by the demo)."""
        states, gone = link_states(links)
        self.metrics.record_netlink("link", len(links))
        if self.tracker is None or not (states or gone):
            return
        self.stats["events"] += len(states) + len(gone)
        self.tracker.set_links(states)
        # RTM_DELLINK: a VF netdev moved into a pod's namespace leaves the host's view; gone is not down.
        self.tracker.drop_links(gone)
        self._note_event(len(states) + len(gone))

    def set_links(self, states: Sequence[tuple[str, bool]]) -> None:
        """Take link states by interface name (the demo's and tests' way in)."""
        assert self.tracker is not None
        self.tracker.set_links(states)
        self._note_event(len(states))

    def on_overrun(self, source: str = "link") -> None:
        """Netlink events were lost (overrun, socket error, stall): resynchronise everything, never guess.

        The monitor counted the fault and reopened its socket; the link monitor dumps every link itself.
        A uevent monitor's resync is this full rescan, timed until it is applied.
        """
        self.stats["overruns"] += 1
        log_event(log, "netlink events lost, resyncing", level=logging.WARNING, source=source)
        if source == "uevent" and self._uevent_lost_at is None:
            self._uevent_lost_at = time.monotonic()
        self.request_rescan()

    def on_uevent(self, event: UeventTuple) -> None:
        """A kernel uevent: PCI add/remove/bind/unbind/change and net moves trigger a rescan."""
        action, devpath, env = event
        self.metrics.record_netlink("uevent")
        fields = dict(env)
        if fields.get("SUBSYSTEM", "") in UEVENT_SUBSYSTEMS and action in UEVENT_ACTIONS:
            self.stats["events"] += 1
            # The device is named by PCI_SLOT_NAME (pci) or is the last PCI function in DEVPATH
            # (net, infiniband, auxiliary and vdpa devices hang below their PCI function).
            self.request_rescan(fields.get("PCI_SLOT_NAME") or pci_address_in(devpath))

    def _poll_rdma(self) -> None:
        """Read RDMA port states now, on the caller's thread (start-up, before anything is served)."""
        ibdevs = self._ibdevs()
        if ibdevs:
            self._take_ports(discovery.read_rdma_ports(self.settings.sysfs_root, ibdevs))

    def _take_ports(self, ports: Sequence[tuple[str, int, int, int]]) -> None:
        if self.tracker is not None:
            self.tracker.set_rdma_ports((ib, port, state) for ib, port, state, _phys in ports)

    async def _refresh_ports(self) -> None:
        """Read the RDMA ports of pooled devices in a worker thread (32k files at 16k devices)."""
        ibdevs = self._ibdevs()
        if ibdevs:
            self._take_ports(
                await asyncio.to_thread(discovery.read_rdma_ports, self.settings.sysfs_root, ibdevs)
            )

    async def _rdma_loop(self) -> None:
        # RDMA port state has no event source (sysfs-sriov-rdma reference): poll it.
        while True:
            await asyncio.sleep(self.config.rdma_poll_s)
            try:
                await self._refresh_ports()
            except Exception:
                log.exception("RDMA port poll failed")
                continue
            self._note_event(0)

    def flush(self) -> None:
        """Send one message to every pool whose advertised health changed, and arm the hold-down timer."""
        if self.tracker is None:
            return
        updates = self.tracker.collect()
        latency = None if self._burst_start is None else time.monotonic() - self._burst_start
        events, self._burst_start, self._burst_events = self._burst_events, None, 0
        self.stats["flushes"] += 1
        for name, upd in updates.items():
            runtime = self.pools.get(name)
            if runtime is None:
                continue
            try:
                nbytes = runtime.publish(upd.healthy, upd.changed)
            except Exception:
                log.exception("pool %s: publishing failed", runtime.name)
                continue
            self.metrics.record_send(runtime.name, nbytes, latency, events)
            self._report_change(runtime, upd)
        if self.dra is not None:
            try:
                self.dra.take_changes(updates)
            except Exception:
                log.exception("DRA: publishing health failed")
        deadline = self.tracker.next_deadline()
        if self._deadline_handle is not None:
            self._deadline_handle.cancel()
            self._deadline_handle = None
        if deadline is not None:
            loop = asyncio.get_running_loop()
            self._deadline_handle = loop.call_later(max(0.0, deadline - self._clock()), self.flush)

    def _report_change(self, runtime: PoolRuntime, upd: PoolUpdate) -> None:
        """One log line per pool and direction, and the per-pool gauges; never a line per device."""
        members = runtime.pool.members
        down_pos = [p for p in upd.changed if not upd.healthy[p]]
        down = [members[p].id for p in down_pos]
        up = [members[p].id for p in upd.changed if upd.healthy[p]]
        self.metrics.record_transitions(runtime.name, len(down), len(up))
        if down:
            assert self.tracker is not None
            # Reasons of a sample are enough for the log line; the metrics count every device.
            why = sorted({r for p in down_pos[:64] for r in self.tracker.reasons(members[p].device.id)})
            log_event(
                log,
                "devices unhealthy",
                level=logging.WARNING,
                pool=runtime.name,
                count=len(down),
                reason=",".join(why) or "unknown",
                devices=summarise(down),
            )
        if up:
            log_event(log, "devices recovered", pool=runtime.name, count=len(up), devices=summarise(up))
        self._report_counts(runtime.name, upd.healthy)

    def _report_counts(self, name: str, healthy: Sequence[bool]) -> None:
        bad = healthy.count(False) if isinstance(healthy, list | tuple) else sum(1 for h in healthy if not h)
        reasons: dict[str, int] = {}
        if bad and self.tracker is not None and name in self.pools:
            members = self.pools[name].pool.members
            for pos, ok in enumerate(healthy):
                if not ok:
                    for r in self.tracker.reasons(members[pos].device.id):
                        reasons[r] = reasons.get(r, 0) + 1
        self.metrics.set_pool_devices(name, len(healthy) - bad, bad, reasons)

    async def _start_netlink(self) -> None:
        try:
            links = LinkMonitor(
                self.on_links,
                self.on_overrun,
                netns=self.settings.netns,
                rcvbuf=self.settings.netlink_rcvbuf,
                observer=self.metrics,
            )
            await links.start()
            self._link_monitor = links
        except OSError as exc:
            log.error("cannot watch rtnetlink links (%s): link health comes from rescans only", exc)
        try:
            uevents = UeventMonitor(
                self.on_uevent,
                functools.partial(self.on_overrun, "uevent"),
                netns=self.settings.netns,
                rcvbuf=self.settings.netlink_rcvbuf,
                observer=self.metrics,
            )
            await uevents.start()
            self._uevent_monitor = uevents
        except OSError as exc:
            log.error("cannot watch kernel uevents (%s): devices change only on reconcile", exc)

    # ----------------------------------------------------------------------------------- reload
    def request_reload(self) -> None:
        """Reload the config file soon (SIGHUP or a change seen on disk)."""
        self._reload_requested.set()

    async def _config_watch_loop(self) -> None:
        # A ConfigMap mount updates by swapping the `..data` symlink, so watch the resolved target and its
        # stat, not just the path's mtime.
        path = self.settings.config_path
        assert path is not None
        last = _config_identity(path)
        while True:
            await asyncio.sleep(self.settings.config_poll_s)
            try:
                now = _config_identity(path)
            except Exception:
                log.exception("config watch: cannot stat %s; trying again", path)
                continue
            if now != last:
                last = now
                self.request_reload()

    async def _reload_loop(self) -> None:
        # This task is the only way SIGHUP and file changes take effect: if it died, every later reload
        # would be ignored without a word.  Whatever a reload raises is logged and counted, and the
        # last good config stays.
        while True:
            await self._reload_requested.wait()
            self._reload_requested.clear()
            try:
                await self.reload()
            except Exception:
                self._reload_failed()
                log.exception("config reload failed; the last good config stays")

    def _reload_failed(self) -> None:
        self.stats["reload_failures"] += 1
        self.metrics.record_reload(False)

    async def reload(self) -> bool:
        """Load the config file again and apply it: new pools start, removed stop, changed update in place.

        Returns False, logging why, when the file is refused or applying it fails; the daemon then keeps
        running on the last good config.
        """
        path = self.settings.config_path
        if path is None:
            return False
        try:
            # In a worker thread: a 1 MiB file full of problems takes a while to validate, and the loop
            # keeps health and the kubelet's calls going meanwhile.
            new = await asyncio.to_thread(config_mod.load, path, default_prefix=self.settings.resource_prefix)
        except config_mod.ConfigError as exc:
            self._reload_failed()
            for p in exc.problems:
                log_event(log, "config reload refused", level=logging.ERROR, file=str(path), problem=p)
            return False
        except Exception as exc:
            # load() turns every problem of the file into ConfigError; anything else is a bug, and still
            # must not end the daemon's reloads.
            self._reload_failed()
            log_event(
                log, "config reload refused", level=logging.ERROR, file=str(path), problem=repr(exc)[:500]
            )
            return False
        for warning in new.warnings:
            log_event(log, "config warning", level=logging.WARNING, file=str(path), problem=warning)
        if new == self.config:
            return True
        last_good = self.config
        try:
            await self.apply_config(new)
        except Exception:
            # Pools already stopped or started stay so; the config stays the last good one, so the next
            # reload diffs against it again and finishes the job.
            self.config = last_good
            self._reload_failed()
            log.exception("applying the reloaded config failed; the last good config stays")
            return False
        return True

    async def apply_config(self, new: Config) -> None:
        """Diff pool definitions and apply them; untouched pools keep their streams and registration."""
        async with self._reload_lock:
            old_by_name = {p.full_name: p for p in self.config.pools}
            new_by_name = {p.full_name: p for p in new.pools}
            removed = [n for n in old_by_name if n not in new_by_name]
            added = [n for n in new_by_name if n not in old_by_name]
            # The kubelet reads options only at registration: a pool whose options change re-registers.
            reregister = [
                n
                for n in new_by_name
                if n in old_by_name and _options_of(old_by_name[n]) != _options_of(new_by_name[n])
            ]
            changed = [n for n in new_by_name if n in old_by_name and old_by_name[n] != new_by_name[n]]
            # A pool moving to DRA leaves the device-plugin API: its server stops, its files stay for
            # the pods that hold its devices (withheld from the DRA pool until they are released).
            to_dra = [n for n in new_by_name if n in self.pools and new_by_name[n].api is PoolApi.DRA]
            for n in removed + reregister + to_dra:
                runtime = self.pools.pop(n, None)
                if runtime is not None:
                    deleted = n in removed and n not in self.ownership.resources_held()
                    await self._stop_runtime(runtime, deleted=deleted)
                if n in removed:
                    self.metrics.remove_pool(n)
            with contextlib.suppress(Exception):
                await self.ownership.refresh()  # devices the new config moves may be held by pods
            self.config = new
            self._dra_recover()  # the first DRA pool of this run
            # The window may have changed: a new coalescer, but the old one's pending flush must neither
            # fire later (a second flush, or one after stop()) nor be lost: the new one takes it over.
            pending = self._coalescer.pending
            self._coalescer.cancel()
            self._coalescer = Coalescer(self.flush, new.coalesce_ms / 1e3)
            if pending:
                self._coalescer.notify()
            self._ibdev_cache = None
            pools = self._apply(self.devices, new)
            assert self.tracker is not None
            started: list[PoolRuntime] = []
            for pool in pools:
                name = pool.config.full_name
                if name in self.pools or pool.config.api is PoolApi.DRA:
                    continue
                try:
                    runtime = PoolRuntime(
                        pool,
                        self.settings,
                        self.metrics,
                        self._kubelet_watch,
                        self.ownership,
                        health=self.tracker,
                    )
                except Exception:
                    log.exception("pool %s could not be set up; the other pools go on", name)
                    continue
                healthy = self.tracker.healthy(name)
                runtime.publish(healthy, None)
                self.pools[name] = runtime
                self._report_counts(name, healthy)
                started.append(runtime)
            self._retain_held()
            await asyncio.gather(*(self._start_runner(r) for r in started))
            await self._dra_start()
            self.stats["reloads"] += 1
            self.metrics.record_reload(True)
            log_event(
                log,
                "config reloaded",
                added=",".join(added) or "-",
                removed=",".join(removed) or "-",
                changed=",".join(changed) or "-",
                reregistered=",".join(reregister) or "-",
                pools=len(self.pools),
            )

    # ----------------------------------------------------------------------------------- DRA
    def _dra_recover(self) -> None:
        """Build the DRA driver and count the devices its prepared claims hold (before serving)."""
        dra = self.settings.dra
        if dra is None or self.dra is not None:
            return
        # Nothing to do for a node that never served DRA: no DRA pool and no claims checkpoint.
        checkpoint = dra.plugins_dir / self.config.dra_driver_name / CLAIMS_CHECKPOINT
        if not any(p.api is PoolApi.DRA for p in self.config.pools) and not os.path.lexists(checkpoint):
            return
        self.dra = DraDriver(
            dra,
            self.config.dra_driver_name,
            cdi_dir=self.settings.cdi_dir,
            devinfo_dir=self.settings.devinfo_dir,
            dev_root=self.settings.dev_root,
            on_node=lambda device_id: device_id in self.table.by_id(),
            holder=self._dra_holder,
            on_claims=self._dra_claims_changed,
            client_factory=self._dra_client,
        )
        self.ownership.set_claimed(self.dra.recover())

    def _dra_holder(self, device_id: str) -> str | None:
        """Name who holds a device under the device-plugin API (the DRA gate refuses it then)."""
        return ", ".join(sorted(self.ownership.held.get(device_id, frozenset()) - {DRA_CLAIMS})) or None

    def _dra_claims_changed(self) -> None:
        """After a Prepare or Unprepare: the ownership map follows the claims at once."""
        if self.dra is not None:
            self.ownership.set_claimed(self.dra.claimed())

    def _dra_take(self, raw: Sequence[Pool], pools: Sequence[Pool]) -> None:
        if self.dra is None:
            return
        try:
            self.dra.take_pools(raw, pools, self.ownership.withheld)
            assert self.tracker is not None
            self.dra.take_health(self.tracker)
        except Exception:
            log.exception("DRA: taking the new pools failed")

    async def _dra_start(self) -> None:
        """Start the DRA driver when it is needed; on failure one line, and retries in the background."""
        dra = self.dra
        if dra is None:
            if any(p.api is PoolApi.DRA for p in self.config.pools):
                log_event(log, "DRA pools are not served: DRA is off", level=logging.WARNING)
            return
        if dra.started or not dra.needed() or any(t.get_name() == "dra-start" for t in self._tasks):
            return
        if dra.driver != self.config.dra_driver_name:
            log_event(
                log,
                "draDriverName changes take effect at the next start",
                level=logging.WARNING,
                serving=dra.driver,
            )
        if not await self._dra_try_start(1):
            self._spawn(self._dra_retry(), "dra-start")

    async def _dra_try_start(self, attempt: int) -> bool:
        assert self.dra is not None
        try:
            await self.dra.start()
        except DraUnavailable as exc:
            if attempt == 1 or attempt % 10 == 0:
                log_event(log, "DRA driver cannot start; retrying", level=logging.WARNING, error=str(exc))
            return False
        except Exception:
            log.exception("DRA driver failed to start; retrying")
            return False
        return True

    async def _dra_retry(self) -> None:
        bounds = self.settings.dra.retry_s if self.settings.dra is not None else (0.5, 30.0)
        attempt = 1
        while True:
            await asyncio.sleep(backoff_delay(attempt, bounds))
            attempt += 1
            if await self._dra_try_start(attempt):
                return


def backoff_delay(attempt: int, bounds: tuple[float, float]) -> float:
    """Return the wait before retry ``attempt`` (1-based): the low bound, doubling, capped at the high."""
    low, high = bounds
    return min(low * 2 ** (attempt - 1), high)


def _options_of(pool: PoolConfig) -> tuple[bool, bool]:
    return pool.prestart, pool.preferred != "none"


def _config_identity(path: Path) -> tuple[str, int, int, int] | None:
    try:
        real = os.path.realpath(path)
        st = os.stat(real)
    except OSError:
        return None
    return real, st.st_ino, st.st_mtime_ns, st.st_size
