"""Pool sockets left behind by an earlier run (SIGKILL, a pool removed meanwhile) are removed at start.

Only entries this daemon could have made count: names ``densedev-*.sock`` (see
``manager.socket_name_for``), that are sockets themselves (never a symlink or another file), that no
current pool uses, and that nobody serves — a socket another running program listens on is left alone
(connect succeeds); a dead one refuses the connection (ECONNREFUSED), as every socket of a killed
process does.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger(__name__)

PREFIX = "densedev-"
SUFFIX = ".sock"


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


# sockaddr_un.sun_path is 108 bytes including the terminating NUL (include/uapi/linux/un.h).
MAX_UNIX_PATH = 107

FileIdentity = tuple[int, int, int]  # (st_dev, st_ino, st_ctime_ns)


def identify(path: Path, *, follow_symlinks: bool = True) -> FileIdentity | None:
    """Return what tells this file from a recreated one at the same path, or None when it is absent.

    The ctime too, as on ext4 a deleted socket's inode number is soon given to the next one.  Our own
    sockets are named with ``follow_symlinks=False``: a symlink planted at their path is not ours.
    """
    try:
        st = os.stat(path, follow_symlinks=follow_symlinks)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return st.st_dev, st.st_ino, st.st_ctime_ns
