# Class maps: which function owns each class device (netdev, RDMA device and node), each driver's
# devices and vDPA parents, read once per scan from the class, driver and bus directories.

from libc.string cimport strlen, memchr, memcmp, memcpy, memset, strcmp
from libc.stdlib cimport calloc, malloc, realloc, free, qsort

_RDMA_CLASSES = (b"infiniband_verbs", b"infiniband_mad", b"infiniband_cm")
_CLASSES = _RDMA_CLASSES + (b"net", b"infiniband")  # the order of CLS_*


cdef bint class_owner(const char *buf, Py_ssize_t n, const char *c, Py_ssize_t cn,
                          Py_ssize_t *at, Py_ssize_t *ln) noexcept nogil:
    """``../../devices/.../<function>/<cls>/<node>`` → where ``<function>`` is; False for other shapes."""
    cdef Py_ssize_t end = n, i, j, k, e2, e3
    while end > 0 and buf[end - 1] == 47:
        end -= 1
    i = end
    while i > 0 and buf[i - 1] != 47:
        i -= 1
    if i == 0:
        return False
    e2 = i - 1
    j = e2
    while j > 0 and buf[j - 1] != 47:
        j -= 1
    if j == 0 or e2 - j != cn or memcmp(buf + j, c, cn) != 0:
        return False
    e3 = j - 1
    k = e3
    while k > 0 and buf[k - 1] != 47:
        k -= 1
    # A netdev below ``<function>/virtio<N>/`` (or ``<function>/vdpa<N>/virtio<M>/``) is the function's:
    # see the twin's _class_owner.  Only a class/net link named so takes the extra steps.
    if cn == 3 and memcmp(c, b"net", 3) == 0 and k > 0 and numbered(buf + k, e3 - k, b"virtio", 6):
        e3 = k - 1
        k = e3
        while k > 0 and buf[k - 1] != 47:
            k -= 1
        if k > 0 and numbered(buf + k, e3 - k, b"vdpa", 4):
            e3 = k - 1
            k = e3
            while k > 0 and buf[k - 1] != 47:
                k -= 1
    at[0] = k
    ln[0] = e3 - k
    return e3 > k


cdef inline bint numbered(const char *s, Py_ssize_t n, const char *prefix, Py_ssize_t pn) noexcept nogil:
    """Whether ``s[:n]`` is ``prefix`` followed by decimal digits (``virtio2``, ``vdpa0``)."""
    cdef Py_ssize_t i
    if n <= pn or memcmp(s, prefix, pn) != 0:
        return False
    for i in range(pn, n):
        if s[i] < 48 or s[i] > 57:
            return False
    return True


# ------------------------------------------------------------------ class maps, in C

cdef bint cmap_add(cmap *m, const char *owner, Py_ssize_t on, const char *name,
                       Py_ssize_t nn) noexcept nogil:
    """Record one class device; False when out of memory."""
    cdef Py_ssize_t cap, need = on + nn + 2
    cdef void *p
    if m.n == m.cap:
        cap = 2 * m.cap if m.cap else 1024
        p = realloc(m.e, cap * sizeof(centry))
        if p == NULL:
            return False
        m.e = <centry *>p
        m.cap = cap
    if m.used + need > m.acap:
        cap = 2 * m.acap if m.acap else 65536
        while cap < m.used + need:
            cap *= 2
        p = realloc(m.arena, cap)
        if p == NULL:
            return False
        m.arena = <char *>p
        m.acap = cap
    m.e[m.n].owner_at = m.used
    memcpy(m.arena + m.used, owner, on)
    m.arena[m.used + on] = 0
    m.used += on + 1
    m.e[m.n].name_at = m.used
    memcpy(m.arena + m.used, name, nn)
    m.arena[m.used + nn] = 0
    m.used += nn + 1
    m.n += 1
    return True


cdef int centry_cmp(const void *a, const void *b) noexcept nogil:
    # strcmp order of (owner, name): NUL-padded big-endian prefixes compare as strcmp does, and when
    # both are equal either both owners end within them (equal) or the rest decides.
    cdef const centry *x = <const centry *>a
    cdef const centry *y = <const centry *>b
    cdef int c
    if x.k0 != y.k0:
        return -1 if x.k0 < y.k0 else 1
    if x.k1 != y.k1:
        return -1 if x.k1 < y.k1 else 1
    c = strcmp(x.owner + 16, y.owner + 16) if x.k1 & 0xFF else 0
    return c if c != 0 else strcmp(x.name, y.name)


cdef void centry_key(centry *e) noexcept nogil:
    cdef unsigned long long k0 = 0, k1 = 0
    cdef int j = 0
    cdef const unsigned char *o = <const unsigned char *>e.owner
    while j < 8 and o[j] != 0:
        k0 |= (<unsigned long long>o[j]) << (56 - 8 * j)
        j += 1
    if j == 8:
        while j < 16 and o[j] != 0:
            k1 |= (<unsigned long long>o[j]) << (120 - 8 * j)
            j += 1
    e.k0 = k0
    e.k1 = k1


cdef void cmap_seal(cmap *m) noexcept nogil:
    """Turn offsets into pointers and sort: owners together, each one's names in bytes order."""
    cdef Py_ssize_t i
    for i in range(m.n):
        m.e[i].owner = m.arena + m.e[i].owner_at
        m.e[i].name = m.arena + m.e[i].name_at
        centry_key(&m.e[i])
    if m.n > 1:
        qsort(m.e, m.n, sizeof(centry), centry_cmp)


cdef void seal_item(void *maps, Py_ssize_t i) noexcept nogil:
    """Work queue item: seal class map i."""
    cmap_seal(&(<cmap *>maps)[i])


cdef Py_ssize_t cmap_find(cmap *m, const char *owner, Py_ssize_t *end) noexcept nogil:
    """The first entry of ``owner`` in a sealed map (-1 if none); ``end`` gets one past its last.

    Lookups come in address order while rows are built, so the search starts where the last one
    ended when the owner sorts after it, and within the next few entries when it sorts before them.
    Not thread-safe (the hint): the scanning thread alone looks up.
    """
    cdef Py_ssize_t lo = 0, hi = m.n, mid, h = m.hint
    if 0 < h <= m.n and strcmp(m.e[h - 1].owner, owner) < 0:
        lo = h
        if h + 8 < m.n and strcmp(m.e[h + 8].owner, owner) >= 0:
            hi = h + 8
    while lo < hi:
        mid = (lo + hi) >> 1
        if strcmp(m.e[mid].owner, owner) < 0:
            lo = mid + 1
        else:
            hi = mid
    if lo == m.n or strcmp(m.e[lo].owner, owner) != 0:
        m.hint = lo
        return -1
    hi = lo + 1
    while hi < m.n and strcmp(m.e[hi].owner, owner) == 0:
        hi += 1
    end[0] = hi
    m.hint = hi
    return lo


cdef void cmap_free(cmap *m) noexcept nogil:
    free(m.e)
    free(m.arena)
    memset(m, 0, sizeof(cmap))


cdef dict vdpa_map(int rootfd):
    cdef dict out = {}
    cdef int bfd
    cdef char buf[LINK_MAX]
    cdef Py_ssize_t n, b
    cdef int status
    cdef bytes entry, parent, path
    cdef const char *cpath
    with nogil:
        bfd = open_dir(rootfd, "bus/vdpa/devices")
    if bfd < 0:
        return out
    try:
        for entry in entries_fd(dup(bfd)):
            cpath = entry
            with nogil:
                status = read_link(bfd, cpath, buf, &n)
            if status != 0:
                continue
            parent = parent_of(buf, n)
            if parent in out:
                continue
            path = entry + b"/driver"
            cpath = path
            with nogil:
                status = read_link(bfd, cpath, buf, &n)
            if status == 0:
                b = basename_at(buf, n)
                drv = fs_str(buf + b, n - b)
            else:
                drv = ""
            out[parent] = (_os.fsdecode(entry), drv)
    finally:
        close(bfd)
    return out


cdef void link_ahead_item(void *items, Py_ssize_t i) noexcept nogil:
    """Work queue item: read link i."""
    link_ahead_read(&(<link_ahead *>items)[i])


cdef void link_ahead_read(link_ahead *r) noexcept nogil:
    cdef ssize_t got = readlinkat(r.dirfd, r.name, r.buf, AHEAD_LINK_MAX)
    if got < 0:
        r.status = errno if errno else 1
    elif got >= AHEAD_LINK_MAX:
        r.status = LINK_LONG
    else:
        r.status = 0
        r.n = got


cdef struct list_jobs:
    # Directories to list side by side: each path is opened relative to its fd, listed into out.
    int *fds
    const char **paths
    dirlist *out


cdef void list_item(void *jobs, Py_ssize_t i) noexcept nogil:
    """Work queue item: list directory i."""
    cdef list_jobs *b = <list_jobs *>jobs
    dirlist_open(&b.out[i], b.fds[i], b.paths[i])


cdef void list_dirs(list dirs, int helpers, dirlist *out) except *:
    """List several directories, each ``(dirfd, path, sort)``, into ``out`` (one each, freed by the
    caller), by this thread and helpers.

    The big listings of a scan (the bus, each class and each driver: one entry per device) cost a
    getdents64 pass over thousands of dentries each; listed side by side they take half the time.
    They stay C strings: a class's or driver's entries are only read back in C (16k Python bytes per
    listing would hold the GIL for milliseconds).  An absent or unreadable directory lists as empty.
    """
    cdef list_jobs b
    cdef workq q
    cdef Py_ssize_t i, n = len(dirs)
    b.out = out
    b.fds = <int *>malloc((n + 1) * sizeof(int))
    b.paths = <const char **>malloc((n + 1) * sizeof(char *))
    try:
        if b.fds == NULL or b.paths == NULL:
            raise MemoryError("sysfs scan: out of memory")
        for i in range(n):
            b.fds[i] = <int>dirs[i][0]
            b.paths[i] = <bytes>dirs[i][1]  # kept alive by ``dirs``
            b.out[i].unsorted = not dirs[i][2]
        with nogil:
            workq_init(&q, list_item, &b, n, NULL)
            workq_run(&q, helpers)
        for i in range(n):
            if b.out[i].oom:
                raise MemoryError("sysfs scan: out of memory listing a directory")
    finally:
        free(b.paths)
        free(b.fds)


cdef void driver_map(cmap *m, list drivers, dirlist *lists) except *:
    """(address, driver) for every device link in each driver's listing into ``m`` (the twin's
    _driver_map, where two drivers claiming one device make it b"": here it has two entries)."""
    cdef Py_ssize_t i, e, n, dn
    cdef const char *driver
    cdef const char *name
    cdef bint ok = True
    for i in range(len(drivers)):
        driver = <bytes>drivers[i]
        dn = len(<bytes>drivers[i])
        with nogil:
            for e in range(lists[i].count):
                name = lists[i].names[e]
                n = strlen(name)
                # ':' – a device link, not one of the driver core's bind/unbind/new_id/uevent/module
                if memchr(name, 58, n) != NULL and not cmap_add(m, name, n, driver, dn):
                    ok = False
                    break
        if not ok:
            raise MemoryError("sysfs scan: out of memory")


cdef list read_classes(int rootfd, cmap *cmaps, int helpers, int *gate, int busfd):
    """Fill ``cmaps`` (MAP_COUNT maps) with every class map of the scan (the twin's _rdma_map and
    _class_map), their links read in parallel by this thread and up to ``helpers`` more (once ``gate``
    is open: see gated).

    One readlink per class device names the function that owns it; with ~4 class devices per RDMA VF
    (netdev, ibdev, uverbs, umad) these links are a third of the scan, so the helpers read them ahead
    while this thread adds each one read to its class's C map (sealed, that is sorted, at the end),
    and reads too whenever the next one it needs is not ready; all of it without the GIL.  The class
    directories are listed side by side with the bus and every driver (``busfd``, unless it is -1 for
    a partial scan): the bus's sorted entries are returned (None without it) and the drivers' device
    links fill the MAP_DRIVERS map (the twin's _driver_map).
    """
    cdef char big[LINK_MAX]
    cdef Py_ssize_t n, i, total = 0, pos, fill_e, entry_i, nlists = 0
    cdef int fill_j, job_i, njobs = 0
    cdef int cfd = -1
    cdef bint ok, oom = False
    cdef bytes cls_path
    cdef const char *cpath
    cdef const char *buf
    cdef Py_ssize_t at, ln
    cdef int k
    cdef link_ahead *items = NULL
    cdef int *done = NULL
    cdef link_ahead *r
    cdef workq q
    # Each class directory that opened: its fd, its CLS_* and its name (for class_owner).
    cdef int job_fd[CLS_COUNT]
    cdef int job_kind[CLS_COUNT]
    cdef const char *job_cls[CLS_COUNT]
    cdef Py_ssize_t job_cn[CLS_COUNT]
    cdef dirlist *lists = NULL  # the listings: one per class job, then the bus, then each driver
    cdef list bus_names = None
    try:
        for k in range(CLS_COUNT):
            cls_path = b"class/" + _CLASSES[k]
            cpath = cls_path
            with nogil:
                cfd = open_dir(rootfd, cpath)
            if cfd >= 0:
                job_fd[njobs] = cfd
                job_kind[njobs] = k
                job_cls[njobs] = <bytes>_CLASSES[k]  # module-level constants: alive for good
                job_cn[njobs] = len(<bytes>_CLASSES[k])
                njobs += 1
        # Only the bus is needed in order (a PF before its VFs); the class and driver maps sort their
        # own pairs.
        dirs = [(job_fd[j], b".", False) for j in range(njobs)]
        drivers = []
        if busfd >= 0:
            dirs.append((busfd, b".", True))
            drivers = listdir_at(rootfd, "bus/pci/drivers")
            dirs.extend([(rootfd, b"bus/pci/drivers/" + d, False) for d in drivers])
        lists = <dirlist *>calloc(len(dirs) + 1, sizeof(dirlist))
        if lists == NULL:
            raise MemoryError("sysfs scan: out of memory")
        nlists = len(dirs)
        list_dirs(dirs, gated(helpers, gate), lists)
        if busfd >= 0:
            bus_names = dirlist_bytes(&lists[njobs])
            driver_map(&cmaps[MAP_DRIVERS], drivers, lists + njobs + 1)
        for j in range(njobs):
            total += lists[j].count
        items = <link_ahead *>malloc((total if total < AHEAD_BATCH else AHEAD_BATCH) * sizeof(link_ahead) + 1)
        done = <int *>malloc((total if total < AHEAD_BATCH else AHEAD_BATCH) * sizeof(int) + 1)
        if items == NULL or done == NULL:
            raise MemoryError("sysfs scan: out of memory")
        with nogil:
            # All classes' links in one sequence, in chunks; (fill_j, fill_e) fills, (job_i, entry_i)
            # adds to the maps.  The names point into the listings, which outlive the loop.
            fill_j = job_i = 0
            fill_e = entry_i = 0
            pos = 0
            while pos < total and not oom:
                n = total - pos if total - pos < AHEAD_BATCH else AHEAD_BATCH
                for i in range(n):
                    while fill_e >= lists[fill_j].count:
                        fill_j += 1
                        fill_e = 0
                    items[i].dirfd = job_fd[fill_j]
                    items[i].name = lists[fill_j].names[fill_e]
                    fill_e += 1
                workq_init(&q, link_ahead_item, items, n, done)
                workq_start(&q, gated(helpers, gate) if n >= AHEAD_SHARED else 0)
                for i in range(q.n):
                    while entry_i >= lists[job_i].count:
                        job_i += 1
                        entry_i = 0
                    entry_i += 1
                    r = &items[i]
                    workq_wait(&q, i)
                    buf = r.buf
                    n = r.n
                    if r.status == LINK_LONG:
                        r.status = read_link(job_fd[job_i], r.name, big, &n)
                        buf = big
                    # A uverbs/umad/issm/ucm class device's parent is its ib_device's parent, the
                    # function itself (uverbs_main.c ib_uverbs_add_one, user_mad.c, ucma).
                    ok = r.status == 0 and class_owner(buf, n, job_cls[job_i], job_cn[job_i], &at, &ln)
                    if ok and not cmap_add(&cmaps[job_kind[job_i]], buf + at, ln, r.name, strlen(r.name)):
                        oom = True
                        break
                workq_stop(&q)
                pos += q.n
        if oom:
            raise MemoryError("sysfs scan: out of memory")
        with nogil:
            # Each map sorts its own few thousand pairs: sealed side by side, as the directories were listed.
            workq_init(&q, seal_item, cmaps, MAP_COUNT, NULL)
            workq_run(&q, gated(helpers, gate))
    finally:
        free(items)
        free(done)
        if lists != NULL:
            for i in range(nlists):
                dirlist_free(&lists[i])
            free(lists)
        for j in range(njobs):
            close(job_fd[j])
    return bus_names
