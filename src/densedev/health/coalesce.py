"""Coalescing: a burst of events (a PF going down takes its VFs along) becomes one flush, soon after."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class Coalescer:
    """Folds a burst of events into one call of ``flush``, at most ``window`` seconds after its first event.

    The deadline is set by the first event and never pushed back by later ones, so a steady stream of
    events cannot postpone the message to the kubelet indefinitely.
    """

    def __init__(
        self,
        flush: Callable[[], None],
        window: float = 0.002,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        if window < 0:
            raise ValueError(f"coalescing window must be >= 0 seconds, got {window}")
        self._flush = flush
        self._window = window
        self._loop = loop
        self._handle: asyncio.TimerHandle | None = None

    @property
    def pending(self) -> bool:
        """Return whether a flush is scheduled."""
        return self._handle is not None

    def notify(self) -> None:
        """Note an event batch; schedules the flush unless one is already due."""
        if self._handle is None:
            loop = self._loop or asyncio.get_running_loop()
            self._handle = loop.call_later(self._window, self._fire)

    def cancel(self) -> None:
        """Drop a scheduled flush."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _fire(self) -> None:
        self._handle = None
        self._flush()
