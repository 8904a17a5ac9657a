"""Which implementation a benchmark measures, said loudly before any figure (shared by bench_*.py).

The scripts import densedev from ``src/``, which holds the Cython extension only after an in-place build;
without one, ``accel`` silently picks the plain-Python twin and every "extension" figure is the twin's.
So a benchmark refuses to run without the extension unless the twin was asked for explicitly
(``DENSEDEV_NO_EXTENSIONS=1``).
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

from densedev import accel  # noqa: E402

BUILD = f"{sys.executable} -m pip install 'cython>=3.0' && {sys.executable} setup.py build_ext --inplace"


def announce(script: str) -> None:
    """Print which implementation ``script`` measures; exit 2 if the extension is missing unasked."""
    name = Path(script).name
    if {"--child", "--tracker-only"} & set(sys.argv[1:]):
        return  # a script's own helper process: its parent announced, and its stdout is data
    if accel.IMPLEMENTATION == "cython":
        where = getattr(accel.impl, "__file__", "?")
        print(f"### {name}: measuring the Cython extension ({where})", flush=True)
        return
    if accel.NO_EXTENSIONS:
        print(f"### {name}: measuring the PLAIN-PYTHON TWIN (DENSEDEV_NO_EXTENSIONS is set)", flush=True)
        return
    reason = accel.FALLBACK_REASON or "not built"
    sys.exit(
        f"{name}: the Cython extension is not available in {SRC} ({reason}); these figures would be the "
        f"plain-Python twin's. Build it in place from the repository root: {BUILD} "
        "(or set DENSEDEV_NO_EXTENSIONS=1 to measure the twin on purpose)"
    )


def kept(workdir: Path) -> None:
    """Say on stderr that ``--dir`` kept the simulated nodes, how much they hold and how to free it."""
    total = 0
    for dirpath, _dirs, files in os.walk(workdir):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    where = "RAM (tmpfs)" if str(workdir.resolve()).startswith("/dev/shm") else "disk"
    print(
        f"kept the simulated nodes in {workdir} for the next run: {total / 2**20:.0f} MiB of {where}; "
        f"rm -rf {workdir} frees it",
        file=sys.stderr,
    )
