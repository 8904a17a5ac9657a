"""Benchmark what bounding every sysfs read costs, and what a file that does not answer costs (issue 23, 3).

Prints, on a simulated node of ``--vfs`` VFs (on tmpfs when there is one):

- the scan straight through ``accel.scan_sysfs`` and through ``Scanner.scan`` (a thread of its own
  under a deadline: ``node.stuck``), medians of ``--repeat`` runs taken alternately in one process, and
  their ratio;
- the same ``Scanner.scan`` with one VF 0's ``uevent`` a FIFO no one writes (a hung driver's file): the
  time to leave that device out and read the rest;
- ``densedev run`` on a small node with two such files: the time from SIGTERM to its exit, sent on the
  log line of each phase of its start (waiting for the scanning child, scanning in a thread, the rest).

    python bench/bench_stuck.py            # 4,096 VFs, 15 runs
    python bench/bench_stuck.py --vfs 1024 --repeat 5 --json
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SRC = Path(__file__).resolve().parent.parent / "src"
sys.path.insert(0, str(SRC))

import _impl  # noqa: E402

from densedev import accel  # noqa: E402
from densedev.node.scanner import Scanner  # noqa: E402
from densedev.testing.simnode import build_node, simulate  # noqa: E402


def _ms(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def scans(top: Path, vfs: int, repeat: int) -> dict[str, float]:
    root = top / "sys"
    build_node(root, pfs=max(1, vfs // 256), vfs_per_pf=min(vfs, 256), rdma=True)
    raw = os.fsencode(root)
    scanner = Scanner(root)
    direct, bounded = [], []
    for _ in range(repeat):
        direct.append(_ms(lambda: accel.scan_sysfs(raw, None, True)))
        bounded.append(_ms(scanner.scan))
    vf0 = sorted((root / "bus/pci/devices").iterdir())[1].resolve() / "uevent"  # the first PF's VF 0
    vf0.unlink()
    os.mkfifo(vf0)
    try:
        hung = _ms(Scanner(root).scan)
    finally:
        os.close(os.open(vf0, os.O_WRONLY | os.O_NONBLOCK))  # wake the reader left blocked in it
    return {
        "direct_ms": statistics.median(direct),
        "bounded_ms": statistics.median(bounded),
        "bounded_over_direct": statistics.median(bounded) / statistics.median(direct),
        "one_hung_device_ms": hung,
    }


PHASES = {
    "child": "scan ahead: waiting for child",
    "scan": "scanning in the daemon instead",
    "rest": "devices in",
}


def sigterm(top: Path) -> dict[str, float]:
    node = top / "node"
    layout = simulate(node, pfs=2, vfs_per_pf=4, rdma=True)
    pf = layout.pfs[1]
    for address, name in ((pf.vf_addresses[0], "uevent"), (pf.address, "sriov_numvfs")):
        path = (node / "bus/pci/devices" / address).resolve() / name
        path.unlink()
        os.mkfifo(path)
    out = {}
    env = dict(os.environ, PYTHONPATH=str(SRC))
    for phase, trigger in PHASES.items():
        kdir = Path(tempfile.mkdtemp(prefix="dd-", dir="/tmp"))
        argv = [sys.executable, "-m", "densedev", "run", "--config", str(node / "config.json")]
        argv += ["--sysfs-root", str(node), "--kubelet-dir", str(kdir), "--no-netlink", "--devinfo-dir", ""]
        proc = subprocess.Popen([*argv, "--log-level", "debug"], stderr=subprocess.PIPE, text=True, env=env)
        assert proc.stderr is not None
        for line in proc.stderr:
            if trigger in line:
                break
        t0 = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        out[f"sigterm_to_exit_{phase}_ms"] = (time.perf_counter() - t0) * 1e3
        proc.stderr.close()
        shutil.rmtree(kdir, ignore_errors=True)
    return out


def main() -> None:
    parser = _impl.arguments(__file__, __doc__, "1,024 VFs, 3 scans each way")
    parser.add_argument("--vfs", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args()
    if args.quick:
        args.vfs, args.repeat = 1024, 3
    top = Path(
        tempfile.mkdtemp(prefix="densedev-stuck-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    )
    try:
        result: dict[str, Any] = {"implementation": accel.IMPLEMENTATION, "vfs": args.vfs}
        result.update(scans(top, args.vfs, args.repeat))
        result.update(sigterm(top))
    finally:
        shutil.rmtree(top, ignore_errors=True)
    if args.json:
        print(json.dumps(result))
        return
    for key, value in result.items():
        print(f"{key:32} {value:.2f}" if isinstance(value, float) else f"{key:32} {value}")


if __name__ == "__main__":
    main()
