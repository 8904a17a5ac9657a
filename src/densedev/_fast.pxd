# Shared declarations of densedev._fast: the C structs and enums its includes (_pyx/*.pxi) share, the
# syscalls they make and the inline helpers around them.  Each kernel struct is quoted once, here.

from libc.errno cimport errno
from libc.stdint cimport int32_t, uint8_t, uint16_t, uint32_t


# ------------------------------------------------------------------ syscalls (sysio.pxi)

cdef extern from "<fcntl.h>" nogil:
    int openat(int dirfd, const char *path, int flags, ...)
    enum:
        O_RDONLY
        O_DIRECTORY
        O_CLOEXEC

cdef extern from "<unistd.h>" nogil:
    ssize_t read(int fd, void *buf, size_t count)
    int close(int fd)
    ssize_t readlinkat(int dirfd, const char *path, char *buf, size_t size)
    int dup(int fd)

cdef extern from "<poll.h>" nogil:
    struct pollfd:
        int fd
        short events
        short revents
    int poll(pollfd *fds, unsigned long nfds, int timeout)
    enum:
        POLLIN

cdef extern from "<sys/syscall.h>" nogil:
    long syscall(long number, ...)
    enum:
        SYS_getdents64

# include/linux/dirent.h:
#   struct linux_dirent64 { u64 d_ino; s64 d_off; unsigned short d_reclen; unsigned char d_type;
#                            char d_name[]; };
cdef struct linux_dirent64:
    unsigned long long d_ino
    long long d_off
    unsigned short d_reclen
    unsigned char d_type
    char d_name[1]

cdef enum:
    DIR_FLAGS = O_RDONLY | O_DIRECTORY | O_CLOEXEC
    FILE_FLAGS = O_RDONLY | O_CLOEXEC
    READ_MAX = 255      # one short attribute line, as the twin's os.read(fd, 255)
    LINK_MAX = 4096     # PATH_MAX: sysfs link targets are far shorter
    EMPTY = -2          # status of an attribute that exists but holds only whitespace
    UNREAD = -3         # status of an attribute this device does not need read
    MAX_PARTS = 128
    UEVENT_MAX = 1023   # a PCI device's uevent is ~150 bytes (DRIVER, PCI_*, MODALIAS)
    DENTS_BUF = 32768   # one getdents64 call returns a whole device directory
    DIRENT_MAX = 280    # largest linux_dirent64: 19-byte header + 255-byte name + NUL, 8-aligned
    FILE_NAME_MAX = 255
    YIELD_ROWS = 1023   # a GIL hand-over point every 1,024 rows of the whole-table loops


# ------------------------------------------------------------------ rtnetlink (netlink.pxi)

# <linux/netlink.h>
#   struct nlmsghdr {
#       __u32 nlmsg_len;    /* Length of message including header */
#       __u16 nlmsg_type;   /* Message content */
#       __u16 nlmsg_flags;  /* Additional flags */
#       __u32 nlmsg_seq;    /* Sequence number */
#       __u32 nlmsg_pid;    /* Sending process port ID */
#   };
cdef struct nlmsghdr:
    uint32_t nlmsg_len
    uint16_t nlmsg_type
    uint16_t nlmsg_flags
    uint32_t nlmsg_seq
    uint32_t nlmsg_pid

# <linux/rtnetlink.h>
#   struct ifinfomsg {
#       unsigned char  ifi_family;
#       unsigned char  __ifi_pad;
#       unsigned short ifi_type;    /* ARPHRD_* */
#       int            ifi_index;   /* Link index */
#       unsigned       ifi_flags;   /* IFF_* flags */
#       unsigned       ifi_change;  /* IFF_* change mask */
#   };
cdef struct ifinfomsg:
    uint8_t ifi_family
    uint8_t ifi_pad
    uint16_t ifi_type
    int32_t ifi_index
    uint32_t ifi_flags
    uint32_t ifi_change

#   struct rtattr {
#       unsigned short rta_len;
#       unsigned short rta_type;
#   };
cdef struct rtattr:
    uint16_t rta_len
    uint16_t rta_type

# Netlink constants as a C enum (as uvloop declares its socket constants): the values are the
# kernel's ABI, include/uapi/linux/rtnetlink.h (RTM_*) and if_link.h (IFLA_*).
cdef enum:
    RTM_NEWLINK = 16
    RTM_DELLINK = 17
    IFLA_IFNAME = 3
    IFLA_LINK = 5
    IFLA_OPERSTATE = 16
    IFLA_CARRIER = 33

cdef enum:
    # include/uapi/linux/if_arp.h
    ARPHRD_ETHER = 1
    ARPHRD_INFINIBAND = 32


# ------------------------------------------------------------------ threads (workq.pxi)

cdef extern from "<pthread.h>" nogil:
    ctypedef unsigned long pthread_t
    int pthread_create(pthread_t *t, const void *attr, void *(*start)(void *) noexcept nogil, void *arg)
    int pthread_join(pthread_t t, void **ret)

cdef extern from "<sched.h>" nogil:
    int sched_yield()

cdef extern from *:
    """
    static inline Py_ssize_t fetch_add(Py_ssize_t *p) { return __atomic_fetch_add(p, 1, __ATOMIC_RELAXED); }
    static inline void mark_done(int *p) { __atomic_store_n(p, 1, __ATOMIC_RELEASE); }
    static inline int is_done(int *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
    static inline void store_relaxed(Py_ssize_t *p, Py_ssize_t v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
    """
    Py_ssize_t fetch_add(Py_ssize_t *p) nogil
    void mark_done(int *p) nogil
    int is_done(int *p) nogil
    void store_relaxed(Py_ssize_t *p, Py_ssize_t v) nogil

ctypedef void (*work_fn)(void *ctx, Py_ssize_t i) noexcept nogil

cdef enum:
    MAX_HELPERS = 3

cdef struct workq:
    # n items of ctx, each taken once by whoever is free (see workq.pxi)
    work_fn run            # does item i of ctx
    void *ctx
    Py_ssize_t n
    Py_ssize_t next        # the next item nobody has taken
    int *done              # NULL, or one flag per item, set once it is done (for in-order consumers)
    int started            # helper threads running
    pthread_t threads[MAX_HELPERS]


# ------------------------------------------------------------------ listings and class maps (sysio, classmap)

cdef struct dirlist:
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


cdef enum:
    CLS_VERBS = 0       # the order of _CLASSES
    CLS_MAD = 1
    CLS_CM = 2
    CLS_NET = 3
    CLS_IB = 4
    CLS_COUNT = 5
    MAP_DRIVERS = 5         # after the classes: (device address, driver) from the driver directories
    MAP_COUNT = 6


cdef struct centry:
    # One class device: the function that owns it and its name, NUL-terminated in the map's arena
    # (offsets while the arena grows, pointers once sealed).
    Py_ssize_t owner_at
    Py_ssize_t name_at
    const char *owner
    const char *name
    unsigned long long k0  # the owner's first 16 bytes, big-endian and NUL-padded: most comparisons
    unsigned long long k1  # while sorting end here (a PCI address is 12 bytes)


cdef struct cmap:
    # One class directory as (owner, name) pairs sorted by owner then name: the twin's _class_map,
    # looked up by binary search instead of a dict of lists (no Python object per class device).
    centry *e
    Py_ssize_t n
    Py_ssize_t cap
    char *arena
    Py_ssize_t used
    Py_ssize_t acap
    Py_ssize_t hint        # where the last lookup ended: rows are built in the map's (address) order


cdef enum:
    AHEAD_LINK_MAX = 256   # a class link target read ahead ("../../devices/.../uverbs3"); longer: re-read
    AHEAD_BATCH = 4096     # class links read ahead at once (~270 bytes each)
    AHEAD_SHARED = 64      # fewer links than this are read by this thread alone (a thread costs more)
    LINK_LONG = -4         # status of a link longer than AHEAD_LINK_MAX: read again with room for PATH_MAX


cdef struct link_ahead:
    # One link to read ahead (a work queue item): where, and what it says.
    int dirfd
    const char *name
    int status
    Py_ssize_t n
    char buf[AHEAD_LINK_MAX]


# ------------------------------------------------------------------ inline syscall helpers

cdef inline bint is_space(char c) noexcept nogil:
    # bytes.strip() whitespace: space \t \n \r \v \f
    return c == 32 or (9 <= c <= 13)


cdef inline int read_link(int dirfd, const char *name, char *buf, Py_ssize_t *n) noexcept nogil:
    # readlinkat into buf (LINK_MAX bytes), NUL-terminated; 0 or an errno.
    cdef ssize_t got = readlinkat(dirfd, name, buf, LINK_MAX - 1)
    n[0] = 0
    if got < 0:
        return errno if errno else 1
    buf[got] = 0
    n[0] = got
    return 0


cdef inline Py_ssize_t basename_at(const char *buf, Py_ssize_t n) noexcept nogil:
    """Offset of the basename (after the last '/')."""
    cdef Py_ssize_t i = n
    while i > 0 and buf[i - 1] != 47:
        i -= 1
    return i


cdef inline int open_dir(int dirfd, const char *name) noexcept nogil:
    # A directory fd (the scan reaches everything relative to one), or -1 with errno set.
    return openat(dirfd, name, DIR_FLAGS)
