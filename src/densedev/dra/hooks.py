"""The daemon's side of DRA: the active driver, and the drivers a rename left behind until they are done.

The driver (gRPC DRA services, the API-server client, the ResourceSlice publisher) is imported where it is
built, so a device-plugin-only node never loads it (issue 14, start-up).

**Renaming the driver** (``draDriverName``) takes effect at the reload.  The old driver ``A`` cannot
simply go: the kubelet holds claims ``A`` prepared and will call ``A``'s NodeUnprepareResources for them
(retrying until it succeeds, pkg/kubelet/cm/dra/manager.go), and the devices those claims hold are in
use.  So ``A`` *retires*:

1. a new driver ``B`` is built (its own plugin dir, sockets and checkpoint) and takes the DRA pools;
2. ``A``'s slices are deleted by its own publisher at once (every slice is stale to a plan with no
   pools), so the scheduler allocates no new ``A`` claim; a claim allocated from them before is refused
   at Prepare with one line naming the rename (its allocation is one ``B``'s slices know nothing of:
   preparing it could hand out a device the scheduler has since given to a ``B`` claim);
3. ``A``'s kubelet plugin stays registered and serves Unprepare (and a repeated Prepare of a claim it
   prepared, which must answer the same: the kubelet re-sends it after its own restart);
4. the devices ``A``'s prepared claims hold are held in the ownership map under
   ``retiring_claims(A)``, withheld from every pool, ``B``'s DRA pools too;
5. once ``A`` holds no claim it stops: its sockets are removed (the kubelet deregisters it), then its
   checkpoint, CDI specs and plugin dir.  With nothing prepared this is immediate.

A rename while drivers retire retires the active one too (``A`` and ``B`` retire side by side, both
now refusing as renamed to ``C``); renaming back to a retiring driver makes that same instance active
again (one instance per name: the sockets and the checkpoint are per name).  At the daemon's start the
plugins dir is searched for densedev checkpoints (``checkpoints.find_checkpoints``): one of a name the config
no longer uses makes that driver a retiring one from the start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ..backoff import backoff_delay
from ..model import Config, Pool, PoolApi
from ..ops.logs import log_event
from ..ops.metrics import Gauge
from ..pools.ownership import DRA_CLAIMS, UNRESTORED, Ownership, retiring_claims
from . import CHECKPOINT_NAME as CLAIMS_CHECKPOINT
from . import DraSettings

if TYPE_CHECKING:
    from ..health.tracker import HealthTracker, PoolUpdate
    from ..node.holdings import PodResourcesClient
    from ..ops.metrics import Metrics
    from .configure import JournalMetrics
    from .driver import ClientFactory, DraDriver

log = logging.getLogger("densedev.dra.driver")  # the driver's lines, wherever in the package they start
_DEFAULT_CDI_DIR = Path("/var/run/cdi")  # alloc.cdi.DEFAULT_CDI_DIR, not imported for it at every start


class _Retiring:
    """A driver ``draDriverName`` no longer names, served until its last prepared claim is unprepared."""

    # A plain class: a mutable record compared by identity, made on every start's import and used only
    # after a rename, where a dataclass statement would cost each start ~0.3 ms (3.11 execs its methods).
    __slots__ = ("driver", "reactivated", "renamed_to", "stopping", "task", "wake")

    def __init__(self, driver: DraDriver, renamed_to: str) -> None:
        self.driver = driver
        self.renamed_to = renamed_to
        self.wake = asyncio.Event()  # its claims changed, or it is wanted
        self.task: asyncio.Task[None] | None = None
        self.stopping = False  # past the point of no return: sockets and files are going
        self.reactivated = False  # renamed back: the task leaves the driver as it is


class DraHooks:
    """The daemon's side of DRA: the active driver made once needed, fed every pool set, started with
    retries; and the retiring drivers a rename left, until their claims are unprepared."""

    def __init__(
        self,
        settings: DraSettings | None,
        ownership: Ownership,
        on_node: Callable[[str], bool],
        *,
        cdi_dir: Path | None,
        devinfo_dir: Path | None,
        dev_root: Path,
        client_factory: ClientFactory | None = None,
        metrics: Metrics | None = None,
        pod_resources: Path | None = None,
        pod_resources_poll_s: float = 5.0,
        sysfs_root: Path | None = None,
        on_health: Callable[[], None] | None = None,
    ) -> None:
        self.settings = settings  # None: DRA is off (pools with "api": "dra" are not served)
        # The kubelet's PodResources socket, read while a lost checkpoint is unsettled (``_kubelet_view``).
        self._pod_resources = pod_resources
        self._pod_resources_poll_s = pod_resources_poll_s
        self._view: asyncio.Task[None] | None = None
        self._metrics = metrics  # the DRA pools' device gauges, as the device-plugin pools have them
        self.ownership = ownership
        self._on_node = on_node
        self._cdi_dir = cdi_dir
        self._devinfo_dir = devinfo_dir
        self._dev_root = dev_root
        self._sysfs_root = sysfs_root  # where claim parameters change VF links (None: refused)
        self._on_health = on_health  # the tracker's facts changed outside a health event: flush them
        self._journal_metrics: JournalMetrics | None = None  # made with the first driver
        self._client = client_factory  # the API client's maker (tests); None: from the kubeconfig
        self.driver: DraDriver | None = None  # the one draDriverName names
        self.retiring: dict[str, _Retiring] = {}  # by driver name
        self._name: str | None = None  # draDriverName as last recovered (None: not yet)
        self._pending: str | None = None  # renamed back to a driver still stopping: made in start()
        self._last: tuple[Sequence[Pool], Sequence[Pool], HealthTracker] | None = None  # last take()
        self._retry: asyncio.Task[None] | None = None
        self._retry_for: DraDriver | None = None
        self._g_claims: Gauge | None = None
        self._g_unsettled: Gauge | None = None
        self._claims_series: set[tuple[str, str]] = set()
        self._unsettled_series: set[str] = set()

    def recover(self, config: Config) -> None:
        """Make the driver ``config`` names (retiring a renamed one) and hold what every driver's claims hold.

        Before anything is served at the daemon's start, and before a reload's pools are applied: the
        devices of prepared claims, under whichever name, must be held before a pool lists anything.
        """
        dra = self.settings
        if dra is None:
            return
        name = config.dra_driver_name
        if self._name is None:
            self._name = name
            self._find_renamed(dra, name)
        elif name != self._name:
            log_event(log, "draDriverName changed", old=self._name, new=name)
            self._name = name
            self._pending = None
            active, self.driver = self.driver, None
            for record in self.retiring.values():  # a rename while others retire: they now point here
                record.renamed_to = name
                record.driver.retire(name)
            if active is not None:
                self._retire(active, name)
        if self.driver is None:
            self.driver = self._take_over(name, config)
        self._claims_changed()

    def _find_renamed(self, dra: DraSettings, name: str) -> None:
        """At the daemon's start: make the drivers whose checkpoints a rename left retiring ones."""
        from .checkpoints import find_checkpoints  # light: no claims, gRPC or API client

        # A damaged checkpoint of a retired name counts when our CDI specs name its claims (fail closed).
        cdi_dir = self._cdi_dir if self._cdi_dir is not None else _DEFAULT_CDI_DIR
        for other in find_checkpoints(dra.plugins_dir, cdi_dir=cdi_dir):
            if other != name:
                driver = self._build(other)
                driver.recover()
                self._retire(driver, name, found=True)

    def _take_over(self, name: str, config: Config) -> DraDriver | None:
        """Return the driver of ``name``: a retiring one made active again, or a new one when needed."""
        record = self.retiring.get(name)
        if record is not None:
            if record.stopping:
                self._pending = name  # its files are going: a fresh instance once it is gone
                return None
            del self.retiring[name]
            record.reactivated = True
            record.wake.set()
            record.driver.reactivate()
            log_event(
                log, "DRA driver active again", driver=name, claims=len(record.driver.plugin.service.prepared)
            )
            return record.driver
        # Nothing to do for a node that never served DRA: no DRA pool and no claims checkpoint.
        assert self.settings is not None
        checkpoint = self.settings.plugins_dir / name / CLAIMS_CHECKPOINT
        if not any(p.api is PoolApi.DRA for p in config.pools) and not os.path.lexists(checkpoint):
            return None
        driver = self._build(name)
        driver.recover()
        return driver

    def _build(self, name: str) -> DraDriver:
        from .driver import DraDriver  # only now: a device-plugin-only node never loads the DRA side

        assert self.settings is not None
        if self._journal_metrics is None and self._metrics is not None:
            from .configure import JournalMetrics

            self._journal_metrics = JournalMetrics(self._metrics.registry)
        driver = DraDriver(
            self.settings,
            name,
            cdi_dir=self._cdi_dir,
            devinfo_dir=self._devinfo_dir,
            dev_root=self._dev_root,
            on_node=self._on_node,
            holder=self._holder,
            on_claims=self._claims_changed,
            client_factory=self._client,
            metrics=self._metrics,
            sysfs_root=self._sysfs_root,
            journal_metrics=self._journal_metrics,
        )
        # Before its recover: a lost checkpoint then waits for the kubelet's view (``_kubelet_view``).
        driver.plugin.service.kubelet_view = self._pod_resources is not None
        return driver

    def _drivers(self) -> list[DraDriver]:
        drivers = [] if self.driver is None else [self.driver]
        drivers.extend(r.driver for r in self.retiring.values())
        return drivers

    def _watch_kubelet(self) -> None:
        """Read PodResources in the background while some driver's lost checkpoint is unsettled."""
        if self._pod_resources is None or (self._view is not None and not self._view.done()):
            return
        if not any(d.plugin.service.unsettled is not None for d in self._drivers()):
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return  # not started yet: start() watches
        self._view = asyncio.create_task(self._kubelet_view(self._pod_resources), name="dra-podresources")

    async def first_view(self) -> None:
        """At the start, before any pool lists a device: one bounded PodResources read if it is awaited.

        A checkpoint lost together with a claim's CDI spec leaves a claim only the kubelet can name; a
        device-plugin pool that now covers its device must not list it even once.  A failed read
        changes nothing (the background reads go on, ``_kubelet_view``).
        """
        if self._pod_resources is None:
            return
        if not any((u := d.plugin.service.unsettled) is not None and u.pending for d in self._drivers()):
            return
        from ..node.holdings import PodResourcesClient

        client = PodResourcesClient(self._pod_resources)
        try:
            await self._read_view(client, failing=False)
        finally:
            await client.close()

    async def _read_view(self, client: PodResourcesClient, *, failing: bool) -> bool:
        """Read PodResources once and hand our drivers' claim uses to every unsettled driver.

        Return whether the read failed (one line when reads start failing, one when they answer again).
        """
        from functools import partial

        from ..node.holdings import SourceUnavailable, decode_pod_resources

        drivers = [d for d in self._drivers() if d.plugin.service.unsettled is not None]
        if not drivers:
            return False
        try:
            view = await client.read(
                partial(decode_pod_resources, drivers=frozenset(d.driver for d in drivers))
            )
        except SourceUnavailable as exc:
            if not failing:
                log_event(
                    log,
                    "DRA: cannot read the kubelet's PodResources; what a lost checkpoint leaves unsettled "
                    "stays held",
                    level=logging.WARNING,
                    error=str(exc),
                )
            return True
        if failing:
            log_event(log, "DRA: the kubelet's PodResources answer again")
        changed = False
        for driver in drivers:
            try:
                changed |= await driver.plugin.service.observe(view.claims)
            except Exception:
                log.exception("DRA %s: taking the kubelet's PodResources failed", driver.driver)
        if changed:
            self._claims_changed()
        return False

    async def _kubelet_view(self, socket: Path) -> None:
        """Hand each successful PodResources read to every unsettled driver until none is left.

        Evidence for the claims a lost checkpoint may have recorded (docs/ownership.md): a claim a running
        pod uses under our driver is held even when no CDI spec names it.  A failed read changes nothing
        (fail closed).
        """
        from ..node.holdings import PodResourcesClient

        client = PodResourcesClient(socket)
        failing = False
        try:
            while any(d.plugin.service.unsettled is not None for d in self._drivers()):
                failing = await self._read_view(client, failing=failing)
                await asyncio.sleep(self._pod_resources_poll_s)
        finally:
            await client.close()

    def _retire(self, driver: DraDriver, renamed_to: str, *, found: bool = False) -> None:
        """Retire ``driver`` (see the module docstring); its task serves it until it can stop."""
        claims = len(driver.plugin.service.prepared)
        driver.retire(renamed_to)
        record = _Retiring(driver, renamed_to)
        self.retiring[driver.driver] = record
        log_event(
            log,
            "DRA driver retiring",
            driver=driver.driver,
            renamed_to=renamed_to,
            claims=claims,
            found="checkpoint at start" if found else "-",
        )
        record.task = asyncio.create_task(self._retirement(record), name=f"dra-retire {driver.driver}")

    async def _retirement(self, record: _Retiring) -> None:
        """Serve a retiring driver while it holds claims (started with retries), then stop it for good."""
        driver = record.driver
        assert self.settings is not None
        attempt = 0
        while True:
            while not driver.done() and not record.reactivated:
                delay: float | None = None
                if not driver.started and driver.needed():  # prepared or unsettled claims
                    # Its plugin for Unprepare, its publisher to delete slices a previous run left.
                    attempt += 1
                    if await self._try_start(driver, attempt):
                        continue
                    delay = backoff_delay(attempt, self._bounds())
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await record.wake.wait()
                record.wake.clear()
            if record.reactivated:
                return
            if driver.plugin.started:
                # The kubelet reads its last answer before it sees the driver go (retire_linger_s);
                # a call arriving meanwhile (a retried Unprepare) keeps the driver serving.
                await asyncio.sleep(self.settings.retire_linger_s)
            # Its slices deleted first (the publisher's pass after ``retire``): bounded, because the
            # kubelet deletes a deregistered driver's slices itself (at once on 1.32, after 30 s from
            # 1.33, cm/dra/plugin/registration.go).  Everything up to here leaves the driver whole, so
            # a rename back meanwhile simply makes it active again.
            if driver.publisher is not None and not await driver.withdrawn(self.settings.withdraw_wait_s):
                log_event(
                    log,
                    "DRA slices of a retired driver not confirmed deleted; the kubelet deletes them "
                    "once it deregisters the driver",
                    level=logging.WARNING,
                    driver=driver.driver,
                )
            if driver.done() and not record.reactivated:
                break
        record.stopping = True
        await self._stop_retired(record)

    async def _stop_retired(self, record: _Retiring) -> None:
        """Stop a retiring driver holding no claim and answering no call: sockets, then its files."""
        driver = record.driver
        try:
            await driver.stop()  # the registration socket goes first: the kubelet deregisters it
        except Exception:
            log.exception("DRA driver %s failed to stop cleanly", driver.driver)
        try:
            driver.remove_state()
        except Exception:
            log.exception("DRA driver %s: removing its files failed", driver.driver)
        if self.retiring.get(driver.driver) is record:
            del self.retiring[driver.driver]
        self._claims_changed()
        log_event(log, "DRA driver stopped", driver=driver.driver, renamed_to=record.renamed_to)

    def _holder(self, device_id: str) -> str | None:
        """Name who else holds a device: a pod's resource, or a retiring driver's claim (the gate refuses)."""
        out: list[str] = []
        for holder in sorted(self.ownership.held.get(device_id, frozenset()) - {DRA_CLAIMS}):
            if holder == UNRESTORED:
                out.append("its settings from an earlier claim are not restored yet")
                continue
            record = next((r for n, r in self.retiring.items() if retiring_claims(n) == holder), None)
            if record is None:
                out.append(holder)
                continue
            ref = record.driver.plugin.service.held().get(device_id)
            what = f"claim {ref}" if ref is not None else "maybe a claim (its checkpoint was lost)"
            out.append(f"{what} of driver {record.driver.driver}, renamed to {record.renamed_to}")
        return ", ".join(out) or None

    def _claims_changed(self) -> None:
        """After a Prepare or Unprepare (any driver's): the ownership map follows the claims at once."""
        active = self.driver.claimed() if self.driver is not None else frozenset()
        retiring = {name: r.driver.claimed() for name, r in self.retiring.items()}
        unrestored = frozenset().union(*(d.unrestored() for d in self._drivers()))
        self.ownership.set_claimed(active, retiring, unrestored)
        self._manage_drivers()
        for record in self.retiring.values():
            if record.driver.done():
                record.wake.set()  # its last claim is gone and the kubelet answered: it may stop
        self._count_claims()
        self._watch_kubelet()

    def _manage_drivers(self) -> None:
        """Tell the health tracker which devices claims rebound on purpose (not a "driver-changed")."""
        if self._last is None:
            return
        from .configure import DRIVER  # light enough, but only wanted once claims change

        drivers = {
            r.device_id: str(r.old.get(DRIVER) or "")
            for d in self._drivers()
            for r in d.plugin.service.journal
            if DRIVER in r.new
        }
        if self._last[2].manage_drivers(drivers) and self._on_health is not None:
            self._on_health()

    def _count_claims(self) -> None:
        """Set the prepared-claims gauge, per driver and state (active or retiring), and the unsettled one."""
        counts: dict[tuple[str, str], int] = {}
        drivers = [] if self.driver is None else [self.driver]
        drivers.extend(r.driver for r in self.retiring.values())
        if self.driver is not None:
            counts[(self.driver.driver, "active")] = len(self.driver.plugin.service.prepared)
        for name, record in self.retiring.items():
            counts[(name, "retiring")] = len(record.driver.plugin.service.prepared)
        self._count_unsettled(drivers)
        if self._metrics is None or (not counts and self._g_claims is None):
            return
        gauge = self._g_claims
        if gauge is None:
            gauge = self._g_claims = Gauge(
                "densedev_dra_prepared_claims",
                "DRA claims prepared on this node, by driver name and state (active, or retiring: renamed).",
                ["driver", "state"],
                registry=self._metrics.registry,
            )
        for key in self._claims_series - counts.keys():
            gauge.remove(*key)  # a driver stopped, or one that changed state
        for (name, state), n in counts.items():
            gauge.labels(name, state).set(n)
        self._claims_series = set(counts)

    def _count_unsettled(self, drivers: Sequence[DraDriver]) -> None:
        """Set the gauges of what lost checkpoints leave held: claims unaccounted for, devices withheld."""
        unsettled = {d.driver: d.plugin.service.unsettled for d in drivers}
        live = {name: u for name, u in unsettled.items() if u is not None}
        if self._metrics is None or (not live and self._g_unsettled is None):
            return
        gauge = self._g_unsettled
        if gauge is None:
            gauge = self._g_unsettled = Gauge(
                "densedev_dra_unsettled",
                "What a DRA checkpoint that could not be read leaves held until the kubelet settles it: "
                "claims named by the CDI specs left on disk, and devices withheld, by driver.",
                ["driver", "what"],
                registry=self._metrics.registry,
            )
        for name in self._unsettled_series - live.keys():
            for what in ("claims", "devices"):
                gauge.remove(name, what)
        for name, u in live.items():
            gauge.labels(name, "claims").set(len(u.claims) + len(u.named))
            gauge.labels(name, "devices").set(len(u.held()))
        self._unsettled_series = set(live)

    def take(self, raw: Sequence[Pool], pools: Sequence[Pool], health: HealthTracker) -> None:
        """Hand the driver a new pool set (as configured, and as listed) and the owner of its health."""
        self._last = (raw, pools, health)
        self._manage_drivers()
        if self.driver is None:
            return
        try:
            grew = self.driver.take_pools(raw, pools, self.ownership.withheld)
            self.driver.take_health(health)
        except Exception:
            log.exception("DRA: taking the new pools failed")
        else:
            if grew:
                self._claims_changed()  # an unsettled driver holds its pool's devices: withhold them
        self._count(health, None)

    def take_changes(self, updates: Mapping[str, PoolUpdate], health: HealthTracker) -> None:
        """Hand the driver a health flush: its stream and its slices follow what changed."""
        if self.driver is None:
            return
        try:
            self.driver.take_changes(updates)
        except Exception:
            log.exception("DRA: publishing health failed")
        self._count(health, updates)

    def _count(self, health: HealthTracker, only: Mapping[str, PoolUpdate] | None) -> None:
        """Set the device gauges of the DRA pools (those in ``only`` when given) from the tracker."""
        if self._metrics is None or self.driver is None:
            return
        for pool in self.driver.listed:
            name = pool.config.full_name
            if only is None or name in only:
                ok, bad, reasons = health.counts(name)
                self._metrics.set_pool_devices(name, ok, bad, reasons)

    def waiting(self) -> bool:
        """Return whether the driver is needed but has not started (``/readyz`` says not ready)."""
        return self.driver is not None and self.driver.needed() and not self.driver.started

    async def start(self, config: Config) -> None:
        """Start the DRA driver when it is needed; on failure one line, and retries in the background."""
        self._watch_kubelet()
        if self._pending is not None:
            await self._replace_stopped(config)
        dra = self.driver
        if dra is None:
            if self.settings is None and any(p.api is PoolApi.DRA for p in config.pools):
                log_event(log, "DRA pools are not served: DRA is off", level=logging.WARNING)
            return
        retrying = self._retry is not None and not self._retry.done() and self._retry_for is dra
        if dra.started or not dra.needed() or retrying:
            return
        if not await self._try_start(dra, 1):
            self._retry_for = dra
            self._retry = asyncio.create_task(self._retry_start(dra), name="dra-start")

    async def _replace_stopped(self, config: Config) -> None:
        """Renamed back to a driver that was stopping: wait for it to be gone, then make it anew."""
        name, self._pending = self._pending, None
        record = self.retiring.get(name) if name is not None else None
        if record is not None and record.task is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(record.task)
        if name is None or self.driver is not None or name != self._name:
            return
        self.driver = self._take_over(name, config)
        self._claims_changed()
        if self._last is not None:
            self.take(*self._last)

    def _bounds(self) -> tuple[float, float]:
        return self.settings.retry_s if self.settings is not None else (0.5, 30.0)

    async def _try_start(self, driver: DraDriver, attempt: int) -> bool:
        from .driver import DraUnavailable  # loaded already: the driver is a DraDriver

        try:
            await driver.start()
        except DraUnavailable as exc:
            if attempt == 1 or attempt % 10 == 0:
                log_event(
                    log,
                    "DRA driver cannot start; retrying",
                    level=logging.WARNING,
                    driver=driver.driver,
                    error=str(exc),
                )
            return False
        except Exception:
            log.exception("DRA driver %s failed to start; retrying", driver.driver)
            return False
        return True

    async def _retry_start(self, driver: DraDriver) -> None:
        """Retry the active driver's start until it succeeds, or it is no longer the active one."""
        attempt = 1
        while True:
            await asyncio.sleep(backoff_delay(attempt, self._bounds()))
            attempt += 1
            if self.driver is not driver or driver.started:
                return  # renamed meanwhile: a retiring driver's own task starts it if it must
            if await self._try_start(driver, attempt):
                return

    async def stop(self) -> None:
        """Stop retrying and stop every driver (the slices stay: the kubelet owns their cleanup).

        A retiring driver's checkpoint stays too: the next start finds it and retires it again.
        """
        tasks = [
            t for t in (self._retry, self._view, *(r.task for r in self.retiring.values())) if t is not None
        ]
        self._retry, self._view = None, None
        self._pod_resources = None  # stopped: no read starts again
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for driver in (self.driver, *(r.driver for r in self.retiring.values())):
            if driver is None:
                continue
            try:
                await driver.stop()
            except Exception:
                log.exception("the DRA driver %s failed to stop cleanly", driver.driver)
