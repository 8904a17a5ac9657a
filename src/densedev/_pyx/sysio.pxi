# Raw syscalls, directory listings and small-file reads for the sysfs scan (scan.pxi): everything is
# reached relative to an open directory fd (openat/readlinkat), read into a C buffer and parsed in C,
# without the GIL.

from libc.errno cimport errno, ENOENT
from libc.string cimport strlen, memcmp, memcpy, memset, strcmp
from libc.stdlib cimport realloc, free, qsort
from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.unicode cimport PyUnicode_DecodeUTF8

import os as _os


# ------------------------------------------------------------------ C primitives (no GIL needed)

cdef inline int read_attr(int dirfd, const char *name, char *buf, Py_ssize_t *n) noexcept nogil:
    return read_file(dirfd, name, buf, n, READ_MAX)


cdef int read_file(int dirfd, const char *name, char *buf, Py_ssize_t *n, Py_ssize_t cap) noexcept nogil:
    """Read and strip a small attribute into buf (at least cap + 1 bytes); 0, an errno, or EMPTY."""
    cdef int fd = openat(dirfd, name, FILE_FLAGS)
    cdef ssize_t got
    cdef Py_ssize_t start = 0, end
    n[0] = 0
    if fd < 0:
        return errno if errno else 1
    got = read(fd, buf, cap)
    if got < 0:
        end = errno
        close(fd)
        return end if end else 1
    close(fd)
    end = got
    while end > 0 and is_space(buf[end - 1]):
        end -= 1
    while start < end and is_space(buf[start]):
        start += 1
    if start == end:
        return EMPTY
    if start:
        memcpy(buf, buf + start, end - start)
    n[0] = end - start
    buf[n[0]] = 0
    return 0


cdef bint parse_int(const char *buf, Py_ssize_t n, long *out) noexcept nogil:
    """Optional '-' then 1..9 decimal digits, as the twin's _int."""
    cdef Py_ssize_t i = 0
    cdef long v = 0
    cdef bint neg = False
    if n > 0 and buf[0] == 45:
        neg = True
        i = 1
    if n - i < 1 or n - i > 9:
        return False
    while i < n:
        if not (48 <= buf[i] <= 57):
            return False
        v = v * 10 + (buf[i] - 48)
        i += 1
    out[0] = -v if neg else v
    return True


cdef bint parse_hex_id(char *buf, Py_ssize_t n, int digits) noexcept nogil:
    """0x + exactly ``digits`` hex digits; lower-cases them in place."""
    cdef Py_ssize_t i
    cdef char c
    if n != digits + 2 or buf[0] != 48 or (buf[1] != 120 and buf[1] != 88):
        return False
    for i in range(2, n):
        c = buf[i]
        if 65 <= c <= 70:
            buf[i] = c + 32
        elif not (48 <= c <= 57 or 97 <= c <= 102):
            return False
    return True


cdef inline bint all_hex(char *buf, Py_ssize_t n) noexcept nogil:
    """All hex digits (and at least one); lower-cases them in place."""
    cdef Py_ssize_t i
    cdef char c
    if n < 1:
        return False
    for i in range(n):
        c = buf[i]
        if 65 <= c <= 70:
            buf[i] = c + 32
        elif not (48 <= c <= 57 or 97 <= c <= 102):
            return False
    return True


cdef inline bint hex_pair(char *buf, Py_ssize_t n) noexcept nogil:
    """``15B3:101E``: two groups of four hex digits around a colon (lower-cased in place)."""
    return n == 9 and buf[4] == 58 and all_hex(buf, 4) and all_hex(buf + 5, 4)


cdef bint contains(const char *buf, Py_ssize_t n, const char *sub, Py_ssize_t m) noexcept nogil:
    """``sub in buf`` over lengths (a driver name read from a file may hold any byte)."""
    cdef Py_ssize_t i
    for i in range(n - m + 1):
        if memcmp(buf + i, sub, m) == 0:
            return True
    return False


# ------------------------------------------------------------------ directory listings without the GIL

cdef int cmp_names(const void *a, const void *b) noexcept nogil:
    # Directory entries hold no NUL, and strcmp compares as unsigned char: the order of sorted(bytes).
    return strcmp((<const char **>a)[0], (<const char **>b)[0])


cdef bint dirlist_add(dirlist *l, const char *nm, Py_ssize_t ln) noexcept nogil:
    cdef Py_ssize_t cap
    cdef char *d
    cdef Py_ssize_t *o
    cdef char **p
    if l.used + ln + 1 > l.cap:
        cap = 2 * l.cap
        if cap < l.used + ln + 1:
            cap = l.used + ln + 1 + 4096
        d = <char *>realloc(l.data, cap)
        if d == NULL:
            l.oom = True
            return False
        l.data = d
        l.cap = cap
    if l.count == l.ncap:
        cap = 2 * l.ncap if l.ncap else 64
        o = <Py_ssize_t *>realloc(l.offs, cap * sizeof(Py_ssize_t))
        if o == NULL:
            l.oom = True
            return False
        l.offs = o
        p = <char **>realloc(l.names, cap * sizeof(char *))
        if p == NULL:
            l.oom = True
            return False
        l.names = p
        l.ncap = cap
    memcpy(l.data + l.used, nm, ln + 1)
    l.offs[l.count] = l.used
    l.used += ln + 1
    l.count += 1
    return True


cdef void dirlist_fill(dirlist *l, int fd) noexcept nogil:
    """List an open directory (fd is consumed) into l, sorted; '.' and '..' left out.

    getdents64 straight into a stack buffer: no DIR allocation and no fcntl as fdopendir would cost.
    """
    cdef char buf[DENTS_BUF]
    cdef long got, pos
    cdef Py_ssize_t i
    cdef linux_dirent64 *e
    cdef const char *nm
    l.used = 0
    l.count = 0
    while True:
        got = syscall(SYS_getdents64, fd, buf, DENTS_BUF)
        if got <= 0:
            break
        pos = 0
        while pos < got:
            e = <linux_dirent64 *>(buf + pos)
            pos += e.d_reclen
            nm = e.d_name
            if nm[0] == 46 and (nm[1] == 0 or (nm[1] == 46 and nm[2] == 0)):
                continue
            if not dirlist_add(l, nm, strlen(nm)):
                break
        # fs/readdir.c: getdents64 fills the buffer until the next record does not fit or the
        # directory ends (kernfs, ext4 and tmpfs all emit until full), so a reply with room left
        # for a maximal record is the end: skip the extra call that would return 0.
        if l.oom or got < DENTS_BUF - DIRENT_MAX:
            break
    close(fd)
    for i in range(l.count):
        l.names[i] = l.data + l.offs[i]
    if l.count > 1 and not l.unsorted:
        qsort(l.names, l.count, sizeof(char *), cmp_names)


cdef void dirlist_open(dirlist *l, int dirfd, const char *name) noexcept nogil:
    """List a subdirectory into l; empty when it is absent or unreadable."""
    cdef int fd = openat(dirfd, name, DIR_FLAGS)
    l.used = 0
    l.count = 0
    if fd >= 0:
        dirlist_fill(l, fd)


cdef void dirlist_free(dirlist *l) noexcept nogil:
    free(l.data)
    free(l.offs)
    free(l.names)
    memset(l, 0, sizeof(dirlist))


cdef list dirlist_bytes(dirlist *l):
    """The listing as a list of bytes; raises MemoryError if it could not be held."""
    cdef Py_ssize_t i
    if l.oom:
        raise MemoryError("sysfs scan: out of memory listing a directory")
    return [PyBytes_FromStringAndSize(l.names[i], strlen(l.names[i])) for i in range(l.count)]


cdef list entries_fd(int fd):
    """Sorted entries of an open directory (fd is consumed); '.' and '..' left out."""
    cdef dirlist l
    memset(&l, 0, sizeof(dirlist))
    try:
        with nogil:
            dirlist_fill(&l, fd)
        return dirlist_bytes(&l)
    finally:
        dirlist_free(&l)


cdef list listdir_at(int dirfd, const char *name):
    cdef dirlist l
    memset(&l, 0, sizeof(dirlist))
    try:
        with nogil:
            dirlist_open(&l, dirfd, name)
        return dirlist_bytes(&l)
    finally:
        dirlist_free(&l)


# ------------------------------------------------------------------ Python objects (GIL held)

cdef inline str fs_str(const char *buf, Py_ssize_t n):
    # os.fsdecode on Linux: UTF-8 with surrogateescape
    return PyUnicode_DecodeUTF8(buf, n, "surrogateescape")


def _why(int status):
    if status == EMPTY:
        return "empty"
    if status == ENOENT:
        return "missing"
    return f"unreadable ({_os.strerror(status)})"
