"""Benchmark what reading RDMA char devices at Allocate costs: the same Allocate with and without it.

A simulated node (4 PFs x 16 RoCE VFs); an ``isRdma`` pool of its VFs, CDI and device-info files off
(so the figures are the response alone).  Each row allocates ``size`` VFs with the sysfs root set (the
function's RDMA device and char devices listed at Allocate, docs/allocation.md) and without (the
discovery record), alternating in one process; the ratio is of medians from the same run.  A plain
netDevice pool of the same VFs shows the cost for pools that hand out no RDMA (no sysfs read).

    PYTHONPATH=src python bench/bench_alloc_rdma.py [--rounds N]
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import _impl

from densedev.alloc.respond import AllocationSettings, PoolAllocator
from densedev.model import Pool, PoolConfig, PoolMember, Selector
from densedev.node import scanner
from densedev.testing import simnode


def allocator(config: PoolConfig, devices: list, sysfs: Path | None, dev_root: Path) -> PoolAllocator:
    pool = Pool(config, tuple(PoolMember(d.id, d) for d in devices))
    settings = AllocationSettings(cdi_dir=None, devinfo_dir=None, dev_root=dev_root, sysfs_root=sysfs)
    return PoolAllocator(pool, settings, lambda _id: True)


def timed(alloc: PoolAllocator, ids: list[str], rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        alloc.allocate(ids)
        out.append((time.perf_counter() - t) * 1e6)
    return out


def main() -> None:
    parser = _impl.arguments(__file__, __doc__, "200 Allocates per cell")
    parser.add_argument("--rounds", type=int, default=2000)
    args = parser.parse_args()
    if args.quick:
        args.rounds = 200
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        sysfs, dev_root = root / "sys", root / "dev"
        simnode.build_node(sysfs, pfs=4, vfs_per_pf=16, rdma=True)
        table = scanner.scan(sysfs)
        vfs = [d for d in table.devices if d.rdma_device and d.pf]
        for d in vfs:
            for node in (*d.rdma_nodes, "/dev/infiniband/rdma_cm"):
                f = dev_root / node.removeprefix("/dev/")
                f.parent.mkdir(parents=True, exist_ok=True)
                f.touch()
        rdma = PoolConfig("rdma_vf", "example.com", selectors=(Selector(is_rdma=True),))
        plain = PoolConfig("plain_vf", "example.com")
        if not args.json:
            print(f"{len(vfs)} RoCE VFs; {args.rounds} Allocates per cell; microseconds per Allocate")
            head = f"{'pool':<9} {'size':>4} {'record p50/p99':>18} {'at Allocate p50/p99':>22}"
            print(f"{head} {'ratio p50':>10}")
        for config in (rdma, plain):
            now = allocator(config, vfs, sysfs, dev_root)
            record = allocator(config, vfs, None, dev_root)
            for size in (1, 8):
                ids = [d.id for d in vfs[:size]]
                a: list[float] = []
                b: list[float] = []
                for _ in range(5):  # alternate, so load on the shared box hits both alike
                    a += timed(record, ids, args.rounds // 5)
                    b += timed(now, ids, args.rounds // 5)
                qa, qb = statistics.quantiles(a, n=100), statistics.quantiles(b, n=100)
                rows.append(
                    {
                        "pool": config.resource_name,
                        "size": size,
                        "record_p50_us": round(qa[49], 1),
                        "record_p99_us": round(qa[98], 1),
                        "at_allocate_p50_us": round(qb[49], 1),
                        "at_allocate_p99_us": round(qb[98], 1),
                    }
                )
                if args.json:
                    continue
                print(
                    f"{config.resource_name:<9} {size:>4} {qa[49]:>8.1f} / {qa[98]:>7.1f} "
                    f"{qb[49]:>11.1f} / {qb[98]:>8.1f} {qb[49] / qa[49]:>10.2f}"
                )

    if args.json:
        print(json.dumps({"bench": "alloc_rdma", "vfs": len(vfs), "rounds": args.rounds, "results": rows}))


if __name__ == "__main__":
    main()
