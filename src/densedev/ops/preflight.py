"""Checks the daemon makes before it serves anything: a real sysfs tree, the kubelet's directory, one
instance per kubelet directory (an exclusive lock file beside the sockets)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
from pathlib import Path

from ..node.layout import PCI_DEVICES

LOCK_NAME = "densedev.lock"
LOCK_ATTEMPTS = 8  # tries to lock the file the path names while holders keep removing it (acquire)
LOCK_POLL_S = 0.005  # a stand-by's tries for the lock (run --wait-for-lock): part of an upgrade's window


class PreflightError(Exception):
    """A condition under which the daemon cannot do anything useful; its text is one line for the user."""


class LockHeld(PreflightError):
    """Another daemon holds the instance lock; ``holder`` is its PID when the lock file names one."""

    def __init__(self, path: Path, holder: int | None) -> None:
        who = f"pid {holder}" if holder else "another process"
        super().__init__(f"another densedev ({who}) already serves {path.parent} (it holds {path})")
        self.holder = holder


def sysfs_root_problem(root: Path) -> str | None:
    """Return why ``root`` is not a sysfs tree (no ``bus/pci/devices`` directory), or None when it is.

    A node with no matching devices is fine; a root without the PCI bus view is a typo or a missing
    mount, and a daemon scanning it would serve nothing without a word.
    """
    problem = _path_problem(root)
    if problem is not None:
        return problem
    if not root.is_dir():
        return f"{root} is not a directory"
    # Every Linux sysfs has bus/pci/devices (drivers/pci/pci-driver.c registers the bus at boot), even on
    # a machine without PCI devices; the kernel's class/ and devices/ views hang off the same root.
    if not (root / PCI_DEVICES).is_dir():
        return f"{root} is not a sysfs tree: it has no {PCI_DEVICES} directory"
    return None


def _path_problem(path: Path) -> str | None:
    """Why ``path`` cannot be reached (absent, a symlink loop, not searchable), or None.

    ``Path.exists`` says False for every one of these (it swallows ELOOP): the user is told which.
    """
    try:
        os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            return f"{path} does not exist"
        if exc.errno == errno.ELOOP:
            # path_resolution(7): more than 40 links followed, as a link that leads back to itself does.
            return f"{path} is a symlink loop (its links lead back to themselves)"
        return f"{path} cannot be reached: {exc.strerror}"
    return None


def kubelet_dir_problem(path: Path) -> str | None:
    """Return why the daemon cannot serve in the kubelet's device-plugin directory ``path``, or None.

    The kubelet creates this directory when it starts (its device manager's socket dir); a daemon that
    created it would serve sockets nobody reads, so a missing one is refused rather than made.
    """
    if not path.exists():
        return (
            f"{path} does not exist: the kubelet creates it when it starts; "
            "is the kubelet running on this node, and is --kubelet-dir its device-plugins directory?"
        )
    if not path.is_dir():
        return f"{path} is not a directory"
    return None


class InstanceLock:
    """An exclusive ``flock`` on ``<kubelet-dir>/densedev.lock`` holding the owner's PID.

    Two daemons on one kubelet directory would replace each other's sockets and registrations; the
    second one must refuse instead, naming the first.  The kernel drops a flock when its holder exits
    (even by SIGKILL), so a stale file never blocks a restart.
    """

    def __init__(self, directory: Path) -> None:
        self.path = Path(directory) / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> str | None:
        """Take the lock; raise PreflightError naming the holder's PID when another daemon has it.

        Returns None when locked, or why the file could not be made (a read-only or full directory):
        the pools cannot start there either, and are retried until it heals, so that is a warning for
        the caller to log rather than a refusal.
        """
        # A holder removes the file while it still holds the lock, then unlocks (release): a process that
        # opened the file just before locks a removed file, which guards nothing (the next one creates
        # and locks a new file).  So a lock counts only on the file the path still names; else again.
        # Each retry follows a holder that let go meanwhile, so a few suffice.
        for _ in range(LOCK_ATTEMPTS):
            fd = self._open_locked()
            if fd is None:
                continue
            if isinstance(fd, str):
                return fd
            # The mode given to open() is masked by the umask; set it explicitly so readers see the PID.
            os.fchmod(fd, 0o644)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            self._fd = fd
            return None
        raise PreflightError(f"cannot lock {self.path}: it was removed and made again {LOCK_ATTEMPTS} times")

    def _open_locked(self) -> int | str | None:
        """One attempt: the locked fd, why the file cannot be made, or None when it was removed meanwhile."""
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(self.path, flags, 0o644)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise PreflightError(f"{self.path} is a symbolic link; refusing to follow it") from None
            return f"cannot create the lock file {self.path}: {exc.strerror}"
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _read_pid(fd)
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise LockHeld(self.path, holder) from None
            raise PreflightError(f"cannot lock {self.path}: {exc.strerror}") from None
        try:
            named = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            named = None
        mine = os.fstat(fd)
        if named is None or (named.st_dev, named.st_ino) != (mine.st_dev, mine.st_ino):
            os.close(fd)
            return None
        return fd

    async def wait(self, poll_s: float = LOCK_POLL_S) -> str | None:
        """Take the lock once its holder lets go, trying every ``poll_s`` (cancel to stop waiting).

        A non-blocking try on the loop's thread rather than a blocking flock in a worker: a thread
        blocked in flock(2) cannot be cancelled, so a SIGTERM during the wait would hang the exit.
        Returns as ``acquire`` does.
        """
        while True:
            try:
                return self.acquire()
            except LockHeld:
                await asyncio.sleep(poll_s)

    def release(self) -> None:
        """Remove the file (while still holding the lock, so no one locks a doomed file) and unlock."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            st = os.stat(self.path, follow_symlinks=False)
            mine = os.fstat(fd)
            if (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):
                os.unlink(self.path)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            os.close(fd)


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
