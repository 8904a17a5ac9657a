"""The per-kind thread pools: one kind's flood never delays another, and a hung call never blocks exit."""

from __future__ import annotations

import asyncio
import contextvars
import subprocess
import sys
import threading
import time

import pytest

from densedev import workers
from densedev.workers import Work

_var: contextvars.ContextVar[str] = contextvars.ContextVar("_var", default="unset")


async def test_result_exception_and_context_cross_the_thread() -> None:
    _var.set("caller")
    assert await workers.run(Work.CONFIG, lambda a, b=0: a + b, 2, b=3) == 5
    assert await workers.run(Work.CONFIG, _var.get) == "caller"
    with pytest.raises(ZeroDivisionError):
        await workers.run(Work.CONFIG, lambda: 1 / 0)
    name = await workers.run(Work.FILES, lambda: threading.current_thread().name)
    assert name.startswith("densedev-files-")


async def test_a_flood_of_renders_does_not_delay_file_writes() -> None:
    """Every METRICS thread blocked and 200 renders queued: a FILES call still runs at once."""
    gate = threading.Event()
    try:
        flood = [asyncio.ensure_future(workers.run(Work.METRICS, gate.wait, 5)) for _ in range(200)]
        began = time.monotonic()
        assert await asyncio.wait_for(workers.run(Work.FILES, lambda: "written"), 2) == "written"
        assert time.monotonic() - began < 2
        assert not any(f.done() for f in flood)  # the renders are still held: the control
    finally:
        gate.set()
    assert all(await asyncio.gather(*flood))


async def test_threads_per_kind_are_bounded() -> None:
    seen: set[str] = set()
    lock = threading.Lock()

    def note() -> None:
        with lock:
            seen.add(threading.current_thread().name)
        time.sleep(0.01)

    await asyncio.gather(*(workers.run(Work.SCAN, note) for _ in range(50)))
    assert 1 <= len(seen) <= workers.SIZES[Work.SCAN]


def test_a_hung_call_does_not_hold_the_interpreter_at_exit(tmp_path) -> None:
    """A call blocked for good in a read (a FIFO nobody writes, as a hung driver's sysfs file) is left
    behind at exit; concurrent.futures' pools would join it and never exit."""
    import os

    fifo = tmp_path / "hung"
    os.mkfifo(fifo)
    code = (
        "import asyncio, sys\n"
        "from densedev import workers\n"
        "from densedev.workers import Work\n"
        "async def main():\n"
        f"    t = asyncio.ensure_future(workers.run(Work.SCAN, open, {str(fifo)!r}))\n"
        "    await asyncio.sleep(0.2)\n"
        "    t.cancel()\n"
        "asyncio.run(main())\n"
        "print('exiting', flush=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert "exiting" in done.stdout
