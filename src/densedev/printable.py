"""Text from outside (config files, kubelet requests) made safe to print: escaped, clipped, counted.

Anything densedev echoes back — a config problem, a gRPC status message, a log line — may carry what a
user or a peer sent.  Echoed raw, a newline splits one problem into two lines, an escape sequence
repaints the operator's terminal, a lone surrogate makes ``print`` raise, and 100,000 IDs make a 2 MB
status message that gRPC refuses to carry (a status travels in HTTP/2 trailers, which gRPC caps at
8 KiB by default, ``grpc.max_metadata_size``).  These helpers bound all of that.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

# C0 controls, DEL, C1 controls (U+0085 is a line break to str.splitlines), the Unicode line and
# paragraph separators (also line breaks to splitlines) and lone surrogates (unencodable as UTF-8).
_UNPRINTABLE_RE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}

DEFAULT_LIMIT = 80  # characters of one echoed value
DEFAULT_ITEMS = 10  # items of one echoed list


def has_unprintable(text: str) -> bool:
    """Return whether ``text`` holds a control character, a line separator or a lone surrogate."""
    return _UNPRINTABLE_RE.search(text) is not None


def first_unprintable(text: str) -> str:
    """Return the first unprintable character of ``text`` as ``U+XXXX`` (empty when there is none)."""
    m = _UNPRINTABLE_RE.search(text)
    return f"U+{ord(m.group()):04X}" if m else ""


def _escape_one(m: re.Match[str]) -> str:
    ch = m.group()
    named = _NAMED.get(ch)
    if named:
        return named
    code = ord(ch)
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def escape(text: str) -> str:
    """Return ``text`` with every unprintable character written as a backslash escape (``\\n``, ``\\x1b``)."""
    return _UNPRINTABLE_RE.sub(_escape_one, text)


def clip(text: str, limit: int = DEFAULT_LIMIT) -> str:
    """Return ``text`` escaped and cut to about ``limit`` characters, saying how many were left out."""
    if len(text) > limit:
        # Escape only what is shown: escaping a megabyte to print eighty characters of it is waste.
        return f"{escape(text[:limit])}… ({len(text) - limit} more characters)"
    return escape(text)


def listing(items: Iterable[object], limit: int = DEFAULT_ITEMS, width: int = DEFAULT_LIMIT) -> str:
    """Return ``"a, b, c … and N more"``: the first ``limit`` items, each clipped, and how many follow."""
    shown: list[str] = []
    rest = 0
    for item in items:
        if len(shown) < limit:
            shown.append(clip(str(item), width))
        else:
            rest += 1
    text = ", ".join(shown)
    return f"{text} … and {rest} more" if rest else text


def columns(rows: Sequence[Sequence[str]], indent: str = "") -> list[str]:
    """Return rows as left-aligned columns two spaces apart, a line each, with no trailing spaces."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)] if rows else []
    return [
        (indent + "  ".join([*(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)), r[-1]])).rstrip()
        for r in rows
    ]
