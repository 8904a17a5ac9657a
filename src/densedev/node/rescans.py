"""Rescan requests: which PCI devices the next rescan reads (those uevents named, or all), and when;
and since when uevents were lost, until a full rescan has resynced them."""

from __future__ import annotations

import asyncio
import time

# Events come in bursts (writing sriov_numvfs creates hundreds of VFs): a rescan waits this long first.
SETTLE_S = 0.05


class RescanRequests:
    """Collects rescan requests until the rescan loop takes them; a timeout makes the periodic reconcile."""

    def __init__(self) -> None:
        self._targets: set[str] = set()  # PCI addresses named by uevents since the last rescan
        self._full = False
        self._reconcile = False  # the next full rescan is the periodic reconcile
        self._requested = asyncio.Event()
        self.lost_at: float | None = None  # uevents lost since then, not yet resynced by a full rescan

    def request(self, address: str | None = None) -> None:
        """Ask for a rescan soon: of one PCI device (and its VFs if a PF), or of everything."""
        if address is None:
            self._full = True
        else:
            self._targets.add(address)
        self._requested.set()

    async def wait(self, reconcile_s: float) -> None:
        """Return once a rescan was asked for and its burst settled, or after ``reconcile_s`` (reconcile)."""
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a cancellation that
        # arrives as the inner wait completes (cpython gh-86296), and stop() would wait forever.
        try:
            async with asyncio.timeout(reconcile_s):
                await self._requested.wait()
        except TimeoutError:
            self._full = True  # the safety net: reconcile everything now and then
            self._reconcile = True
        await asyncio.sleep(SETTLE_S)
        self._requested.clear()

    def take(self) -> tuple[set[str], bool, bool]:
        """Return and clear what was asked: (addresses, or empty for all; full; the periodic reconcile)."""
        targets, self._targets = self._targets, set()
        full, self._full = self._full or not targets, False
        reconcile, self._reconcile = self._reconcile, False
        return (set() if full else targets), full, reconcile

    def lost(self) -> None:
        """Note that uevents were lost; ask for the full rescan that resyncs them (timed from then)."""
        if self.lost_at is None:
            self.lost_at = time.monotonic()
        self.request()

    def resynced(self, since: float | None) -> float | None:
        """A full rescan begun while the loss noted at ``since`` was outstanding is applied: return the
        seconds since that loss and forget it; None when there is nothing to time (``since`` is None,
        or no longer the loss outstanding)."""
        if since is None or since != self.lost_at:
            return None
        self.lost_at = None
        return time.monotonic() - since
