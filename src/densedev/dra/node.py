"""NodePrepareResources / NodeUnprepareResources of one DRA driver on one node, and their gRPC handlers.

Prepare gives a container what ``Allocate`` gives it under the device-plugin API — ``PCIDEVICE_*`` and
``_INFO`` env, device nodes, device-info files — through one CDI spec per claim
(``densedev_dra_<driver>_<claim UID>.json``, kind ``<driver>/claim``):

- ``<uid>-<device name>``: the device's nodes and its own ``<ENV>_<ADDRESS>_INFO`` variable;
- ``<uid>_<request>``: the combined ``PCIDEVICE_<RESOURCE>`` / ``_INFO`` of that request's devices,
  named by the first device of the request only, so a container naming the request (or the whole
  claim) gets it once.  Claim UIDs have no ``_`` and request names are DNS labels, so the two kinds of
  names never collide.  A container naming two requests of one pool sees the variables of one of them:
  CDI env edits of two devices with the same name overwrite each other (a warning says so at Prepare).

The claim UID is in every CDI name, so a runtime never resolves a stale cached entry of another claim
(kubeletplugin's DRAPlugin doc).  Calls are serialised (the kubelet calls concurrently for different
pods; the helper serialises too); claim objects are read before taking the lock.  Calls of one kind that
wait for the lock are done together when it comes free: one pass, one journal write and one record write
(each fsynced) for all of them, instead of a pair per call while a node's pods start at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
import re
import threading
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple, TypeVar, cast

import grpc

from .. import files, workers
from .._proto import dra_v1_pb2, dra_v1beta1_pb2
from ..alloc import cdi, devinfo
from ..alloc.respond import build_response, cdi_env, needs_vhost_net, vdpa_path
from ..backoff import Backoff
from ..kubelet.lifecycle import unary
from ..model import Device, DeviceType, PoolConfig, RequestError, Role
from ..node import rebind
from ..node.holdings import ClaimUse
from ..node.vflinks import VfLinkError, VfLinks, VfTarget
from ..ops.logs import log_event, summarise
from ..printable import clip, listing
from ..workers import Work
from . import configure, names, params
from .checkpoints import SPEC_PREFIX as SPEC_PREFIX
from .checkpoints import spec_stem as spec_stem
from .checkpoints import specs_of
from .claims import (
    Checkpoint,
    ClaimReader,
    ClaimRef,
    Damage,
    Denied,
    DeviceGate,
    Grant,
    InfoFile,
    PreparedClaim,
    PreparedDevice,
    Refusal,
    Unsettled,
)
from .configure import JournalMetrics, JournalRecord, JournalState, stop_at
from .status import NoStatus, StatusSink

log = logging.getLogger(__name__)
T = TypeVar("T")
IF_NAME = params.Field.IF_NAME.value  # the key of a claim's asked interface name in PreparedClaim.applied

CDI_CLASS = "claim"
MAX_SPEC = 16 * 1024 * 1024  # a claim's spec is kilobytes; a bigger file is read as naming no device
MAX_ERROR_CHARS = 1000  # per-claim errors end up in a pod event; a status in gRPC trailers (8 KiB)
READ_TIMEOUT = 30.0  # the kubelet gives each call 45 s (defaultClientCallTimeout): answer before it
# Kubernetes UIDs are UUIDs; accept what could be one, because the UID goes into file and CDI names.
_UID = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,62}")
# Request names are DNS labels (resource.k8s.io DeviceRequest.name); they go into CDI names too.
_REQUEST = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")

SERVICE_V1 = "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin"
SERVICE_V1BETA1 = "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin"


class ClaimError(Exception):
    """One claim that cannot be prepared; the message becomes its per-claim error."""


class PrepareResult(NamedTuple):
    """The answer for one claim: its devices, or a non-empty error."""

    devices: tuple[PreparedDevice, ...] = ()
    error: str = ""


@dataclass(frozen=True)
class NodeSettings:
    """Who we are and where we write: driver, this node's pool, plugin dir, CDI/device-info dirs, /dev."""

    driver: str
    pool: str  # one pool per node, named after the node
    plugin_dir: Path  # <kubelet plugins dir>/<driver>: the checkpoint lives here
    cdi_dir: Path = cdi.DEFAULT_CDI_DIR
    devinfo_dir: Path | None = devinfo.DEFAULT_DEVINFO_DIR
    dev_root: Path = Path("/dev")


class NodeService:
    """Prepares and unprepares claims for one driver on one node; the state survives restarts."""

    def __init__(
        self,
        settings: NodeSettings,
        reader: ClaimReader,
        gate: DeviceGate,
        *,
        read_timeout: float = READ_TIMEOUT,
        links: VfLinks | None = None,
        journal_metrics: JournalMetrics | None = None,
        restore_retry_s: tuple[float, float] = (0.5, 30.0),
        sysfs_root: Path | None = None,
        rebind_timeout: float = 10.0,
    ) -> None:
        self.settings = settings
        self.driver = settings.driver
        self.pool = settings.pool
        self.kind = cdi.make_kind(settings.driver, CDI_CLASS)
        self._reader = reader
        self.gate = gate
        self._read_timeout = read_timeout
        self._checkpoint = Checkpoint(settings.plugin_dir, settings.driver)
        self._stem = spec_stem(settings.driver)
        self._claims: dict[str, PreparedClaim] = {}
        self._holders: dict[str, ClaimRef] = {}
        # What a lost checkpoint may have recorded (None: nothing unaccounted for); see ``recover``.
        self._unsettled: Unsettled | None = None
        # ``widen`` runs on the loop, a call's settling in its worker thread: each changes the state
        # under this lock, from what it is then (neither may undo the other).
        self._unsettled_lock = threading.Lock()
        # Whether the kubelet's PodResources will be read while unsettled (``observe``): a lost
        # checkpoint then holds the pool until the first read said which claims running pods use.
        self.kubelet_view = False
        self._writers: dict[tuple[str, str], devinfo.InfoWriter] = {}
        self._lock = asyncio.Lock()
        self._queue: list[_Call] = []  # calls waiting for the lock, in arrival order (= the lock's)
        self.prepares = 0  # calls answered, for tests and metrics
        # The kubelet's calls in flight, from the handler's start until the answer is sent: a retired
        # driver stops only after the answer to its last Unprepare went out (a kubelet that lost it
        # would retry against a driver that is gone).
        self.calls = 0
        self.on_idle: Callable[[], None] | None = None  # called on the loop when the last call ended
        # Non-empty while the driver retires (renamed, ``DraDriver.retire``): a claim not prepared
        # yet is refused with this reason; prepared ones keep their answer and are unprepared as usual.
        self.refusing = ""
        # Called on the loop after a Prepare or Unprepare call (the daemon's ownership map follows).
        self.on_change: Callable[[], None] | None = None
        self.unprepares = 0
        # claim status (issue 25 §3): the driver sets a ClaimStatus once it has an API client
        self.claim_status: StatusSink = NoStatus()
        # Claim parameters (configure.py): where VF link settings are changed (None: refused), the
        # journal's metrics, the claims whose devices a Prepare is changing now, the restore retries.
        self._links = links
        self._sysfs_root = sysfs_root  # where a VF's driver is rebound (None: a rebind is refused)
        self._rebind_timeout = rebind_timeout  # a probe's bound (vfio-pci answers in milliseconds)
        self._jm = journal_metrics
        self._inflight: set[str] = set()
        self._restore_retry_s = restore_retry_s
        self._restorer: asyncio.Task[None] | None = None
        self._restore_failures: dict[str, str] = {}  # device ID → why its last restore failed

    # -- state ----------------------------------------------------------------------------------------

    @property
    def prepared(self) -> Mapping[str, PreparedClaim]:
        """The prepared claims by UID."""
        return self._claims

    def held(self) -> Mapping[str, ClaimRef]:
        """Return the device IDs that prepared claims hold, each with the claim holding it."""
        return self._holders

    @property
    def unsettled(self) -> Unsettled | None:
        """What a lost checkpoint may have recorded, held until the kubelet settles it (None: nothing)."""
        return self._unsettled

    @property
    def journal(self) -> tuple[JournalRecord, ...]:
        """The changes prepared claims made to devices, as the checkpoint records them."""
        return self._checkpoint.journal

    def unrestored(self) -> frozenset[str]:
        """Return the devices a change left as no prepared claim asked: withheld from every pool.

        A record neither ``applied`` for a claim still prepared nor a Prepare's in flight: a change cut
        off by a crash, an Unprepare's restore not finished, a restore that failed.
        """
        return frozenset(
            r.device_id
            for r in self._checkpoint.journal
            if r.claim not in self._inflight
            and not (r.state is JournalState.APPLIED and r.claim in self._claims)
        )

    def withheld(self) -> frozenset[str]:
        """Return every device ID held here: prepared claims' and, while unsettled, all it withholds."""
        held = frozenset(self._holders)
        return held if self._unsettled is None else held | self._unsettled.held()

    def widen(self, device_ids: Iterable[str]) -> bool:
        """While unsettled, withhold these devices too (the driver's pool now); return whether that grew.

        In memory only: every start recomputes it from the pools then configured.
        """
        ids = frozenset(device_ids)
        with self._unsettled_lock:  # a call's worker thread may settle claims meanwhile
            if self._unsettled is None:
                return False
            wider = self._unsettled.widened(ids)
            grew = wider is not self._unsettled
            self._unsettled = wider
        return grew

    async def observe(self, uses: Iterable[ClaimUse]) -> bool:
        """Take a successful PodResources read (our driver's claim uses); return whether what is held changed.

        While unsettled, a claim a running pod uses under this driver and pool is held by namespace and
        name (PodResources gives no UID), with the devices it names, whether or not a CDI spec names it;
        a named claim no longer shown is released (a spec naming it holds it still, by UID).  A claim
        prepared here already is on record and not counted (matched by namespace and name: the kubelet
        lets one claim of a name be prepared on a node at a time, newer UIDs of the name being refused
        while an older is cached, kubelet-dra.md "Before calling").  A failed read is never passed here.
        """
        async with self._lock:  # no Prepare or Unprepare meanwhile: one writer of the checkpoint at a time
            return await self._observe(uses)

    async def _observe(self, uses: Iterable[ClaimUse]) -> bool:
        named: dict[tuple[str, str], set[str]] = {}
        recorded = {(c.ref.namespace, c.ref.name) for c in self._claims.values()}
        for use in uses:
            if use.driver != self.driver or use.pool != self.pool:
                continue
            key = (use.namespace, use.name)
            if key in recorded:
                continue
            device_id = names.pci_address(use.device)
            ids = named.setdefault(key, set())
            if device_id is not None:
                ids.add(device_id)
        with self._unsettled_lock:  # a call's worker thread may settle claims meanwhile
            before = self._unsettled
            if before is None:
                return False
            after = before.observed({k: frozenset(v) for k, v in named.items()})
            self._unsettled = after
        if after is before:
            return False
        now = set(after.named) if after is not None else set()
        added = sorted(f"{ns}/{n}" for ns, n in now - before.named.keys())
        gone = sorted(f"{ns}/{n}" for ns, n in before.named.keys() - now)
        log_event(
            log,
            "DRA claims of a lost checkpoint: the kubelet's PodResources were read; the claims running "
            "pods use under this driver are held by namespace and name until unprepared or gone"
            if after is not None
            else "DRA claims of the lost checkpoint all settled by the kubelet; their devices are released",
            level=logging.WARNING if after is not None else logging.INFO,
            driver=self.driver,
            held=summarise(added, noun="claim") if added else "-",
            released=summarise(gone, noun="claim") if gone else "-",
            last="podresources",
        )
        try:  # so that a restart holds what PodResources named
            await _in_thread(self._checkpoint.save, self._claims, after)
        except OSError as e:  # held in memory all the same; the next save records it
            log.warning(
                "DRA %s: cannot record the unsettled state in %s: %s", self.driver, self._checkpoint.path, e
            )
        return True

    def recover(self) -> frozenset[str]:
        """Load the checkpoint, remove our CDI specs of claims it does not know; return held device IDs.

        Call before anything is served: ownership must count these devices as taken first.  A checkpoint
        that cannot be read fails closed (``_lost``): nothing of ours on disk is removed, and what it may
        have recorded is held until the kubelet settles it.
        """
        loaded = self._checkpoint.load()
        self._commit(loaded.claims)
        self._unsettled = self._still_unsettled(loaded.recorded.unsettled)
        for claim in self._claims.values():
            for i in claim.info:
                self._writer(i.prefix, i.name).adopt([i.device_id])
        if loaded.damage is not None:
            self._lost(loaded.damage)
        # A crash between writing a spec and recording its claim, or an Unprepare that removed the
        # record but not the file: the kubelet does not know the claim as ours.  (Specs of unsettled
        # claims stay: the kubelet may know them.)
        self._prune_specs()
        pending = self.unrestored()
        if pending:
            log_event(
                log,
                "DRA: devices changed for claims no longer prepared (or cut off by a crash) are withheld "
                "from every pool until their old settings are restored",
                level=logging.WARNING,
                driver=self.driver,
                devices=summarise(sorted(pending)),
            )
            self.start_restores()
        self._report()
        if self._claims:
            log.info(
                "recovered %d prepared DRA claims holding %d devices", len(self._claims), len(self._holders)
            )
        if self._unsettled is not None and loaded.damage is None:
            log_event(
                log,
                "DRA claims of a lost checkpoint still unsettled; their devices stay withheld",
                level=logging.WARNING,
                driver=self.driver,
                claims=len(self._unsettled.claims),
                devices=len(self._unsettled.held()),
                reason=self._unsettled.reason,
            )
        return self.withheld()

    def _still_unsettled(self, unsettled: Unsettled | None) -> Unsettled | None:
        """Return the recorded unsettled state without the claims whose CDI spec is no longer on disk.

        The spec is the evidence the claim may be live; an operator who has made sure no pod uses a
        claim removes its spec to settle it by hand (docs/ownership.md), a restart then releases it.
        """
        if unsettled is None:
            return None
        try:
            entries = set(files.list_names(self.settings.cdi_dir))
        except OSError:
            return unsettled  # cannot tell: all stay held
        gone = [uid for uid in unsettled.claims if self._spec_file(uid) not in entries]
        if gone:
            log_event(
                log,
                "DRA claims of a lost checkpoint settled by hand: their CDI specs were removed",
                level=logging.WARNING,
                driver=self.driver,
                claims=summarise(sorted(gone), noun="claim"),
            )
        left = unsettled.without(gone)
        # Waiting for PodResources a run does not read would hold the pool for good.
        return left.unawaited() if left is not None and not self.kubelet_view else left

    def _lost(self, damage: Damage) -> None:
        """Fail closed on a checkpoint that cannot be read: hold every claim our CDI specs still name.

        Prepare writes a claim's spec before it records the claim or answers the kubelet, so the specs
        on disk name every claim the lost file could have recorded (and perhaps a few it never did).
        Each stays held — its spec and device-info files kept, its devices and every device of the
        driver's pool (``widen``) withheld from every other claim and pool — until the kubelet prepares
        it (recorded again) or unprepares it (released).  The state is recorded in a fresh checkpoint
        at once, so a restart before that holds it still.
        """
        claims = self._spec_claims()
        reason = f"checkpoint {self._checkpoint.path} {damage.problem}"
        # A claim whose spec was lost too is named only by the kubelet: until its PodResources have
        # been read (``observe``), every device of the pool may be one (pending).
        pending = self.kubelet_view
        if claims or pending:
            self._unsettled = Unsettled(claims, frozenset(), clip(reason, 300), pending=pending)
        saved = "recorded in a fresh checkpoint"
        try:
            self._checkpoint.save(self._claims, self._unsettled)
        except OSError as e:
            saved = f"held in memory only (cannot write a fresh checkpoint: {e.strerror or e})"
        held = self._unsettled.held() if self._unsettled is not None else frozenset()
        if claims:
            what = (
                "DRA checkpoint cannot be read; the claims our CDI specs name are kept held until the "
                "kubelet prepares or unprepares each (their CDI specs and device-info files kept, their "
                "devices and the driver's pool withheld)"
            )
        elif pending:
            what = (
                "DRA checkpoint cannot be read; no CDI spec of ours names a claim, so the driver's pool "
                "is withheld until the kubelet's PodResources say which claims running pods use"
            )
        else:
            what = "DRA checkpoint cannot be read; no CDI spec of ours names a claim, so none is held"
        log_event(
            log,
            what,
            level=logging.ERROR,
            driver=self.driver,
            checkpoint=str(self._checkpoint.path),
            problem=damage.problem,
            kept_as=damage.kept_as,
            claims=summarise(sorted(claims), noun="claim") if claims else "-",
            devices=len(held),
            state=saved if self._unsettled is not None else "-",
        )

    def _spec_claims(self) -> dict[str, frozenset[str]]:
        """Return the claim UIDs our CDI specs on disk name, each with the device IDs its spec names."""
        try:
            entries = files.list_names(self.settings.cdi_dir)
        except OSError as e:
            log.warning("cannot list CDI dir %s: %s", self.settings.cdi_dir, e)
            return {}
        out: dict[str, frozenset[str]] = {}
        for name in specs_of(self._stem, entries):
            uid = name[len(self._stem) : -len(".json")]
            if not _UID.fullmatch(uid) or uid in self._claims:
                continue
            out[uid] = self._spec_devices(name, uid)
        return out

    def _spec_devices(self, name: str, uid: str) -> frozenset[str]:
        """Return the device IDs a claim's CDI spec names (``<uid>-<device name>`` entries); bounded."""
        data = files.read_regular(self.settings.cdi_dir, name, limit=MAX_SPEC)
        try:
            doc = json.loads(data) if data is not None else None
            entries = doc.get("devices") if isinstance(doc, dict) else None
        except ValueError:
            entries = None
        ids: set[str] = set()
        for entry in entries if isinstance(entries, list) else ():
            cdi_name = entry.get("name") if isinstance(entry, dict) else None
            if isinstance(cdi_name, str) and cdi_name.startswith(f"{uid}-"):
                device_id = names.pci_address(cdi_name[len(uid) + 1 :])
                if device_id is not None:
                    ids.add(device_id)
        return frozenset(ids)

    def _prune_specs(self) -> None:
        """Remove this driver's CDI specs (and temp files) of claims neither prepared nor unsettled."""
        keep = {c.spec_file for c in self._claims.values()}
        if self._unsettled is not None:
            keep.update(self._spec_file(uid) for uid in self._unsettled.claims)
        try:
            entries = files.list_names(self.settings.cdi_dir)
        except OSError as e:
            log.warning("cannot list CDI dir %s: %s", self.settings.cdi_dir, e)
            entries = []
        for name in entries:
            ours = (name.startswith(self._stem) and name.endswith(".json")) or files.is_temp_of(
                name, self._stem
            )
            if ours and name not in keep:
                with contextlib.suppress(OSError):
                    files.remove(self.settings.cdi_dir, name)
                    log.info("removed CDI spec %s of no prepared claim", self.settings.cdi_dir / name)

    def _spec_file(self, uid: str) -> str:
        return f"{self._stem}{uid}.json"

    def remove_state(self) -> None:
        """Remove the checkpoint and the driver's CDI specs: it stops for good (renamed, no claim left)."""
        if self._claims or self._unsettled is not None or self._checkpoint.journal:
            raise RuntimeError(f"DRA {self.driver}: claims are still prepared or unsettled")
        self._checkpoint.remove()
        self._prune_specs()

    def call_started(self) -> None:
        """Count a kubelet call in flight (the gRPC handler's, until its answer is sent)."""
        self.calls += 1

    def call_ended(self) -> None:
        """A kubelet call ended (answered, failed or cancelled); the last one calls ``on_idle``."""
        self.calls -= 1
        if self.calls == 0 and self.on_idle is not None:
            try:
                self.on_idle()
            except Exception:
                log.exception("DRA: the idle hook failed")

    def _changed(self) -> None:
        if self.on_change is not None:
            try:
                self.on_change()
            except Exception:
                log.exception("DRA: the claims change hook failed")

    def _commit(self, claims: dict[str, PreparedClaim]) -> None:
        self._claims = claims
        holders: dict[str, ClaimRef] = {}
        for claim in claims.values():
            for device_id in claim.held():
                holders.setdefault(device_id, claim.ref)
        self._holders = holders

    def _writer(self, prefix: str, name: str) -> devinfo.InfoWriter:
        assert self.settings.devinfo_dir is not None
        w = self._writers.get((prefix, name))
        if w is None:
            w = self._writers[(prefix, name)] = devinfo.InfoWriter(self.settings.devinfo_dir, prefix, name)
        return w

    # -- prepare --------------------------------------------------------------------------------------

    async def prepare(self, refs: Sequence[ClaimRef]) -> dict[str, PrepareResult]:
        """Prepare every claim; return a result per claim UID (repeat calls return the same)."""
        out: dict[str, PrepareResult] = {}
        todo: dict[str, ClaimRef] = {}  # a claim named twice is prepared once
        for ref in refs:
            if ref.uid in out or ref.uid in todo:
                continue
            problem = _ref_problem(ref)
            if not problem and self.refusing and ref.uid not in self._claims and not self._is_unsettled(ref):
                problem = clip(f"claim {ref}: {self.refusing}", MAX_ERROR_CHARS)
                log.warning("DRA prepare refused: %s", problem)
            if problem:
                out[ref.uid] = PrepareResult(error=problem)
            else:
                todo[ref.uid] = ref
        # Read the claim objects first, concurrently and outside the lock (as the helper does); a claim
        # prepared already needs no read: its UID fixes its allocation, which is immutable.
        fresh = [r for r in todo.values() if r.uid not in self._claims]
        objects = await asyncio.gather(*(self._read(r) for r in fresh))
        read = dict(zip((r.uid for r in fresh), objects, strict=True))
        done = await self._joined(_Call(_CallKind.PREPARE, todo, read))
        out.update((uid, cast(PrepareResult, done[uid])) for uid in todo if uid in done)
        for uid, result in out.items():
            if not result.error:
                log.info(
                    "DRA claim %s prepared: %s",
                    uid,
                    ", ".join(f"{d.name} ({d.device_id})" for d in result.devices),
                )
                # claim status (issue 25 §3): queued, best-effort; never delays or fails this call
                self.claim_status.prepared(todo[uid], result.devices, self.applied(uid))
        return {ref.uid: out[ref.uid] for ref in refs if ref.uid in out}

    async def _joined(self, call: _Call) -> Mapping[str, PrepareResult | str]:
        """Do ``call`` under the lock with the calls of its kind queued right behind it; return its part.

        The first of them to get the lock runs one pass for all, shielded like a thread: a cancelled
        caller still leaves every device recorded and either configured for a recorded claim or put
        back.  The others find their answer when the lock comes to them.  Only a run of one
        kind is joined, so a Prepare and an Unprepare of one claim keep the order they came in.
        """
        self._queue.append(call)
        try:
            async with self._lock:
                if not call.done.done():
                    at = self._queue.index(call)
                    end = at + 1
                    while end < len(self._queue) and self._queue[end].kind is call.kind:
                        end += 1
                    batch = self._queue[at:end]
                    del self._queue[at:end]
                    work = asyncio.ensure_future(self._pass(call.kind, batch))
                    work.add_done_callback(partial(_deliver, batch))
                    await _finish(work)
        except asyncio.CancelledError:
            if call in self._queue:  # not taken by a pass: nothing of it was done
                self._queue.remove(call)
            raise
        outcome = call.done.result()
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    async def _pass(self, kind: _CallKind, batch: Sequence[_Call]) -> Mapping[str, PrepareResult | str]:
        """Do the calls of one batch as one; the hook hears of their claims once, at the end."""
        try:
            return await self._pass_of(kind, batch)
        finally:
            self._changed()

    async def _pass_of(self, kind: _CallKind, batch: Sequence[_Call]) -> Mapping[str, PrepareResult | str]:
        refs: dict[str, ClaimRef] = {}  # every call's claims, a claim named twice once
        for c in batch:
            for uid, ref in c.refs.items():
                refs.setdefault(uid, ref)
        if kind is _CallKind.PREPARE:
            self.prepares += len(batch)
            return await self._prepare_pass(refs, {u: o for c in batch for u, o in c.read.items()})
        self.unprepares += len(batch)
        return await self._unprepare(list(refs.values()))

    async def _prepare_pass(
        self, todo: Mapping[str, ClaimRef], read: Mapping[str, Mapping[str, Any] | str]
    ) -> dict[str, PrepareResult]:
        """Prepare the claims of one or more calls under the lock; return a result per claim UID."""
        out: dict[str, PrepareResult] = {}
        plans: dict[str, PreparedClaim] = {}
        asks: dict[str, dict[str, tuple[VfTarget, dict[str, Any]]]] = {}  # UID → device → settings
        drafts: dict[str, list[_Granted]] = {}  # UID → its grants, for claims rebinding a driver
        reserved: dict[str, ClaimRef] = {}
        for n, ref in enumerate(todo.values()):
            if n:
                # A pass may hold a hundred pods' claims: planning them is pure CPU, so the loop (health
                # on its way to the kubelet) gets a turn between two.  The lock keeps the claims still.
                await asyncio.sleep(0)
            known = self._claims.get(ref.uid)
            if known is not None:
                plans[ref.uid] = known
                continue
            obj = read.get(ref.uid)
            if isinstance(obj, str):
                out[ref.uid] = PrepareResult(error=obj)
                continue
            if obj is None:  # prepared meanwhile by a concurrent call's read... then unprepared
                out[ref.uid] = PrepareResult(error=f"claim {ref} changed during the call; retry")
                continue
            try:
                plan, ask, granted = self._plan(ref, obj, reserved)
            except ClaimError as e:
                out[ref.uid] = PrepareResult(error=clip(str(e), MAX_ERROR_CHARS))
                log.warning("DRA prepare refused: %s", e)
                continue
            except Exception as e:
                # Our bug, met by this claim only: its own error, the others are prepared.
                log.exception("DRA prepare of claim %s failed", ref)
                out[ref.uid] = PrepareResult(
                    error=clip(f"claim {ref}: cannot prepare it: {clip(repr(e), 300)}", MAX_ERROR_CHARS)
                )
                continue
            plans[ref.uid] = plan
            if ask:
                asks[ref.uid] = ask
                if any(configure.DRIVER in want for _t, want in ask.values()):
                    drafts[ref.uid] = granted
            for device_id in plan.held():
                reserved[device_id] = ref
        if plans:
            await self._configure_and_store(plans, asks, drafts, out)
        return out

    def applied(self, uid: str) -> Mapping[str, Mapping[str, Any]]:
        """Return what Prepare configured on the claim's devices, by device ID (the claim status's data)."""
        claim = self._claims.get(uid)
        return claim.applied if claim is not None else {}

    async def _configure_and_store(
        self,
        plans: dict[str, PreparedClaim],
        asks: Mapping[str, Mapping[str, tuple[VfTarget, dict[str, Any]]]],
        drafts: Mapping[str, Sequence[_Granted]],
        out: dict[str, PrepareResult],
    ) -> None:
        """Change the devices of the claims that ask it (journaled), then record every claim (``_store``).

        A claim whose change fails is refused with its devices put back; a claim that cannot be recorded
        after its change has its devices put back too (the kubelet retries its Prepare).
        """
        journaled = await self._journal(plans, asks, out)
        for uid, records in journaled.items():
            plan = plans[uid]
            error = await self._apply(plan.ref, records)
            if error:
                out[uid] = PrepareResult(error=clip(error, MAX_ERROR_CHARS))
                log.warning("DRA prepare refused: %s", error)
                del plans[uid]
                continue
            applied = _merged(plan.applied, configure.applied_of(self.journal, uid))
            draft = drafts.get(uid)
            if draft is not None:
                # Rebound: the claim's CDI edits are those of the device as it is now (vfio-pci's
                # /dev/vfio/<group> and /dev/vfio/vfio, which exist only once it is bound).
                try:
                    plan = self._build(plan.ref, _rebound(draft, applied), _if_names(plan.applied))
                except ClaimError as e:
                    out[uid] = PrepareResult(error=clip(str(e), MAX_ERROR_CHARS))
                    log.warning("DRA prepare failed after the rebind: %s", e)
                    del plans[uid]
                    continue
            plans[uid] = replace(plan, applied=applied)
        try:
            written = await _in_thread(self._store, plans) if plans else {}
        finally:
            self._inflight.difference_update(asks)
        for uid, error in written.items():
            if error:
                out[uid] = PrepareResult(error=clip(error, MAX_ERROR_CHARS))
            else:
                out[uid] = PrepareResult(plans[uid].devices)
        if any(written.get(uid) == "" for uid in asks):
            stop_at("prepare-recorded")
        undone = [r for r in self.journal if r.claim in asks and written.get(r.claim) != ""]
        if undone:
            await self._restore(undone)
        self._report()

    async def _journal(
        self,
        plans: dict[str, PreparedClaim],
        asks: Mapping[str, Mapping[str, tuple[VfTarget, dict[str, Any]]]],
        out: dict[str, PrepareResult],
    ) -> dict[str, list[JournalRecord]]:
        """Read the old values of every device the claims change and make them durable, in one write.

        Returns the records by claim UID; a claim whose devices cannot be read, or all of them when the
        write fails, is refused (out of ``plans``, its error in ``out``) with nothing changed.
        """
        journaled: dict[str, list[JournalRecord]] = {}
        for uid, ask in asks.items():
            records = await self._records(plans[uid].ref, ask)
            if isinstance(records, str):
                out[uid] = PrepareResult(error=clip(records, MAX_ERROR_CHARS))
                log.warning("DRA prepare refused: %s", records)
                del plans[uid]
            else:
                journaled[uid] = records
        stop_at("prepare-read")
        if not journaled:
            return {}
        self._inflight.update(journaled)
        journal = (
            *(r for r in self.journal if r.claim not in journaled),
            *(r for records in journaled.values() for r in records),
        )
        try:
            await _in_thread(self._checkpoint.save, self._claims, self._unsettled, journal)
        except OSError as e:
            self._inflight.difference_update(journaled)
            for uid in journaled:
                error = (
                    f"claim {plans[uid].ref}: cannot record its changes in {self._checkpoint.path}: {e}; "
                    "nothing was changed"
                )
                out[uid] = PrepareResult(error=clip(error, MAX_ERROR_CHARS))
                log.warning("DRA prepare refused: %s", error)
                del plans[uid]
            return {}
        stop_at("prepare-journaled")
        return journaled

    async def _records(
        self, ref: ClaimRef, ask: Mapping[str, tuple[VfTarget, dict[str, Any]]]
    ) -> list[JournalRecord] | str:
        """Return the journal records of a claim's changes (old and new values), or why it cannot."""
        records: list[JournalRecord] = []
        for device_id, (target, want) in ask.items():
            settings = configure.touched(want)
            if settings and self._links is None:
                return f"claim {ref}: asks VF link settings, which this node cannot change"
            try:
                old: dict[str, Any] = {}
                if settings and self._links is not None:
                    old = await workers.run(Work.NETLINK, self._links.read, target, settings)
                new = configure.completed(want, old)
                if configure.DRIVER in want and self._sysfs_root is not None:
                    root = self._sysfs_root
                    binding = await workers.run(Work.REBIND, rebind.binding_of, root, device_id)
                    old[configure.DRIVER] = binding.driver or ""
                    old[configure.OVERRIDE] = await workers.run(
                        Work.REBIND, rebind.override_of, root, device_id
                    )
                    new[configure.DRIVER] = new[configure.OVERRIDE] = want[configure.DRIVER]
            except (VfLinkError, rebind.RebindError) as e:
                return f"claim {ref}: cannot read the settings of {device_id} ({e}); nothing was changed"
            records.append(JournalRecord(ref.uid, device_id, target, old, new))
        return records

    async def _apply(self, ref: ClaimRef, records: Sequence[JournalRecord]) -> str:
        """Make a claim's journaled changes; return "" or its error (every device of it put back).

        The kernel may stop part way through one message, so a failure puts back every device of the
        claim from its record.
        """
        for r in records:
            driver, pf, own = configure.split(r.new)
            try:
                if driver:
                    assert self._sysfs_root is not None
                    await workers.run(
                        Work.REBIND,
                        partial(
                            rebind.rebind,
                            self._sysfs_root,
                            r.device_id,
                            driver[configure.DRIVER],
                            timeout=self._rebind_timeout,
                            dev_root=self.settings.dev_root,
                        ),
                    )
                stop_at("prepare-rebound")
                if pf:
                    assert self._links is not None
                    await workers.run(Work.NETLINK, self._links.apply, r.target, pf)
                stop_at("prepare-partial")
                if own:
                    assert self._links is not None
                    await workers.run(Work.NETLINK, self._links.apply, r.target, own)
            except (VfLinkError, rebind.RebindError) as e:
                self._inflight.discard(ref.uid)
                failed = await self._restore(records)
                back = (
                    "nothing was changed"
                    if not failed
                    else f"putting back {', '.join(sorted(failed))} failed: withheld and retried"
                )
                return f"claim {ref}: {r.device_id}: cannot set {configure.describe(r.new)}: {e}; {back}"
            log_event(
                log,
                "DRA claim changed a device",
                claim=str(ref),
                device=r.device_id,
                target=str(r.target),
                set=configure.describe(r.changed()),
                was=configure.describe({k: r.old[k] for k in r.changed()}),
            )
        stop_at("prepare-applied")
        return ""

    async def _restore(self, records: Sequence[JournalRecord]) -> set[str]:
        """Put back the old values of these records, dropping each record restored; return the failed.

        A failure keeps its record: the device stays withheld (``unrestored``) and ``start_restores``
        retries it with backoff.
        """
        failed: set[str] = set()
        done: set[tuple[str, str]] = set()
        for r in records:
            driver, pf, own = configure.split(r.old)
            try:
                if (pf or own) and self._links is None:
                    raise VfLinkError("this node cannot change VF links")
                if own and self._links is not None:
                    await workers.run(Work.NETLINK, self._links.apply, r.target, own)
                stop_at("unprepare-partial")
                if pf and self._links is not None:
                    await workers.run(Work.NETLINK, self._links.apply, r.target, pf)
                stop_at("unprepare-links-back")
                if driver:
                    if self._sysfs_root is None:
                        raise VfLinkError("this node cannot rebind drivers")
                    before = rebind.Binding(driver[configure.DRIVER] or None, None, ())
                    await workers.run(
                        Work.REBIND,
                        partial(
                            rebind.restore,
                            self._sysfs_root,
                            r.device_id,
                            before,
                            driver.get(configure.OVERRIDE),
                            timeout=self._rebind_timeout,
                        ),
                    )
            except (VfLinkError, rebind.RebindError) as e:
                failed.add(r.device_id)
                if self._jm is not None:
                    self._jm.restored(False)
                if self._restore_failures.get(r.device_id) != str(e):
                    self._restore_failures[r.device_id] = str(e)
                    log_event(
                        log,
                        "DRA: cannot restore a device's settings; it stays withheld from every pool, retried",
                        level=logging.ERROR,
                        claim=r.claim,
                        device=r.device_id,
                        restore=configure.describe(r.old),
                        error=str(e),
                    )
                continue
            done.add((r.claim, r.device_id))
            self._restore_failures.pop(r.device_id, None)
            if self._jm is not None:
                self._jm.restored(True)
            log_event(
                log,
                "DRA device restored",
                claim=r.claim,
                device=r.device_id,
                target=str(r.target),
                restored=configure.describe(r.old),
            )
        if done:
            stop_at("unprepare-restored")
            journal = tuple(r for r in self.journal if (r.claim, r.device_id) not in done)
            try:
                await _in_thread(self._checkpoint.save, self._claims, self._unsettled, journal)
            except OSError as e:  # restored but still recorded: the next attempt restores it again
                log.warning(
                    "DRA %s: cannot drop restored records from %s: %s", self.driver, self._checkpoint.path, e
                )
                failed.update(d for _c, d in done)
        if failed:
            self.start_restores()
        self._report()
        return failed

    def start_restores(self) -> None:
        """Retry the restores not done yet in the background, with backoff (needs a running loop)."""
        if not self.unrestored() or (self._restorer is not None and not self._restorer.done()):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # recovered before the loop runs: the plugin's start calls this again
        self._restorer = loop.create_task(self._restore_loop(), name=f"dra-restore {self.driver}")

    async def _restore_loop(self) -> None:
        backoff = Backoff(*self._restore_retry_s, jitter=0.5)
        while True:
            async with self._lock:
                pending = self.unrestored()
                if not pending:
                    break
                failed = await _finish(self._restore([r for r in self.journal if r.device_id in pending]))
            self._changed()  # released devices are listed again at once
            if failed:
                await asyncio.sleep(backoff.next())

    async def stop_restores(self) -> None:
        """Stop the background restores (the daemon stops; the next start retries from the journal)."""
        task, self._restorer = self._restorer, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        close = getattr(self._links, "close", None)  # the rtnetlink backend's socket
        if close is not None:
            close()

    def _report(self) -> None:
        if self._jm is not None:
            self._jm.report(self.driver, self.journal, len(self.unrestored()))

    def _is_unsettled(self, ref: ClaimRef) -> bool:
        return self._unsettled is not None and self._unsettled.holds(ref.uid, (ref.namespace, ref.name))

    async def _read(self, ref: ClaimRef) -> Mapping[str, Any] | str:
        """Return the claim object, or the per-claim error saying why it could not be read."""
        try:
            obj = await asyncio.wait_for(self._reader.get(ref.namespace, ref.name), self._read_timeout)
        except TimeoutError:
            return (
                f"reading ResourceClaim {ref.namespace}/{ref.name} timed out after {self._read_timeout:g} s"
            )
        except Exception as e:
            return clip(f"cannot read ResourceClaim {ref.namespace}/{ref.name}: {e}", MAX_ERROR_CHARS)
        if not isinstance(obj, Mapping):
            return f"ResourceClaim {ref.namespace}/{ref.name}: the reader returned no object"
        return obj

    def _plan(
        self, ref: ClaimRef, obj: Mapping[str, Any], reserved: Mapping[str, ClaimRef]
    ) -> tuple[PreparedClaim, dict[str, tuple[VfTarget, dict[str, Any]]], list[_Granted]]:
        """Return what preparing the claim makes and the link settings it asks per device, or raise
        ClaimError; writes and changes nothing."""
        results = self._our_results(ref, obj)
        asked: list[tuple[str, str, str, bool, Grant]] = []  # (full request, name, ID, admin, grant)
        unrestored = self.unrestored()
        problems: list[str] = []
        # request, pool, name, id, admin, grant: one entry per (request, device), in result order
        granted: list[_Granted] = []
        seen: set[tuple[str, str, str, bool]] = set()
        unsettled = self._unsettled
        others_unsettled: frozenset[str] = frozenset()
        if unsettled is not None:
            # A claim the lost checkpoint may have recorded may take what its allocation names, but
            # not a device another such claim's spec names; any other claim is refused every device
            # the state withholds (the driver's whole pool).
            claim_name = (ref.namespace, ref.name)
            if unsettled.holds(ref.uid, claim_name):
                others_unsettled = unsettled.others(ref.uid, claim_name)
            else:
                others_unsettled = unsettled.held()
        for r in results:
            request = r.get("request")
            pool, name = r.get("pool"), r.get("device")
            admin = r.get("adminAccess") is True
            if not isinstance(request, str) or not isinstance(pool, str) or not isinstance(name, str):
                problems.append(f"malformed allocation result {clip(repr(dict(r)), 200)}")
                continue
            base = request.split("/", 1)[0]
            if base and not _REQUEST.fullmatch(base):
                problems.append(f"request name {clip(repr(base), 80)} is not a DNS label")
                continue
            key = (base, pool, name, admin)
            if key in seen:
                continue  # the same device listed twice for one request: answered and recorded once
            seen.add(key)
            label = f"{pool}/{name}"
            if pool != self.pool:
                problems.append(f"{label}: {Refusal.NOT_ON_NODE.value} (this node's pool is {self.pool})")
                continue
            device_id = names.pci_address(name)
            if device_id is None:
                problems.append(f"{label}: not a device name of driver {self.driver}")
                continue
            verdict = self.gate(device_id)
            if isinstance(verdict, Denied):
                if verdict.refusal is Refusal.HELD and admin and verdict.grant is not None:
                    verdict = verdict.grant  # admin access shares a device in use by design
                else:
                    detail = f" ({verdict.detail})" if verdict.detail else ""
                    problems.append(f"{label} ({device_id}): {verdict.refusal.value}{detail}")
                    continue
            holder = self._holders.get(device_id) or reserved.get(device_id)
            if holder is not None and holder.uid != ref.uid and not admin:
                problems.append(f"{label} ({device_id}): {Refusal.HELD.value} (claim {holder})")
                continue
            if device_id in others_unsettled and not admin and unsettled is not None:
                problems.append(
                    f"{label} ({device_id}): {Refusal.HELD.value} (maybe: the record of prepared claims "
                    f"was lost — {clip(unsettled.reason, 200)}; withheld until the kubelet prepares or "
                    f"unprepares the {len(unsettled.claims)} claims it cannot account for)"
                )
                continue
            if device_id in unrestored and not admin:
                problems.append(
                    f"{label} ({device_id}): {Refusal.HELD.value} (its settings from an earlier claim are "
                    "not restored yet)"
                )
                continue
            granted.append((base, pool, name, device_id, admin, verdict))
            asked.append((request, name, device_id, admin, verdict))
        if problems:
            raise ClaimError(f"claim {ref}: cannot prepare {listing(problems, width=MAX_ERROR_CHARS)}")
        if self._sysfs_root is not None:
            live = {device_id: self._live(grant) for _r, _p, _n, device_id, _a, grant in granted}
            granted = [(r, p, n, i, a, live[i]) for r, p, n, i, a, _g in granted]
            asked = [(r, n, i, a, live[i]) for r, n, i, a, _g in asked]
        ask, if_names = self._asks(ref, obj, asked)
        return self._build(ref, granted, if_names), ask, granted

    def _asks(
        self, ref: ClaimRef, obj: Mapping[str, Any], asked: Sequence[tuple[str, str, str, bool, Grant]]
    ) -> tuple[dict[str, tuple[VfTarget, dict[str, Any]]], dict[str, str]]:
        """Return the link settings and the ``ifName`` the allocation's config asks per device ID (two
        mappings); ClaimError when refused.

        Checked in full before anything is touched (params.plan): one line per problem, naming the
        request, the field and the reason.
        """
        config = ((obj.get("status") or {}).get("allocation") or {}).get("devices", {}).get("config")
        if not config:
            return {}, {}
        results = [
            params.Result(
                request, name, params.facts_of(grant.device, self._pf_of(grant.device), admin_access=admin)
            )
            for request, name, _id, admin, grant in asked
        ]
        plan = params.plan(config, results, self.driver)
        if plan.problems:
            lines = [str(p) for p in plan.problems]
            raise ClaimError(f"claim {ref}: parameters refused: {listing(lines, width=MAX_ERROR_CHARS)}")
        by_name = {name: (device_id, grant) for _r, name, device_id, _a, grant in asked}
        out: dict[str, tuple[VfTarget, dict[str, Any]]] = {}
        if_names: dict[str, str] = {}
        for name, cfg in plan.configs.items():
            device_id, grant = by_name[name]
            if cfg.if_name:
                # Nothing on the device changes: the name is told to the CNI and the pod (_INFO,
                # device-info) and shown in the claim's status.
                if_names[device_id] = cfg.if_name
            want = configure.wanted(cfg)
            # Always journaled when asked, the binding read live at the change (the device table may
            # be older than the last rebind: a restore at start, before a rescan saw it).
            if cfg.driver is not None:
                if self._sysfs_root is None:
                    raise ClaimError(
                        f"claim {ref}: {name}: driver: rebinding to {cfg.driver} is not available here"
                    )
                want[configure.DRIVER] = cfg.driver
            if want:
                out[device_id] = (configure.target_of(grant.device), want)
        return out, if_names

    def _live(self, grant: Grant) -> Grant:
        """Return the grant with its VF's driver and netdevs as sysfs shows them now.

        A rebind (a claim's, or a restore at start) changes them before a rescan of the device table
        sees it; what the claim gets (CDI, device-info) and may ask must follow the device as it is.
        """
        d = grant.device
        if d.role != Role.VF or self._sysfs_root is None:
            return grant
        try:
            now = rebind.binding_of(self._sysfs_root, d.id)
        except rebind.RebindError:
            return grant  # the gate's table is all there is: the change itself reads it again
        driver = now.driver or ""
        if driver == d.driver and now.netdevs == d.netdevs:
            return grant
        return grant._replace(device=d._replace(driver=driver, netdevs=now.netdevs))

    def _pf_of(self, device: Device) -> Device | None:
        """Return a stand-in for a VF's PF carrying its link type (read from its netdev), else None.

        A VF without a netdev of its own (bound to vfio-pci, or scanned while it was) still takes the
        PF's settings through the PF's netdev, of the PF's type (``type``: ARPHRD_ETHER 1,
        ARPHRD_INFINIBAND 32).
        """
        if device.role != Role.VF or not device.pf_netdev or self._sysfs_root is None:
            return None
        try:
            arphrd = int((self._sysfs_root / "class/net" / device.pf_netdev / "type").read_text().strip())
        except (OSError, ValueError):
            return None
        kind = {1: "ether", 32: "infiniband"}.get(arphrd)
        return device._replace(role=Role.PF, link_type=kind) if kind else None

    def _our_results(self, ref: ClaimRef, obj: Mapping[str, Any]) -> list[Mapping[str, Any]]:
        where = f"ResourceClaim {ref.namespace}/{ref.name}"
        try:
            uid = obj.get("metadata", {}).get("uid")
            if uid != ref.uid:
                raise ClaimError(f"{where} has UID {clip(str(uid), 80)}, not {ref.uid}: it was replaced")
            allocation = (obj.get("status") or {}).get("allocation")
            if not isinstance(allocation, Mapping):
                raise ClaimError(f"{where} is not allocated")
            results = (allocation.get("devices") or {}).get("results") or []
            if not isinstance(results, list):
                raise ClaimError(f"{where}: status.allocation.devices.results is not a list")
        except (AttributeError, TypeError) as e:
            raise ClaimError(f"{where} is malformed: {e}") from None
        ours = [r for r in results if isinstance(r, Mapping) and r.get("driver") == self.driver]
        if not ours:
            raise ClaimError(f"{where} has no allocation result for driver {self.driver}")
        return ours

    def _build(
        self, ref: ClaimRef, granted: Sequence[_Granted], if_names: Mapping[str, str] | None = None
    ) -> PreparedClaim:
        """Return the prepared claim: CDI entries per device and per request, device-info documents.

        ``if_names`` (device ID → the claim's ``ifName``) go into the ``_INFO`` env and the device-info
        files, and into the claim's ``applied`` (for its status).
        """
        if_names = if_names or {}
        entries: dict[str, dict[str, Any]] = {}
        info: dict[tuple[str, str, str], InfoFile] = {}
        # Per request, per pool config: the devices in result order, each once.
        groups: dict[str, dict[PoolConfig, dict[str, Grant]]] = {}
        for request, _pool, _name, device_id, _admin, grant in granted:
            groups.setdefault(request, {}).setdefault(grant.config, {}).setdefault(device_id, grant)
        _warn_shared_pools(ref, groups)
        device_names: dict[str, str] = {}
        request_names: dict[str, str] = {}
        for request, by_config in groups.items():
            env: dict[str, str] = {}
            for config, grants in by_config.items():
                try:
                    parts, per_device = build_response(
                        config, [g.device for g in grants.values()], self.settings.dev_root, if_names=if_names
                    )
                except RequestError as e:
                    raise ClaimError(f"claim {ref}: {e.message}") from None
                env.update(parts.envs)
                for part in per_device:
                    d = part.device
                    cdi_name = f"{ref.uid}-{names.device_name(d.id)}"
                    device_names[d.id] = cdi_name
                    entries.setdefault(
                        cdi_name, cdi.device_entry(cdi_name, part.nodes, cdi_env(config, part))
                    )
                    if self.settings.devinfo_dir is not None and config.device_type == DeviceType.NET_DEVICE:
                        doc = devinfo.info_document(
                            d, needs_vhost_net(config), vdpa_path(d), if_names.get(d.id, "")
                        )
                        key = (config.resource_prefix, config.resource_name, d.id)
                        info.setdefault(key, InfoFile(*key, doc))
            request_name = f"{ref.uid}_{request or 'claim'}"
            request_names[request] = request_name
            _qualified(self.kind, request_name, ref)  # a name CDI refuses is this claim's error
            entries[request_name] = cdi.device_entry(request_name, (), env)
        # One answer per device, naming every request it serves (a device listed twice, or by two
        # requests, is one device to the kubelet and one entry in the checkpoint).
        order: dict[str, tuple[str, str]] = {}  # device ID -> pool, DRA name; in result order
        requests_of: dict[str, list[str]] = {}
        cdi_ids: dict[str, list[str]] = {}
        holds: set[str] = set()  # devices a result without admin access names: the claim holds them
        first: set[str] = set()
        for request, pool, name, device_id, admin, _grant in granted:
            if device_id not in order:
                order[device_id] = (pool, name)
                requests_of[device_id] = []
                cdi_ids[device_id] = [_qualified(self.kind, device_names[device_id])]
            if not admin:
                holds.add(device_id)
            if request not in requests_of[device_id]:
                requests_of[device_id].append(request)
            if request not in first:
                first.add(request)
                cdi_ids[device_id].append(_qualified(self.kind, request_names[request]))
        prepared = [
            PreparedDevice(tuple(requests_of[d]), pool, name, d, tuple(cdi_ids[d]), d not in holds)
            for d, (pool, name) in order.items()
        ]
        spec_file = files.check_name(f"{self._stem}{ref.uid}.json")
        spec = cdi.spec_document(self.kind, entries.values())
        applied = {d: {IF_NAME: n} for d, n in if_names.items() if d in order}
        return PreparedClaim(ref, tuple(prepared), spec_file, spec, tuple(info.values()), applied)

    def _store(self, plans: Mapping[str, PreparedClaim]) -> dict[str, str]:
        """Write every plan's files, then the checkpoint; return an error (or "") per claim UID.

        Runs in a worker thread under the lock (fsync must not stall the event loop); the state is
        replaced only after the checkpoint holds it.  An unsettled claim prepared here is settled: it
        is on record again.  Its files are never removed on a failure (a container may use them).
        """
        errors: dict[str, str] = {}
        claims = dict(self._claims)
        for uid, plan in plans.items():
            try:
                self._write_files(plan)
            except OSError as e:
                errors[uid] = f"claim {plan.ref}: cannot write its files: {e}"
                if uid not in claims and not self._is_unsettled(plan.ref):
                    with contextlib.suppress(OSError):
                        self._remove_files(plan, claims)
                continue
            claims[uid] = plan
            errors[uid] = ""
        settled = [(c.ref.namespace, c.ref.name) for c in claims.values()]
        unsettled = self._unsettled.without(claims, settled) if self._unsettled is not None else None
        # The changes of the claims recorded now are marked applied in the same write.
        journal = tuple(
            replace(r, state=JournalState.APPLIED)
            if r.state is JournalState.APPLYING and r.claim in claims and r.claim in self._inflight
            else r
            for r in self._checkpoint.journal
        )
        if claims != self._claims or unsettled is not self._unsettled:
            try:
                self._checkpoint.save(claims, unsettled, journal)
            except OSError as e:
                for uid, plan in plans.items():
                    if uid not in self._claims and not errors[uid]:
                        errors[uid] = f"claim {plan.ref}: cannot record it in {self._checkpoint.path}: {e}"
                        del claims[uid]
                        if not self._is_unsettled(plan.ref):
                            with contextlib.suppress(OSError):
                                self._remove_files(plan, claims)
                return errors
        self._commit(claims)
        self._settle(claims, "prepared", settled)
        return errors

    def _settle(self, uids: Iterable[str], how: str, names_: Iterable[tuple[str, str]] = ()) -> None:
        """Settle these claims of the unsettled state; one line when the last of it is settled."""
        with self._unsettled_lock:
            before = self._unsettled
            if before is None:
                return
            self._unsettled = before.without(uids, names_)
            done = self._unsettled is None
        if done:
            log_event(
                log,
                "DRA claims of the lost checkpoint all settled by the kubelet; their devices are released",
                driver=self.driver,
                last=how,
            )

    def _write_files(self, claim: PreparedClaim) -> None:
        files.write_atomic(self.settings.cdi_dir, claim.spec_file, cdi.spec_bytes(claim.spec))
        for i in claim.info:
            self._writer(i.prefix, i.name).write_all({i.device_id: dict(i.doc)})

    def _remove_files(self, claim: PreparedClaim, others: Mapping[str, PreparedClaim]) -> None:
        """Remove a claim's spec and the device-info files no other claim in ``others`` also has."""
        files.remove(self.settings.cdi_dir, claim.spec_file)
        shared = {(i.prefix, i.name, i.device_id) for c in others.values() if c is not claim for i in c.info}
        for i in claim.info:
            if (i.prefix, i.name, i.device_id) not in shared:
                self._writer(i.prefix, i.name).remove([i.device_id])

    # -- unprepare ------------------------------------------------------------------------------------

    async def unprepare(self, refs: Sequence[ClaimRef]) -> dict[str, str]:
        """Remove what Prepare made for each claim; return an error (or "") per UID; unknown claims pass."""
        done = await self._joined(_Call(_CallKind.UNPREPARE, {ref.uid: ref for ref in refs}))
        errors = {ref.uid: cast(str, done[ref.uid]) for ref in refs if ref.uid in done}
        for ref in refs:  # claim status (issue 25 §3): our entries go, queued and best-effort
            if not errors.get(ref.uid) and not _ref_problem(ref):
                self.claim_status.unprepared(ref)
        return {ref.uid: errors.get(ref.uid, "") for ref in refs}

    async def _unprepare(self, refs: Sequence[ClaimRef]) -> dict[str, str]:
        """Drop the claims (their records marked restoring in the same write), then put their devices back.

        A restore that fails does not fail the call: the claim is gone, its device stays withheld from
        every pool and is retried with backoff (``start_restores``).
        """
        before = set(self._claims)
        errors = await _in_thread(self._drop, refs)
        gone = before - set(self._claims)
        records = [r for r in self.journal if r.claim in gone and r.state is JournalState.RESTORING]
        if records:
            stop_at("unprepare-marked")
            await self._restore(records)
            stop_at("unprepare-dropped")
        return errors

    def _drop(self, refs: Sequence[ClaimRef]) -> dict[str, str]:
        errors: dict[str, str] = {}
        claims = dict(self._claims)
        released: list[str] = []  # unsettled claims unprepared: released
        released_names: list[tuple[str, str]] = []  # the same, as PodResources named them
        unsettled = self._unsettled
        for ref in dict.fromkeys(refs):
            uid = ref.uid
            claim = claims.pop(uid, None)
            if claim is None:
                if unsettled is not None and uid in unsettled.claims:
                    # The lost record's claim: its spec goes (its device-info files are those of
                    # devices the pools rewrite or a later start's reconcile removes).
                    try:
                        files.remove(self.settings.cdi_dir, files.check_name(self._spec_file(uid)))
                    except OSError as e:
                        errors[uid] = clip(f"claim {uid}: cannot remove its CDI spec: {e}", MAX_ERROR_CHARS)
                        continue
                    released.append(uid)
                    log.info("DRA claim %s (unsettled) unprepared", uid)
                if unsettled is not None and (ref.namespace, ref.name) in unsettled.named:
                    # Named by PodResources only (its spec lost too): nothing of it left to remove.
                    released_names.append((ref.namespace, ref.name))
                    log.info("DRA claim %s (unsettled, named by PodResources) unprepared", ref)
                continue  # never prepared here, or unprepared already: success (kubelet retries)
            try:
                self._remove_files(claim, claims)
            except OSError as e:
                claims[uid] = claim
                errors[uid] = clip(f"claim {claim.ref}: cannot remove its files: {e}", MAX_ERROR_CHARS)
                continue
            log.info("DRA claim %s unprepared", claim.ref)
        after = (
            unsettled.without(released, released_names)
            if unsettled is not None and (released or released_names)
            else unsettled
        )
        gone = set(self._claims) - set(claims)
        journal = configure.marked(self._checkpoint.journal, gone, JournalState.RESTORING)
        if claims != self._claims or after is not unsettled:
            try:
                self._checkpoint.save(claims, after, journal)
            except OSError as e:
                # The files are gone but the record stays: a repeated Unprepare finishes the job.
                for ref in refs:
                    uid = ref.uid
                    if (
                        (uid in self._claims and uid not in claims)
                        or uid in released
                        or (ref.namespace, ref.name) in released_names
                    ):
                        errors[uid] = f"cannot update {self._checkpoint.path}: {e}"
                return errors
            self._commit(claims)
            self._settle(released, "unprepared", released_names)
        return errors


class _CallKind(enum.Enum):
    PREPARE = "prepare"
    UNPREPARE = "unprepare"


@dataclass(eq=False)
class _Call:
    """One Prepare or Unprepare call waiting for the lock: its claims, and the answer once done."""

    kind: _CallKind
    refs: Mapping[str, ClaimRef]  # UID → claim
    read: Mapping[str, Mapping[str, Any] | str] = field(default_factory=dict)  # Prepare's claim objects
    done: asyncio.Future[Mapping[str, Any] | BaseException] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


def _deliver(batch: Sequence[_Call], work: asyncio.Future[Mapping[str, Any]]) -> None:
    """Hand a pass's answers (or its error, our bug) to every call it did."""
    outcome: Mapping[str, Any] | BaseException = (
        asyncio.CancelledError() if work.cancelled() else work.exception() or work.result()
    )
    for c in batch:
        if not c.done.done():
            c.done.set_result(outcome)


_Granted = tuple[str, str, str, str, bool, Grant]  # request, pool, name, device ID, admin, grant


def _merged(*parts: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Return per-device settings merged, device by device (the claim's ``ifName`` and the journal's)."""
    out: dict[str, dict[str, Any]] = {}
    for part in parts:
        for device_id, values in part.items():
            out.setdefault(device_id, {}).update(values)
    return {d: dict(sorted(v.items())) for d, v in out.items()}


def _if_names(applied: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    """Return device ID → the ``ifName`` a claim's applied settings carry."""
    return {d: str(v[IF_NAME]) for d, v in applied.items() if v.get(IF_NAME)}


def _rebound(granted: Sequence[_Granted], applied: Mapping[str, Mapping[str, Any]]) -> list[_Granted]:
    """Return the grants with each rebound device as it is now: its new driver, no netdev with vfio-pci."""
    out: list[_Granted] = []
    for request, pool, name, device_id, admin, grant in granted:
        driver = applied.get(device_id, {}).get(configure.DRIVER)
        if driver:
            gone = driver in params.USERSPACE_DRIVERS  # a user-space driver's VF has no netdev
            device = grant.device._replace(driver=driver, netdevs=() if gone else grant.device.netdevs)
            grant = grant._replace(device=device)
        out.append((request, pool, name, device_id, admin, grant))
    return out


def _qualified(kind: str, device: str, ref: ClaimRef | None = None) -> str:
    """Return the CDI name of one of a claim's entries; ClaimError if CDI refuses the name."""
    try:
        return cdi.qualified_name(kind, device)
    except cdi.CdiError as e:
        where = f"claim {ref}: " if ref is not None else ""
        raise ClaimError(f"{where}{clip(str(e), 300)}") from None


def _warn_shared_pools(ref: ClaimRef, groups: Mapping[str, Mapping[PoolConfig, object]]) -> None:
    """Warn once per claim when two of its requests take devices of one pool.

    Each request's CDI entry sets the pool's ``PCIDEVICE_<RESOURCE>``; a container naming both requests
    gets both entries and the runtime keeps the value of the last one applied (CDI env edits replace a
    variable of the same name), so it sees one request's addresses.  Its ``_INFO`` variables and
    device-info files still list every device.  One request with ``count: N`` gives the combined list,
    as ``intel.com/x: N`` does under the device-plugin API.
    """
    requests: dict[str, list[str]] = {}
    for request, by_config in groups.items():
        for config in by_config:
            requests.setdefault(config.full_name, []).append(request or "claim")
    for pool, names_ in requests.items():
        if len(names_) > 1:
            log_event(
                log,
                "DRA claim: requests share one pool; a container naming several sees one request's "
                "PCIDEVICE_* (ask with one request and count: N instead)",
                level=logging.WARNING,
                claim=ref.uid,
                pool=pool,
                requests=",".join(names_),
            )


async def _in_thread(fn: Callable[..., T], *args: Any) -> T:
    """Run ``fn`` in a worker thread and return its result; a cancellation waits for it to finish first.

    gRPC cancels a handler when the kubelet's deadline passes, but a thread cannot be stopped: the
    caller holds the lock, and releasing it while the thread still writes files and replaces the state
    would let the next call run on a state about to change under it.
    """
    return await _finish(workers.run(Work.FILES, fn, *args))


async def _finish(work: Awaitable[T]) -> T:
    """Await ``work`` to its end even when cancelled meanwhile (then re-raise the cancellation).

    What it does to devices and the checkpoint must not stop half way because the kubelet's deadline
    passed: the next call would start from a state about to change under it.
    """
    future = asyncio.ensure_future(work)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(future)
            break
        except asyncio.CancelledError:
            if future.done():
                raise
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return result


def _ref_problem(ref: ClaimRef) -> str:
    if not _UID.fullmatch(ref.uid):
        return f"claim UID {clip(ref.uid, 80)} is not a Kubernetes UID"
    if not ref.namespace or not ref.name:
        return f"claim {clip(str(ref), 200)} lacks a namespace or name"
    return ""


# -- gRPC ---------------------------------------------------------------------------------------------


def _device_pb(module: ModuleType, d: PreparedDevice) -> Any:
    return module.Device(
        request_names=list(d.requests), pool_name=d.pool, device_name=d.name, cdi_device_ids=list(d.cdi_ids)
    )


def handlers(service: NodeService) -> list[grpc.GenericRpcHandler]:
    """Return the DRAPlugin handlers for v1 and v1beta1 (identical messages, the same service)."""
    return [_handler(service, SERVICE_V1, dra_v1_pb2), _handler(service, SERVICE_V1BETA1, dra_v1beta1_pb2)]


def _track(service: NodeService, context: grpc.aio.ServicerContext) -> None:
    """Count the call in flight until gRPC has ended it (its answer sent, or it failed)."""
    service.call_started()

    def ended(_context: Any) -> None:
        service.call_ended()

    # grpc-stubs declare the callback type as a class, not a Protocol: a function is what grpc takes.
    context.add_done_callback(cast(Any, ended))


def _handler(service: NodeService, name: str, pb: ModuleType) -> grpc.GenericRpcHandler:
    async def prepare(request: Any, context: grpc.aio.ServicerContext) -> Any:
        _track(service, context)
        refs = [ClaimRef(c.namespace, c.name, c.uid) for c in request.claims]
        results = await _guard(context, "NodePrepareResources", service.prepare(refs))
        response = pb.NodePrepareResourcesResponse()
        for uid, result in results.items():
            entry = response.claims[uid]
            if result.error:
                entry.error = result.error
            else:
                entry.devices.extend(_device_pb(pb, d) for d in result.devices)
        return response

    async def unprepare(request: Any, context: grpc.aio.ServicerContext) -> Any:
        _track(service, context)
        refs = [ClaimRef(c.namespace, c.name, c.uid) for c in request.claims]
        errors = await _guard(context, "NodeUnprepareResources", service.unprepare(refs))
        response = pb.NodeUnprepareResourcesResponse()
        for uid, error in errors.items():
            response.claims[uid].error = error  # an entry for every claim, even an empty one
        return response

    return grpc.method_handlers_generic_handler(
        name,
        {
            "NodePrepareResources": unary(
                prepare, pb.NodePrepareResourcesRequest, pb.NodePrepareResourcesResponse
            ),
            "NodeUnprepareResources": unary(
                unprepare, pb.NodeUnprepareResourcesRequest, pb.NodeUnprepareResourcesResponse
            ),
        },
    )


async def _guard(context: grpc.aio.ServicerContext, call: str, work: Awaitable[Any]) -> Any:
    """Await ``work``; a bug fails this call with INTERNAL and a bounded message, never the server."""
    try:
        return await work
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        log.exception("DRA %s failed", call)
        await context.abort(grpc.StatusCode.INTERNAL, f"{call} failed: {clip(repr(exc), MAX_ERROR_CHARS)}")
