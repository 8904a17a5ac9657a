"""Files and directories densedev writes, made safe whatever the umask and whatever is planted there.

Every file densedev creates (CDI specs, device-info files, its ownership record) goes through this
module: the directory is opened once with ``O_NOFOLLOW`` and everything else happens relative to that
descriptor (``openat``, ``renameat``, ``unlinkat``), so a symlink planted at a file's name, at a
temporary name, or in place of the directory itself is never followed.  Modes are set with ``fchmod``
after creation because ``open``/``mkdir`` modes are masked by the process umask (an operator's
``umask 000`` would otherwise hand out world-writable files).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
from pathlib import Path

DIR_MODE = 0o755  # runtimes and CNI plugins read our directories; only root writes them
FILE_MODE = 0o644  # CDI specs and device-info files: read by runtimes and CNI plugins, written by us
SOCKET_MODE = 0o600  # a pool socket: only the kubelet (root) may call Allocate
NAME_MAX = 255  # bytes in one path component (include/uapi/linux/limits.h)
MAX_READ = 64 * 1024 * 1024  # refuse to compare against anything bigger: it cannot be ours

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
TMP_SUFFIX = ".tmp"


def canonical_json(value: object) -> str:
    """Return ``value`` as compact JSON with sorted keys: equal content always gives equal text.

    What densedev writes for others to compare or re-read (CDI specs, ``_INFO`` variables, the DRA
    checkpoint) is this form, so an unchanged document is recognised by its bytes alone.
    """
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


class UnsafeNameError(OSError):
    """A file name that could leave its directory or that no filesystem would take.

    An OSError, so every caller that handles a failed write (a refused Allocate, a logged warning)
    handles this one the same way.
    """


def check_name(name: str) -> str:
    """Return ``name`` if it is one safe path component, else raise UnsafeNameError saying why.

    Safe: non-empty, not ``.`` or ``..``, no ``/``, no NUL or other control character, at most
    NAME_MAX bytes.  Names are built from config values; this is the last line before the filesystem.
    """
    if not name or name in (".", ".."):
        raise UnsafeNameError(f"file name {name!r} is empty or a directory reference")
    if "/" in name:
        raise UnsafeNameError(f"file name {name!r} contains '/'")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in name):
        raise UnsafeNameError(f"file name {name!r} contains a control character")
    if len(os.fsencode(name)) > NAME_MAX:
        raise UnsafeNameError(f"file name {name[:40]!r}... is longer than {NAME_MAX} bytes")
    return name


def ensure_dir(directory: Path, mode: int = DIR_MODE) -> None:
    """Create ``directory`` and missing parents with ``mode`` exactly (umask or not); never via a symlink.

    Directories that already exist keep their mode (an operator's choice); the last component must
    not be a symlink.  Parents above the first existing one are created by us and get ``mode`` too.
    """
    directory = Path(directory)
    missing: list[Path] = []
    p = directory
    while not os.path.lexists(p):
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, mode)
        except FileExistsError:
            continue  # made by someone else meanwhile: theirs, keep its mode
        fd = os.open(d, _DIR_FLAGS)
        try:
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
    os.close(open_dir(directory))  # the last component must be a real directory


def open_dir(directory: Path) -> int:
    """Open ``directory`` for ``*at`` calls; an OSError saying so if it is a symlink or not a directory."""
    try:
        return os.open(directory, _DIR_FLAGS)
    except OSError as e:
        # open(2) with O_DIRECTORY|O_NOFOLLOW reports a symlink as ENOTDIR or ELOOP: say which it is.
        if e.errno in (errno.ENOTDIR, errno.ELOOP) and os.path.islink(directory):
            raise OSError(
                errno.ELOOP, "is a symlink; densedev never writes through one", str(directory)
            ) from None
        raise


def read_if_regular(dirfd: int, name: str, limit: int = MAX_READ) -> bytes | None:
    """Return the content of a regular file in the directory, or None (absent, symlink, FIFO, too big)."""
    try:
        # O_NONBLOCK: a FIFO planted at the name must not hang us; O_NOFOLLOW: nor a symlink lead us.
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dirfd)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            return None
        chunks: list[bytes] = []
        size = 0
        while size <= st.st_size:
            chunk = os.read(fd, max(st.st_size + 1 - size, 1))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)


def read_regular(directory: Path, name: str, limit: int = MAX_READ) -> bytes | None:
    """Return the content of a regular file ``name`` in ``directory``, or None if it cannot be read so.

    None also when the directory is absent, a symlink or unreadable: what callers read this way (our
    own records and specs) is then simply not there.
    """
    try:
        dirfd = open_dir(directory)
    except OSError:
        return None
    try:
        return read_if_regular(dirfd, name, limit)
    finally:
        os.close(dirfd)


def temp_name(name: str) -> str:
    """Return a fresh temporary name for ``name``: hidden (runtimes load only *.json), unguessable."""
    # os.urandom is what secrets.token_hex draws from; the secrets module (hmac, random: ~1.5 ms of
    # every start) is not imported for it.
    return f".{name}.{os.urandom(8).hex()}{TMP_SUFFIX}"


def is_temp_of(entry: str, name_prefix: str) -> bool:
    """Return whether ``entry`` is a temporary file of ours for a name starting with ``name_prefix``."""
    return entry.startswith("." + name_prefix) and entry.endswith(TMP_SUFFIX)


def write_atomic(directory: Path, name: str, data: bytes, mode: int = FILE_MODE) -> bool:
    """Write ``data`` to ``directory/name`` atomically with ``mode``; return False if it was already there.

    The temporary file is created with ``O_CREAT|O_EXCL|O_NOFOLLOW`` under a random name (a planted file
    or symlink makes the create fail rather than be written through), fsynced, then renamed over
    ``name`` (rename replaces a symlink at ``name`` instead of following it).
    """
    check_name(name)
    ensure_dir(directory)
    dirfd = open_dir(directory)
    try:
        old = read_if_regular(dirfd, name, limit=len(data))
        if old == data:
            with contextlib.suppress(OSError):
                st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
                if stat.S_IMODE(st.st_mode) != mode:
                    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dirfd)
                    try:
                        os.fchmod(fd, mode)
                    finally:
                        os.close(fd)
            return False
        tmp = temp_name(name)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, mode, dir_fd=dirfd)
        try:
            try:
                os.fchmod(fd, mode)  # the umask masked the mode given to open
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, name, src_dir_fd=dirfd, dst_dir_fd=dirfd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dirfd)
            raise
        # The rename itself is durable only once the directory is (a no-op on tmpfs /run).
        with contextlib.suppress(OSError):
            os.fsync(dirfd)
        return True
    finally:
        os.close(dirfd)


def remove(directory: Path, name: str) -> bool:
    """Unlink ``directory/name`` without following a symlinked directory; return whether it existed."""
    check_name(name)
    try:
        dirfd = open_dir(directory)
    except FileNotFoundError:
        return False
    try:
        os.unlink(name, dir_fd=dirfd)
        return True
    except FileNotFoundError:
        return False
    finally:
        os.close(dirfd)


def list_names(directory: Path) -> list[str]:
    """Return the sorted entry names of ``directory`` (empty if absent); ELOOP if it is a symlink."""
    try:
        dirfd = open_dir(directory)
    except FileNotFoundError:
        return []
    try:
        return sorted(os.listdir(dirfd))
    finally:
        os.close(dirfd)


FileIdentity = tuple[int, int, int]  # (st_dev, st_ino, st_ctime_ns)


def identity_of(st: os.stat_result) -> FileIdentity:
    """Return what tells a file from another at the same path, or from itself before a change.

    A file made anew (written and renamed over, as the kubelet and ConfigMap updates do) has a new
    inode; an inode written, truncated, chmod-ed or renamed in place gets a new ctime (inode(7)).
    """
    return st.st_dev, st.st_ino, st.st_ctime_ns


def identify(path: str | os.PathLike[str], *, follow_symlinks: bool = True) -> FileIdentity | None:
    """Return the identity (``identity_of``) of the file at ``path``, or None when nothing is there.

    Other errors (EACCES, ELOOP) are raised: the path exists, but cannot be told apart.
    """
    try:
        st = os.stat(path, follow_symlinks=follow_symlinks)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return identity_of(st)


def resolved_identity(path: str | os.PathLike[str]) -> tuple[str, FileIdentity] | None:
    """Return the path's target with its identity, or None when it cannot be resolved and stat-ed.

    A ConfigMap mount updates by swapping its ``..data`` symlink: the target's name changes too.
    """
    try:
        real = os.path.realpath(path)
        found = identify(real)
    except OSError:
        return None
    return None if found is None else (real, found)
