"""Benchmark what the safe file writes cost an Allocate: device-info files and the reconcile at start.

Times, per device-info file of an Allocate of 64 devices (the Allocate path writes one per device):
  * ``plain``: the writer densedev had before issue 12 (``open(".<name>.<pid>.tmp", "wb")``, write,
    fsync, ``os.replace``), which follows symlinks and takes the umask's mode;
  * ``safe``: ``files.write_atomic`` (directory opened ``O_NOFOLLOW``, ``O_CREAT|O_EXCL|O_NOFOLLOW``
    random temporary name, fchmod, fsync, renameat, directory fsync);
  * ``unchanged``: ``files.write_atomic`` of bytes already there (a refresh: compared, not rewritten);
and the reconcile at start over a directory holding ``--leftovers`` files of a removed pool plus the
same number of another plugin's.  Run it on the filesystem the files live on (tmpfs /run: /dev/shm).

    PYTHONPATH=src python bench/bench_files.py [--quick] [--json] [--dir /dev/shm] [--leftovers 4096]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from densedev import files
from densedev.alloc import devinfo, leftovers

DOC = devinfo.document_bytes({"type": "pci", "version": "1.1.0", "pci": {"pci-address": "0000:3b:00.2"}})


def addresses(count: int) -> list[str]:
    """Return ``count`` VF-shaped PCI addresses."""
    return [f"0000:{0x18 + (i >> 8):02x}:{(i >> 3) & 0x1F:02x}.{i & 7}" for i in range(count)]


def plain_write(path: Path, data: bytes) -> None:
    """The pre-issue-12 writer, for comparison only."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def per_file(fn: Callable[[int], None], count: int, repeat: int) -> float:
    """Return the median seconds per file over ``repeat`` rounds of ``count`` files."""
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for i in range(count):
            fn(i)
        samples.append((time.perf_counter() - t0) / count)
    return statistics.median(samples)


def main() -> None:
    """Print the figures (and one JSON line with ``--json``)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", action="store_true")
    p.add_argument("--dir", type=Path, default=Path("/dev/shm") if os.path.isdir("/dev/shm") else None)
    p.add_argument("--leftovers", type=int, default=4096)
    args = p.parse_args()
    repeat = 3 if args.quick else 15
    count = 64
    leftover_count = 256 if args.quick else args.leftovers
    base = Path(tempfile.mkdtemp(prefix="densedev-bench-files-", dir=args.dir))
    try:
        d = base / "devinfo"
        files.ensure_dir(d)
        names = [devinfo.file_name("example.com", "vf", a) for a in addresses(count)]
        plain = per_file(
            lambda i: plain_write(d / names[i], DOC + str(time.perf_counter()).encode()), count, repeat
        )
        safe = per_file(
            lambda i: files.write_atomic(d, names[i], DOC + str(time.perf_counter()).encode()), count, repeat
        )
        per_file(lambda i: files.write_atomic(d, names[i], DOC), count, 1)  # make every file DOC
        unchanged = per_file(lambda i: files.write_atomic(d, names[i], DOC), count, repeat)

        r = base / "reconcile"
        files.ensure_dir(r)
        devinfo.write_owners(r, ["example.com-gone"])
        for a in addresses(leftover_count):
            files.write_atomic(r, devinfo.file_name("example.com", "gone", a), DOC)
            files.write_atomic(r, devinfo.file_name("intel.com", "other_plugin", a), DOC)
        claim = leftovers.PoolClaim("", "example.com-kept", frozenset(addresses(leftover_count)))
        t0 = time.perf_counter()
        result = leftovers.reconcile(None, r, [claim])
        reconcile_s = time.perf_counter() - t0
        assert len(result.removed) == leftover_count, len(result.removed)
    finally:
        shutil.rmtree(base, ignore_errors=True)

    where = str(args.dir or tempfile.gettempdir())
    print(f"device-info file write on {where}, Allocate of {count} devices, median of {repeat}:")
    print(f"  plain (pre-issue-12) {plain * 1e6:8.1f} us/file")
    print(f"  safe (files.write_atomic) {safe * 1e6:8.1f} us/file   ({safe / plain:.2f}x plain)")
    print(f"  unchanged (compare only) {unchanged * 1e6:8.1f} us/file")
    print(
        f"reconcile at start: {leftover_count} leftover files removed among {2 * leftover_count}: "
        f"{reconcile_s * 1e3:.1f} ms"
    )
    if args.json:
        print(
            json.dumps(
                {
                    "bench": "files",
                    "dir": where,
                    "plain_us_per_file": plain * 1e6,
                    "safe_us_per_file": safe * 1e6,
                    "unchanged_us_per_file": unchanged * 1e6,
                    "reconcile_files": 2 * leftover_count,
                    "reconcile_ms": reconcile_s * 1e3,
                }
            )
        )


if __name__ == "__main__":
    main()
