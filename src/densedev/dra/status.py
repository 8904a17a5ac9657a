"""The claim's device status: what Prepare gave each device, written to ``status.devices[]`` of the claim.

After NodePrepareResources succeeded for a claim, every device of ours in its allocation gets an entry
(KEP-4817, ``DRAResourceClaimDeviceStatus``, beta and on since 1.33): ``driver``/``pool``/``device``
naming the allocated device, a ``Ready`` condition, ``networkData`` (interface name, hardware address)
when known, and ``data`` saying what was applied.  NodeUnprepareResources removes our entries again;
other drivers' entries are never touched.  dranet does the same at both ends (kubelet-dra.md §9).

It is best-effort by design: the claim is prepared whatever the API server says, so a write never
delays or fails Prepare.  ``prepared`` / ``unprepared`` only record what the claim should show and
return; a task per claim writes it in the background — read the claim, PUT ``resourceclaims/<name>/status``
with the resourceVersion read (a 409 Conflict re-reads at once: another writer won), back off with
jitter on other failures, give up after a bounded number of attempts with one log line.  At most
``concurrency`` requests are in flight at once, so a burst of prepares (100 claims at a pod storm)
does not open 100 connections to the API server.  A newer wish for a claim (Unprepare soon after
Prepare) replaces an older one not yet written and wakes its retry.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from ..backoff import backoff_delay, jittered
from ..printable import clip
from .apiclient import ApiError
from .claims import ClaimRef, PreparedDevice
from .params import API_VERSION

if TYPE_CHECKING:
    from ..ops.metrics import Metrics

log = logging.getLogger(__name__)

STATUS_KIND = "VfStatus"  # the kind of our ``data``, in the same group/version as the VfConfig we read
CONCURRENCY = 4  # status requests in flight at once, all claims together
MAX_ATTEMPTS = 8  # per wish; 409s count too (each one re-reads), so a writer that always wins is let be
BACKOFF = (0.5, 30.0)  # seconds: first retry, cap (8 attempts span about a minute and a half)
JITTER = 0.5  # equal jitter: many claims failing together (an API server restart) do not return in step
MAX_DATA = 10 * 1024  # status.devices[].data must be at most 10 Ki (resource.k8s.io AllocatedDeviceStatus)
MAX_INTERFACE = 256  # networkData.interfaceName
MAX_HARDWARE_ADDRESS = 128  # networkData.hardwareAddress
READY = "Ready"


class NetInfo(NamedTuple):
    """What is known of a device's network interface on the host: its name and MAC ("" when unknown)."""

    interface: str = ""
    hardware_address: str = ""


class StatusClient(Protocol):
    """The API calls ClaimStatus needs (``ResourceClient`` implements them, in its discovered version)."""

    async def get_claim(self, namespace: str, name: str) -> dict[str, Any]:
        """Return the ResourceClaim; raise ApiError (404 when gone)."""
        ...

    async def replace_claim_status(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """PUT the claim to its status subresource; raise ApiError (409 on a stale resourceVersion)."""
        ...


class StatusSink(Protocol):
    """Where the node service says which claims were prepared and unprepared (``ClaimStatus``)."""

    def prepared(
        self,
        ref: ClaimRef,
        devices: Sequence[PreparedDevice],
        applied: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        """Take a claim just prepared with these devices; must return at once and never raise."""
        ...

    def unprepared(self, ref: ClaimRef) -> None:
        """Take a claim just unprepared; must return at once and never raise."""
        ...


class NoStatus:
    """A StatusSink that writes nothing (no API server: tests of the node service alone, the demo)."""

    def prepared(
        self,
        ref: ClaimRef,
        devices: Sequence[PreparedDevice],
        applied: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        """Do nothing."""

    def unprepared(self, ref: ClaimRef) -> None:
        """Do nothing."""


class _Wish(NamedTuple):
    """What one claim's status should show: our devices (empty with ``clear``) and what was applied."""

    ref: ClaimRef
    devices: tuple[PreparedDevice, ...]
    applied: Mapping[str, Mapping[str, Any]]
    clear: bool


class _Outcome(NamedTuple):
    """How one attempt ended: ``done`` (nothing more to do), else the failure reason and whether to retry."""

    done: bool
    reason: str = ""
    retry: bool = False
    detail: str = ""


class ClaimStatus:
    """Writes our entries of claims' ``status.devices[]`` after Prepare and removes them at Unprepare."""

    def __init__(
        self,
        driver: str,
        client: Callable[[], StatusClient | None],
        *,
        describe: Callable[[str], NetInfo] = lambda _device_id: NetInfo(),
        metrics: Metrics | None = None,
        concurrency: int = CONCURRENCY,
        attempts: int = MAX_ATTEMPTS,
        backoff: tuple[float, float] = BACKOFF,
        rand: Callable[[], float] = random.random,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.driver = driver
        self._client = client  # None until the API server is connected (the driver connects later)
        self._describe = describe
        self._metrics = metrics
        self._sem = asyncio.Semaphore(concurrency)
        self._attempts = attempts
        self._backoff = backoff
        self._rand = rand
        self._now = now
        self._wishes: dict[str, _Wish] = {}  # by claim UID: the newest, not yet written
        self._wake: dict[str, asyncio.Event] = {}  # set when a newer wish replaces one in backoff
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self.written = 0  # successful PUTs, for tests
        self.in_flight = 0  # requests running now (GET or PUT), and the most seen at once
        self.peak = 0
        if metrics is not None:  # the series exist (at zero) before the first write
            metrics.dra_claim_status_pending.labels(driver).set(0)

    # -- what the node service calls --------------------------------------------------------------------

    def prepared(
        self,
        ref: ClaimRef,
        devices: Sequence[PreparedDevice],
        applied: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        """Queue writing the claim's entries for these devices (``applied``: device ID → settings)."""
        self._want(_Wish(ref, tuple(devices), dict(applied or {}), clear=False))

    def unprepared(self, ref: ClaimRef) -> None:
        """Queue removing the claim's entries of this driver (other drivers' entries stay)."""
        self._want(_Wish(ref, (), {}, clear=True))

    @property
    def pending(self) -> int:
        """Claims whose status is still to be written (queued, in flight or waiting to retry)."""
        return len(self._tasks)

    async def idle(self) -> None:
        """Wait until no claim's status is pending (tests; a clean stop)."""
        await self._idle.wait()

    async def close(self) -> None:
        """Stop writing: what is still pending is dropped (best-effort; the claim itself is prepared)."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # -- the background writes --------------------------------------------------------------------------

    def _want(self, wish: _Wish) -> None:
        uid = wish.ref.uid
        self._wishes[uid] = wish
        wake = self._wake.get(uid)
        if wake is not None:
            wake.set()
        if uid not in self._tasks:
            self._idle.clear()
            self._tasks[uid] = asyncio.get_running_loop().create_task(
                self._run(uid), name=f"dra-claim-status-{uid}"
            )
            self._gauge()

    def _gauge(self) -> None:
        if self._metrics is not None:
            self._metrics.dra_claim_status_pending.labels(self.driver).set(len(self._tasks))

    async def _run(self, uid: str) -> None:
        try:
            while True:
                wish = self._wishes[uid]
                try:
                    await self._apply(wish)
                except asyncio.CancelledError:
                    raise
                except Exception:  # our bug: this claim's status is given up, never the task's caller
                    log.exception("DRA claim %s: writing its device status failed", wish.ref)
                    self._failed("bug")
                if self._wishes.get(uid) is wish:
                    del self._wishes[uid]
                    break
        finally:
            self._wishes.pop(uid, None)  # cancelled: the wish goes with its task
            self._tasks.pop(uid, None)
            self._wake.pop(uid, None)
            self._gauge()
            if not self._tasks:
                self._idle.set()

    def _failed(self, reason: str) -> None:
        if self._metrics is not None:
            self._metrics.dra_claim_status_failures.labels(self.driver, reason).inc()

    async def _apply(self, wish: _Wish) -> None:
        """Write one wish, retrying within the bounds; return when done, given up or superseded."""
        uid = wish.ref.uid
        failures = 0
        last = ""
        for _attempt in range(self._attempts):
            outcome = await self._attempt(wish)
            if outcome.done:
                return
            self._failed(outcome.reason)
            last = outcome.detail
            if not outcome.retry:
                log.warning(
                    "DRA claim %s: device status not %s (not retried): %s",
                    wish.ref,
                    "cleared" if wish.clear else "written",
                    last,
                )
                return
            if self._wishes.get(uid) is not wish:
                return  # superseded: the newer wish is written instead
            if outcome.reason == "conflict":
                continue  # another writer won: read again at once
            failures += 1
            delay = jittered(backoff_delay(failures, self._backoff), JITTER, self._rand)
            wake = self._wake.setdefault(uid, asyncio.Event())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), delay)
            wake.clear()
            if self._wishes.get(uid) is not wish:
                return
        self._failed("gave_up")
        log.warning(
            "DRA claim %s: device status not %s after %d attempts, given up (the claim stays prepared): %s",
            wish.ref,
            "cleared" if wish.clear else "written",
            self._attempts,
            last,
        )

    async def _attempt(self, wish: _Wish) -> _Outcome:
        client = self._client()
        if client is None:
            return _Outcome(False, "error", True, "the API server is not connected yet")
        ref = wish.ref
        async with self._sem:
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
            try:
                obj = await client.get_claim(ref.namespace, ref.name)
                body = self._updated(wish, obj)
                if body is None:
                    return _Outcome(True)
                stored = await client.replace_claim_status(body)
            except ApiError as e:
                return _classify(e, ref)
            finally:
                self.in_flight -= 1
        self.written += 1
        if self._metrics is not None:
            self._metrics.dra_claim_status_writes.labels(
                self.driver, "clear" if wish.clear else "report"
            ).inc()
        if not wish.clear and not _ours(stored, self.driver) and _ours(body, self.driver):
            # A 1.32 server (gate alpha, off) accepts the write and drops status.devices silently.
            return _Outcome(
                False,
                "dropped",
                False,
                "the API server dropped status.devices (feature gate DRAResourceClaimDeviceStatus off?)",
            )
        return _Outcome(True)

    def _updated(self, wish: _Wish, obj: Mapping[str, Any]) -> dict[str, Any] | None:
        """Return the claim with our entries as wished, or None when there is nothing to write."""
        meta = obj.get("metadata") or {}
        if meta.get("uid") != wish.ref.uid:
            return None  # deleted and made anew under the name: not the claim we prepared
        status = obj.get("status") or {}
        current = [e for e in status.get("devices") or () if isinstance(e, Mapping)]
        others = [e for e in current if e.get("driver") != self.driver]
        ours = [e for e in current if e.get("driver") == self.driver]
        if wish.clear:
            wanted: list[dict[str, Any]] = []
        else:
            allocation = status.get("allocation")
            if not isinstance(allocation, Mapping):
                return None  # deallocated meanwhile: no device to report on
            allocated = {
                (r.get("pool"), r.get("device"))
                for r in (allocation.get("devices") or {}).get("results") or ()
                if isinstance(r, Mapping) and r.get("driver") == self.driver
            }
            before = {(e.get("pool"), e.get("device")): e for e in ours}
            generation = meta.get("generation")
            wanted = [
                self._entry(d, wish.applied.get(d.device_id, {}), before.get((d.pool, d.name)), generation)
                for d in wish.devices
                if (d.pool, d.name) in allocated  # the server refuses an entry naming no allocated device
            ]
        if wanted == ours:
            return None
        new_status = {**status, "devices": others + wanted}
        if not new_status["devices"]:
            del new_status["devices"]
        return {**obj, "status": new_status}

    def _entry(
        self,
        d: PreparedDevice,
        applied: Mapping[str, Any],
        before: Mapping[str, Any] | None,
        generation: Any,
    ) -> dict[str, Any]:
        """Return one ``status.devices[]`` entry for a prepared device."""
        since = self._now().strftime("%Y-%m-%dT%H:%M:%SZ")
        for c in (before or {}).get("conditions") or ():
            # A condition's lastTransitionTime is when its status last changed (metav1.Condition).
            if isinstance(c, Mapping) and c.get("type") == READY and c.get("status") == "True":
                since = str(c.get("lastTransitionTime") or since)
        what = ", ".join(sorted(applied)) if applied else "nothing (as allocated)"
        ready: dict[str, Any] = {
            "type": READY,
            "status": "True",
            "reason": "Prepared",
            "message": clip(
                f"prepared for requests {', '.join(d.requests) or '-'}; configured: {what}", 1000
            ),
            "lastTransitionTime": since,
        }
        if isinstance(generation, int):
            ready["observedGeneration"] = generation
        entry: dict[str, Any] = {
            "driver": self.driver,
            "pool": d.pool,
            "device": d.name,
            "conditions": [ready],
            "data": _data(d, applied),
        }
        net = self._describe(d.device_id)
        # The name the CNI is asked to give it in the pod wins over the host's name for it now.
        interface = str(applied.get("ifName") or net.interface)
        mac = str(applied.get("mac") or net.hardware_address)
        network: dict[str, str] = {}
        if interface and len(interface) <= MAX_INTERFACE:
            network["interfaceName"] = interface
        if mac and len(mac) <= MAX_HARDWARE_ADDRESS:
            network["hardwareAddress"] = mac
        if network:
            entry["networkData"] = network
        return entry


def _data(d: PreparedDevice, applied: Mapping[str, Any]) -> dict[str, Any]:
    """Return the entry's ``data``: the device's PCI address and what was applied, within 10 Ki."""
    doc: dict[str, Any] = {
        "apiVersion": API_VERSION,
        "kind": STATUS_KIND,
        "pciAddress": d.device_id,
        "adminAccess": d.admin,
        # Plain JSON (the settings may hold enums or addresses): a value JSON cannot carry becomes its text.
        "applied": json.loads(json.dumps(dict(applied), default=str)),
    }
    if len(json.dumps(doc, separators=(",", ":"))) > MAX_DATA:
        # The server refuses the whole write over one large value; say so rather than lose the rest.
        doc["applied"] = {"omitted": f"over {MAX_DATA} bytes: {', '.join(sorted(applied))[:500]}"}
    return doc


def _ours(obj: Mapping[str, Any], driver: str) -> bool:
    devices = (obj.get("status") or {}).get("devices") or ()
    return any(isinstance(e, Mapping) and e.get("driver") == driver for e in devices)


def _classify(e: ApiError, ref: ClaimRef) -> _Outcome:
    """Return how a failed request ends the attempt: done, retried, or given up with its reason."""
    if e.status == 404:
        return _Outcome(True)  # the claim is gone: nothing left to show anything on
    if e.status == 409:
        return _Outcome(False, "conflict", True, str(e))
    if e.status == 403:
        return _Outcome(
            False,
            "refused",
            False,
            f"{e} (the ServiceAccount needs update on resourceclaims/status: `densedev dra-manifests`)",
        )
    if e.status in (400, 422):
        return _Outcome(False, "refused", False, f"ResourceClaim {ref.namespace}/{ref.name}: {e}")
    # 0 (no answer), 401 (a rotated token), 429, 5xx: the server may heal.
    return _Outcome(False, "error", True, str(e))
