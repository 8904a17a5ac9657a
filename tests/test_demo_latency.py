"""The demo's flip-to-kubelet latency: timed only by the update that answers the flip."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from densedev.demo import _flip_latency
from densedev.testing.kubelet import HEALTHY, UNHEALTHY, Update


class _Emulator:
    """Just the two calls the demo's measurement makes, with updates the test appends itself."""

    def __init__(self) -> None:
        self.list: list[Update] = []
        self.changed = asyncio.Event()

    def updates(self, resource: str) -> list[Update]:
        return self.list

    def append(self, received: float, health: dict[str, str]) -> None:
        self.list.append(Update(received, health, {}, 0, received))
        self.changed.set()

    async def wait_for(self, predicate: Callable[[], bool], timeout: float) -> None:
        async with asyncio.timeout(timeout):
            while not predicate():
                self.changed.clear()
                await self.changed.wait()


VFS = ("0000:3b:00.1", "0000:3b:00.2")


async def test_an_update_received_before_the_flip_is_not_its_answer() -> None:
    # With the kubelet's per-update work on (the demo's emulator), an update is appended after that
    # work: one received just before the flip (the same pool's hold-down recovery, all healthy) can
    # land in the list after the flip's count was taken.  It must not be timed against the flip.
    emulator = _Emulator()
    t_flip = 100.0
    emulator.append(99.978, dict.fromkeys(VFS, HEALTHY))
    answer = asyncio.get_running_loop().call_later(
        0.02, emulator.append, 100.005, dict.fromkeys(VFS, UNHEALTHY)
    )
    try:
        latency = await _flip_latency(emulator, "r", 0, t_flip, VFS, timeout=2.0)  # type: ignore[arg-type]
    finally:
        answer.cancel()
    assert latency is not None
    assert abs(latency - 0.005) < 1e-9


async def test_no_answer_within_the_timeout_is_none() -> None:
    emulator = _Emulator()
    emulator.append(100.01, dict.fromkeys(VFS, HEALTHY))  # after the flip, but still healthy
    assert await _flip_latency(emulator, "r", 0, 100.0, VFS, timeout=0.05) is None  # type: ignore[arg-type]
