"""What the kubelet holds, from its two records: the PodResources API and the device-manager checkpoint.

The PodResources API (``v1.PodResourcesLister/List`` on ``/var/lib/kubelet/pod-resources/kubelet.sock``)
is the supported way for a node agent to learn which devices running pods hold; its List first frees
the devices of pods that are no longer active (the device manager's UpdateAllocatedDevices).  The
checkpoint (``kubelet_internal_checkpoint`` in the device-plugin directory) is kubelet-internal but has
kept its JSON shape since 1.20; the kubelet rewrites it after every allocation and device-list update,
but not when a pod ends, so it may still name devices of finished pods: it is the fallback, never the
reason to list a device.  Both readers return plain ``{(resource, id)}`` sets and never raise for what
the kubelet (or a planted file) gives them.

The List reply is decoded here by hand (``decode_held``) and its request is the empty message: the
daemon reads what pods hold before its first list, and the generated classes with the protobuf runtime
would add ~15 ms to every start for the three fields this reader needs.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple, TypeVar

import grpc

from .. import files, workers
from ..protowire import fields
from ..workers import Work

DEFAULT_SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
CHECKPOINT = "kubelet_internal_checkpoint"
LIST_METHOD = "/v1.PodResourcesLister/List"
# A List of a node running hundreds of pods with thousands of devices is a few MiB at most.
MAX_RECEIVE = 64 * 1024 * 1024
MAX_CHECKPOINT_BYTES = 64 * 1024 * 1024

Held = frozenset[tuple[str, str]]  # (resource name, device ID as the kubelet knows it)
T = TypeVar("T")


class SourceUnavailable(Exception):
    """The source cannot be read now (no socket, kubelet restarting, unreadable file); one line says why."""


class ClaimUse(NamedTuple):
    """One device a running pod's DRA claim uses, as PodResources names it (no claim UID: see below)."""

    driver: str
    namespace: str
    name: str  # the ResourceClaim's name; PodResources gives no UID
    pool: str
    device: str  # the DRA device name within the pool


class PodHoldings(NamedTuple):
    """What one List reply says running pods hold: device-plugin devices, and our drivers' claim devices."""

    devices: Held
    claims: frozenset[ClaimUse] = frozenset()


def decode_held(data: bytes) -> Held:
    """Return every (resource, device ID) of a ``v1.ListPodResourcesResponse``; ValueError if malformed."""
    return decode_pod_resources(data).devices


def decode_pod_resources(data: bytes, drivers: frozenset[str] = frozenset()) -> PodHoldings:
    """Return what a ``v1.ListPodResourcesResponse`` says is held; ValueError if malformed.

    The path: ListPodResourcesResponse.pod_resources (1) → PodResources.containers (3) →
    ContainerResources.devices (2) → ContainerDevices.resource_name (1) and device_ids (2); and, for the
    claims of ``drivers`` only, ContainerResources.dynamic_resources (5) → DynamicResource.claim_name (2),
    claim_namespace (3), claim_resources (4) → ClaimResource.driver_name (2), pool_name (3),
    device_name (4) (field 1 of DynamicResource, class_name, was removed in 1.31; the kubelet fills these
    when its DynamicResourceAllocation feature is on).  Every other field is skipped, as protobuf skips
    unknown ones; a field of another wire type than its declared one is skipped too (protobuf keeps it
    as unknown), and a repeated string name's last value wins.  Nothing here is unbounded but the reply,
    which the client caps (``MAX_RECEIVE``).
    """
    held: set[tuple[str, str]] = set()
    claims: set[ClaimUse] = set()
    for in_list, pod in fields(data):
        if in_list != 1 or pod is None:
            continue
        for in_pod, container in fields(pod):
            if in_pod != 3 or container is None:
                continue
            for in_container, part in fields(container):
                if part is None:
                    continue
                if in_container == 2:
                    resource, ids = "", []
                    for in_devices, value in fields(part):
                        if value is None:
                            continue
                        if in_devices == 1:
                            resource = value.decode()  # proto3 strings are UTF-8: UnicodeDecodeError else
                        elif in_devices == 2:
                            ids.append(value.decode())
                    held.update((resource, i) for i in ids)
                elif in_container == 5 and drivers:
                    claims.update(_claim_uses(part, drivers))
    return PodHoldings(frozenset(held), frozenset(claims))


def _claim_uses(data: bytes, drivers: frozenset[str]) -> list[ClaimUse]:
    """Return the devices of ``drivers`` one DynamicResource names; ValueError if malformed."""
    name = namespace = ""
    resources: list[bytes] = []
    for number, value in fields(data):
        if value is None:
            continue
        if number == 2:
            name = value.decode()
        elif number == 3:
            namespace = value.decode()
        elif number == 4:
            resources.append(value)
    out: list[ClaimUse] = []
    for resource in resources:  # after the loop: the claim's name may follow its resources
        driver = pool = device = ""
        for number, value in fields(resource):
            if value is None:
                continue
            if number == 2:
                driver = value.decode()
            elif number == 3:
                pool = value.decode()
            elif number == 4:
                device = value.decode()
        if driver in drivers:
            out.append(ClaimUse(driver, namespace, name, pool, device))
    return out


class PodResourcesClient:
    """Calls ``List`` on the kubelet's PodResources socket; reconnects after any failure.

    ``decode`` turns the reply's bytes into what is held (``decode_held``; a test passes one that notes
    the thread it ran in).
    """

    def __init__(
        self, socket: Path, timeout: float = 2.0, *, decode: Callable[[bytes], Held] = decode_held
    ) -> None:
        self.socket = Path(socket)
        self.timeout = timeout
        self._decode = decode
        self._channel: grpc.aio.Channel | None = None
        self._list: grpc.aio.UnaryUnaryMultiCallable | None = None

    async def list(self) -> Held:
        """Return every (resource, device ID) a running pod holds; raise SourceUnavailable on failure."""
        return await self.read(self._decode)

    async def read(self, decode: Callable[[bytes], T]) -> T:
        """Call List and return the reply as ``decode`` reads it (off the loop); SourceUnavailable if not."""
        # Without the socket, gRPC would wait in its reconnect back-off; the kubelet creates the socket
        # when it starts serving, so its absence is an answer.
        try:
            st = os.lstat(self.socket)
        except OSError as exc:
            raise SourceUnavailable(f"{self.socket}: {exc.strerror}") from None
        if not stat.S_ISSOCK(st.st_mode):
            raise SourceUnavailable(f"{self.socket}: not a socket")
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(
                f"unix:{self.socket}", options=(("grpc.max_receive_message_length", MAX_RECEIVE),)
            )
            # Bytes both ways: the request is the empty ListPodResourcesRequest, the reply decode_held's.
            self._list = self._channel.unary_unary(LIST_METHOD, None, None)
        assert self._list is not None
        try:
            response = await self._list(b"", timeout=self.timeout)
        except grpc.aio.AioRpcError as exc:
            # A restarted kubelet serves a new socket: start from a fresh channel next time.
            await self.close()
            details = (exc.details() or "")[:200]
            raise SourceUnavailable(f"{self.socket}: List: {exc.code().name} {details}") from None
        try:
            # Off the loop: a List of a large node is tens of MiB, and decoding 60 MiB in Python takes
            # most of a second (issue 23 item 7) that no health flush or Allocate may wait for.
            return await workers.run(Work.KUBELET, decode, response)
        except ValueError as exc:  # UnicodeDecodeError included
            # As after an RPC error (a reply the generated classes failed to parse was one): not the
            # kubelet we knew, so a fresh channel next time.
            await self.close()
            raise SourceUnavailable(f"{self.socket}: List: undecodable reply: {str(exc)[:200]}") from None

    async def close(self) -> None:
        """Close the channel (a later ``list`` opens a new one)."""
        channel, self._channel, self._list = self._channel, None, None
        if channel is not None:
            await channel.close(None)


def checkpoint_identity(path: Path) -> files.FileIdentity | None:
    """Return what changes when the kubelet replaces the checkpoint (it writes a new file and renames it)."""
    try:
        return files.identify(path, follow_symlinks=False)
    except OSError:
        return None


def read_checkpoint(path: Path) -> Held:
    """Return every (resource, device ID) of the checkpoint's PodDeviceEntries.

    Opened without following symlinks and only if a regular file of bounded size: the kubelet's
    directory is writable by other device plugins.  The Checksum is not verified (the kubelet's is an
    FNV hash of a Go-specific dump of Data); entries that do not have the documented shape are skipped.

    No file in an existing directory is the kubelet's own "nothing allocated": its device manager writes
    the checkpoint after every allocation (allocateContainerResources ends in writeCheckpoint, always by
    a rename, so it is never briefly absent) and reads a missing one as empty state at its start.  A file
    that exists but cannot be read (not JSON, a symlink, a FIFO, over the bound, no permission) says
    nothing and raises SourceUnavailable: the caller keeps what it knew.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        if os.path.isdir(path.parent):
            return frozenset()
        raise SourceUnavailable(f"{path.parent}: no such directory") from None
    except OSError as exc:
        raise SourceUnavailable(f"{path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SourceUnavailable(f"{path}: not a regular file")
        if st.st_size > MAX_CHECKPOINT_BYTES:
            raise SourceUnavailable(f"{path}: {st.st_size} bytes, over {MAX_CHECKPOINT_BYTES}")
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
            if sum(map(len, chunks)) > MAX_CHECKPOINT_BYTES:
                raise SourceUnavailable(f"{path}: grew over {MAX_CHECKPOINT_BYTES} bytes while read")
    except OSError as exc:
        raise SourceUnavailable(f"{path}: {exc.strerror}") from None
    finally:
        os.close(fd)
    try:
        doc = json.loads(b"".join(chunks))
    except (ValueError, RecursionError) as exc:
        raise SourceUnavailable(f"{path}: not JSON: {str(exc)[:120]}") from None
    data = doc.get("Data") if isinstance(doc, dict) else None
    if not isinstance(data, dict):
        raise SourceUnavailable(f"{path}: no Data object")
    entries = data.get("PodDeviceEntries") or []  # Go marshals an empty slice as null
    if not isinstance(entries, list):
        raise SourceUnavailable(f"{path}: PodDeviceEntries is not a list")
    held: set[tuple[str, str]] = set()
    for entry in entries:
        if not isinstance(entry, dict):
            continue
        resource = entry.get("ResourceName")
        per_numa = entry.get("DeviceIDs")
        if not isinstance(resource, str) or not isinstance(per_numa, dict):
            continue
        # DeviceIDs is keyed by NUMA node ("-1" without topology); a device on two nodes is listed twice.
        for ids in per_numa.values():
            if isinstance(ids, list):
                held.update((resource, i) for i in ids if isinstance(i, str))
    return frozenset(held)
