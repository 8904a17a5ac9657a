"""The first whole-node scan, read by a forked child while the daemon's process imports the rest of itself.

``densedev run`` spends ~100 ms importing argparse, asyncio, uvloop, gRPC and its own stages before it
can scan, and the first scan of a 4,096-VF node takes ~40 ms more; the two are independent, so the
scan can run meanwhile.  It cannot run in a thread: the imports hold the GIL, and the scan gives the
GIL up at every system call it makes, so each waits for the other (CPython's convoy effect) — measured,
a scan thread beside the imports slowed them from ~63 to ~100 ms and saved nothing.  A child process has
its own interpreter.  It forks as the command starts, before those imports and before any thread exists
(``_single_threaded``): ``densedev.__main__`` reads the sysfs root from the raw arguments, and the
command checks it against the flags it parses (a root spelled otherwise forks again there).  So this
module imports only the standard library's basics at its top, and the child imports the scanner itself
(~5 ms: the accelerator and the models, none of which imports a dataclass) while the daemon imports
its own.  The child scans on one thread while the daemon imports, and with the scan's helper threads
too once the daemon waits for it (the gate, a pipe the daemon closes: on two cores helpers beside the
imports slowed a 4,096-VF start by ~20 ms, and a child without them made a 16,384-VF start ~15 %
slower, the daemon waiting for it).  It writes its rows to a private memory file, says DONE on a pipe
and exits; the daemon decodes the rows when it reaches its scan (~4 ms at 4,096 VFs,
~15 ms at 16,384).

Whatever goes wrong — no fork, a child killed, stopped, blocked in a read that does not answer (a hung
driver's sysfs file), slower than the timeout, or a truncated result — the daemon scans in its own
process, as it would without this (``ScanAhead.result`` returns None and says why in one warning).  A
stopped or blocked child is given up at the first look (``CHECK_S``), not at the timeout: the daemon's
own scan leaves a device that does not answer out (``node.stuck``).  The child reads sysfs only: it
decides nothing, holds nothing, and exits; and it dies with the daemon (``PR_SET_PDEATHSIG``), so a
daemon killed while the child scans leaves none behind.  ``result`` runs on a worker thread (the daemon's
event loop must stay free to take SIGTERM) and ``cancel`` may come from the loop meanwhile: a lock
orders them, so the descriptors are closed and the child reaped once, by whichever comes last.
"""

from __future__ import annotations

import _thread
import marshal
import os
import select
import signal
import time
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:  # imported where used: this module loads before the fork, they after it
    import logging
    from pathlib import Path

    from ..model import Device

# The child's result, marshalled: (FORMAT, seconds the scan took, rows as plain tuples, warnings).
# marshal, not pickle: the rows hold only str, int, bool and tuples, which marshal writes and reads
# ~3x faster, and nothing in them names a class to import.
FORMAT = 1
DEFAULT_TIMEOUT_S = 30.0  # a child still scanning (neither stopped nor blocked) this long is given up
CHECK_S = 1.0  # how often a waited-for child is looked at: stopped, or blocked in a read (node.stuck)
PR_SET_PDEATHSIG = 1  # include/uapi/linux/prctl.h
REAP_WAIT_S = 1.0  # how long a killed child is waited for
REAP_FIRST_POLL_S, REAP_POLL_S = 0.0005, 0.01  # polls for its end, doubling from the first
DONE = b"\x01"  # the child's word on the pipe once its whole result is in the memory file


def _log() -> logging.Logger:
    import logging

    return logging.getLogger(__name__)


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

    def __init__(
        self, pid: int, done_fd: int, data_fd: int, timeout_s: float, root: bytes = b"", gate_fd: int = -1
    ) -> None:
        self.pid = pid
        self.root = root  # the sysfs root the child scans
        self._done_fd = done_fd  # the pipe's read end: DONE, then end of file once the child has exited
        self._data_fd = data_fd  # the memory file the child writes its result into
        self._gate_fd = gate_fd  # a pipe's write end, closed once this process waits for the scan
        self._timeout_s = timeout_s
        self._open = True
        self._reaped = False
        # result() (a worker thread) and cancel() (the loop) may overlap: the lock orders them, and while
        # result() waits, cancel() only kills the child, leaving the descriptors and the reaping to it.
        self._lock = _thread.allocate_lock()
        self._waiting = False
        # Files the child was found blocked in: the daemon's own scan leaves their devices out at once.
        self.unanswered: frozenset[str] = frozenset()

    @classmethod
    def start(
        cls, sysfs_root: str | Path, *, threads: bool = True, timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> ScanAhead | None:
        """Fork a child that scans ``sysfs_root``; None when this process cannot (threads, no fork)."""
        if not _single_threaded():
            return None
        root = os.fsencode(sysfs_root)
        fds: list[int] = []
        try:
            data_fd = os.memfd_create("densedev-scan", os.MFD_CLOEXEC)
            fds.append(data_fd)
            done_r, done_w = os.pipe2(os.O_CLOEXEC)  # child -> daemon: DONE
            fds += (done_r, done_w)
            gate_r, gate_w = os.pipe2(os.O_CLOEXEC)  # daemon -> child: end of file once it waits
            fds += (gate_r, gate_w)
            parent = os.getpid()
            pid = os.fork()
        except (AttributeError, OSError) as exc:
            for fd in fds:
                os.close(fd)
            _log().debug("scan ahead: cannot fork (%s): scanning in the daemon", exc)
            return None
        if pid == 0:  # pragma: no cover - the child; its result is checked by the parent's tests
            _child(root, threads, data_fd, done_w, gate_r, parents=(done_r, gate_w), parent=parent)
        os.close(done_w)
        os.close(gate_r)
        return cls(pid, done_r, data_fd, timeout_s, root, gate_w)

    def scans(self, sysfs_root: str | Path) -> bool:
        """Return whether the child scans ``sysfs_root`` (as spelled: a different spelling forks again)."""
        return os.fsencode(sysfs_root) == self.root

    def result(self) -> Scanned | None:
        """Wait for the child and return its scan; None (with a warning) if it did not give one.

        Blocking (up to the timeout): the daemon calls it on a worker thread.
        """
        with self._lock:
            if not self._open or self._waiting:
                return None
            self._waiting = True
        try:
            _log().debug("scan ahead: waiting for child %d's scan", self.pid)
            self._open_gate()  # this process waits from now: the child's helper threads may run
            why = self._wait()
            if why is None:
                got = self._read()
                if isinstance(got, Scanned):
                    _log().debug(
                        "scan ahead: took child %d's scan of %d devices (%.1f ms)",
                        self.pid,
                        len(got.devices),
                        got.seconds * 1e3,
                    )
                    return got
                why = got
            _log().warning("scan ahead: %s: scanning in the daemon instead", why)
            return None
        finally:
            with self._lock:
                self._waiting = False
            self.cancel()

    def cancel(self) -> None:
        """Stop the child if it still runs, reap it and close the files (idempotent; from any thread)."""
        with self._lock:
            if not self._open:
                return
            if self._waiting:
                # result() waits on another thread: killed, the child ends its wait (end of file), and
                # result() reaps it and closes the files on its way out.
                if not self._reaped:
                    try:
                        os.kill(self.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        return  # exited already: result() sees its end of file
                return
            self._close()

    def _close(self) -> None:
        self._open = False
        if not self._reaped:
            # Not reaped yet, so the pid is still the child's (a reaped pid may be reused).
            self._reaped = True
            try:
                os.kill(self.pid, signal.SIGKILL)
                self._reap_killed()
            except (ProcessLookupError, ChildProcessError):
                pass
        self._open_gate()
        os.close(self._done_fd)
        os.close(self._data_fd)

    def _open_gate(self) -> None:
        if self._gate_fd >= 0:
            os.close(self._gate_fd)
            self._gate_fd = -1

    def _reap_killed(self) -> None:
        # SIGKILL takes effect when the child leaves the kernel: a read stuck in a hung driver's sysfs
        # file (uninterruptible sleep) may hold it there for good, and the daemon must not wait with it.
        # A child that has said DONE is exiting already and goes within a millisecond or so: the polls
        # start short, so reaping it does not cost the daemon a whole poll interval.
        deadline = time.monotonic() + REAP_WAIT_S
        pause = REAP_FIRST_POLL_S
        while os.waitpid(self.pid, os.WNOHANG)[0] != self.pid:
            if time.monotonic() >= deadline:
                _log().warning(
                    "scan ahead: the scanning child %d does not exit (stuck in the kernel?)", self.pid
                )
                return
            time.sleep(pause)
            pause = min(pause * 2, REAP_POLL_S)

    def _wait(self) -> str | None:
        """Wait for the child's word that its result is whole; why it gave none, or None."""
        deadline = time.monotonic() + self._timeout_s
        while True:
            # A signal does not cut the wait short: select resumes with the time left (PEP 475).
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self._done_fd], [], [], max(0.0, min(CHECK_S, left)))
            if ready:
                break
            if time.monotonic() >= deadline:
                return f"the scanning child {self.pid} gave no result in {self._timeout_s:g} s"
            why = self._stuck()
            if why is not None:
                return why
        if os.read(self._done_fd, 1) == DONE:
            return None  # the child is exiting: cancel() reaps it once the result is decoded
        # End of file without DONE: every copy of the write end is closed, i.e. the child has exited.
        with self._lock:
            _, status = os.waitpid(self.pid, 0)
            self._reaped = True
        if os.WIFSIGNALED(status):
            return f"the scanning child was killed by signal {os.WTERMSIG(status)}"
        return f"the scanning child exited {os.WEXITSTATUS(status)} without a result"

    def _stuck(self) -> str | None:
        """Why the child, not done yet, will not be (stopped, or blocked in a read); None if it may be."""
        from . import stuck

        if stuck.is_stopped(self.pid):
            return f"the scanning child {self.pid} is stopped"
        blocked = stuck.stuck_files(os.fsdecode(self.root), self.pid)
        if blocked:
            self.unanswered = blocked
            return f"the scanning child's read of {min(blocked)} does not answer"
        return None

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
        from ..model import Device

        new, fields = tuple.__new__, len(Device._fields)
        devices = [new(Device, r) for r in rows if type(r) is tuple and len(r) == fields]
        if len(devices) != len(rows) or not all(type(w) is str for w in warnings):
            return "its result is not in this version's format"
        return Scanned(tuple(devices), warnings, float(seconds))


def _die_with(parent: int) -> None:  # pragma: no cover - the child's
    """Have the kernel SIGKILL this process when the thread that forked it ends; exit if it has already."""
    import ctypes  # ~3 ms in the child, beside the daemon's ~100 ms of imports: off the start's path

    # prctl(2): PR_SET_PDEATHSIG fires when the parent *thread* exits; the fork is made on the main
    # thread (densedev.__main__ or the command's dispatch), which lives as long as the daemon does.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    # The parent may have died between the fork and the prctl: then no signal will come, and this
    # process has been handed to another (init, or a subreaper) already.
    if os.getppid() != parent:
        os._exit(1)


def _child(  # pragma: no cover
    root: bytes,
    threads: bool,
    data_fd: int,
    done_w: int,
    gate_r: int,
    parents: tuple[int, ...],
    parent: int,
) -> None:
    """The forked child: scan, write the result, say DONE, exit — never return into the parent's code."""
    code = 1  # whatever the child raises ends here: the parent scans itself
    try:
        _die_with(parent)
        for fd in parents:  # the daemon's ends: the gate's end of file must come from the daemon alone
            os.close(fd)
        # The parent's handlers are Python functions meant for the daemon (SIGTERM raises to stop
        # it); the child only scans, so a stop signal ends it at once.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        from .. import accel  # the scanner, loaded here while the daemon loads its own modules

        # Helper threads wait at the gate (workq.pxi: gated): until the daemon waits for this scan they
        # would only take the cores its imports run on.  Measured at 4,096 VFs (two cores, 15 starts
        # each): 177 ms median with helpers from the start, 157 with the gate; at 16,384, 358 and 360.
        t0 = time.perf_counter()
        rows, warnings = accel.scan_sysfs(root, None, threads, gate_r)
        seconds = time.perf_counter() - t0
        data = marshal.dumps((FORMAT, seconds, tuple(map(tuple, rows)), warnings))
        view = memoryview(data)
        while view:
            view = view[os.write(data_fd, view) :]
        # The parent goes on at this word rather than at the pipe's end of file, which comes only
        # once the kernel has torn this process's memory down (exit_mm runs before exit_files).
        os.write(done_w, DONE)
        code = 0
    finally:
        # os._exit: no atexit handlers, no flushing of stdio buffers inherited from the parent.
        os._exit(code)
