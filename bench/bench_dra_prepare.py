"""Benchmark DRA NodePrepareResources for a 1-device claim, excluding the claim GET; p50/p99 per call.

A node of 4,096 VFs in one DRA pool, ``--held`` claims already prepared (the checkpoint rewritten on
every call grows with them); each timed call prepares a fresh claim of one VF through the kubelet
emulator over the real DRA socket (gRPC, v1), which writes the claim's CDI spec, its device-info file
and the checkpoint (each fsynced) before answering.  The claim object comes from memory, so the GET
the real driver makes first is excluded.  Unprepare is timed too, and the service alone (no gRPC).
Target: prepare p99 <= 5 ms.

    PYTHONPATH=src python bench/bench_dra_prepare.py [--quick] [--json] [--held N]
        [--run-dir DIR (tmpfs: /dev/shm)] [--state-dir DIR (disk: /tmp)]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import _impl

from densedev.dra import names
from densedev.dra.claims import ClaimRef, PoolGate
from densedev.dra.health import HealthStream
from densedev.dra.node import NodeService, NodeSettings, handlers
from densedev.dra.registration import DraPlugin
from densedev.model import Device, Pool, PoolConfig, PoolMember
from densedev.testing.dra_kubelet import ClaimStore, DraKubelet, allocated_claim

DRIVER = "net.densedev.io"
NODE = "bench-node"
PFS, VFS_PER_PF = 16, 256


def make_devices() -> list[Device]:
    """Build 4,096 kernel-netdev VFs under 16 PFs."""
    out = []
    for p in range(PFS):
        for v in range(VFS_PER_PF):
            out.append(
                _impl.MLX5_VF._replace(
                    id=f"0000:{p * 2 + 0x10 + v // 128:02x}:{v % 128 // 8:02x}.{v % 8}",
                    pf=f"0000:{p:02x}:00.0",
                    vf_index=v,
                    pf_netdev=f"ens{p}f0",
                    netdevs=(f"ens{p}f0v{v}",),
                    pcie_root="pci0000:00",
                )
            )
    return out


def percentile(samples: list[float], q: float) -> float:
    """Return the q-quantile (0..1) of samples, nearest rank."""
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def figures(samples: list[float]) -> dict[str, Any]:
    """Return p50/p99/max in milliseconds."""
    return {
        "p50_ms": statistics.median(samples) * 1e3,
        "p99_ms": percentile(samples, 0.99) * 1e3,
        "max_ms": max(samples) * 1e3,
        "calls": len(samples),
    }


async def bench(run_root: Path, root: Path, calls: int, held: int) -> dict[str, Any]:
    """Run the measurements (CDI and device-info dirs under ``run_root``, the rest under ``root``)."""
    devices = make_devices()
    config = PoolConfig("mlnx_sriov_netdevice", "nvidia.com")
    pool = Pool(config, tuple(PoolMember(d.id, d) for d in devices))
    ids = {d.id for d in devices}
    store = ClaimStore()
    settings = NodeSettings(
        DRIVER,
        NODE,
        plugin_dir=root / "plugins" / DRIVER,
        cdi_dir=run_root / "cdi",
        devinfo_dir=run_root / "devinfo",
        dev_root=root / "dev",
    )
    service = NodeService(settings, store, PoolGate(ids.__contains__, [pool], lambda _i: True))
    service.recover()
    health = HealthStream(NODE)
    plugin = DraPlugin(
        DRIVER,
        [*handlers(service), health.handler()],
        registry_dir=root / "registry",
        plugins_dir=root / "plugins",
    )
    kubelet = DraKubelet(root / "registry", poll=0.05)
    free = iter(devices)

    def new_claim() -> tuple[str, str, str]:
        d = next(free)
        uid = str(uuid.uuid4())
        result = {"request": "vf", "driver": DRIVER, "pool": NODE, "device": names.device_name(d.id)}
        store.put(allocated_claim("default", f"c-{uid[:8]}", uid, [result]))
        return ("default", f"c-{uid[:8]}", uid)

    await plugin.start()
    await kubelet.start()
    try:
        await kubelet.wait_for(lambda: DRIVER in kubelet.plugins, 10)
        for _ in range(held):
            ns, name, uid = new_claim()
            assert not (await service.prepare([ClaimRef(ns, name, uid)]))[uid].error
        out: dict[str, Any] = {"held_claims": held}
        grpc_prepare: list[float] = []
        grpc_unprepare: list[float] = []
        for i in range(calls + 5):
            claim = new_claim()
            t = time.perf_counter()
            answer = await kubelet.prepare(DRIVER, [claim])
            dt = time.perf_counter() - t
            assert not answer[claim[2]].error, answer[claim[2]].error
            t = time.perf_counter()
            errors = await kubelet.unprepare(DRIVER, [claim])
            du = time.perf_counter() - t
            assert errors == {claim[2]: ""}
            if i >= 5:  # warm-up calls first
                grpc_prepare.append(dt)
                grpc_unprepare.append(du)
        direct: list[float] = []
        for _ in range(calls):
            ns, name, uid = new_claim()
            ref = ClaimRef(ns, name, uid)
            t = time.perf_counter()
            assert not (await service.prepare([ref]))[uid].error
            direct.append(time.perf_counter() - t)
            await service.unprepare([ref])
        out["grpc_prepare"] = figures(grpc_prepare)
        out["grpc_unprepare"] = figures(grpc_unprepare)
        out["service_prepare"] = figures(direct)
        return out
    finally:
        health.stop()
        await plugin.stop()
        await kubelet.stop()


def main() -> int:
    """Run the benchmark and print figures (or JSON)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls (a smoke run)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    # As on a node: /var/run (CDI specs, device-info files) is a tmpfs, /var/lib/kubelet (the plugin
    # dir with the checkpoint, fsynced on every call) a disk.
    parser.add_argument("--run-dir", default="/dev/shm", help="where the CDI and device-info dirs go")
    parser.add_argument("--state-dir", default="/tmp", help="where the plugin dir (checkpoint) goes")
    parser.add_argument("--held", type=int, default=100, help="claims prepared before timing")
    args = parser.parse_args()
    calls = 50 if args.quick else 1000
    held = min(args.held, 20) if args.quick else args.held
    if held + 2 * calls + 5 > PFS * VFS_PER_PF:
        parser.error(f"--held {held} leaves too few of the {PFS * VFS_PER_PF} VFs for {calls} calls")
    run_root = Path(tempfile.mkdtemp(prefix="dd-dra-", dir=args.run_dir))
    root = Path(tempfile.mkdtemp(prefix="dd-dra-", dir=args.state_dir))
    try:
        result = uvloop.run(bench(run_root, root, calls, held))
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(run_root, ignore_errors=True)
    result["run_dir"], result["state_dir"] = args.run_dir, args.state_dir
    if args.json:
        print(json.dumps({"bench": "dra_prepare", **result}))
        return 0
    print(
        f"DRA NodePrepareResources, 1-device claims, {PFS * VFS_PER_PF} VFs, "
        f"{result['held_claims']} claims held; CDI/device-info under {args.run_dir}, "
        f"checkpoint under {args.state_dir}"
    )
    for key, label in (
        ("grpc_prepare", "prepare via gRPC (v1)"),
        ("grpc_unprepare", "unprepare via gRPC"),
        ("service_prepare", "prepare, service only"),
    ):
        f = result[key]
        print(
            f"  {label:<24} p50 {f['p50_ms']:6.2f} ms   p99 {f['p99_ms']:6.2f} ms   "
            f"max {f['max_ms']:6.2f} ms   ({f['calls']} calls)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
