# Bitmaps over device-table indexes; twin and spec: densedev/_fast_py/bitmap.py.
# Bit i is bit (i % 8) of byte (i // 8).  Whole bitmaps are walked as 64-bit words: loaded with
# memcpy (no alignment assumption on the bytes buffer) and read as little-endian words, which is the
# byte order of every platform densedev ships for (x86-64, arm64), so bit j of word w is index 64*w + j.

from libc.stdint cimport uint8_t, uint64_t
from libc.string cimport memcpy
from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING
from cpython.mem cimport PyMem_Malloc, PyMem_Free


cdef extern from *:
    int __builtin_ctzll(unsigned long long x) nogil


cdef inline uint64_t load_word(const uint8_t* p, Py_ssize_t nbytes, Py_ssize_t w) noexcept nogil:
    # The last word of a bitmap whose length is not a multiple of 8 is zero-padded.
    cdef uint64_t v = 0
    cdef Py_ssize_t off = w * 8
    cdef Py_ssize_t n = nbytes - off
    if n >= 8:
        memcpy(&v, p + off, 8)
    else:
        memcpy(&v, p + off, n)
    return v


cdef Py_ssize_t check_lengths(dict named) except -1:
    cdef Py_ssize_t size = -1
    cdef bint differ = False
    for b in named.values():
        if size == -1:
            size = len(b)
        elif len(b) != size:
            differ = True
    if differ:
        shown = ", ".join(f"{name} {len(b)} bytes" for name, b in named.items())
        raise ValueError(f"bitmaps differ in length: {shown}")
    return 0 if size == -1 else size


cdef tuple set_indexes(const uint8_t* a, const uint8_t* b, const uint8_t* m, Py_ssize_t nbytes):
    # Indexes of set bits of (a ^ b) & m, or of a & m when b is NULL, ascending.
    cdef list out = []
    cdef Py_ssize_t w, nwords = (nbytes + 7) // 8
    cdef uint64_t x
    for w in range(nwords):
        x = load_word(a, nbytes, w)
        if b != NULL:
            x ^= load_word(b, nbytes, w)
        x &= load_word(m, nbytes, w)
        while x:
            out.append(w * 64 + __builtin_ctzll(x))
            x &= x - 1
    return tuple(out)


def diff_bitmaps(bytes old, bytes new, bytes mask):
    """Return the ascending indexes of bits that differ between ``old`` and ``new`` within ``mask``."""
    cdef Py_ssize_t n = check_lengths({"old": old, "new": new, "mask": mask})
    return set_indexes(<const uint8_t*>PyBytes_AS_STRING(old), <const uint8_t*>PyBytes_AS_STRING(new),
                       <const uint8_t*>PyBytes_AS_STRING(mask), n)


def select_bits(bytes bitmap, bytes mask):
    """Return the ascending indexes of bits set in ``bitmap`` within ``mask``."""
    cdef Py_ssize_t n = check_lengths({"bitmap": bitmap, "mask": mask})
    return set_indexes(<const uint8_t*>PyBytes_AS_STRING(bitmap), NULL,
                       <const uint8_t*>PyBytes_AS_STRING(mask), n)


def or_bitmaps(bitmaps, bytes mask):
    """Return the OR of ``bitmaps`` restricted to ``mask`` (bits outside the mask are clear)."""
    cdef list items = list(bitmaps)
    cdef dict named = {"mask": mask}
    cdef Py_ssize_t i, nmaps = len(items)
    for i in range(nmaps):
        b = items[i]
        if not isinstance(b, bytes):
            raise TypeError(f"bitmaps[{i}] must be bytes, not {type(b).__name__}")
        named[f"bitmaps[{i}]"] = b
    cdef Py_ssize_t n = check_lengths(named)
    # A fresh object (NULL source), never CPython's shared empty or 1-byte bytes, so writing is safe.
    cdef bytes out = PyBytes_FromStringAndSize(NULL, n)
    cdef uint8_t* o = <uint8_t*>PyBytes_AS_STRING(out)
    cdef const uint8_t* m = <const uint8_t*>PyBytes_AS_STRING(mask)
    cdef const uint8_t** ptrs = <const uint8_t**>PyMem_Malloc((nmaps + 1) * sizeof(const uint8_t*))
    if ptrs == NULL:
        raise MemoryError()
    cdef Py_ssize_t w, k, nwords = n // 8
    cdef uint64_t acc, word
    try:
        for i in range(nmaps):
            ptrs[i] = <const uint8_t*>PyBytes_AS_STRING(items[i])
        # Whole 64-bit words first (one pass over every input per word), then the tail bytes.
        for w in range(nwords):
            acc = 0
            for i in range(nmaps):
                memcpy(&word, ptrs[i] + w * 8, 8)
                acc |= word
            memcpy(&word, m + w * 8, 8)
            acc &= word
            memcpy(o + w * 8, &acc, 8)
        for k in range(nwords * 8, n):
            o[k] = 0
            for i in range(nmaps):
                o[k] |= ptrs[i][k]
            o[k] &= m[k]
    finally:
        PyMem_Free(ptrs)
    return out


def set_bits(bytes bitmap, indexes, bint value):
    """Return a copy of ``bitmap`` with the bits at ``indexes`` set (``value`` true) or cleared."""
    cdef Py_ssize_t n = len(bitmap)
    # Allocate empty then copy: given a 1-byte source, PyBytes_FromStringAndSize returns CPython's
    # shared single-character bytes object, which must never be written to.
    cdef bytes out = PyBytes_FromStringAndSize(NULL, n)
    cdef uint8_t* o = <uint8_t*>PyBytes_AS_STRING(out)
    if n:
        memcpy(o, PyBytes_AS_STRING(bitmap), n)
    cdef long long size = n * 8
    cdef long long i
    for obj in indexes:
        try:
            i = obj
        except OverflowError:
            raise IndexError(f"bit index {obj} outside a bitmap of {size} bits") from None
        if i < 0 or i >= size:
            raise IndexError(f"bit index {i} outside a bitmap of {size} bits")
        if value:
            o[i >> 3] |= <uint8_t>(1 << (i & 7))
        else:
            o[i >> 3] &= <uint8_t>~(1 << (i & 7))
    return out
