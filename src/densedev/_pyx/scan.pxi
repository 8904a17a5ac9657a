# The sysfs scan of PCI functions, subfunctions and RDMA ports; the twin is _fast_py/scan.py (the spec).
#
# Every file and link is reached relative to an open directory fd (openat/readlinkat), read into a stack
# buffer and parsed in C; Python objects are made only for the values that go into a device's tuple.
# Warnings are built with the same Python expressions as the twin so both return identical strings.

from libc.errno cimport errno, ENOENT
from libc.string cimport strlen, memcmp, memcpy
from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.unicode cimport PyUnicode_DecodeUTF8, PyUnicode_DecodeASCII

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
    SC_MAX_PARTS = 128
    SC_UEVENT_MAX = 1023   # a PCI device's uevent is ~150 bytes (DRIVER, PCI_*, MODALIAS)
    SC_DENTS_BUF = 32768   # one getdents64 call returns a whole device directory
    SC_DIRENT_MAX = 280    # largest linux_dirent64: 19-byte header + 255-byte name + NUL, 8-aligned
    # include/uapi/linux/if_arp.h
    SC_ARPHRD_ETHER = 1
    SC_ARPHRD_INFINIBAND = 32

import os as _sc_os

_SC_RDMA_CLASSES = (b"infiniband_verbs", b"infiniband_mad", b"infiniband_cm")


cdef inline bint _sc_space(char c) nogil:
    # bytes.strip() whitespace: space \t \n \r \v \f
    return c == 32 or (9 <= c <= 13)


cdef inline int _sc_read(int dirfd, const char *name, char *buf, Py_ssize_t *n) nogil:
    return _sc_read_cap(dirfd, name, buf, n, SC_READ_MAX)


cdef int _sc_read_cap(int dirfd, const char *name, char *buf, Py_ssize_t *n, Py_ssize_t cap) nogil:
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


cdef int _sc_readlink(int dirfd, const char *name, char *buf, Py_ssize_t *n) nogil:
    cdef ssize_t got = sc_readlinkat(dirfd, name, buf, SC_LINK_MAX - 1)
    n[0] = 0
    if got < 0:
        return errno if errno else 1
    buf[got] = 0
    n[0] = got
    return 0


cdef inline Py_ssize_t _sc_base(const char *buf, Py_ssize_t n) nogil:
    """Offset of the basename (after the last '/')."""
    cdef Py_ssize_t i = n
    while i > 0 and buf[i - 1] != 47:
        i -= 1
    return i


cdef bint _sc_int(const char *buf, Py_ssize_t n, long *out) nogil:
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


cdef bint _sc_hex(char *buf, Py_ssize_t n, int digits) nogil:
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


cdef inline bint _sc_is_hex(char *buf, Py_ssize_t n) nogil:
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


cdef inline bint _sc_pair(char *buf, Py_ssize_t n) nogil:
    """``15B3:101E``: two groups of four hex digits around a colon (lower-cased in place)."""
    return n == 9 and buf[4] == 58 and _sc_is_hex(buf, 4) and _sc_is_hex(buf + 5, 4)


cdef tuple _sc_uevent_ids(char *buf, Py_ssize_t n):
    """Vendor, device, class and subsystem ids from a PCI device's uevent; None if incomplete.

    drivers/pci/pci-driver.c pci_uevent() writes PCI_CLASS=%04X, PCI_ID=%04X:%04X and
    PCI_SUBSYS_ID=%04X:%04X: one read instead of five attribute files (the scan is syscall-bound).
    """
    cdef Py_ssize_t pos = 0, end, eq, klen, vat
    cdef Py_ssize_t id_at = -1, id_n = 0, sub_at = -1, sub_n = 0, cls_at = -1, cls_n = 0
    cdef char cls[6]
    cdef Py_ssize_t i
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
            id_at = vat
            id_n = end - vat
        elif klen == 13 and memcmp(buf + pos, b"PCI_SUBSYS_ID", 13) == 0:
            sub_at = vat
            sub_n = end - vat
        elif klen == 9 and memcmp(buf + pos, b"PCI_CLASS", 9) == 0:
            cls_at = vat
            cls_n = end - vat
        pos = end + 1
    if id_at < 0 or sub_at < 0 or cls_at < 0:
        return None
    if not _sc_pair(buf + id_at, id_n) or not _sc_pair(buf + sub_at, sub_n):
        return None
    if not (1 <= cls_n <= 6) or not _sc_is_hex(buf + cls_at, cls_n):
        return None
    for i in range(6 - cls_n):
        cls[i] = 48
    memcpy(cls + 6 - cls_n, buf + cls_at, cls_n)
    return (
        PyUnicode_DecodeASCII(buf + id_at, 4, NULL),
        PyUnicode_DecodeASCII(buf + id_at + 5, 4, NULL),
        PyUnicode_DecodeASCII(cls, 6, NULL),
        PyUnicode_DecodeASCII(buf + sub_at, 4, NULL),
        PyUnicode_DecodeASCII(buf + sub_at + 5, 4, NULL),
    )


cdef inline str _sc_str(const char *buf, Py_ssize_t n):
    # os.fsdecode on Linux: UTF-8 with surrogateescape
    return PyUnicode_DecodeUTF8(buf, n, "surrogateescape")


cdef str _sc_pcie_root(const char *buf, Py_ssize_t n):
    """First component after ``devices/`` of a link target, ignoring '', '.' and '..' components."""
    cdef Py_ssize_t starts[SC_MAX_PARTS]
    cdef Py_ssize_t lens[SC_MAX_PARTS]
    cdef int count = 0, k
    cdef Py_ssize_t i = 0, j, ln
    while i <= n and count < SC_MAX_PARTS:
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
            return _sc_str(buf + starts[k + 1], lens[k + 1])
    return ""


cdef bytes _sc_parent(const char *buf, Py_ssize_t n):
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


cdef list _sc_entries_fd(int fd):
    """Sorted entries of an open directory (fd is consumed); '.' and '..' left out.

    getdents64 straight into a stack buffer: no DIR allocation and no fcntl as fdopendir would cost.
    """
    cdef char buf[SC_DENTS_BUF]
    cdef long got
    cdef long pos
    cdef sc_dirent64 *e
    cdef const char *nm
    cdef list out = []
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
            out.append(PyBytes_FromStringAndSize(nm, strlen(nm)))
        # fs/readdir.c: getdents64 fills the buffer until the next record does not fit or the
        # directory ends (kernfs, ext4 and tmpfs all emit until full), so a reply with room left
        # for a maximal record is the end: skip the extra call that would return 0.
        if got < SC_DENTS_BUF - SC_DIRENT_MAX:
            break
    sc_close(fd)
    if len(out) > 1:
        out.sort()
    return out


cdef list _sc_listdir(int dirfd, const char *name):
    cdef int fd = sc_openat(dirfd, name, SC_DIR_FLAGS)
    if fd < 0:
        return []
    return _sc_entries_fd(fd)


def _sc_why(int status):
    if status == SC_EMPTY:
        return "empty"
    if status == ENOENT:
        return "missing"
    return f"unreadable ({_sc_os.strerror(status)})"


cdef dict _sc_rdma_map(int rootfd):
    cdef dict out = {}
    cdef int cfd
    cdef char buf[SC_READ_MAX + 1]
    cdef Py_ssize_t n
    cdef bytes entry, path
    for cls in _SC_RDMA_CLASSES:
        cfd = sc_openat(rootfd, b"class/" + cls, SC_DIR_FLAGS)
        if cfd < 0:
            continue
        for entry in _sc_entries_fd(sc_dup(cfd)):
            path = entry + b"/ibdev"
            if _sc_read(cfd, path, buf, &n) == 0:
                key = PyBytes_FromStringAndSize(buf, n)
                node = "/dev/infiniband/" + _sc_os.fsdecode(entry)
                lst = out.get(key)
                if lst is None:
                    out[key] = [node]
                else:
                    lst.append(node)
        sc_close(cfd)
    return out


cdef dict _sc_vdpa_map(int rootfd):
    cdef dict out = {}
    cdef int bfd = sc_openat(rootfd, b"bus/vdpa/devices", SC_DIR_FLAGS)
    cdef char buf[SC_LINK_MAX]
    cdef Py_ssize_t n, b
    cdef bytes entry, parent, path
    if bfd < 0:
        return out
    for entry in _sc_entries_fd(sc_dup(bfd)):
        if _sc_readlink(bfd, entry, buf, &n) != 0:
            continue
        parent = _sc_parent(buf, n)
        if parent in out:
            continue
        path = entry + b"/driver"
        if _sc_readlink(bfd, path, buf, &n) == 0:
            b = _sc_base(buf, n)
            drv = _sc_str(buf + b, n - b)
        else:
            drv = ""
        out[parent] = (_sc_os.fsdecode(entry), drv)
    sc_close(bfd)
    return out


cdef void _sc_virtfns(int devfd, str pf, dict vf_map, list warnings):
    cdef char buf[SC_LINK_MAX]
    cdef Py_ssize_t n, b
    cdef long k
    cdef int status
    cdef bytes entry
    cdef const char *e
    for entry in _sc_listdir(devfd, b"."):
        e = entry
        if len(entry) < 6 or memcmp(e, b"virtfn", 6) != 0:
            continue
        ok = _sc_int(e + 6, len(entry) - 6, &k)
        status = _sc_readlink(devfd, e, buf, &n)
        if not ok or k < 0 or status != 0:
            warnings.append(
                f"{pf}: {_sc_os.fsdecode(entry)}: {_sc_why(status) if status else 'not a VF link'}"
            )
            continue
        b = _sc_base(buf, n)
        vf_map[PyBytes_FromStringAndSize(buf + b, n - b)] = (pf, k)


cdef str _sc_link_type(int devfd, str ifname, str dev, list warnings):
    cdef char buf[SC_READ_MAX + 1]
    cdef Py_ssize_t n
    cdef long v
    cdef bytes path = b"net/" + _sc_os.fsencode(ifname) + b"/type"
    if _sc_read(devfd, path, buf, &n) != 0:
        return ""
    if not _sc_int(buf, n, &v):
        warnings.append(f"{dev}: net/{ifname}/type: not an integer")
        return ""
    if v == SC_ARPHRD_ETHER:
        return "ether"
    if v == SC_ARPHRD_INFINIBAND:
        return "infiniband"
    return ""


cdef tuple _sc_names(list entries):
    return tuple([_sc_os.fsdecode(e) for e in entries]) if entries else ()


cdef list _sc_scan_pci(int busfd, bytes name, dict rdma, dict vdpa, dict vf_map, list warnings):
    """One PCI function in Device field order (PF netdev and VF index are filled in afterwards)."""
    cdef char buf[SC_LINK_MAX]
    cdef Py_ssize_t n, b
    cdef int status, devfd, i
    cdef long value, numa, acpi, total, num, group
    cdef bint noiommu = False
    cdef const char *cname = name
    cdef str dev = _sc_os.fsdecode(name)
    cdef str pcie_root = ""
    cdef list ids = [None, None, None]
    cdef list subsys = ["", ""]
    status = _sc_readlink(busfd, cname, buf, &n)
    if status == 0:
        pcie_root = _sc_pcie_root(buf, n)
    devfd = sc_openat(busfd, cname, SC_DIR_FLAGS)
    if devfd < 0:
        status = errno if errno else 1
        warnings.append(f"{dev}: skipped: {_sc_os.strerror(status)}")
        return None
    try:
        status = _sc_read_cap(devfd, b"uevent", buf, &n, SC_UEVENT_MAX)
        from_uevent = _sc_uevent_ids(buf, n) if status == 0 else None
        if from_uevent is not None:
            ids = [from_uevent[0], from_uevent[1], from_uevent[2]]
            subsys = [from_uevent[3], from_uevent[4]]
        else:
            # No usable uevent (half-written or odd tree): the individual attribute files decide.
            # Identity: vendor, device and class must be well-formed or the device is skipped.
            for i, (attr, digits) in enumerate(((b"vendor", 4), (b"device", 4), (b"class", 6))):
                status = _sc_read(devfd, <bytes>attr, buf, &n)
                if status != 0 or not _sc_hex(buf, n, digits):
                    why = _sc_why(status) if status else "not a hex id"
                    warnings.append(f"{dev}: skipped: {(<bytes>attr).decode()}: {why}")
                    return None
                ids[i] = PyUnicode_DecodeASCII(buf + 2, n - 2, NULL)
            for i, attr in enumerate((b"subsystem_vendor", b"subsystem_device")):
                status = _sc_read(devfd, <bytes>attr, buf, &n)
                if status == 0 and _sc_hex(buf, n, 4):
                    subsys[i] = PyUnicode_DecodeASCII(buf + 2, n - 2, NULL)
                elif status != ENOENT:
                    why = _sc_why(status) if status else "not a hex id"
                    warnings.append(f"{dev}: {(<bytes>attr).decode()}: {why}")
        # A VF has no SR-IOV capability of its own (PCIe SR-IOV spec) and no ACPI companion, so the
        # kernel shows neither sriov_* nor acpi_index on it: once physfn is found, skip those probes.
        status = _sc_readlink(devfd, b"physfn", buf, &n)
        if status == 0:
            b = _sc_base(buf, n)
            pf = _sc_str(buf + b, n - b)
        else:
            pf = ""
            if status != ENOENT:
                warnings.append(f"{dev}: physfn: {_sc_why(status)}")
        numa = _sc_read_int(devfd, b"numa_node", -1, dev, warnings)
        if pf:
            acpi = -1
            total = -2
        else:
            acpi = _sc_read_int(devfd, b"acpi_index", -1, dev, warnings)
            total = _sc_read_int(devfd, b"sriov_totalvfs", -2, dev, warnings)
        status = _sc_readlink(devfd, b"driver", buf, &n)
        if status == 0:
            b = _sc_base(buf, n)
            driver = _sc_str(buf + b, n - b)
        else:
            driver = ""
        group = -1
        status = _sc_readlink(devfd, b"iommu_group", buf, &n)
        if status == 0:
            b = _sc_base(buf, n)
            if not _sc_int(buf + b, n - b, &value) or value < 0:
                warnings.append(f"{dev}: iommu_group: not a group number")
            else:
                group = value
                # drivers/vfio/group.c makes a no-IOMMU group (named "vfio-noiommu") only for a device
                # a vfio driver binds, so only those are asked.
                if driver.startswith("vfio"):
                    status = _sc_read(devfd, b"iommu_group/name", buf, &n)
                    noiommu = status == 0 and n == 12 and memcmp(buf, b"vfio-noiommu", 12) == 0
        role = "vf" if pf else "pci"
        num = 0
        if total != -2:
            role = "pf"
            if total < 0:
                total = 0
            status = _sc_read(devfd, b"sriov_numvfs", buf, &n)
            if status != 0 or not _sc_int(buf, n, &num):
                warnings.append(f"{dev}: sriov_numvfs: {_sc_why(status) if status else 'not an integer'}")
                num = 0
            _sc_virtfns(devfd, dev, vf_map, warnings)
        else:
            total = 0
        netdevs = _sc_names(_sc_listdir(devfd, b"net"))
        link_type = _sc_link_type(devfd, netdevs[0], dev, warnings) if netdevs else ""
        ibdevs = _sc_listdir(devfd, b"infiniband")
        ibdev = ibdevs[0] if ibdevs else b""
        if ibdev:
            nodes = rdma.get(ibdev)
            nodes = tuple(sorted(nodes)) if nodes else ()
        else:
            nodes = ()
        # uio/uioN exists only under a uio driver (igb_uio, uio_pci_generic, ...): drivers/uio/uio.c.
        uios = _sc_listdir(devfd, b"uio") if "uio" in driver else []
        vd = vdpa.get(name)
        vdpa_name, vdpa_driver = vd if vd is not None else ("", "")
        return [
            dev, role, ids[0], ids[1], ids[2], subsys[0], subsys[1], driver, numa, group, noiommu, acpi,
            total, num, pf, -1, "", netdevs, link_type, _sc_os.fsdecode(ibdev), nodes,
            _sc_os.fsdecode(uios[0]) if uios else "", vdpa_name, vdpa_driver, pcie_root, "",
        ]
    finally:
        sc_close(devfd)


cdef long _sc_read_int(int devfd, const char *attr, long default, str dev, list warnings):
    """An integer attribute; ``default`` when absent, max(default, -1) with a warning when bad."""
    cdef char buf[SC_READ_MAX + 1]
    cdef Py_ssize_t n
    cdef long value
    cdef int status = _sc_read(devfd, attr, buf, &n)
    if status == 0 and _sc_int(buf, n, &value):
        return value
    if status == ENOENT:
        return default
    why = _sc_why(status) if status else "not an integer"
    warnings.append(f"{dev}: {(<bytes>attr).decode()}: {why}")
    return default if default > -1 else -1


cdef tuple _sc_pf_facts(int busfd, str pf, dict vf_map, list warnings):
    cdef bytes name = _sc_os.fsencode(pf)
    cdef int devfd = sc_openat(busfd, name, SC_DIR_FLAGS)
    if devfd < 0:
        return ()
    try:
        _sc_virtfns(devfd, pf, vf_map, warnings)
        return _sc_names(_sc_listdir(devfd, b"net"))
    finally:
        sc_close(devfd)


cdef list _sc_scan_sfs(int rootfd, dict by_id, dict rdma, dict vdpa, list warnings):
    cdef list out = []
    cdef char buf[SC_LINK_MAX]
    cdef Py_ssize_t n, b
    cdef int status, devfd
    cdef int afd = sc_openat(rootfd, b"bus/auxiliary/devices", SC_DIR_FLAGS)
    cdef long sfnum
    cdef bytes name
    if afd < 0:
        return out
    try:
        for name in _sc_entries_fd(sc_dup(afd)):
            # mlx5 also puts .eth/.rdma/.eth-rep devices on the auxiliary bus; only .sf. are subfunctions.
            if b".sf." not in name:
                continue
            sf = _sc_os.fsdecode(name)
            status = _sc_readlink(afd, name, buf, &n)
            if status != 0:
                warnings.append(f"{sf}: skipped: {_sc_why(status)}")
                continue
            parent = by_id.get(_sc_os.fsdecode(_sc_parent(buf, n)))
            if parent is None:
                continue
            pcie_root = _sc_pcie_root(buf, n)
            devfd = sc_openat(afd, name, SC_DIR_FLAGS)
            if devfd < 0:
                status = errno if errno else 1
                warnings.append(f"{sf}: skipped: {_sc_os.strerror(status)}")
                continue
            try:
                status = _sc_readlink(devfd, b"driver", buf, &n)
                if status == 0:
                    b = _sc_base(buf, n)
                    driver = _sc_str(buf + b, n - b)
                else:
                    driver = ""
                # mlx5's SF device shows its SF number (sf/dev/dev.c sfnum_show); ranged pfNames
                # select SFs by it, so it goes where a VF keeps its index.
                status = _sc_read(devfd, b"sfnum", buf, &n)
                if status != 0 or not _sc_int(buf, n, &sfnum) or sfnum < 0:
                    if status != ENOENT:
                        why = _sc_why(status) if status else "not an integer"
                        warnings.append(f"{sf}: sfnum: {why}")
                    sfnum = -1
                netdevs = _sc_names(_sc_listdir(devfd, b"net"))
                link_type = _sc_link_type(devfd, netdevs[0], sf, warnings) if netdevs else ""
                ibdevs = _sc_listdir(devfd, b"infiniband")
            finally:
                sc_close(devfd)
            ibdev = ibdevs[0] if ibdevs else b""
            pf_netdevs = parent[17]
            vd = vdpa.get(name)
            vdpa_name, vdpa_driver = vd if vd is not None else ("", "")
            out.append([
                sf, "sf", parent[2], parent[3], parent[4], parent[5], parent[6], driver, parent[8],
                -1, False, -1, 0, 0, parent[0], sfnum, pf_netdevs[0] if pf_netdevs else "", netdevs,
                link_type, _sc_os.fsdecode(ibdev), tuple(sorted(rdma.get(ibdev, ()))) if ibdev else (),
                "", vdpa_name, vdpa_driver, pcie_root, "sf",
            ])
    finally:
        sc_close(afd)
    return out


def _sc_row_id(row):
    return row[0]


def scan_sysfs(bytes root, tuple addresses=None):
    """Scan PCI functions (all, or only ``addresses``) and their subfunctions under a sysfs root."""
    cdef list warnings = []
    cdef int rootfd, busfd
    cdef list rows = []
    cdef dict vf_map = {}
    cdef dict pf_netdevs = {}
    cdef list row
    cdef int err
    rootfd = sc_openat(-100, root, SC_DIR_FLAGS)  # AT_FDCWD
    if rootfd < 0:
        err = errno if errno else 1
        return (), (f"{_sc_os.fsdecode(root)}: cannot open sysfs root: {_sc_os.strerror(err)}",)
    try:
        busfd = sc_openat(rootfd, b"bus/pci/devices", SC_DIR_FLAGS)
        if busfd < 0:
            err = errno if errno else 1
            return (), (f"{_sc_os.fsdecode(root)}/bus/pci/devices: {_sc_os.strerror(err)}",)
        try:
            rdma = _sc_rdma_map(rootfd)
            vdpa = _sc_vdpa_map(rootfd)
            names = _sc_entries_fd(sc_dup(busfd)) if addresses is None else sorted(set(addresses))
            for name in names:
                row = _sc_scan_pci(busfd, name, rdma, vdpa, vf_map, warnings)
                if row is not None:
                    rows.append(row)
            by_id = {r[0]: r for r in rows}
            for row in rows:
                if row[1] != "vf":
                    continue
                pf = row[14]
                parent = by_id.get(pf)
                if parent is not None:
                    netdevs = parent[17]
                elif pf in pf_netdevs:
                    netdevs = pf_netdevs[pf]
                else:
                    netdevs = pf_netdevs[pf] = _sc_pf_facts(busfd, pf, vf_map, warnings)
                row[16] = netdevs[0] if netdevs else ""
                hit = vf_map.get(_sc_os.fsencode(row[0]))
                row[15] = hit[1] if hit is not None and hit[0] == pf else -1
            rows.extend(_sc_scan_sfs(rootfd, by_id, rdma, vdpa, warnings))
        finally:
            sc_close(busfd)
    finally:
        sc_close(rootfd)
    rows.sort(key=_sc_row_id)
    return tuple([tuple(r) for r in rows]), tuple(warnings)


cdef long _sc_leading_int(const char *buf, Py_ssize_t n):
    """``4: ACTIVE`` → 4; -1 when the text before ':' (stripped) is not a number."""
    cdef Py_ssize_t end = 0, start = 0
    cdef long v
    while end < n and buf[end] != 58:
        end += 1
    while end > 0 and _sc_space(buf[end - 1]):
        end -= 1
    while start < end and _sc_space(buf[start]):
        start += 1
    if _sc_int(buf + start, end - start, &v):
        return v
    return -1


def read_rdma_ports(bytes root, tuple ibdevs):
    """Read ``(ibdev, port, state, phys_state)`` for every port of each RDMA device (absent ones skipped)."""
    cdef list out = []
    cdef char buf[SC_READ_MAX + 1]
    cdef Py_ssize_t n
    cdef long port_n, state, phys
    cdef int cfd = sc_openat(-100, _sc_os.path.join(root, b"class/infiniband"), SC_DIR_FLAGS)
    cdef bytes pdir, base
    if cfd < 0:
        return ()
    try:
        for ibdev in ibdevs:
            pdir = ibdev + b"/ports"
            for port in _sc_listdir(cfd, pdir):
                if not _sc_int(port, len(port), &port_n):
                    continue
                base = pdir + b"/" + port
                if _sc_read(cfd, base + b"/state", buf, &n) != 0:
                    continue
                state = _sc_leading_int(buf, n)
                if _sc_read(cfd, base + b"/phys_state", buf, &n) == 0:
                    phys = _sc_leading_int(buf, n)
                else:
                    phys = -1
                out.append((_sc_os.fsdecode(ibdev), port_n, state, phys))
    finally:
        sc_close(cfd)
    return tuple(out)
