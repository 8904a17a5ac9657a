"""Benchmark GetPreferredAllocation ranking: 16,384 available VFs, sizes 1, 8, 64; time per call p50/p99.

The node: 128 PFs x 128 VFs over 2 NUMA nodes and 8 PCIe roots; the kubelet sends every free ID on
each call, so the whole 16k list is walked every time.  Both implementations run in the same process on
the same input, so the extension/Python ratio is measured, not estimated.  Target: p99 <= 2 ms with the
extension.

    PYTHONPATH=src python bench/bench_preferred.py [--quick] [--json]
"""

from __future__ import annotations

import argparse
import importlib
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import _impl

from densedev import _fast_py
from densedev.alloc.respond import POLICIES, build_lookup, topology_of
from densedev.model import Device

PFS, VFS_PER_PF = 128, 128


def make_devices() -> list[Device]:
    """Build 16,384 VFs: PF p on NUMA p // 64 and root p // 16, VFs on buses after their PF's."""
    out: list[Device] = []
    for p in range(PFS):
        for v in range(VFS_PER_PF):
            address = f"{p // 64 + 1:04x}:{p % 64 * 4 + 1 + v // 64:02x}:{v % 64 // 8:02x}.{v % 8}"
            out.append(
                _impl.MLX5_VF._replace(
                    id=address,
                    numa_node=p // 64,
                    pf=f"0000:{p:02x}:00.0",
                    vf_index=v,
                    pf_netdev=f"ens{p}f0",
                    pcie_root=f"pci{p // 16:04x}:00",
                )
            )
    return out


def percentile(samples: list[float], q: float) -> float:
    """Return the q-quantile (0..1) of samples, nearest rank."""
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def fresh(ids: list[str]) -> list[str]:
    """Return new string objects equal to ``ids``: what protobuf hands the server (no cached hashes)."""
    return [i.encode().decode() for i in ids]


def time_calls(fn: Callable[[list[str]], object], ids: list[str], repeat: int) -> list[float]:
    """Return per-call wall times in seconds (one warm-up call first), each on fresh ID strings."""
    fn(fresh(ids))
    out = []
    for _ in range(repeat):
        arg = fresh(ids)
        t = time.perf_counter()
        fn(arg)
        out.append(time.perf_counter() - t)
    return out


def main() -> int:
    """Run the benchmark and print figures (or JSON)."""
    _impl.announce(__file__)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()

    impls: dict[str, ModuleType] = {"python": _fast_py}
    try:
        impls["cython"] = importlib.import_module("densedev._fast")
    except ImportError:
        print("extension not built: python only (build with setup.py build_ext --inplace)", file=sys.stderr)

    devices = make_devices()
    ids = [d.id for d in devices]
    index = {d: i for i, d in enumerate(ids)}
    topology = topology_of(devices)
    lookup = build_lookup(index)
    # The kubelet's available list: the free set in no order we can rely on; one pod's worth already used.
    rng = random.Random(5)
    available = ids[:]
    rng.shuffle(available)
    must = [ids[3 * VFS_PER_PF + 5]]  # a device another resource's allocation already pinned
    repeat = {"cython": 30 if args.quick else 400, "python": 5 if args.quick else 40}

    results: list[dict[str, Any]] = []
    for policy in ("pack", "spread"):
        for size in (1, 8, 64):
            for with_must in (False, True):
                row: dict[str, Any] = {
                    "policy": policy,
                    "size": size,
                    "must_include": len(must) if with_must else 0,
                }
                answers = set()
                for name, mod in impls.items():
                    m = must if with_must else []

                    def call(
                        ids: list[str],
                        mod: ModuleType = mod,
                        m: list[str] = m,
                        size: int = size,
                        policy: int = POLICIES[policy],
                    ) -> tuple[str, ...]:
                        """Return the answer of one implementation for this case."""
                        # As PoolAllocator does: the lookup table only for the extension (the twin
                        # would parse every address in Python; its dict path is faster there).
                        table = lookup if mod is not _fast_py else b""
                        result: tuple[str, ...] = mod.pick_devices(
                            ids, m, size, index, topology, policy, table
                        )
                        return result

                    answers.add(call(available))
                    samples = time_calls(call, available, repeat[name])
                    row[name] = {
                        "p50_ms": statistics.median(samples) * 1e3,
                        "p99_ms": percentile(samples, 0.99) * 1e3,
                        "calls": len(samples),
                    }
                if len(answers) != 1:
                    print(f"implementations disagree on {row}", file=sys.stderr)
                    return 1
                if "cython" in row:
                    row["python_over_cython_p50"] = row["python"]["p50_ms"] / row["cython"]["p50_ms"]
                results.append(row)

    if args.json:
        print(json.dumps({"available": len(available), "results": results}, indent=2))
        return 0
    print(
        f"preferred-allocation bench: {len(available)} available, {PFS} PFs x {VFS_PER_PF} VFs, 2 NUMA nodes"
    )
    print(
        f"  {'policy':<7}{'size':>5}{'must':>5}   {'cython p50/p99 ms':>20}   {'python p50/p99 ms':>20}"
        "   python/cython"
    )
    for r in results:
        cy = r.get("cython")
        cy_s = f"{cy['p50_ms']:8.3f} /{cy['p99_ms']:8.3f}" if cy else f"{'-':>18}"
        py = r["python"]
        ratio = f"{r['python_over_cython_p50']:6.1f}x" if cy else ""
        print(
            f"  {r['policy']:<7}{r['size']:>5}{r['must_include']:>5}   {cy_s:>20}   "
            f"{py['p50_ms']:8.3f} /{py['p99_ms']:8.3f}   {ratio}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
