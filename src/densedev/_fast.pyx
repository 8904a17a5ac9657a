# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""densedev's Cython hot paths; ``densedev._fast_py`` is the readable twin and the spec.

Functions here are pure: bytes, ints and paths in; tuples (the scan's: ``model.Device``s) and bytes
out.  No asyncio, grpc or logging, so each can be compared with its twin, fuzzed and benchmarked alone.
The C structs, enums and inline syscall helpers the includes share are declared in ``_fast.pxd``.
"""

# The mirrored surface is listed once, in the twin; accel re-exports exactly these names.
from ._mirrored import MIRRORED as _MIRRORED

__all__ = list(_MIRRORED)

# Each hot path lives in its own include so its twin sits beside it in _fast_py/<same name>.py.
# sysio (syscalls, listings, small-file reads), workq (the one pthread work queue) and classmap (the
# class, driver and vDPA maps) serve the scan and export nothing, so they have no twin file of their own.
include "_pyx/wire.pxi"
include "_pyx/bitmap.pxi"
include "_pyx/netlink.pxi"
include "_pyx/alloc.pxi"
include "_pyx/sysio.pxi"
include "_pyx/workq.pxi"
include "_pyx/classmap.pxi"
include "_pyx/scan.pxi"
