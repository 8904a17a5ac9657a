"""The DRA resource-health stream (``v1alpha1.DRAResourceHealth/NodeWatchResources``), fed by ``update``.

The kubelet (1.34+, gate ResourceHealthStatus) keeps one stream per DRA plugin and reads each message
as the complete health list of the driver's devices; a device missing from it, or not refreshed within
its timeout (30 s by default, ``DefaultHealthTimeout``), becomes Unknown, and when the stream ends the
kubelet forgets them all (k/k pkg/kubelet/cm/dra/manager.go ``HandleWatchResourcesStream``, healthinfo.go).
So the whole list is sent on every change and re-sent every ``resend`` seconds, well within that.

Messages are assembled from cached per-device encodings (as ``wire`` does for ListAndWatch): a change
re-encodes only the devices that changed, and a resend costs a join, not 16k protobuf objects.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, KeysView, Mapping
from typing import Any, cast

import grpc

from .._proto import dra_health_v1alpha1_pb2 as pb
from ..protowire import length_delimited, varint
from . import names

log = logging.getLogger(__name__)

SERVICE = "v1alpha1.DRAResourceHealth"
RESEND_SECONDS = 10.0  # a third of the kubelet's default 30 s health timeout
TIMEOUT_SECONDS = 30  # what we tell kubelets 1.35+ to wait before calling a device Unknown
CHUNK = 1024  # entries joined together and kept: a PF's VFs, typically one or two chunks


def _identity(message: bytes) -> bytes:
    return message


class HealthStream:
    """Holds the health of the driver's devices on this node and streams it to the kubelet."""

    def __init__(
        self,
        pool: str,
        *,
        resend: float = RESEND_SECONDS,
        timeout_seconds: int = TIMEOUT_SECONDS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not 0 < resend < timeout_seconds:
            raise ValueError(f"resend {resend} s must be positive and below the timeout {timeout_seconds} s")
        self.pool = pool
        self.resend = resend
        self.timeout_seconds = timeout_seconds
        self._clock = clock
        # What the kubelet was last sent per device: the key of the encoding cache below (a device is
        # re-encoded, with a new lastUpdatedTime, only when its health changes), never a health source.
        self._health: dict[str, bool] = {}
        # Each device's DeviceIdentifier, framed as DeviceHealth's field 1: it never changes, so a
        # change encodes only the three scalars after it, the same for every device of one update.
        self._ident: dict[str, bytes] = {}
        self._pool_field = length_delimited(1, pool.encode()) if pool else b""  # proto3 omits ""
        # Each device's entry of the message, framed (tag, length, encoded DeviceHealth), in first-seen
        # order (``_slot``: device ID -> position), and the entries joined per chunk of CHUNK: a message
        # joins the chunks, re-joining only those a change touched (65,536 devices: framing each entry
        # anew per message was 66 ms of the loop per change; joining 65,536 entries 6.6 ms).
        self._slot: dict[str, int] = {}
        self._entries: list[bytes] = []
        self._chunks: list[bytes | None] = []
        self._message: bytes | None = None
        self._version = 0
        self._changed = asyncio.Event()
        self._generation = 0  # the newest stream's number: older ones end when a new one opens
        self._bad: set[str] = set()
        self.streams = 0  # streams open now
        self.streams_opened = 0
        self.messages_sent = 0

    # -- the feeding side ---------------------------------------------------------------------------

    def update(self, health: Mapping[str, bool]) -> None:
        """Set the health of devices by ID (PCI address); any change is streamed at once."""
        changed = False
        now = int(self._clock())
        # A PF going down at 65,536 devices changes 1,024: building and serialising a DeviceHealth
        # each was 6 ms of the loop on the way to the kubelet; the bytes after the identifier are
        # the same for all of them (tests pin the result to protobuf's own encoding).
        tails = {True: self._tail(pb.HEALTHY, now), False: self._tail(pb.UNHEALTHY, now)}
        for device_id, healthy in health.items():
            healthy = bool(healthy)
            if self._health.get(device_id) is healthy:
                continue
            ident = self._ident.get(device_id)
            if ident is None:
                try:
                    name = names.device_name(device_id)
                except ValueError:
                    if device_id not in self._bad:
                        self._bad.add(device_id)
                        log.warning("DRA health: %r has no DRA device name; it is not streamed", device_id)
                    continue
                # DeviceIdentifier {pool_name = 1, device_name = 2}, both non-empty strings: written
                # directly (a protobuf object per device was ~0.3 s of a 65,536-device start).
                ident = length_delimited(1, self._pool_field + length_delimited(2, name.encode()))
                self._ident[device_id] = ident
            self._health[device_id] = healthy
            # NodeWatchResourcesResponse's field 1 (devices): the embedded DeviceHealth, framed.
            entry = length_delimited(1, ident + tails[healthy])
            slot = self._slot.get(device_id)
            if slot is None:
                slot = self._slot[device_id] = len(self._entries)
                self._entries.append(entry)
                if slot // CHUNK == len(self._chunks):
                    self._chunks.append(None)
            else:
                self._entries[slot] = entry
            self._chunks[slot // CHUNK] = None
            changed = True
        if changed:
            self._bump()

    def _tail(self, health: pb.HealthStatus, now: int) -> bytes:
        """DeviceHealth's fields 2 to 4 (proto3: a zero is not written), as protobuf orders them."""
        if now < 0 or self.timeout_seconds < 0:  # a negative int64 is ten bytes: leave it to protobuf
            return pb.DeviceHealth(
                health=health, last_updated_time=now, health_check_timeout_seconds=self.timeout_seconds
            ).SerializeToString()
        out = b"\x10" + varint(health)
        if now:
            out += b"\x18" + varint(now)
        if self.timeout_seconds:
            out += b"\x20" + varint(self.timeout_seconds)
        return out

    def forget(self, device_ids: Iterable[str]) -> None:
        """Stop streaming these devices (they left the DRA pools); the kubelet then calls them Unknown."""
        gone = set()
        for device_id in device_ids:
            if self._health.pop(device_id, None) is not None:
                self._ident.pop(device_id, None)
                gone.add(device_id)
        if gone:
            # Rare (devices leaving the DRA pools): the others close up, in the order they had.
            kept = [(d, self._entries[i]) for d, i in self._slot.items() if d not in gone]
            self._slot = {d: i for i, (d, _e) in enumerate(kept)}
            self._entries = [e for _d, e in kept]
            self._chunks = [None] * -(-len(kept) // CHUNK)
            self._bump()

    def devices(self) -> KeysView[str]:
        """Return the IDs of the devices streamed now."""
        return self._health.keys()

    def _bump(self) -> None:
        self._version += 1
        self._message = None
        self._changed.set()
        self._changed = asyncio.Event()

    def message(self) -> bytes:
        """Return the encoded NodeWatchResourcesResponse: every device's health."""
        if self._message is None:
            chunks, entries = self._chunks, self._entries
            for n, chunk in enumerate(chunks):
                if chunk is None:
                    chunks[n] = b"".join(entries[n * CHUNK : (n + 1) * CHUNK])
            self._message = b"".join(cast(list[bytes], chunks))
        return self._message

    # -- the serving side ---------------------------------------------------------------------------

    def stop(self) -> None:
        """End every open stream cleanly (each returns OK); streams opened later are served again."""
        self._generation += 1
        self._changed.set()
        self._changed = asyncio.Event()

    def handler(self) -> grpc.GenericRpcHandler:
        """Return the gRPC handler of ``v1alpha1.DRAResourceHealth``."""
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "NodeWatchResources": grpc.unary_stream_rpc_method_handler(
                    self._watch,
                    request_deserializer=pb.NodeWatchResourcesRequest.FromString,
                    response_serializer=_identity,
                )
            },
        )

    async def _watch(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        # One stream per kubelet: a new one (a restarted kubelet, or its 5 s re-open after an error)
        # supersedes the old, whose peer is gone or about to be; no stream of a dead kubelet lingers.
        self._generation += 1
        mine = self._generation
        older = self._changed
        self._changed = asyncio.Event()
        older.set()
        self.streams += 1
        self.streams_opened += 1
        log.info("DRA health: NodeWatchResources stream opened")
        try:
            while mine == self._generation:
                version = self._version
                yield self.message()
                self.messages_sent += 1
                if version != self._version:
                    continue
                # asyncio.timeout, not wait_for: wait_for runs the wait as a task of its own, so a
                # change woke this stream two loop turns later, behind the flush's other work.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.resend):
                        await self._changed.wait()
        finally:
            self.streams -= 1
            log.info("DRA health: NodeWatchResources stream closed")
