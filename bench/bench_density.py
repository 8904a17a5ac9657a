"""The density frontier: one pool's ListAndWatch message at 65,536 devices; what pool size costs the kubelet.

1. One pool holding every VF of a 64 PF x 1,024 VF node (65,536 devices; ``--quick``: 16,384): the size
   of its full ListAndWatch message against the kubelet's 4 MiB receive limit, the time densedev's
   ``ListEncoder`` takes to encode the full list, and to encode the update after one PF went down (its
   1,024 devices re-encoded, the message joined again).  Medians of ``--repeat`` runs.
2. The kubelet's per-update cost against pool layout: a node of 16,384 devices (``--quick``: 4,096)
   served as 1, 16 or 64 pools by densedev's own ``PluginServer``/``PoolFeed`` to the kubelet emulator,
   which does the real kubelet's work for every message (the resource's device set replaced from the
   whole list, the checkpoint of the whole node written and fsynced: see ``KubeletEmulator._apply``).
   One PF's devices (1/64 of the node) turn unhealthy, then healthy again: publish → received by the
   emulator, and publish → applied there, p50/p99 over ``--flips`` updates.  The checkpoint sits on
   /tmp (a disk here, as /var/lib/kubelet is on a node), so fsync costs what a disk costs.

No root needed.  The addresses are the simulated node's (``simnode``'s layout, computed, not written).

    PYTHONPATH=src python bench/bench_density.py [--quick] [--json] [--flips 40] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import _impl
import grpc
import uvloop

from densedev import accel
from densedev._proto import api_pb2
from densedev.kubelet.feed import PoolFeed
from densedev.kubelet.server import PluginServer
from densedev.kubelet.wire import KUBELET_MAX_MESSAGE, ListEncoder
from densedev.testing import simnode
from densedev.testing.kubelet import KubeletEmulator

PREFIX = "example.com"


def node_devices(pfs: int, vfs_per_pf: int) -> list[tuple[str, int]]:
    """Every VF's (address, NUMA node) of ``simnode.build_node``'s layout, PF by PF, without writing it."""
    nics = (pfs + 1) // 2
    out = []
    for nic, (domain, bus) in enumerate(simnode.nic_buses(nics, vfs_per_pf)):
        numa = nic * 2 // max(nics, 1)
        for func in range(min(2, pfs - 2 * nic)):
            pf_rid = (bus + 1) << 8 | func
            offset = 2 - func + func * vfs_per_pf  # as build_node: both PFs, then each PF's VFs in turn
            out.extend((simnode._bdf(domain, pf_rid + offset + k), numa) for k in range(vfs_per_pf))
    return out


def one_pool(pfs: int, vfs_per_pf: int, repeat: int) -> dict[str, object]:
    """Message size and encode times of one pool holding every device."""
    devices = node_devices(pfs, vfs_per_pf)
    ids = [d for d, _ in devices]
    numa = [n for _, n in devices]
    # A limit above the message, so the size is the whole list's even past 4 MiB (densedev's guard
    # would cut it to what fits; ``over_limit`` says whether it had to).
    healthy = [True] * len(ids)
    full_s, update_s = [], []
    for _ in range(repeat):
        encoder = ListEncoder(ids, numa, limit=1 << 30)
        t = time.perf_counter()
        message = encoder.encode(healthy)
        full_s.append(time.perf_counter() - t)
        down = list(healthy)
        pf = range(vfs_per_pf)  # the first PF's VFs
        for i in pf:
            down[i] = False
        t = time.perf_counter()
        update = encoder.encode(down, pf)
        update_s.append(time.perf_counter() - t)
    return {
        "devices": len(ids),
        "message_bytes": len(message),
        "update_bytes": len(update),
        "kubelet_limit_bytes": KUBELET_MAX_MESSAGE,
        "share_of_limit": round(len(message) / KUBELET_MAX_MESSAGE, 3),
        "over_limit": len(message) > KUBELET_MAX_MESSAGE,
        "bytes_per_device": round(len(message) / len(ids), 1),
        "encode_full_ms": round(statistics.median(full_s) * 1e3, 2),
        "encode_one_pf_update_ms": round(statistics.median(update_s) * 1e3, 3),
    }


class _Service:
    """The pool side a PluginServer needs for registration and ListAndWatch (no allocation here)."""

    def options(self) -> tuple[bool, bool]:
        return False, False

    def allocate(self, ids: object) -> api_pb2.ContainerAllocateResponse:
        raise NotImplementedError

    def preferred(self, available: object, must_include: object, size: int) -> list[str]:
        raise NotImplementedError

    def prestart(self, ids: object) -> None:
        raise NotImplementedError


async def _register(plugin_dir: Path, resource: str, endpoint: str) -> None:
    async with grpc.aio.insecure_channel(f"unix:{plugin_dir / 'kubelet.sock'}") as channel:
        register = channel.unary_unary(
            "/v1beta1.Registration/Register",
            request_serializer=api_pb2.RegisterRequest.SerializeToString,
            response_deserializer=api_pb2.Empty.FromString,
        )
        request = api_pb2.RegisterRequest(version="v1beta1", endpoint=endpoint, resource_name=resource)
        await register(request, timeout=30)


async def layout_cost(pfs: int, vfs_per_pf: int, pools: int, flips: int) -> dict[str, object]:
    """PF down/up as seen (received, applied) by the emulator doing the kubelet's work, ``pools`` pools."""
    devices = node_devices(pfs, vfs_per_pf)
    per_pool = -(-pfs // pools) * vfs_per_pf
    chunks = [devices[i : i + per_pool] for i in range(0, len(devices), per_pool)]
    kubelet_dir = Path(tempfile.mkdtemp(prefix="dd-dens-", dir="/tmp"))
    emu = KubeletEmulator(kubelet_dir)
    await emu.start()
    servers, feeds, encoders, names = [], [], [], []
    try:
        for n, chunk in enumerate(chunks):
            encoder = ListEncoder([d for d, _ in chunk], [m for _, m in chunk])
            feed = PoolFeed(encoder.encode([True] * len(chunk)))
            name = f"{PREFIX}/vfs_{n}"
            server = PluginServer(name, kubelet_dir / f"p{n}.sock", feed, _Service())  # type: ignore[arg-type]
            await server.start()
            await _register(kubelet_dir, name, f"p{n}.sock")
            servers.append(server)
            feeds.append(feed)
            encoders.append(encoder)
            names.append(name)
        await emu.wait_for(lambda: all(emu.updates(n) for n in names), 60)
        received: list[float] = []
        applied: list[float] = []
        for k in range(flips):
            pool = k % len(chunks)
            count = len(chunks[pool])
            first = (k // len(chunks)) % (count // vfs_per_pf) * vfs_per_pf
            pf = range(first, first + vfs_per_pf)
            for up in (False, True):
                health = [True] * count
                if not up:
                    for i in pf:
                        health[i] = False
                before = len(emu.updates(names[pool]))
                t0 = time.monotonic()
                feeds[pool].publish(encoders[pool].encode(health, pf))
                await emu.wait_for(lambda p=pool, b=before: len(emu.updates(names[p])) > b, 30)
                upd = emu.updates(names[pool])[-1]
                received.append(upd.received - t0)
                applied.append(upd.applied - t0)
        checkpoint = (kubelet_dir / "kubelet_internal_checkpoint").stat().st_size
    finally:
        for server in servers:
            await server.stop()
        await emu.stop()
        shutil.rmtree(kubelet_dir, ignore_errors=True)
    return {
        "devices": len(devices),
        "pools": len(chunks),
        "devices_per_pool": per_pool,
        "updates": len(received),
        "message_bytes": len(encoders[0].encode([True] * len(chunks[0]))),
        "checkpoint_bytes": checkpoint,
        "received_p50_ms": round(_impl.percentile(received, 0.5) * 1e3, 2),
        "received_p99_ms": round(_impl.percentile(received, 0.99) * 1e3, 2),
        "applied_p50_ms": round(_impl.percentile(applied, 0.5) * 1e3, 2),
        "applied_p99_ms": round(_impl.percentile(applied, 0.99) * 1e3, 2),
        "applied_max_ms": round(max(applied) * 1e3, 2),
    }


def main() -> int:
    """Print the one-pool figures at 65,536 devices and the per-update cost of 1, 16 and 64 pools."""
    _impl.announce(__file__)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="16,384 devices in one pool; 4,096 for the layouts")
    p.add_argument("--json", action="store_true")
    p.add_argument("--flips", type=int, default=40, help="PF down/up pairs per layout")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--layouts", default="1,16,64", help="pool counts to compare (comma-separated)")
    args = p.parse_args()
    logging.basicConfig(level=logging.ERROR)
    big = (16, 1024) if args.quick else (64, 1024)
    node = (64, 64) if args.quick else (64, 256)
    if args.quick:
        args.flips, args.repeat = min(args.flips, 8), min(args.repeat, 3)
    results: list[dict[str, object]] = [{"bench": "density_one_pool", **one_pool(*big, args.repeat)}]
    for pools in (int(x) for x in args.layouts.split(",")):
        r = uvloop.run(layout_cost(*node, pools, args.flips))
        results.append({"bench": "density_layout", **r})
    for r in results:
        r["implementation"] = accel.IMPLEMENTATION
        if args.json:
            print(json.dumps(r))
        elif r["bench"] == "density_one_pool":
            print(
                f"one pool of {r['devices']} devices: ListAndWatch message {r['message_bytes']:,} B "
                f"({r['bytes_per_device']} B/device, {100 * r['share_of_limit']:.0f} % of the kubelet's "  # type: ignore[operator]
                f"4 MiB); encode full list {r['encode_full_ms']} ms, one-PF update "
                f"{r['encode_one_pf_update_ms']} ms"
            )
        else:
            print(
                f"{r['devices']} devices in {r['pools']} pools of {r['devices_per_pool']} "
                f"(message {r['message_bytes']:,} B, checkpoint {r['checkpoint_bytes']:,} B): one PF "
                f"down/up → received p50 {r['received_p50_ms']} p99 {r['received_p99_ms']} ms; applied by "
                f"the kubelet "
                f"p50 {r['applied_p50_ms']} p99 {r['applied_p99_ms']} max {r['applied_max_ms']} ms "
                f"over {r['updates']} updates"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
