"""The daemon's side of DRA: the driver built only when a pool is DRA or prepared claims are on record.

The driver (gRPC DRA services, the API-server client, the ResourceSlice publisher) is imported where it is
built, so a device-plugin-only node never loads it (issue 14, start-up).
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
from ..pools.ownership import DRA_CLAIMS, Ownership
from . import CHECKPOINT_NAME as CLAIMS_CHECKPOINT
from . import DraSettings

if TYPE_CHECKING:
    from ..health.tracker import HealthTracker, PoolUpdate
    from ..ops.metrics import Metrics
    from .driver import ClientFactory, DraDriver

log = logging.getLogger("densedev.dra.driver")  # the driver's lines, wherever in the package they start


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
        metrics: Metrics | None = None,
    ) -> None:
        self.settings = settings  # None: DRA is off (pools with "api": "dra" are not served)
        self._metrics = metrics  # the DRA pools' device gauges, as the device-plugin pools have them
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
        from .driver import DraDriver  # only now: a device-plugin-only node never loads the DRA side

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

    def take(self, raw: Sequence[Pool], pools: Sequence[Pool], health: HealthTracker) -> None:
        """Hand the driver a new pool set (as configured, and as listed) and the owner of its health."""
        if self.driver is None:
            return
        try:
            self.driver.take_pools(raw, pools, self.ownership.withheld)
            self.driver.take_health(health)
        except Exception:
            log.exception("DRA: taking the new pools failed")
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
        from .driver import DraUnavailable  # loaded already: self.driver is a DraDriver

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
