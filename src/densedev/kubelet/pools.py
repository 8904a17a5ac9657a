"""The device-plugin pools at the kubelet: one runtime per pool, and the set of them the daemon applies.

A ``PoolRuntime`` is what runs for one pool (feed, encoder, allocator, registration runner); the
``PoolSet`` owns them by name, applies a ``poolset.PoolChanges`` to them, retries a server that could
not start and says why none is serving.  The pool selection and the diff stay outside (``poolset``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import Callable, Collection, Coroutine, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..alloc.respond import AllocationSettings, PoolAllocator
from ..backoff import backoff_delay
from ..health.tracker import HealthTracker, PoolUpdate
from ..model import Pool, PoolApi, PoolConfig
from ..node.watch import DirectoryWatch
from ..ops.logs import log_event, summarise
from ..ops.metrics import MeteredService, Metrics
from ..pools.ownership import Ownership
from .feed import PoolFeed
from .guard import GuardedService
from .registration import PluginRunner
from .server import PoolService
from .sockets import remove_stale_sockets, socket_name_for
from .wire import ListEncoder

if TYPE_CHECKING:
    from ..poolset import PoolChanges
    from ..settings import DaemonSettings

PREPARE_DELAY_S = 0.5  # after a pool's start, when its allocator builds what GetPreferredAllocation needs

# The pools' lines keep the logger they were always logged under (log lines are an interface).
log = logging.getLogger("densedev.daemon")


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
        self.encoder = self._new_encoder(pool)
        self.allocator = PoolAllocator(
            pool,
            AllocationSettings(
                cdi_dir=settings.cdi_dir,
                devinfo_dir=settings.devinfo_dir,
                sysfs_root=settings.sysfs_root,
                dev_root=settings.dev_root,
                cdi_annotations=settings.cdi_annotations,
            ),
            # The tracker is the only holder of the members' health: the allocator asks it directly, not
            # through this runtime, so the runtime is in no reference cycle and goes as its pool stops,
            # although Daemon.start gc.freeze()s it (the collector never looks at it again).
            functools.partial(health.is_healthy, pool.config.full_name),
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
        return ListEncoder(tuple(m.id for m in pool.members), numa, name=pool.config.full_name)

    @property
    def name(self) -> str:
        """Return the pool's extended resource name."""
        return self.pool.config.full_name

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


class PoolSet(Mapping[str, PoolRuntime]):
    """The device-plugin pools' runtimes by name: set up, started (retried while they fail), updated, stopped.

    Readiness comes from here too: which pools could not start and why (``/readyz``), and since when
    none is served (the exit code).  DRA pools have no runtime: the DRA driver serves them.
    """

    def __init__(
        self,
        settings: DaemonSettings,
        metrics: Metrics,
        watch: DirectoryWatch,
        ownership: Ownership,
        health: HealthTracker,
        *,
        clock: Callable[[], float],
        spawn: Callable[[Coroutine[Any, Any, None], str], None],
    ) -> None:
        self._settings = settings
        self._metrics = metrics
        self._kubelet_watch = watch
        self._ownership = ownership
        self._health = health
        self._clock = clock
        self._spawn = spawn  # the daemon's tasks: a retry is cancelled with them at stop
        self._runtimes: dict[str, PoolRuntime] = {}
        self._start_errors: dict[str, str] = {}  # pool -> why its server could not start (retried)
        self._all_failed_since: float | None = None  # since when no configured pool is served

    def __getitem__(self, name: str) -> PoolRuntime:
        return self._runtimes[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._runtimes)

    def __len__(self) -> int:
        return len(self._runtimes)

    def not_serving(self) -> str | None:
        """Return why some pool's server is not serving (for /readyz), or None when every one started."""
        if self.start_failed():
            return f"no pool could start for {self._settings.start_timeout_s:g} s: {self._failure_text()}"
        if self._start_errors:
            return "not serving: " + self._failure_text()
        return None

    def unregistered(self) -> list[str]:
        """Return the pools the kubelet has not registered (yet, or again since its restart)."""
        return [n for n, r in self._runtimes.items() if not r.runner.registered]

    def record_registrations(self) -> None:
        """Copy each pool's registration state and count into the metrics (the housekeeping loop's job)."""
        for name, r in self._runtimes.items():
            self._metrics.set_registered(name, r.runner.registered)
            while r.registrations_seen < r.runner.registrations:
                r.registrations_seen += 1
                self._metrics.record_registration(name, True)

    def allocators(self) -> dict[str, PoolAllocator]:
        """Return every pool's allocator by name (whose files the leftovers keep or prune)."""
        return {n: r.allocator for n, r in self._runtimes.items()}

    def take(self, pools: Sequence[Pool], replaced: Collection[str]) -> list[PoolRuntime]:
        """Set up every device-plugin pool without a runtime, give ``replaced`` ones their new membership.

        Returns the runtimes set up now, for ``start`` once the caller has done its part.
        """
        started: list[PoolRuntime] = []
        for pool in pools:
            runtime = self._runtimes.get(pool.config.full_name)
            if runtime is None:
                # New, re-registering, back from DRA, or one whose set-up failed before: set it up now.
                if pool.config.api is not PoolApi.DRA:
                    healthy = self._health.healthy(pool.config.full_name)
                    new = self._set_up(pool, healthy)
                    if new is not None:
                        started.append(new)
                continue
            if pool.config.full_name in replaced:
                before = {m.id for m in runtime.pool.members}
                after = {m.id for m in pool.members}
                healthy = self._health.healthy(runtime.name)
                try:
                    nbytes = runtime.replace(pool, healthy)
                except Exception:
                    log.exception("pool %s: applying the new membership failed", runtime.name)
                    continue
                self._health.published(runtime.name)  # the whole list just went out
                self._metrics.record_send(runtime.name, nbytes, None)
                self._report_counts(runtime.name)
                log_event(
                    log,
                    "pool membership changed",
                    pool=runtime.name,
                    devices=len(pool.members),
                    added=summarise(sorted(after - before)),
                    removed=summarise(sorted(before - after)),
                )
        return started

    async def stop_changed(self, changes: PoolChanges) -> None:
        """Stop the servers of removed, re-registering and DRA-bound pools; forget removed ones' series.

        The stops run at once, as ``close`` runs them: each waits up to its grace for its streams to
        end, and one after another those waits added up over 1,000 pools (the gRPC server starts and
        stops themselves still take turns in ``lifecycle``).
        """
        stopping = []
        for n in changes.stopped:
            runtime = self._runtimes.pop(n, None)
            if runtime is not None:
                deleted = n in changes.removed and not self._ownership.may_be_held(n)
                stopping.append(self._stop_runtime(runtime, deleted=deleted))
        await asyncio.gather(*stopping)
        self._metrics.remove_pools(changes.removed)

    async def start(self, runtimes: Iterable[PoolRuntime]) -> None:
        """Start each runtime's server and registration; one that fails is retried with backoff."""
        runtimes = list(runtimes)
        await asyncio.gather(*(self._start_runner(r) for r in runtimes))
        # Their allocators' ranking data (GetPreferredAllocation's) is built once the first lists are
        # out, not before: the kubelet asks for a preferred allocation only for a pod it admits later.
        loop = asyncio.get_running_loop()
        for runtime in runtimes:
            loop.call_later(PREPARE_DELAY_S, self._prepare, runtime)

    def _prepare(self, runtime: PoolRuntime) -> None:
        if self._runtimes.get(runtime.name) is not runtime:
            return  # stopped or replaced meanwhile
        try:
            runtime.allocator.prepare()
        except Exception:  # a timer callback: never let it reach the loop; the first call builds it
            log.exception("pool %s: preparing the preferred-allocation ranking failed", runtime.name)

    async def close(self) -> None:
        """Stop every pool's server (the daemon stops): CDI specs stay for the containers that use them."""
        await asyncio.gather(*(self._stop_runtime(r) for r in self._runtimes.values()))

    def remove_stale_sockets(self, configured: Iterable[PoolConfig]) -> None:
        """Delete dead sockets of pools an earlier run served and the config no longer has."""
        keep = {socket_name_for(p.full_name, self._settings.kubelet_dir) for p in configured}
        removed = remove_stale_sockets(self._settings.kubelet_dir, keep)
        if removed:
            log_event(log, "removed stale pool sockets", files=summarise(removed, noun="file"))

    def _set_up(self, pool: Pool, healthy: Sequence[bool]) -> PoolRuntime | None:
        """Build a pool's runtime and publish its first list; None (logged) if it cannot be set up."""
        name = pool.config.full_name
        try:
            runtime = PoolRuntime(
                pool, self._settings, self._metrics, self._kubelet_watch, self._ownership, health=self._health
            )
        except Exception:
            # A failure in one pool (unwritable CDI dir, bad policy) must never take down another.
            log.exception("pool %s could not be set up; the other pools go on", name)
            return None
        runtime.publish(healthy, None)
        self._health.published(name)
        self._runtimes[name] = runtime
        self._report_counts(name)
        return runtime

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
            delay = backoff_delay(attempt, self._settings.start_retry_s)
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
        while self._runtimes.get(runtime.name) is runtime:
            await asyncio.sleep(backoff_delay(attempt, self._settings.start_retry_s))
            if self._runtimes.get(runtime.name) is not runtime:
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
        if runtime.name not in self._runtimes:  # removed by a reload: its failure no longer counts
            self._start_errors.pop(runtime.name, None)
        self._note_failing()

    def _start_error_text(self, exc: Exception) -> str:
        """Say why a pool's server could not start, naming an unwritable kubelet dir plainly."""
        kubelet_dir = self._settings.kubelet_dir
        # bind(2) of a unix socket needs write access to the directory (EACCES, or EROFS on a read-only
        # mount); gRPC reports either as "Failed to bind" without the errno, so look for ourselves.
        if kubelet_dir.is_dir() and not os.access(kubelet_dir, os.W_OK):
            return f"{kubelet_dir} is not writable"
        return f"{type(exc).__name__}: {exc}"

    def _note_failing(self) -> None:
        failing = bool(self._runtimes) and all(n in self._start_errors for n in self._runtimes)
        if not failing:
            self._all_failed_since = None
        elif self._all_failed_since is None:
            self._all_failed_since = self._clock()

    def _failure_text(self) -> str:
        return "; ".join(f"{n}: {e}" for n, e in sorted(self._start_errors.items()))

    def start_failed(self) -> bool:
        """Return whether no configured pool has been served for ``start_timeout_s`` seconds."""
        since = self._all_failed_since
        return since is not None and self._clock() - since >= self._settings.start_timeout_s

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

    def publish(self, updates: Mapping[str, PoolUpdate], latency: float | None, events: int) -> None:
        """Publish a health flush to the pools it names: one message, one log line per direction, the gauges.

        ``latency``: seconds since the burst's first event (None: a hold-down ended); ``events``: how
        many the burst folded.  A pool without a runtime (DRA, or not set up) is skipped.
        """
        for name, upd in updates.items():
            runtime = self._runtimes.get(name)
            if runtime is None:
                continue
            try:
                nbytes = runtime.publish(upd.healthy, upd.changed)
            except Exception:
                log.exception("pool %s: publishing failed", runtime.name)
                continue
            self._metrics.record_send(runtime.name, nbytes, latency, events)
            self._report_change(runtime, upd)

    def _report_change(self, runtime: PoolRuntime, upd: PoolUpdate) -> None:
        """One log line per pool and direction, and the per-pool gauges; never a line per device."""
        members = runtime.pool.members
        down_pos = [p for p in upd.changed if not upd.healthy[p]]
        down = [members[p].id for p in down_pos]
        up = [members[p].id for p in upd.changed if upd.healthy[p]]
        self._metrics.record_transitions(runtime.name, len(down), len(up))
        if down:
            # Reasons of a sample are enough for the log line; the metrics count every device.
            why = sorted({r for p in down_pos[:64] for r in self._health.reasons(members[p].device.id)})
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
        self._report_counts(runtime.name)

    def _report_counts(self, name: str) -> None:
        """Set the pool's device gauges from the health tracker: counts by health, unhealthy by reason."""
        ok, bad, reasons = self._health.counts(name)
        self._metrics.set_pool_devices(name, ok, bad, reasons)
