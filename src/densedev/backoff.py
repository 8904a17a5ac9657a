"""Retry delays: every retry loop of the daemon waits by this one rule, doubling from a low bound to a cap.

Pool starts, the DRA driver's start, restarted daemon tasks and reopened netlink sockets all retry
what the environment may heal (a planted socket file, an API server not up yet, a namespace gone); the
first retry comes soon, later ones ever less often, never further apart than the cap.

Jitter (optional) takes up to a fraction of each delay off at random, so many retriers that failed
together (a node's slices refused by one API server) do not come back in step.  Taken off rather than
added ("equal jitter" when the fraction is a half): the cap stays a cap, and with a fraction of at most a
half, every delay is at least the previous one's upper bound halved, so delays keep growing until the cap.
"""

from __future__ import annotations

import random
from collections.abc import Callable

__all__ = ["Backoff", "backoff_delay", "jittered"]


def backoff_delay(attempt: int, bounds: tuple[float, float]) -> float:
    """Return the wait before retry ``attempt`` (1-based): the low bound, doubling, capped at the high."""
    low, high = bounds
    # The exponent is capped: 2 ** 1024 does not fit a float, and a start failing every 10 s reaches
    # that attempt within three hours (an OverflowError then, and the retry loop would be gone).
    return min(low * 2.0 ** min(attempt - 1, 64), high)


def jittered(delay: float, fraction: float, rand: Callable[[], float] = random.random) -> float:
    """Return ``delay`` less a random part of up to ``fraction`` of it (``rand`` gives [0, 1))."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"jitter fraction must be within [0, 1], got {fraction}")
    return delay * (1.0 - fraction * rand())


class Backoff:
    """The delays of one retry loop (``backoff_delay``, ``jittered`` when asked), counted until ``reset``."""

    __slots__ = ("_rand", "attempt", "bounds", "jitter")

    def __init__(
        self, low: float, high: float, *, jitter: float = 0.0, rand: Callable[[], float] = random.random
    ) -> None:
        if not 0.0 <= jitter <= 1.0:
            raise ValueError(f"jitter fraction must be within [0, 1], got {jitter}")
        self.bounds = (low, high)
        self.jitter = jitter
        self._rand = rand
        self.attempt = 0  # failures since the last reset

    def next(self) -> float:
        """Count one more failure and return the wait before the retry it calls for."""
        self.attempt += 1
        delay = backoff_delay(self.attempt, self.bounds)
        return jittered(delay, self.jitter, self._rand) if self.jitter else delay

    def reset(self) -> None:
        """Start again from the low bound (the retried thing worked, or ran long enough to count)."""
        self.attempt = 0
