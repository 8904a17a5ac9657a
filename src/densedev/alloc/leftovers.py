"""Crash leftovers: reconcile the CDI specs and device-info files an earlier run left with the pools now.

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
devices: a spec or file of a device a pod still holds is kept even when its pool is gone.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from .. import files
from . import cdi, devinfo

log = logging.getLogger(__name__)

MAX_SPEC_READ = 64 * 1024 * 1024  # a spec of 16k devices is a few MB; anything bigger is not ours


@dataclass(frozen=True)
class PoolClaim:
    """What one configured pool may own on disk: its CDI kind, its device-info stem and its devices."""

    kind: str  # "" when the pool writes no CDI spec
    info_stem: str | None  # None when the pool writes no device-info files
    devices: frozenset[str]  # the PCI addresses of its devices (device-info files are named by them)


@dataclass(frozen=True)
class Reconciled:
    """What a reconcile removed and kept, and what it could not do (each a log line, never an error)."""

    removed: tuple[Path, ...]
    kept_info: Mapping[str, frozenset[str]] = field(default_factory=dict)  # stem -> device IDs kept
    kept_specs: tuple[Path, ...] = ()
    problems: tuple[str, ...] = ()


class FileOwner(Protocol):
    """A pool's file side (``allocation.PoolAllocator``): says what it owns, adopts what it kept."""

    def claim(self) -> PoolClaim:
        """Return what this pool may own on disk."""
        ...

    def adopt_info(self, device_ids: Iterable[str]) -> None:
        """Take device-info files an earlier run left for these devices as this pool's own."""
        ...


def reconcile(
    cdi_dir: Path | None,
    devinfo_dir: Path | None,
    claims: Sequence[PoolClaim],
    in_use: frozenset[str] | None = None,
) -> Reconciled:
    """Remove our files that no configured pool and no held device needs; return what was done.

    ``in_use`` is the set of device IDs a pod still holds (from the kubelet); their files stay whatever
    pool they were written for.  Without it, only what the configured pools' devices have is kept.
    """
    held = in_use or frozenset()
    removed: list[Path] = []
    problems: list[str] = []
    kept_specs: list[Path] = []
    kept_info: dict[str, frozenset[str]] = {}
    if cdi_dir is not None:
        _reconcile_cdi(cdi_dir, claims, held, removed, kept_specs, problems)
    if devinfo_dir is not None:
        kept_info = _reconcile_devinfo(devinfo_dir, claims, held, removed, problems)
    return Reconciled(tuple(removed), kept_info, tuple(kept_specs), tuple(problems))


def reconcile_pools(
    cdi_dir: Path | None,
    devinfo_dir: Path | None,
    owners: Sequence[FileOwner],
    in_use: frozenset[str] | None = None,
) -> Reconciled:
    """Reconcile for the daemon's pools, and hand each pool the device-info files kept for it."""
    claims = [o.claim() for o in owners]
    result = reconcile(cdi_dir, devinfo_dir, claims, in_use)
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


def _spec_devices(directory: Path, name: str) -> set[str]:
    """Return the device names a spec file lists (empty when it cannot be read as a spec)."""
    data = files.read_regular(directory, name, MAX_SPEC_READ)
    if data is None:
        return set()
    try:
        doc = json.loads(data)
    except ValueError:
        return set()
    devices = doc.get("devices") if isinstance(doc, dict) else None
    if not isinstance(devices, list):
        return set()
    return {d["name"] for d in devices if isinstance(d, dict) and isinstance(d.get("name"), str)}


def _reconcile_cdi(
    directory: Path,
    claims: Sequence[PoolClaim],
    held: frozenset[str],
    removed: list[Path],
    kept: list[Path],
    problems: list[str],
) -> None:
    wanted = {cdi.spec_file_name(c.kind) for c in claims if c.kind}
    for name in _list(directory, problems):
        if files.is_temp_of(name, cdi.FILE_PREFIX):
            _remove(directory, name, removed, problems)  # a crash between write and rename
        elif cdi.is_spec_name(name):
            if name in wanted or (held and _spec_devices(directory, name) & held):
                kept.append(directory / name)
            else:
                _remove(directory, name, removed, problems)


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
