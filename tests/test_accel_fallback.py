"""The seam: the extension and its twin export one list of functions with the same signatures (and
_fast.pyi says so too), a broken extension build is said once at warning level, and benchmarks refuse
to measure the twin by accident."""

from __future__ import annotations

import ast
import importlib.machinery
import inspect
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import densedev
from densedev import _fast_py, accel

SRC = Path(densedev.__file__).resolve().parent
BENCH = Path(__file__).resolve().parents[1] / "bench"
PROBE = "import densedev.accel as a; print(a.IMPLEMENTATION)"


def _public_functions(module: ModuleType) -> set[str]:
    return {n for n, v in vars(module).items() if not n.startswith("_") and inspect.isroutine(v)}


def _shape(sig: inspect.Signature) -> list[tuple[str, object, object]]:
    # What a caller can rely on: names, positional/keyword kinds and defaults (the extension's
    # parameters carry C types, not annotations; _fast.pyi holds the annotations, checked below).
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()]


def test_one_list_of_mirrored_functions() -> None:
    mirrored = _fast_py.MIRRORED
    assert len(set(mirrored)) == len(mirrored) and list(mirrored) == _fast_py.__all__
    assert _public_functions(_fast_py) == set(mirrored)
    assert set(accel.__all__) - set(mirrored) == {
        "DETAIL",
        "FALLBACK_REASON",
        "IMPLEMENTATION",
        "NO_EXTENSIONS",
        "impl",
    }
    for name in mirrored:
        assert getattr(accel, name) is getattr(accel.impl, name), name


def test_extension_and_twin_export_the_same_functions_and_signatures(
    both: tuple[ModuleType, ModuleType],
) -> None:
    fast, twin = both
    assert fast.__all__ == twin.__all__
    assert _public_functions(fast) == set(twin.MIRRORED)
    for name in twin.MIRRORED:
        assert _shape(inspect.signature(getattr(fast, name))) == _shape(
            inspect.signature(getattr(twin, name))
        ), name


def test_stub_agrees_with_the_twin() -> None:
    # The twin uses postponed annotations, so inspect hands back their source text, as ast.unparse does
    # the stub's.
    tree = ast.parse((SRC / "_fast.pyi").read_text())
    stubs = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    assert set(stubs) == set(_fast_py.MIRRORED)
    for name, node in stubs.items():
        sig = inspect.signature(getattr(_fast_py, name))
        args = node.args
        defaults = [None] * (len(args.args) - len(args.defaults)) + list(args.defaults)
        stub = [
            (
                a.arg,
                ast.unparse(a.annotation) if a.annotation else None,
                None if d is None else ast.literal_eval(d),
            )
            for a, d in zip(args.args, defaults, strict=True)
        ]
        twin = [
            (p.name, p.annotation, None if p.default is inspect.Parameter.empty else p.default)
            for p in sig.parameters.values()
        ]
        assert stub == twin, name
        assert node.returns is not None and ast.unparse(node.returns) == sig.return_annotation, name


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
