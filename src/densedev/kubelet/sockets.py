"""Pool sockets: their names within ``sun_path``'s limit, and the ones an earlier run left behind.

Left behind (SIGKILL, a pool removed meanwhile), they are removed at start.  Only entries this daemon
could have made count: names ``densedev-*.sock`` (``socket_name_for``), that are sockets themselves
(never a symlink or another file), that no current pool uses, and that nobody serves — a socket
another running program listens on is left alone (connect succeeds); a dead one refuses the
connection (ECONNREFUSED), as every socket of a killed process does.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import socket
import stat
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger(__name__)

PREFIX = "densedev-"
SUFFIX = ".sock"
# sockaddr_un.sun_path is 108 bytes including the terminating NUL (include/uapi/linux/un.h).
MAX_UNIX_PATH = 107


def socket_name_for(resource: str, kubelet_dir: Path) -> str:
    """Return the pool's socket file name: readable when it fits ``sun_path``, hashed when it would not.

    Resource names may be 300+ characters while a unix socket path is limited to 107 bytes; the name
    must also be stable across restarts so the kubelet's view does not churn.
    """
    # Only [A-Za-z0-9_.-] of the name reach the file name: no "/" or control character from a config.
    readable = PREFIX + re.sub(r"[^A-Za-z0-9_.-]", "_", resource) + SUFFIX
    if len(os.fsencode(kubelet_dir / readable)) <= MAX_UNIX_PATH:
        return readable
    digest = hashlib.sha256(resource.encode()).hexdigest()[:16]
    return f"{PREFIX}{digest}{SUFFIX}"


def _served(path: str) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(0.5)
    try:
        s.connect(path)
    except OSError as exc:
        # Refused: nobody listens.  Anything else (timeout: a full backlog) means someone might.
        return exc.errno not in (errno.ECONNREFUSED, errno.ENOENT)
    finally:
        s.close()
    return True


def remove_stale_sockets(kubelet_dir: Path, keep: Iterable[str]) -> list[str]:
    """Remove dead ``densedev-*.sock`` sockets in ``kubelet_dir`` not in ``keep``; return their names."""
    kept = set(keep)
    removed: list[str] = []
    try:
        entries = list(os.scandir(kubelet_dir))
    except OSError as exc:
        log.warning("cannot list %s for stale sockets: %s", kubelet_dir, exc.strerror)
        return removed
    for entry in entries:
        name = entry.name
        if not (name.startswith(PREFIX) and name.endswith(SUFFIX)) or name in kept:
            continue
        try:
            if not stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode) or _served(entry.path):
                continue
            os.unlink(entry.path)
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.warning("cannot remove stale socket %s: %s", entry.path, exc.strerror)
            continue
        removed.append(name)
    return sorted(removed)
