"""Run every benchmark under bench/ and print their figures (``--quick`` for a smoke run of each).

    python bench/run_all.py [--quick] [--json]

Each script prints its own figures; with ``--json`` each prints one JSON document per line, collected
here into ``bench/results/<timestamp>.jsonl``.  A script that fails is reported and the others still run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    """Run each bench_*.py in turn; exit non-zero if any failed."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(HERE.parent / "src"), env.get("PYTHONPATH", "")) if x)
    flags = (["--quick"] if args.quick else []) + (["--json"] if args.json else [])
    out_lines: list[str] = []
    failed: list[str] = []
    for script in sorted(HERE.glob("bench_*.py")):
        print(f"== {script.name} {' '.join(flags)}", flush=True)
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, str(script), *flags], env=env, capture_output=True, text=True)
        sys.stdout.write(proc.stdout)
        if proc.returncode:
            failed.append(script.name)
            sys.stdout.write(proc.stderr[-2000:])
        out_lines += [line for line in proc.stdout.splitlines() if line.startswith("{")]
        print(f"   ({time.perf_counter() - t0:.1f} s, exit {proc.returncode})", flush=True)
    if args.json and out_lines:
        results = HERE / "results"
        results.mkdir(exist_ok=True)
        path = results / time.strftime("%Y%m%dT%H%M%S.jsonl")
        path.write_text("\n".join(out_lines) + "\n")
        print(f"results in {path}")
    if failed:
        print("failed: " + ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
