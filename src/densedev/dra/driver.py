"""The DRA side of the running daemon: one driver serving the pools whose API is DRA.

The daemon owns the engine (one scan, one config, one health tracker, one ownership map); this module
turns what it hands over into the two DRA surfaces: ResourceSlices at the API server (``Publisher``)
and the kubelet plugin (``KubeletPlugin``: registration, NodePrepareResources, the health stream).

Order matters and is the daemon's to keep (see ``Daemon.start``), through ``DraHooks``:

1. ``recover()`` loads the prepared claims' checkpoint before anything is served, so the devices
   they hold count as held in the ownership map and the device-plugin side never lists them;
2. ``take_pools`` / ``take_health`` after every pool change and every health flush;
3. ``start()`` connects to the API server, publishes, and serves the kubelet.

The kubelet plugin is served as long as the daemon runs once started, even when a reload leaves no
DRA pool: the kubelet still has to unprepare the claims prepared before (kubelet
``pkg/kubelet/cm/dra/manager.go`` retries NodeUnprepareResources until it succeeds).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..alloc import cdi
from ..backoff import backoff_delay
from ..kubelet.watch import DirectoryWatch
from ..model import Config, Pool, PoolApi
from ..ops.logs import log_event
from ..pools.ownership import DRA_CLAIMS, Ownership
from .apiclient import HttpClaimReader, ResourceClient
from .claims import CHECKPOINT_NAME as CLAIMS_CHECKPOINT
from .claims import PoolGate
from .plugin import KubeletPlugin
from .publisher import Publisher, PublisherSettings
from .registration import DEFAULT_PLUGINS_DIR, DEFAULT_REGISTRY_DIR

log = logging.getLogger("densedev.dra.driver")


class DraUnavailable(Exception):
    """The DRA side cannot start (no node name, no API server): DRA pools stay unserved, retried."""


@dataclass(frozen=True)
class DraSettings:
    """Where the DRA side talks to the kubelet and the API server."""

    node_name: str | None = None  # the Node object's name: the ResourceSlices' pool and nodeName
    kubeconfig: Path | None = None  # None: the in-cluster service account
    plugins_dir: Path = DEFAULT_PLUGINS_DIR
    registry_dir: Path = DEFAULT_REGISTRY_DIR
    taints: bool = False  # taint unhealthy devices NoSchedule instead of withdrawing them
    min_write_interval_s: float = 1.0  # per slice: at most one write per interval
    retry_s: tuple[float, float] = (0.5, 30.0)  # backoff of a start that failed


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
    ) -> None:
        self.settings = settings
        self.driver = driver
        self._factory = client_factory
        self._health: dict[str, bool] = {}
        self._unhealthy: set[str] = set()
        # A device the tracker has no word on is one withheld from its pool: the gate then names
        # who holds it rather than calling it unhealthy.
        self.gate = PoolGate(on_node, (), lambda d: self._health.get(d, True), holder)
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
        )
        self.plugin.service.on_change = on_claims
        self.client: ResourceClient | None = None
        self.publisher: Publisher | None = None
        self.pools: tuple[Pool, ...] = ()  # the DRA pools as configured (nothing withheld)
        self.withheld: frozenset[str] = frozenset()  # their devices held through the other API
        self.indexes: tuple[int, ...] = ()  # positions of the DRA pools in the daemon's pool order
        self._listed: tuple[Pool, ...] = ()  # the DRA pools as listed (withheld devices taken out)
        self.started = False

    # ------------------------------------------------------------------------------------- state
    def recover(self) -> frozenset[str]:
        """Load the prepared claims (before anything is served); return the device IDs they hold."""
        return self.plugin.service.recover()

    def claimed(self) -> frozenset[str]:
        """Return the device IDs prepared claims hold now."""
        return frozenset(self.plugin.service.held())

    def needed(self) -> bool:
        """Return whether the driver must run: DRA pools are configured or claims are still prepared."""
        return bool(self.pools) or bool(self.plugin.service.prepared)

    def take_pools(
        self, raw: Sequence[Pool], listed: Sequence[Pool], withheld: Mapping[str, Sequence[str]]
    ) -> None:
        """Take the daemon's pools (as configured, and as listed in its order) and what is withheld."""
        pools = tuple(p for p in raw if p.config.api is PoolApi.DRA)
        # A rescan or an ownership change re-applies every pool; the slices are re-planned only when
        # the DRA pools themselves changed (a new plan costs a pass over their devices).
        replan = pools != self.pools
        self.pools = pools
        self.indexes = tuple(i for i, p in enumerate(listed) if p.config.api is PoolApi.DRA)
        self._listed = tuple(listed[i] for i in self.indexes)
        # A DRA pool never shares members (no rdmaShared), so member IDs are device IDs.
        self.withheld = frozenset(i for p in self.pools for i in withheld.get(p.config.full_name, ()))
        if replan:
            self.gate.set_pools(self.pools)
        if self.publisher is not None:
            self.publisher.update(pools=self.pools if replan else None, withheld=self.withheld)

    def take_health(self, health_of: Callable[[int], Sequence[bool]]) -> None:
        """Take the advertised health (hold-down applied) of the DRA pools from the daemon's tracker."""
        health: dict[str, bool] = {}
        for i, pool in zip(self.indexes, self._listed, strict=True):
            for m, ok in zip(pool.members, health_of(i), strict=True):
                health[m.device.id] = bool(ok)
        gone = self._health.keys() - health.keys()
        self._health = health
        self._unhealthy = {d for d, ok in health.items() if not ok}
        if gone:
            self.plugin.health.forget(gone)
        self.plugin.health.update(health)
        if self.publisher is not None:
            self.publisher.update(unhealthy=self._unhealthy)

    def take_changes(self, changes: Mapping[int, tuple[Sequence[bool], Sequence[int]]]) -> None:
        """Take a health flush: per pool position, the members' health and the positions that changed.

        Costs the devices that changed, not the node: a PF going down at 16k devices touches its 256.
        """
        delta: dict[str, bool] = {}
        for i, pool in zip(self.indexes, self._listed, strict=True):
            change = changes.get(i)
            if change is None:
                continue
            healthy, changed = change
            members = pool.members
            for p in changed:
                delta[members[p].device.id] = bool(healthy[p])
        if not delta:
            return
        self._health.update(delta)
        for d, ok in delta.items():
            if ok:
                self._unhealthy.discard(d)
            else:
                self._unhealthy.add(d)
        self.plugin.health.update(delta)
        if self.publisher is not None:
            self.publisher.update(unhealthy=self._unhealthy)

    # ------------------------------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Connect to the API server, start publishing, then serve the kubelet; DraUnavailable if not."""
        if self.started:
            return
        node = self.settings.node_name
        if not node:
            raise DraUnavailable("serving DRA pools needs the node's name: --node-name or $NODE_NAME")
        if self.client is None:
            try:
                if self._factory is not None:
                    self.client = await self._factory()
                else:
                    self.client = await ResourceClient.from_kubeconfig(self.settings.kubeconfig)
            except Exception as exc:
                why = f"{type(exc).__name__}: {exc}"
                raise DraUnavailable(f"cannot configure the API client: {why}") from None
        try:
            await self.client.discover()
        except Exception as exc:
            raise DraUnavailable(f"the API server does not answer: {type(exc).__name__}: {exc}") from None
        self._reader.reader = HttpClaimReader(self.client)
        settings = PublisherSettings(
            node,
            self.driver,
            taints=self.settings.taints,
            min_write_interval_s=self.settings.min_write_interval_s,
        )
        publisher = Publisher(self.client, settings, self.pools)
        publisher.update(withheld=self.withheld, unhealthy=[d for d, ok in self._health.items() if not ok])
        await publisher.start()
        self.publisher = publisher
        # The kubelet deletes the node's slices of a driver it (re)registers; publish again then
        # (the reflector sees the deletions too, this is the prompt path).
        self.plugin.on_registered = publisher.poke
        try:
            await self.plugin.start()
        except Exception:
            await publisher.stop()
            self.publisher = None
            raise
        self.started = True
        log_event(
            log,
            "DRA driver started",
            driver=self.driver,
            node=node,
            version=publisher.version.value,
            pools=len(self.pools),
            devices=sum(len(p.members) for p in self.pools),
            prepared=len(self.plugin.service.prepared),
        )

    async def stop(self) -> None:
        """Stop serving the kubelet and publishing (the slices stay: the kubelet owns their cleanup)."""
        await self.plugin.stop()
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


class DraHooks:
    """The daemon's side of DRA: the driver made once needed, fed every pool set, started with retries."""

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
    ) -> None:
        self.settings = settings  # None: DRA is off (pools with "api": "dra" are not served)
        self.ownership = ownership
        self._on_node = on_node
        self._cdi_dir = cdi_dir
        self._devinfo_dir = devinfo_dir
        self._dev_root = dev_root
        self._client = client_factory  # the API client's maker (tests); None: from the kubeconfig
        self.driver: DraDriver | None = None
        self._retry: asyncio.Task[None] | None = None

    def recover(self, config: Config) -> None:
        """Build the DRA driver and count the devices its prepared claims hold (before serving)."""
        dra = self.settings
        if dra is None or self.driver is not None:
            return
        # Nothing to do for a node that never served DRA: no DRA pool and no claims checkpoint.
        checkpoint = dra.plugins_dir / config.dra_driver_name / CLAIMS_CHECKPOINT
        if not any(p.api is PoolApi.DRA for p in config.pools) and not os.path.lexists(checkpoint):
            return
        self.driver = DraDriver(
            dra,
            config.dra_driver_name,
            cdi_dir=self._cdi_dir,
            devinfo_dir=self._devinfo_dir,
            dev_root=self._dev_root,
            on_node=self._on_node,
            holder=self._holder,
            on_claims=self._claims_changed,
            client_factory=self._client,
        )
        self.ownership.set_claimed(self.driver.recover())

    def _holder(self, device_id: str) -> str | None:
        """Name who holds a device under the device-plugin API (the DRA gate refuses it then)."""
        return ", ".join(sorted(self.ownership.held.get(device_id, frozenset()) - {DRA_CLAIMS})) or None

    def _claims_changed(self) -> None:
        """After a Prepare or Unprepare: the ownership map follows the claims at once."""
        if self.driver is not None:
            self.ownership.set_claimed(self.driver.claimed())

    def take(
        self, raw: Sequence[Pool], pools: Sequence[Pool], health_of: Callable[[int], Sequence[bool]]
    ) -> None:
        """Hand the driver a new pool set (as configured, and as listed) and its advertised health."""
        if self.driver is None:
            return
        try:
            self.driver.take_pools(raw, pools, self.ownership.withheld)
            self.driver.take_health(health_of)
        except Exception:
            log.exception("DRA: taking the new pools failed")

    def waiting(self) -> bool:
        """Return whether the driver is needed but has not started (``/readyz`` says not ready)."""
        return self.driver is not None and self.driver.needed() and not self.driver.started

    async def start(self, config: Config) -> None:
        """Start the DRA driver when it is needed; on failure one line, and retries in the background."""
        dra = self.driver
        if dra is None:
            if any(p.api is PoolApi.DRA for p in config.pools):
                log_event(log, "DRA pools are not served: DRA is off", level=logging.WARNING)
            return
        if dra.started or not dra.needed() or (self._retry is not None and not self._retry.done()):
            return
        if dra.driver != config.dra_driver_name:
            log_event(
                log,
                "draDriverName changes take effect at the next start",
                level=logging.WARNING,
                serving=dra.driver,
            )
        if not await self._try_start(1):
            self._retry = asyncio.create_task(self._retry_start(), name="dra-start")

    async def _try_start(self, attempt: int) -> bool:
        assert self.driver is not None
        try:
            await self.driver.start()
        except DraUnavailable as exc:
            if attempt == 1 or attempt % 10 == 0:
                log_event(log, "DRA driver cannot start; retrying", level=logging.WARNING, error=str(exc))
            return False
        except Exception:
            log.exception("DRA driver failed to start; retrying")
            return False
        return True

    async def _retry_start(self) -> None:
        bounds = self.settings.retry_s if self.settings is not None else (0.5, 30.0)
        attempt = 1
        while True:
            await asyncio.sleep(backoff_delay(attempt, bounds))
            attempt += 1
            if await self._try_start(attempt):
                return

    async def stop(self) -> None:
        """Stop retrying and stop the driver (the slices stay: the kubelet owns their cleanup)."""
        retry, self._retry = self._retry, None
        if retry is not None:
            retry.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await retry
        if self.driver is not None:
            try:
                await self.driver.stop()
            except Exception:
                log.exception("the DRA driver failed to stop cleanly")
