"""Device-info files for Multus and SR-IOV CNI (the Network Plumbing WG device-info spec, 1.1.0).

The device plugin writes ``<dir>/<prefix>-<name>-<address>-device.json`` at Allocate; the CNI plugin
that later attaches the interface reads it and copies it into the pod's ``network-status`` annotation,
where applications (DPDK, KubeVirt) find the PCI address of the device they were given.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .. import files, pci
from ..model import Device

log = logging.getLogger(__name__)

DEFAULT_DEVINFO_DIR = Path("/var/run/k8s.cni.cncf.io/devinfo/dp")
SPEC_VERSION = "1.1.0"
_UNSAFE = re.compile(r"[^A-Za-z0-9_.:-]")
SUFFIX = "-device.json"
# What a device-info file of ours is named: the pool's stem, a PCI address as the kernel names it, the suffix.
_OURS = re.compile(rf"(?P<stem>.+)-(?P<id>{pci.ADDRESS})-device\.json")
# The record of which stems (pools) densedev wrote files for, kept beside them: the directory is shared
# with other device plugins (the SR-IOV network device plugin names its files the same way), so a file
# is densedev's only when its stem is recorded here or belongs to a pool configured now.
OWNED_RECORD = ".densedev-devinfo-owners.json"


def stem(prefix: str, name: str) -> str:
    """Return a pool's file-name stem: ``<prefix>-<name>`` with every unsafe character made ``_``."""
    return _UNSAFE.sub("_", f"{prefix}-{name}")


def file_name(prefix: str, name: str, device_id: str) -> str:
    """Return the device-info file name the CNI side looks up: ``<prefix>-<name>-<address>-device.json``.

    One path component always: ``/`` and control characters of a config value become ``_``.
    """
    return files.check_name(stem(prefix, name) + "-" + _UNSAFE.sub("_", device_id) + SUFFIX)


def parse_name(name: str) -> tuple[str, str] | None:
    """Return (stem, device ID) of a device-info file name of our shape, or None."""
    m = _OURS.fullmatch(name)
    return (m["stem"], m["id"]) if m else None


def read_owners(directory: Path) -> set[str]:
    """Return the stems recorded as densedev's in ``directory`` (empty when there is no record)."""
    data = files.read_regular(directory, OWNED_RECORD, limit=1 << 20)
    if data is None:
        return set()
    try:
        doc = json.loads(data)
    except ValueError:
        log.warning("device-info ownership record %s is not JSON; ignoring it", directory / OWNED_RECORD)
        return set()
    stems = doc.get("stems") if isinstance(doc, dict) else None
    return {s for s in stems if isinstance(s, str)} if isinstance(stems, list) else set()


def write_owners(directory: Path, stems: Iterable[str]) -> None:
    """Record ``stems`` as the pools densedev has device-info files for in ``directory`` (none: no record)."""
    wanted = sorted(set(stems))
    if not wanted:
        files.remove(directory, OWNED_RECORD)
        return
    body = json.dumps({"stems": wanted}, separators=(",", ":")) + "\n"
    files.write_atomic(directory, OWNED_RECORD, body.encode())


def info_document(device: Device, vhost_net: bool, vdpa_path: str, if_name: str = "") -> dict[str, Any]:
    """Return the device-info document of a device: ``type: vdpa`` if a vDPA device sits on it, else pci.

    ``if_name`` (a DRA claim's ``ifName``) is written as ``interface-name`` in the type's object.  The spec
    (1.1.0) has no field for it; readers that decode the file into the spec's types (Go's encoding/json)
    skip a field they do not know, so it breaks none of them, and a CNI reading the file finds the name.
    """
    doc = _info_document(device, vhost_net, vdpa_path)
    if if_name:
        doc[doc["type"]]["interface-name"] = if_name
    return doc


def _info_document(device: Device, vhost_net: bool, vdpa_path: str) -> dict[str, Any]:
    if device.vdpa:
        vdpa: dict[str, str] = {
            "parent-device": device.vdpa,
            # The spec names the bus driver without the "_vdpa" suffix: "vhost" or "virtio".
            "driver": device.vdpa_driver.removesuffix("_vdpa"),
            "pci-address": device.id,
        }
        if vdpa_path:
            vdpa["path"] = vdpa_path
        if device.pf:
            vdpa["pf-pci-address"] = device.pf
        return {"type": "vdpa", "version": SPEC_VERSION, "vdpa": vdpa}
    pci: dict[str, str] = {"pci-address": device.id}
    if device.pf:
        pci["pf-pci-address"] = device.pf
    if device.rdma_device:
        pci["rdma-device"] = device.rdma_device
    if vhost_net:
        pci["vhost-net"] = "/dev/vhost-net"
    return {"type": "pci", "version": SPEC_VERSION, "pci": pci}


def document_bytes(doc: dict[str, Any]) -> bytes:
    """Return the bytes of a device-info file: sorted keys, so equal content means equal bytes.

    Not the compact canonical form: these files have always been written with json's default spacing,
    and rewriting every file of a node on upgrade for whitespace alone would buy nothing.
    """
    return (json.dumps(doc, sort_keys=True) + "\n").encode()


class InfoWriter:
    """Writes and removes one pool's device-info files, remembering which ones it wrote."""

    def __init__(self, directory: Path, prefix: str, name: str) -> None:
        self.directory = directory
        self.prefix = prefix
        self.name = name
        self.written: set[str] = set()  # device IDs whose file this writer created or refreshed
        self.stem = stem(prefix, name)
        self._recorded = False  # whether the ownership record is known to name our stem

    def path_of(self, device_id: str) -> Path:
        """Return the device-info file path of a device of this pool."""
        return self.directory / file_name(self.prefix, self.name, device_id)

    def adopt(self, device_ids: Iterable[str]) -> None:
        """Take files an earlier run left for these devices as ours (removed as if this writer wrote them)."""
        self.written.update(device_ids)
        # An earlier run recorded our stem before writing them (reconcile keeps it while files remain).
        self._recorded = self._recorded or bool(self.written)

    def _record(self) -> None:
        # Recorded before the first file is written: a crash right after leaves a file the next start
        # recognises as ours.
        if self._recorded:
            return
        owners = read_owners(self.directory)
        if self.stem not in owners:
            write_owners(self.directory, owners | {self.stem})
        self._recorded = True

    def _unrecord(self) -> None:
        # Our last file is gone: the record no longer needs our stem (and goes with its last stem).
        if not self._recorded or self.written:
            return
        self._recorded = False
        try:
            owners = read_owners(self.directory)
            if self.stem in owners:
                write_owners(self.directory, owners - {self.stem})
        except OSError as e:
            log.warning("cannot update device-info ownership record in %s: %s", self.directory, e)

    def write_all(self, docs: dict[str, dict[str, Any]]) -> None:
        """Write every document, or none: on an error, files written by this call are removed again."""
        done: list[str] = []
        if docs:
            self._record()
        try:
            for device_id, doc in docs.items():
                name = file_name(self.prefix, self.name, device_id)
                if (
                    files.write_atomic(self.directory, name, document_bytes(doc))
                    or device_id not in self.written
                ):
                    done.append(device_id)
                self.written.add(device_id)
        except BaseException:
            for device_id in done:
                self.remove((device_id,))
            raise
        finally:
            self._unrecord()

    def remove(self, device_ids: Iterable[str]) -> None:
        """Remove the files of these devices (left the pool, or shutdown); missing files are fine."""
        for device_id in device_ids:
            self.written.discard(device_id)
            try:
                files.remove(self.directory, file_name(self.prefix, self.name, device_id))
            except (OSError, ValueError) as e:
                log.warning("cannot remove device-info file %s: %s", self.path_of(device_id), e)
        self._unrecord()

    def close(self) -> None:
        """Remove every file this writer wrote."""
        self.remove(sorted(self.written))
