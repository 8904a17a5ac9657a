"""Fault: the kubelet restarts 50 times in a row (issue 12, section 6).

A crash-looping kubelet deletes every plugin socket and recreates ``kubelet.sock`` again and again,
faster than plugins finish registering.  The daemon must end with every pool registered once more with
its full, healthy list on a live stream, and hold no more file descriptors, tasks or threads than
after the first few restarts: a leak per restart would show as dozens after fifty.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading

import pytest
from helpers.node import GUARD_S, Node, res

from densedev import workers
from densedev.daemon import Daemon
from densedev.testing.kubelet import HEALTHY, KubeletEmulator

pytestmark = pytest.mark.faults

RESTARTS = 50
WARMUP = 5  # restarts before the resource counts are taken: gRPC sets up its pollers lazily
FD_SLACK = (
    4  # descriptors gRPC may hold for a while (a pooled subchannel); a leak is one per pool per restart
)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def expected_lists(node: Node) -> dict[str, set[str]]:
    pfs = node.layout.pfs
    out = {res(f"sriov_{pf.netdev}"): set(pf.vf_addresses) for pf in pfs[:2]}
    out[res("other_vfs")] = {a for pf in pfs[2:] for a in pf.vf_addresses}
    out[res("rdma_shared")] = {f"{pf.address}/{k}" for pf in pfs for k in range(4)}
    return out


async def settled(emu: KubeletEmulator, want: dict[str, set[str]], since: dict[str, int]) -> None:
    """Wait until every pool registered again after ``since`` and streams its full, healthy list."""

    def done() -> bool:
        return all(
            emu.registrations(r) > since[r]
            and not emu.stream_ended(r)
            and set(emu.devices(r)) == ids
            and set(emu.devices(r).values()) == {HEALTHY}
            for r, ids in want.items()
        )

    await emu.wait_for(done, GUARD_S)


def other_threads() -> int:
    """Return the threads alive that are not the blocking-work pools' (densedev.workers)."""
    pooled = set(workers.threads())
    return sum(1 for t in threading.enumerate() if t not in pooled)


async def test_fifty_kubelet_restarts_in_a_row(node: Node, kubelet: KubeletEmulator, daemon: Daemon) -> None:
    emu = kubelet
    want = expected_lists(node)
    for _ in range(WARMUP):
        since = {r: emu.registrations(r) for r in want}
        await emu.restart()
        await settled(emu, want, since)
    fds, threads = open_fds(), other_threads()
    tasks = len(asyncio.all_tasks())
    first = {r: emu.registrations(r) for r in want}
    waited = 0
    for i in range(RESTARTS - WARMUP):
        since = {r: emu.registrations(r) for r in want}
        await emu.restart()
        # Mostly a whole restart cycle (every server rebuilt, every pool registered: what
        # would leak, leaks once per cycle); every fourth comes back to back with the next,
        # while pools are still re-registering from the last.
        if i % 4 != 3:
            await settled(emu, want, since)
            waited += 1
    await settled(emu, want, since)
    assert daemon.registered()[0], daemon.registered()
    # Each pool came back after every waited restart (and the storm's last); none registered more than
    # once per restart (a runner that forked a second registration loop would).
    for r in want:
        assert waited <= emu.registrations(r) - first[r] <= RESTARTS - WARMUP
    # The lists reaching the kubelet are whole: the last message of each stream names every ID.
    for r, ids in want.items():
        assert set(emu.updates(r)[-1].devices) == ids
    # Exactly one socket per pool, plus the kubelet's own.
    socks = sorted(p.name for p in node.kubelet_dir.iterdir() if p.is_socket())
    assert len(socks) == len(want) + 1 and "kubelet.sock" in socks
    # Let closed channels and finished streams wind down before counting what is held: on a
    # busy machine that takes longer than any fixed pause, so wait (bounded) for the baseline;
    # a leak never gets there.
    with contextlib.suppress(TimeoutError):  # the asserts below say what was left
        await emu.wait_for(
            lambda: (
                len(asyncio.all_tasks()) <= tasks
                and open_fds() <= fds + FD_SLACK
                and other_threads() <= threads  # a finished channel's threads exit a moment later
            ),
            GUARD_S,
        )
    assert len(asyncio.all_tasks()) == tasks
    assert other_threads() <= threads
    # The blocking-work pools start their threads as work first overlaps, up to their fixed sizes.
    assert len(workers.threads()) <= sum(workers.SIZES.values())
    assert open_fds() <= fds + FD_SLACK, (open_fds(), fds)
    assert all(not t.done() for t in daemon._tasks)
