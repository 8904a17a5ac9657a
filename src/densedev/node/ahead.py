"""The first whole-node scan, read by a forked child while the daemon's process imports the rest of itself.

``densedev run`` spends ~60 ms importing asyncio, uvloop, gRPC and its own stages after it has parsed
its flags, and the first scan of a 4,096-VF node takes ~40 ms more; the two are independent, so the
scan can run meanwhile.  It cannot run in a thread: the imports hold the GIL, and the scan gives the
GIL up at every system call it makes, so each waits for the other (CPython's convoy effect) — measured,
a scan thread beside the imports slowed them from ~63 to ~100 ms and saved nothing.  A child process has
its own interpreter: it forks right after the flags are read (before any thread exists, see
``_single_threaded``), scans (with the scan's own helper threads: a single-threaded child made a
16,384-VF start ~15 % slower, the parent waiting for it), writes its rows to a private memory file and
exits; the daemon decodes them when it reaches its scan (~6 ms at 4,096 VFs, ~15 ms at 16,384).

Whatever goes wrong — no fork, a child killed, stopped past the timeout, or a truncated result — the
daemon scans in its own process, as it would without this (``ScanAhead.result`` returns None and says
why in one warning).  The child reads sysfs only: it decides nothing, holds nothing, and exits.
"""

from __future__ import annotations

import logging
import marshal
import os
import select
import signal
import time
from pathlib import Path
from typing import NamedTuple

from .. import accel
from ..model import Device

log = logging.getLogger(__name__)

# The child's result, marshalled: (FORMAT, seconds the scan took, rows as plain tuples, warnings).
# marshal, not pickle: the rows hold only str, int, bool and tuples, which marshal writes and reads
# ~3x faster, and nothing in them names a class to import.
FORMAT = 1
DEFAULT_TIMEOUT_S = 30.0  # a scan that blocks this long (a hung driver's sysfs file) is given up
REAP_POLLS, REAP_POLL_S = 100, 0.01  # how long a killed child is waited for: up to 1 s

_FIELDS = len(Device._fields)


class Scanned(NamedTuple):
    """A scan's rows and warnings, as ``accel.scan_sysfs`` returns them, and how long it took."""

    devices: tuple[Device, ...]
    warnings: tuple[str, ...]
    seconds: float


def _single_threaded() -> bool:
    """Return whether this process has one thread (fork copies only the calling one: a lock another
    thread held at the fork would stay locked in the child for good)."""
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return False


class ScanAhead:
    """A whole-node scan running in a forked child; ``result`` collects it (or None: scan here)."""

    def __init__(self, pid: int, done_fd: int, data_fd: int, timeout_s: float) -> None:
        self.pid = pid
        self._done_fd = done_fd  # the pipe's read end: end of file once the child has exited
        self._data_fd = data_fd  # the memory file the child writes its result into
        self._timeout_s = timeout_s
        self._open = True
        self._reaped = False

    @classmethod
    def start(
        cls, sysfs_root: str | Path, *, threads: bool = True, timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> ScanAhead | None:
        """Fork a child that scans ``sysfs_root``; None when this process cannot (threads, no fork)."""
        if not _single_threaded():
            return None
        root = os.fsencode(sysfs_root)
        try:
            data_fd = os.memfd_create("densedev-scan", os.MFD_CLOEXEC)
        except (AttributeError, OSError):
            return None
        try:
            done_r, done_w = os.pipe2(os.O_CLOEXEC)
        except OSError:
            os.close(data_fd)
            return None
        try:
            pid = os.fork()
        except OSError as exc:
            for fd in (data_fd, done_r, done_w):
                os.close(fd)
            log.debug("scan ahead: cannot fork (%s): scanning in the daemon", exc)
            return None
        if pid == 0:  # pragma: no cover - the child; its result is checked by the parent's tests
            _child(root, threads, data_fd, done_r)
        os.close(done_w)
        return cls(pid, done_r, data_fd, timeout_s)

    def result(self) -> Scanned | None:
        """Wait for the child and return its scan; None (with a warning) if it did not give one."""
        if not self._open:
            return None
        try:
            why = self._wait()
            if why is None:
                got = self._read()
                if isinstance(got, Scanned):
                    log.debug(
                        "scan ahead: took child %d's scan of %d devices (%.1f ms)",
                        self.pid,
                        len(got.devices),
                        got.seconds * 1e3,
                    )
                    return got
                why = got
            log.warning("scan ahead: %s: scanning in the daemon instead", why)
            return None
        finally:
            self.cancel()

    def cancel(self) -> None:
        """Stop the child if it still runs, reap it and close the files (idempotent)."""
        if not self._open:
            return
        self._open = False
        if not self._reaped:
            # Not reaped yet, so the pid is still the child's (a reaped pid may be reused).
            self._reaped = True
            try:
                os.kill(self.pid, signal.SIGKILL)
                self._reap_killed()
            except (ProcessLookupError, ChildProcessError):
                pass
        os.close(self._done_fd)
        os.close(self._data_fd)

    def _reap_killed(self) -> None:
        # SIGKILL takes effect when the child leaves the kernel: a read stuck in a hung driver's sysfs
        # file (uninterruptible sleep) may hold it there for good, and the daemon must not wait with it.
        for _ in range(REAP_POLLS):
            if os.waitpid(self.pid, os.WNOHANG)[0] == self.pid:
                return
            time.sleep(REAP_POLL_S)
        log.warning("scan ahead: the scanning child %d does not exit (stuck in the kernel?)", self.pid)

    def _wait(self) -> str | None:
        """Wait until the child exits; why it gave no result, or None."""
        # A signal does not cut the wait short: select resumes with the time left (PEP 475).
        ready, _, _ = select.select([self._done_fd], [], [], self._timeout_s)
        if not ready:
            return f"the scanning child {self.pid} gave no result in {self._timeout_s:g} s"
        # End of file: every copy of the write end is closed, i.e. the child has exited.
        _, status = os.waitpid(self.pid, 0)
        self._reaped = True
        if os.WIFSIGNALED(status):
            return f"the scanning child was killed by signal {os.WTERMSIG(status)}"
        code = os.WEXITSTATUS(status)
        return None if code == 0 else f"the scanning child exited {code}"

    def _read(self) -> Scanned | str:
        """Decode the child's result, or say why it cannot be."""
        size = os.fstat(self._data_fd).st_size
        data = os.pread(self._data_fd, size, 0)
        try:
            fmt, seconds, rows, warnings = marshal.loads(data)
        except (EOFError, ValueError, TypeError) as exc:
            return f"its result is unreadable ({exc})"
        if fmt != FORMAT or type(rows) is not tuple or type(warnings) is not tuple:
            return "its result is not in this version's format"
        new = tuple.__new__
        devices = [new(Device, r) for r in rows if type(r) is tuple and len(r) == _FIELDS]
        if len(devices) != len(rows) or not all(type(w) is str for w in warnings):
            return "its result is not in this version's format"
        return Scanned(tuple(devices), warnings, float(seconds))


def _child(root: bytes, threads: bool, data_fd: int, done_r: int) -> None:  # pragma: no cover
    """The forked child: scan, write the result, exit — never return into the parent's code."""
    code = 1  # whatever the child raises ends here: the parent scans itself
    try:
        os.close(done_r)
        # The parent's handlers are Python functions meant for the daemon (SIGTERM raises to stop
        # it); the child only scans, so a stop signal ends it at once.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        t0 = time.perf_counter()
        rows, warnings = accel.scan_sysfs(root, None, threads)
        seconds = time.perf_counter() - t0
        data = marshal.dumps((FORMAT, seconds, tuple(map(tuple, rows)), warnings))
        view = memoryview(data)
        while view:
            view = view[os.write(data_fd, view) :]
        code = 0
    finally:
        # os._exit: no atexit handlers, no flushing of stdio buffers inherited from the parent.
        os._exit(code)
