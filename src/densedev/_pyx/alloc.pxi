# Preferred-allocation ranking; twin and spec: densedev/_fast_py/alloc.py (read its docstring first).
# The kubelet sends every available ID of a resource on each GetPreferredAllocation and pod admission
# waits for the answer, so the per-ID work here is one dict lookup and a few array reads; the only
# sorts are of the PF groups (qsort) and a bounded heap holding the `need` best device keys.

from libc.stdint cimport int32_t, uint32_t, uint64_t
from libc.stdlib cimport malloc, calloc, free, qsort
from libc.string cimport memcpy
from cpython.dict cimport PyDict_GetItem
from cpython.object cimport PyObject


cdef extern from "Python.h":
    # PEP 393 compact strings: a 12-character ASCII ID is 12 bytes right after the object header.
    bint PyUnicode_CheckExact(object o)
    Py_ssize_t PyUnicode_GET_LENGTH(object o)
    int PyUnicode_KIND(object o)
    void* PyUnicode_DATA(object o)
    int PyUnicode_1BYTE_KIND


cdef enum:
    ALLOC_POLICY_PACK = 0
    ALLOC_POLICY_SPREAD = 1
    ALLOC_POLICY_NONE = 2
    # The kernel's CONFIG_NODES_SHIFT is at most 10: NUMA node ids are below MAX_NUMNODES = 1024.
    ALLOC_MAX_NUMA = 1024
    ALLOC_F20 = 20
    ALLOC_MAX_ROUND = 0xFFFF

cdef uint64_t ALLOC_MAX_MEMBERS = (1 << 20) - 1
# lookup blocks: uint32 domain, then int32 member per (bus << 8 | devfn); see the twin's build_lookup.
cdef Py_ssize_t ALLOC_LOOKUP_BLOCK = 4 + 4 * 65536


# One pool member's topology, as packed by the allocator (three little-endian int32).
cdef struct alloc_topo:
    int32_t numa   # /sys/bus/pci/devices/<bdf>/numa_node; -1 when the firmware gives none
    int32_t root   # dense id of the PCIe root ("pci0000:3a")
    int32_t pf     # dense id of the parent PF; a device without one is its own group


cdef int cmp_u64(const void* a, const void* b) noexcept nogil:
    cdef uint64_t x = (<const uint64_t*>a)[0]
    cdef uint64_t y = (<const uint64_t*>b)[0]
    return (x > y) - (x < y)


cdef inline void sift_up(uint64_t* heap, Py_ssize_t i) noexcept nogil:
    cdef Py_ssize_t parent
    cdef uint64_t v = heap[i]
    while i > 0:
        parent = (i - 1) // 2
        if heap[parent] >= v:
            break
        heap[i] = heap[parent]
        i = parent
    heap[i] = v


cdef inline void sift_down(uint64_t* heap, Py_ssize_t n, Py_ssize_t i) noexcept nogil:
    # Max-heap: the root is the worst of the best `n` keys kept so far.
    cdef Py_ssize_t child
    cdef uint64_t v = heap[i]
    while True:
        child = 2 * i + 1
        if child >= n:
            break
        if child + 1 < n and heap[child + 1] > heap[child]:
            child += 1
        if heap[child] <= v:
            break
        heap[i] = heap[child]
        i = child
    heap[i] = v


cdef inline int hex_digit(unsigned char c) noexcept nogil:
    # Lower-case only: the kernel names PCI functions with "%04x:%02x:%02x.%d".
    if 48 <= c <= 57:
        return c - 48
    if 97 <= c <= 102:
        return c - 87
    return -1


cdef long parse_bdf(object dev_id):
    # domain << 16 | bus << 8 | device << 3 | function of a canonical PCI address, else -1.
    if not PyUnicode_CheckExact(dev_id) or PyUnicode_GET_LENGTH(dev_id) != 12:
        return -1
    if PyUnicode_KIND(dev_id) != PyUnicode_1BYTE_KIND:
        return -1
    cdef const unsigned char* p = <const unsigned char*>PyUnicode_DATA(dev_id)
    if p[4] != 58 or p[7] != 58 or p[10] != 46 or not (48 <= p[11] <= 55):
        return -1
    cdef int i, h
    cdef long domain = 0, bus = 0, device = 0
    for i in range(4):
        h = hex_digit(p[i])
        if h < 0:
            return -1
        domain = domain * 16 + h
    for i in range(5, 7):
        h = hex_digit(p[i])
        if h < 0:
            return -1
        bus = bus * 16 + h
    for i in range(8, 10):
        h = hex_digit(p[i])
        if h < 0:
            return -1
        device = device * 16 + h
    if device > 0x1F:
        return -1
    return domain << 16 | bus << 8 | device << 3 | (p[11] - 48)


cdef Py_ssize_t member_of(dict index, object dev_id, Py_ssize_t members,
                              const char* lookup, Py_ssize_t nblocks) except -2:
    cdef PyObject* hit
    cdef Py_ssize_t m, b
    cdef long bdf = parse_bdf(dev_id) if nblocks else -1
    cdef uint32_t domain
    cdef int32_t v
    m = -1
    hit = NULL
    if bdf >= 0:
        for b in range(nblocks):
            memcpy(&domain, lookup + b * ALLOC_LOOKUP_BLOCK, 4)
            if domain == <uint32_t>(bdf >> 16):
                memcpy(&v, lookup + b * ALLOC_LOOKUP_BLOCK + 4 + 4 * (bdf & 0xFFFF), 4)
                m = v
                break
        else:
            bdf = -1
    if bdf < 0:
        hit = PyDict_GetItem(index, dev_id)
        if hit == NULL:
            return -1
        m = <object>hit
    if m >= members:
        raise ValueError(f"index maps {dev_id!r} to {m}, beyond the topology's {members} members")
    return -1 if m < 0 else m


cdef int target_numa(const Py_ssize_t* counts) noexcept nogil:
    # counts[n + 1] for NUMA node n (-1 .. 1023); the highest wins, the lowest id on ties; -2: none.
    cdef int best = -2
    cdef Py_ssize_t best_count = 0, i
    for i in range(ALLOC_MAX_NUMA + 1):
        if counts[i] > best_count:
            best = <int>i - 1
            best_count = counts[i]
    return best


def pick_devices(available, must_include, Py_ssize_t size, index, bytes topology, int policy,
                 bytes lookup=b""):
    """Return the preferred IDs: the must-includes, then the best-ranked free IDs up to ``size``."""
    if policy != ALLOC_POLICY_PACK and policy != ALLOC_POLICY_SPREAD and policy != ALLOC_POLICY_NONE:
        raise ValueError(f"unknown preferred-allocation policy {policy}")
    cdef Py_ssize_t tlen = len(topology)
    if tlen % 12:
        raise ValueError(f"topology is {tlen} bytes, not a whole number of int32 triples")
    if len(lookup) % ALLOC_LOOKUP_BLOCK:
        raise ValueError(
            f"lookup is {len(lookup)} bytes, not a whole number of {ALLOC_LOOKUP_BLOCK}-byte blocks")
    cdef Py_ssize_t nblocks = len(lookup) // ALLOC_LOOKUP_BLOCK
    cdef const char* lk = lookup
    cdef Py_ssize_t members = tlen // 12
    if not isinstance(index, dict):
        index = dict(index)
    if not isinstance(available, (list, tuple)):
        available = list(available)
    cdef Py_ssize_t navail = len(available)
    if <uint64_t>members > ALLOC_MAX_MEMBERS or <uint64_t>navail > ALLOC_MAX_MEMBERS:
        raise ValueError(f"at most {ALLOC_MAX_MEMBERS} devices per pool are supported")

    cdef alloc_topo* topo = <alloc_topo*>malloc(max(members, 1) * sizeof(alloc_topo))
    cdef char* taken = <char*>calloc(max(members, 1), 1)
    cdef Py_ssize_t* free_pos = <Py_ssize_t*>malloc(max(navail, 1) * sizeof(Py_ssize_t))
    cdef Py_ssize_t* free_m = <Py_ssize_t*>malloc(max(navail, 1) * sizeof(Py_ssize_t))
    cdef Py_ssize_t* must = <Py_ssize_t*>malloc(max(len(must_include), 1) * sizeof(Py_ssize_t))
    if topo == NULL or taken == NULL or free_pos == NULL or free_m == NULL or must == NULL:
        free(topo); free(taken); free(free_pos); free(free_m); free(must)
        raise MemoryError()
    cdef Py_ssize_t i, m, nfree = 0, nmust = 0, need
    cdef list chosen = []
    cdef set seen_unknown = set()
    cdef list unknown = []
    cdef tuple picked
    try:
        memcpy(topo, <const char*>topology, tlen)
        for i in range(members):
            if not -1 <= topo[i].numa < ALLOC_MAX_NUMA:
                raise ValueError(f"NUMA node {topo[i].numa} out of range [-1, {ALLOC_MAX_NUMA})")
            # Dense ids: there are never more roots or PF groups than members.
            if not (0 <= topo[i].root < members and 0 <= topo[i].pf < members):
                raise ValueError(f"root {topo[i].root} / pf {topo[i].pf} out of range [0, {members})")

        for dev_id in must_include:
            m = member_of(index, dev_id, members, lk, nblocks)
            if m < 0:
                if dev_id in seen_unknown:
                    continue
                seen_unknown.add(dev_id)
            elif taken[m]:
                continue
            else:
                taken[m] = 1
                must[nmust] = m
                nmust += 1
            chosen.append(dev_id)
        need = size - len(chosen)
        if need <= 0:
            return tuple(chosen)

        for i in range(navail):
            dev_id = available[i]
            m = member_of(index, dev_id, members, lk, nblocks)
            if m < 0:
                if dev_id not in seen_unknown:
                    seen_unknown.add(dev_id)
                    unknown.append(dev_id)
            elif not taken[m]:
                taken[m] = 1
                free_pos[nfree] = i
                free_m[nfree] = m
                nfree += 1

        if policy == ALLOC_POLICY_NONE:
            for i in range(min(need, nfree)):
                chosen.append(available[free_pos[i]])
        else:
            picked = rank_members(topo, members, free_pos, free_m, nfree, must, nmust, need, policy)
            for i in picked:
                chosen.append(available[i])
        if size - len(chosen) > 0:
            chosen.extend(unknown[:size - len(chosen)])
        return tuple(chosen)
    finally:
        free(topo); free(taken); free(free_pos); free(free_m); free(must)


cdef tuple rank_members(const alloc_topo* topo, Py_ssize_t members, const Py_ssize_t* free_pos,
                       const Py_ssize_t* free_m, Py_ssize_t nfree, const Py_ssize_t* must, Py_ssize_t nmust,
                       Py_ssize_t need, int policy):
    # Positions (in `available`) of the `need` smallest device keys, best first.
    cdef Py_ssize_t* numa_counts = <Py_ssize_t*>calloc(ALLOC_MAX_NUMA + 1, sizeof(Py_ssize_t))
    # Per PF id (< members): free count (-1: no free device), NUMA, root, must-includes on it, rank.
    cdef Py_ssize_t* pf_count = <Py_ssize_t*>malloc(max(members, 1) * sizeof(Py_ssize_t))
    cdef int32_t* pf_numa = <int32_t*>malloc(max(members, 1) * sizeof(int32_t))
    cdef int32_t* pf_root = <int32_t*>malloc(max(members, 1) * sizeof(int32_t))
    cdef Py_ssize_t* pf_must = <Py_ssize_t*>calloc(max(members, 1), sizeof(Py_ssize_t))
    cdef char* root_must = <char*>calloc(max(members, 1), 1)
    cdef uint64_t* pf_keys = <uint64_t*>malloc(max(members, 1) * sizeof(uint64_t))
    cdef Py_ssize_t kheap = min(need, nfree)
    cdef uint64_t* heap = <uint64_t*>malloc(max(kheap, 1) * sizeof(uint64_t))
    if (numa_counts == NULL or pf_count == NULL or pf_numa == NULL or pf_root == NULL or pf_must == NULL
            or root_must == NULL or pf_keys == NULL or heap == NULL):
        free(numa_counts); free(pf_count); free(pf_numa); free(pf_root); free(pf_must)
        free(root_must); free(pf_keys); free(heap)
        raise MemoryError()
    cdef Py_ssize_t i, m, npf = 0, nheap = 0
    cdef int32_t pf, root
    cdef int target
    cdef uint64_t key, count, other, fits, r
    cdef Py_ssize_t* rank = pf_count  # reused once counts are folded into the PF keys
    cdef list out
    try:
        with nogil:
            if nmust:
                for i in range(nmust):
                    numa_counts[topo[must[i]].numa + 1] += 1
            else:
                for i in range(nfree):
                    numa_counts[topo[free_m[i]].numa + 1] += 1
            target = target_numa(numa_counts)
            for i in range(members):
                pf_count[i] = -1
            for i in range(nmust):
                pf_must[topo[must[i]].pf] += 1
                root_must[topo[must[i]].root] = 1
            for i in range(nfree):
                m = free_m[i]
                pf = topo[m].pf
                if pf_count[pf] < 0:
                    pf_count[pf] = 0
                    pf_numa[pf] = topo[m].numa
                    pf_root[pf] = topo[m].root
                pf_count[pf] += 1

            for pf in range(members):
                if pf_count[pf] < 0:
                    continue
                count = <uint64_t>pf_count[pf]
                other = pf_numa[pf] != target
                root = pf_root[pf]
                if policy == ALLOC_POLICY_PACK:
                    fits = count >= <uint64_t>need
                    key = ((other << 63) | (<uint64_t>(pf_must[pf] == 0) << 62)
                           | (<uint64_t>(root_must[root] == 0) << 61) | ((1 - fits) << 60)
                           | ((count if fits else ALLOC_MAX_MEMBERS - count) << (2 * ALLOC_F20))
                           | (<uint64_t>root << ALLOC_F20) | <uint64_t>pf)
                else:
                    key = ((other << 63) | ((ALLOC_MAX_MEMBERS - count) << (2 * ALLOC_F20))
                           | (<uint64_t>root << ALLOC_F20) | <uint64_t>pf)
                pf_keys[npf] = key
                npf += 1
            qsort(pf_keys, npf, sizeof(uint64_t), cmp_u64)
            for i in range(npf):
                rank[pf_keys[i] & ALLOC_MAX_MEMBERS] = i

            # The rounds of spread reuse pf_must: must-includes on a PF count as its first rounds.
            for i in range(nfree):
                m = free_m[i]
                pf = topo[m].pf
                if policy == ALLOC_POLICY_PACK:
                    key = (<uint64_t>rank[pf] << ALLOC_F20) | <uint64_t>free_pos[i]
                else:
                    r = <uint64_t>pf_must[pf]
                    pf_must[pf] += 1
                    if r > ALLOC_MAX_ROUND:
                        r = ALLOC_MAX_ROUND
                    other = topo[m].numa != target
                    key = ((other << 56) | (r << (2 * ALLOC_F20)) | (<uint64_t>rank[pf] << ALLOC_F20)
                           | <uint64_t>free_pos[i])
                if nheap < kheap:
                    # Grow the max-heap: sift the new key up.
                    heap[nheap] = key
                    nheap += 1
                    sift_up(heap, nheap - 1)
                elif kheap and key < heap[0]:
                    heap[0] = key
                    sift_down(heap, nheap, 0)
            qsort(heap, nheap, sizeof(uint64_t), cmp_u64)
        out = [None] * nheap
        for i in range(nheap):
            out[i] = <Py_ssize_t>(heap[i] & ALLOC_MAX_MEMBERS)
        return tuple(out)
    finally:
        free(numa_counts); free(pf_count); free(pf_numa); free(pf_root); free(pf_must)
        free(root_must); free(pf_keys); free(heap)
