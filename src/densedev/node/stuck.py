"""Sysfs reads that do not answer: each runs on a thread of its own under a deadline, and one that overruns
is asked of the kernel which file it is blocked on, so its caller can read again without that device.

Reading a sysfs attribute runs its driver's ``show()`` (fs/kernfs/file.c kernfs_seq_show ->
fs/sysfs/file.c sysfs_kf_seq_show) under the open file's mutex; a driver hung there holds the reader
in the kernel for as long as it hangs.  No flag bounds that: kernfs ignores O_NONBLOCK, and a read in
uninterruptible sleep takes no signal, so a thread blocked in it cannot be got back.  The one real bound
is time, and the cost of a hung file is the thread blocked in it.  So a read that may block runs on a
daemon thread of its own (never joined: the interpreter exits past it), its caller waits up to a
deadline, and then asks the kernel where the thread is: ``/proc/<pid>/task/<tid>/syscall`` gives the
system call a thread is blocked in and its arguments (fs/proc/base.c proc_pid_syscall, lib/syscall.c
task_current_syscall), ``/proc/<pid>/fd/<fd>`` the file behind a descriptor, and a blocked ``openat``'s
path is read from the process's memory (``/proc/<pid>/mem``).  A thread found in the same call twice,
``CONFIRM_S`` apart, is stuck, not slow; the file names its device (the last PCI address in its real
path), and the caller reads again without that device.  Only the reading thread and the helper threads
it starts (the extension's scan starts pthreads, which inherit its name: kernel/fork.c copies ``comm``)
are examined, each call naming its thread uniquely, so a read blocked in another call is that call's to
report.

O_NONBLOCK would only make a FIFO answer at once; a real hung attribute ignores it.  A FIFO no one
writes blocks its reader exactly as a hung ``show()`` does (fifo(7): open waits for a writer), which is
how the tests plant one; so the scan does not use the flag, and the deadline is tested for real.

A file found hung stays on record (``HungFiles``) while the read blocked in it has not returned and the
file is still the same inode: later reads leave its device out without a new warning and without
losing another thread to it.  Once the read returns (the driver answered) or the file is replaced, the
device is read again at the next rescan.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import platform
import threading
import time
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

from .. import pci

__all__ = [
    "CONFIRM_S",
    "DEADLINE_S",
    "HungFiles",
    "Unanswered",
    "after",
    "call",
    "device_of",
    "is_stopped",
    "stuck_files",
]

T = TypeVar("T")

log = logging.getLogger(__name__)

# A sysfs read takes microseconds; one still blocked after a second, in the same call half a second
# later, is hung (a slow scan moves on between the two looks and is waited for again).
DEADLINE_S = 1.0
CONFIRM_S = 0.5
# A call that overruns with no read seen blocked (a slow node, or no /proc to ask) is waited for, with
# one warning once it has taken this long.
SLOW_WARNING_S = 30.0

# System calls a read of a file blocks in, by machine: (reads of a descriptor, opens at a directory
# descriptor, opens of a path).  arch/x86/entry/syscalls/syscall_64.tbl; include/uapi/asm-generic/unistd.h.
_SYSCALLS: dict[str, tuple[frozenset[int], frozenset[int], frozenset[int]]] = {
    # read, pread64, readv, preadv, preadv2 | openat, openat2 | open
    "x86_64": (frozenset((0, 17, 19, 295, 327)), frozenset((257, 437)), frozenset((2,))),
    "aarch64": (frozenset((63, 67, 65, 69, 286)), frozenset((56, 437)), frozenset()),
}
_READS, _OPENATS, _OPENS = _SYSCALLS.get(platform.machine(), (frozenset(), frozenset(), frozenset()))
_AT_FDCWD = -100
_PATH_MAX = 4096  # include/uapi/linux/limits.h

_names = itertools.count()


class Unanswered(OSError):
    """A call's read blocked in these files (real paths) past its deadline; its thread is left to them.

    An OSError (ETIMEDOUT, the first file its filename): where no device can be left out, the caller
    reports it as it reports any file the system would not read.
    """

    def __init__(self, paths: frozenset[str]) -> None:
        super().__init__(errno.ETIMEDOUT, "a sysfs read does not answer", min(paths))
        self.paths = paths


def device_of(path: str) -> str:
    """Return the last PCI address among a sysfs path's components (the function it is a file of), or ""."""
    for part in reversed(path.split("/")):
        if pci.is_address(part):
            return part
    return ""


def after(path: str, directory: str) -> str:
    """Return the component that follows the last ``directory`` component of a path ("" if none)."""
    parts = path.split("/")
    for i in range(len(parts) - 2, -1, -1):
        if parts[i] == directory:
            return parts[i + 1]
    return ""


def is_stopped(pid: int) -> bool:
    """Return whether process ``pid`` is stopped (``T``, or ``t`` under a tracer; proc(5) stat field 3)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read(_PATH_MAX)
    except OSError:
        return False
    # The command name (field 2) may hold spaces and parentheses: the state follows the last ")".
    state = stat.rpartition(b")")[2].split()[:1]
    return state in ([b"T"], [b"t"])


def _read_proc(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, _PATH_MAX)
    finally:
        os.close(fd)


def _c_string(mem: int, address: int) -> str | None:
    """The NUL-terminated path at ``address`` in a process's memory (its ``/proc/<pid>/mem``), or None."""
    out = b""
    while len(out) < _PATH_MAX:
        # Up to the page's end first: the next page may not be mapped.
        chunk = os.pread(mem, 4096 - (address + len(out)) % 4096, address + len(out))
        if not chunk:
            return None
        end = chunk.find(b"\0")
        if end >= 0:
            return os.fsdecode(out + chunk[:end])
        out += chunk
    return None


def _blocked_path(pid: str, fields: list[str]) -> str | None:
    """The file a thread is blocked reading or opening, from its ``syscall`` line's fields; None if not."""
    try:
        nr = int(fields[0])
        args = [int(a, 16) for a in fields[1:7]]
    except (ValueError, IndexError):
        return None  # "running", or not in a system call ("-1 sp pc")
    try:
        if nr in _READS:
            return os.readlink(f"/proc/{pid}/fd/{args[0]}")
        if nr in _OPENATS or nr in _OPENS:
            dirfd, address = (args[0], args[1]) if nr in _OPENATS else (_AT_FDCWD, args[0])
            dirfd = dirfd - (1 << 32) if dirfd >= 1 << 31 else dirfd  # an int in a register: sign it
            mem = os.open(f"/proc/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
            try:
                name = _c_string(mem, address)
            finally:
                os.close(mem)
            if name is None:
                return None
            if os.path.isabs(name):
                return os.path.realpath(name)
            base = os.readlink(f"/proc/{pid}/cwd" if dirfd == _AT_FDCWD else f"/proc/{pid}/fd/{dirfd}")
            # realpath reads links (lstat, readlink) and never opens the file itself: safe on a hung one.
            return os.path.realpath(os.path.join(base, name))
    except OSError:
        return None  # the thread moved on (its descriptor closed), or /proc will not say
    return None


def _blocked(pid: str, root: str, comm: bytes | None) -> dict[tuple[str, bytes], str]:
    """(thread, its syscall line) -> the file under ``root`` it is blocked in, for threads named ``comm``."""
    out: dict[tuple[str, bytes], str] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            if comm is not None and _read_proc(f"/proc/{pid}/task/{tid}/comm").rstrip(b"\n") != comm:
                continue
            line = _read_proc(f"/proc/{pid}/task/{tid}/syscall")
        except OSError:
            continue  # the thread ended
        path = _blocked_path(pid, line.decode("ascii", "replace").split())
        if path is not None and (path == root or path.startswith(root + "/")):
            out[(tid, line)] = path
    return out


def stuck_files(
    root: str | os.PathLike[str], pid: int | None = None, comm: bytes | None = None
) -> frozenset[str]:
    """Return the files under ``root`` that threads of ``pid`` (this process: None) named ``comm`` (any:
    None) are blocked reading, seen in the same system call twice ``CONFIRM_S`` apart."""
    where = "self" if pid is None else str(pid)
    real = os.path.realpath(root)
    first = _blocked(where, real, comm)
    if not first:
        return frozenset()
    time.sleep(CONFIRM_S)
    second = _blocked(where, real, comm)
    return frozenset(path for key, path in first.items() if second.get(key) == path)


class _Call(Generic[T]):
    """One bounded call: its function, its thread's name, and what it returned or raised once it has."""

    __slots__ = ("comm", "done", "error", "fn", "value")

    def __init__(self, fn: Callable[[], T]) -> None:
        self.fn = fn
        # /proc/<pid>/task/<tid>/comm holds 15 bytes (TASK_COMM_LEN 16, with the NUL).
        self.comm = f"dd-sysfs-{next(_names) % 1000000}".encode()
        self.done = threading.Event()
        self.value: T | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            # Name this thread (proc(5): a thread may write its own comm) so the pthreads the scan starts
            # carry the name too, and a look at the process's threads finds this call's alone.
            with open(f"/proc/self/task/{threading.get_native_id()}/comm", "wb") as f:
                f.write(self.comm)
        except OSError:
            self.comm = b""  # no /proc: nothing will be asked of it either
        try:
            self.value = self.fn()
        except BaseException as exc:  # handed to the waiting caller
            self.error = exc
        finally:
            self.done.set()


class HungFiles:
    """Files found hung, kept while the read blocked in each has not returned and the file is the same."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # real path -> (st_dev, st_ino) when found, and the blocked call's end
        self._files: dict[str, tuple[tuple[int, int], threading.Event]] = {}

    def add(self, paths: Iterable[str], done: threading.Event) -> None:
        """Record files a call is blocked in (``done``: set when that call returns)."""
        with self._lock:
            for path in paths:
                try:
                    st = os.stat(path)  # stat does not run the driver's show(): safe on a hung file
                    key = (st.st_dev, st.st_ino)
                except OSError:
                    key = (-1, -1)
                self._files[path] = (key, done)

    def outstanding(self) -> frozenset[str]:
        """Return the files still hung: their blocked read has not returned and they were not replaced."""
        with self._lock:
            out = set()
            for path, (key, done) in list(self._files.items()):
                try:
                    st = os.stat(path)
                    same = (st.st_dev, st.st_ino) == key
                except OSError:
                    same = False
                if done.is_set() or not same:
                    del self._files[path]  # answered, replaced or gone: read it again
                else:
                    out.add(path)
            return frozenset(out)


def call(
    fn: Callable[[], T], root: str | os.PathLike[str], hung: HungFiles, *, deadline_s: float = DEADLINE_S
) -> T:
    """Return ``fn()``, run on a thread of its own; raise ``Unanswered`` (recorded in ``hung``) should a
    read of a file under ``root`` block past the deadline.

    A call that overruns with no read seen blocked is slow, not stuck, and is waited for.
    """
    job: _Call[T] = _Call(fn)
    thread = threading.Thread(target=job.run, name=f"densedev-{job.comm.decode()}", daemon=True)
    thread.start()
    began = time.monotonic()
    warned = False
    while not job.done.wait(deadline_s):
        paths = stuck_files(root, comm=job.comm) if job.comm else frozenset()
        if paths and not job.done.is_set():
            hung.add(paths, job.done)
            raise Unanswered(paths)
        if not warned and time.monotonic() - began >= SLOW_WARNING_S:
            warned = True
            log.warning(
                "a sysfs read under %s has not finished in %.0f s (no read seen blocked)",
                root,
                SLOW_WARNING_S,
            )
    if job.error is not None:
        raise job.error
    return job.value  # type: ignore[return-value]
