"""DRA claims on this node: what the daemon is asked, what a prepared claim holds, and its checkpoint.

The kubelet's DRA calls carry only a claim's namespace, name and UID; the allocation is read from the
ResourceClaim object (``ClaimReader``).  Whether a device may be handed out is the daemon's knowledge —
its device table, pools, health and ownership — and reaches the node service through ``DeviceGate``.
Prepared claims are recorded in a checkpoint file in the plugin's own directory, because Unprepare may
come after a restart, for a claim whose object is already gone (the kubelet works from its own
checkpoint then; kubeletplugin's DRAPlugin doc asks drivers to keep an on-disk record).
"""

from __future__ import annotations

import enum
import json
import logging
import os
import stat
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from .. import files
from ..model import Device, Pool, PoolConfig
from ..printable import clip
from . import CHECKPOINT_NAME
from .checkpoints import CHECKPOINT_KIND, MAX_CHECKPOINT
from .configure import JournalRecord, record_doc, record_of

log = logging.getLogger(__name__)

CHECKPOINT_VERSION = 1
CHECKPOINT_MODE = 0o600  # claim names and device IDs: nobody but the daemon needs to read them


class Refusal(enum.Enum):
    """Why a device named in a claim cannot be prepared here (the contract's per-claim errors)."""

    NOT_ON_NODE = "not on this node"
    NOT_OURS = "not in a pool served through DRA"
    UNHEALTHY = "unhealthy"
    HELD = "held elsewhere"


class Grant(NamedTuple):
    """A device that may be prepared: its record and the config of the DRA pool it is in."""

    device: Device
    config: PoolConfig


class Denied(NamedTuple):
    """A device that may not be prepared, why, and (for a held device only) what it would have been.

    ``grant`` lets an admin-access result (which by definition may share a device in use) go ahead
    when the only objection is that someone holds the device.
    """

    refusal: Refusal
    detail: str = ""
    grant: Grant | None = None


class DeviceGate(Protocol):
    """The daemon's word on one device ID (a PCI address): grant it with its pool, or say why not."""

    def __call__(self, device_id: str) -> Grant | Denied:
        """Return a Grant for a device that may be prepared now, else a Denied naming the reason."""
        ...


class ClaimReader(Protocol):
    """Reads a resource.k8s.io/v1 ResourceClaim (the HTTP client implements it; tests use memory)."""

    async def get(self, namespace: str, name: str) -> Mapping[str, Any]:
        """Return the ResourceClaim object as a dict; raise (any exception) when it cannot be read."""
        ...


class ClaimRef(NamedTuple):
    """A claim as the kubelet names it in NodePrepareResources / NodeUnprepareResources."""

    namespace: str
    name: str
    uid: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name} ({self.uid})"


class PreparedDevice(NamedTuple):
    """One allocation result of a prepared claim, as returned to the kubelet."""

    requests: tuple[str, ...]  # base request names (``main/sub`` made ``main``)
    pool: str
    name: str  # the DRA device name (names.device_name of ``device_id``)
    device_id: str  # the PCI address, the ID ownership and the device-plugin API use
    cdi_ids: tuple[str, ...]
    admin: bool = False  # adminAccess result: shares the device, does not hold it


class InfoFile(NamedTuple):
    """A device-info file written for a prepared claim: the pool's prefix and name, device, content."""

    prefix: str
    name: str
    device_id: str
    doc: Mapping[str, Any]


@dataclass(frozen=True)
class PreparedClaim:
    """Everything Prepare made for one claim; kept until Unprepare removes it."""

    ref: ClaimRef
    devices: tuple[PreparedDevice, ...]
    spec_file: str  # the CDI spec file name in the CDI directory
    spec: Mapping[str, Any] = field(hash=False)  # its content, so a repeat Prepare can restore it
    info: tuple[InfoFile, ...] = field(default=(), hash=False)
    # What Prepare set on each device (device ID → setting → value, from its VfConfig): for the claim's
    # status; the journal in the checkpoint holds the old values that restore them.
    applied: Mapping[str, Mapping[str, Any]] = field(default_factory=dict, hash=False)

    def held(self) -> frozenset[str]:
        """Return the device IDs this claim holds (admin-access results hold nothing)."""
        return frozenset(d.device_id for d in self.devices if not d.admin)


def _claim_doc(c: PreparedClaim) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "uid": c.ref.uid,
        "namespace": c.ref.namespace,
        "name": c.ref.name,
        "devices": [
            {
                "requests": list(d.requests),
                "pool": d.pool,
                "device": d.name,
                "id": d.device_id,
                "cdi": list(d.cdi_ids),
                "admin": d.admin,
            }
            for d in c.devices
        ],
        "specFile": c.spec_file,
        "spec": c.spec,
        "info": [{"prefix": i.prefix, "name": i.name, "id": i.device_id, "doc": i.doc} for i in c.info],
    }
    if c.applied:  # only when set: a claim without parameters is recorded as it always was
        doc["applied"] = {d: dict(v) for d, v in c.applied.items()}
    return doc


def _claim_of(doc: Mapping[str, Any]) -> PreparedClaim:
    """Return the claim of one checkpoint entry; KeyError/TypeError/ValueError if it is malformed."""
    ref = ClaimRef(str(doc["namespace"]), str(doc["name"]), str(doc["uid"]))
    devices = tuple(
        PreparedDevice(
            tuple(str(r) for r in d["requests"]),
            str(d["pool"]),
            str(d["device"]),
            str(d["id"]),
            tuple(str(i) for i in d["cdi"]),
            bool(d["admin"]),
        )
        for d in doc["devices"]
    )
    spec = doc["spec"]
    if not isinstance(spec, dict):
        raise TypeError("spec is not an object")
    info = tuple(
        InfoFile(str(i["prefix"]), str(i["name"]), str(i["id"]), dict(i["doc"])) for i in doc["info"]
    )
    applied = doc.get("applied", {})
    if not isinstance(applied, dict) or not all(isinstance(v, dict) for v in applied.values()):
        raise TypeError("applied is not an object of objects")
    return PreparedClaim(ref, devices, files.check_name(str(doc["specFile"])), spec, info, applied)


def _canonical(value: Any) -> bytes:
    return files.canonical_json(value).encode()


ClaimName = tuple[str, str]  # (namespace, name): how PodResources names a claim (it gives no UID)


@dataclass(frozen=True)
class Unsettled:
    """What a lost checkpoint may have recorded: held until the kubelet's view settles each claim.

    ``claims`` are the UIDs the CDI specs left on disk name, each with the device IDs its spec names
    (none when the spec itself cannot be read); ``named`` the claims the kubelet's PodResources showed
    running pods using under our driver and pool, by namespace and name, each with its device IDs;
    ``pending`` that PodResources has not been read since the loss (it may name claims no spec does);
    ``devices`` every other device that may be held (the driver's DRA pools while unsettled).  All of
    them count as held; a claim leaves the set when the kubelet prepares it (it is recorded again) or
    unprepares it (released), a named one also when a successful PodResources read no longer shows it,
    and the state ends when nothing is left (docs/ownership.md, "A DRA checkpoint that cannot be read").
    """

    claims: Mapping[str, frozenset[str]] = field(hash=False)
    devices: frozenset[str] = frozenset()
    reason: str = ""
    named: Mapping[ClaimName, frozenset[str]] = field(default_factory=dict, hash=False)
    pending: bool = False

    def held(self) -> frozenset[str]:
        """Return every device ID this state withholds."""
        return self.devices.union(*self.claims.values(), *self.named.values())

    def holds(self, uid: str, name: ClaimName) -> bool:
        """Return whether the claim (by UID, or by namespace and name as PodResources gave it) is in it."""
        return uid in self.claims or name in self.named

    def others(self, uid: str, name: ClaimName) -> frozenset[str]:
        """Return the device IDs every entry but this claim's names (what it may not take)."""
        return frozenset().union(
            *(ids for u, ids in self.claims.items() if u != uid),
            *(ids for n, ids in self.named.items() if n != name),
        )

    def _left(
        self, claims: Mapping[str, frozenset[str]], named: Mapping[ClaimName, frozenset[str]], pending: bool
    ) -> Unsettled | None:
        if not claims and not named and not pending:
            return None
        return replace(self, claims=claims, named=named, pending=pending)

    def without(self, uids: Iterable[str], names: Iterable[ClaimName] = ()) -> Unsettled | None:
        """Return the state with these claims settled (itself if none is in it); None once none is left."""
        gone, gone_names = set(uids), set(names)
        left = {uid: ids for uid, ids in self.claims.items() if uid not in gone}
        named = {n: ids for n, ids in self.named.items() if n not in gone_names}
        if len(left) == len(self.claims) and len(named) == len(self.named):
            return self
        return self._left(left, named, self.pending)

    def observed(self, named: Mapping[ClaimName, frozenset[str]]) -> Unsettled | None:
        """Return the state after a successful PodResources read that showed these claims (and no other)."""
        if not self.pending and named == self.named:
            return self
        return self._left(self.claims, dict(named), False)

    def unawaited(self) -> Unsettled | None:
        """Return the state without waiting for PodResources (a run that does not read them)."""
        return self if not self.pending else self._left(self.claims, self.named, False)

    def widened(self, device_ids: Iterable[str]) -> Unsettled:
        """Return the state also withholding these devices (the driver's pool as it is now)."""
        devices = self.devices.union(device_ids)
        return self if devices == self.devices else replace(self, devices=devices)


def _unsettled_doc(u: Unsettled) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "claims": {uid: sorted(ids) for uid, ids in u.claims.items()},
        "devices": sorted(u.devices),
        "reason": u.reason,
    }
    # Only when set: a state of spec-named claims alone is recorded as it always was.
    if u.named:
        doc["named"] = [
            {"namespace": ns, "name": name, "devices": sorted(ids)}
            for (ns, name), ids in sorted(u.named.items())
        ]
    if u.pending:
        doc["pending"] = True
    return doc


def _unsettled_of(doc: Any) -> Unsettled:
    """Return the unsettled state of a checkpoint; TypeError/ValueError if it is malformed."""
    if not isinstance(doc, dict) or not isinstance(doc.get("claims"), dict):
        raise TypeError("unsettled is not an object with claims")
    claims: dict[str, frozenset[str]] = {}
    for uid, ids in doc["claims"].items():
        if not isinstance(ids, list):
            raise TypeError(f"unsettled claim {clip(str(uid), 80)}: devices are not a list")
        claims[str(uid)] = frozenset(str(i) for i in ids)
    named: dict[ClaimName, frozenset[str]] = {}
    raw_named = doc.get("named", [])
    if not isinstance(raw_named, list):
        raise TypeError("unsettled named claims are not a list")
    for entry in raw_named:
        if not isinstance(entry, dict) or not isinstance(entry.get("devices"), list):
            raise TypeError("an unsettled named claim is not an object with devices")
        named[(str(entry.get("namespace", "")), str(entry.get("name", "")))] = frozenset(
            str(i) for i in entry["devices"]
        )
    pending = doc.get("pending", False) is True
    if not claims and not named and not pending:
        raise ValueError("unsettled names no claim")
    devices = doc.get("devices", [])
    if not isinstance(devices, list):
        raise TypeError("unsettled devices are not a list")
    return Unsettled(claims, frozenset(str(i) for i in devices), str(doc.get("reason", "")), named, pending)


def encode_claim(claim: PreparedClaim) -> bytes:
    """Return the canonical JSON bytes of one checkpoint entry."""
    return _canonical(_claim_doc(claim))


def encode_checkpoint(
    driver: str,
    claims: Mapping[str, PreparedClaim],
    encoded: Mapping[str, bytes] | None = None,
    unsettled: Unsettled | None = None,
    journal: Iterable[JournalRecord] = (),
) -> bytes:
    """Return the checkpoint bytes: the claims sorted by UID and a CRC32 over their canonical JSON.

    ``encoded`` may hold entries already encoded (by UID): a node with hundreds of prepared claims
    rewrites its checkpoint on every call, and re-encoding them all was most of a Prepare's time.
    ``unsettled`` (what a lost checkpoint may have held) is recorded too, under the same checksum, so
    a restart before the kubelet settled it still holds it; a checkpoint without it is as it always was.
    ``journal`` (the changes Prepare made to devices, ``configure.py``) is recorded and summed likewise,
    only when non-empty, so a checkpoint of a node without claim parameters is as it always was.
    """
    cached = encoded or {}
    entries = b"[" + b",".join(cached.get(uid) or encode_claim(claims[uid]) for uid in sorted(claims)) + b"]"
    # Written by hand in json.dumps(sort_keys=True, separators=(",", ":")) form, keys in sorted order,
    # so that decoding and re-encoding the entries gives back exactly the checksummed bytes.  Atomic
    # renames rule out torn files; the checksum catches hand edits and disk corruption, which would
    # otherwise silently free devices that pods still use.
    rest: dict[str, Any] = {"driver": driver, "kind": CHECKPOINT_KIND, "version": CHECKPOINT_VERSION}
    summed = entries
    if unsettled is not None:
        rest["unsettled"] = _unsettled_doc(unsettled)
        summed += _canonical(rest["unsettled"])
    records = [record_doc(r) for r in journal]
    if records:
        rest["journal"] = records
        summed += _canonical(records)
    head = _canonical({"checksum": zlib.crc32(summed)})[:-1]
    return head + b',"claims":' + entries + b"," + _canonical(rest)[1:] + b"\n"


class CheckpointError(ValueError):
    """A checkpoint file that cannot be trusted (not JSON, wrong kind, bad checksum, bad entry)."""


class Recorded(NamedTuple):
    """What a checkpoint holds: the prepared claims by UID, and what a lost checkpoint left unsettled."""

    claims: dict[str, PreparedClaim]
    unsettled: Unsettled | None = None
    journal: tuple[JournalRecord, ...] = ()  # changes made to devices, with the values that restore them


class Damage(NamedTuple):
    """A checkpoint that could not be read: what is wrong, and where the file was kept for an operator."""

    problem: str
    kept_as: str


class Loaded(NamedTuple):
    """The result of reading a checkpoint: what it records, or (``damage`` set) that it is lost."""

    recorded: Recorded
    damage: Damage | None = None

    @property
    def claims(self) -> dict[str, PreparedClaim]:
        """The prepared claims on record (none when the checkpoint is lost: see ``damage``)."""
        return self.recorded.claims


def decode_checkpoint(driver: str, data: bytes) -> dict[str, PreparedClaim]:
    """Return the claims of checkpoint bytes by UID, or raise CheckpointError saying what is wrong."""
    return decode_record(driver, data).claims


def decode_record(driver: str, data: bytes) -> Recorded:
    """Return what checkpoint bytes record, or raise CheckpointError saying what is wrong."""
    try:
        doc = json.loads(data)
    except ValueError as e:
        raise CheckpointError(f"not JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("kind") != CHECKPOINT_KIND:
        raise CheckpointError(f"not a {CHECKPOINT_KIND}")
    if doc.get("version") != CHECKPOINT_VERSION:
        raise CheckpointError(f"version {doc.get('version')!r}, this daemon reads {CHECKPOINT_VERSION}")
    if doc.get("driver") != driver:
        raise CheckpointError(f"written for driver {doc.get('driver')!r}, not {driver!r}")
    entries = doc.get("claims")
    raw_unsettled = doc.get("unsettled")
    if not isinstance(entries, list):
        raise CheckpointError("checksum mismatch")
    raw_journal = doc.get("journal")
    summed = _canonical(entries) + (b"" if raw_unsettled is None else _canonical(raw_unsettled))
    if raw_journal is not None:
        summed += _canonical(raw_journal)
    if doc.get("checksum") != zlib.crc32(summed):
        raise CheckpointError("checksum mismatch")
    claims: dict[str, PreparedClaim] = {}
    for n, entry in enumerate(entries):
        try:
            claim = _claim_of(entry)
        except (KeyError, TypeError, ValueError, OSError) as e:
            raise CheckpointError(f"claim entry {n} is malformed: {e!r}") from None
        claims[claim.ref.uid] = claim
    unsettled = None
    if raw_unsettled is not None:
        try:
            unsettled = _unsettled_of(raw_unsettled)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"unsettled state is malformed: {e}") from None
    journal: list[JournalRecord] = []
    if raw_journal is not None:
        if not isinstance(raw_journal, list):
            raise CheckpointError("journal is not a list")
        for n, entry in enumerate(raw_journal):
            try:
                journal.append(record_of(entry))
            except (KeyError, TypeError, ValueError) as e:
                raise CheckpointError(f"journal record {n} is malformed: {e!r}") from None
    return Recorded(claims, unsettled, tuple(journal))


class Checkpoint:
    """The prepared claims of one driver on disk: one JSON file, replaced atomically, never via a symlink."""

    def __init__(self, directory: Path, driver: str, name: str = CHECKPOINT_NAME) -> None:
        self.directory = Path(directory)
        self.driver = driver
        self.name = files.check_name(name)
        self._encoded: dict[str, tuple[PreparedClaim, bytes]] = {}  # UID -> (claim, its entry's bytes)
        # The journal as last loaded or saved: every save writes it unless given a new one.
        self.journal: tuple[JournalRecord, ...] = ()

    @property
    def path(self) -> Path:
        """The checkpoint file's path."""
        return self.directory / self.name

    def load(self) -> Loaded:
        """Return what the checkpoint records; nothing when there is no file.

        A file that cannot be trusted — not JSON, a bad checksum, another driver's, a symlink, a FIFO, a
        directory, too big — is never read through and never deleted: it is moved aside (kept for an
        operator) and ``damage`` says so.  The caller must then treat what it may have recorded as held
        (``NodeService.recover``): its claims are lost, not gone.
        """
        try:
            dirfd = files.open_dir(self.directory)
        except FileNotFoundError:
            return Loaded(Recorded({}))
        except OSError as e:
            # A plugin dir we cannot open (a symlink, no permission) may still hold a checkpoint.
            return Loaded(Recorded({}), Damage(f"cannot be opened: {e.strerror or e}", "(not moved)"))
        try:
            try:
                st = os.stat(self.name, dir_fd=dirfd, follow_symlinks=False)
            except FileNotFoundError:
                return Loaded(Recorded({}))
            # Bounded and non-blocking (files.read_if_regular: O_NOFOLLOW|O_NONBLOCK, size checked
            # before reading): a FIFO, a symlink loop or a 200 MiB file costs one open and one fstat.
            data = files.read_if_regular(dirfd, self.name, limit=MAX_CHECKPOINT)
            if data is None:
                problem = f"is not a regular file of at most {MAX_CHECKPOINT >> 20} MiB ({_kind_of(st)})"
            else:
                try:
                    recorded = decode_record(self.driver, data)
                    self.journal = recorded.journal
                    return Loaded(recorded)
                except CheckpointError as e:
                    problem = clip(str(e), 300)
            aside = f"{self.name}.bad-{os.getpid()}-{st.st_ino}"
            try:
                os.rename(self.name, aside, src_dir_fd=dirfd, dst_dir_fd=dirfd)
            except OSError as e:
                aside = f"(not moved: {e.strerror})"
            return Loaded(Recorded({}), Damage(problem, aside))
        finally:
            os.close(dirfd)

    def remove(self) -> None:
        """Remove the checkpoint file (a retired driver's, once it holds no claim); absent is fine."""
        files.remove(self.directory, self.name)
        self._encoded = {}

    def save(
        self,
        claims: Mapping[str, PreparedClaim],
        unsettled: Unsettled | None = None,
        journal: Iterable[JournalRecord] | None = None,
    ) -> None:
        """Replace the checkpoint with ``claims`` (atomic: a crash leaves the old or the new file).

        ``journal`` replaces the recorded journal once written; None keeps the one recorded.
        """
        records = self.journal if journal is None else tuple(journal)
        cache = self._encoded
        encoded = {}
        for uid, claim in claims.items():
            hit = cache.get(uid)
            encoded[uid] = hit[1] if hit is not None and hit[0] is claim else encode_claim(claim)
        files.write_atomic(
            self.directory,
            self.name,
            encode_checkpoint(self.driver, claims, encoded, unsettled, records),
            mode=CHECKPOINT_MODE,
        )
        self.journal = records
        self._encoded = {uid: (claims[uid], data) for uid, data in encoded.items()}


def _kind_of(st: os.stat_result) -> str:
    """Name what is at a path by its lstat (for the line saying why a checkpoint was not read)."""
    mode = st.st_mode
    for test, name in (
        (stat.S_ISLNK, "a symlink"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a device"),
        (stat.S_ISBLK, "a device"),
    ):
        if test(mode):
            return name
    return f"{st.st_size} bytes" if st.st_size > MAX_CHECKPOINT else "unreadable"


class PoolGate:
    """A DeviceGate over the daemon's state: which devices the node has, the DRA pools, health, holders.

    The daemon backs it with its device table, the pools whose API is DRA, its health tracker and its
    ownership map (a device a pod holds under the device-plugin API is ``held``); tests back it with
    plain dicts and sets.
    """

    def __init__(
        self,
        on_node: Callable[[str], bool],
        pools: Iterable[Pool],
        healthy: Callable[[str], bool],
        holder: Callable[[str], str | None] = lambda _device_id: None,
    ) -> None:
        self._on_node = on_node
        self._healthy = healthy
        self._holder = holder
        self._members: dict[str, Grant] = {}
        self.set_pools(pools)

    def set_pools(self, pools: Iterable[Pool]) -> None:
        """Take the DRA pools' current members (after a rescan or a reload)."""
        members: dict[str, Grant] = {}
        for pool in pools:
            for m in pool.members:
                members.setdefault(m.device.id, Grant(m.device, pool.config))
        self._members = members

    def __call__(self, device_id: str) -> Grant | Denied:
        """Return a Grant for a DRA pool's healthy, unheld device on this node, else why not."""
        grant = self._members.get(device_id)
        if grant is None:
            if not self._on_node(device_id):
                return Denied(Refusal.NOT_ON_NODE)
            return Denied(Refusal.NOT_OURS)
        if not self._healthy(device_id):
            return Denied(Refusal.UNHEALTHY)
        holder = self._holder(device_id)
        if holder:
            return Denied(Refusal.HELD, holder, grant)
        return grant
