"""Benchmark a VF's driver rebind over the simulated kernel: to vfio-pci and back, p50/p99 over its delay.

The simulated kernel (``densedev simulate-kernel``, its own process as the kernel is its own party)
answers ``drivers_probe`` and a driver's ``bind`` after ``--delay-ms`` (a driver's probe() time); the
rest at once.  Each round rebinds one VF to vfio-pci (``rebind.rebind``: driver_override, unbind,
drivers_probe, the driver link and /dev/vfio/<group> awaited) and puts it back on mlx5_core
(``rebind.restore``), on a different VF each round.  Issue 25's target: a rebind within the kernel's
delay + 10 ms; the overhead printed is p - delay.

    PYTHONPATH=src python bench/bench_rebind.py [--quick] [--json] [--delay-ms 20] [--kernel process|thread]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import _impl

from densedev.node import rebind
from densedev.testing import simnode
from densedev.testing.simkernel import FaultRule, SimKernel, write_faults


def start_kernel(kind: str, sysfs: Path, dev: Path) -> Any:
    """Start the simulated kernel as a process (waiting for its ready line) or a thread."""
    if kind == "thread":
        return SimKernel(sysfs, dev).start()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "densedev.cli",
            "simulate-kernel",
            "--sysfs-root",
            str(sysfs),
            "--dev-root",
            str(dev),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(_impl.SRC)},
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("simulate-kernel: answering"):
        proc.kill()
        raise SystemExit(f"the simulated kernel did not start: {line!r}")
    return proc


def stop_kernel(kernel: Any) -> None:
    """Stop what start_kernel started."""
    if isinstance(kernel, SimKernel):
        kernel.stop()
        return
    kernel.terminate()
    kernel.wait(30)


def measure(work: Path, pfs: int, vfs_per_pf: int, rounds: int, delay_ms: float, kind: str) -> dict[str, Any]:
    sysfs, dev = work / "sys", work / "dev"
    layout = simnode.build_node(sysfs, pfs=pfs, vfs_per_pf=vfs_per_pf)
    write_faults(
        sysfs, [FaultRule(op="drivers_probe", delay_ms=delay_ms), FaultRule(op="bind", delay_ms=delay_ms)]
    )
    vfs = layout.vf_addresses
    kernel = start_kernel(kind, sysfs, dev)
    there: list[float] = []
    back: list[float] = []
    # CPU time, which the machine's load does not inflate as it does latency: ours (the writes, reads
    # and polls of rebind and restore) and the kernel process's (its answers; 0 for a thread kernel,
    # whose CPU is counted as ours).
    cpu0 = time.process_time()
    kcpu0 = _impl.cpu_seconds(kernel.pid) if not isinstance(kernel, SimKernel) else 0.0
    try:
        for k in range(rounds):
            vf = vfs[(k * 7919) % len(vfs)]  # spread over the node, a different VF each round
            before = rebind.binding_of(sysfs, vf)
            t0 = time.perf_counter()
            after = rebind.rebind(sysfs, vf, "vfio-pci", timeout=5.0, dev_root=dev)
            t1 = time.perf_counter()
            rebind.restore(sysfs, vf, before, None, timeout=5.0)
            t2 = time.perf_counter()
            assert after.driver == "vfio-pci" and rebind.binding_of(sysfs, vf).driver == before.driver
            there.append((t1 - t0) * 1e3)
            back.append((t2 - t1) * 1e3)
        cpu = time.process_time() - cpu0
        kcpu = _impl.cpu_seconds(kernel.pid) - kcpu0 if not isinstance(kernel, SimKernel) else 0.0
    finally:
        stop_kernel(kernel)

    def figures(ms: list[float]) -> dict[str, float]:
        p50, p99 = _impl.percentile(ms, 0.5), _impl.percentile(ms, 0.99)
        return {
            "p50_ms": round(p50, 2),
            "p99_ms": round(p99, 2),
            "p99_over_delay_ms": round(p99 - delay_ms, 2),
        }

    return {
        "bench": "rebind",
        "kernel": kind,
        "vfs": len(vfs),
        "rounds": rounds,
        "delay_ms": delay_ms,
        "rebind": figures(there),
        "restore": figures(back),
        "cpu_ms_per_round": round(cpu * 1e3 / rounds, 2),
        "kernel_cpu_ms_per_round": round(kcpu * 1e3 / rounds, 2),
        "load": os.getloadavg()[0],
    }


def main() -> int:
    p = _impl.arguments(__file__, __doc__, "a smoke run: 2 PFs x 16 VFs, 10 rounds")
    p.add_argument("--delay-ms", type=float, default=20.0, help="the simulated probe's time")
    p.add_argument("--kernel", choices=("process", "thread"), default="process")
    args = p.parse_args()
    pfs, per, rounds = (2, 16, 10) if args.quick else (16, 256, 100)
    # On tmpfs, as sysfs is in memory: on a disk every create and rename of the tree waits on its journal.
    with _impl.scratch("bench-rebind-", _impl.tmpfs_dir(1 << 30)) as work:
        result = measure(work, pfs, per, rounds, args.delay_ms, args.kernel)
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"rebind over a simulated kernel ({result['kernel']}) with a {args.delay_ms:g} ms probe, "
        f"{result['vfs']} VFs, {rounds} rounds (load {result['load']:.1f}):"
    )
    for what in ("rebind", "restore"):
        f = result[what]
        print(
            f"  {what:8s} p50 {f['p50_ms']:7.2f} ms  p99 {f['p99_ms']:7.2f} ms  "
            f"(p99 - delay: {f['p99_over_delay_ms']:.2f} ms; target <= 10)"
        )
    print(
        f"  CPU per round (rebind + restore): {result['cpu_ms_per_round']:.2f} ms ours, "
        f"{result['kernel_cpu_ms_per_round']:.2f} ms the simulated kernel's"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
