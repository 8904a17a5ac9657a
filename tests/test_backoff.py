"""The one retry rule: doubling from the low bound, capped, reset after a success."""

from __future__ import annotations

import pytest

from densedev.backoff import Backoff, backoff_delay, jittered


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


def test_jitter_takes_up_to_its_fraction_off_each_delay() -> None:
    draws = iter([0.0, 0.5, 0.999, 0.25])
    b = Backoff(1.0, 4.0, jitter=0.5, rand=lambda: next(draws))
    assert [b.next() for _ in range(4)] == [1.0, 1.5, 4.0 * (1 - 0.4995), 4.0 * 0.875]
    assert jittered(8.0, 0.0, lambda: 0.7) == 8.0


def test_half_jittered_delays_stay_within_half_to_all_of_their_step() -> None:
    # Real random draws: each delay within [d/2, d]; the next step's floor is then d itself, so a
    # retrier's waits never shrink before the cap whatever the draws.
    b = Backoff(0.5, 30.0, jitter=0.5)
    for attempt in range(1, 200):
        d = backoff_delay(attempt, b.bounds)
        got = b.next()
        assert d / 2 <= got <= d


def test_a_jitter_fraction_outside_zero_to_one_is_refused() -> None:
    with pytest.raises(ValueError, match="jitter fraction"):
        Backoff(1.0, 2.0, jitter=1.5)
    with pytest.raises(ValueError, match="jitter fraction"):
        jittered(1.0, -0.1)
