"""Run every benchmark under bench/ and print their figures (``--quick`` for a smoke run of each).

    python bench/run_all.py [--quick] [--json] [--report DIR] [--e2e-sizes 1024,4096,16384]

Each script prints its own figures; with ``--json`` each prints JSON documents (one per line or
indented), collected here into ``bench/results/<timestamp>.jsonl``: one record per document, naming the
script, its exit code and wall time, and one record for a script that printed none (with its stderr's
last line: why it skipped).  ``--report DIR`` implies ``--json`` and draws the run as an HTML page with
plots in DIR (bench/report.py; needs matplotlib: ``pip install -e '.[bench]'``).  ``--e2e-sizes`` runs
the end-to-end benchmark once per node size (VF counts), so start-up, idle CPU and memory can be drawn
against node size (bench_startup.py measures start-up alone at 1k/4k/16k VFs, with import time).  A
script that fails is reported and the others still run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

# bench_e2e's own sizes: --quick is 8 PFs x 64 VFs, 20 flips, 3 s idle; a full run 64 x 256, 100, 60 s.
E2E_QUICK = ("--flips", "20", "--idle", "3")


def parse_documents(stdout: str) -> list[dict[str, Any]]:
    """Every JSON object a script printed, whether on one line or indented over many (``indent=2``)."""
    decoder = json.JSONDecoder()
    docs: list[dict[str, Any]] = []
    pos = 0
    while pos < len(stdout):
        # A document starts at a line's first column; anything else (the "###" banner, tables) is prose.
        start = stdout.find("{", pos)
        if start < 0:
            break
        if start > 0 and stdout[start - 1] != "\n":
            pos = stdout.find("\n", start)
            pos = len(stdout) if pos < 0 else pos
            continue
        try:
            doc, end = decoder.raw_decode(stdout, start)
        except json.JSONDecodeError:
            pos = start + 1
            continue
        if isinstance(doc, dict):
            docs.append(doc)
        pos = end
    return docs


def e2e_sizes(text: str) -> list[int]:
    """``--e2e-sizes``: comma-separated VF counts, each a positive multiple of 64."""
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated VF counts, e.g. 1024,4096") from None
    bad = [s for s in sizes if s <= 0 or s % 64]
    if bad or not sizes:
        raise argparse.ArgumentTypeError(
            f"{text!r}: each size a positive multiple of 64 (PFs of 64 or 256 VFs)"
        )
    return sizes


def e2e_shape(vfs: int) -> list[str]:
    """bench_e2e's flags for a node of ``vfs`` VFs: 256 VFs per PF as on the README's node, else 64."""
    per_pf = 256 if vfs % 256 == 0 else 64
    return ["--pfs", str(vfs // per_pf), "--vfs-per-pf", str(per_pf)]


def plan(args: argparse.Namespace) -> list[tuple[Path, list[str]]]:
    """Each script to run with its flags; bench_e2e once per ``--e2e-sizes`` entry when given."""
    flags = (["--quick"] if args.quick else []) + (["--json"] if args.json else [])
    runs: list[tuple[Path, list[str]]] = []
    for script in sorted(HERE.glob("bench_*.py")):
        if script.name == "bench_e2e.py" and args.e2e_sizes:
            # --quick would override the node's shape, so a quick sweep passes the quick counts itself.
            extra = [f for f in flags if f != "--quick"] + (list(E2E_QUICK) if args.quick else [])
            runs += [(script, [*e2e_shape(vfs), *extra]) for vfs in args.e2e_sizes]
        else:
            runs.append((script, flags))
    return runs


def main() -> int:
    """Run each bench_*.py in turn; exit non-zero if any failed."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke sizes of every benchmark")
    p.add_argument("--json", action="store_true", help="collect JSON results into bench/results/")
    p.add_argument("--report", type=Path, metavar="DIR", help="write an HTML page with plots to DIR")
    p.add_argument("--e2e-sizes", type=e2e_sizes, metavar="VFS,...", help="run bench_e2e at each node size")
    args = p.parse_args()
    if args.report is not None:
        args.json = True
        import report  # bench/ is on sys.path: the script's own directory

        missing = report.matplotlib_missing()
        if missing:  # say so before minutes of benchmarks, not after
            print(f"run_all.py: --report {missing}", file=sys.stderr)
            return 2
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(HERE.parent / "src"), env.get("PYTHONPATH", "")) if x)
    started = time.time()
    records: list[dict[str, Any]] = [
        {
            "run": {
                "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
                "argv": sys.argv[1:],
                "quick": args.quick,
                "host": platform.node(),
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "no_extensions": env.get("DENSEDEV_NO_EXTENSIONS", "") not in ("", "0"),
            }
        }
    ]
    failed: list[str] = []
    for script, flags in plan(args):
        print(f"== {script.name} {' '.join(flags)}", flush=True)
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, str(script), *flags], env=env, capture_output=True, text=True)
        seconds = round(time.perf_counter() - t0, 1)
        sys.stdout.write(proc.stdout)
        if proc.returncode:
            failed.append(script.name)
            sys.stdout.write(proc.stderr[-2000:])
        base = {"script": script.stem, "args": flags, "exit": proc.returncode, "seconds": seconds}
        banner = next((ln[4:] for ln in proc.stdout.splitlines() if ln.startswith("### ")), "")
        if banner:  # which implementation the script measured (bench/_impl.py's first line)
            base["banner"] = banner
        docs = parse_documents(proc.stdout) if args.json else []
        records += [{**base, "result": doc} for doc in docs]
        if args.json and not docs:
            last = next((ln for ln in reversed(proc.stderr.splitlines()) if ln.strip()), "")
            records.append({**base, "result": None, "note": last[-300:]})
        print(f"   ({seconds} s, exit {proc.returncode})", flush=True)
    if args.json:
        results = HERE / "results"
        results.mkdir(exist_ok=True)
        path = results / time.strftime("%Y%m%dT%H%M%S.jsonl", time.gmtime(started))
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        print(f"results in {path}")
        if args.report is not None:
            page = report.build(records, args.report, source=path.name)
            print(f"report in {page}")
    if failed:
        print("failed: " + ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
