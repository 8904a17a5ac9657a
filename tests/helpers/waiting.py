"""Waiting in async tests for what happens on the loop: bounded, never a timed assertion."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def until(cond: Callable[[], bool], interval: float = 0.01) -> None:
    """Return once ``cond()`` holds, looking every ``interval`` (bound it with ``asyncio.wait_for``)."""
    while not cond():
        await asyncio.sleep(interval)


async def eventually(cond: Callable[[], bool], what: str, limit: float = 30.0) -> None:
    """Wait until ``cond()`` holds; fail naming ``what`` if it has not within ``limit`` s (a hang guard)."""
    try:
        await asyncio.wait_for(until(cond), limit)
    except TimeoutError:
        raise AssertionError(f"never happened: {what}") from None
