"""CDI (Container Device Interface) specs: one JSON file per pool, written atomically, only on change.

A CDI-aware runtime (containerd ≥ 1.7, CRI-O ≥ 1.23) resolves each fully-qualified name the kubelet
passes in ``ContainerAllocateResponse.cdi_devices`` (``vendor.com/class=name``) against the spec files in
its CDI directories and applies that device's ``containerEdits``.  Runtimes re-read the directory when a
file changes, and may read it at any moment, so a spec is written to a temporary file and renamed over
the old one (rename is atomic within a filesystem) and never rewritten when its content is unchanged.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .. import files

log = logging.getLogger(__name__)

# CDI spec version we emit: 0.5.0 added deviceNodes.hostPath, which we need because the node path on
# the host (/dev/vfio/noiommu-7) can differ from the one in the container (/dev/vfio/7).
CDI_VERSION = "0.5.0"
DEFAULT_CDI_DIR = Path("/var/run/cdi")
FILE_PREFIX = "densedev-"  # every spec this daemon writes starts with it; nothing else is ever deleted
ANNOTATION_PREFIX = "cdi.k8s.io/"

# From the CDI spec: the kind's name segment (the class) is alphanumerics with "-", "_", "." between,
# beginning and ending alphanumeric, at most 63 characters; a device name may also contain ":".
# Always fullmatch: Python's `$` also matches before a final newline, so "vf\n" would pass match().
_CLASS_RE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?")
_VENDOR_RE = re.compile(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*")
_DEVICE_RE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?")
_UNSAFE_FILE = re.compile(r"[^A-Za-z0-9_.-]")


class CdiError(ValueError):
    """A CDI kind or device name the spec would reject."""


def make_kind(prefix: str, pool: str) -> str:
    """Return the CDI kind ``<prefix>/<pool>`` for a pool, checking both segments against the spec."""
    if not _VENDOR_RE.fullmatch(prefix) or len(prefix) > 253:
        raise CdiError(f"CDI vendor {prefix!r}: must be a lower-case DNS subdomain")
    if not _CLASS_RE.fullmatch(pool):
        raise CdiError(
            f"CDI class {pool!r}: must be ≤63 alphanumerics, '-', '_', '.', alphanumeric at both ends"
        )
    return f"{prefix}/{pool}"


def qualified_name(kind: str, device: str) -> str:
    """Return the fully-qualified CDI device name ``vendor/class=device``."""
    if not _DEVICE_RE.fullmatch(device):
        raise CdiError(f"CDI device name {device!r}: must be alphanumerics, '-', '_', '.', ':'")
    return f"{kind}={device}"


def spec_file_name(kind: str) -> str:
    """Return the spec file name for a kind: ``densedev-<vendor>-<class>.json``, one component always.

    Every character but ``[A-Za-z0-9_.-]`` becomes ``_`` (so no ``/`` or control character from a
    config reaches the filesystem); a kind too long for one file name is named by its hash instead.
    """
    name = FILE_PREFIX + _UNSAFE_FILE.sub("_", kind.replace("/", "-")) + ".json"
    if len(name) > files.NAME_MAX:
        name = FILE_PREFIX + hashlib.sha256(kind.encode()).hexdigest()[:32] + ".json"
    return files.check_name(name)


def annotation(kind: str, resource: str, names: Sequence[str]) -> tuple[str, str]:
    """Return the ``cdi.k8s.io/<key>`` annotation for runtimes that only read CDI devices from annotations.

    The key's name part must be a Kubernetes qualified name of at most 63 characters, so it is the
    resource name with other characters made ``_``, cut to fit; the value is the comma-separated names.
    """
    key = re.sub(r"[^A-Za-z0-9_.-]", "_", f"densedev_{kind.split('/', 1)[1]}_{resource}")[:63]
    key = key.rstrip("_.-")
    return ANNOTATION_PREFIX + key, ",".join(names)


def device_entry(name: str, nodes: Iterable[tuple[str, str, str]], env: Mapping[str, str]) -> dict[str, Any]:
    """Return one ``devices[]`` entry: its name and container edits (device nodes, env)."""
    edits: dict[str, Any] = {}
    node_list = [
        {"path": container, "hostPath": host, "permissions": perms} for container, host, perms in nodes
    ]
    if node_list:
        edits["deviceNodes"] = node_list
    if env:
        edits["env"] = [f"{k}={v}" for k, v in sorted(env.items())]
    return {"name": name, "containerEdits": edits}


def spec_document(kind: str, entries: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Return a whole CDI spec for a kind and its device entries (sorted by name, so output is stable)."""
    return {
        "cdiVersion": CDI_VERSION,
        "kind": kind,
        "devices": sorted(entries, key=lambda e: str(e["name"])),
    }


def spec_bytes(doc: Mapping[str, Any]) -> bytes:
    """Return the bytes of a spec file: canonical JSON, so equal content means equal bytes.

    Compact, because a pool of 16k devices makes a spec of megabytes that runtimes re-read on change.
    """
    return (files.canonical_json(doc) + "\n").encode()


def write_atomic(path: Path, data: bytes) -> bool:
    """Write ``data`` to ``path`` atomically (see ``files.write_atomic``); False if it was already there."""
    return files.write_atomic(path.parent, path.name, data)


class SpecWriter:
    """Owns the CDI spec files of this daemon in one directory; writes on change, deletes only its own."""

    def __init__(self, directory: Path = DEFAULT_CDI_DIR) -> None:
        self.directory = directory

    def path_of(self, kind: str) -> Path:
        """Return the path of a kind's spec file."""
        return self.directory / spec_file_name(kind)

    def write(self, kind: str, entries: Iterable[dict[str, Any]]) -> bool:
        """Write the kind's spec if its content changed; return whether the file was (re)written."""
        return write_atomic(self.path_of(kind), spec_bytes(spec_document(kind, entries)))

    def remove(self, kind: str) -> None:
        """Delete the kind's spec (a pool that is gone); a missing file is fine, other failures are logged."""
        try:
            files.remove(self.directory, spec_file_name(kind))
        except OSError as e:
            log.warning("cannot remove CDI spec of %s in %s: %s", kind, self.directory, e)


def is_spec_name(name: str) -> bool:
    """Return whether a file name is one this daemon gives its specs (``densedev-*.json``)."""
    return name.startswith(FILE_PREFIX) and name.endswith(".json")
