"""Benchmark the config loader on the worst files it may be given: memory and time per file.

Each file is loaded by ``densedev.pools.config.load`` in a fresh child process, which reports its peak
resident memory (``ru_maxrss``) before and after the load, so one file's cost is not hidden by another's.
The files: VF ranges ``"ens1#0-65535"`` repeated 100 and 2,000 times (issue 12 saw 641 MB and 6.4 GB),
the same range under 55,000 names (a 1 MiB file that is valid), 1 MiB of empty pools (340,000 problems),
and 1 MiB of brackets (nesting 500,000 deep).

    PYTHONPATH=src python bench/bench_config.py [--quick] [--json] [--src DIR]

``--src`` measures another checkout's ``src`` (e.g. the code before a change) with the same files.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

CHILD = """
import json, resource, sys, time
from densedev.pools import config
path = sys.argv[1]
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
try:
    cfg = config.load(path)
    outcome = f"valid, {len(cfg.pools)} pool(s)"
except config.ConfigError as exc:
    outcome = f"{len(exc.problems)} problem line(s): " + exc.problems[-1][:60]
elapsed = time.perf_counter() - t0
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
traced = None
if elapsed < 5:  # again under tracemalloc, for the bytes allocated (RSS moves in pages and arenas)
    import tracemalloc
    tracemalloc.start()
    try:
        config.load(path)
    except config.ConfigError:
        pass
    traced = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
print(json.dumps({"kib": after - before, "seconds": elapsed, "traced": traced, "outcome": outcome}))
"""


def files(quick: bool) -> dict[str, str]:
    """Return the benchmark's files by name (their text)."""

    def ranges(names: list[str]) -> str:
        return json.dumps({"resourceList": [{"resourceName": "p", "selectors": {"pfNames": names}}]})

    out = {
        "ranges x100": ranges(["ens1#0-65535"] * 100),
        "ranges x2000": ranges(["ens1#0-65535"] * 2000),
    }
    if not quick:
        out["ranges x55000 names"] = ranges([f"e{i}#0-65535" for i in range(55_000)])
        out["1 MiB of empty pools"] = '{"resourceList": [' + ",".join(["{}"] * 340_000) + "]}"
        out["1 MiB of brackets"] = "[" * 500_000 + "]" * 500_000
    return out


def main() -> int:
    """Load each file in a child process and print its memory and time."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="only the two range files")
    p.add_argument("--json", action="store_true")
    p.add_argument("--src", type=Path, default=SRC, help="the densedev source tree to measure")
    args = p.parse_args()
    env = dict(os.environ)
    env["PYTHONPATH"] = str(args.src.resolve())
    env["DENSEDEV_NO_EXTENSIONS"] = "1"  # the loader is pure Python; an old tree may have no build
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in files(args.quick).items():
            path = Path(tmp) / "config.json"
            path.write_text(text)
            proc = subprocess.run(
                [sys.executable, "-c", CHILD, str(path)], env=env, capture_output=True, text=True
            )
            if proc.returncode:
                print(f"{name}: child failed: {proc.stderr.strip().splitlines()[-1:]}")
                continue
            r = json.loads(proc.stdout)
            r.update(file=name, bytes=len(text.encode()))
            results.append(r)
            if args.json:
                print(json.dumps({"bench": "config", **r}))
            else:
                traced = "-" if r["traced"] is None else f"{r['traced'] / 2**20:.2f}"
                print(
                    f"{name:20s} {r['bytes'] / 1024:6.0f} KiB file  +{r['kib'] / 1024:7.1f} MiB peak RSS  "
                    f"{traced:>7s} MiB allocated  {r['seconds'] * 1e3:8.1f} ms  {r['outcome']}"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
