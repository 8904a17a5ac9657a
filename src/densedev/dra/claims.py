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
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from .. import files
from ..model import Device, Pool, PoolConfig
from . import CHECKPOINT_NAME
from .checkpoints import CHECKPOINT_KIND, MAX_CHECKPOINT

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

    def held(self) -> frozenset[str]:
        """Return the device IDs this claim holds (admin-access results hold nothing)."""
        return frozenset(d.device_id for d in self.devices if not d.admin)


def _claim_doc(c: PreparedClaim) -> dict[str, Any]:
    return {
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
    return PreparedClaim(ref, devices, files.check_name(str(doc["specFile"])), spec, info)


def _canonical(value: Any) -> bytes:
    return files.canonical_json(value).encode()


def encode_claim(claim: PreparedClaim) -> bytes:
    """Return the canonical JSON bytes of one checkpoint entry."""
    return _canonical(_claim_doc(claim))


def encode_checkpoint(
    driver: str, claims: Mapping[str, PreparedClaim], encoded: Mapping[str, bytes] | None = None
) -> bytes:
    """Return the checkpoint bytes: the claims sorted by UID and a CRC32 over their canonical JSON.

    ``encoded`` may hold entries already encoded (by UID): a node with hundreds of prepared claims
    rewrites its checkpoint on every call, and re-encoding them all was most of a Prepare's time.
    """
    cached = encoded or {}
    entries = b"[" + b",".join(cached.get(uid) or encode_claim(claims[uid]) for uid in sorted(claims)) + b"]"
    # Written by hand in json.dumps(sort_keys=True, separators=(",", ":")) form, keys in sorted order,
    # so that decoding and re-encoding the entries gives back exactly the checksummed bytes.  Atomic
    # renames rule out torn files; the checksum catches hand edits and disk corruption, which would
    # otherwise silently free devices that pods still use.
    head = _canonical({"checksum": zlib.crc32(entries)})[:-1]
    tail = _canonical({"driver": driver, "kind": CHECKPOINT_KIND, "version": CHECKPOINT_VERSION})[1:]
    return head + b',"claims":' + entries + b"," + tail + b"\n"


class CheckpointError(ValueError):
    """A checkpoint file that cannot be trusted (not JSON, wrong kind, bad checksum, bad entry)."""


def decode_checkpoint(driver: str, data: bytes) -> dict[str, PreparedClaim]:
    """Return the claims of checkpoint bytes by UID, or raise CheckpointError saying what is wrong."""
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
    if not isinstance(entries, list) or doc.get("checksum") != zlib.crc32(_canonical(entries)):
        raise CheckpointError("checksum mismatch")
    claims: dict[str, PreparedClaim] = {}
    for n, entry in enumerate(entries):
        try:
            claim = _claim_of(entry)
        except (KeyError, TypeError, ValueError, OSError) as e:
            raise CheckpointError(f"claim entry {n} is malformed: {e!r}") from None
        claims[claim.ref.uid] = claim
    return claims


class Checkpoint:
    """The prepared claims of one driver on disk: one JSON file, replaced atomically, never via a symlink."""

    def __init__(self, directory: Path, driver: str, name: str = CHECKPOINT_NAME) -> None:
        self.directory = Path(directory)
        self.driver = driver
        self.name = files.check_name(name)
        self._encoded: dict[str, tuple[PreparedClaim, bytes]] = {}  # UID -> (claim, its entry's bytes)

    @property
    def path(self) -> Path:
        """The checkpoint file's path."""
        return self.directory / self.name

    def load(self) -> dict[str, PreparedClaim]:
        """Return the recorded claims by UID; none when there is no file.

        A file that cannot be trusted is moved aside (kept for an operator, never deleted) with one
        error line, and the daemon starts with no recorded claims; a symlink or other non-file at the
        path is ignored the same way, and never read through.
        """
        try:
            dirfd = files.open_dir(self.directory)
        except FileNotFoundError:
            return {}
        try:
            try:
                st = os.stat(self.name, dir_fd=dirfd, follow_symlinks=False)
            except FileNotFoundError:
                return {}
            data = files.read_if_regular(dirfd, self.name, limit=MAX_CHECKPOINT)
            if data is None:
                problem = "is not a regular file of at most 64 MiB (a symlink, or unreadable)"
            else:
                try:
                    return decode_checkpoint(self.driver, data)
                except CheckpointError as e:
                    problem = str(e)
            aside = f"{self.name}.bad-{os.getpid()}-{st.st_ino}"
            try:
                os.rename(self.name, aside, src_dir_fd=dirfd, dst_dir_fd=dirfd)
            except OSError as e:
                aside = f"(not moved: {e.strerror})"
            log.error(
                "DRA checkpoint %s %s; starting with no prepared claims, the file is kept as %s",
                self.path,
                problem,
                aside,
            )
            return {}
        finally:
            os.close(dirfd)

    def remove(self) -> None:
        """Remove the checkpoint file (a retired driver's, once it holds no claim); absent is fine."""
        files.remove(self.directory, self.name)
        self._encoded = {}

    def save(self, claims: Mapping[str, PreparedClaim]) -> None:
        """Replace the checkpoint with ``claims`` (atomic: a crash leaves the old or the new file)."""
        cache = self._encoded
        encoded = {}
        for uid, claim in claims.items():
            hit = cache.get(uid)
            encoded[uid] = hit[1] if hit is not None and hit[0] is claim else encode_claim(claim)
        files.write_atomic(
            self.directory, self.name, encode_checkpoint(self.driver, claims, encoded), mode=CHECKPOINT_MODE
        )
        self._encoded = {uid: (claims[uid], data) for uid, data in encoded.items()}


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
