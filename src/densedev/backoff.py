"""Retry delays: every retry loop of the daemon waits by this one rule, doubling from a low bound to a cap.

Pool starts, the DRA driver's start, restarted daemon tasks and reopened netlink sockets all retry
what the environment may heal (a planted socket file, an API server not up yet, a namespace gone); the
first retry comes soon, later ones ever less often, never further apart than the cap.
"""

from __future__ import annotations

__all__ = ["Backoff", "backoff_delay"]


def backoff_delay(attempt: int, bounds: tuple[float, float]) -> float:
    """Return the wait before retry ``attempt`` (1-based): the low bound, doubling, capped at the high."""
    low, high = bounds
    # The exponent is capped: 2 ** 1024 does not fit a float, and a start failing every 10 s reaches
    # that attempt within three hours (an OverflowError then, and the retry loop would be gone).
    return min(low * 2.0 ** min(attempt - 1, 64), high)


class Backoff:
    """The delays of one retry loop (``backoff_delay``), counted until ``reset`` after a success."""

    __slots__ = ("attempt", "bounds")

    def __init__(self, low: float, high: float) -> None:
        self.bounds = (low, high)
        self.attempt = 0  # failures since the last reset

    def next(self) -> float:
        """Count one more failure and return the wait before the retry it calls for."""
        self.attempt += 1
        return backoff_delay(self.attempt, self.bounds)

    def reset(self) -> None:
        """Start again from the low bound (the retried thing worked, or ran long enough to count)."""
        self.attempt = 0
