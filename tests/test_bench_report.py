"""bench/run_all.py keeps every JSON document a benchmark prints, and bench/report.py draws a recorded run
as an HTML page whose plots are files beside it, embedded and linked, or a stated reason why not."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
RECORDED = Path(__file__).resolve().parent / "data" / "bench" / "run_quick.jsonl"
PLOTS = {"scan", "e2e_cdf", "startup", "idle", "preferred"}
E2E_PLOTS = {"e2e_cdf", "startup", "idle"}
SKIP_NOTE = "bench_e2e: needs root and iproute2 (network namespaces); skipped"


def _module(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}_under_test", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve their string annotations through it
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def report() -> ModuleType:
    """bench/report.py, when matplotlib can draw; the test skips (saying why) when it cannot."""
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install -e '.[bench]')")
    return _module("report")


def _recorded() -> list[dict[str, Any]]:
    return [json.loads(line) for line in RECORDED.read_text().splitlines()]


def _section(page: str, name: str) -> str:
    start = page.index(f'<section id="{name}">')
    return page[start : page.index("</section>", start)]


def test_run_all_records_indented_documents_and_skips(tmp_path: Path) -> None:
    # Before: only lines starting with "{" were kept, so bench_scan's and bench_preferred's indented
    # JSON was recorded as a bare "{" line, and a script that skipped (bench_e2e without root) left
    # no trace of why.
    bench = tmp_path / "bench"
    bench.mkdir()
    shutil.copy(BENCH / "run_all.py", bench)
    shutil.copy(BENCH / "report.py", bench)
    doc = {"nodes": [{"vfs": 1024, "python_best_ms": 70.0}], "rdma": True}
    (bench / "bench_a.py").write_text(
        "import json\n"
        "print('### bench_a.py: measuring the Cython extension (x.so)')\n"
        "print('a table {with braces} in prose')\n"
        f"print(json.dumps({doc!r}, indent=2))\n"
        "print(json.dumps({'one': 1}))\n"
    )
    (bench / "bench_b.py").write_text(f"import sys\nprint({SKIP_NOTE!r}, file=sys.stderr)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, str(bench / "run_all.py"), "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (results,) = (bench / "results").glob("*.jsonl")
    records = [json.loads(line) for line in results.read_text().splitlines()]
    scripts = [r for r in records if "script" in r]
    assert [(r["script"], r["result"]) for r in scripts] == [
        ("bench_a", doc),
        ("bench_a", {"one": 1}),
        ("bench_b", None),
    ]
    assert scripts[0]["banner"] == "bench_a.py: measuring the Cython extension (x.so)"
    assert scripts[2]["note"] == SKIP_NOTE and scripts[2]["exit"] == 0
    assert records[0]["run"]["argv"] == ["--json"]


def test_e2e_sizes_become_node_shapes() -> None:
    run_all = _module("run_all")
    assert run_all.e2e_shape(16384) == ["--pfs", "64", "--vfs-per-pf", "256"]
    assert run_all.e2e_shape(320) == ["--pfs", "5", "--vfs-per-pf", "64"]
    proc = subprocess.run(
        [sys.executable, str(BENCH / "run_all.py"), "--e2e-sizes", "1000"], capture_output=True, text=True
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines()[-1].endswith(
        "'1000': each size a positive multiple of 64 (PFs of 64 or 256 VFs)"
    )


def test_a_recorded_run_draws_every_plot(report: ModuleType, tmp_path: Path) -> None:
    records = _recorded()
    page = report.build(records, tmp_path / "out", source=RECORDED.name)
    assert report.check(tmp_path / "out") == []
    assert {p.stem for p in (tmp_path / "out").glob("*.png")} == PLOTS
    text = page.read_text()
    for name in PLOTS:
        assert "<img " in _section(text, name) and 'class="missing"' not in _section(text, name)
    # Captions come from the figures: the recorded twin/extension ratio and the largest e2e node's p99.
    (scan,) = [r["result"] for r in records if r.get("script") == "bench_scan"]
    assert f"Twin time over extension time: {scan['nodes'][0]['ratio']} at 1,024 VFs." in _section(
        text, "scan"
    )
    e2e = max((r["result"] for r in records if r.get("script") == "bench_e2e"), key=lambda d: d["devices"])
    assert f"p99 {e2e['down_p99_ms']} ms" in _section(text, "e2e_cdf")
    assert "--e2e-sizes" not in _section(text, "startup")  # two node sizes were measured: a trend, no hint


def test_a_run_without_e2e_says_why_and_drops_stale_plots(report: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "out"
    report.build(_recorded(), out)  # a full report first: its e2e plots must not survive the next one
    records = [r for r in _recorded() if r.get("script") not in ("bench_e2e", "bench_preferred")]
    records.append(
        {"script": "bench_e2e", "args": [], "exit": 0, "seconds": 0.1, "result": None, "note": SKIP_NOTE}
    )
    text = report.build(records, out).read_text()
    assert report.check(out) == []
    assert {p.stem for p in out.glob("*.png")} == {"scan"}
    for name in E2E_PLOTS:
        section = _section(text, name)
        assert 'class="missing"' in section and SKIP_NOTE in section and "<img " not in section
    assert "bench_preferred did not run in this run" in _section(text, "preferred")


def test_percentiles_alone_still_draw(report: ModuleType, tmp_path: Path) -> None:
    # A run recorded before bench_e2e kept its samples: the distribution is drawn from its percentiles.
    records = _recorded()
    for r in records:
        if r.get("script") == "bench_e2e":
            r["result"] = {k: v for k, v in r["result"].items() if k not in ("down_ms", "up_ms")}
    text = report.build(records, tmp_path / "out").read_text()
    assert report.check(tmp_path / "out") == []
    assert "Only percentiles were recorded for 256, 512 VFs" in _section(text, "e2e_cdf")


def test_check_finds_a_broken_report(report: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "out"
    report.build(_recorded(), out)
    (out / "startup.png").unlink()
    (out / "idle.png").write_bytes((out / "scan.png").read_bytes())
    shutil.copy(out / "scan.png", out / "stray.png")
    assert report.check(out) == [
        "startup.png: referenced by the page, not in " + str(out),
        "idle.png: the page embeds another image than the file",
        "stray.png: in " + str(out) + " but not on the page",
    ]
    proc = subprocess.run(
        [sys.executable, str(BENCH / "report.py"), "--check", str(out)], capture_output=True, text=True
    )
    assert proc.returncode == 1 and len(proc.stderr.splitlines()) == 3
    (out / "index.html").unlink()
    assert report.check(out) == [f"{out / 'index.html'}: missing"]


def test_missing_matplotlib_is_one_line_before_any_benchmark(tmp_path: Path) -> None:
    fake = tmp_path / "site" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        "raise ImportError('No module named matplotlib (planted by the test)')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    for argv in (
        [str(BENCH / "run_all.py"), "--quick", "--report", str(tmp_path / "out")],
        [str(BENCH / "report.py"), str(RECORDED), str(tmp_path / "out")],
    ):
        proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, timeout=60)
        assert proc.returncode == 2 and proc.stdout == "", proc.stdout
        (line,) = proc.stderr.splitlines()
        assert "needs matplotlib" in line and "pip install -e '.[bench]'" in line
    assert not (tmp_path / "out").exists()


def test_an_unreadable_results_file_is_one_line(report: ModuleType, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"run": {}}\n{"script": \n')
    proc = subprocess.run(
        [sys.executable, str(BENCH / "report.py"), str(bad), str(tmp_path / "out")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"report.py: cannot read {bad}: ")
