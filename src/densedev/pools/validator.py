"""What both config formats share: the limits, the reader that collects problems, names the kubelet accepts.

``config.py`` picks the format; ``sriov_format.py`` (the SR-IOV network device plugin's ``resourceList``)
and ``rdma_format.py`` (the RDMA shared device plugin's ``configList``) each read theirs into the one model
(``model.Config``) with the checks here, so a problem reads the same whichever file it came from: one
printable line naming the pool, the key and the reason, every problem of a file at once.
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

from ..dra.classes import device_class_name
from ..model import Config, PoolApi, PoolConfig
from ..printable import clip, escape, first_unprintable, has_unprintable

LINK_TYPES = ("ether", "infiniband")  # what discovery reports from ARPHRD 1 / 32
# densedev's own top-level keys, the same in either format (neither plugin has them).
TIMING_KEYS = ("coalesceMs", "rdmaPollSeconds", "reconcileSeconds")
IFNAMSIZ = 16  # the kernel's dev_valid_name(): at most IFNAMSIZ - 1 bytes, no '/', ':' or whitespace
# A ConfigMap holds at most 1 MiB of data (the API server's limit), so a mounted config is never larger;
# the limit also keeps a file that never ends (a FIFO, /dev/zero behind a symlink) from being read forever.
MAX_CONFIG_BYTES = 1 << 20
# The deepest either plugin's schema goes is 5 (resourceList, pool, additionalInfo, device, value); anything
# far deeper is not a config, and Python's decoder would die of RecursionError around 1,000 levels.
MAX_NESTING = 64
# Enough problems to fix a file by, few enough that a reload of a broken file never floods the log.
MAX_PROBLEMS = 100
MAX_PROBLEM_CHARS = 500

# Extended resource name rules the kubelet applies at Register (IsExtendedResourceName → IsQualifiedName).
# Every pattern here is used with fullmatch: Go's regexp anchors `$` at the very end of the text, Python's
# `$` also before a final newline, so "vf\n" would pass a match() that the kubelet's check refuses.
_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
DNS_SUBDOMAIN_RE = re.compile(rf"{_DNS_LABEL}(\.{_DNS_LABEL})*")
_QUALIFIED_NAME_RE = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
HEX16_RE = re.compile(r"(?:0[xX])?[0-9a-fA-F]{1,4}")
# A JSON string (escapes included, possibly unterminated at the end of the text) or a bracket: brackets
# inside strings do not nest anything.
_NESTING_TOKEN_RE = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?|[\[{\]}]', re.S)


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
    if not DNS_SUBDOMAIN_RE.fullmatch(prefix):
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


def type_name(value: Any) -> str:
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


class Reader:
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

    def entry(self, obj: Any, base: str, allowed: Sequence[str]) -> tuple[str, dict[str, Any]] | None:
        """Open one resource entry of a list: where its problems are said (``base (its name)``) and its
        fields (``fields``); None, with one problem, when it is not an object."""
        if not isinstance(obj, Mapping):
            self.problem(base, f"expected a resource object, got {type_name(obj)}")
            return None
        # The name labels every problem of the entry, even a misspelt or ill-typed one's.
        raw_name = next((v for k, v in obj.items() if k.lower() == "resourcename"), None)
        label = clip(raw_name, 64) if isinstance(raw_name, str) and raw_name else "no resourceName"
        where = f"{base} ({label})"
        return where, self.fields(obj, allowed, where)

    def fields(self, obj: Mapping[str, Any], allowed: Sequence[str], where: str) -> dict[str, Any]:
        """Map ``obj``'s keys to their canonical spelling; report unknown and duplicate keys.

        Go's encoding/json, which the plugin uses, matches keys case-insensitively, so "IsRdma" is
        "isRdma" there; we accept the same spellings to load the same files.
        """
        by_lower = lower_keys(tuple(allowed))
        out: dict[str, Any] = {}
        for dup in getattr(obj, "duplicates", ()):
            self.problem(join(where, dup), "key given more than once")
        for key, value in obj.items():
            canonical = key if key in allowed else by_lower.get(key.lower())
            if canonical is None:
                # No key is longer than 32 characters: a hint for a long one would only cost time.
                close = difflib.get_close_matches(key, allowed, n=1) if len(key) <= 64 else []
                hint = f' (did you mean "{close[0]}"?)' if close else ""
                self.problem(where, f'unknown key "{clip(key)}"{hint}')
                continue
            if canonical in out:
                self.problem(join(where, key), f'same key as "{canonical}" (keys are case-insensitive)')
                continue
            out[canonical] = value
        return out

    def boolean(self, value: Any, where: str, default: bool) -> bool:
        if isinstance(value, bool):
            return value
        self.problem(where, f"expected true or false, got {type_name(value)}")
        return default

    def number(self, value: Any, where: str, default: float, *, minimum: float, strict: bool) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            self.problem(where, f"expected a number, got {type_name(value)}")
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
        self.problem(where, f"expected a string, got {type_name(value)}")
        return None

    def string_items(self, value: Any, where: str) -> Iterator[tuple[str, str]]:
        """Yield ``(where, item)`` for each string of a list; report a non-list and each non-string."""
        if not isinstance(value, list):
            self.problem(where, f"expected a list of strings, got {type_name(value)}")
            return
        for i, item in enumerate(value):
            at = f"{where}[{i}]"
            if isinstance(item, str):
                yield at, item
            else:
                self.problem(at, f"expected a string, got {type_name(item)}")

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
def lower_keys(allowed: tuple[str, ...]) -> dict[str, str]:
    """Return each allowed key by its lower-case spelling (one dict per key set, not per object read)."""
    return {k.lower(): k for k in allowed}


def join(where: str, key: str) -> str:
    if not where:
        return key
    # "resourceList[0] (name)" is followed by ": key"; a key path inside a pool by ".key".
    return f"{where}: {key}" if where.endswith(")") else f"{where}.{key}"


def lower_hex16(text: str) -> str | None:
    if not HEX16_RE.fullmatch(text):
        return None
    return text.lower().removeprefix("0x").rjust(4, "0")


def interface_name_problem(name: str) -> str | None:
    if has_unprintable(name):
        return f'"{clip(name)}" contains the control character {first_unprintable(name)}'
    if len(name.encode()) >= IFNAMSIZ:
        return f'interface name "{clip(name)}" longer than {IFNAMSIZ - 1} bytes (IFNAMSIZ)'
    if name in (".", "..") or any(c in name for c in "/:") or any(c.isspace() for c in name):
        return f'"{clip(name)}" is not a valid interface name'
    return None


_CANONICAL_ID_RE = re.compile(r"[0-9a-f]{4}")  # sysfs vendor/device without "0x", as it compares them


def compat_ids(r: Reader, value: Any, where: str, what: str, plugin: str) -> tuple[str, ...]:
    """Read vendor or device IDs as exact strings, as both Go plugins compare them with sysfs's values.

    It matches ``"15b3"`` only: ``"0x15b3"``, ``"15B3"`` or ``"fakeid"`` select nothing there, so nothing
    here either, and each gets a warning naming the value that would match.
    """
    ids = r.strings(value, where)
    for i, text in enumerate(ids):
        if _CANONICAL_ID_RE.fullmatch(text):
            continue
        canonical = lower_hex16(text)
        hint = f'; write "{canonical}"' if canonical is not None else ""
        r.warn(
            f'{where}[{i}]: "{text}" matches no device: {what} IDs are compared as exact strings with '
            f"sysfs's 4 lowercase hex digits, as {plugin} does{hint}"
        )
    return ids


def compat_link_types(r: Reader, value: Any, where: str) -> tuple[str, ...]:
    """Read link types; an unknown one loads (the Go plugin loads it) and matches nothing, with a warning."""
    types = r.strings(value, where)
    for i, text in enumerate(types):
        if text not in LINK_TYPES:
            r.warn(
                f'{where}[{i}]: "{text}" is not a link type ({" or ".join(LINK_TYPES)}); it matches no device'
            )
    return types


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


def decode_json(text: str) -> Any:
    """Decode JSON keeping duplicate keys in view; raise json's own errors."""
    return json.loads(text, object_pairs_hook=_object_pairs, parse_constant=_refuse_constant)


def decode_document(text: str, source: str) -> Any:
    """Decode a config document; raise ConfigError (line and column) for anything that is not JSON."""
    # Checked before decoding: json's C scanner recurses per level and raises RecursionError (with a
    # 35-line traceback) near the interpreter's recursion limit.
    deep = _too_deep(text)
    if deep >= 0:
        raise ConfigError(
            [f"invalid JSON at {_position(text, deep)}: nested deeper than {MAX_NESTING} levels"], source
        )
    try:
        return decode_json(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            [f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"], source
        ) from None
    except RecursionError:
        # Unreachable after the check above unless the caller's own stack is nearly exhausted.
        raise ConfigError(["invalid JSON: nested deeper than this process can decode"], source) from None
    except ValueError as exc:
        raise ConfigError([f"invalid JSON: {exc}"], source) from None


def read_timing(r: Reader, f: Mapping[str, Any]) -> tuple[float, float, float]:
    """Read densedev's ``TIMING_KEYS`` from top-level fields: (coalesce ms, RDMA poll s, reconcile s)."""
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
    return coalesce, rdma_poll, reconcile


def check_unique(r: Reader, pools: Sequence[tuple[int, PoolConfig]], section: str) -> None:
    """Report two pools with one full name, or with names that collide in the PCIDEVICE_ variable.

    ``section`` is the list the pools came from (``resourceList``, ``configList``), to name them by.
    """
    seen: dict[str, int] = {}
    seen_env: dict[str, int] = {}
    seen_class: dict[str, int] = {}
    for i, pool in pools:
        where = f"{section}[{i}] ({pool.resource_name})"
        full = pool.full_name
        if full in seen:
            r.problem(where, f'resource "{full}" already defined by {section}[{seen[full]}]')
            continue
        seen[full] = i
        env = env_var_name(full)
        if env in seen_env:
            r.problem(
                where, f'resource "{full}" has the same variable name {env} as {section}[{seen_env[env]}]'
            )
            continue
        seen_env[env] = i
        if pool.api is PoolApi.DRA:
            # Each DRA pool gets a DeviceClass named after its resource; two names may fold into one.
            cls = device_class_name(full)
            if cls in seen_class:
                r.problem(where, f'DeviceClass "{cls}" is also the class of {section}[{seen_class[cls]}]')
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
