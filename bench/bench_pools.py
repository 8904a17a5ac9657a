"""Benchmark pool selection: hand-built device tables of 4,096 and 16,384 VFs, 8 pools, printing ms.

Pool selection is pure Python (no extension path), so there is no extension/Python ratio to report here;
the figure to watch is the cost per device, which must stay flat from 4k to 16k (linear).

    PYTHONPATH=src python bench/bench_pools.py [--quick] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import _impl

from densedev.model import Device, Role
from densedev.pools import config
from densedev.pools import select as selectors

VFS_PER_PF = 128

CONFIG = {
    "resourceList": [
        {"resourceName": "mlx_p0_low", "selectors": {"vendors": ["15b3"], "pfNames": ["ens1f0#0-63"]}},
        {"resourceName": "mlx_p0_high", "selectors": {"vendors": ["15b3"], "pfNames": ["ens1f0#64-127"]}},
        {"resourceName": "mlx_dpdk", "selectors": {"vendors": ["15b3"], "drivers": ["vfio-pci"]}},
        {"resourceName": "mlx_rdma_ib", "selectors": {"isRdma": True, "linkTypes": ["infiniband"]}},
        {
            "resourceName": "by_root",
            "selectors": [{"rootDevices": ["0000:20:00.0#0-31"]}, {"rootDevices": ["0000:21:00.0"]}],
        },
        {"resourceName": "intel_iavf", "selectors": {"vendors": ["8086"], "drivers": ["iavf"]}},
        {
            "resourceName": "rdma_shared",
            "rdmaShared": 4,
            "deviceType": "accelerator",
            "selectors": {"pciAddresses": ["0000:3f:00.0"]},
        },
        {"resourceName": "rest", "selectors": {"vendors": ["15b3", "8086"]}},
    ]
}


def make_devices(n_vfs: int) -> list[Device]:
    """Build ``n_vfs`` VFs on PFs of 128 VFs each (mixed vendors, drivers, link types) plus their PFs."""
    devices: list[Device] = []
    n_pfs = (n_vfs + VFS_PER_PF - 1) // VFS_PER_PF
    for p in range(n_pfs):
        bus = 0x10 + p
        pf_id = f"0000:{bus:02x}:00.0"
        vendor = "15b3" if p % 4 != 3 else "8086"
        ib = p % 4 == 1
        link = "infiniband" if ib else "ether"
        pf_net = f"ens{p + 1}f0"
        devices.append(
            Device(
                pf_id,
                Role.PF,
                vendor,
                "101d",
                "020000",
                vendor,
                "0001",
                "mlx5_core",
                p % 2,
                p,
                False,
                -1,
                VFS_PER_PF,
                VFS_PER_PF,
                "",
                -1,
                "",
                (pf_net,),
                link,
                f"mlx5_{p}",
                (),
                "",
                "",
                "",
                f"pci0000:{bus:02x}",
                "",
            )
        )
        for k in range(min(VFS_PER_PF, n_vfs - p * VFS_PER_PF)):
            vf_id = f"0000:{bus:02x}:{1 + k // 8:02x}.{k % 8}"
            driver = "vfio-pci" if k % 8 == 7 else ("iavf" if vendor == "8086" else "mlx5_core")
            netdevs = () if driver == "vfio-pci" else (f"{pf_net}v{k}",)
            devices.append(
                Device(
                    vf_id,
                    Role.VF,
                    vendor,
                    "101e",
                    "020000",
                    vendor,
                    "0002",
                    driver,
                    p % 2,
                    1000 + k,
                    False,
                    -1,
                    0,
                    0,
                    pf_id,
                    k,
                    pf_net,
                    netdevs,
                    link if netdevs else "",
                    f"mlx5_{p}_{k}" if vendor == "15b3" else "",
                    (),
                    "",
                    "",
                    "",
                    f"pci0000:{bus:02x}",
                    "",
                )
            )
    return devices


def measure(cfg: config.Config, devices: list[Device], repeat: int) -> float:
    """Return the best wall time of ``build_pools`` in milliseconds over ``repeat`` runs."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        selectors.build_pools(cfg, devices)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> None:
    """Run the benchmark and print one line per size (or one JSON object with --json)."""
    _impl.announce(__file__)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats, for CI")
    ap.add_argument("--json", action="store_true", help="machine-readable output")
    args = ap.parse_args()
    cfg = config.parse(json.dumps(CONFIG))
    repeat = 3 if args.quick else 15
    results = []
    for n in (4096, 16384):
        devices = make_devices(n)
        pools = selectors.build_pools(cfg, devices)
        ms = measure(cfg, devices, repeat)
        results.append(
            {
                "vfs": n,
                "devices": len(devices),
                "pools": len(pools),
                "pooled_ids": sum(len(p.members) for p in pools),
                "build_pools_ms": round(ms, 3),
                "us_per_device": round(ms * 1e3 / len(devices), 3),
            }
        )
    if args.json:
        print(json.dumps({"bench": "pools", "results": results}))
        return
    for r in results:
        print(
            f"build_pools: {r['vfs']:>6} VFs ({r['devices']} devices, {r['pools']} pools, "
            f"{r['pooled_ids']} IDs): "
            f"{r['build_pools_ms']:.2f} ms  ({r['us_per_device']:.2f} us/device)"
        )
    print(f"16k/4k ratio: {results[1]['build_pools_ms'] / results[0]['build_pools_ms']:.2f} (linear: ~4)")


if __name__ == "__main__":
    main()
