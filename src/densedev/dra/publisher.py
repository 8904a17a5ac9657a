"""Keeps a node's ResourceSlices at the API server equal to what its pools, health and owners say.

Two tasks on the daemon's loop, neither of which may die of an exception:

* the **reflector** lists our slices (``spec.nodeName=<node>,spec.driver=<driver>``) and watches them,
  keeping a mirror of what the server holds; a watch that ends is resumed from the last resourceVersion
  seen, and the reflector lists again only when the server expired it (410) (or, if watching is refused,
  every ``resync_s``), so a slice deleted by someone else is seen either way and a lost watch costs one
  LIST at most; a watch the server closed early comes back after a random part of ``reconnect_spread_s``
  (a restarting API server closes every node's watch at once: issue 26);
* the **syncer** compares what the builder wants with the mirror and writes the difference: deletes
  of stale slices of ours first (with UID and resourceVersion preconditions), then updates, then
  creates, as the official helper orders them.  Each write is a task of its own, at most
  ``WRITES_IN_FLIGHT`` of them sending at once and never two for one slice; a pass starts them and
  does not wait, so one slice's write that gets no answer holds up that slice alone.

Incremental: a change (``update``) re-derives every slice's state from bitmaps-cheap set lookups, but
writes only slices whose state differs from the server's.  Bursts are coalesced (``coalesce_s``) and
every slice has its own rate limit (``min_write_interval_s``): a slice written less than that long ago
waits, and is then written once with the newest state, so a flapping PF costs one write per interval.

Pool generation (resource.k8s.io ResourcePool docs): consumers use only the slices of the highest
generation and check ``resourceSliceCount``.  Devices never move between slices while the plan stays
(``slices.plan``), so health changes rewrite slices in place at the same generation; when the set of
slices, the slice count or a device's slice changes (a reload, a rescan, slices left by another
version), every slice moves to generation + 1.

Failures are the slice's own: a conflict (409) is retried at once after a fresh read of that slice,
and a second one in a row, a write cut by ``write_timeout_s`` (10 s; the slice is read again before it
is retried, since the server may have applied it) or any other error backs that slice off, jittered,
from 0.5 s doubling to 30 s, and never sooner than a 429's or 503's ``Retry-After`` asked (capped at
60 s), with one log line per run of failures; a slice gone under an update (404) is created again.  All
of a node's writes also pass its client's token bucket (``--dra-write-qps``/``--dra-write-burst``).
A retry, like every write, carries the newest state the slice should have, never the one the failed
write carried.  Conflicts and cut writes are counted (``densedev_dra_slice_write_*``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from ..backoff import Backoff, jittered
from ..model import Pool
from ..ops.logs import log_event
from .apiclient import RETRY_AFTER_MAX_S, WRITE_TIMEOUT_S, ApiError, ResourceClient
from .slices import ApiVersion, SliceBuilder, SliceState, node_owner

if TYPE_CHECKING:
    from ..ops.metrics import Metrics

log = logging.getLogger("densedev.dra.publisher")

# Slice writes in flight at once, over every pass: the API server works on one while we encode the
# next, and a start's creates do not queue one behind another, yet a node of hundreds of slices does not
# open hundreds of requests at once: client-go's default client allows a burst of 10 (rest.Config
# DefaultBurst), and API Priority and Fairness gives a service account's requests (the workload-low
# level) a small share of the server's seats.
WRITES_IN_FLIGHT = 8


class _Job(NamedTuple):
    """What one slice should become: ``state`` rendered by ``builder`` (``want``), or deleted (no state)."""

    state: SliceState | None
    want: dict[str, Any] | None  # rendered; None for a create until it is written
    generation: int
    slices: int  # resourceSliceCount
    owned: bool
    builder: SliceBuilder | None = None  # what renders ``state`` when ``want`` is None


@dataclass(frozen=True)
class PublisherSettings:
    """Node, driver and the publisher's knobs."""

    node: str
    driver: str
    taints: bool = False  # taint unhealthy devices NoSchedule (v1) instead of withdrawing them
    min_write_interval_s: float = 1.0  # per slice: at most one write per interval
    coalesce_s: float = 0.002  # fold a burst of updates into one pass
    resync_s: float = 60.0  # re-list this often when watching is not possible
    watch_timeout_s: int = 300  # the server ends each watch after this; the reflector re-lists
    backoff_min_s: float = 0.5  # failed writes (per slice) and failed passes back off between these
    backoff_max_s: float = 30.0
    write_timeout_s: float = WRITE_TIMEOUT_S  # a slice write (or its re-read) unanswered this long is cut
    # A watch the server closed early is resumed after a random part of this: when an API server
    # restarts, every node of the fleet loses its watch in the same second (issue 26).
    reconnect_spread_s: float = 8.0  # a 2 s refusal then leaves the LISTs spread over 6 s or more


def _rv_int(rv: str) -> int | None:
    # resourceVersions are opaque; etcd's are integers and that lets a late watch event of our own
    # earlier write be told from a newer state.  Non-integers are compared for equality only.
    return int(rv) if rv.isdigit() else None


def _shape_of(obj: dict[str, Any]) -> tuple[Any, Any]:
    """A stored slice's pool generation and slice count: what the plan of generations reads of it."""
    pool = (obj.get("spec") or {}).get("pool") or {}
    return pool.get("generation"), pool.get("resourceSliceCount")


def _spec_for_compare(spec: dict[str, Any]) -> dict[str, Any]:
    """The spec as we would have written it: the server's defaulting (taints' timeAdded) taken out."""
    devices = spec.get("devices") or []
    if any("taints" in d for d in devices):
        devices = [
            {**d, "taints": [{k: v for k, v in t.items() if k != "timeAdded"} for t in d["taints"]]}
            if "taints" in d
            else d
            for d in devices
        ]
    return {**spec, "devices": devices}


class Publisher:
    """Publishes one node's DRA pools as ResourceSlices, incrementally, rate-limited and self-healing."""

    def __init__(
        self,
        client: ResourceClient,
        settings: PublisherSettings,
        pools: Sequence[Pool] = (),
        *,
        clock: Callable[[], float] = time.monotonic,
        metrics: Metrics | None = None,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self._client = client
        client.identify(settings.node)
        self._metrics = metrics
        self._rand = rand
        self.settings = settings
        self._clock = clock
        self._pools: Sequence[Pool] = pools
        self._unhealthy: frozenset[str] = frozenset()
        self._withheld: frozenset[str] = frozenset()
        self._builder: SliceBuilder | None = None
        self._owner: dict[str, Any] | None = None
        self._mirror: dict[str, dict[str, Any]] = {}  # name → slice as the server holds it (ours only)
        # Bumped when a slice enters or leaves the mirror or changes its generation or slice count: the
        # plan's generation depends on nothing else once the layout was checked (_plan_generation).
        self._shape = 0
        self._plan_memo: tuple[tuple[Any, ...], int] | None = None
        self._listed = asyncio.Event()
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._last_write: dict[str, float] = {}
        # name → (resourceVersion, state, generation, count, owned) of our last successful write
        self._written: dict[str, tuple[Any, ...]] = {}
        # The resourceVersion of each slice's last write, as its answer gave it: the watch's echo of
        # that write says nothing new (_observe would drop it as not newer), so it is not decoded.
        self._own_rvs: set[str] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self._field_selector = f"spec.nodeName={settings.node},spec.driver={settings.driver}"
        self._gate = asyncio.Semaphore(WRITES_IN_FLIGHT)
        self._running: dict[str, asyncio.Task[None]] = {}  # name → its write task (one at most)
        self._jobs: dict[str, _Job] = {}  # name → what its running write should make it (newest)
        self._failures: dict[str, Backoff] = {}  # name → the backoff of its run of failed writes
        self._unsure: set[str] = set()  # slices whose last write was cut: read before writing again
        self.retrying: dict[str, float] = {}  # name → clock time its next write may go (after failures)
        self.passes = 0  # syncer passes made, for tests
        self.writes = 0  # successful creates, updates and deletes
        self.conflicts = 0  # writes answered 409
        self.timeouts = 0  # writes cut for want of an answer
        self.errors = 0
        self.lists = 0  # successful LISTs (one at the start, one per watch loss the server expired)
        self.watch_losses = 0  # watches the server closed before their timeout
        self.throttled = 0  # failures that came with a Retry-After (429, 503), honoured
        self.deferred: set[str] = set()  # slices waiting for their rate limit or backoff
        # The API server dropped the taints we wrote (DRADeviceTaints is off: alpha in 1.33-1.35, and
        # a disabled gate's fields are dropped silently): unhealthy devices are withdrawn instead.
        self.taints_dropped = False
        self._layout_checked: SliceBuilder | None = None  # the plan the mirror was last checked against
        self.layout_checks = 0  # looks at every published device for one that moved (tests count them)
        # Slices with a write out whose watch event came first: the newest resourceVersion seen.
        self._unconfirmed: dict[str, int] = {}

    # ----------------------------------------------------------------------------------------- input
    def update(
        self,
        *,
        pools: Sequence[Pool] | None = None,
        unhealthy: Collection[str] | None = None,
        withheld: Collection[str] | None = None,
    ) -> None:
        """Take new DRA pools, unhealthy device IDs and/or withheld device IDs; publish soon."""
        if pools is not None:
            self._pools = pools
            self._builder = None  # re-plan: the generation decides whether devices moved
        if unhealthy is not None:
            self._unhealthy = frozenset(unhealthy)
        if withheld is not None:
            self._withheld = frozenset(withheld)
        self.poke()

    def poke(self) -> None:
        """Wake the syncer (after a clock change in tests, or to retry at once)."""
        self._idle.clear()
        self._wake.set()

    async def wait_idle(self) -> None:
        """Return once the server holds exactly the desired slices and no write is deferred."""
        await self._idle.wait()

    # ------------------------------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Start the reflector and the syncer; an API server not answering yet is retried, never raised."""
        self._idle.clear()
        self._tasks = [
            asyncio.create_task(self._reflect(), name="dra-reflector"),
            asyncio.create_task(self._sync_loop(), name="dra-syncer"),
        ]

    async def stop(self) -> None:
        """Stop both tasks and every write (slices stay published: the kubelet wipes them later)."""
        tasks = [*self._tasks, *self._running.values()]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks = []
        self._running.clear()
        self._jobs.clear()

    @property
    def version(self) -> ApiVersion:
        """The resource.k8s.io version in use."""
        assert self._client.version is not None
        return self._client.version

    def builder(self) -> SliceBuilder:
        """Return the slice builder of the current pools (made on first use after a change)."""
        if self._builder is None:
            s = self.settings
            taints = s.taints and not self.taints_dropped
            self._builder = SliceBuilder(s.node, s.driver, self._pools, version=self.version, taints=taints)
        return self._builder

    # ------------------------------------------------------------------------------------- reflector
    def _ours(self, obj: Any) -> bool:
        # Shape checked once here: everything else reads mirror entries without guarding each key.
        if not isinstance(obj, dict) or not isinstance(obj.get("metadata"), dict):
            return False
        spec = obj.get("spec")
        if not isinstance(spec, dict) or not isinstance(spec.get("pool"), dict):
            return False
        return spec.get("nodeName") == self.settings.node and spec.get("driver") == self.settings.driver

    def _observe(self, kind: str, obj: dict[str, Any]) -> None:
        """Fold one watch event into the mirror, ignoring events older than what we hold."""
        if not self._ours(obj):
            return
        name = obj["metadata"].get("name", "")
        have = self._mirror.get(name)
        new_rv = _rv_int(str(obj.get("metadata", {}).get("resourceVersion", "")))
        if have is not None and new_rv is not None:
            old_rv = _rv_int(str(have["metadata"].get("resourceVersion", "")))
            if old_rv is not None and new_rv <= old_rv and kind != "DELETED":
                return
        if kind == "DELETED":
            if have is not None and have["metadata"].get("uid") == obj["metadata"].get("uid"):
                self._let_go(name)
                self.poke()
        else:
            self._hold(name, obj)
            sent = self._written.get(name)
            rv = obj["metadata"].get("resourceVersion")
            if sent is None or sent[0] != rv:
                if name in self._running and new_rv is not None:
                    # Our write to it may be what this reports, its answer not in yet (a busy server
                    # sends the event first): decided when the write ends (_put, _run).
                    self._unconfirmed[name] = max(self._unconfirmed.get(name, 0), new_rv)
                else:
                    self._layout_checked = None  # someone else's content: look for moved devices again
            self.poke()

    def _merge_list(self, items: Sequence[dict[str, Any]]) -> None:
        """Replace the mirror by a fresh list, keeping our own writes that are newer than the list."""
        fresh = {s["metadata"]["name"]: s for s in items if self._ours(s)}
        for name, have in self._mirror.items():
            got = fresh.get(name)
            if got is None:
                continue
            old = _rv_int(str(have["metadata"].get("resourceVersion", "")))
            new = _rv_int(str(got["metadata"].get("resourceVersion", "")))
            if old is not None and new is not None and old > new:
                fresh[name] = have
        self._mirror = fresh
        self._shape += 1
        self._layout_checked = None

    async def _reflect(self) -> None:
        """List once, then watch from the newest resourceVersion seen, resuming after every loss.

        A watch that ends is resumed from where it was (as client-go's reflector does): no LIST unless
        the server says that resourceVersion is gone (410 Expired, which a restarted server's fresh
        watch cache answers) or will not watch at all, so a lost watch costs a node exactly one LIST at
        most.  A watch the server closed early (a restart, a rolling update: every node's watch ends in
        the same second) is resumed after a random part of ``reconnect_spread_s``, so a fleet comes back
        spread out instead of in one burst; every failed attempt backs off, jittered, and waits at least
        what a 429 or 503 asked for in ``Retry-After``.
        """
        s = self.settings
        retry = Backoff(s.backoff_min_s, s.backoff_max_s, jitter=0.5, rand=self._rand)
        loop = asyncio.get_running_loop()
        rv = ""  # the newest resourceVersion seen; "" means list first
        lost = False  # since a watch the server closed, nothing has worked yet
        while True:
            try:
                if self._client.version is None:
                    await self._client.discover()
                if not rv:
                    items, rv = await self._client.list_slices(self._field_selector)
                    self.lists += 1
                    self._merge_list(items)
                    self._listed.set()
                    self.poke()
                    retry.reset()
                    lost = False
                opened = loop.time()
                async for kind, obj in self._client.watch_slices(
                    self._field_selector, rv, s.watch_timeout_s, known=self._own_rvs.__contains__
                ):
                    retry.reset()
                    lost = False
                    meta = obj.get("metadata") if isinstance(obj, dict) else None
                    seen = str(meta.get("resourceVersion") or "") if isinstance(meta, dict) else ""
                    if seen:
                        rv = seen  # bookmarks too: they move the resume point past others' writes
                    if kind != "BOOKMARK":
                        self._observe(kind, obj)
                if loop.time() - opened < 0.9 * s.watch_timeout_s:
                    # Closed by the server before its timeout: the whole fleet lost its watch now.
                    self.watch_losses += 1
                    lost = True
                    await asyncio.sleep(s.reconnect_spread_s * self._rand())
                continue  # a watch that ran its time is resumed at once
            except asyncio.CancelledError:
                raise
            except ApiError as exc:
                self.errors += 1
                if exc.status in (403, 405):
                    # Watching refused: poll by listing instead.
                    log.warning("dra: cannot watch ResourceSlices (%s); listing every %gs", exc, s.resync_s)
                    rv = ""
                    await asyncio.sleep(s.resync_s)
                    continue
                if exc.status == 410:  # our resourceVersion is too old: list again at once
                    rv = ""
                    continue
                delay = self._retry_delay(retry, exc)
                if lost:
                    # Still down after a loss: the nodes that came back early would otherwise all
                    # retry within a backoff of the server's return, in one burst; each draws again.
                    delay = max(delay, s.reconnect_spread_s * self._rand())
                log.warning("dra: ResourceSlice list/watch failed: %s; again in %.1fs", exc, delay)
                await asyncio.sleep(delay)
            except Exception:
                self.errors += 1
                delay = retry.next()
                log.exception("dra: reflector error; again in %.1fs", delay)
                await asyncio.sleep(delay)

    def _retry_delay(self, retry: Backoff, exc: Exception) -> float:
        """The next jittered backoff, but at least what the server asked for in Retry-After (plus up to
        a quarter more, so nodes told the same second do not all come back in it), at most the cap."""
        delay = retry.next()
        after = exc.retry_after if isinstance(exc, ApiError) else None
        if after:
            self.throttled += 1
            delay = max(delay, min(RETRY_AFTER_MAX_S, after * (1.0 + 0.25 * self._rand())))
        return delay

    # ----------------------------------------------------------------------------------------- syncer
    async def _sync_loop(self) -> None:
        delay = self.settings.backoff_min_s
        while True:
            await self._wake.wait()
            if self.settings.coalesce_s > 0:
                await asyncio.sleep(self.settings.coalesce_s)
            self._wake.clear()
            try:
                await self._listed.wait()
                if self._owner is None:
                    await self._lookup_owner()
                wait = await self.sync_once()
                self.passes += 1
                delay = self.settings.backoff_min_s
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.errors += 1
                if isinstance(exc, ApiError):
                    log.warning("dra: publishing slices failed: %s; again in %.1fs", exc, delay)
                else:
                    log.exception("dra: publishing slices failed; again in %.1fs", delay)
                wait = jittered(delay, 0.5, self._rand)
                if isinstance(exc, ApiError) and exc.retry_after:
                    wait = max(wait, exc.retry_after)
                delay = min(delay * 2, self.settings.backoff_max_s)
            if wait is None:
                if not self._running and not self._wake.is_set():
                    self._idle.set()
                continue  # idle, or writes out: each one's end wakes the syncer
            # Something is deferred (rate limit) or failed: come back then, or earlier when woken.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), wait)
            self._wake.set()

    async def _lookup_owner(self) -> None:
        try:
            node = await self._client.get_node(self.settings.node)
            uid = str(node.get("metadata", {}).get("uid", ""))
            self._owner = node_owner(self.settings.node, uid) if uid else {}
        except ApiError as exc:
            # Without the Node's UID the slices simply have no owner; the kubelet still wipes them.
            log.warning("dra: cannot read Node %s for ownerReferences: %s", self.settings.node, exc)
            self._owner = {}

    def _plan_generation(self, states: Sequence[SliceState]) -> int:
        """Return the generation to write: the current one, or one more when slices change shape.

        Only the slices of the highest generation count (consumers ignore the rest, ResourcePool
        docs): lower ones are left-overs of a move in progress, to be rewritten or deleted, so a move
        that a rate limit or a failure interrupted resumes at its generation instead of starting over.
        """
        mirror = self._mirror
        if not mirror:
            return 1
        # Every write's end makes a pass; at 512 slices, reading every stored slice's generation each
        # time was 4 ms of the loop per pass (a third of a 65,536-device start).  The answer depends
        # only on the mirror's shape, the slices planned (the builder's, one state per group) and
        # whether the layout was checked, unless devices moved: that answer is not kept.
        memo = self._plan_memo
        if memo is not None and memo[0] == self._plan_key(states):
            return memo[1]
        generation, moved = self._plan_shape(states)
        if not moved:  # the layout check just made is part of the key
            self._plan_memo = (self._plan_key(states), generation)
        return generation

    def _plan_key(self, states: Sequence[SliceState]) -> tuple[Any, ...]:
        return (self._shape, self._builder, self._layout_checked, len(states))

    def _plan_shape(self, states: Sequence[SliceState]) -> tuple[int, bool]:
        """The generation to write, and whether it is one more because devices moved between slices."""
        mirror = self._mirror
        current = max(int(s["spec"]["pool"].get("generation", 0)) for s in mirror.values())
        top = {n: s for n, s in mirror.items() if int(s["spec"]["pool"].get("generation", 0)) == current}
        names = {s.name for s in states}
        # Slices missing (deleted by someone) are created again at the same generation; an extra one
        # or another slice count mean the pool changed shape.
        if not set(top) <= names:
            return current + 1, False
        if any(int(s["spec"]["pool"].get("resourceSliceCount", 0)) != len(states) for s in top.values()):
            return current + 1, False
        if self._layout_checked is self._builder:
            return current, False  # the mirror holds only what this plan wrote: no device can have moved
        # A device published in one slice and wanted in another: move everything to a new generation.
        self.layout_checks += 1
        where: dict[str, str] = {}
        for name, s in top.items():
            for d in s["spec"].get("devices") or ():
                where[d["name"]] = name
        for st in states:
            for dname, _ in st.devices:
                if where.get(dname, st.name) != st.name:
                    return current + 1, True
        self._layout_checked = self._builder
        return current, False

    async def sync_once(self) -> float | None:
        """Start the writes of what differs; return seconds until a deferred one may go, else None.

        Writes run as tasks of their own (``_run``), a few at a time: the pass never waits for one, so
        a write that gets no answer holds up its own slice only.  A slice with a write out is not
        written again until it ends (its end wakes the syncer for another pass); what it should hold
        meanwhile is kept in ``_jobs``, replaced by every pass, and read again before any retry.
        """
        builder = self.builder()
        states = builder.states(self._unhealthy, self._withheld)
        generation = self._plan_generation(states)
        owner = self._owner or None
        now = self._clock()
        interval = self.settings.min_write_interval_s
        wait: float | None = None
        self.deferred = set()

        def allowed(name: str) -> bool:
            nonlocal wait
            until = self.retrying.get(name)
            last = self._last_write.get(name)
            if until is not None and until > now:
                left = until - now  # backing off after a failed write
            elif until is None and last is not None and now - last < interval:
                left = last + interval - now  # rate limit
            else:
                return True
            wait = left if wait is None else min(wait, left)
            self.deferred.add(name)
            return False

        # Deletes first, then updates, then creates, as the official helper orders them: tasks take the
        # gate in the order they are made.
        jobs: dict[str, _Job] = {}
        wanted = {st.name for st in states}
        for name in self._mirror:
            if name not in wanted:
                jobs[name] = _Job(None, None, generation, 0, False)  # a delete
        count = len(states)
        creates: list[tuple[str, _Job]] = []
        for st in states:
            held = self._mirror.get(st.name)
            if held is not None:
                # What we wrote last and the server still holds unchanged: no need to render it.
                sent = self._written.get(st.name)
                if sent == (held["metadata"].get("resourceVersion"), st, generation, count, bool(owner)):
                    continue
            job = self._jobs.get(st.name)
            key = (st, generation, count, bool(owner))
            if job is None or (job.state, job.generation, job.slices, job.owned) != key:
                # Rendered only when it is not the job of a write already out: at a start, every
                # write's end makes a pass while the others are still out.  A create is rendered when
                # it is written: a start's first write then goes out after one slice is rendered, not
                # 512 (0.5 s at 65,536 devices, which the server's work on the first writes overlaps).
                if held is None:
                    job = _Job(st, None, generation, count, bool(owner), builder)
                else:
                    want = builder.render(st, generation, count, owner)
                    if self._same(held, want):
                        continue
                    job = _Job(st, want, generation, count, bool(owner), builder)
            if held is None:
                creates.append((st.name, job))
            else:
                jobs[st.name] = job
        jobs.update(creates)

        # Slices that need nothing any more: a queued write is dropped, a backoff forgotten.
        for name in [n for n in self._jobs if n not in jobs]:
            del self._jobs[name]
        for name in [n for n in self.retrying if n not in jobs and n not in self._running]:
            self._forget_failures(name)
        for name, job in jobs.items():
            if name in self._running:
                self._jobs[name] = job  # the newest content, for the write's retry or the next pass
                continue
            if not allowed(name):
                continue
            self._jobs[name] = job
            self._running[name] = asyncio.create_task(self._run(name), name=f"dra-write-{name}")
        return wait

    async def _run(self, name: str) -> None:
        """Write one slice (under the gate of writes in flight); on failure, back it off alone."""
        try:
            async with self._gate:
                await self._apply(name)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a re-read that failed, or a bug: that slice backs off all the same
            if not isinstance(exc, ApiError):
                log.exception("dra: writing ResourceSlice %s failed", name)
            self._count(name, exc)
            self._back_off(name, exc)
        finally:
            self._jobs.pop(name, None)
            self._running.pop(name, None)
            if self._unconfirmed.pop(name, None) is not None:
                self._layout_checked = None  # seen while the write was out, and not its answer
            self.poke()  # another pass: the newest state may differ from what this write carried

    async def _apply(self, name: str) -> None:
        """Bring one slice to its newest job; a conflict is retried at once once, then backed off."""
        timeout = self.settings.write_timeout_s
        retried = False
        while (job := self._jobs.get(name)) is not None:
            if name in self._unsure:
                await self._refresh(name)  # a write cut short may have been applied: read what is there
                self._unsure.discard(name)
            have = self._mirror.get(name)
            if job.state is not None and job.want is None:
                job = self._jobs[name] = self._rendered(job)
            try:
                if job.want is None:
                    if have is not None:
                        meta = have["metadata"]
                        await self._client.delete_slice(
                            name, meta.get("uid", ""), meta.get("resourceVersion", ""), timeout=timeout
                        )
                        self._wrote(name)
                    self._let_go(name)
                elif have is None or not self._same(have, job.want):
                    await self._put(job, have, timeout)
            except ApiError as exc:
                if exc.status == 404 and have is not None:
                    # Gone under an update: create it; under a delete: done.  (A create's 404 is no
                    # such thing: the version is not served, and that backs off like any error.)
                    self._let_go(name)
                    continue
                self._count(name, exc)
                if exc.status == 409:
                    # Stale resourceVersion, created meanwhile, or a delete's precondition failed.
                    await self._refresh(name)
                    if not retried and name not in self._failures:
                        # One conflict is optimistic concurrency at work (client-go's RetryOnConflict
                        # retries at once after a fresh read); a second one in a row is contention.
                        retried = True
                        continue
                self._back_off(name, exc)
                return
            self._succeeded(name)
            return

    def _rendered(self, job: _Job) -> _Job:
        """The job with ``want`` rendered by the builder that planned its state."""
        assert job.state is not None and job.builder is not None
        owner = (self._owner or None) if job.owned else None
        return job._replace(want=job.builder.render(job.state, job.generation, job.slices, owner))

    async def _put(self, job: _Job, have: dict[str, Any] | None, timeout: float) -> None:
        """Create or replace one slice from ``job`` (raises ApiError) and take in what was stored."""
        st, want = job.state, job.want
        assert st is not None and want is not None
        if have is None:
            stored = await self._client.create_slice(want, timeout=timeout)
        else:
            want = {
                **want,
                "metadata": {**want["metadata"], "resourceVersion": have["metadata"]["resourceVersion"]},
            }
            stored = await self._client.replace_slice(want, timeout=timeout)
        if isinstance(stored.get("spec"), dict) and self._same(stored, want):
            # The server stored what we sent: hold our spec, whose devices the builder keeps anyway,
            # and let the decoded copy go at once.  Holding 512 decoded copies was ~400 MiB at 65,536
            # devices, and every page of it a fault on the way (~1.4 s of a start's kernel time here).
            stored["spec"] = want["spec"]
        self._hold(st.name, stored)
        self._wrote(st.name)
        if self._taints_lost(st, stored):
            if not self.taints_dropped:
                log.warning(
                    "dra: the API server dropped device taints (feature gate DRADeviceTaints off?); "
                    "withdrawing unhealthy devices from the slices instead"
                )
            self.taints_dropped = True
            self._builder = None  # the layout changes: the pass this write's end wakes re-plans
            return
        seen = self._unconfirmed.pop(st.name, None)
        if seen is not None and seen > (_rv_int(str(stored["metadata"].get("resourceVersion", ""))) or 0):
            self._layout_checked = None  # another writer's change came after ours
        rv = stored["metadata"].get("resourceVersion")
        before = self._written.get(st.name)
        if before is not None:
            self._own_rvs.discard(before[0])
        if isinstance(rv, str) and rv:
            self._own_rvs.add(rv)
        self._written[st.name] = (
            rv,
            st,
            job.generation,
            job.slices,
            job.owned,
        )

    def _count(self, name: str, exc: Exception) -> None:
        """Count a failed write (or re-read) of one slice by its kind."""
        if isinstance(exc, ApiError) and exc.status == 409:
            self.conflicts += 1
            if self._metrics is not None:
                self._metrics.record_slice_conflict(self.settings.driver)
        elif isinstance(exc, ApiError) and exc.timed_out:
            self.timeouts += 1
            if self._metrics is not None:
                self._metrics.record_slice_timeout(self.settings.driver)
            self._unsure.add(name)  # it may have been applied: read the slice before writing it again
        else:
            self.errors += 1

    def _back_off(self, name: str, exc: Exception) -> None:
        """Hold the slice's next write back by its own growing, jittered delay; log its first failure."""
        tries = self._failures.get(name)
        first = tries is None
        if tries is None:
            s = self.settings
            # Jittered so that a node's slices refused together (one API server) come back spread out.
            tries = self._failures[name] = Backoff(
                s.backoff_min_s, s.backoff_max_s, jitter=0.5, rand=self._rand
            )
        delay = self._retry_delay(tries, exc)
        self.retrying[name] = self._clock() + delay
        if first:
            # One line per slice per run of failures, not one per failure (409s can come back-to-back).
            log_event(
                log,
                "dra: ResourceSlice write failed; retrying it alone with backoff",
                level=logging.WARNING,
                slice=name,
                error=str(exc) if isinstance(exc, ApiError) else type(exc).__name__,
                retry_s=round(delay, 3),
            )

    def _succeeded(self, name: str) -> None:
        tries = self._failures.get(name)
        if tries is not None:
            log_event(
                log, "dra: ResourceSlice written after failed attempts", slice=name, retries=tries.attempt
            )
            self._forget_failures(name)

    def _forget_failures(self, name: str) -> None:
        self._failures.pop(name, None)
        self.retrying.pop(name, None)

    @staticmethod
    def _taints_lost(state: SliceState, stored: dict[str, Any]) -> bool:
        """Return whether we sent tainted devices and the stored slice has fewer tainted ones."""
        sent = sum(tainted for _, tainted in state.devices)
        if not sent:
            return False
        kept = sum(bool(d.get("taints")) for d in stored.get("spec", {}).get("devices") or ())
        return kept < sent

    def _same(self, have: dict[str, Any], want: dict[str, Any]) -> bool:
        hm, wm = have.get("metadata", {}), want["metadata"]
        if hm.get("labels") != wm.get("labels"):
            return False
        if "ownerReferences" in wm and hm.get("ownerReferences") != wm["ownerReferences"]:
            return False
        return bool(_spec_for_compare(have.get("spec") or {}) == _spec_for_compare(want["spec"]))

    def _hold(self, name: str, obj: dict[str, Any]) -> None:
        """Put the server's copy of one slice in the mirror."""
        old = self._mirror.get(name)
        self._mirror[name] = obj
        if old is None or _shape_of(old) != _shape_of(obj):
            self._shape += 1

    def _let_go(self, name: str) -> None:
        """Take one slice out of the mirror (deleted, or gone)."""
        if self._mirror.pop(name, None) is not None:
            self._shape += 1

    def _wrote(self, name: str) -> None:
        self.writes += 1
        self._last_write[name] = self._clock()

    async def _refresh(self, name: str) -> None:
        self._layout_checked = None
        try:
            self._hold(name, await self._client.get_slice(name, timeout=self.settings.write_timeout_s))
        except ApiError as exc:
            if exc.status != 404:
                raise
            self._let_go(name)
