"""The DRA side of the running daemon: one driver serving the pools whose API is DRA.

The daemon owns the engine (one scan, one config, one health tracker, one ownership map); this module
turns what it hands over into the two DRA surfaces: ResourceSlices at the API server (``Publisher``)
and the kubelet plugin (``KubeletPlugin``: registration, NodePrepareResources, the health stream).

Order matters and is the daemon's to keep (see ``Daemon.start``), through ``DraHooks``:

1. ``recover()`` loads the prepared claims' checkpoint before anything is served, so the devices
   they hold count as held in the ownership map and the device-plugin side never lists them;
2. ``take_pools`` / ``take_health`` after every pool change, ``take_changes`` after every health flush
   (health itself stays in the daemon's tracker: the gate and the slices read it there);
3. ``start()`` serves the kubelet (at once: claims prepared before stay unpreparable while the API
   server is away), then connects to the API server and publishes; retried until it can.

The kubelet plugin is served as long as the daemon runs once started, even when a reload leaves no
DRA pool: the kubelet still has to unprepare the claims prepared before (kubelet
``pkg/kubelet/cm/dra/manager.go`` retries NodeUnprepareResources until it succeeds).  For the same
reason a driver ``draDriverName`` no longer names is ``retire``d rather than stopped: no slices, no new
claims, its prepared claims served until unprepared (``hooks.py`` says when it stops).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..alloc import cdi
from ..health.tracker import HealthTracker, PoolUpdate
from ..model import Pool, PoolApi
from ..node.vflinks import links_for
from ..node.watch import DirectoryWatch
from ..ops.logs import log_event
from . import DraSettings
from .apiclient import HttpClaimReader, ResourceClient
from .claims import Grant, PoolGate
from .configure import JournalMetrics
from .plugin import KubeletPlugin
from .publisher import Publisher, PublisherSettings
from .status import ClaimStatus, NetInfo

if TYPE_CHECKING:
    from ..ops.metrics import Metrics

log = logging.getLogger("densedev.dra.driver")


class DraUnavailable(Exception):
    """The DRA side cannot start (no node name, no API server): DRA pools stay unserved, retried."""


ClientFactory = Callable[[], Awaitable[ResourceClient]]


class _LateReader:
    """A ClaimReader that reads through the API client once it exists (the plugin is built before)."""

    def __init__(self) -> None:
        self.reader: HttpClaimReader | None = None

    async def get(self, namespace: str, name: str) -> Mapping[str, Any]:
        """Return the ResourceClaim, or fail as the API client does."""
        if self.reader is None:
            raise LookupError("the API server is not connected yet")
        return await self.reader.get(namespace, name)


class DraDriver:
    """One DRA driver on this node, fed by the daemon's pools, health and ownership map."""

    def __init__(
        self,
        settings: DraSettings,
        driver: str,
        *,
        cdi_dir: Path | None,
        devinfo_dir: Path | None,
        dev_root: Path,
        on_node: Callable[[str], bool],
        holder: Callable[[str], str | None],
        on_claims: Callable[[], None],
        client_factory: ClientFactory | None = None,
        watch: DirectoryWatch | None = None,
        metrics: Metrics | None = None,
        sysfs_root: Path | None = None,
        journal_metrics: JournalMetrics | None = None,
    ) -> None:
        self.settings = settings
        self.driver = driver
        self._factory = client_factory
        self._metrics = metrics  # the publisher's counts of conflicting and cut slice writes
        self._tracker: HealthTracker | None = None  # the daemon's, from take_health: it alone holds health
        # The IDs each listed DRA pool advertises unhealthy, by pool name (kept from flush to flush).
        self._bad: dict[str, set[str]] = {}
        self.gate = PoolGate(on_node, (), self._healthy, holder)
        self._reader = _LateReader()
        self.plugin = KubeletPlugin(
            driver,
            settings.node_name or "",
            self._reader,
            self.gate,
            plugins_dir=settings.plugins_dir,
            registry_dir=settings.registry_dir,
            cdi_dir=cdi_dir if cdi_dir is not None else cdi.DEFAULT_CDI_DIR,
            devinfo_dir=devinfo_dir,
            dev_root=dev_root,
            watch=watch,
            # Claim parameters change VF links: the kernel's, or a simulated node's (sysfs root).
            links=links_for(sysfs_root) if sysfs_root is not None else None,
            journal_metrics=journal_metrics,
            sysfs_root=sysfs_root,  # where a claim's driver rebind is written (node/rebind.py)
        )
        self.plugin.service.on_change = on_claims
        self.plugin.service.on_idle = on_claims  # a retiring driver may stop once the kubelet is answered
        # The claims' status.devices (issue 25 §3): queued from the first Prepare, written once connected.
        self.claim_status = ClaimStatus(driver, self._status_client, describe=self._net_info, metrics=metrics)
        self.plugin.service.claim_status = self.claim_status
        self.client: ResourceClient | None = None
        self.publisher: Publisher | None = None
        self.pools: tuple[Pool, ...] = ()  # the DRA pools as configured (nothing withheld)
        self.withheld: frozenset[str] = frozenset()  # their devices held through the other API
        self._listed: tuple[Pool, ...] = ()  # the DRA pools as listed (withheld devices taken out)
        self.started = False  # publishing and serving the kubelet
        self.renamed_to: str | None = None  # retiring: draDriverName now names this driver instead
        # Starts and stops one at a time: a retiring driver's start (its own retry) and the daemon's
        # start of the driver made active again may overlap.
        self._lock = asyncio.Lock()

    # ------------------------------------------------------------------------------------- state
    def recover(self) -> frozenset[str]:
        """Load the prepared claims (before anything is served); return the device IDs they hold."""
        return self.plugin.recover()

    def unrestored(self) -> frozenset[str]:
        """Return the devices whose settings a claim changed are not back yet (withheld from every pool)."""
        return self.plugin.service.unrestored()

    def claimed(self) -> frozenset[str]:
        """Return the device IDs prepared claims hold now (and, while unsettled, what a lost record may)."""
        return self.plugin.service.withheld()

    def _status_client(self) -> ResourceClient | None:
        """Return the API client once connected (its version discovered), else None (retried later)."""
        client = self.client
        return client if client is not None and client.version is not None else None

    def _net_info(self, device_id: str) -> NetInfo:
        """Return the device's host interface name as the pools know it (no MAC: the scan keeps none)."""
        verdict = self.gate(device_id)
        grant = verdict if isinstance(verdict, Grant) else verdict.grant  # a claim's device is held
        if grant is None or not grant.device.netdevs:
            return NetInfo()
        return NetInfo(grant.device.netdevs[0])

    def _healthy(self, device_id: str) -> bool:
        """Return whether the tracker advertises the device healthy (the gate's question at Prepare)."""
        # A device the tracker lists in no pool is one withheld from its pool: the gate then names
        # who holds it rather than calling it unhealthy.
        return self._tracker is None or self._tracker.device_healthy(device_id)

    def _unhealthy(self, updates: Mapping[str, PoolUpdate] | None = None) -> frozenset[str]:
        """Return the DRA pools' devices the tracker advertises unhealthy.

        With a flush's ``updates``, a pool's set follows the positions that changed: with a
        65,536-device pool mostly down, reading every unhealthy device from the bitmaps at each flush
        was 27 ms of the loop.  Without, or for a pool not seen before, it is read from the tracker.
        """
        tracker = self._tracker
        if tracker is None:
            self._bad = {}
            return frozenset()
        bad: dict[str, set[str]] = {}
        for pool in self._listed:
            name = pool.config.full_name
            have = self._bad.get(name) if updates is not None else None
            if have is None:
                have = set(tracker.unhealthy_devices(name))
            elif (upd := updates.get(name)) is not None:  # type: ignore[union-attr]
                members = pool.members
                for p in upd.changed:
                    # All of a device's members (a shared RDMA pool's) share its health.
                    (have.discard if upd.healthy[p] else have.add)(members[p].device.id)
            bad[name] = have
        self._bad = bad
        return frozenset().union(*bad.values())

    def done(self) -> bool:
        """Return whether the driver holds no prepared claim and answers no kubelet call (may stop)."""
        service = self.plugin.service
        return (
            not service.prepared
            and service.unsettled is None
            and service.calls == 0
            and not service.unrestored()
        )

    def needed(self) -> bool:
        """Return whether the driver must run: DRA pools are configured or claims are still prepared."""
        service = self.plugin.service
        return (
            bool(self.pools)
            or bool(service.prepared)
            or service.unsettled is not None
            or bool(service.unrestored())
        )

    def take_pools(
        self, raw: Sequence[Pool], listed: Sequence[Pool], withheld: Mapping[str, Sequence[str]]
    ) -> bool:
        """Take the daemon's pools (as configured, and as listed in its order) and what is withheld.

        Return whether the devices the driver holds grew: while a lost checkpoint is unsettled every
        device of its DRA pools counts as held (and stays so should a reload move it to another pool).
        """
        pools = tuple(p for p in raw if p.config.api is PoolApi.DRA)
        self._bad = {}  # member positions may have moved: the next read of health starts afresh
        # A rescan or an ownership change re-applies every pool; the slices are re-planned only when
        # the DRA pools themselves changed (a new plan costs a pass over their devices).
        replan = pools != self.pools
        self.pools = pools
        self._listed = tuple(p for p in listed if p.config.api is PoolApi.DRA)
        # A DRA pool never shares members (no rdmaShared), so member IDs are device IDs.
        self.withheld = frozenset(i for p in self.pools for i in withheld.get(p.config.full_name, ()))
        if replan:
            self.gate.set_pools(self.pools)
        if self.publisher is not None:
            self.publisher.update(pools=self.pools if replan else None, withheld=self.withheld)
        return self.plugin.service.widen(m.device.id for p in pools for m in p.members)

    def retire(self, renamed_to: str) -> None:
        """Offer nothing more: withdraw every slice, refuse new claims, keep the prepared ones' Unprepare.

        The scheduler allocates from the slices of a driver name; once ``draDriverName`` names another
        driver, an allocation from ours is one the new driver's slices know nothing of, so ours are
        deleted at once (the publisher's next pass, every slice being stale) and a claim allocated
        from them before that is refused at Prepare (see ``NodeService.refusing``).  Claims prepared
        already stay served until the kubelet unprepares them (it retries NodeUnprepareResources until
        it succeeds, pkg/kubelet/cm/dra/manager.go).
        """
        self.renamed_to = renamed_to
        self.plugin.service.refusing = (
            f"driver {self.driver} was renamed to {renamed_to} (draDriverName) and its ResourceSlices "
            f"withdrawn; a claim allocated from them is not prepared: delete it (or its pod) so that it "
            f"is allocated from {renamed_to}'s"
        )
        self.pools, self._listed, self.withheld = (), (), frozenset()
        self.gate.set_pools(())
        # The devices of claims still prepared leave every pool's listing (ownership withholds them),
        # so the tracker no longer follows them: their last health stays in the stream, the rest goes.
        stream = self.plugin.health
        gone = stream.devices() - set(self.plugin.service.held())
        if gone:
            stream.forget(gone)
        if self.publisher is not None:
            self.publisher.update(pools=(), withheld=frozenset(), unhealthy=frozenset())

    def reactivate(self) -> None:
        """Serve under this name again (``draDriverName`` renamed back); ``take_pools`` republishes."""
        self.renamed_to = None
        self.plugin.service.refusing = ""

    def remove_state(self) -> None:
        """Remove the checkpoint, CDI specs, sockets and plugin dir of a stopped driver holding no claim."""
        self.plugin.remove_state()

    async def withdrawn(self, timeout: float) -> bool:
        """Wait until the server holds none of our slices (after ``retire``); False after ``timeout``."""
        publisher = self.publisher
        if publisher is None:
            return False
        try:
            async with asyncio.timeout(timeout):
                await publisher.wait_idle()
        except TimeoutError:
            return False
        return True

    @property
    def listed(self) -> tuple[Pool, ...]:
        """The DRA pools as listed (devices held through the other API taken out)."""
        return self._listed

    def take_health(self, tracker: HealthTracker) -> None:
        """After a pool change: stream the DRA pools' advertised health from the tracker."""
        self._tracker = tracker
        health: dict[str, bool] = {}
        for pool in self._listed:
            for m, ok in zip(pool.members, tracker.healthy(pool.config.full_name), strict=True):
                health[m.device.id] = ok
        stream = self.plugin.health
        gone = stream.devices() - health.keys()
        if gone:
            stream.forget(gone)
        stream.update(health)
        if self.publisher is not None:
            self.publisher.update(unhealthy=self._unhealthy())

    def take_changes(self, updates: Mapping[str, PoolUpdate]) -> None:
        """Take a health flush (the tracker's updates by pool name): stream and publish what changed.

        Costs the devices that changed, not the node: a PF going down at 16k devices touches its 256.
        """
        delta: dict[str, bool] = {}
        for pool in self._listed:
            upd = updates.get(pool.config.full_name)
            if upd is None:
                continue
            members = pool.members
            for p in upd.changed:
                delta[members[p].device.id] = upd.healthy[p]
        if not delta:
            return
        self.plugin.health.update(delta)
        if self.publisher is not None:
            # After the health stream's turn, which update() has just queued: the kubelet is told
            # first, and the slices' set of unhealthy devices (3 ms at 65,536 devices) follows.  Queued
            # in order, so successive flushes reach the slices in the order they happened.
            asyncio.get_running_loop().call_soon(self._publish_unhealthy, updates)

    def _publish_unhealthy(self, updates: Mapping[str, PoolUpdate]) -> None:
        try:
            if self.publisher is not None:
                self.publisher.update(unhealthy=self._unhealthy(updates))
        except Exception:
            log.exception("DRA: publishing health to the slices failed")

    # ------------------------------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Serve the kubelet, then connect to the API server and publish; DraUnavailable if it cannot.

        The kubelet side comes first and stays up whatever the API server does: claims prepared before
        a restart must be unpreparable even while the API server cannot be reached (the kubelet retries
        NodeUnprepareResources until it succeeds, pkg/kubelet/cm/dra/manager.go), and a Prepare then
        fails per claim (its ResourceClaim cannot be read) rather than the plugin being absent.  Called
        again (the daemon retries with backoff), it only connects and publishes.
        """
        async with self._lock:
            await self._start()

    async def _start(self) -> None:
        if self.started:
            return
        node = self.settings.node_name
        if not node:
            raise DraUnavailable("serving DRA pools needs the node's name: --node-name or $NODE_NAME")
        if not self.plugin.started:  # the kubelet side, served before the API server answers too
            await self.plugin.start()
        if self.client is None:
            try:
                if self._factory is not None:
                    self.client = await self._factory()
                else:
                    self.client = await ResourceClient.from_kubeconfig(self.settings.kubeconfig)
            except Exception as exc:
                why = f"{type(exc).__name__}: {exc}"
                raise DraUnavailable(f"cannot configure the API client: {why}") from None
            # Every request names the node (audit log, APF flow), writes are metered for the node as a whole.
            self.client.identify(node)
            self.client.limit_writes(self.settings.write_qps, self.settings.write_burst)
        try:
            await self.client.discover()
        except Exception as exc:
            # The next attempt builds the client anew: a kubeconfig or token fixed meanwhile is read.
            client, self.client = self.client, None
            with contextlib.suppress(Exception):
                await client.close()
            raise DraUnavailable(f"the API server does not answer: {type(exc).__name__}: {exc}") from None
        self._reader.reader = HttpClaimReader(self.client)
        # The claims prepared before a restart: their status is checked again (written only where it
        # differs), since what was still pending when the daemon stopped was dropped.
        service = self.plugin.service
        for claim in service.prepared.values():
            self.claim_status.prepared(claim.ref, claim.devices, service.applied(claim.ref.uid))
        settings = PublisherSettings(
            node,
            self.driver,
            taints=self.settings.taints,
            min_write_interval_s=self.settings.min_write_interval_s,
        )
        publisher = Publisher(self.client, settings, self.pools, metrics=self._metrics)
        publisher.update(withheld=self.withheld, unhealthy=self._unhealthy())
        await publisher.start()
        self.publisher = publisher
        # The kubelet deletes the node's slices of a driver it (re)registers; publish again then
        # (the reflector sees the deletions too, this is the prompt path).
        self.plugin.on_registered = publisher.poke
        self.started = True
        log_event(
            log,
            "DRA driver started" if self.renamed_to is None else "DRA driver started to retire",
            driver=self.driver,
            node=node,
            version=publisher.version.value,
            pools=len(self.pools),
            devices=sum(len(p.members) for p in self.pools),
            prepared=len(self.plugin.service.prepared),
        )

    async def stop(self) -> None:
        """Stop serving the kubelet and publishing (the slices stay: the kubelet owns their cleanup)."""
        async with self._lock:
            await self._stop()

    async def _stop(self) -> None:
        await self.plugin.stop()
        await self.claim_status.close()  # best-effort: what is still pending is dropped
        if self.publisher is not None:
            await self.publisher.stop()
            self.publisher = None
        if self.client is not None:
            try:
                await self.client.close()
            except Exception:
                log.exception("closing the API client failed")
            self.client = None
        self.started = False
