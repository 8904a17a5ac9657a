"""Benchmark withheld-device release latency: a pod ends → its device is listed in its new pool.

Pods hold VFs of pool p1; a reload removes p1, so its VFs fall into pool rest, which withholds the held
ones.  Then the pods end one at a time and each time the clock runs from the end of the pod until the
kubelet emulator receives a rest list naming its VF.  With PodResources (the default) the release is
seen by the daemon's poll (0.25 s while devices are withheld); with ``--source checkpoint`` the
kubelet's next checkpoint rewrite (the emulator admits a device-less pod right after each deletion,
as the kubelet rewrites it at every admission) wakes the daemon through inotify.  The daemon and the
emulator share one uvloop loop, as in the tests.

    PYTHONPATH=src python bench/bench_release.py [--quick] [--json] [--source podresources|checkpoint]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import uvloop

from densedev.daemon import Daemon, DaemonSettings
from densedev.pools import config as config_mod
from densedev.testing import simnode
from densedev.testing.kubelet import KubeletEmulator

PREFIX = "example.com"
P1, REST = f"{PREFIX}/p1", f"{PREFIX}/rest"


def write_config(path: Path, pools: list[tuple[str, list[str]]]) -> None:
    doc = {
        "resourceList": [
            {"resourceName": n, "resourcePrefix": PREFIX, "selectors": {"pfNames": pfs}} for n, pfs in pools
        ]
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    tmp.replace(path)


async def measure(work: Path, pods: int, vfs_per_pf: int, source: str) -> list[float]:
    sysfs = work / "sys"
    layout = simnode.build_node(sysfs, pfs=4, vfs_per_pf=vfs_per_pf, rdma=False)
    names = [pf.netdev for pf in layout.pfs]
    config_path = work / "config.json"
    write_config(config_path, [("p1", names[:1]), ("rest", names)])
    kubelet_dir = Path(tempfile.mkdtemp(prefix="dd-", dir="/tmp"))
    pr_dir = Path(tempfile.mkdtemp(prefix="pr-", dir="/tmp"))
    emu = KubeletEmulator(kubelet_dir, pod_resources_socket=pr_dir / "kubelet.sock", strict=True)
    settings = DaemonSettings(
        sysfs_root=sysfs,
        kubelet_dir=kubelet_dir,
        dev_root=work / "dev",
        resource_prefix=PREFIX,
        config_path=config_path,
        netlink=False,
        config_poll_s=0.05,
        pod_resources_socket=pr_dir / "kubelet.sock" if source == "podresources" else None,
    )
    await emu.start()
    daemon = Daemon(settings, config_mod.load(config_path, default_prefix=PREFIX))
    await daemon.start()
    samples: list[float] = []
    try:
        await emu.wait_for(lambda: bool(emu.updates(P1) and emu.updates(REST)), 30)
        held = []
        for k in range(pods):
            got = await emu.create_pod(f"c{k}", {P1: 1})
            held.append((f"uid-c{k}", got[P1][0]))
        write_config(config_path, [("rest", names)])
        total = len(layout.pfs) * vfs_per_pf
        await emu.wait_for(lambda: len(emu.devices(REST)) == total - pods, 30)
        rng = random.Random(7)
        for uid, device in held:
            # Pods end at moments unrelated to the daemon's poll: a random pause decouples them (right
            # after a list is received the daemon has just refreshed, which would flatter the figure).
            await asyncio.sleep(rng.uniform(0.3, 0.8))
            t0 = time.perf_counter()
            emu.delete_pod(uid)
            if source == "checkpoint":
                await emu.create_pod(f"admit-{uid}", {})
            await emu.wait_for(lambda d=device: d in emu.devices(REST), 30)  # type: ignore[misc]
            samples.append(time.perf_counter() - t0)
        assert emu.double_holdings == []
    finally:
        await daemon.stop()
        await emu.stop()
        shutil.rmtree(kubelet_dir, ignore_errors=True)
        shutil.rmtree(pr_dir, ignore_errors=True)
    return samples


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a smoke run: 5 releases")
    p.add_argument("--json", action="store_true")
    p.add_argument("--source", choices=("podresources", "checkpoint"), default="podresources")
    args = p.parse_args()
    pods = 5 if args.quick else 40
    vfs_per_pf = 64 if args.quick else 256
    with tempfile.TemporaryDirectory(prefix="bench-release-") as tmp:
        samples = uvloop.run(measure(Path(tmp), pods, vfs_per_pf, args.source))
    ms = sorted(s * 1e3 for s in samples)
    result: dict[str, Any] = {
        "bench": "release",
        "source": args.source,
        "vfs": 4 * vfs_per_pf,
        "releases": len(ms),
        "p50_ms": round(statistics.median(ms), 1),
        "p99_ms": round(ms[min(len(ms) - 1, int(len(ms) * 0.99))], 1),
        "max_ms": round(ms[-1], 1),
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"release → listed in the new pool ({args.source}, {result['vfs']} VFs, {len(ms)} releases): "
            f"p50 {result['p50_ms']} ms, p99 {result['p99_ms']} ms, max {result['max_ms']} ms"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
