"""A pool's ``ListAndWatchResponse`` bytes, assembled from per-device encodings cached between updates.

At 16k devices, building the message with protobuf objects costs milliseconds on every health flip; here
each ``Device`` is encoded once and re-encoded only when its health changes, and the accelerator joins
the cached parts into one allocation.  The stream then sends those bytes as they are (see ``server``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from ..accel import encode_device, encode_list

log = logging.getLogger(__name__)

# The kubelet's gRPC client receives at most 4 MiB per message; a larger ListAndWatch message ends the
# stream with RESOURCE_EXHAUSTED and every device of the pool turns unhealthy.  gRPC counts the
# serialized message (its 5-byte frame header is not part of the limit).
KUBELET_MAX_MESSAGE = 4 * 1024 * 1024


def bit(bitmap: bytes, index: int) -> bool:
    """Return bit ``index`` of a bitmap: byte ``index // 8``, least significant bit first."""
    return bool(bitmap[index >> 3] >> (index & 7) & 1)


def _varint_len(value: int) -> int:
    return max(1, (value.bit_length() + 6) // 7)


class ListEncoder:
    """Caches each member's encoded ``Device`` and builds the pool's ``ListAndWatchResponse`` bytes.

    Health comes as a sequence of booleans or as a bitmap (bit ``i`` of the pool's member ``i``,
    least significant bit first, as ``bit`` reads it).  ``changed`` names the members that may have
    changed; ``None`` compares every member with the last state.
    """

    def __init__(
        self,
        ids: Sequence[str],
        numa: Sequence[int],
        *,
        limit: int = KUBELET_MAX_MESSAGE,
        name: str = "",
    ) -> None:
        if len(ids) != len(numa):
            raise ValueError(f"ListEncoder: {len(ids)} ids but {len(numa)} NUMA nodes")
        self._ids = [device_id.encode() for device_id in ids]
        self._numa = list(numa)
        self._limit = limit
        self._name = name
        # Nothing is known before the first encode(): every member counts as changed then.
        self._healthy: list[bool | None] = [None] * len(self._ids)
        self._parts: list[bytes] = [b""] * len(self._ids)
        self._bitmap: bytes | None = None
        self.truncated = 0  # members left out of the last message by the size guard

    def __len__(self) -> int:
        return len(self._ids)

    def encode(self, healthy: Sequence[bool] | bytes, changed: Iterable[int] | None = None) -> bytes:
        """Return the message for this health state, re-encoding only the members whose health changed."""
        count = len(self._ids)
        if isinstance(healthy, bytes | bytearray | memoryview):
            bitmap = bytes(healthy)
            if len(bitmap) * 8 < count:
                raise ValueError(
                    f"ListEncoder: bitmap of {len(bitmap)} bytes is too short for {count} devices"
                )
            indexes = self._changed_bits(bitmap) if changed is None else changed
            for index in indexes:
                self._check(index)
                self._update(index, bit(bitmap, index))
            self._bitmap = bitmap
        else:
            if len(healthy) != count:
                raise ValueError(f"ListEncoder: {len(healthy)} health values for {count} devices")
            for index in range(count) if changed is None else changed:
                self._check(index)
                self._update(index, bool(healthy[index]))
            self._bitmap = None
        message = encode_list(self._parts)
        if len(message) <= self._limit:
            self.truncated = 0
            return message
        return self._truncate(len(message))

    def _changed_bits(self, bitmap: bytes) -> Iterable[int]:
        """Yield member indexes whose byte differs from the last bitmap (all of them the first time)."""
        count = len(self._ids)
        last = self._bitmap
        for byte_index in range((count + 7) >> 3):
            if last is None or last[byte_index] != bitmap[byte_index]:
                yield from range(byte_index << 3, min(count, (byte_index + 1) << 3))

    def _check(self, index: int) -> None:
        if not 0 <= index < len(self._ids):
            raise IndexError(f"ListEncoder: changed index {index} outside 0..{len(self._ids) - 1}")

    def _update(self, index: int, healthy: bool) -> None:
        if self._healthy[index] is not healthy:
            self._healthy[index] = healthy
            self._parts[index] = encode_device(self._ids[index], healthy, self._numa[index])

    def _truncate(self, size: int) -> bytes:
        """Keep the longest prefix of members that fits the limit, so the stream stays alive."""
        total = 0
        kept = 0
        for part in self._parts:
            entry = 1 + _varint_len(len(part)) + len(part)
            if total + entry > self._limit:
                break
            total += entry
            kept += 1
        self.truncated = len(self._parts) - kept
        log.error(
            "pool %s: ListAndWatch message of %d devices is %d bytes, over the kubelet's %d-byte limit; "
            "sending the first %d devices (%d bytes) and leaving out %d",
            self._name or "?",
            len(self._parts),
            size,
            self._limit,
            kept,
            total,
            self.truncated,
        )
        return encode_list(self._parts[:kept])
