"""``densedev kubelet-emulator DIR``: a stand-in kubelet to try ``densedev run`` end to end.

It serves ``DIR/kubelet.sock`` as the kubelet's device manager does, and prints a line whenever a
resource registers or its device list changes (counts, not thousands of IDs); ``--allocate RES=N``
asks the plugin for N healthy devices of RES once they are listed, as the kubelet does at pod
admission, and prints the container's environment.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal

import grpc

from .testing.kubelet import HEALTHY, KubeletEmulator, KubeletError


def parse_allocation(text: str) -> tuple[str, int]:
    """Parse ``RESOURCE=COUNT`` (``intel.com/sriov_ens1f0=2``)."""
    resource, sep, count = text.rpartition("=")
    if not sep or "/" not in resource or not count.isdigit() or int(count) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected RESOURCE=COUNT, e.g. intel.com/sriov_a=2")
    return resource, int(count)


async def run_emulator(args: argparse.Namespace) -> int:
    """Serve until Ctrl-C, SIGTERM or ``--seconds``; print registrations, list changes, allocations."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    emulator = KubeletEmulator(args.dir)
    await emulator.start()
    print(f"kubelet emulator listening on {emulator.socket_path}", flush=True)
    pending = list(args.allocate)
    shown: dict[str, tuple[int, int, int]] = {}
    code = 0
    try:
        if args.seconds > 0:
            loop.call_later(args.seconds, stop.set)
        while not stop.is_set():
            for res in emulator.resources():
                devices = emulator.devices(res)
                healthy = sum(1 for h in devices.values() if h == HEALTHY)
                state = (emulator.registrations(res), len(devices), healthy)
                if shown.get(res) != state:
                    shown[res] = state
                    print(f"{res}: {len(devices)} devices, {healthy} healthy", flush=True)
            for want in list(pending):
                code = max(code, await _try_allocate(emulator, want, pending))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.2)
    finally:
        await emulator.stop()
    return code


async def _try_allocate(
    emulator: KubeletEmulator, want: tuple[str, int], pending: list[tuple[str, int]]
) -> int:
    resource, count = want
    healthy = sorted(i for i, h in emulator.devices(resource).items() if h == HEALTHY)
    if len(healthy) < count:
        return 0  # not listed (yet): try again on the next change
    pending.remove(want)
    try:
        response = await emulator.allocate(resource, healthy[:count])
    except (KubeletError, grpc.aio.AioRpcError) as exc:
        print(f"allocate {count} of {resource}: refused: {exc}", flush=True)
        return 1
    env = " ".join(f"{k}={v}" for k, v in sorted(response.envs.items()))
    print(f"allocated {', '.join(healthy[:count])} of {resource}: {env}", flush=True)
    return 0
