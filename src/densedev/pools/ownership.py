"""One pod per device: what the kubelet holds, and which pool members must not be listed because of it.

The kubelet's device manager accounts allocated devices per resource name only
(pkg/kubelet/cm/devicemanager: ``allocatedDevices`` is keyed by resource), so when a reload, a
rebind seen by a rescan or a removed pool moves a device held by a running pod from resource A into
pool B, listing it in B makes it free in the kubelet's eyes and a second pod gets it.  Only the plugin
can prevent that: a device held under another resource is withheld from its new pool — not listed —
until the kubelet no longer holds it, then it joins.

What is held comes from the PodResources API (the supported source), else the kubelet's checkpoint
(the fallback), plus this daemon's own Allocate answers, which fill the gap between an answer and the
moment a source shows it.  ``Ownership.held`` is a plain map ``device ID → resource names`` that
other parts (file reconciliation at start) may consult.

Both records fail closed (STYLE lesson 13; issue 23 item 2).  When neither can be read, the last
successful read's holdings stay, with every Allocate answer since: every allocation in this run passes
through this daemon's Allocate, so they are all that can have changed, except releases, which wait for
a read that shows them.  Before any read has succeeded in this run nothing is known at all: a device
could be held under any resource an earlier run listed it under, so every pool member is withheld and
every pool's files count as held until a source answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING

from .. import workers
from ..model import Pool, PoolApi
from ..node.holdings import Held, PodResourcesClient, SourceUnavailable, checkpoint_identity, read_checkpoint
from ..ops.logs import log_event, summarise
from ..ops.metrics import Counter, Gauge, Registry
from ..workers import Work

if TYPE_CHECKING:
    from ..node.watch import DirectoryWatch

log = logging.getLogger(__name__)

POLL_S = 5.0  # PodResources poll while nothing is withheld (the kubelet allows 100 QPS; poll gently)
FAST_POLL_S = 0.25  # while devices are withheld: a release is seen well within a second
MIN_REFRESH_S = 0.1  # checkpoint rewrites (one per ListAndWatch message) refresh at most this often
OWN_GRACE_S = 5.0  # an Allocate answer counts as held until a source read this much later covers it
# The holder a device counts as held by while nothing could be read since start: no resource name
# (no "/"), so every pool, whatever its resource or API, withholds the device.
UNCHECKED = "unchecked"
# The holder name of devices prepared DRA claims hold: not a valid extended resource name (it has no
# "/"), so it can never be mistaken for a device-plugin pool.
DRA_CLAIMS = "dra-claims"


# The holder of devices whose settings a DRA claim changed are not restored yet (dra/configure.py):
# no "/" and not DRA_CLAIMS, so every pool withholds them, DRA ones too.
UNRESTORED = "dra-unrestored"


def retiring_claims(driver: str) -> str:
    """Return the holder name of devices held by the prepared claims of a retiring (renamed) DRA driver.

    Not ``DRA_CLAIMS``: a DRA pool keeps listing the devices its own driver's claims hold (the
    scheduler counts those allocations), but a device a retiring driver's claim holds is an allocation
    the scheduler knows under the old name only, so every pool, DRA ones too, must withhold it.
    """
    return f"{DRA_CLAIMS}:{driver}"  # ':' is in no resource name or DNS name: never a pool's


class Source(Enum):
    """Where the current in-use view comes from."""

    PODRESOURCES = "podresources"
    CHECKPOINT = "checkpoint"
    # Neither source readable now: the last successful read's holdings and this daemon's Allocate
    # answers since, kept until a read shows a device free.
    LAST_KNOWN = "last-known"
    UNKNOWN = "unknown"  # no source has been readable since start: every pool member withheld
    OWN = "own"  # no source configured: only this daemon's Allocate answers (tools and tests)

    @property
    def checked(self) -> bool:
        """Whether the holdings are as current as the configured sources allow (the last read succeeded)."""
        return self in (Source.PODRESOURCES, Source.CHECKPOINT, Source.OWN)


def device_id_of(member_id: str) -> str:
    """Return the device behind a pool member ID (a shared RDMA pool's ``<device>/<k>``, else itself)."""
    return member_id.split("/", 1)[0]


class Ownership:
    """Knows which devices running pods hold, under which resource, and withholds them from other pools."""

    def __init__(
        self,
        checkpoint: Path | None,
        client: PodResourcesClient | None = None,
        *,
        registry: Registry | None = None,
        clock: Callable[[], float] = time.monotonic,
        poll_s: float = POLL_S,
        fast_poll_s: float = FAST_POLL_S,
        grace_s: float = OWN_GRACE_S,
    ) -> None:
        self.checkpoint = checkpoint
        self.client = client
        self.poll_s = poll_s
        self.fast_poll_s = fast_poll_s
        self.grace_s = grace_s
        self._clock = clock
        self.held: dict[str, frozenset[str]] = {}  # device ID → resource names holding it
        # Until a first read succeeds nothing is known (fail closed); with no source to read, the own
        # Allocate answers are all there will ever be.
        self.source = Source.UNKNOWN if checkpoint is not None or client is not None else Source.OWN
        self._base: Held | None = None  # the last successful read (None: none yet in this run)
        self.refreshes = 0
        self._own: dict[tuple[str, str], float] = {}  # (resource, ID) → when this daemon allocated it
        self._claimed: dict[str, frozenset[str]] = {}  # holder → device IDs prepared DRA claims hold
        self._kubelet_held: dict[str, frozenset[str]] = {}  # ``held`` without the claims
        self._claims_moved = False  # claims changed since the loop last reported a change
        self._raw: tuple[Pool, ...] = ()
        self.withheld: dict[str, tuple[str, ...]] = {}  # pool → member IDs not listed
        self._failures: dict[str, str] = {}  # source → last failure logged (log once per new failure)
        self._last_refresh = -1e9
        self._wake: asyncio.Event | None = None  # set by run(): wakes its loop early
        self._lock: asyncio.Lock | None = None
        self._g_withheld = self._g_in_use = self._g_unchecked = self._c_failures = None
        if registry is not None:
            self._g_withheld = Gauge(
                "densedev_pool_withheld_devices",
                "Devices of a pool not listed because running pods hold them under another resource.",
                ["resource"],
                registry=registry,
            )
            self._g_in_use = Gauge(
                "densedev_devices_in_use",
                "Devices running pods hold (any resource), by the source the view came from.",
                ["source"],
                registry=registry,
            )
            self._g_unchecked = Gauge(
                "densedev_in_use_unchecked_devices",
                "Pool members withheld on holdings no source can confirm now (none is readable): the last "
                "known holdings, or every member while nothing could be read since start.",
                registry=registry,
            )
            self._c_failures = Counter(
                "densedev_in_use_read_failures",
                "Failed reads of what the kubelet holds, by source.",
                ["source"],
                registry=registry,
            )

    # ------------------------------------------------------------------------------ what is held
    def in_use(self) -> Mapping[str, frozenset[str]]:
        """Return device ID → resource names of every device running pods hold (as last refreshed)."""
        return self.held

    @property
    def known(self) -> bool:
        """Whether what pods hold has been read at least once in this run (or no source is configured)."""
        return self.source is not Source.UNKNOWN

    def resources_held(self) -> set[str]:
        """Return every resource name running pods hold devices under (while unknown: may hold)."""
        return set(self.by_resource())

    def may_be_held(self, resource: str) -> bool:
        """Return whether running pods may hold devices under ``resource`` (always, while unknown)."""
        return not self.known or resource in self.resources_held()

    def by_resource(self) -> dict[str, set[str]]:
        """Return resource name → device IDs running pods hold under it.

        While nothing could be read since start, a pool's devices may be held under its resource by pods
        an earlier run served: each pool of the last ``filter`` counts as holding all of them, so their
        files stay (the kubelet restarts those pods' containers from responses naming them).
        """
        out: dict[str, set[str]] = {}
        for device, resources in self.held.items():
            for r in resources:
                out.setdefault(r, set()).add(device)
        if not self.known:
            for pool in self._raw:
                out.setdefault(pool.config.full_name, set()).update(m.device.id for m in pool.members)
        return out

    def note_allocated(self, resource: str, ids: Iterable[str]) -> None:
        """Record an Allocate answer: the kubelet holds these IDs under ``resource`` from now on."""
        now = self._clock()
        for i in ids:
            self._own[(resource, i)] = now
            d = device_id_of(i)
            self._kubelet_held[d] = self._kubelet_held.get(d, frozenset()) | {resource}
            self.held[d] = self.held.get(d, frozenset()) | {resource}

    def conflicts(self, resource: str, ids: Iterable[str]) -> dict[str, frozenset[str]]:
        """Return the IDs that running pods hold (or, while unknown, may hold) under another resource."""
        if not self.known:
            return {i: frozenset((UNCHECKED,)) for i in ids}
        out: dict[str, frozenset[str]] = {}
        for i in ids:
            if i.isdigit():
                # A pool-wide shared ID ("0" … rdmaHcaMax-1, as the RDMA shared device plugin numbers
                # them) names a share of its resource, no device: every resource has its own "0", and
                # the HCAs behind them are shared by design.
                continue
            others = self.held.get(device_id_of(i), frozenset()) - {resource}
            if others:
                out[i] = others
        return out

    async def refresh(self) -> bool:
        """Read what the kubelet holds (PodResources, else the checkpoint); return whether it changed."""
        # One read at a time (the poll, a reload, a rescan): an older read finishing last would win.
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            return await self._refresh()

    async def _refresh(self) -> bool:
        started = self._clock()
        self._last_refresh = started
        self.refreshes += 1
        base: Held | None = None
        source: Source = Source.OWN if self.source is Source.OWN else Source.UNKNOWN
        if self.client is not None:
            try:
                base = await self.client.list()
                source = Source.PODRESOURCES
            except SourceUnavailable as exc:
                self._failed(Source.PODRESOURCES, str(exc))
        if base is None and self.checkpoint is not None:
            try:
                base = await workers.run(Work.KUBELET, read_checkpoint, self.checkpoint)
                source = Source.CHECKPOINT
            except SourceUnavailable as exc:
                self._failed(Source.CHECKPOINT, str(exc))
        if base is not None:
            self._failures.pop(source.value, None)
            self._base = base
            # An answer is covered once a read that began after it shows the allocation (from then on
            # the source says when it ends); one the source never shows (admission failed after our
            # answer) counts until a read that began a grace period after it.
            cutoff = started - self.grace_s
            self._own = {k: t for k, t in self._own.items() if t > cutoff and not (t < started and k in base)}
        elif self._base is not None:
            # Fail closed: no read says a device was released, so the last known holdings stay (and the
            # own answers, uncovered by any read since).
            source = Source.LAST_KNOWN
        was_known = self.known
        if source is not self.source:
            if source.checked:
                log_event(log, "in-use devices read from", source=source.value)
            else:
                kept = "the last known holdings" if self._base is not None else "every pool member withheld"
                why = {"source": source.value, "kept": kept}
                log_event(log, "in-use devices cannot be checked", level=logging.WARNING, **why)
            self.source = source
        pairs = set(self._base or ()) | self._own.keys()
        held: dict[str, set[str]] = {}
        for resource, i in pairs:
            held.setdefault(device_id_of(i), set()).add(resource)
        self._kubelet_held = {d: frozenset(r) for d, r in held.items()}
        frozen = self._with_claims()
        # The first successful read since start changes what is withheld even when nothing is held.
        changed = frozen != self.held or self._claims_moved or was_known != self.known
        self._claims_moved = False
        self.held = frozen
        if self._g_in_use is not None:
            for s in Source:
                self._g_in_use.labels(s.value).set(len(frozen) if s is source else 0)
        self._count_unchecked()
        return changed

    def set_claimed(
        self,
        device_ids: Iterable[str],
        retiring: Mapping[str, Iterable[str]] | None = None,
        unrestored: Iterable[str] = (),
    ) -> bool:
        """Take the device IDs every DRA driver's prepared claims hold; return whether that changed.

        ``device_ids`` are the active driver's (held under ``DRA_CLAIMS``), ``retiring`` maps each
        retiring driver's name to its claims' (held under ``retiring_claims(name)``), ``unrestored``
        the devices whose changed settings are not back yet (``UNRESTORED``): the union is held.
        """
        claimed = {DRA_CLAIMS: frozenset(device_ids)}
        for driver, ids in (retiring or {}).items():
            claimed[retiring_claims(driver)] = frozenset(ids)
        claimed[UNRESTORED] = frozenset(unrestored)
        claimed = {holder: ids for holder, ids in claimed.items() if ids}
        if claimed == self._claimed:
            return False
        self._claimed = claimed
        held = self._with_claims()
        changed = held != self.held
        self.held = held  # at once: an Allocate right after a Prepare must see the device taken
        if changed:
            # The run loop re-applies the pools (under the daemon's reload lock) on its next turn.
            self._claims_moved = True
            if self._wake is not None:
                self._wake.set()
        return changed

    def _with_claims(self) -> dict[str, frozenset[str]]:
        if not self._claimed:
            return dict(self._kubelet_held)
        held = dict(self._kubelet_held)
        for holder, ids in self._claimed.items():
            mark = frozenset((holder,))
            for d in ids:
                held[d] = held.get(d, frozenset()) | mark
        return held

    def _failed(self, source: Source, why: str) -> None:
        if self._c_failures is not None:
            self._c_failures.labels(source.value).inc()
        if self._failures.get(source.value) != why:
            self._failures[source.value] = why
            log_event(
                log, "cannot read in-use devices", level=logging.WARNING, source=source.value, problem=why
            )

    # ------------------------------------------------------------------------------ withholding
    def split(self, pools: Sequence[Pool]) -> tuple[tuple[Pool, ...], dict[str, tuple[str, ...]]]:
        """Return the pools without members held under another resource, and those members per pool."""
        if not self.known:
            # Nothing read since start: any member may be held under a resource an earlier run listed
            # it under, which the kubelet would count apart from this pool's (fail closed).
            unknown = {p.config.full_name: tuple(m.id for m in p.members) for p in pools if p.members}
            return tuple(p._replace(members=()) for p in pools), unknown
        if not self.held:
            return tuple(pools), {}
        out: list[Pool] = []
        withheld: dict[str, tuple[str, ...]] = {}
        held = self.held
        for pool in pools:
            name = pool.config.full_name
            # A DRA pool's devices are its own when claims hold them; a device-plugin pool's when pods
            # hold them under its resource name.  Held by the other API: withheld until released.
            own = DRA_CLAIMS if pool.config.api is PoolApi.DRA else name
            drop = [m.id for m in pool.members if m.device.id in held and held[m.device.id] - {own}]
            if drop:
                gone = set(drop)
                withheld[name] = tuple(drop)
                pool = pool._replace(members=tuple(m for m in pool.members if m.id not in gone))
            out.append(pool)
        return tuple(out), withheld

    def filter(self, pools: Sequence[Pool]) -> tuple[Pool, ...]:
        """Return the pools to advertise (held devices withheld), logging and counting what changed."""
        self._raw = tuple(pools)
        out, withheld = self.split(pools)
        self._report(withheld)
        return out

    def would_change(self) -> bool:
        """Return whether the last pools, filtered with what is held now, differ from what is listed."""
        return self.split(self._raw)[1] != self.withheld

    def _report(self, withheld: dict[str, tuple[str, ...]]) -> None:
        names = [p.config.full_name for p in self._raw]
        unchecked: dict[str, list[str]] = {}  # pool → members newly withheld on holdings none can confirm
        for name in sorted(set(names) | self.withheld.keys()):
            before = set(self.withheld.get(name, ()))
            now = withheld.get(name, ())
            added = [i for i in now if i not in before]
            released = sorted(before - set(now))
            if added and not self.source.checked:
                unchecked[name] = added
            elif added:
                under = sorted({r for i in added[:64] for r in self.held.get(device_id_of(i), ())} - {name})
                log_event(
                    log,
                    "devices withheld",
                    level=logging.WARNING,
                    pool=name,
                    count=len(now),
                    held_under=",".join(under[:4]) + (",..." if len(under) > 4 else ""),
                    devices=summarise(added),
                )
            if released:
                log_event(
                    log, "withheld devices released", pool=name, count=len(now), devices=summarise(released)
                )
        if self._g_withheld is not None:
            for name in self.withheld.keys() - set(names):
                with contextlib.suppress(KeyError):
                    self._g_withheld.remove(name)
            for name in names:
                self._g_withheld.labels(name).set(len(withheld.get(name, ())))
        if unchecked:
            # One line for the whole apply (a start with nothing readable withholds every pool's members).
            log_event(
                log,
                "devices withheld: holder cannot be checked",
                level=logging.WARNING,
                source=self.source.value,
                pools=summarise(sorted(unchecked), limit=4, noun="pool"),
                count=sum(map(len, unchecked.values())),
                devices=summarise([i for ids in unchecked.values() for i in ids]),
            )
        if withheld and not self.withheld and self._wake is not None:
            self._wake.set()  # the loop may sleep a slow poll: switch it to fast polling now
        self.withheld = withheld
        self._count_unchecked()

    def _count_unchecked(self) -> None:
        if self._g_unchecked is not None:
            count = 0 if self.source.checked else sum(map(len, self.withheld.values()))
            self._g_unchecked.set(count)

    # ------------------------------------------------------------------------------ the loop
    async def run(self, on_change: Callable[[], Awaitable[None]], watch: DirectoryWatch | None) -> None:
        """Refresh on every checkpoint rewrite (inotify) and every poll; call ``on_change`` when what is
        held changed (``would_change`` says whether the pools would list differently).  Never ends on
        an exception."""
        wake = self._wake = asyncio.Event()
        path = self.checkpoint
        seen = checkpoint_identity(path) if path is not None else None

        def on_dir() -> None:
            # The kubelet rewrites its checkpoint after every ListAndWatch message of any plugin; it
            # matters at once only while devices wait for their release (else the poll covers it).
            nonlocal seen
            now = checkpoint_identity(path) if path is not None else None
            if now != seen:
                seen = now
                if self.withheld:
                    wake.set()

        unsubscribe = watch.subscribe(on_dir) if watch is not None and path is not None else None
        try:
            while True:
                # While devices are withheld every fast tick also looks at the checkpoint, so a release
                # is seen in time without inotify too.
                interval = self.fast_poll_s if self.withheld else self.poll_s
                # asyncio.timeout, not wait_for: on 3.11 wait_for can lose a cancellation that arrives
                # as the event is set, and then the daemon's stop waits for this task forever.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(interval):
                        await wake.wait()
                wake.clear()
                on_dir()
                wake.clear()
                pause = self._last_refresh + MIN_REFRESH_S - self._clock()
                if pause > 0:
                    await asyncio.sleep(pause)
                try:
                    if await self.refresh():
                        await on_change()
                except Exception:
                    log.exception("refreshing in-use devices failed; the last view stays")
        finally:
            if unsubscribe is not None:
                unsubscribe()
            if self.client is not None:
                with contextlib.suppress(Exception):
                    await self.client.close()
