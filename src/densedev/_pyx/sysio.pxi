# Raw syscalls, directory listings and small-file reads for the sysfs scan (scan.pxi): everything is
# reached relative to an open directory fd (openat/readlinkat), read into a C buffer and parsed in C,
# without the GIL.

from libc.errno cimport errno, ENOENT
from libc.string cimport strlen, memcmp, memcpy, memset, strcmp
from libc.stdlib cimport realloc, free, qsort
from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.unicode cimport PyUnicode_DecodeUTF8

cdef extern from "<fcntl.h>" nogil:
    int sc_openat "openat"(int dirfd, const char *path, int flags, ...)
    enum:
        SC_O_RDONLY "O_RDONLY"
        SC_O_DIRECTORY "O_DIRECTORY"
        SC_O_CLOEXEC "O_CLOEXEC"

cdef extern from "<unistd.h>" nogil:
    ssize_t sc_read "read"(int fd, void *buf, size_t count)
    int sc_close "close"(int fd)
    ssize_t sc_readlinkat "readlinkat"(int dirfd, const char *path, char *buf, size_t size)
    int sc_dup "dup"(int fd)

cdef extern from "<sys/syscall.h>" nogil:
    long sc_syscall "syscall"(long number, ...)
    enum:
        SC_SYS_getdents64 "SYS_getdents64"

# include/linux/dirent.h:
#   struct linux_dirent64 { u64 d_ino; s64 d_off; unsigned short d_reclen; unsigned char d_type;
#                            char d_name[]; };
cdef struct sc_dirent64:
    unsigned long long d_ino
    long long d_off
    unsigned short d_reclen
    unsigned char d_type
    char d_name[1]

cdef enum:
    SC_DIR_FLAGS = SC_O_RDONLY | SC_O_DIRECTORY | SC_O_CLOEXEC
    SC_FILE_FLAGS = SC_O_RDONLY | SC_O_CLOEXEC
    SC_READ_MAX = 255      # one short attribute line, as the twin's os.read(fd, 255)
    SC_LINK_MAX = 4096     # PATH_MAX: sysfs link targets are far shorter
    SC_EMPTY = -2          # status of an attribute that exists but holds only whitespace
    SC_UNREAD = -3         # status of an attribute this device does not need read
    SC_MAX_PARTS = 128
    SC_UEVENT_MAX = 1023   # a PCI device's uevent is ~150 bytes (DRIVER, PCI_*, MODALIAS)
    SC_DENTS_BUF = 32768   # one getdents64 call returns a whole device directory
    SC_DIRENT_MAX = 280    # largest linux_dirent64: 19-byte header + 255-byte name + NUL, 8-aligned
    SC_NAME_MAX = 255
    SC_YIELD_ROWS = 1023   # a GIL hand-over point every 1,024 rows of the whole-table loops
    # include/uapi/linux/if_arp.h
    SC_ARPHRD_ETHER = 1
    SC_ARPHRD_INFINIBAND = 32

import os as _sc_os


# ------------------------------------------------------------------ C primitives (no GIL needed)

cdef inline bint _sc_space(char c) noexcept nogil:
    # bytes.strip() whitespace: space \t \n \r \v \f
    return c == 32 or (9 <= c <= 13)


cdef inline int _sc_read(int dirfd, const char *name, char *buf, Py_ssize_t *n) noexcept nogil:
    return _sc_read_cap(dirfd, name, buf, n, SC_READ_MAX)


cdef int _sc_read_cap(int dirfd, const char *name, char *buf, Py_ssize_t *n, Py_ssize_t cap) noexcept nogil:
    """Read and strip a small attribute into buf (at least cap + 1 bytes); 0, an errno, or SC_EMPTY."""
    cdef int fd = sc_openat(dirfd, name, SC_FILE_FLAGS)
    cdef ssize_t got
    cdef Py_ssize_t start = 0, end
    n[0] = 0
    if fd < 0:
        return errno if errno else 1
    got = sc_read(fd, buf, cap)
    if got < 0:
        end = errno
        sc_close(fd)
        return end if end else 1
    sc_close(fd)
    end = got
    while end > 0 and _sc_space(buf[end - 1]):
        end -= 1
    while start < end and _sc_space(buf[start]):
        start += 1
    if start == end:
        return SC_EMPTY
    if start:
        memcpy(buf, buf + start, end - start)
    n[0] = end - start
    buf[n[0]] = 0
    return 0


cdef int _sc_readlink(int dirfd, const char *name, char *buf, Py_ssize_t *n) noexcept nogil:
    cdef ssize_t got = sc_readlinkat(dirfd, name, buf, SC_LINK_MAX - 1)
    n[0] = 0
    if got < 0:
        return errno if errno else 1
    buf[got] = 0
    n[0] = got
    return 0


cdef inline Py_ssize_t _sc_base(const char *buf, Py_ssize_t n) noexcept nogil:
    """Offset of the basename (after the last '/')."""
    cdef Py_ssize_t i = n
    while i > 0 and buf[i - 1] != 47:
        i -= 1
    return i


cdef bint _sc_int(const char *buf, Py_ssize_t n, long *out) noexcept nogil:
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


cdef bint _sc_hex(char *buf, Py_ssize_t n, int digits) noexcept nogil:
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


cdef inline bint _sc_is_hex(char *buf, Py_ssize_t n) noexcept nogil:
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


cdef inline bint _sc_pair(char *buf, Py_ssize_t n) noexcept nogil:
    """``15B3:101E``: two groups of four hex digits around a colon (lower-cased in place)."""
    return n == 9 and buf[4] == 58 and _sc_is_hex(buf, 4) and _sc_is_hex(buf + 5, 4)


cdef bint _sc_contains(const char *buf, Py_ssize_t n, const char *sub, Py_ssize_t m) noexcept nogil:
    """``sub in buf`` over lengths (a driver name read from a file may hold any byte)."""
    cdef Py_ssize_t i
    for i in range(n - m + 1):
        if memcmp(buf + i, sub, m) == 0:
            return True
    return False


# ------------------------------------------------------------------ directory listings without the GIL

cdef struct sc_names:
    # A sorted directory listing as C strings.
    char *data            # the names, NUL-terminated, back to back
    Py_ssize_t used
    Py_ssize_t cap
    Py_ssize_t *offs      # where each name starts in data (data moves while it grows)
    char **names          # count pointers into data, sorted once the listing is complete
    Py_ssize_t count
    Py_ssize_t ncap
    bint oom
    bint unsorted         # set before listing: leave the names in directory order


cdef int _sc_cmp(const void *a, const void *b) noexcept nogil:
    # Directory entries hold no NUL, and strcmp compares as unsigned char: the order of sorted(bytes).
    return strcmp((<const char **>a)[0], (<const char **>b)[0])


cdef bint _sc_names_add(sc_names *l, const char *nm, Py_ssize_t ln) noexcept nogil:
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


cdef void _sc_names_fill(sc_names *l, int fd) noexcept nogil:
    """List an open directory (fd is consumed) into l, sorted; '.' and '..' left out.

    getdents64 straight into a stack buffer: no DIR allocation and no fcntl as fdopendir would cost.
    """
    cdef char buf[SC_DENTS_BUF]
    cdef long got, pos
    cdef Py_ssize_t i
    cdef sc_dirent64 *e
    cdef const char *nm
    l.used = 0
    l.count = 0
    while True:
        got = sc_syscall(SC_SYS_getdents64, fd, buf, SC_DENTS_BUF)
        if got <= 0:
            break
        pos = 0
        while pos < got:
            e = <sc_dirent64 *>(buf + pos)
            pos += e.d_reclen
            nm = e.d_name
            if nm[0] == 46 and (nm[1] == 0 or (nm[1] == 46 and nm[2] == 0)):
                continue
            if not _sc_names_add(l, nm, strlen(nm)):
                break
        # fs/readdir.c: getdents64 fills the buffer until the next record does not fit or the
        # directory ends (kernfs, ext4 and tmpfs all emit until full), so a reply with room left
        # for a maximal record is the end: skip the extra call that would return 0.
        if l.oom or got < SC_DENTS_BUF - SC_DIRENT_MAX:
            break
    sc_close(fd)
    for i in range(l.count):
        l.names[i] = l.data + l.offs[i]
    if l.count > 1 and not l.unsorted:
        qsort(l.names, l.count, sizeof(char *), _sc_cmp)


cdef void _sc_names_open(sc_names *l, int dirfd, const char *name) noexcept nogil:
    """List a subdirectory into l; empty when it is absent or unreadable."""
    cdef int fd = sc_openat(dirfd, name, SC_DIR_FLAGS)
    l.used = 0
    l.count = 0
    if fd >= 0:
        _sc_names_fill(l, fd)


cdef void _sc_names_free(sc_names *l) noexcept nogil:
    free(l.data)
    free(l.offs)
    free(l.names)
    memset(l, 0, sizeof(sc_names))


cdef list _sc_names_list(sc_names *l):
    """The listing as a list of bytes; raises MemoryError if it could not be held."""
    cdef Py_ssize_t i
    if l.oom:
        raise MemoryError("sysfs scan: out of memory listing a directory")
    return [PyBytes_FromStringAndSize(l.names[i], strlen(l.names[i])) for i in range(l.count)]


cdef list _sc_entries_fd(int fd):
    """Sorted entries of an open directory (fd is consumed); '.' and '..' left out."""
    cdef sc_names l
    memset(&l, 0, sizeof(sc_names))
    try:
        with nogil:
            _sc_names_fill(&l, fd)
        return _sc_names_list(&l)
    finally:
        _sc_names_free(&l)


cdef list _sc_listdir(int dirfd, const char *name):
    cdef sc_names l
    memset(&l, 0, sizeof(sc_names))
    try:
        with nogil:
            _sc_names_open(&l, dirfd, name)
        return _sc_names_list(&l)
    finally:
        _sc_names_free(&l)


cdef int _sc_open_dir(int dirfd, const char *name) noexcept nogil:
    return sc_openat(dirfd, name, SC_DIR_FLAGS)


# ------------------------------------------------------------------ Python objects (GIL held)

cdef inline str _sc_str(const char *buf, Py_ssize_t n):
    # os.fsdecode on Linux: UTF-8 with surrogateescape
    return PyUnicode_DecodeUTF8(buf, n, "surrogateescape")


def _sc_why(int status):
    if status == SC_EMPTY:
        return "empty"
    if status == ENOENT:
        return "missing"
    return f"unreadable ({_sc_os.strerror(status)})"
