"""What one grpc.aio server on a unix socket costs in RSS, and what a client streaming from it adds.

Standalone (grpcio and uvloop only, no densedev), as ``repro_grpc_lifecycle.py``: N servers are started
in this process, each with a unary-stream method that sends one message and holds the stream open, as a
device-plugin pool's ListAndWatch does; a child process then dials every socket on a channel of its own
(as the kubelet does) and reads the first message.  Printed: the RSS per server, then per connected
stream, both with densedev's server options and with each extra option tried, so what a channel
argument could save is measured, not guessed.

    python bench/grpc_server_cost.py [--servers 500]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import grpc
import uvloop

# densedev's own (kubelet/lifecycle.py SERVER_OPTIONS), repeated: this script imports no densedev.
BASE: list[tuple[str, Any]] = [
    ("grpc.max_send_message_length", 4 << 20),
    ("grpc.max_receive_message_length", 4 << 20),
    ("grpc.so_reuseport", 0),
]
TRIED: list[list[tuple[str, Any]]] = [
    [],
    [("grpc.experimental.tcp_read_chunk_size", 1024), ("grpc.experimental.tcp_max_read_chunk_size", 8192)],
    [("grpc.http2.bdp_probe", 0)],
    [("grpc.http2.hpack_table_size.decoder", 256), ("grpc.http2.hpack_table_size.encoder", 256)],
    [("grpc.http2.write_buffer_size", 1024)],
    [("grpc.max_concurrent_streams", 4)],
]


def rss_kib() -> float:
    """This process's resident memory in KiB."""
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1024


async def serve(n: int, options: list[tuple[str, Any]]) -> tuple[float, float]:
    """Start ``n`` servers, then a child streaming from each; return KiB per server and per stream."""
    where = Path(tempfile.mkdtemp(prefix="gsc-", dir="/tmp"))
    stop = asyncio.Event()

    async def list_and_watch(request: bytes, context: grpc.aio.ServicerContext) -> Any:
        yield b"x" * 200
        await stop.wait()

    handler = grpc.method_handlers_generic_handler(
        "s", {"LW": grpc.unary_stream_rpc_method_handler(list_and_watch)}
    )
    servers = []

    async def one(name: str) -> None:
        server = grpc.aio.server(options=options)
        server.add_generic_rpc_handlers((handler,))
        server.add_insecure_port(f"unix:{where / name}")
        await server.start()
        servers.append(server)

    await one("warm.sock")  # the first server brings gRPC's shared state up: not a server's own cost
    await asyncio.sleep(0.5)
    before = rss_kib()
    for i in range(n):
        await one(f"{i}.sock")
    await asyncio.sleep(0.5)
    served = rss_kib()
    child = subprocess.Popen([sys.executable, __file__, "--child", str(where), "--servers", str(n)])
    try:
        while not (where / "ready").exists():
            if child.poll() is not None:
                raise RuntimeError("the client process ended before dialling every server")
            await asyncio.sleep(0.2)
        await asyncio.sleep(1.0)
        streamed = rss_kib()
    finally:
        child.kill()
        child.wait()
        stop.set()
        await asyncio.gather(*(s.stop(None) for s in servers))
        shutil.rmtree(where, ignore_errors=True)
    return (served - before) / n, (streamed - served) / n


async def dial(where: Path, n: int) -> None:
    """The child: one channel and one open stream per server, then wait to be killed."""
    held = []
    for i in range(n):
        channel = grpc.aio.insecure_channel(
            f"unix:{where / f'{i}.sock'}", options=(("grpc.use_local_subchannel_pool", 1),)
        )
        call = channel.unary_stream("/s/LW")(b"")
        await call.read()
        held.append((channel, call))
    (where / "ready").write_bytes(b"")
    await asyncio.sleep(3600)


def main() -> int:
    """Measure each option set in a fresh process of its own, print one line (or JSON) per set."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", type=int, default=500)
    p.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--options", help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.child is not None:
        uvloop.run(dial(args.child, args.servers))
        return 0
    if args.options is not None:
        options = [tuple(o) for o in json.loads(args.options)]
        per_server, per_stream = uvloop.run(serve(args.servers, options))  # type: ignore[arg-type]
        print(json.dumps({"server_kib": round(per_server, 1), "stream_kib": round(per_stream, 1)}))
        return 0
    for extra in TRIED:
        # A process per option set: memory freed by one set's servers would be reused by the next.
        out = subprocess.run(
            [sys.executable, __file__, "--servers", str(args.servers), "--options", json.dumps(BASE + extra)],
            capture_output=True,
            text=True,
            check=True,
        )
        found = json.loads(out.stdout.strip().splitlines()[-1])
        label = ", ".join(f"{k}={v}" for k, v in extra) or "densedev's options"
        if args.json:
            print(json.dumps({"options": label, **found}))
        else:
            print(
                f"{label}: {found['server_kib']} KiB a server, {found['stream_kib']} KiB more with a "
                f"client streaming from it ({args.servers} servers)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
