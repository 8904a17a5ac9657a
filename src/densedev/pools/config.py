"""The config file: the SR-IOV network device plugin's ``config.json`` plus densedev's own keys.

Any file that plugin accepts loads here unchanged (see ``docs/config.md``); densedev's additions are
optional keys with defaults, so old files stay valid.  Everything is checked at load, never at match
time, and every problem found is reported at once, each naming the pool, the key and the reason.
"""

from __future__ import annotations

import difflib
import errno
import functools
import json
import math
import os
import re
import stat
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from .. import pci
from ..dra.classes import device_class_name
from ..model import (
    DEFAULT_DRIVER_NAME,
    Config,
    DeviceType,
    HealthPolicy,
    IndexRange,
    IndexSpans,
    PoolApi,
    PoolConfig,
    Preferred,
    Selector,
    VdpaType,
)
from ..model import DEFAULT_PREFIX as DEFAULT_PREFIX
from ..printable import clip, escape, first_unprintable, has_unprintable

DEVICE_TYPES = tuple(DeviceType)
PREFERRED_POLICIES = tuple(Preferred)
LINK_TYPES = ("ether", "infiniband")  # what discovery reports from ARPHRD 1 / 32
VDPA_TYPES = tuple(VdpaType)
MAX_VF_INDEX = 65535  # the SR-IOV capability's NumVFs/TotalVFs are 16-bit registers
MAX_RDMA_SHARED = 65535
IFNAMSIZ = 16  # the kernel's dev_valid_name(): at most IFNAMSIZ - 1 bytes, no '/', ':' or whitespace
# A ConfigMap holds at most 1 MiB of data (the API server's limit), so a mounted config is never larger;
# the limit also keeps a file that never ends (a FIFO, /dev/zero behind a symlink) from being read forever.
MAX_CONFIG_BYTES = 1 << 20
# The deepest the plugin's schema goes is 5 (resourceList, pool, additionalInfo, device, value); anything
# far deeper is not a config, and Python's decoder would die of RecursionError around 1,000 levels.
MAX_NESTING = 64
# Enough problems to fix a file by, few enough that a reload of a broken file never floods the log.
MAX_PROBLEMS = 100
MAX_PROBLEM_CHARS = 500

# Extended resource name rules the kubelet applies at Register (IsExtendedResourceName → IsQualifiedName).
# Every pattern here is used with fullmatch: Go's regexp anchors `$` at the very end of the text, Python's
# `$` also before a final newline, so "vf\n" would pass a match() that the kubelet's check refuses.
_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_SUBDOMAIN_RE = re.compile(rf"{_DNS_LABEL}(\.{_DNS_LABEL})*")
_QUALIFIED_NAME_RE = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
# The SR-IOV plugin's pciAddresses and rootDevices: the kernel's address, domain optional, any case.
_PCI_ADDRESS_RE = re.compile(
    rf"(?:({pci.DOMAIN}):)?({pci.BUS}):({pci.DEVICE})\.({pci.FUNCTION})", re.IGNORECASE
)
_HEX16_RE = re.compile(r"(?:0[xX])?[0-9a-fA-F]{1,4}")
# A JSON string (escapes included, possibly unterminated at the end of the text) or a bracket: brackets
# inside strings do not nest anything.
_NESTING_TOKEN_RE = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?|[\[{\]}]', re.S)

# Keys of internal Go structs that leak into files the SR-IOV network operator marshals from the plugin's
# own types; the plugin ignores them and so do we, as long as they are null.
_GO_INTERNAL_KEYS = ("SelectorObj", "SelectorObjs")

# isRdma is common here (the plugin has it for net devices only): accelerator-type shared RDMA pools use it.
_COMMON_SELECTOR_KEYS = ("vendors", "devices", "drivers", "pciAddresses", "acpiIndexes", "isRdma")
_NET_SELECTOR_KEYS = ("pfNames", "rootDevices", "linkTypes")
_SELECTOR_KEYS_BY_TYPE: dict[DeviceType, tuple[str, ...]] = {
    # The plugin's selector struct depends on deviceType; a key of another type is almost always a
    # forgotten deviceType, so it is reported rather than silently ignored as Go's decoder would.
    DeviceType.NET_DEVICE: (
        *_COMMON_SELECTOR_KEYS,
        *_NET_SELECTOR_KEYS,
        "needVhostNet",
        "vdpaType",
        "pKeys",
        "ddpProfiles",
    ),
    DeviceType.ACCELERATOR: _COMMON_SELECTOR_KEYS,
    DeviceType.AUX_NET_DEVICE: (*_COMMON_SELECTOR_KEYS, *_NET_SELECTOR_KEYS, "auxTypes"),
}
_ALL_SELECTOR_KEYS = tuple(dict.fromkeys(k for keys in _SELECTOR_KEYS_BY_TYPE.values() for k in keys))
_POOL_KEYS = (
    "resourceName",
    "resourcePrefix",
    "deviceType",
    "excludeTopology",
    "additionalInfo",
    "selectors",
    "isRdma",  # legacy: the plugin's early README put it beside resourceName
    "rdmaShared",
    "healthPolicy",
    "preferredAllocation",
    "preStart",
    "api",
    *_GO_INTERNAL_KEYS,
)
_TOP_KEYS = ("resourceList", "coalesceMs", "rdmaPollSeconds", "reconcileSeconds", "draDriverName")
_HEALTH_KEYS = ("pfLink", "ownLink", "rdmaPort", "driver", "holdDownSeconds")


class ConfigError(Exception):
    """An invalid config file; ``problems`` lists every problem found (to ``MAX_PROBLEMS``), a line each."""

    def __init__(self, problems: Sequence[str], source: str = "<string>", *, more: int = 0) -> None:
        # Every problem is one printable line of bounded length, whatever the file held; past
        # MAX_PROBLEMS the last line says how many more there were (``more`` counts those the caller
        # already left out).
        shown = [clip(p, MAX_PROBLEM_CHARS) for p in problems[:MAX_PROBLEMS]]
        more += max(0, len(problems) - MAX_PROBLEMS)
        if more:
            shown.append(f"… and {more} more problems")
        self.problems: tuple[str, ...] = tuple(shown)
        self.source = escape(source)
        lines = "\n".join(f"  {p}" for p in self.problems)
        total = min(len(problems), MAX_PROBLEMS) + more
        super().__init__(f"{self.source}: {total} problem(s) in the config:\n{lines}")


def validate_resource_name(full_name: str) -> str | None:
    """Return why the kubelet would refuse ``full_name`` as an extended resource name; None when valid."""
    shown = clip(full_name)
    if has_unprintable(full_name):
        return f'"{shown}" contains the control character {first_unprintable(full_name)}'
    if "/" not in full_name:
        return f'"{shown}" has no "/": an extended resource name is "<prefix>/<name>"'
    # The kubelet treats anything containing "kubernetes.io/" as a native resource (IsNativeResource).
    if "kubernetes.io/" in full_name:
        return f'"{shown}": the kubernetes.io/ namespace is reserved for native resources'
    if full_name.startswith("requests."):
        return f'"{shown}": names starting "requests." are reserved for quota'
    prefix, _, name = full_name.partition("/")
    if not prefix:
        return f'"{shown}": the prefix before "/" is empty'
    # The kubelet checks "requests.<name>" as a qualified name, so the prefix gets 9 chars less than 253.
    if len(prefix) > 253 - len("requests."):
        return f'"{shown}": prefix longer than {253 - len("requests.")} characters'
    if not _DNS_SUBDOMAIN_RE.fullmatch(prefix):
        return f'"{shown}": prefix "{clip(prefix)}" is not a lowercase DNS subdomain'
    if not name:
        return f'"{shown}": the name after "/" is empty'
    if "/" in name:
        return f'"{shown}": more than one "/"'
    if len(name) > 63:
        return f'"{shown}": name part longer than 63 characters ({len(name)})'
    if not _QUALIFIED_NAME_RE.fullmatch(name):
        return f'"{shown}": name part "{clip(name)}" must be [A-Za-z0-9._-], starting and ending alphanumeric'
    return None


def env_var_name(full_name: str) -> str:
    """Return the ``PCIDEVICE_<PREFIX>_<NAME>`` variable a container gets for a resource's devices.

    The SR-IOV network device plugin's convention (pkg/resources/pool_stub.go GetEnvs): the prefix and
    name joined by "_", upper-cased, every "." made "_" and nothing else changed, so a "-" stays.
    """
    return "PCIDEVICE_" + full_name.upper().replace(".", "_").replace("/", "_")


def parse_index_range(text: str) -> IndexRange:
    """Parse a ``pfNames``/``rootDevices`` value like ``"ens1f0#0,2-7"``; raise ValueError saying why not.

    The indexes stay spans (``0-65535`` is one pair of ints), so a file costs memory in proportion to
    its own size, never to the number of VFs its ranges name.
    """
    name, sep, ranges = text.partition("#")
    if not name:
        raise ValueError(f'bad VF range "{clip(text)}": no name before "#"')
    if not sep:
        return IndexRange(name)
    if not ranges:
        raise ValueError(f'bad VF range "{clip(text)}": no VF index after "#"')
    spans: list[tuple[int, int]] = []
    for item in ranges.split(","):
        start_s, dash, end_s = item.partition("-")
        if not item:
            raise ValueError(f'bad VF range "{clip(text)}": empty item in the list')
        start = _vf_index(text, start_s)
        end = _vf_index(text, end_s) if dash else start
        if start > end:
            raise ValueError(f'bad VF range "{clip(text)}": start > end')
        spans.append((start, end))
    return IndexRange(name, IndexSpans.of(spans))


def _vf_index(text: str, s: str) -> int:
    if not s.isdigit() or not s.isascii():
        raise ValueError(
            f'bad VF range "{clip(text)}": "{clip(s)}" is not a VF index (a non-negative integer)'
        )
    # Checked by length first: int() of a megabyte of digits is slow (and refused past 4,300 digits);
    # leading zeros are no reason to refuse (Go's strconv.Atoi, which the plugin uses, accepts them).
    digits = s.lstrip("0") or "0"
    value = int(digits) if len(digits) <= 6 else MAX_VF_INDEX + 1
    if value > MAX_VF_INDEX:
        raise ValueError(
            f'bad VF range "{clip(text)}": index {clip(s, 12)} above {MAX_VF_INDEX} '
            "(SR-IOV has 16-bit VF counts)"
        )
    return value


def normalize_pci_address(text: str) -> str | None:
    """Return ``text`` as a full lower-case PCI address (``0000:3b:02.1``, domain added), or None."""
    m = _PCI_ADDRESS_RE.fullmatch(text)
    if m is None:
        return None
    domain, bus, dev, fn = m.groups()
    return f"{(domain or '0000').lower()}:{bus.lower()}:{dev.lower()}.{fn}"


class _Obj(dict[str, Any]):
    """A JSON object that remembers keys it saw more than once (json keeps only the last silently)."""

    duplicates: tuple[str, ...] = ()


def _object_pairs(pairs: list[tuple[str, Any]]) -> _Obj:
    obj = _Obj()
    dups: list[str] = []
    for k, v in pairs:
        if k in obj:
            dups.append(k)
        obj[k] = v
    if dups:
        obj.duplicates = tuple(dups)
    return obj


def _refuse_constant(name: str) -> Any:
    # Python's json accepts NaN and Infinity; JSON (and the Go plugin) do not.
    raise ValueError(f"{name} is not valid JSON")


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "list"
    return "object"


class _Reader:
    """Walks the decoded JSON, collecting every problem and warning instead of stopping at the first."""

    def __init__(self, default_prefix: str) -> None:
        self.default_prefix = default_prefix
        self.problems: list[str] = []
        self.more = 0  # problems found beyond MAX_PROBLEMS: counted, not kept (a 1 MiB file may hold 300k)
        self.warnings: list[str] = []
        self.more_warnings = 0  # warnings beyond MAX_PROBLEMS: counted, not kept (as problems are)

    @property
    def count(self) -> int:
        """Return how many problems were found so far."""
        return len(self.problems) + self.more

    def problem(self, where: str, reason: str) -> None:
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(f"{where}: {reason}" if where else reason)
        else:
            self.more += 1

    def warn(self, text: str) -> None:
        """Keep a warning, shortened, up to MAX_PROBLEMS of them; count the rest."""
        if len(self.warnings) < MAX_PROBLEMS:
            self.warnings.append(clip(text, MAX_PROBLEM_CHARS))
        else:
            self.more_warnings += 1

    def all_warnings(self) -> tuple[str, ...]:
        """Return the kept warnings, the last line saying how many more there were."""
        more = (f"… and {self.more_warnings} more warnings",) if self.more_warnings else ()
        return (*self.warnings, *more)

    def printable(self, value: str, where: str) -> bool:
        """Report a string holding a control character (never valid in a name, ID or value); False then."""
        if has_unprintable(value):
            self.problem(where, f'"{clip(value)}" contains the control character {first_unprintable(value)}')
            return False
        return True

    def fields(self, obj: Mapping[str, Any], allowed: Sequence[str], where: str) -> dict[str, Any]:
        """Map ``obj``'s keys to their canonical spelling; report unknown and duplicate keys.

        Go's encoding/json, which the plugin uses, matches keys case-insensitively, so "IsRdma" is
        "isRdma" there; we accept the same spellings to load the same files.
        """
        by_lower = _lower_keys(tuple(allowed))
        out: dict[str, Any] = {}
        for dup in getattr(obj, "duplicates", ()):
            self.problem(_join(where, dup), "key given more than once")
        for key, value in obj.items():
            canonical = key if key in allowed else by_lower.get(key.lower())
            if canonical is None:
                # No key is longer than 32 characters: a hint for a long one would only cost time.
                close = difflib.get_close_matches(key, allowed, n=1) if len(key) <= 64 else []
                hint = f' (did you mean "{close[0]}"?)' if close else ""
                self.problem(where, f'unknown key "{clip(key)}"{hint}')
                continue
            if canonical in out:
                self.problem(_join(where, key), f'same key as "{canonical}" (keys are case-insensitive)')
                continue
            out[canonical] = value
        return out

    def boolean(self, value: Any, where: str, default: bool) -> bool:
        if isinstance(value, bool):
            return value
        self.problem(where, f"expected true or false, got {_type_name(value)}")
        return default

    def number(self, value: Any, where: str, default: float, *, minimum: float, strict: bool) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            self.problem(where, f"expected a number, got {_type_name(value)}")
            return default
        try:
            finite = math.isfinite(value)
        except OverflowError:  # an integer beyond any float
            finite = False
        if not finite or value < minimum or (strict and value == minimum):
            shown = clip(repr(value), 40)
            self.problem(where, f"expected a number {'>' if strict else '>='} {minimum:g}, got {shown}")
            return default
        return float(value)

    def string(self, value: Any, where: str) -> str | None:
        if isinstance(value, str):
            return value if self.printable(value, where) else None
        self.problem(where, f"expected a string, got {_type_name(value)}")
        return None

    def string_items(self, value: Any, where: str) -> Iterator[tuple[str, str]]:
        """Yield ``(where, item)`` for each string of a list; report a non-list and each non-string."""
        if not isinstance(value, list):
            self.problem(where, f"expected a list of strings, got {_type_name(value)}")
            return
        for i, item in enumerate(value):
            at = f"{where}[{i}]"
            if isinstance(item, str):
                yield at, item
            else:
                self.problem(at, f"expected a string, got {_type_name(item)}")

    def strings(
        self,
        value: Any,
        where: str,
        convert: Callable[[str], str | None] | None = None,
        what: str = "",
    ) -> tuple[str, ...]:
        """Read a list of non-empty strings, each passed through ``convert`` (None from it = invalid)."""
        out: list[str] = []
        for at, item in self.string_items(value, where):
            if not item:
                self.problem(at, "empty string")
            elif not self.printable(item, at):
                continue
            elif convert is None:
                out.append(item)
            else:
                converted = convert(item)
                if converted is None:
                    self.problem(at, f'"{clip(item)}" is not {what}')
                else:
                    out.append(converted)
        return tuple(dict.fromkeys(out))


@functools.cache
def _lower_keys(allowed: tuple[str, ...]) -> dict[str, str]:
    """Return each allowed key by its lower-case spelling (one dict per key set, not per object read)."""
    return {k.lower(): k for k in allowed}


def _join(where: str, key: str) -> str:
    if not where:
        return key
    # "resourceList[0] (name)" is followed by ": key"; a key path inside a pool by ".key".
    return f"{where}: {key}" if where.endswith(")") else f"{where}.{key}"


def _lower_hex16(text: str) -> str | None:
    if not _HEX16_RE.fullmatch(text):
        return None
    return text.lower().removeprefix("0x").rjust(4, "0")


def _pkey(text: str) -> str | None:
    if not _HEX16_RE.fullmatch(text):
        return None
    return f"0x{int(text, 16):04x}"


def _acpi_index(text: str) -> str | None:
    # The kernel prints acpi_index as an unsigned decimal (pci-sysfs.c acpi_index_show).
    if not text.isascii() or not text.isdigit():
        return None
    return str(int(text))


def _one_of(choices: Sequence[str]) -> Callable[[str], str | None]:
    return lambda text: text if text in choices else None


def _interface_name_problem(name: str) -> str | None:
    if has_unprintable(name):
        return f'"{clip(name)}" contains the control character {first_unprintable(name)}'
    if len(name.encode()) >= IFNAMSIZ:
        return f'interface name "{clip(name)}" longer than {IFNAMSIZ - 1} bytes (IFNAMSIZ)'
    if name in (".", "..") or any(c in name for c in "/:") or any(c.isspace() for c in name):
        return f'"{clip(name)}" is not a valid interface name'
    return None


def _parse_selector(
    r: _Reader, obj: Any, where: str, device_type: DeviceType, legacy_rdma: bool | None
) -> Selector | None:
    if not isinstance(obj, Mapping):
        r.problem(where, f"expected a selector object, got {_type_name(obj)}")
        return None
    f = r.fields(obj, _ALL_SELECTOR_KEYS, where)
    allowed = _SELECTOR_KEYS_BY_TYPE[device_type]
    for key in f:
        if key not in allowed:
            users = [t for t, keys in _SELECTOR_KEYS_BY_TYPE.items() if key in keys]
            r.problem(
                _join(where, key),
                f'not a selector of deviceType "{device_type}" (only of {", ".join(users)})',
            )
    kw: dict[str, Any] = {}
    if "vendors" in f:
        kw["vendors"] = _compat_ids(r, f["vendors"], _join(where, "vendors"), "vendor")
    if "devices" in f:
        kw["devices"] = _compat_ids(r, f["devices"], _join(where, "devices"), "device")
    if "drivers" in f:
        kw["drivers"] = r.strings(f["drivers"], _join(where, "drivers"))
    if "pciAddresses" in f:
        kw["pci_addresses"] = r.strings(
            f["pciAddresses"],
            _join(where, "pciAddresses"),
            normalize_pci_address,
            "a PCI address (0000:3b:02.1)",
        )
    if "acpiIndexes" in f:
        kw["acpi_indexes"] = r.strings(
            f["acpiIndexes"], _join(where, "acpiIndexes"), _acpi_index, "an ACPI index (a decimal number)"
        )
    for key, attr, is_pci in (("pfNames", "pf_names", False), ("rootDevices", "root_devices", True)):
        if key in f:
            kw[attr] = _parse_ranges(r, f[key], _join(where, key), is_pci)
    if "linkTypes" in f:
        kw["link_types"] = _compat_link_types(r, f["linkTypes"], _join(where, "linkTypes"))
    if "isRdma" in f:
        kw["is_rdma"] = r.boolean(f["isRdma"], _join(where, "isRdma"), False)
    elif legacy_rdma is not None:
        kw["is_rdma"] = legacy_rdma
    if "needVhostNet" in f:
        kw["need_vhost_net"] = r.boolean(f["needVhostNet"], _join(where, "needVhostNet"), False)
    if "vdpaType" in f:
        text = r.string(f["vdpaType"], _join(where, "vdpaType"))
        if text is not None and text not in VDPA_TYPES:
            r.problem(_join(where, "vdpaType"), f'"{clip(text)}" is not one of {", ".join(VDPA_TYPES)}')
        elif text is not None:
            kw["vdpa_type"] = VdpaType(text)
    if "pKeys" in f:
        kw["pkeys"] = r.strings(f["pKeys"], _join(where, "pKeys"), _pkey, "a partition key (0x7fff)")
        if kw["pkeys"]:
            r.warn(
                f"{_join(where, 'pKeys')}: not supported (the device table has no partition keys); "
                "this selector matches no device"
            )
    if "auxTypes" in f:
        kw["aux_types"] = r.strings(f["auxTypes"], _join(where, "auxTypes"))
    _compat_selector_warnings(r, f, kw, where, device_type)
    if "ddpProfiles" in f:
        kw["ddp_profiles"] = r.strings(f["ddpProfiles"], _join(where, "ddpProfiles"))
        if kw["ddp_profiles"]:
            r.warn(
                f"{_join(where, 'ddpProfiles')}: not supported (densedev does not query DDP profiles "
                "with devlink or ddptool); this selector matches no device"
            )
    return Selector(**kw)


# ------------------------------------------------------------------------ SR-IOV plugin compatibility
# A file the SR-IOV network device plugin loads must load here, selecting what it selects; what it would
# refuse at start (or crash on) is accepted when the kubelet accepts it, with a warning, because mixed
# fleets and rollbacks run the same ConfigMap through both.  `check-config --strict` turns the warnings
# into errors.  Each rule below cites what the Go plugin does (pkg/resources, pkg/utils, pkg/types).

_GO_REFUSES = "which the SR-IOV network device plugin refuses (it would not start with this file)"
_GO_NAME_RE = re.compile(r"[a-zA-Z0-9_-]+")  # its resourceName check (pkg/resources/server.go)
_CANONICAL_ID_RE = re.compile(r"[0-9a-f]{4}")  # sysfs vendor/device without "0x", as it compares them


def _compat_ids(r: _Reader, value: Any, where: str, what: str) -> tuple[str, ...]:
    """Read vendor or device IDs as exact strings, as the Go plugin compares them with sysfs's values.

    It matches ``"15b3"`` only: ``"0x15b3"``, ``"15B3"`` or ``"fakeid"`` select nothing there, so nothing
    here either, and each gets a warning naming the value that would match.
    """
    ids = r.strings(value, where)
    for i, text in enumerate(ids):
        if _CANONICAL_ID_RE.fullmatch(text):
            continue
        canonical = _lower_hex16(text)
        hint = f'; write "{canonical}"' if canonical is not None else ""
        r.warn(
            f'{where}[{i}]: "{text}" matches no device: {what} IDs are compared as exact strings with '
            f"sysfs's 4 lowercase hex digits, as the SR-IOV network device plugin does{hint}"
        )
    return ids


def _compat_link_types(r: _Reader, value: Any, where: str) -> tuple[str, ...]:
    """Read link types; an unknown one loads (the Go plugin loads it) and matches nothing, with a warning."""
    types = r.strings(value, where)
    for i, text in enumerate(types):
        if text not in LINK_TYPES:
            r.warn(
                f'{where}[{i}]: "{text}" is not a link type ({" or ".join(LINK_TYPES)}); it matches no device'
            )
    return types


def _compat_name_warnings(r: _Reader, where: str, name: str, full: str) -> None:
    """Warn about names the kubelet accepts but that trouble shells or the Go plugin."""
    if "-" in full:
        # The Go plugin keeps the "-" in the variable (its own tests assert "sriov-net_0" valid): Go
        # programs and CNIs read such variables through the environment fine; only shells cannot.
        r.warn(
            f'{where}: resourceName/resourcePrefix: the container gets {env_var_name(full)} (with "-", as '
            "the SR-IOV network device plugin names it); programs read it, shell scripts cannot"
        )
    if not _GO_NAME_RE.fullmatch(name):
        r.warn(f'{where}: resourceName: "{name}" has characters outside [a-zA-Z0-9_-], {_GO_REFUSES}')


def _compat_selector_warnings(
    r: _Reader, f: Mapping[str, Any], kw: Mapping[str, Any], where: str, device_type: DeviceType
) -> None:
    """Warn about selectors the Go plugin refuses at start, and auxTypes that select nothing."""
    if kw.get("is_rdma") and kw.get("vdpa_type"):
        r.warn(f"{where}: isRdma with vdpaType in one selector, {_GO_REFUSES}")
    if device_type != DeviceType.AUX_NET_DEVICE:
        return
    aux = kw.get("aux_types", ())
    if "auxTypes" not in f or not aux:
        r.warn(f'{where}: auxTypes: missing or empty, {_GO_REFUSES} (it needs ["sf"])')
    for i, text in enumerate(aux):
        if text != "sf":
            r.warn(f'{where}: auxTypes[{i}]: "{text}" matches no device (only "sf" exists), {_GO_REFUSES}')


def _parse_ranges(r: _Reader, value: Any, where: str, is_pci: bool) -> tuple[IndexRange, ...]:
    out: list[IndexRange] = []
    for at, text in r.string_items(value, where):
        try:
            rng = parse_index_range(text)
        except ValueError as exc:
            r.problem(at, str(exc))
            continue
        if is_pci:
            address = normalize_pci_address(rng.name)
            if address is None:
                r.problem(at, f'"{clip(rng.name)}" is not a PCI address (0000:3b:00.0)')
                continue
            rng = IndexRange(address, rng.indexes)
        else:
            why = _interface_name_problem(rng.name)
            if why is not None:
                r.problem(at, why)
                continue
        out.append(rng)
    return tuple(out)


def _parse_health(r: _Reader, value: Any, where: str) -> HealthPolicy:
    if not isinstance(value, Mapping):
        r.problem(where, f"expected an object, got {_type_name(value)}")
        return HealthPolicy()
    f = r.fields(value, _HEALTH_KEYS, where)
    d = HealthPolicy()
    return HealthPolicy(
        pf_link=r.boolean(f["pfLink"], _join(where, "pfLink"), d.pf_link) if "pfLink" in f else d.pf_link,
        own_link=r.boolean(f["ownLink"], _join(where, "ownLink"), d.own_link)
        if "ownLink" in f
        else d.own_link,
        rdma_port=r.boolean(f["rdmaPort"], _join(where, "rdmaPort"), d.rdma_port)
        if "rdmaPort" in f
        else d.rdma_port,
        driver=r.boolean(f["driver"], _join(where, "driver"), d.driver) if "driver" in f else d.driver,
        hold_down_s=r.number(
            f["holdDownSeconds"], _join(where, "holdDownSeconds"), d.hold_down_s, minimum=0, strict=False
        )
        if "holdDownSeconds" in f
        else d.hold_down_s,
    )


def _parse_additional_info(
    r: _Reader, value: Any, where: str
) -> tuple[tuple[str, tuple[tuple[str, str], ...]], ...]:
    if not isinstance(value, Mapping):
        r.problem(where, f"expected an object of objects, got {_type_name(value)}")
        return ()
    for dup in getattr(value, "duplicates", ()):
        r.problem(_join(where, dup), "key given more than once")
    out: list[tuple[str, tuple[tuple[str, str], ...]]] = []
    for device, info in value.items():
        at = f'{where}["{clip(device)}"]'
        if not device:
            r.problem(where, 'empty key (use a device ID or "*")')
            continue
        if not r.printable(device, where):
            continue
        if not isinstance(info, Mapping):
            r.problem(at, f"expected an object of strings, got {_type_name(info)}")
            continue
        pairs: list[tuple[str, str]] = []
        for k, v in info.items():
            # Keys and values become JSON in the container's _INFO variable and device-info files.
            if not r.printable(k, at):
                continue
            if not isinstance(v, str):
                r.problem(f'{at}["{clip(k)}"]', f"expected a string, got {_type_name(v)}")
            elif r.printable(v, f'{at}["{clip(k)}"]'):
                pairs.append((k, v))
        out.append((device, tuple(pairs)))
    return tuple(out)


# resource.k8s.io string attributes hold at most 64 characters; a DRA pool's resource name is one.
DRA_MAX_STRING = 64
DRA_MAX_DRIVER_NAME = 63  # ResourceSlice spec.driver: a DNS subdomain of at most 63 characters


def _parse_api(r: _Reader, f: Mapping[str, Any], where: str, pool: PoolConfig) -> PoolApi:
    """Read a pool's ``api`` (devicePlugin | dra) and report what DRA cannot serve."""
    if "api" not in f:
        return PoolApi.DEVICE_PLUGIN
    text = r.string(f["api"], f"{where}: api")
    if text is None:
        return PoolApi.DEVICE_PLUGIN
    try:
        api = PoolApi(text)
    except ValueError:
        r.problem(f"{where}: api", f'"{clip(text)}" is not one of {", ".join(a.value for a in PoolApi)}')
        return PoolApi.DEVICE_PLUGIN
    if api is PoolApi.DRA:
        # DRA device names are DNS labels made from PCI addresses (dra/names.py); a subfunction has none.
        if pool.device_type == DeviceType.AUX_NET_DEVICE:
            r.problem(
                f"{where}: api", '"dra" cannot serve auxNetDevice pools (subfunctions have no PCI address)'
            )
        # A DRA device goes to one claim at a time: shared RDMA IDs have no DRA equivalent here.
        if pool.rdma_shared:
            r.problem(f"{where}: api", '"dra" cannot serve rdmaShared pools (a DRA device has one claim)')
        if pool.resource_name and len(pool.full_name) > DRA_MAX_STRING:
            r.problem(
                f"{where}: api",
                f'"dra" needs a resource name of at most {DRA_MAX_STRING} characters '
                f"(a ResourceSlice string attribute), {pool.full_name!r} has {len(pool.full_name)}",
            )
    return api


def _parse_driver_name(r: _Reader, value: Any) -> str:
    text = r.string(value, "draDriverName")
    if text is None:
        return DEFAULT_DRIVER_NAME
    if len(text) > DRA_MAX_DRIVER_NAME or not _DNS_SUBDOMAIN_RE.fullmatch(text):
        r.problem(
            "draDriverName",
            f'"{clip(text)}" is not a lowercase DNS subdomain of at most {DRA_MAX_DRIVER_NAME} characters',
        )
        return DEFAULT_DRIVER_NAME
    return text


def _parse_pool(r: _Reader, obj: Any, index: int) -> PoolConfig | None:
    base = f"resourceList[{index}]"
    if not isinstance(obj, Mapping):
        r.problem(base, f"expected a resource object, got {_type_name(obj)}")
        return None
    raw_name = next((v for k, v in obj.items() if k.lower() == "resourcename"), None)
    label = clip(raw_name, 64) if isinstance(raw_name, str) and raw_name else "no resourceName"
    where = f"{base} ({label})"
    before = r.count
    f = r.fields(obj, _POOL_KEYS, where)

    name = ""
    if "resourceName" not in f:
        r.problem(where, "resourceName: required")
    else:
        name = r.string(f["resourceName"], f"{where}: resourceName") or ""
        if f["resourceName"] == "":
            r.problem(where, "resourceName: empty")
    prefix = r.default_prefix
    if "resourcePrefix" in f:
        prefix = r.string(f["resourcePrefix"], f"{where}: resourcePrefix") or prefix
    if name:
        full = f"{prefix}/{name}"
        why = validate_resource_name(full)
        if why is not None:
            r.problem(where, f"resourceName/resourcePrefix: the kubelet would refuse {why}")
        else:
            _compat_name_warnings(r, where, name, full)

    device_type = DeviceType.NET_DEVICE
    if "deviceType" in f:
        text = r.string(f["deviceType"], f"{where}: deviceType")
        if text is not None and text not in DEVICE_TYPES:
            r.problem(f"{where}: deviceType", f'"{clip(text)}" is not one of {", ".join(DEVICE_TYPES)}')
        elif text is not None:
            device_type = DeviceType(text)

    legacy_rdma: bool | None = None
    if "isRdma" in f:
        legacy_rdma = r.boolean(f["isRdma"], f"{where}: isRdma", False)

    selectors: tuple[Selector, ...] = (Selector(is_rdma=legacy_rdma),)
    if "selectors" in f:
        raw = f["selectors"]
        if isinstance(raw, Mapping):
            sel = _parse_selector(r, raw, f"{where}: selectors", device_type, legacy_rdma)
            selectors = (sel,) if sel is not None else ()
        elif isinstance(raw, list):
            if not raw:
                r.problem(f"{where}: selectors", "empty list: the pool would select no device")
            parsed = [
                _parse_selector(r, s, f"{where}: selectors[{i}]", device_type, legacy_rdma)
                for i, s in enumerate(raw)
            ]
            selectors = tuple(s for s in parsed if s is not None)
        else:
            r.problem(
                f"{where}: selectors", f"expected an object or a list of objects, got {_type_name(raw)}"
            )

    if "selectors" not in f:
        r.warn(
            f"{where}: selectors: missing: densedev takes every device of the pool's deviceType, "
            f"{_GO_REFUSES}"
        )
    for key in _GO_INTERNAL_KEYS:
        if key in f and f[key] is not None:
            r.problem(f"{where}: {key}", "internal field of the Go plugin: only null is accepted")

    exclude_topology = False
    if "excludeTopology" in f:
        exclude_topology = r.boolean(f["excludeTopology"], f"{where}: excludeTopology", False)
    additional_info: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = ()
    if "additionalInfo" in f:
        additional_info = _parse_additional_info(r, f["additionalInfo"], f"{where}: additionalInfo")
    rdma_shared = 0
    if "rdmaShared" in f:
        v = f["rdmaShared"]
        if isinstance(v, bool) or not isinstance(v, int):
            r.problem(
                f"{where}: rdmaShared", f"expected a whole number of IDs per RDMA device, got {_type_name(v)}"
            )
        elif not 0 <= v <= MAX_RDMA_SHARED:
            r.problem(f"{where}: rdmaShared", f"expected 0 to {MAX_RDMA_SHARED}, got {clip(str(v), 40)}")
        else:
            rdma_shared = v
    health = HealthPolicy()
    if "healthPolicy" in f:
        health = _parse_health(r, f["healthPolicy"], f"{where}: healthPolicy")
    preferred = Preferred.PACK
    if "preferredAllocation" in f:
        text = r.string(f["preferredAllocation"], f"{where}: preferredAllocation")
        if text is not None and text not in PREFERRED_POLICIES:
            r.problem(
                f"{where}: preferredAllocation",
                f'"{clip(text)}" is not one of {", ".join(PREFERRED_POLICIES)}',
            )
        elif text is not None:
            preferred = Preferred(text)
    prestart = False
    if "preStart" in f:
        prestart = r.boolean(f["preStart"], f"{where}: preStart", False)

    pool = PoolConfig(
        resource_name=name,
        resource_prefix=prefix,
        device_type=device_type,
        selectors=selectors,
        exclude_topology=exclude_topology,
        additional_info=additional_info,
        rdma_shared=rdma_shared,
        health=health,
        preferred=preferred,
        prestart=prestart,
    )
    api = _parse_api(r, f, where, pool)
    if r.count > before:
        return None
    return pool._replace(api=api) if api is not PoolApi.DEVICE_PLUGIN else pool


def _too_deep(text: str) -> int:
    """Return the offset of the first bracket nested deeper than ``MAX_NESTING``, or -1."""
    if text.count("[") + text.count("{") <= MAX_NESTING:
        return -1  # the common case: too few brackets to nest that deep, no scan needed
    depth = 0
    for m in _NESTING_TOKEN_RE.finditer(text):
        c = text[m.start()]
        if c in "[{":
            depth += 1
            if depth > MAX_NESTING:
                return m.start()
        elif c in "]}":
            depth -= 1
    return -1


def _position(text: str, offset: int) -> str:
    line = text.count("\n", 0, offset) + 1
    column = offset - text.rfind("\n", 0, offset)  # rfind is -1 on the first line: columns count from 1
    return f"line {line} column {column}"


def _decode(text: str) -> Any:
    """Decode JSON; raise ConfigError-ready text with line and column on a syntax error."""
    return json.loads(text, object_pairs_hook=_object_pairs, parse_constant=_refuse_constant)


def parse(text: str, *, default_prefix: str = DEFAULT_PREFIX, source: str = "<string>") -> Config:
    """Parse and validate a config document; raise ConfigError listing every problem."""
    # Checked before decoding: json's C scanner recurses per level and raises RecursionError (with a
    # 35-line traceback) near the interpreter's recursion limit.
    deep = _too_deep(text)
    if deep >= 0:
        raise ConfigError(
            [f"invalid JSON at {_position(text, deep)}: nested deeper than {MAX_NESTING} levels"], source
        )
    try:
        doc = _decode(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            [f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"], source
        ) from None
    except RecursionError:
        # Unreachable after the check above unless the caller's own stack is nearly exhausted.
        raise ConfigError(["invalid JSON: nested deeper than this process can decode"], source) from None
    except ValueError as exc:
        raise ConfigError([f"invalid JSON: {exc}"], source) from None
    r = _Reader(default_prefix)
    if not isinstance(doc, Mapping):
        raise ConfigError([f"expected a JSON object with resourceList, got {_type_name(doc)}"], source)
    f = r.fields(doc, _TOP_KEYS, "")
    pools: list[tuple[int, PoolConfig]] = []
    if "resourceList" not in f:
        r.problem("resourceList", "required (a list of resource pools)")
    elif not isinstance(f["resourceList"], list):
        r.problem("resourceList", f"expected a list of resource objects, got {_type_name(f['resourceList'])}")
    else:
        for i, obj in enumerate(f["resourceList"]):
            pool = _parse_pool(r, obj, i)
            if pool is not None:
                pools.append((i, pool))
    d = Config(pools=())
    coalesce = d.coalesce_ms
    if "coalesceMs" in f:
        coalesce = r.number(f["coalesceMs"], "coalesceMs", d.coalesce_ms, minimum=0, strict=False)
    rdma_poll = d.rdma_poll_s
    if "rdmaPollSeconds" in f:
        rdma_poll = r.number(f["rdmaPollSeconds"], "rdmaPollSeconds", d.rdma_poll_s, minimum=0, strict=True)
    reconcile = d.reconcile_s
    if "reconcileSeconds" in f:
        reconcile = r.number(f["reconcileSeconds"], "reconcileSeconds", d.reconcile_s, minimum=0, strict=True)
    driver_name = _parse_driver_name(r, f["draDriverName"]) if "draDriverName" in f else DEFAULT_DRIVER_NAME
    _check_unique(r, pools)
    if r.count:
        raise ConfigError(r.problems, source, more=r.more)
    return Config(
        pools=tuple(pool for _, pool in pools),
        coalesce_ms=coalesce,
        rdma_poll_s=rdma_poll,
        reconcile_s=reconcile,
        dra_driver_name=driver_name,
        warnings=r.all_warnings(),
    )


def _check_unique(r: _Reader, pools: Sequence[tuple[int, PoolConfig]]) -> None:
    """Report two pools with one full name, or with names that collide in the PCIDEVICE_ variable."""
    seen: dict[str, int] = {}
    seen_env: dict[str, int] = {}
    seen_class: dict[str, int] = {}
    for i, pool in pools:
        where = f"resourceList[{i}] ({pool.resource_name})"
        full = pool.full_name
        if full in seen:
            r.problem(where, f'resource "{full}" already defined by resourceList[{seen[full]}]')
            continue
        seen[full] = i
        env = env_var_name(full)
        if env in seen_env:
            r.problem(
                where, f'resource "{full}" has the same variable name {env} as resourceList[{seen_env[env]}]'
            )
            continue
        seen_env[env] = i
        if pool.api is PoolApi.DRA:
            # Each DRA pool gets a DeviceClass named after its resource; two names may fold into one.
            cls = device_class_name(full)
            if cls in seen_class:
                r.problem(where, f'DeviceClass "{cls}" is also the class of resourceList[{seen_class[cls]}]')
                continue
            seen_class[cls] = i


_FILE_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def _not_regular(mode: int) -> str | None:
    if stat.S_ISREG(mode):
        return None
    kind = next((name for test, name in _FILE_KINDS if test(mode)), "not a file")
    return f"not a regular file ({kind})"


def read_config_bytes(path: str | Path) -> bytes:
    """Return the bytes of a config file; raise ConfigError unless it is a regular file of at most 1 MiB.

    Symlinks are followed (a ConfigMap volume is ``config.json -> ..data/config.json``), but what they
    lead to must be a regular file: opening a FIFO would block until some writer came, and a character
    device may never end.
    """
    p = Path(path)
    try:
        why = _not_regular(os.stat(p).st_mode)
        if why is not None:
            raise ConfigError([why], str(p))
        # O_NONBLOCK: should the file be swapped for a FIFO after the stat, open() still returns at once
        # (fifo(7)) and the fstat below refuses it.
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as exc:
        raise ConfigError([f"cannot read the file: {exc.strerror or exc}"], str(p)) from None
    try:
        st = os.fstat(fd)
        why = _not_regular(st.st_mode)
        if why is not None:
            raise ConfigError([why], str(p))
        chunks: list[bytes] = []
        size = 0
        # Read to the end rather than st_size bytes (procfs and some FUSE files report 0), but never
        # more than the limit allows.
        while size <= MAX_CONFIG_BYTES:
            try:
                # os.read allocates what it is asked for: ask for what the file says it holds (plus one,
                # to see its end), not for the whole limit every time.
                chunk = os.read(fd, min(MAX_CONFIG_BYTES + 1 - size, max(st.st_size - size + 1, 1 << 16)))
            except InterruptedError:
                continue
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        reason = "it is a directory" if exc.errno == errno.EISDIR else exc.strerror or str(exc)
        raise ConfigError([f"cannot read the file: {reason}"], str(p)) from None
    finally:
        os.close(fd)
    if size > MAX_CONFIG_BYTES:
        raise ConfigError(
            [f"larger than {MAX_CONFIG_BYTES >> 20} MiB (the most a ConfigMap can hold): not a config"],
            str(p),
        )
    return b"".join(chunks)


def load(path: str | Path, *, default_prefix: str = DEFAULT_PREFIX) -> Config:
    """Read and validate a config file; raise ConfigError listing every problem."""
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
