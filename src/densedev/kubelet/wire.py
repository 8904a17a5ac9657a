"""A pool's ``ListAndWatchResponse`` bytes, assembled from per-device encodings cached between updates.

At 16k devices, building the message with protobuf objects costs milliseconds on every health flip; here
each ``Device`` is encoded once and re-encoded only when its health changes, and the accelerator joins
the cached parts into one allocation.  The stream then sends those bytes as they are (see ``server``).

The two other messages a pool sends before its first list, ``RegisterRequest`` and the
``DevicePluginOptions`` answer, are encoded here too, so the path to the first list never loads the
protobuf runtime and the generated classes (~15 ms of a start; they load with the first Allocate).
Proto3's rules, as ``SerializeToString()`` applies them: fields in field-number order, a scalar equal to
its default (``""``, ``false``) left out, a message field that is set written even when empty.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from ..accel import encode_device, encode_list
from ..protowire import length_delimited, varint_len

log = logging.getLogger(__name__)

# The kubelet's gRPC client receives at most 4 MiB per message; a larger ListAndWatch message ends the
# stream with RESOURCE_EXHAUSTED and every device of the pool turns unhealthy.  gRPC counts the
# serialized message (its 5-byte frame header is not part of the limit).
KUBELET_MAX_MESSAGE = 4 * 1024 * 1024


def encode_options(pre_start_required: bool, preferred_allocation: bool) -> bytes:
    """Return the bytes of ``v1beta1.DevicePluginOptions`` (fields 1 and 2, bools: 0x08/0x10 then 1)."""
    return (b"\x08\x01" if pre_start_required else b"") + (b"\x10\x01" if preferred_allocation else b"")


def encode_register_request(
    version: str, endpoint: str, resource_name: str, pre_start_required: bool, preferred_allocation: bool
) -> bytes:
    """Return the bytes of ``v1beta1.RegisterRequest``: version 1, endpoint 2, resource_name 3, options 4."""
    out = b"".join(
        length_delimited(number, text.encode())
        for number, text in ((1, version), (2, endpoint), (3, resource_name))
        if text
    )
    return out + length_delimited(4, encode_options(pre_start_required, preferred_allocation))


class ListEncoder:
    """Caches each member's encoded ``Device`` and builds the pool's ``ListAndWatchResponse`` bytes.

    It holds no health of its own: the health tracker hands over every member's health with the
    members that changed since its last report (``None``: all), and only those are re-encoded.
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
        # The pool's own ID strings, encoded again when a member changes: a copy as bytes for every
        # member cost 54 bytes a device (0.8 MiB at 16,384) to save microseconds per flip.
        self._ids = ids if isinstance(ids, tuple) else tuple(ids)
        self._numa = list(numa)
        self._limit = limit
        self._name = name
        self._parts: list[bytes] = [b""] * len(self._ids)  # filled by the first encode (changed=None)
        self.truncated = 0  # members left out of the last message by the size guard

    def __len__(self) -> int:
        return len(self._ids)

    def encode(self, healthy: Sequence[bool], changed: Iterable[int] | None = None) -> bytes:
        """Return the message for this health state, re-encoding the members named in ``changed``."""
        count = len(self._ids)
        if len(healthy) != count:
            raise ValueError(f"ListEncoder: {len(healthy)} health values for {count} devices")
        parts, ids, numa = self._parts, self._ids, self._numa
        for index in range(count) if changed is None else changed:
            if not 0 <= index < count:
                raise IndexError(f"ListEncoder: changed index {index} outside 0..{count - 1}")
            parts[index] = encode_device(ids[index].encode(), bool(healthy[index]), numa[index])
        message = encode_list(parts)
        if len(message) <= self._limit:
            self.truncated = 0
            return message
        return self._truncate(len(message))

    def _truncate(self, size: int) -> bytes:
        """Keep the longest prefix of members that fits the limit, so the stream stays alive."""
        total = 0
        kept = 0
        for part in self._parts:
            entry = 1 + varint_len(len(part)) + len(part)
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
