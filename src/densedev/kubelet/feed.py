"""The latest ListAndWatch message of one pool, versioned, for any number of streams to follow."""

from __future__ import annotations

import asyncio


class PoolFeed:
    """Holds only the newest encoded ``ListAndWatchResponse`` of a pool; readers wait for a newer one.

    A slow kubelet therefore never makes the plugin buffer: a reader that falls behind skips straight
    to the latest state, which is all the kubelet wants (each message replaces the whole list).
    """

    def __init__(self, message: bytes | None = None) -> None:
        # None: no list exists yet.  b"" is a real list (a pool with no devices), so it cannot mean that.
        self._version = 0
        self._message = b"" if message is None else message
        self._listed = message is not None
        self._changed = asyncio.Event()

    @property
    def listed(self) -> bool:
        """Whether a whole list exists: given to the constructor or published since."""
        return self._listed

    def publish(self, message: bytes) -> int:
        """Replace the message, wake every waiting reader and return the new version."""
        self._version += 1
        self._message = message
        self._listed = True
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        return self._version

    def latest(self) -> tuple[int, bytes]:
        """Return the current version and message without waiting."""
        return self._version, self._message

    async def first(self) -> tuple[int, bytes]:
        """Wait until a whole list exists and return the latest version and message."""
        if not self._listed:
            await self.wait_newer(self._version)
        return self._version, self._message

    async def wait_newer(self, version: int) -> tuple[int, bytes]:
        """Wait until the version is newer than ``version`` and return the latest version and message."""
        while self._version <= version:
            await self._changed.wait()
        return self._version, self._message
