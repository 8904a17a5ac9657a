"""Benchmark a large PodResources List reply: its decode, and how long it stalls the daemon's event loop.

A node running thousands of pods answers List with tens of MiB.  The client decodes the reply in a
``densedev-kubelet-*`` worker thread (issue 23 item 7: on the loop, 60 MiB stalled it for most of a
second).  This prints how long the decode alone takes on this machine, and the longest gap a 10 ms
ticker on the loop sees while ``PodResourcesClient.list`` fetches and decodes the same reply from a
server in a child process (the kubelet is another process): what is left is gRPC's own receive.

    PYTHONPATH=src python bench/bench_podresources.py [--quick] [--mib 60] [--shape dra|devices] [--runs 3]
                                                      [--json]

``dra`` pods hold 8 VFs and a DRA claim of 128 CDI devices (the claim is skipped whole by the decoder);
``devices`` pods hold only the 8 VFs, the densest reply to decode per MiB.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import grpc
import uvloop

from densedev.node.holdings import PodResourcesClient, decode_held
from densedev.protowire import length_delimited

VFS = [f"0000:{b:02x}:{d:02x}.{f}".encode() for b in (0x3B, 0x5E) for d in range(2) for f in (2, 3)]


def reply(mib: int, shape: str) -> bytes:
    """A List reply of at least ``mib`` MiB made of identical pods of the given shape."""
    devices = length_delimited(1, b"example.com/sriov_a") + b"".join(length_delimited(2, i) for i in VFS)
    container = length_delimited(1, b"main") + length_delimited(2, devices)
    if shape == "dra":
        names = [f"dra.example.com/vf=claim-{k:03d}".encode() for k in range(128)]
        cdi = b"".join(length_delimited(1, length_delimited(1, n)) for n in names)
        container += length_delimited(5, length_delimited(2, b"claim") + length_delimited(4, cdi))
    pod = length_delimited(1, b"pod") + length_delimited(2, b"default") + length_delimited(3, container)
    one = length_delimited(1, pod)
    return one * ((mib << 20) // len(one) + 1)


async def serve(socket: str, mib: int, shape: str) -> None:
    """The child: serve List with the reply until killed."""
    data = reply(mib, shape)

    async def list_(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return data

    server = grpc.aio.server()
    handler = grpc.method_handlers_generic_handler(
        "v1.PodResourcesLister", {"List": grpc.unary_unary_rpc_method_handler(list_)}
    )
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"unix:{socket}")
    await server.start()
    print("ready", flush=True)
    await asyncio.sleep(3600)


async def stall(socket: Path) -> tuple[float, float]:
    """Return (seconds List took, longest gap between 10 ms ticks of the loop meanwhile)."""
    client = PodResourcesClient(socket, timeout=60)
    worst = 0.0
    done = asyncio.Event()

    async def ticker() -> None:
        nonlocal worst
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.01)
            now = time.perf_counter()
            worst = max(worst, now - last - 0.01)
            last = now

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.05)
    t0 = time.perf_counter()
    try:
        await client.list()
    finally:
        took = time.perf_counter() - t0
        done.set()
        await task
        await client.close()
    return took, worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=60)
    ap.add_argument("--shape", choices=("dra", "devices"), default="dra")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="8 MiB, one run")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.mib, args.runs = 8, 1
    if args.serve:
        uvloop.run(serve(args.serve, args.mib, args.shape))
        return
    data = reply(args.mib, args.shape)
    decode = []
    for _ in range(args.runs):
        t0 = time.perf_counter()
        decode_held(data)
        decode.append(time.perf_counter() - t0)
    del data
    work = Path(tempfile.mkdtemp(prefix="pr-", dir="/tmp"))
    socket = work / "kubelet.sock"
    child = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(socket), "--mib", str(args.mib), "--shape", args.shape],
        stdout=subprocess.PIPE,
        env=os.environ,
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == b"ready"
        runs = [uvloop.run(stall(socket)) for _ in range(args.runs)]
    finally:
        child.kill()
        child.wait()
        for p in work.iterdir():
            p.unlink()
        work.rmdir()
    result = {
        "mib": args.mib,
        "shape": args.shape,
        "decode_ms": round(statistics.median(decode) * 1e3, 1),
        "list_ms": round(statistics.median(r[0] for r in runs) * 1e3, 1),
        "loop_stall_ms": round(statistics.median(r[1] for r in runs) * 1e3, 1),
    }
    result["stall_over_decode"] = round(result["loop_stall_ms"] / result["decode_ms"], 3)
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{args.mib} MiB List reply ({args.shape}): decode alone {result['decode_ms']} ms; "
            f"List {result['list_ms']} ms with the loop's longest stall {result['loop_stall_ms']} ms "
            f"({result['stall_over_decode']:.0%} of the decode), median of {args.runs}"
        )


if __name__ == "__main__":
    main()
