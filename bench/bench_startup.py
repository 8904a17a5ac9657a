"""Start-up: ``densedev run`` forked and exec'd until every device of its one pool reached the kubelet.

One pool of all VFs (PFs of 256 VFs) on a simulated node of 1,024 / 4,096 / 16,384 VFs; the kubelet
emulator (densedev.testing.kubelet) runs in this process.  Each repeat starts the daemon as its own
process — exactly the command a DaemonSet runs — with a fresh kubelet directory, and the figure is from
just before the fork to the emulator's receive time of the first ListAndWatch message holding every
device (both read CLOCK_MONOTONIC): interpreter start, imports, scan, pools, server, registration,
first list.  Then the daemon is stopped (SIGTERM) and the next repeat starts from nothing.

Import time: the same start under ``python -X importtime``, stopped once the full list arrived; the
figure is the sum of the top-level imports' cumulative times (every import the run made, the lazy
ones included), best of a few runs (importtime's own overhead inflates it; compare runs, not absolutes).
The child that reads the first scan (node.ahead) inherits the flag and stderr, so its own few imports
(the accelerator and the models, ~5 ms) are counted too, though they run beside the daemon's.

The daemon runs from bytecode caches, as installed (``_impl.daemon_env``); the warm-up start writes them.
As root with iproute2 the PFs' netdevs are real veth links in a private network namespace and the
daemon watches netlink there, as on a node; otherwise it runs with ``--no-netlink`` (said in the output).

    PYTHONPATH=src python bench/bench_startup.py [--quick] [--json] [--sizes 1024,4096,16384] [--repeat 10]
        [--src OLD/src --src src]   # before/after from one run
        [--python VENV/bin/python ...]   # the daemon under another interpreter (the image's)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import _impl
import uvloop

from densedev import accel
from densedev.testing import simnode
from densedev.testing.kubelet import KubeletEmulator
from densedev.testing.netns import available, namespace

VFS_PER_PF = 256
RESOURCE = "intel.com/vfs"
_IMPORT_LINE = re.compile(r"import time:\s+(\d+)\s+\|\s+(\d+)\s+\|( +)(\S+)")


class Subject(NamedTuple):
    """What one series of starts runs: an interpreter (with densedev's dependencies) and a src/ tree."""

    python: str
    src: Path


def build(work: Path, vfs: int) -> tuple[Path, Path, list[str]]:
    """Build a node of ``vfs`` VFs under ``work`` and a one-pool config; return sysfs, config, PF netdevs."""
    sysfs = work / "sys"
    layout = simnode.build_node(sysfs, pfs=vfs // VFS_PER_PF, vfs_per_pf=VFS_PER_PF, numa_nodes=2)
    netdevs = [pf.netdev for pf in layout.pfs]
    config = work / "config.json"
    pool = {"resourceName": "vfs", "selectors": {"pfNames": netdevs}}
    config.write_text(json.dumps({"resourceList": [pool]}))
    return sysfs, config, netdevs


def import_total_ms(stderr: str) -> tuple[float, int]:
    """Sum of the top-level imports' cumulative times in ``-X importtime`` output, and modules imported."""
    total_us = modules = 0
    for m in _IMPORT_LINE.finditer(stderr):
        modules += 1
        if len(m.group(3)) == 1:  # nested imports are indented further and counted in their parent
            total_us += int(m.group(2))
    return total_us / 1e3, modules


async def start_once(
    work: Path,
    sysfs: Path,
    config: Path,
    vfs: int,
    netns: str | None,
    subject: Subject,
    python_flags: tuple[str, ...] = (),
) -> tuple[float, float, str]:
    """Start the daemon once: seconds from fork to the full list at the emulator, its CPU seconds by
    then (user + system, its reaped children's included), and its stderr."""
    kubelet_dir = Path(tempfile.mkdtemp(prefix="dd-", dir="/tmp"))  # short: sun_path holds 107 bytes
    emu = KubeletEmulator(kubelet_dir)
    await emu.start()
    argv = _impl.daemon_argv(
        config, sysfs, kubelet_dir, work / "dev", netns, python_flags, subject.src, subject.python
    )

    def full() -> bool:
        return any(len(u.devices) == vfs for u in emu.updates(RESOURCE))

    try:
        with tempfile.TemporaryFile() as err:
            t0 = time.monotonic()
            env = _impl.daemon_env(work / "pycache", subject.src)
            daemon = subprocess.Popen(argv, env=env, stderr=err)
            try:
                # A daemon that died ends the wait at once, with its stderr below, not after 120 s.
                await emu.wait_for(lambda: full() or daemon.poll() is not None, 120)
                listed = full()
                if listed:
                    received = next(u.received for u in emu.updates(RESOURCE) if len(u.devices) == vfs)
                    # Load-independent: what the start itself cost, the child that read the first scan
                    # (node.ahead; reaped before the first list) included.
                    cpu = _impl.cpu_seconds(daemon.pid, children=True)
            finally:
                if daemon.poll() is None:
                    daemon.send_signal(signal.SIGTERM)
                code = await asyncio.to_thread(daemon.wait, 30)
            err.seek(0)
            text = err.read().decode(errors="replace")
        if not listed or code != 0:
            raise RuntimeError(f"densedev run exited {code} (full list sent: {listed}): {text[-2000:]}")
        return received - t0, cpu, text
    finally:
        await emu.stop()
        shutil.rmtree(kubelet_dir, ignore_errors=True)


async def measure(
    work: Path, vfs: int, subjects: list[Subject], repeat: int, import_runs: int, netns: str | None
) -> list[dict[str, object]]:
    """Every figure of one node size, per subject; the subjects' starts take turns, so a machine
    that gets busier mid-run weighs on each alike."""
    t = time.perf_counter()
    sysfs, config, netdevs = build(work, vfs)
    build_s = time.perf_counter() - t
    if netns is not None:
        _impl.veth_pfs(netns, netdevs)
    runs: dict[Subject, list[tuple[float, float, str]]] = {s: [] for s in subjects}
    imports: dict[Subject, list[tuple[float, int]]] = {s: [] for s in subjects}
    try:
        for s in subjects:  # warm-up: page cache, bytecode (daemon_env)
            await start_once(work, sysfs, config, vfs, netns, s)
        for _ in range(repeat):
            for s in subjects:
                runs[s].append(await start_once(work, sysfs, config, vfs, netns, s))
        for _ in range(import_runs):
            for s in subjects:
                stderr = (await start_once(work, sysfs, config, vfs, netns, s, ("-X", "importtime")))[2]
                imports[s].append(import_total_ms(stderr))
    finally:
        if netns is not None:
            # The next size makes links of the same names; each veth's peer goes with it.
            gone = "".join(f"link del {name}\n" for name in netdevs)
            subprocess.run(["ip", "-n", netns, "-batch", "-"], input=gone, text=True, capture_output=True)
    out = []
    for s in subjects:
        starts, cpus = [r[0] for r in runs[s]], [r[1] for r in runs[s]]
        best_import = min(imports[s], default=(0.0, 0))
        out.append(
            {
                "python": s.python,
                "src": str(s.src),
                "devices": vfs,
                "pools": 1,
                "build_node_s": round(build_s, 2),
                "repeats": repeat,
                "start_median_ms": round(statistics.median(starts) * 1e3, 1),
                "start_best_ms": round(min(starts) * 1e3, 1),
                "start_p90_ms": round(_impl.percentile(starts, 0.9) * 1e3, 1),
                "start_ms": [round(s * 1e3, 1) for s in starts],
                # CPU the daemon (and its scanning child) used until the full list (clock ticks: 10 ms
                # steps) is what a busy machine does not inflate, unlike the wall-clock figures above.
                "cpu_median_ms": round(statistics.median(cpus) * 1e3, 1),
                "cpu_best_ms": round(min(cpus) * 1e3, 1),
                "import_runs": import_runs,
                "import_best_ms": round(best_import[0], 1),
                "modules_imported": best_import[1],
            }
        )
    return out


def sizes(text: str) -> list[int]:
    """``--sizes``: comma-separated VF counts, each a positive multiple of 256 (one PF's VFs)."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated VF counts, e.g. 1024,4096") from None
    if not out or any(v <= 0 or v % VFS_PER_PF for v in out):
        raise argparse.ArgumentTypeError(f"{text!r}: each size a positive multiple of {VFS_PER_PF}")
    return out


def main() -> int:
    _impl.announce(__file__)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1,024 VFs, 3 repeats, 1 import run")
    p.add_argument("--json", action="store_true")
    p.add_argument("--sizes", type=sizes, default=[1024, 4096, 16384], metavar="VFS,...")
    p.add_argument("--repeat", type=int, default=10, help="timed starts per size (after one warm-up)")
    p.add_argument("--import-runs", type=int, default=3, help="starts under -X importtime per size")
    p.add_argument("--dir", default=None, help="where to build the simulated nodes (default: tmpfs if room)")
    p.add_argument(
        "--src",
        type=Path,
        action="append",
        metavar="DIR",
        help="run densedev from this src/ directory instead (repeatable: the trees' starts take turns, "
        "for before/after figures from one run; default: this tree's)",
    )
    p.add_argument(
        "--python",
        action="append",
        metavar="PATH",
        help="run the daemon under this interpreter, which must have densedev's dependencies (repeatable, "
        "crossed with --src: every pair takes its turn; default: this one)",
    )
    args = p.parse_args()
    if args.quick:
        args.sizes, args.repeat, args.import_runs = [1024], 3, 1
    srcs = [d.resolve() for d in args.src] if args.src else [_impl.SRC]
    pythons = args.python or [sys.executable]
    subjects = [Subject(py, src) for py in pythons for src in srcs]
    netlink = "netns" if available() is None else "off"
    results = []
    with ExitStack() as stack:
        netns = stack.enter_context(namespace("densedev-s")) if netlink == "netns" else None
        for vfs in args.sizes:
            work = Path(tempfile.mkdtemp(prefix="densedev-start-", dir=args.dir or _impl.tmpfs_dir()))
            try:
                figures = uvloop.run(measure(work, vfs, subjects, args.repeat, args.import_runs, netns))
            finally:
                shutil.rmtree(work, ignore_errors=True)
            results += figures
            for r in figures if not args.json else []:
                where = (f" {r['python']}" if args.python else "") + (f" {r['src']}" if args.src else "")
                print(
                    f"start-up [{accel.IMPLEMENTATION}, netlink {netlink}]{where} {r['devices']} VFs, "
                    "1 pool: "
                    f"median {r['start_median_ms']} ms, best {r['start_best_ms']} ms, "
                    f"p90 {r['start_p90_ms']} ms over {r['repeats']} starts (daemon CPU median "
                    f"{r['cpu_median_ms']} ms); imports "
                    f"{r['import_best_ms']} ms ({r['modules_imported']} modules, -X importtime, best of "
                    f"{r['import_runs']})",
                    flush=True,
                )
    if args.json:
        print(json.dumps({"implementation": accel.IMPLEMENTATION, "netlink": netlink, "sizes": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
