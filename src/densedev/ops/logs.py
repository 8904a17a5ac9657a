"""Structured logs: one line per event an operator cares about, as ``key=value`` (default) or JSON.

How the rest of densedev logs (the one convention to follow):

* Get a logger per module: ``log = logging.getLogger(__name__)`` (names start with ``densedev.``).
* Log an event with fields through :func:`log_event`::

      log_event(log, "device unhealthy", level=logging.WARNING, pool=pool, device=dev_id, reason=why)

  which is shorthand for ``log.warning("device unhealthy", extra={"fields": {...}})``; either form works.
  The message is a fixed phrase (greppable, countable); everything variable goes into fields.
* Never log one line per device in a burst: log one line with ``devices=summarise(ids)`` and the count.

``setup_logging`` installs one handler on the root logger (so grpc's and asyncio's records come out in
the same format) and replaces only the handler it installed before, so calling it again — on a config
reload or in tests — never duplicates lines.  Output, ``kv``::

    ts=2026-11-30T04:39:21.123Z level=warning logger=densedev.health.tracker msg="device unhealthy" pool=a/b
    device=0000:3b:00.2 reason=pf_link_down

(shown wrapped; it is one line) and ``json``, one object per line with the same keys.  Values with
spaces, quotes, ``=`` or control characters are double-quoted in ``kv`` with ``\\"``, ``\\\\``, ``\\n``,
``\\r``, ``\\t`` escapes, so every record (even a traceback) stays on one line and a log shipper can
split on newlines.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from collections.abc import Collection, Mapping
from typing import IO

LEVELS: Mapping[str, int] = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "warn": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}
FORMATS = ("kv", "json")

# The keys every record starts with; a field of the same name is renamed with a trailing "_" rather
# than silently replacing the record's own value.
_RESERVED = frozenset({"ts", "level", "logger", "msg", "exc"})
_BARE = re.compile(r"[A-Za-z0-9_.:/@+,\-]+")  # values printed without quotes in kv
_KEY_BAD = re.compile(r"[^A-Za-z0-9_.\-]")
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}
_ESCAPE_RE = re.compile(r'["\\\n\r\t]|[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]')


def _escape_char(match: re.Match[str]) -> str:
    ch = match.group()
    return _ESCAPES.get(ch) or f"\\x{ord(ch):02x}"


def _kv_value(value: object) -> str:
    """Render one value for kv output: bare when safe, else double-quoted with escapes."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple | set | frozenset):
        text = ",".join(str(v) for v in value)
    else:
        text = str(value)
    if _BARE.fullmatch(text):
        return text
    return '"' + _ESCAPE_RE.sub(_escape_char, text) + '"'


def _json_value(value: object) -> object:
    """Map a field value onto what JSON can carry (other objects become their ``str``)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple | set | frozenset):
        return [_json_value(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _json_value(v) for k, v in value.items()}
    return str(value)


def _timestamp(created: float) -> str:
    """Format a record's time as RFC 3339 UTC with milliseconds (what log shippers parse natively)."""
    seconds = int(created)
    millis = int((created - seconds) * 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{millis:03d}Z"


def _record_items(record: logging.LogRecord) -> list[tuple[str, object]]:
    """Return a record's keys in output order: ts, level, logger, msg, then fields, then exc."""
    items: list[tuple[str, object]] = [
        ("ts", _timestamp(record.created)),
        ("level", record.levelname.lower()),
        ("logger", record.name),
        ("msg", record.getMessage()),
    ]
    fields = getattr(record, "fields", None)
    if isinstance(fields, Mapping):
        for key, value in fields.items():
            name = _KEY_BAD.sub("_", str(key)) or "_"
            if name in _RESERVED:
                name += "_"
            items.append((name, value))
    if record.exc_info and record.exc_info[0] is not None:
        items.append(("exc", logging.Formatter().formatException(record.exc_info)))
    elif record.exc_text:
        items.append(("exc", record.exc_text))
    if record.stack_info:
        items.append(("stack", record.stack_info))
    return items


class KeyValueFormatter(logging.Formatter):
    """Format a record as one ``key=value`` line (logfmt style)."""

    def format(self, record: logging.LogRecord) -> str:
        """Return the record as one line of space-separated ``key=value`` pairs."""
        return " ".join(f"{key}={_kv_value(value)}" for key, value in _record_items(record))


class JsonFormatter(logging.Formatter):
    """Format a record as one JSON object per line."""

    def format(self, record: logging.LogRecord) -> str:
        """Return the record as a single-line JSON object."""
        obj = {key: _json_value(value) for key, value in _record_items(record)}
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


class _DensedevHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The handler ``setup_logging`` installs; its type marks it for replacement on the next call."""


class _StderrHandler(_DensedevHandler):
    """Writes to whatever ``sys.stderr`` is at each record (as logging's last-resort handler does).

    Looking it up per record keeps logging working when stderr is replaced after setup (test runners
    capturing output, a daemon redirecting it), instead of writing to a closed stream.
    """

    def __init__(self) -> None:
        logging.Handler.__init__(self)

    @property  # type: ignore[override]
    def stream(self) -> IO[str]:
        """Return the current ``sys.stderr``."""
        return sys.stderr


# A glog verbosity (the SR-IOV network device plugin's --log-level=N) from which densedev logs at debug:
# Kubernetes' logging conventions make V(4) "debug level verbosity"; below it, glog's always-on info.
GLOG_DEBUG_FROM = 4


def parse_level(level: str | int) -> int:
    """Return the logging level for a name such as ``"info"`` or a glog verbosity such as ``"10"`` (an int
    is passed through)."""
    if isinstance(level, int):
        return level
    text = level.strip()
    if text.isdecimal():
        return logging.DEBUG if int(text) >= GLOG_DEBUG_FROM else logging.INFO
    try:
        return LEVELS[level.strip().lower()]
    except KeyError:
        raise ValueError(f"log level {level!r} is not one of {', '.join(LEVELS)}") from None


def setup_logging(level: str = "info", fmt: str = "kv", stream: IO[str] | None = None) -> None:
    """Send every log record to ``stream`` (default stderr) at ``level`` in the ``kv`` or ``json`` format."""
    numeric = parse_level(level)
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r} is not one of {', '.join(FORMATS)}")
    handler = _StderrHandler() if stream is None else _DensedevHandler(stream)
    handler.setFormatter(KeyValueFormatter() if fmt == "kv" else JsonFormatter())
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _DensedevHandler)]:
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    # Debug is densedev's own: the libraries' debug lines (gRPC's "Loaded running loop" for every
    # stream, asyncio's, aiohttp's) say nothing about the node, and the SR-IOV operators run the
    # plugin at glog verbosity 10, which is debug here.
    root.setLevel(max(numeric, logging.INFO))
    logging.getLogger("densedev").setLevel(numeric if numeric < logging.INFO else logging.NOTSET)


def log_event(logger: logging.Logger, msg: str, /, level: int = logging.INFO, **fields: object) -> None:
    """Log ``msg`` with structured ``fields`` at ``level`` (does nothing cheaply when the level is off)."""
    if logger.isEnabledFor(level):
        # stacklevel=2 makes the record point at the caller, not at this helper.
        logger.log(level, msg, extra={"fields": fields}, stacklevel=2)


def summarise(ids: Collection[str], limit: int = 5, noun: str = "device") -> str:
    """Describe many IDs in one short string: ``"256 devices: a, b, c, d, e, ... (+251)"``."""
    if limit < 0:
        raise ValueError(f"summarise limit must be >= 0, got {limit}")
    count = len(ids)
    label = f"{count} {noun}" + ("" if count == 1 else "s")
    if count == 0 or limit == 0:
        return label
    shown: list[str] = []
    for item in ids:
        if len(shown) == limit:
            break
        shown.append(str(item))
    text = f"{label}: {', '.join(shown)}"
    if count > len(shown):
        text += f", ... (+{count - len(shown)})"
    return text
