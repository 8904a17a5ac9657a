"""A broken extension build is said once at warning level, and benchmarks refuse to measure the twin
by accident."""

from __future__ import annotations

import importlib.machinery
import os
import shutil
import subprocess
import sys
from pathlib import Path

import densedev

SRC = Path(densedev.__file__).resolve().parent
BENCH = Path(__file__).resolve().parents[1] / "bench"
PROBE = "import densedev.accel as a; print(a.IMPLEMENTATION)"


def _copy_tree(dest: Path, with_so: bytes | None) -> Path:
    """Copy the package without any built extension, then plant ``with_so`` as one when given."""
    pkg = dest / "src" / "densedev"
    shutil.copytree(SRC, pkg, ignore=shutil.ignore_patterns("*.so", "__pycache__", "*.c"))
    if with_so is not None:
        (pkg / f"_fast{importlib.machinery.EXTENSION_SUFFIXES[0]}").write_bytes(with_so)
    return dest / "src"


def _probe(src: Path, **env: str) -> subprocess.CompletedProcess[str]:
    child = {k: v for k, v in os.environ.items() if k != "DENSEDEV_NO_EXTENSIONS"}
    child.update(PYTHONPATH=str(src), **env)
    return subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, env=child, timeout=60, cwd=src
    )


def test_a_broken_extension_is_logged_once_at_warning(tmp_path: Path) -> None:
    src = _copy_tree(tmp_path, b"\x7fELF not really a shared object")
    proc = _probe(src)
    assert proc.stdout.strip() == "python"
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr  # before: nothing at all, the twin ran silently
    assert "running the plain-Python twin: the built extension does not load" in lines[0]
    # Asked for explicitly, the twin stays silent.
    asked = _probe(src, DENSEDEV_NO_EXTENSIONS="1")
    assert asked.stdout.strip() == "python" and asked.stderr == ""


def test_a_missing_extension_is_silent_for_the_library(tmp_path: Path) -> None:
    proc = _probe(_copy_tree(tmp_path, None))
    assert proc.stdout.strip() == "python" and proc.stderr == ""


def test_a_benchmark_refuses_to_measure_the_twin_unasked(tmp_path: Path) -> None:
    _copy_tree(tmp_path, None)
    shutil.copytree(BENCH, tmp_path / "bench", ignore=shutil.ignore_patterns("results", "__pycache__"))
    env = {k: v for k, v in os.environ.items() if k not in ("DENSEDEV_NO_EXTENSIONS", "PYTHONPATH")}
    script = str(tmp_path / "bench" / "bench_wire.py")
    proc = subprocess.run(
        [sys.executable, script, "--quick"], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 1 and proc.stdout == ""
    assert "the Cython extension is not available" in proc.stderr.strip().splitlines()[-1]
    assert "setup.py build_ext --inplace" in proc.stderr
    twin = subprocess.run(
        [sys.executable, script, "--quick"],
        capture_output=True,
        text=True,
        env={**env, "DENSEDEV_NO_EXTENSIONS": "1"},
        timeout=120,
    )
    assert twin.returncode == 0, twin.stderr
    assert twin.stdout.startswith("### bench_wire.py: measuring the PLAIN-PYTHON TWIN")
