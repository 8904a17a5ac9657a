"""The one retry rule: doubling from the low bound, capped, reset after a success."""

from __future__ import annotations

from densedev.backoff import Backoff, backoff_delay


def test_delays_double_from_the_low_bound_up_to_the_cap() -> None:
    assert [backoff_delay(a, (0.5, 10.0)) for a in range(1, 8)] == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]


def test_a_retry_loop_failing_for_hours_keeps_its_cap() -> None:
    # 2 ** 1024 does not fit a float: a start failing every 10 s reaches that attempt in under 3 hours.
    assert backoff_delay(1025, (0.5, 10.0)) == 10.0
    assert backoff_delay(10**6, (0.1, 30.0)) == 30.0


def test_backoff_counts_failures_until_reset() -> None:
    b = Backoff(0.1, 0.4)
    assert [b.next() for _ in range(4)] == [0.1, 0.2, 0.4, 0.4]
    assert b.attempt == 4
    b.reset()
    assert b.next() == 0.1
