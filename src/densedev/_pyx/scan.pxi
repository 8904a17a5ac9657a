# The sysfs scan of PCI functions, subfunctions and RDMA ports; the twin is _fast_py/scan.py (the spec,
# and where the kernel facts behind each shortcut are written down).
#
# Every file and link is reached relative to an open directory fd (openat/readlinkat), read into a C
# buffer and parsed in C.  The scan is syscall-bound, so the syscalls run without the GIL and, where
# there are many independent ones, on more than one thread: the big directory listings (the bus and
# each class), the class links (one per netdev, RDMA device and RDMA node), a PF's virtfn links and
# runs of VFs are read ahead by this thread and up to three helper pthreads taking the next item each
# (the one work queue of workq.pxi, used by list_dirs, read_classes, virtfns and _VfReader), while
# this thread turns what is read into maps and rows in order with the GIL.  The daemon runs the full scan in a worker thread
# (asyncio.to_thread), so the event loop keeps running meanwhile.  Warnings are built with the same
# Python expressions as the twin so both return identical strings.

from libc.errno cimport errno, ENOENT
from libc.string cimport strlen, memchr, memcmp, memcpy, memset, strcmp
from libc.stdlib cimport calloc, malloc, realloc, free, qsort
from libc.stdio cimport snprintf
from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.list cimport PyList_New, PyList_SET_ITEM
from cpython.ref cimport Py_INCREF
from cpython.unicode cimport PyUnicode_DecodeUTF8, PyUnicode_DecodeASCII


from .model import Device as _Device

cdef extern from "Python.h":
    int PyGC_Disable()
    int PyGC_Enable()
    void PyObject_GC_UnTrack(object op)

cdef const char *HEX_DIGITS = b"0123456789abcdef"


# ------------------------------------------------------------------ rows: densedev.model.Device

cdef object _DEVICE = _Device  # a C global: no module dict lookup per row
# Where each field of a Device is, looked up by name: the field order is the model's alone.
cdef Py_ssize_t DEV_FIELDS = len(_Device._fields)
cdef Py_ssize_t DEV_ID = _Device._fields.index("id")
cdef Py_ssize_t DEV_ROLE = _Device._fields.index("role")
cdef Py_ssize_t DEV_VENDOR = _Device._fields.index("vendor")
cdef Py_ssize_t DEV_DEVICE = _Device._fields.index("device")
cdef Py_ssize_t DEV_PCI_CLASS = _Device._fields.index("pci_class")
cdef Py_ssize_t DEV_SUBSYSTEM_VENDOR = _Device._fields.index("subsystem_vendor")
cdef Py_ssize_t DEV_SUBSYSTEM_DEVICE = _Device._fields.index("subsystem_device")
cdef Py_ssize_t DEV_DRIVER = _Device._fields.index("driver")
cdef Py_ssize_t DEV_NUMA_NODE = _Device._fields.index("numa_node")
cdef Py_ssize_t DEV_IOMMU_GROUP = _Device._fields.index("iommu_group")
cdef Py_ssize_t DEV_NOIOMMU = _Device._fields.index("noiommu")
cdef Py_ssize_t DEV_ACPI_INDEX = _Device._fields.index("acpi_index")
cdef Py_ssize_t DEV_TOTAL_VFS = _Device._fields.index("total_vfs")
cdef Py_ssize_t DEV_NUM_VFS = _Device._fields.index("num_vfs")
cdef Py_ssize_t DEV_PF = _Device._fields.index("pf")
cdef Py_ssize_t DEV_VF_INDEX = _Device._fields.index("vf_index")
cdef Py_ssize_t DEV_PF_NETDEV = _Device._fields.index("pf_netdev")
cdef Py_ssize_t DEV_NETDEVS = _Device._fields.index("netdevs")
cdef Py_ssize_t DEV_LINK_TYPE = _Device._fields.index("link_type")
cdef Py_ssize_t DEV_RDMA_DEVICE = _Device._fields.index("rdma_device")
cdef Py_ssize_t DEV_RDMA_NODES = _Device._fields.index("rdma_nodes")
cdef Py_ssize_t DEV_UIO = _Device._fields.index("uio")
cdef Py_ssize_t DEV_VDPA = _Device._fields.index("vdpa")
cdef Py_ssize_t DEV_VDPA_DRIVER = _Device._fields.index("vdpa_driver")
cdef Py_ssize_t DEV_PCIE_ROOT = _Device._fields.index("pcie_root")
cdef Py_ssize_t DEV_AUX_TYPE = _Device._fields.index("aux_type")
if DEV_FIELDS != 26:
    # new_row fills the 26 fields above: a field the model gained would be a NULL slot.
    raise ImportError(f"densedev.model.Device has {DEV_FIELDS} fields; the scan fills 26: update new_row")


cdef inline void put_item(list row, Py_ssize_t i, object value):
    Py_INCREF(value)  # PyList_SET_ITEM steals a reference
    PyList_SET_ITEM(row, i, value)


cdef list new_row(object id, object role, object vendor, object device, object pci_class,
                  object subsystem_vendor, object subsystem_device, object driver, object numa_node,
                  object iommu_group, object noiommu, object acpi_index, object total_vfs, object num_vfs,
                  object pf, object vf_index, object pf_netdev, object netdevs, object link_type,
                  object rdma_device, object rdma_nodes, object uio, object vdpa, object vdpa_driver,
                  object pcie_root, object aux_type):
    """One device's fields, by name, as a list in Device field order (the twin's Device(...)).

    A list so the pass after the scan can fill in what a VF takes from its PF; as_device makes it a
    Device once complete.
    """
    cdef list row = PyList_New(DEV_FIELDS)
    put_item(row, DEV_ID, id)
    put_item(row, DEV_ROLE, role)
    put_item(row, DEV_VENDOR, vendor)
    put_item(row, DEV_DEVICE, device)
    put_item(row, DEV_PCI_CLASS, pci_class)
    put_item(row, DEV_SUBSYSTEM_VENDOR, subsystem_vendor)
    put_item(row, DEV_SUBSYSTEM_DEVICE, subsystem_device)
    put_item(row, DEV_DRIVER, driver)
    put_item(row, DEV_NUMA_NODE, numa_node)
    put_item(row, DEV_IOMMU_GROUP, iommu_group)
    put_item(row, DEV_NOIOMMU, noiommu)
    put_item(row, DEV_ACPI_INDEX, acpi_index)
    put_item(row, DEV_TOTAL_VFS, total_vfs)
    put_item(row, DEV_NUM_VFS, num_vfs)
    put_item(row, DEV_PF, pf)
    put_item(row, DEV_VF_INDEX, vf_index)
    put_item(row, DEV_PF_NETDEV, pf_netdev)
    put_item(row, DEV_NETDEVS, netdevs)
    put_item(row, DEV_LINK_TYPE, link_type)
    put_item(row, DEV_RDMA_DEVICE, rdma_device)
    put_item(row, DEV_RDMA_NODES, rdma_nodes)
    put_item(row, DEV_UIO, uio)
    put_item(row, DEV_VDPA, vdpa)
    put_item(row, DEV_VDPA_DRIVER, vdpa_driver)
    put_item(row, DEV_PCIE_ROOT, pcie_root)
    put_item(row, DEV_AUX_TYPE, aux_type)
    return row


cdef extern from *:
    """
    /* tuple.__new__(Device, row) without the argument tuple and the copy in between: a Device is a
       tuple subclass (a NamedTuple, no __dict__), laid out as a tuple, so its items are set in place. */
    static PyObject *tuple_subtype_from_list(PyObject *cls, PyObject *list) {
        PyTypeObject *type = (PyTypeObject *)cls;
        Py_ssize_t i, n = PyList_GET_SIZE(list);
        PyObject *out = type->tp_alloc(type, n);
        if (out == NULL)
            return NULL;
        for (i = 0; i < n; i++) {
            PyObject *item = PyList_GET_ITEM(list, i);
            Py_INCREF(item);
            PyTuple_SET_ITEM(out, i, item);
        }
        return out;
    }
    """
    object tuple_subtype_from_list(object type, list row)


cdef inline object as_device(list row):
    """A complete row as a densedev.model.Device."""
    return tuple_subtype_from_list(_DEVICE, row)


cdef str pcie_root_of(const char *buf, Py_ssize_t n):
    """First component after ``devices/`` of a link target, ignoring '', '.' and '..' components."""
    cdef Py_ssize_t starts[MAX_PARTS]
    cdef Py_ssize_t lens[MAX_PARTS]
    cdef int count = 0, k
    cdef Py_ssize_t i = 0, j, ln
    while i <= n and count < MAX_PARTS:
        j = i
        while j < n and buf[j] != 47:
            j += 1
        ln = j - i
        if not (ln == 0 or (ln == 1 and buf[i] == 46) or (ln == 2 and buf[i] == 46 and buf[i + 1] == 46)):
            starts[count] = i
            lens[count] = ln
            count += 1
        i = j + 1
    for k in range(count - 1):
        if lens[k] == 7 and memcmp(buf + starts[k], b"devices", 7) == 0:
            return fs_str(buf + starts[k + 1], lens[k + 1])
    return ""


cdef bytes parent_of(const char *buf, Py_ssize_t n):
    """The component before the last of a link target (the twin's _parent)."""
    cdef Py_ssize_t end = n, i
    while end > 0 and buf[end - 1] == 47:
        end -= 1
    i = end
    while i > 0 and buf[i - 1] != 47:
        i -= 1
    if i == 0:
        return b""
    end = i - 1
    i = end
    while i > 0 and buf[i - 1] != 47:
        i -= 1
    return PyBytes_FromStringAndSize(buf + i, end - i)


# ------------------------------------------------------------------ what one scan reads once

cdef class _ScanMaps:
    """Class maps, vDPA parents and the PFs read so far: looked up by every function (the twin's _Maps)."""

    cdef dict vdpa
    cdef cmap cmaps[MAP_COUNT]  # each class directory's (owner, name) pairs in _CLASSES order,
                                      # then MAP_DRIVERS: (address, driver) from each driver's directory
    cdef dict vf_map      # VF address (bytes, as listed) → (PF, index), from virtfn links
    cdef dict pfs         # PF read in this scan (str) → (parent dir fd, PCIe root, its VFs' ids or None,
                          # whether it has an IOMMU group)
    cdef dict parents     # parent dir (link text) → open fd, shared by its PFs
    cdef object present   # every address on the bus (a set of bytes; full scans only, else None)
    cdef object wanted    # the addresses a partial scan reads (a set of bytes; full scans: None)
    cdef int rootfd
    cdef int helpers      # helper threads that may share the reads (0: this thread alone)
    cdef int gate         # helpers wait until this fd is readable (-1: they need not wait; see gated)
    cdef str drv_str      # the last driver name decoded, and its bytes: thousands of VFs share one
    cdef char drv_buf[64]
    cdef Py_ssize_t drv_len

    def __cinit__(self):
        self.vf_map = {}
        self.pfs = {}
        self.parents = {}
        self.gate = -1

    cdef str driver_name(self, const char *drv, Py_ssize_t n):
        """A driver name as str ("" for none), the same object while consecutive VFs share it."""
        if n <= 0:
            return ""
        if n == self.drv_len and memcmp(drv, self.drv_buf, n) == 0:
            return self.drv_str
        self.drv_str = fs_str(drv, n)
        if n <= <Py_ssize_t>sizeof(self.drv_buf):
            memcpy(self.drv_buf, drv, n)
            self.drv_len = n
        else:
            self.drv_len = 0
        return self.drv_str

    cdef int parent_fd(self, int busfd, const char *link, Py_ssize_t n) except? -2:
        """An open fd of the directory holding a function's real directory (-1 if it will not open)."""
        cdef Py_ssize_t b = basename_at(link, n)
        cdef bytes parent = PyBytes_FromStringAndSize(link, b - 1) if b > 0 else b"."
        cdef const char *cparent = parent
        cdef int fd
        got = self.parents.get(parent)
        if got is not None:
            return got
        with nogil:
            fd = openat(busfd, cparent, DIR_FLAGS)
        if fd < 0:
            fd = -1
        self.parents[parent] = fd
        return fd

    cdef void close(self) noexcept:
        for fd in self.parents.values():
            if fd >= 0:
                close(fd)
        self.parents.clear()

    def __dealloc__(self):
        cdef int k
        for k in range(MAP_COUNT):
            cmap_free(&self.cmaps[k])


cdef str dev_node(const char *entry):
    """``uverbs3`` → ``/dev/infiniband/uverbs3`` in one decode (the twin's "/dev/infiniband/" + name)."""
    cdef char buf[FILE_NAME_MAX + 32]
    cdef Py_ssize_t n = strlen(entry)
    if n > FILE_NAME_MAX:
        return "/dev/infiniband/" + fs_str(entry, n)
    memcpy(buf, b"/dev/infiniband/", 16)
    memcpy(buf + 16, entry, n)
    return fs_str(buf, 16 + n)


cdef bytes virtfns(int devfd, str pf, dict vf_map, list warnings, int helpers):
    """Record VF address → (PF, index) from a PF's ``virtfn<k>`` links, read in parallel without the GIL.

    Returns VF 0's address (b"" without one), whose uevent gives the ids all the PF's VFs share.
    """
    cdef bytes first = b""
    cdef char big[LINK_MAX]
    cdef Py_ssize_t n, b, i, ln, count = 0
    cdef long k
    cdef bint ok
    cdef const char *e
    cdef const char *buf
    cdef dirlist l
    cdef link_ahead *items = NULL
    cdef link_ahead *r
    cdef workq q
    memset(&l, 0, sizeof(dirlist))
    try:
        with nogil:
            dirlist_open(&l, devfd, ".")
        if l.oom:
            raise MemoryError("sysfs scan: out of memory listing a directory")
        items = <link_ahead *>malloc((l.count or 1) * sizeof(link_ahead))
        if items == NULL:
            raise MemoryError("sysfs scan: out of memory")
        for i in range(l.count):
            e = l.names[i]
            if strlen(e) >= 6 and memcmp(e, b"virtfn", 6) == 0:
                items[count].dirfd = devfd
                items[count].name = e
                count += 1
        with nogil:
            workq_init(&q, link_ahead_item, items, count, NULL)
            workq_run(&q, helpers if count >= AHEAD_SHARED else 0)
        for i in range(count):
            r = &items[i]
            e = r.name
            ln = strlen(e)
            ok = parse_int(e + 6, ln - 6, &k)
            buf = r.buf
            n = r.n
            if r.status == LINK_LONG:
                with nogil:
                    r.status = read_link(devfd, e, big, &n)
                buf = big
            if not ok or k < 0 or r.status != 0:
                entry = PyBytes_FromStringAndSize(e, ln)
                warnings.append(
                    f"{pf}: {_os.fsdecode(entry)}: {_why(r.status) if r.status else 'not a VF link'}"
                )
                continue
            b = basename_at(buf, n)
            vf_map[PyBytes_FromStringAndSize(buf + b, n - b)] = (pf, k)
            if k == 0:
                first = PyBytes_FromStringAndSize(buf + b, n - b)
    finally:
        free(items)
        dirlist_free(&l)
    return first


cdef long routing_id(const char *a, Py_ssize_t n) noexcept nogil:
    """``0000:3b:00.1`` → bus << 8 | device << 3 | function; -1 for anything else (twin: _routing_id)."""
    cdef Py_ssize_t colon = 0
    cdef long bus, dev, fn
    while colon < n and a[colon] != 58:
        colon += 1
    if colon == 0 or colon == n or n - colon != 8 or a[colon + 3] != 58 or a[colon + 6] != 46:
        return -1
    if not all_hex(<char *>a, colon) or not all_hex(<char *>a + colon + 1, 2):
        return -1
    if not all_hex(<char *>a + colon + 4, 2) or not (48 <= a[colon + 7] <= 57):
        return -1
    bus = hex_value(a + colon + 1, 2)
    dev = hex_value(a + colon + 4, 2)
    fn = a[colon + 7] - 48
    if dev > 0x1F or fn > 7:
        return -1
    return bus << 8 | dev << 3 | fn


cdef inline long hex_value(const char *a, Py_ssize_t n) noexcept nogil:
    # n hex digits, already checked by all_hex
    cdef long v = 0
    cdef Py_ssize_t i
    cdef char c
    for i in range(n):
        c = a[i]
        v = v * 16 + (c - 48 if c <= 57 else (c - 87 if c >= 97 else c - 55))
    return v


cdef bint cat_path(char *out, size_t cap, const char *a, const char *b, const char *c,
                  const char *d) noexcept nogil:
    """``a`` + ``b`` + ``c`` + ``d`` (c, d may be NULL) into out, cut to fit as snprintf would; False if cut.

    A path is built per VF for each read: snprintf's format parsing was ~5 % of the scan's user time.
    """
    cdef const char *parts[4]
    cdef size_t used = 0, n
    cdef int i
    parts[0] = a
    parts[1] = b
    parts[2] = c
    parts[3] = d
    for i in range(4):
        if parts[i] == NULL:
            break
        n = strlen(parts[i])
        if used + n >= cap:
            memcpy(out + used, parts[i], cap - 1 - used)
            out[cap - 1] = 0
            return False
        memcpy(out + used, parts[i], n)
        used += n
    out[used] = 0
    return True


cdef object computed_virtfns(int devfd, str pf, bytes pfb, long numvfs, object present, dict vf_map):
    """Record a PF's VFs from its routing ID, sriov_offset and sriov_stride (the twin's _computed_virtfns).

    ``pfb`` is the PF's bus entry (``pf`` as bytes).  Returns VF 0's address, or None when the
    ``virtfn<k>`` links must be read instead.
    """
    cdef char buf[READ_MAX + 1]
    cdef char addr[64]
    cdef Py_ssize_t n, dn
    cdef long offset, stride, rid, r, k
    cdef int status
    cdef bint ok
    cdef bytes name
    cdef const char *cpf
    cdef list found
    if present is None or numvfs <= 0:
        return None
    with nogil:
        status = read_attr(devfd, "sriov_offset", buf, &n)
        ok = status == 0 and parse_int(buf, n, &offset)
        if ok:
            status = read_attr(devfd, "sriov_stride", buf, &n)
            ok = status == 0 and parse_int(buf, n, &stride)
    cpf = pfb
    rid = routing_id(cpf, len(pfb))
    if not ok or rid < 0 or offset <= 0 or stride < 0 or (stride == 0 and numvfs > 1):
        return None
    dn = pfb.index(b":")
    if dn > 32:
        return None
    found = []
    for k in range(numvfs):
        r = rid + offset + k * stride
        if r > 0xFFFF:
            return None
        # "%s:%02x:%02x.%d" % (domain, bus, device, function), as the kernel names a PCI device
        memcpy(addr, cpf, dn)
        addr[dn] = 58
        addr[dn + 1] = HEX_DIGITS[(r >> 12) & 15]
        addr[dn + 2] = HEX_DIGITS[(r >> 8) & 15]
        addr[dn + 3] = 58
        addr[dn + 4] = HEX_DIGITS[(r >> 7) & 1]
        addr[dn + 5] = HEX_DIGITS[(r >> 3) & 15]
        addr[dn + 6] = 46
        addr[dn + 7] = 48 + (r & 7)
        name = PyBytes_FromStringAndSize(addr, dn + 8)
        if name not in present:
            return None
        found.append(name)
    for k in range(numvfs):
        name = found[k]
        vf_map[name] = (pf, k)
    return found[0]


cdef object read_vf_ids(int parentfd, bytes vf0):
    """The ids every VF of a PF shares, from its VF 0's uevent; None if unusable (the twin's _vf_ids)."""
    cdef char buf[UEVENT_MAX + 1]
    cdef Py_ssize_t n
    cdef int status
    cdef uevent_at u
    cdef bytes path
    cdef const char *cpath
    if not vf0:
        return None
    path = vf0 + b"/uevent"
    cpath = path
    with nogil:
        status = read_file(parentfd, cpath, buf, &n, UEVENT_MAX)
    if status != 0 or not uevent_fields(buf, n, &u):
        return None
    return uevent_ids(buf, &u)


cdef tuple netdevs_of(_ScanMaps maps, const char *name):
    """A function's netdev names in bytes order (the twin's ``maps.nets``)."""
    cdef Py_ssize_t end, i = cmap_find(&maps.cmaps[CLS_NET], name, &end)
    cdef centry *e = maps.cmaps[CLS_NET].e
    if i < 0:
        return ()
    return tuple([fs_str(e[k].name, strlen(e[k].name)) for k in range(i, end)])


cdef tuple functions_of(_ScanMaps maps, bytes name):
    """A function's netdevs, first RDMA device and its /dev/infiniband nodes, from the class maps."""
    cdef const char *c = name
    cdef Py_ssize_t end, i, k
    cdef int m
    cdef centry *e
    netdevs = netdevs_of(maps, c)
    i = cmap_find(&maps.cmaps[CLS_IB], c, &end)
    if i < 0:
        return netdevs, "", ()
    e = maps.cmaps[CLS_IB].e
    ibdev = fs_str(e[i].name, strlen(e[i].name))
    nodes = []
    for m in range(CLS_VERBS, CLS_CM + 1):
        i = cmap_find(&maps.cmaps[m], c, &end)
        e = maps.cmaps[m].e
        for k in range(i, end if i >= 0 else i):
            nodes.append(dev_node(e[k].name))
    nodes.sort()
    return netdevs, ibdev, tuple(nodes)


cdef const char *first_netdev(_ScanMaps maps, bytes name) noexcept:
    """The first netdev's name as a C string (kept alive by the map), or NULL."""
    cdef Py_ssize_t end, i = cmap_find(&maps.cmaps[CLS_NET], name, &end)
    return maps.cmaps[CLS_NET].e[i].name if i >= 0 else NULL


cdef str link_type_name(int status, const char *buf, Py_ssize_t n, str ifname, str dev, list warnings,
                        int rootfd):
    """The link type of a ``net/<if>/type`` read (the twin's _link_type).

    Absent there, the interface the class map gave the function may sit deeper (a virtio NIC's
    ``virtio<N>/net/<if>``): only then is ``class/net/<if>/type`` read, the same directory.
    """
    cdef long v
    cdef char again[READ_MAX + 1]
    cdef bytes path
    cdef const char *cpath
    if status == 2 and rootfd >= 0:
        path = b"class/net/" + _os.fsencode(ifname) + b"/type"
        cpath = path
        with nogil:
            status = read_attr(rootfd, cpath, again, &n)
        buf = again
    if status != 0:
        return ""  # the interface left the host namespace between listing and reading
    if not parse_int(buf, n, &v):
        warnings.append(f"{dev}: net/{ifname}/type: not an integer")
        return ""
    if v == ARPHRD_ETHER:
        return "ether"
    if v == ARPHRD_INFINIBAND:
        return "infiniband"
    return ""


cdef str read_link_type(int devfd, str ifname, str dev, list warnings, int rootfd):
    cdef char buf[READ_MAX + 1]
    cdef Py_ssize_t n
    cdef int status
    cdef bytes path = b"net/" + _os.fsencode(ifname) + b"/type"
    cdef const char *cpath = path
    with nogil:
        status = read_attr(devfd, cpath, buf, &n)
    return link_type_name(status, buf, n, ifname, dev, warnings, rootfd)


# ------------------------------------------------------------------ uevent

cdef struct uevent_at:
    # Where a PCI uevent's fields start in its buffer (-1: absent) and how long the class and driver are.
    Py_ssize_t id_at, sub_at, cls_at, cls_n, drv_at, drv_n


cdef bint uevent_fields(char *buf, Py_ssize_t n, uevent_at *u) noexcept nogil:
    """Ids (and the bound driver) from a PCI device's uevent; False if the ids are incomplete.

    drivers/pci/pci-driver.c pci_uevent() writes PCI_CLASS=%04X, PCI_ID=%04X:%04X and
    PCI_SUBSYS_ID=%04X:%04X, and the driver core's dev_uevent() (drivers/base/core.c) DRIVER=<name>
    while a driver is bound: one read instead of five attribute files and the driver link.
    """
    cdef Py_ssize_t pos = 0, end, eq, klen, vat
    cdef Py_ssize_t id_n = 0, sub_n = 0
    u.id_at = u.sub_at = u.cls_at = u.drv_at = -1
    u.cls_n = u.drv_n = 0
    while pos <= n:
        end = pos
        while end < n and buf[end] != 10:
            end += 1
        eq = pos
        while eq < end and buf[eq] != 61:
            eq += 1
        klen = eq - pos
        # value: after '=' up to the line end (empty when the line has no '=')
        vat = eq + 1 if eq < end else end
        if klen == 6 and memcmp(buf + pos, b"PCI_ID", 6) == 0:
            u.id_at = vat
            id_n = end - vat
        elif klen == 13 and memcmp(buf + pos, b"PCI_SUBSYS_ID", 13) == 0:
            u.sub_at = vat
            sub_n = end - vat
        elif klen == 9 and memcmp(buf + pos, b"PCI_CLASS", 9) == 0:
            u.cls_at = vat
            u.cls_n = end - vat
        elif klen == 6 and memcmp(buf + pos, b"DRIVER", 6) == 0:
            u.drv_at = vat
            u.drv_n = end - vat
        pos = end + 1
    if u.id_at < 0 or u.sub_at < 0 or u.cls_at < 0:
        return False
    if not hex_pair(buf + u.id_at, id_n) or not hex_pair(buf + u.sub_at, sub_n):
        return False
    return 1 <= u.cls_n <= 6 and all_hex(buf + u.cls_at, u.cls_n)


cdef list uevent_ids(const char *u, uevent_at *e):
    """vendor, device, class (6 digits), subsystem vendor and device from a parsed uevent."""
    return [
        PyUnicode_DecodeASCII(u + e.id_at, 4, NULL),
        PyUnicode_DecodeASCII(u + e.id_at + 5, 4, NULL),
        "0" * (6 - e.cls_n) + PyUnicode_DecodeASCII(u + e.cls_at, e.cls_n, NULL),
        PyUnicode_DecodeASCII(u + e.sub_at, 4, NULL),
        PyUnicode_DecodeASCII(u + e.sub_at + 5, 4, NULL),
    ]


# ------------------------------------------------------------------ one PCI function, read in full

cdef struct small_file:
    # One small attribute file: status 0, an errno, EMPTY or UNREAD; its stripped text.
    int status
    Py_ssize_t n
    char buf[READ_MAX + 1]


cdef struct link_read:
    # One symlink: status 0 or an errno; the target and where its basename starts.
    int status
    Py_ssize_t n
    Py_ssize_t base
    char buf[LINK_MAX]


cdef struct pci_read:
    # Everything the scan reads of one PCI function, filled without the GIL by read_pci.
    link_read bus            # bus/pci/devices/<name> → the device's path (its PCIe root)
    int devfd              # the device directory; -1 when it would not open (open_err says why)
    int open_err
    int uevent_status
    Py_ssize_t uevent_n
    char uevent[UEVENT_MAX + 1]
    bint from_uevent       # ids (and maybe the driver) came from uevent; ue points into it
    uevent_at ue
    small_file ids[5]         # vendor, device, class, subsystem_vendor, subsystem_device: without uevent
    link_read physfn
    bint is_vf
    small_file numa, acpi, total
    long numa_v, acpi_v, total_v
    link_read driver
    const char *drv        # the driver name: into uevent or driver.buf; drv_len 0 when unbound
    Py_ssize_t drv_len
    link_read group
    long group_v
    bint group_bad
    bint noiommu
    small_file numvfs
    small_file net_type
    dirlist uio


cdef inline void get_link(int dirfd, const char *name, link_read *l) noexcept nogil:
    l.status = read_link(dirfd, name, l.buf, &l.n)
    l.base = basename_at(l.buf, l.n) if l.status == 0 else 0


cdef inline long int_value(small_file *a, long default) noexcept nogil:
    """An integer attribute; ``default`` when absent, max(default, -1) when bad (the twin's rule)."""
    cdef long value
    if a.status == 0 and parse_int(a.buf, a.n, &value):
        return value
    if a.status == ENOENT:
        return default
    return default if default > -1 else -1


cdef inline const char *id_attr_name(int i) noexcept nogil:
    if i == 0:
        return "vendor"
    if i == 1:
        return "device"
    if i == 2:
        return "class"
    if i == 3:
        return "subsystem_vendor"
    return "subsystem_device"


cdef void read_pci(int busfd, const char *name, const char *ifname, pci_read *d) noexcept nogil:
    """Read one PCI function into d without the GIL; d.devfd is left open for build_pci."""
    cdef int i
    cdef long v
    cdef char path[FILE_NAME_MAX + 16]
    d.devfd = -1
    d.from_uevent = False
    d.is_vf = False
    d.drv = NULL
    d.drv_len = 0
    d.group_v = -1
    d.group_bad = False
    d.noiommu = False
    d.numa.status = d.acpi.status = d.total.status = d.numvfs.status = d.net_type.status = UNREAD
    d.numa_v = d.acpi_v = -1
    d.total_v = -2
    d.uio.count = 0
    for i in range(5):
        d.ids[i].status = UNREAD
    get_link(busfd, name, &d.bus)
    d.devfd = openat(busfd, name, DIR_FLAGS)
    if d.devfd < 0:
        d.open_err = errno if errno else 1
        return
    d.uevent_status = read_file(d.devfd, "uevent", d.uevent, &d.uevent_n, UEVENT_MAX)
    if d.uevent_status == 0:
        d.from_uevent = uevent_fields(d.uevent, d.uevent_n, &d.ue)
    if not d.from_uevent:
        # No usable uevent (half-written or odd tree): the individual attribute files decide, and a
        # bad identity file skips the device (so nothing more is read).
        for i in range(5):
            d.ids[i].status = read_attr(d.devfd, id_attr_name(i), d.ids[i].buf, &d.ids[i].n)
            if i < 3 and (d.ids[i].status != 0 or not parse_hex_id(d.ids[i].buf, d.ids[i].n, 6 if i == 2 else 4)):
                return
    # A VF has no SR-IOV capability of its own (PCIe SR-IOV spec) and no ACPI companion, so the
    # kernel shows neither sriov_* nor acpi_index on it, and its NUMA node is its PF's (see the
    # twin's module docstring): once physfn is found, skip those probes.
    get_link(d.devfd, "physfn", &d.physfn)
    d.is_vf = d.physfn.status == 0 and d.physfn.n > d.physfn.base
    if not d.is_vf:
        d.numa.status = read_attr(d.devfd, "numa_node", d.numa.buf, &d.numa.n)
        d.numa_v = int_value(&d.numa, -1)
        d.acpi.status = read_attr(d.devfd, "acpi_index", d.acpi.buf, &d.acpi.n)
        d.acpi_v = int_value(&d.acpi, -1)
        d.total.status = read_attr(d.devfd, "sriov_totalvfs", d.total.buf, &d.total.n)
        d.total_v = int_value(&d.total, -2)
    if d.from_uevent and d.ue.drv_n > 0:
        d.drv = d.uevent + d.ue.drv_at
        d.drv_len = d.ue.drv_n
    else:
        # No DRIVER= line (unbound, or the attribute files decided): the driver link says.
        get_link(d.devfd, "driver", &d.driver)
        if d.driver.status == 0:
            d.drv = d.driver.buf + d.driver.base
            d.drv_len = d.driver.n - d.driver.base
    get_link(d.devfd, "iommu_group", &d.group)
    if d.group.status == 0:
        if not parse_int(d.group.buf + d.group.base, d.group.n - d.group.base, &v) or v < 0:
            d.group_bad = True
        else:
            d.group_v = v
            # drivers/vfio/group.c makes a no-IOMMU group (named "vfio-noiommu") only for a device a
            # vfio driver binds, so only those are asked.
            if d.drv_len >= 4 and memcmp(d.drv, b"vfio", 4) == 0:
                i = read_attr(d.devfd, "iommu_group/name", d.net_type.buf, &d.net_type.n)
                d.noiommu = i == 0 and d.net_type.n == 12 and memcmp(d.net_type.buf, b"vfio-noiommu", 12) == 0
    if d.total_v != -2:
        d.numvfs.status = read_attr(d.devfd, "sriov_numvfs", d.numvfs.buf, &d.numvfs.n)
    d.net_type.status = UNREAD
    if ifname != NULL and snprintf(path, sizeof(path), "net/%s/type", ifname) < <int>sizeof(path):
        d.net_type.status = read_attr(d.devfd, path, d.net_type.buf, &d.net_type.n)
    # uio/uioN exists only under a uio driver (igb_uio, uio_pci_generic, ...): drivers/uio/uio.c.
    if contains(d.drv, d.drv_len, "uio", 3):
        dirlist_open(&d.uio, d.devfd, "uio")


cdef inline str attr_why(small_file *a, str what):
    return _why(a.status) if a.status else what


cdef void warn_int(small_file *a, str attr, str dev, list warnings) except *:
    """The twin's warning for an integer attribute that is present but unreadable or not a number."""
    cdef long value
    if a.status == UNREAD or a.status == ENOENT:
        return
    if a.status == 0 and parse_int(a.buf, a.n, &value):
        return
    warnings.append(f"{dev}: {attr}: {attr_why(a, 'not an integer')}")


cdef list build_pci(pci_read *d, int busfd, bytes name, _ScanMaps maps, list warnings):
    """One PCI function as a row (new_row) from what read_pci read (closes d.devfd).

    A VF's PF netdev, index and NUMA node are filled in afterwards; a PF leaves its own for the VFs
    read after it.  Warnings come in the twin's order.
    """
    cdef str dev = fs_str(name, len(name))
    cdef str pcie_root = pcie_root_of(d.bus.buf, d.bus.n) if d.bus.status == 0 else ""
    cdef int i, parentfd
    cdef long num, total
    cdef small_file *a
    if d.devfd < 0:
        warnings.append(f"{dev}: skipped: {_os.strerror(d.open_err)}")
        return None
    try:
        if d.from_uevent:
            ids = uevent_ids(d.uevent, &d.ue)
        else:
            ids = ["", "", "", "", ""]
            for i in range(5):
                a = &d.ids[i]
                if a.status == 0 and parse_hex_id(a.buf, a.n, 6 if i == 2 else 4):
                    ids[i] = PyUnicode_DecodeASCII(a.buf + 2, a.n - 2, NULL)
                elif i < 3:
                    why = attr_why(a, "not a hex id")
                    warnings.append(f"{dev}: skipped: {id_attr_name(i).decode()}: {why}")
                    return None
                elif a.status != ENOENT:
                    why = attr_why(a, "not a hex id")
                    warnings.append(f"{dev}: {id_attr_name(i).decode()}: {why}")
        if d.physfn.status == 0:
            pf = fs_str(d.physfn.buf + d.physfn.base, d.physfn.n - d.physfn.base)
        else:
            pf = ""
            if d.physfn.status != ENOENT:
                warnings.append(f"{dev}: physfn: {_why(d.physfn.status)}")
        warn_int(&d.numa, "numa_node", dev, warnings)
        warn_int(&d.acpi, "acpi_index", dev, warnings)
        warn_int(&d.total, "sriov_totalvfs", dev, warnings)
        driver = fs_str(d.drv, d.drv_len) if d.drv_len else ""
        if d.group_bad:
            warnings.append(f"{dev}: iommu_group: not a group number")
        role = "vf" if pf else "pci"
        num = 0
        total = d.total_v
        netdevs, ibdev, nodes = functions_of(maps, name)
        if total != -2:
            role = "pf"
            if total < 0:
                total = 0
            a = &d.numvfs
            if a.status != 0 or not parse_int(a.buf, a.n, &num):
                warnings.append(f"{dev}: sriov_numvfs: {attr_why(a, 'not an integer')}")
                num = 0
            vf0 = computed_virtfns(d.devfd, dev, name, num, maps.present, maps.vf_map)
            if vf0 is None:
                vf0 = virtfns(d.devfd, dev, maps.vf_map, warnings, gated(maps.helpers, &maps.gate))
            if d.bus.status == 0:
                parentfd = maps.parent_fd(busfd, d.bus.buf, d.bus.n)
                if parentfd >= 0:
                    # VF 0's uevent only if VF 0 is scanned (the twin says why)
                    vf_ids = read_vf_ids(parentfd, vf0) if maps.wanted is None or vf0 in maps.wanted else None
                    maps.pfs[dev] = (
                        parentfd, pcie_root, vf_ids, d.group_v >= 0, d.numa_v, netdevs[0] if netdevs else ""
                    )
        else:
            total = 0
        if netdevs:
            a = &d.net_type
            link_type = link_type_name(a.status, a.buf, a.n, netdevs[0], dev, warnings, maps.rootfd)
        else:
            link_type = ""
        if d.uio.oom:
            raise MemoryError("sysfs scan: out of memory listing a directory")
        uio = fs_str(d.uio.names[0], strlen(d.uio.names[0])) if d.uio.count else ""
        vd = maps.vdpa.get(name)
        vdpa_name, vdpa_driver = vd if vd is not None else ("", "")
        return new_row(
            id=dev, role=role, vendor=ids[0], device=ids[1], pci_class=ids[2], subsystem_vendor=ids[3],
            subsystem_device=ids[4], driver=driver, numa_node=d.numa_v, iommu_group=d.group_v,
            noiommu=d.noiommu, acpi_index=d.acpi_v, total_vfs=total, num_vfs=num, pf=pf, vf_index=-1,
            pf_netdev="", netdevs=netdevs, link_type=link_type, rdma_device=ibdev, rdma_nodes=nodes,
            uio=uio, vdpa=vdpa_name, vdpa_driver=vdpa_driver, pcie_root=pcie_root, aux_type="",
        )
    finally:
        close(d.devfd)
        d.devfd = -1


# ------------------------------------------------------------------ a VF beside its PF, read in batches

cdef enum:
    VF_LINK_MAX = 256       # a VF's driver link target; longer ones take the full read
    VF_BATCH = 512      # VFs read ahead at once (~1.6 KB each)


cdef struct vf_read:
    # What the fast read of one VF needs and finds; filled without the GIL, by any reader thread.
    int parentfd           # the PF's parent directory: the VF's directory is in it
    const char *name       # the VF's address (kept alive by the scan's name list)
    const char *ifname     # its first netdev or NULL (kept alive by the class map)
    bint have_ids          # its PF's VFs' ids are known: read the driver link instead of the uevent
    const char *listed     # its driver from the driver's directory listing, or NULL (in the maps' arena)
    Py_ssize_t listed_len
    bint pf_grouped        # its PF has an IOMMU group (so should it)
    bint full              # this VF needs the full read (no usable uevent, or an odd link)
    int uevent_n
    char uevent[UEVENT_MAX + 1]
    uevent_at ue
    const char *drv
    Py_ssize_t drv_len
    char drvlink[VF_LINK_MAX]
    long group_v
    bint group_bad
    bint noiommu
    small_file net_type
    dirlist uio


cdef void read_vf(vf_read *v) noexcept nogil:
    """The fast read of a VF relative to its PF's parent: uevent, driver, IOMMU group, link type, uio."""
    cdef char path[FILE_NAME_MAX * 2 + 32]
    cdef Py_ssize_t n, b
    cdef ssize_t got
    cdef size_t cap = sizeof(path)
    v.full = True
    v.drv = NULL
    v.drv_len = 0
    v.group_v = -1
    v.group_bad = v.noiommu = False
    v.net_type.status = UNREAD
    v.uio.count = 0
    v.uio.oom = False
    if v.have_ids and v.listed != NULL:
        # The ids are its PF's VFs' (the twin's _vf_ids) and its driver's listing named it.
        v.drv = v.listed
        v.drv_len = v.listed_len
    elif v.have_ids:
        # The ids are its PF's VFs': only the driver link is its own.  Unbound (or gone) takes the
        # full read, which tells the two apart.
        if not cat_path(path, cap, v.name, "/driver", NULL, NULL):
            return
        got = readlinkat(v.parentfd, path, v.drvlink, VF_LINK_MAX)
        if got < 0 or got >= VF_LINK_MAX:
            return
        b = basename_at(v.drvlink, got)
        v.drv = v.drvlink + b
        v.drv_len = got - b
    elif not cat_path(path, cap, v.name, "/uevent", NULL, NULL):
        return
    elif read_file(v.parentfd, path, v.uevent, &n, UEVENT_MAX) != 0:
        return
    else:
        v.uevent_n = n
        if not uevent_fields(v.uevent, n, &v.ue) or not vf_driver(v, path, cap):
            return
    read_vf_rest(v, path, cap)


cdef bint vf_driver(vf_read *v, char *path, size_t cap) noexcept nogil:
    """The driver of a VF read by its uevent: the DRIVER= line, else its driver link.

    False when the link is longer than the slot holds (the full read has room for it).
    """
    cdef ssize_t got
    cdef Py_ssize_t b
    if v.ue.drv_n > 0:
        v.drv = v.uevent + v.ue.drv_at
        v.drv_len = v.ue.drv_n
        return True
    cat_path(path, cap, v.name, "/driver", NULL, NULL)
    got = readlinkat(v.parentfd, path, v.drvlink, VF_LINK_MAX)
    if got >= VF_LINK_MAX:
        return False
    if got >= 0:
        b = basename_at(v.drvlink, got)
        v.drv = v.drvlink + b
        v.drv_len = got - b
    return True


cdef void read_vf_rest(vf_read *v, char *path, size_t cap) noexcept nogil:
    """IOMMU group, link type and uio node of a VF whose ids and driver are read."""
    cdef char link[LINK_MAX]
    cdef Py_ssize_t n, b
    cdef long g
    cdef int status
    cat_path(path, cap, v.name, "/iommu_group", NULL, NULL)
    status = read_link(v.parentfd, path, link, &n)
    if status != 0 and v.listed != NULL and v.pf_grouped:
        # Nothing of its own read yet: no group where its PF has one may be a VF that is gone (the
        # IOMMU puts every VF in a group when it does its PF), which the full read tells.
        return
    if status == 0:
        b = basename_at(link, n)
        if not parse_int(link + b, n - b, &g) or g < 0:
            v.group_bad = True
        else:
            v.group_v = g
            if v.drv_len >= 4 and memcmp(v.drv, b"vfio", 4) == 0:
                cat_path(path, cap, v.name, "/iommu_group/name", NULL, NULL)
                status = read_attr(v.parentfd, path, v.net_type.buf, &v.net_type.n)
                v.noiommu = status == 0 and v.net_type.n == 12 and memcmp(v.net_type.buf, b"vfio-noiommu", 12) == 0
    if v.ifname != NULL:
        if not cat_path(path, cap, v.name, "/net/", v.ifname, "/type"):
            return
        v.net_type.status = read_attr(v.parentfd, path, v.net_type.buf, &v.net_type.n)
    if contains(v.drv, v.drv_len, "uio", 3):
        cat_path(path, cap, v.name, "/uio", NULL, NULL)
        dirlist_open(&v.uio, v.parentfd, path)
    v.full = False


cdef object build_vf(vf_read *v, bytes name, str pf, long index, _ScanMaps maps, list warnings):
    """A fast-read VF of a PF this scan read, complete, as a Device; warnings in the twin's order.

    A Device: nothing is filled in later (the full read's rows are lists for that).
    Its ids are the ones its PF's VFs share, or its own uevent's when those are not known; its NUMA
    node, PCIe root and PF netdev are its PF's (the twin's _scan_vf and the pass after it).
    """
    _parentfd, pcie_root, ids, _grouped, numa, pf_netdev = maps.pfs[pf]
    cdef str dev = fs_str(name, len(name))
    cdef str driver = maps.driver_name(v.drv, v.drv_len)
    cdef small_file *a = &v.net_type
    if v.group_bad:
        warnings.append(f"{dev}: iommu_group: not a group number")
    netdevs, ibdev, nodes = functions_of(maps, name)
    link_type = link_type_name(a.status, a.buf, a.n, netdevs[0], dev, warnings, maps.rootfd) if netdevs else ""
    if v.uio.oom:
        raise MemoryError("sysfs scan: out of memory listing a directory")
    uio = fs_str(v.uio.names[0], strlen(v.uio.names[0])) if v.uio.count else ""
    if ids is None:
        ids = uevent_ids(v.uevent, &v.ue)
    vd = maps.vdpa.get(name)
    vdpa_name, vdpa_driver = vd if vd is not None else ("", "")
    return as_device(new_row(
        id=dev, role="vf", vendor=ids[0], device=ids[1], pci_class=ids[2], subsystem_vendor=ids[3],
        subsystem_device=ids[4], driver=driver, numa_node=numa, iommu_group=v.group_v, noiommu=v.noiommu,
        acpi_index=-1, total_vfs=0, num_vfs=0, pf=pf, vf_index=index, pf_netdev=pf_netdev,
        netdevs=netdevs, link_type=link_type, rdma_device=ibdev, rdma_nodes=nodes, uio=uio,
        vdpa=vdpa_name, vdpa_driver=vdpa_driver, pcie_root=pcie_root, aux_type="",
    ))


cdef void vf_slot(vf_read *v, _ScanMaps maps, str pf, bytes name) except *:
    """Point a slot at a VF of ``pf`` (``name`` must outlive the read)."""
    cdef Py_ssize_t at, end
    parentfd, pcie_root, ids, pf_grouped, _numa, _netdev = maps.pfs[pf]
    v.parentfd = parentfd
    v.name = name
    v.ifname = first_netdev(maps, name)
    v.have_ids = ids is not None
    v.pf_grouped = pf_grouped
    v.listed = NULL
    v.listed_len = 0
    if v.have_ids:
        # Listed by exactly one driver; by two (a torn bind) it reads its own link, as the twin does.
        at = cmap_find(&maps.cmaps[MAP_DRIVERS], name, &end)
        if at >= 0 and end - at == 1:
            v.listed = maps.cmaps[MAP_DRIVERS].e[at].name
            v.listed_len = strlen(v.listed)


cdef enum:
    VF_SHARED = 32         # fewer VFs than this are read by this thread alone (a thread costs more)


cdef void read_vf_item(void *slots, Py_ssize_t i) noexcept nogil:
    """Work queue item: the fast read of VF slot i."""
    read_vf(&(<vf_read *>slots)[i])


cdef class _VfReader:
    """Slots for a run of VFs read ahead in parallel; the scanning thread builds rows in order."""

    cdef vf_read *slots
    cdef int *done
    cdef Py_ssize_t cap

    def __cinit__(self):
        self.cap = VF_BATCH
        self.slots = <vf_read *>malloc(self.cap * sizeof(vf_read))
        self.done = <int *>malloc(self.cap * sizeof(int))
        if self.slots == NULL or self.done == NULL:
            raise MemoryError("sysfs scan: out of memory")
        memset(self.slots, 0, self.cap * sizeof(vf_read))

    def __dealloc__(self):
        cdef Py_ssize_t i
        if self.slots != NULL:
            for i in range(self.cap):
                dirlist_free(&self.slots[i].uio)
            free(self.slots)
        free(self.done)

    cdef list run(self, list names, Py_ssize_t start, Py_ssize_t stop, int busfd, _ScanMaps maps,
                  list warnings, list rows):
        """Read names[start:stop] (VFs whose PF this scan read) and append their rows in order."""
        cdef workq q
        cdef Py_ssize_t k, n = stop - start
        cdef bytes name
        cdef vf_read *v
        pfs = []
        for k in range(n):
            name = names[start + k]
            pf, _index = maps.vf_map[name]
            vf_slot(&self.slots[k], maps, pf, name)
            pfs.append(pf)
        with nogil:
            workq_init(&q, read_vf_item, self.slots, n, self.done)
            workq_start(&q, gated(maps.helpers, &maps.gate) if n >= VF_SHARED else 0)
        try:
            for k in range(n):
                with nogil:
                    workq_wait(&q, k)
                v = &self.slots[k]
                name = names[start + k]
                pf = pfs[k]
                hit = maps.vf_map.get(name)
                if v.full or hit is None or hit[0] != pf:
                    # An odd VF (or one an odd PF claimed meanwhile): the one-at-a-time path decides.
                    row = scan_one(busfd, name, maps, warnings)
                else:
                    row = build_vf(v, name, pf, hit[1], maps, warnings)
                if row is not None:
                    rows.append(row)
                if not (k + 1) & 255:
                    yield_gil()
        finally:
            with nogil:
                workq_stop(&q)  # helpers stop after their current slot


cdef object scan_one(int busfd, bytes name, _ScanMaps maps, list warnings):
    """One function on its own: the fast read if it is a VF of a PF this scan read, else the full read."""
    cdef vf_read *v
    cdef pci_read *d
    cdef const char *cname = name
    cdef const char *ifname
    hit = maps.vf_map.get(name)
    if hit is not None and hit[0] in maps.pfs:
        v = <vf_read *>malloc(sizeof(vf_read))
        if v == NULL:
            raise MemoryError("sysfs scan: out of memory")
        memset(v, 0, sizeof(vf_read))
        try:
            vf_slot(v, maps, hit[0], name)
            with nogil:
                read_vf(v)
            if not v.full:
                return build_vf(v, name, hit[0], hit[1], maps, warnings)
        finally:
            dirlist_free(&v.uio)
            free(v)
    d = <pci_read *>malloc(sizeof(pci_read))
    if d == NULL:
        raise MemoryError("sysfs scan: out of memory")
    memset(d, 0, sizeof(pci_read))
    d.devfd = -1
    ifname = first_netdev(maps, name)
    try:
        with nogil:
            read_pci(busfd, cname, ifname, d)
        return build_pci(d, busfd, name, maps, warnings)
    finally:
        if d.devfd >= 0:
            close(d.devfd)
        dirlist_free(&d.uio)
        free(d)


cdef tuple pf_facts_of(int busfd, str pf, _ScanMaps maps, list warnings):
    """For a partial scan: a PF outside the set still gives its VFs their index, netdev and NUMA node."""
    cdef bytes name = _os.fsencode(pf)
    cdef const char *cname = name
    cdef int devfd, status
    cdef char buf[READ_MAX + 1]
    cdef Py_ssize_t n
    cdef long numa
    with nogil:
        devfd = open_dir(busfd, cname)
    if devfd < 0:
        return (), -1
    try:
        virtfns(devfd, pf, maps.vf_map, warnings, gated(maps.helpers, &maps.gate))
        with nogil:
            status = read_attr(devfd, "numa_node", buf, &n)
        if status != 0 or not parse_int(buf, n, &numa):
            numa = -1
        return netdevs_of(maps, cname), numa
    finally:
        close(devfd)


cdef list scan_sfs(int rootfd, dict by_id, list rows, _ScanMaps maps, list warnings):
    """Every auxiliary-bus subfunction whose parent function is among ``rows`` (``by_id``: the rows
    that are not VFs, where SFs are made; a VF parent is found among all of them)."""
    cdef list out = []
    cdef dict every = None
    cdef char buf[LINK_MAX]
    cdef Py_ssize_t n, b
    cdef int status, devfd, afd
    cdef long sfnum
    cdef bytes name
    cdef const char *cname
    with nogil:
        afd = open_dir(rootfd, "bus/auxiliary/devices")
    if afd < 0:
        return out
    try:
        for name in entries_fd(dup(afd)):
            # mlx5 also puts .eth/.rdma/.eth-rep devices on the auxiliary bus; only .sf. are subfunctions.
            if b".sf." not in name:
                continue
            sf = _os.fsdecode(name)
            cname = name
            with nogil:
                status = read_link(afd, cname, buf, &n)
            if status != 0:
                warnings.append(f"{sf}: skipped: {_why(status)}")
                continue
            owner = _os.fsdecode(parent_of(buf, n))
            parent = by_id.get(owner)
            if parent is None:
                if every is None:
                    every = {r[DEV_ID]: r for r in rows}
                parent = every.get(owner)
            if parent is None:
                continue
            pcie_root = pcie_root_of(buf, n)
            with nogil:
                devfd = open_dir(afd, cname)
                status = (errno if errno else 1) if devfd < 0 else 0
            if devfd < 0:
                warnings.append(f"{sf}: skipped: {_os.strerror(status)}")
                continue
            netdevs, ibdev, nodes = functions_of(maps, name)
            try:
                with nogil:
                    status = read_link(devfd, "driver", buf, &n)
                if status == 0:
                    b = basename_at(buf, n)
                    driver = fs_str(buf + b, n - b)
                else:
                    driver = ""
                # mlx5's SF device shows its SF number (sf/dev/dev.c sfnum_show); ranged pfNames
                # select SFs by it, so it goes where a VF keeps its index.
                with nogil:
                    status = read_attr(devfd, "sfnum", buf, &n)
                if status != 0 or not parse_int(buf, n, &sfnum) or sfnum < 0:
                    if status != ENOENT:
                        why = _why(status) if status else "not an integer"
                        warnings.append(f"{sf}: sfnum: {why}")
                    sfnum = -1
                link_type = read_link_type(devfd, netdevs[0], sf, warnings, maps.rootfd) if netdevs else ""
            finally:
                close(devfd)
            pf_netdevs = parent[DEV_NETDEVS]
            vd = maps.vdpa.get(name)
            vdpa_name, vdpa_driver = vd if vd is not None else ("", "")
            # An SF shares its parent function's ids and NUMA node; its sfnum goes where a VF's index does.
            out.append(new_row(
                id=sf, role="sf", vendor=parent[DEV_VENDOR], device=parent[DEV_DEVICE],
                pci_class=parent[DEV_PCI_CLASS], subsystem_vendor=parent[DEV_SUBSYSTEM_VENDOR],
                subsystem_device=parent[DEV_SUBSYSTEM_DEVICE], driver=driver,
                numa_node=parent[DEV_NUMA_NODE], iommu_group=-1, noiommu=False, acpi_index=-1, total_vfs=0,
                num_vfs=0, pf=parent[DEV_ID], vf_index=sfnum, pf_netdev=pf_netdevs[0] if pf_netdevs else "",
                netdevs=netdevs, link_type=link_type, rdma_device=ibdev, rdma_nodes=nodes, uio="",
                vdpa=vdpa_name, vdpa_driver=vdpa_driver, pcie_root=pcie_root, aux_type="sf",
            ))
    finally:
        close(afd)
    return out


cdef void drain(object table) except *:
    """Empty a big dict or list entry by entry, with GIL hand-over points (see yield_gil)."""
    cdef Py_ssize_t i = 0
    while table:
        table.popitem() if type(table) is dict else table.pop()
        i += 1
        if not i & YIELD_ROWS:
            yield_gil()


cdef inline void yield_gil() noexcept:
    # A point where a thread waiting for the GIL (the event loop) can take it: CPython hands the GIL
    # over here once the waiter has asked for it (after sys.getswitchinterval()), as between bytecodes.
    with nogil:
        pass


def _row_id(row):
    return row[DEV_ID]


cdef list scan_pcis(int busfd, list names, _ScanMaps maps, list warnings):
    """Every named PCI function in order; runs of VFs whose PF was read are read ahead in parallel."""
    cdef list rows = []
    cdef Py_ssize_t i = 0, j, count = len(names)
    cdef _VfReader reader = None
    cdef bytes name
    while i < count:
        j = i
        while j < count and j - i < VF_BATCH:
            name = names[j]
            hit = maps.vf_map.get(name)
            if hit is None or hit[0] not in maps.pfs:
                break
            j += 1
        if j > i:
            if reader is None:
                reader = _VfReader()
            reader.run(names, i, j, busfd, maps, warnings, rows)
            i = j
            continue
        row = scan_one(busfd, names[i], maps, warnings)
        if row is not None:
            rows.append(row)
        i += 1
    return rows


def scan_sysfs(bytes root, tuple addresses=None, bint threads=True, int gate=-1):
    """Scan PCI functions (all, or only ``addresses``) and their subfunctions under a sysfs root."""
    # Every object the scan makes lives until it returns, so a collection during it would only
    # traverse them in vain (tens of thousands per scan): the collector waits until the end.
    cdef int gc_was = PyGC_Disable()
    try:
        return scan_tree(root, addresses, threads, gate)
    finally:
        if gc_was:
            PyGC_Enable()


cdef tuple scan_tree(bytes root, tuple addresses, bint threads, int gate):
    cdef list warnings = []
    cdef int rootfd, busfd
    cdef list rows
    cdef dict pf_facts = {}
    cdef dict by_id
    cdef list out
    cdef int err
    cdef Py_ssize_t i
    cdef const char *croot = root
    cdef _ScanMaps maps
    with nogil:
        rootfd = openat(-100, croot, DIR_FLAGS)  # AT_FDCWD
        err = (errno if errno else 1) if rootfd < 0 else 0
    if rootfd < 0:
        return (), (f"{_os.fsdecode(root)}: cannot open sysfs root: {_os.strerror(err)}",)
    try:
        with nogil:
            busfd = open_dir(rootfd, "bus/pci/devices")
            err = (errno if errno else 1) if busfd < 0 else 0
        if busfd < 0:
            return (), (f"{_os.fsdecode(root)}/bus/pci/devices: {_os.strerror(err)}",)
        maps = _ScanMaps()
        maps.rootfd = rootfd
        maps.helpers = _HELPERS if threads else 0
        maps.gate = gate
        try:
            names = read_classes(rootfd, maps.cmaps, maps.helpers, &maps.gate, busfd if addresses is None else -1)
            maps.vdpa = vdpa_map(rootfd)
            if addresses is not None:
                names = sorted(set(addresses))
            maps.present = set(names) if addresses is None else None
            maps.wanted = None if addresses is None else set(names)
            rows = scan_pcis(busfd, names, maps, warnings)
            # The rows VFs and SFs hang off: PFs (and the other functions), a few dozen, not every VF.
            by_id = {r[DEV_ID]: r for r in rows if r[DEV_ROLE] != "vf"}
            i = 0
            for row in rows:
                i += 1
                if not i & YIELD_ROWS:
                    yield_gil()
                if row[DEV_ROLE] != "vf" or row[DEV_VF_INDEX] >= 0:
                    continue  # not a VF, or one read beside its PF: complete already (a Device)
                pf = row[DEV_PF]
                parent = by_id.get(pf)
                if parent is not None:
                    facts = (parent[DEV_NETDEVS], parent[DEV_NUMA_NODE])
                else:
                    facts = pf_facts.get(pf)
                    if facts is None:
                        facts = pf_facts[pf] = pf_facts_of(busfd, pf, maps, warnings)
                netdevs = facts[0]
                row[DEV_PF_NETDEV] = netdevs[0] if netdevs else ""
                row[DEV_NUMA_NODE] = facts[1]
                hit = maps.vf_map.get(_os.fsencode(row[DEV_ID]))
                row[DEV_VF_INDEX] = hit[1] if hit is not None and hit[0] == pf else -1
            rows.extend(scan_sfs(rootfd, by_id, rows, maps, warnings))
        finally:
            maps.close()
            close(busfd)
    finally:
        close(rootfd)
    rows.sort(key=_row_id)
    # Working tables are emptied piecemeal and each row list is freed as its Device is made (by_id
    # first lets go of them): one dealloc of 16k entries would hold the GIL for milliseconds.
    by_id = None
    drain(maps.vf_map)
    drain(names)
    out = []
    for i in range(len(rows)):
        if not (i + 1) & YIELD_ROWS:
            yield_gil()
        row = rows[i]
        if type(row) is list:
            row = as_device(<list>row)
        untrack(row)
        out.append(row)
        rows[i] = None
    return tuple(out), tuple(warnings)


cdef inline void untrack(object row) noexcept:
    # A Device holds only str, int, bool and tuples of str (and, a NamedTuple, no __dict__): it can
    # never be part of a reference cycle, so the collector need not traverse it (CPython untracks such
    # tuples itself, but only once a collection has walked them: ~40k per 4k-VF scan, a millisecond of
    # the first collection after, and never a tuple subclass).
    PyObject_GC_UnTrack(row[DEV_NETDEVS])
    PyObject_GC_UnTrack(row[DEV_RDMA_NODES])
    PyObject_GC_UnTrack(row)


cdef long leading_int(const char *buf, Py_ssize_t n) noexcept nogil:
    """``4: ACTIVE`` → 4; -1 when the text before ':' (stripped) is not a number."""
    cdef Py_ssize_t end = 0, start = 0
    cdef long v
    while end < n and buf[end] != 58:
        end += 1
    while end > 0 and is_space(buf[end - 1]):
        end -= 1
    while start < end and is_space(buf[start]):
        start += 1
    if parse_int(buf + start, end - start, &v):
        return v
    return -1


def read_rdma_ports(bytes root, tuple ibdevs):
    """Read ``(ibdev, port, state, phys_state)`` for every port of each RDMA device (absent ones skipped)."""
    cdef list out = []
    cdef char buf[READ_MAX + 1]
    cdef Py_ssize_t n
    cdef long port_n, state, phys
    cdef int cfd = openat(-100, _os.path.join(root, b"class/infiniband"), DIR_FLAGS)
    cdef bytes pdir, base, state_path, phys_path
    cdef const char *state_c
    cdef const char *phys_c
    cdef int rc
    if cfd < 0:
        return ()
    try:
        for ibdev in ibdevs:
            pdir = ibdev + b"/ports"
            for port in listdir_at(cfd, pdir):
                if not parse_int(port, len(port), &port_n):
                    continue
                base = pdir + b"/" + port
                state_path = base + b"/state"
                phys_path = base + b"/phys_state"
                state_c = state_path
                phys_c = phys_path
                # The poll reads two files per port for every RDMA device in a pool, every second: the
                # reads run without the GIL so a poll in a worker thread leaves the event loop free.
                with nogil:
                    rc = read_attr(cfd, state_c, buf, &n)
                    if rc == 0:
                        state = leading_int(buf, n)
                        phys = leading_int(buf, n) if read_attr(cfd, phys_c, buf, &n) == 0 else -1
                if rc != 0:
                    continue
                out.append((_os.fsdecode(ibdev), port_n, state, phys))
    finally:
        close(cfd)
    return tuple(out)
