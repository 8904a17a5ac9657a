"""A directory watch on the event loop: inotify tells the kubelet's socket directory changed, no polling.

The kubelet's restart is visible only in its socket directory: it deletes every plugin socket and
recreates ``kubelet.sock`` (pkg/kubelet/cm/devicemanager: the manager's Start removes stale sockets
before listening).  With one pool per resource and thousands of idle seconds between restarts, polling
``stat`` in every pool wakes the daemon tens of times a second for nothing; an inotify watch wakes it
only when an entry is created, deleted or moved.  Where inotify is unavailable (no watch left:
``fs.inotify.max_user_watches``, a filesystem without it) the watch says so and its users poll.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import logging
import os
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

# include/uapi/linux/inotify.h
IN_ATTRIB = 0x00000004
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC
# Entries appearing or going (sockets are created by bind and removed by unlink), and the directory
# itself being removed or replaced (then the watch is gone and is set up again).
WATCH_MASK = IN_CREATE | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO | IN_DELETE_SELF | IN_MOVE_SELF | IN_ONLYDIR
_GONE = IN_DELETE_SELF | IN_MOVE_SELF | IN_IGNORED

_EVENT_HEADER = 16  # struct inotify_event { int wd; u32 mask; u32 cookie; u32 len; char name[]; }
_READ_SIZE = 64 * 1024


def _libc() -> ctypes.CDLL | None:
    # The process's own symbols (dlopen(NULL)) hold the C library's inotify calls wherever the
    # interpreter is linked dynamically; ctypes.util.find_library("c") would run "ldconfig -p" in a
    # child process at every start (a fork, ~2 ms) to name the same library.
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.inotify_init1  # noqa: B018 (AttributeError where the symbols are not global)
        return libc
    except (OSError, AttributeError):
        pass
    from ctypes.util import find_library

    name = find_library("c")
    try:
        return ctypes.CDLL(name or "libc.so.6", use_errno=True)
    except OSError:
        return None


def parse_events(data: bytes) -> list[tuple[int, int, bytes]]:
    """Split a read from an inotify fd into ``(wd, mask, name)`` records (a truncated tail is dropped)."""
    out = []
    pos = 0
    while pos + _EVENT_HEADER <= len(data):
        wd = int.from_bytes(data[pos : pos + 4], "little", signed=True)
        mask = int.from_bytes(data[pos + 4 : pos + 8], "little")
        length = int.from_bytes(data[pos + 12 : pos + 16], "little")
        end = pos + _EVENT_HEADER + length
        if end > len(data):
            break
        out.append((wd, mask, data[pos + _EVENT_HEADER : end].rstrip(b"\0")))
        pos = end
    return out


class DirectoryWatch:
    """Calls every subscriber whenever an entry of one directory is created, deleted or moved."""

    def __init__(self, directory: Path | str) -> None:
        self.directory = Path(directory)
        self._fd = -1
        self._wd = -1
        self._loop: asyncio.AbstractEventLoop | None = None
        self._subscribers: list[Callable[[], None]] = []
        self._libc = _libc()
        self.events = 0  # inotify records seen, for tests and metrics

    @property
    def active(self) -> bool:
        """Whether changes are being reported (False: callers must poll)."""
        return self._wd >= 0

    def subscribe(self, wake: Callable[[], None]) -> Callable[[], None]:
        """Call ``wake`` on every change; return a function that stops doing so."""
        self._subscribers.append(wake)

        def unsubscribe() -> None:
            if wake in self._subscribers:
                self._subscribers.remove(wake)

        return unsubscribe

    def start(self) -> bool:
        """Open the inotify fd and watch the directory; False (and polling callers) when that fails."""
        self._loop = asyncio.get_running_loop()
        if self._libc is None:
            log.warning("watch: no libc for inotify; %s is polled", self.directory)
            return False
        fd = self._libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            log.warning(
                "watch: inotify_init1: %s; %s is polled", os.strerror(ctypes.get_errno()), self.directory
            )
            return False
        self._fd = fd
        self._loop.add_reader(fd, self._on_readable)
        return self.rewatch()

    def rewatch(self) -> bool:
        """Watch the directory again if the watch is gone (it was removed, or did not exist yet)."""
        if self._fd < 0 or self._libc is None:
            return False
        if self._wd >= 0:
            return True
        wd = self._libc.inotify_add_watch(self._fd, os.fsencode(self.directory), WATCH_MASK)
        if wd < 0:
            err = ctypes.get_errno()
            level = logging.DEBUG if err == errno.ENOENT else logging.WARNING
            log.log(level, "watch: %s: %s; polled until it can be watched", self.directory, os.strerror(err))
            return False
        self._wd = wd
        return True

    def close(self) -> None:
        """Stop watching and close the inotify fd."""
        fd, self._fd = self._fd, -1
        self._wd = -1
        if fd >= 0:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(fd)
            os.close(fd)
        self._subscribers.clear()

    def _on_readable(self) -> None:
        try:
            data = os.read(self._fd, _READ_SIZE)
        except BlockingIOError:
            return
        except OSError as exc:
            log.warning("watch: reading inotify events failed: %s", exc)
            return
        records = parse_events(data)
        self.events += len(records)
        for wd, mask, _name in records:
            if mask & _GONE and wd == self._wd:
                if mask & IN_MOVE_SELF and self._libc is not None:
                    # Moved away, the watch would follow it: drop it and watch the path again.
                    self._libc.inotify_rm_watch(self._fd, wd)
                self._wd = -1  # the directory went away: set up again on the next rewatch()
        # An overflow (IN_Q_OVERFLOW) lost events: waking everyone makes them look, which is all an
        # event would have done.
        for wake in list(self._subscribers):
            wake()
