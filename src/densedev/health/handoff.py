"""The health hand-off: the tracker's changed pools, handed on once per burst and when a hold-down ends."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping

from .coalesce import Coalescer
from .tracker import HealthTracker, PoolUpdate

# deliver(updates by pool name, seconds since the burst's first event or None, events in the burst)
Deliver = Callable[[Mapping[str, PoolUpdate], float | None, int], None]


class Handoff:
    """Hands the tracker's changes to ``deliver``: one flush per burst of facts, one per hold-down end.

    Coalescing: the first event of a burst arms one flush ``window`` seconds later; later events in the
    window ride along, so a PF taking 256 VFs down becomes one message per pool.  After each flush the
    earliest running hold-down arms the next one, so recovery is told without polling.
    """

    def __init__(
        self,
        tracker: HealthTracker,
        deliver: Deliver,
        window: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._tracker = tracker
        self._deliver = deliver
        self._clock = clock  # the tracker's clock: hold-down deadlines are in its time
        self._coalescer = Coalescer(self.flush, window)
        self._burst_start: float | None = None  # when the first event of the pending burst arrived
        self._burst_events = 0
        self._deadline_handle: asyncio.TimerHandle | None = None

    @property
    def coalescer(self) -> Coalescer:
        """Return the coalescer of the current window (a reload that changes the window makes a new one)."""
        return self._coalescer

    def note(self, count: int) -> None:
        """Note ``count`` facts given to the tracker (0: a rescan or poll that may have changed any)."""
        if self._burst_start is None:
            self._burst_start = time.monotonic()
        self._burst_events += count
        self._coalescer.notify()

    def flush(self) -> None:
        """Hand every pool whose advertised health changed to ``deliver``, and arm the hold-down timer."""
        updates = self._tracker.collect()
        latency = None if self._burst_start is None else time.monotonic() - self._burst_start
        events, self._burst_start, self._burst_events = self._burst_events, None, 0
        self._deliver(updates, latency, events)
        deadline = self._tracker.next_deadline()
        if self._deadline_handle is not None:
            self._deadline_handle.cancel()
            self._deadline_handle = None
        if deadline is not None:
            loop = asyncio.get_running_loop()
            self._deadline_handle = loop.call_later(max(0.0, deadline - self._clock()), self.flush)

    def set_window(self, window: float) -> None:
        """Coalesce over ``window`` seconds from now on (a reload), carrying a pending flush over."""
        # A new coalescer, but the old one's pending flush must neither fire later (a second flush, or
        # one after stop()) nor be lost: the new one takes it over.
        pending = self._coalescer.pending
        self._coalescer.cancel()
        self._coalescer = Coalescer(self.flush, window)
        if pending:
            self._coalescer.notify()

    def cancel(self) -> None:
        """Drop the scheduled flush and the hold-down timer (the daemon stops)."""
        self._coalescer.cancel()
        if self._deadline_handle is not None:
            self._deadline_handle.cancel()
            self._deadline_handle = None
