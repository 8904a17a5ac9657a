"""Leftovers: the CDI specs and device-info files no configured pool and no held device needs any more.

A daemon killed with SIGKILL (OOM killer, node pressure, ``kubectl delete --force``) never runs its
cleanup, and the next start may have a config without some of its pools: their device-info files and
CDI specs would stay forever.  At start the daemon looks at every file it owns *by its naming* in the
CDI and device-info directories and keeps only what a configured pool's devices, or a device a pod
still holds, need.  Files of other programs are never touched:

- CDI: densedev names its specs ``densedev-*.json`` (``cdi.FILE_PREFIX``), a prefix of its own.
- device-info: the directory is shared with other device plugins that name files the same way
  (``<prefix>-<name>-<address>-device.json``), so a file is ours only when its stem is a configured
  pool's or is named in densedev's ownership record (``devinfo.OWNED_RECORD``), which every pool
  writes before its first file.

The kubelet restarts a pod's containers from its checkpointed Allocate response, which names our CDI
devices ``<resource>=<device>``, the kind being the resource (``respond.cdi_class``): one rule,
``prune_cdi``, keeps the spec of every configured pool and of every resource pods still hold devices
under, at start and after every release; device-info files, one per device, stay while their device is
held under any resource.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple, Protocol

from .. import files
from ..model import Device
from ..ops.logs import log_event, summarise
from . import cdi, devinfo

log = logging.getLogger(__name__)

Held = Mapping[str, Collection[str]]  # resource name -> device IDs running pods hold under it


class PoolClaim(NamedTuple):
    """What one configured pool may own on disk: its CDI kind, its device-info stem and its devices."""

    kind: str  # "" when the pool writes no CDI spec
    info_stem: str | None  # None when the pool writes no device-info files
    devices: frozenset[str]  # the PCI addresses of its devices (device-info files are named by them)


class Reconciled(NamedTuple):
    """What a reconcile removed and kept, and what it could not do (each a log line, never an error)."""

    removed: tuple[Path, ...]
    kept_info: Mapping[str, frozenset[str]]  # stem -> device IDs kept
    kept_specs: tuple[Path, ...] = ()
    problems: tuple[str, ...] = ()


class FileOwner(Protocol):
    """A pool's file side (``respond.PoolAllocator``): says what it owns, adopts and retains files."""

    def claim(self) -> PoolClaim:
        """Return what this pool may own on disk."""
        ...

    def adopt_info(self, device_ids: Iterable[str]) -> None:
        """Take device-info files an earlier run left for these devices as this pool's own."""
        ...

    def retain(self, devices: Sequence[Device]) -> None:
        """Keep the files of these devices, held under this pool's resource, after they left the pool."""
        ...


def reconcile(
    cdi_dir: Path | None,
    devinfo_dir: Path | None,
    claims: Sequence[PoolClaim],
    held: Held | None = None,
) -> Reconciled:
    """Remove our files that no configured pool and no held device needs; return what was done.

    ``held`` names the devices pods still hold (from the kubelet) by resource: the specs of those
    resources and the device-info files of those devices stay, whatever pool wrote them.  Without it,
    only what the configured pools have is kept.
    """
    held = held or {}
    removed: list[Path] = []
    problems: list[str] = []
    kept_specs: list[Path] = []
    kept_info: dict[str, frozenset[str]] = {}
    if cdi_dir is not None:
        specs = prune_cdi(cdi_dir, claims, held)
        removed.extend(specs.removed)
        kept_specs.extend(specs.kept_specs)
        problems.extend(specs.problems)
    if devinfo_dir is not None:
        in_use = frozenset(i for ids in held.values() for i in ids)
        kept_info = _reconcile_devinfo(devinfo_dir, claims, in_use, removed, problems)
    return Reconciled(tuple(removed), kept_info, tuple(kept_specs), tuple(problems))


def reconcile_pools(
    cdi_dir: Path | None,
    devinfo_dir: Path | None,
    owners: Sequence[FileOwner],
    held: Held | None = None,
) -> Reconciled:
    """Reconcile for the daemon's pools, and hand each pool the device-info files kept for it."""
    claims = [o.claim() for o in owners]
    result = reconcile(cdi_dir, devinfo_dir, claims, held)
    for owner, claim in zip(owners, claims, strict=True):
        if claim.info_stem is not None:
            kept = result.kept_info.get(claim.info_stem, frozenset())
            # Only files of its current devices become the pool's: those of held devices that left it
            # stay until a later start finds them released.
            owner.adopt_info(kept & claim.devices)
    return result


def _remove(directory: Path, name: str, removed: list[Path], problems: list[str]) -> None:
    try:
        if files.remove(directory, name):
            removed.append(directory / name)
    except OSError as e:
        problems.append(f"cannot remove {directory / name}: {e.strerror or e}")


def _list(directory: Path, problems: list[str]) -> list[str]:
    try:
        return files.list_names(directory)
    except OSError as e:
        problems.append(f"cannot list {directory}: {e.strerror or e}")
        return []


def prune_cdi(directory: Path, claims: Sequence[PoolClaim], held: Held) -> Reconciled:
    """Remove our CDI specs of kinds no configured pool writes and no pod holds devices under.

    The one CDI rule, at start and after every release: a spec's kind is its pool's resource name, and
    the kubelet restarts a container from its checkpointed response naming ``<resource>=<device>``.
    Temporary files of ours (a crash between write and rename) go too.
    """
    removed: list[Path] = []
    kept: list[Path] = []
    problems: list[str] = []
    wanted = {cdi.spec_file_name(c.kind) for c in claims if c.kind}
    wanted.update(cdi.spec_file_name(r) for r, ids in held.items() if ids)
    for name in _list(directory, problems):
        if files.is_temp_of(name, cdi.FILE_PREFIX):
            _remove(directory, name, removed, problems)
        elif cdi.is_spec_name(name):
            if name in wanted:
                kept.append(directory / name)
            else:
                _remove(directory, name, removed, problems)
    return Reconciled(tuple(removed), {}, kept_specs=tuple(kept), problems=tuple(problems))


def _reconcile_devinfo(
    directory: Path,
    claims: Sequence[PoolClaim],
    held: frozenset[str],
    removed: list[Path],
    problems: list[str],
) -> dict[str, frozenset[str]]:
    current: dict[str, set[str]] = {}
    for c in claims:
        if c.info_stem is not None:
            current.setdefault(c.info_stem, set()).update(c.devices)
    recorded = devinfo.read_owners(directory)
    owned = recorded | set(current)
    kept: dict[str, set[str]] = {}
    for name in _list(directory, problems):
        if files.is_temp_of(name, devinfo.OWNED_RECORD) or any(
            files.is_temp_of(name, s + "-") for s in owned
        ):
            _remove(directory, name, removed, problems)
            continue
        parsed = devinfo.parse_name(name)
        if parsed is None or parsed[0] not in owned:
            continue  # another program's file
        stem, device_id = parsed
        if device_id in current.get(stem, ()) or device_id in held:
            kept.setdefault(stem, set()).add(device_id)
        else:
            _remove(directory, name, removed, problems)
    # The record names exactly the stems that still have files here (a pool records itself again
    # before it writes its first file).
    if set(kept) != recorded:
        try:
            devinfo.write_owners(directory, kept)
        except OSError as e:
            problems.append(f"cannot update {directory / devinfo.OWNED_RECORD}: {e.strerror or e}")
    return {s: frozenset(ids) for s, ids in kept.items()}


class Leftovers:
    """The daemon's files beyond what each pool keeps itself: reconciled at start, pruned after releases."""

    def __init__(self, cdi_dir: Path | None, devinfo_dir: Path | None) -> None:
        self.cdi_dir = cdi_dir
        self.devinfo_dir = devinfo_dir

    def reconcile(self, owners: Sequence[FileOwner], held: Held) -> None:
        """At start: remove what an earlier run left that no pool and no held device needs (logged)."""
        try:
            result = reconcile_pools(self.cdi_dir, self.devinfo_dir, owners, held)
        except Exception:
            log.exception("reconciling files left by an earlier run failed; going on without")
            return
        _report(result, "removed files left by an earlier run")

    def prune(self, owners: Sequence[FileOwner], held: Held) -> None:
        """After a release: remove the specs of pools no longer configured once nothing is held under them."""
        if self.cdi_dir is None:
            return
        _report(prune_cdi(self.cdi_dir, [o.claim() for o in owners], held), "removed stale CDI specs")

    def retain(
        self, owners: Mapping[str, FileOwner], held: Held, devices: Callable[[], Mapping[str, Device]]
    ) -> None:
        """Have each pool keep the files of devices pods hold under its resource after they left it."""
        if self.cdi_dir is None and self.devinfo_dir is None:
            return
        by_id = devices() if held else {}
        for name, owner in owners.items():
            try:
                owner.retain([by_id[i] for i in sorted(held.get(name, ())) if i in by_id])
            except Exception:
                log.exception("pool %s: keeping the files of held devices failed", name)


def _report(result: Reconciled, what: str) -> None:
    """Log what was removed (one line, summarised) and each problem met (one line each)."""
    for problem in result.problems:
        log_event(log, "leftover file not reconciled", level=logging.WARNING, problem=problem)
    if result.removed:
        log_event(log, what, files=summarise([p.name for p in result.removed], noun="file"))
