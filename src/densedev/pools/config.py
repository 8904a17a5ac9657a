"""The config file: either plugin's ``config.json``, read into one model (``model.Config``).

Two formats load here unchanged, each by its own module over the shared checks of ``validator.py``:

* ``sriov_format.py``: the SR-IOV network device plugin's ``resourceList`` plus densedev's own keys;
* ``rdma_format.py``: the RDMA shared device plugin's ``configList`` (each entry a shared RDMA pool).

The top-level list names the format; a file holding both lists (or the other format's keys beside one)
is refused with one line, since no reading of it is the one its author meant.  Everything is checked
at load, never at match time, and every problem found is reported at once, each naming the pool, the key
and the reason (see ``docs/config.md``).
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path
from typing import Any

from ..model import DEFAULT_PREFIX, Config
from . import rdma_format, sriov_format
from .sriov_format import (
    _ALL_SELECTOR_KEYS,
    _HEALTH_KEYS,
    _POOL_KEYS,
    _TOP_KEYS,
    DEVICE_TYPES,
    DRA_MAX_DRIVER_NAME,
    DRA_MAX_STRING,
    MAX_RDMA_SHARED,
    MAX_VF_INDEX,
    normalize_pci_address,
    parse_index_range,
)
from .validator import (
    IFNAMSIZ,
    LINK_TYPES,
    MAX_CONFIG_BYTES,
    MAX_NESTING,
    MAX_PROBLEM_CHARS,
    MAX_PROBLEMS,
    ConfigError,
    Reader,
    decode_document,
    env_var_name,
    read_config_bytes,
    type_name,
    validate_resource_name,
)

# What this module offered before the formats had modules of their own (its importers and the tests).
__all__ = [
    "DEFAULT_PREFIX",
    "DEVICE_TYPES",
    "DRA_MAX_DRIVER_NAME",
    "DRA_MAX_STRING",
    "IFNAMSIZ",
    "LINK_TYPES",
    "MAX_CONFIG_BYTES",
    "MAX_NESTING",
    "MAX_PROBLEMS",
    "MAX_PROBLEM_CHARS",
    "MAX_RDMA_SHARED",
    "MAX_VF_INDEX",
    "_ALL_SELECTOR_KEYS",
    "_HEALTH_KEYS",
    "_POOL_KEYS",
    "_TOP_KEYS",
    "ConfigError",
    "Format",
    "check",
    "detect_format",
    "env_var_name",
    "load",
    "normalize_pci_address",
    "parse",
    "parse_index_range",
    "read_config_bytes",
    "validate_resource_name",
]


class Format(StrEnum):
    """Which plugin's config shape a file has, named by its top-level list."""

    SRIOV = "resourceList"  # the SR-IOV network device plugin's
    RDMA_SHARED = "configList"  # the RDMA shared device plugin's


# Keys only one format has (compared case-insensitively, as Go's decoder and our reader match keys).
_ONLY = {
    Format.SRIOV: ("resourceList", "draDriverName"),
    Format.RDMA_SHARED: ("configList", "periodicUpdateInterval", "kubeletRootDir"),
}
_WHOSE = {
    Format.SRIOV: "the SR-IOV network device plugin's",
    Format.RDMA_SHARED: "the RDMA shared device plugin's",
}


def detect_format(doc: Mapping[str, Any]) -> Format | str:
    """Return the format of a decoded document, or the one line saying why it mixes both.

    A document with neither list is read as the SR-IOV format, whose reader then names the missing
    ``resourceList``: that is the format densedev has always read.
    """
    lower = {k.lower(): k for k in doc}
    found = {fmt: [lower[k.lower()] for k in keys if k.lower() in lower] for fmt, keys in _ONLY.items()}
    if found[Format.SRIOV] and found[Format.RDMA_SHARED]:
        sriov, rdma = (", ".join(found[f]) for f in (Format.SRIOV, Format.RDMA_SHARED))
        whose_sriov, whose_rdma = _WHOSE[Format.SRIOV], _WHOSE[Format.RDMA_SHARED]
        return (
            f"mixes two formats: {sriov} ({whose_sriov}) with {rdma} ({whose_rdma}); "
            "a file is one or the other"
        )
    return Format.RDMA_SHARED if found[Format.RDMA_SHARED] else Format.SRIOV


def parse(text: str, *, default_prefix: str = DEFAULT_PREFIX, source: str = "<string>") -> Config:
    """Parse and validate a config document of either format; raise ConfigError listing every problem.

    ``default_prefix`` is the SR-IOV format's default ``resourcePrefix``; the RDMA shared format's is
    always ``rdma``, as in that plugin (which has no flag for it).
    """
    doc = decode_document(text, source)
    if not isinstance(doc, Mapping):
        raise ConfigError(
            [f"expected a JSON object with resourceList or configList, got {type_name(doc)}"], source
        )
    fmt = detect_format(doc)
    if not isinstance(fmt, Format):
        raise ConfigError([fmt], source)
    r = Reader(default_prefix)
    if fmt is Format.RDMA_SHARED:
        f = r.fields(doc, rdma_format.TOP_KEYS, "")
        cfg = rdma_format.read_document(r, f)
    else:
        f = r.fields(doc, _TOP_KEYS, "")
        cfg = sriov_format.read_document(r, f)
    if r.count:
        raise ConfigError(r.problems, source, more=r.more)
    return cfg._replace(warnings=r.all_warnings())


def load(path: str | Path, *, default_prefix: str = DEFAULT_PREFIX) -> Config:
    """Read and validate a config file of either format; raise ConfigError listing every problem."""
    p = Path(path)
    data = read_config_bytes(p)
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ConfigError([f"not UTF-8 text (byte {exc.start})"], str(p)) from None
    return parse(text, default_prefix=default_prefix, source=str(p))


def check(path: str | Path, *, default_prefix: str = DEFAULT_PREFIX) -> tuple[str, ...]:
    """Return every problem of a config file (empty when it is valid), for ``densedev check-config``."""
    try:
        load(path, default_prefix=default_prefix)
    except ConfigError as exc:
        return exc.problems
    return ()
