"""Blocking work off the event loop: one bounded thread pool per kind of work, so no kind starves another.

``asyncio.to_thread`` shares the loop's one default executor among everything: 400 clients scraping
``/metrics`` took every thread and held a reload, a DRA Prepare's file writes and the rescans behind
them for seconds (issue 23, item 4).  Each kind here has its own few threads; a flood of one kind queues
behind its own pool only.  The pools' threads are daemon threads that the interpreter does not join at
exit (``concurrent.futures`` joins its own workers at exit, so one sysfs read hung in a driver would
hold a stopping daemon for good): a stop never waits on a blocked read.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from enum import Enum
from typing import Any, TypeVar

__all__ = ["Work", "pool", "run", "shutdown", "threads"]

T = TypeVar("T")

log = logging.getLogger(__name__)


class Work(Enum):
    """A kind of blocking work; the value is its thread names' prefix, and each has its own threads."""

    SCAN = "scan"  # sysfs: scans, link and attribute reads, RDMA port polls
    KUBELET = "kubelet"  # what the kubelet says it holds: its checkpoint, PodResources replies
    CONFIG = "config"  # config file loads
    FILES = "files"  # Allocate's and Prepare's files: CDI specs, device-info, the DRA checkpoint
    METRICS = "metrics"  # /metrics renders (the scrape path, which anyone on its address may flood)
    NETLINK = "netlink"  # rtnetlink requests that change links (VF settings, MTUs: node/vfnetlink.py)
    REBIND = "rebind"  # driver rebinds through sysfs (node/rebind.py): a probe may take seconds


# Threads per kind.  Scans run Cython with the GIL released and may block in a hung driver's read, so
# they get the most; a render is CPU under the GIL, where a second thread buys nothing.
SIZES: dict[Work, int] = {
    Work.SCAN: 4,
    Work.KUBELET: 2,
    Work.CONFIG: 1,
    Work.FILES: 4,
    Work.METRICS: 1,
    # The kernel runs an rtnetlink request in the sending thread, under rtnl_lock, and a driver's
    # ndo_set_vf_* may wait there on its firmware: a stuck one holds these threads, not the files'.
    Work.NETLINK: 2,
    # A write to drivers_probe returns when the driver's probe() has run (mlx5 waits on its firmware
    # for ~1 s): a few rebinds at once, without holding the files' or netlink's threads meanwhile.
    Work.REBIND: 4,
}


class _Pool:
    """A fixed set of daemon threads taking calls from one queue (a small ThreadPoolExecutor without the
    exit-time join)."""

    __slots__ = ("_lock", "_queue", "_threads", "kind", "size")

    def __init__(self, kind: Work, size: int) -> None:
        self.kind = kind
        self.size = size
        self._queue: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Queue ``fn`` and return its future; starts a thread while fewer than ``size`` run."""
        future: Future[T] = Future()
        self._queue.put((future, fn))
        with self._lock:
            if len(self._threads) < self.size:
                thread = threading.Thread(
                    target=self._work, name=f"densedev-{self.kind.value}-{len(self._threads)}", daemon=True
                )
                self._threads.append(thread)
                thread.start()
        return future

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn()
            except BaseException as exc:  # handed to the awaiting coroutine, which decides
                future.set_exception(exc)
            else:
                future.set_result(result)

    def stop(self) -> None:
        """Tell the threads to end after their current call; queued calls are cancelled."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        with self._lock:
            for _ in self._threads:
                self._queue.put(None)
            self._threads.clear()


_pools: dict[Work, _Pool] = {}
_pools_lock = threading.Lock()


def pool(kind: Work) -> _Pool:
    """Return the thread pool of one kind of work, created at first use."""
    found = _pools.get(kind)
    if found is None:
        with _pools_lock:
            found = _pools.get(kind)
            if found is None:
                found = _pools[kind] = _Pool(kind, SIZES[kind])
    return found


async def run(kind: Work, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """Run ``fn(*args, **kwargs)`` in the threads of ``kind`` and return its result (as ``to_thread``).

    The call carries the caller's context variables, as ``asyncio.to_thread`` does.  Cancelling the
    await does not stop a call already running (a thread cannot be interrupted); it only stops waiting.
    """
    ctx = contextvars.copy_context()
    call = functools.partial(ctx.run, fn, *args, **kwargs)
    return await asyncio.wrap_future(pool(kind).submit(call))


def threads() -> list[threading.Thread]:
    """Return every pool's threads (for checks that count what a process holds)."""
    with _pools_lock:
        pools = list(_pools.values())
    found: list[threading.Thread] = []
    for p in pools:
        with p._lock:
            found += p._threads
    return found


def shutdown() -> None:
    """End every pool's threads after their current calls (a daemon's stop; threads blocked stay behind)."""
    with _pools_lock:
        pools = list(_pools.values())
        _pools.clear()
    for p in pools:
        p.stop()
