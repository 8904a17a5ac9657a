"""A kubelet device manager in miniature: serves Registration, dials plugins and consumes their streams.

It behaves as the real kubelet does (see the device-plugin reference): it validates Register, dials the
plugin and reads its options inside Register, follows ListAndWatch with the 4 MiB receive limit, marks
a resource's devices unhealthy when its stream ends, never redials and removes the resource after
``endpointStopGracePeriod`` (5 minutes) without a plugin, and refuses unhealthy or unknown devices before
asking the plugin to allocate them.  A new registration of a resource replaces the endpoint as the v1.32
device manager does: the replaced client's stream is still followed, and when it ends the newest client
is disconnected in its place (the re-registration race).  Tests, the demo and the benchmarks drive it.

Pods come and go through ``create_pod`` / ``delete_pod``.  Like the kubelet's device manager it
accounts allocated devices per resource name only, so a device a plugin lists under two resources can
be handed to two pods; every such double holding is recorded (``double_holdings``), and a strict
emulator raises ``InvariantViolation`` on the first one.  It serves the PodResources API
(``v1.PodResourcesLister``) when given a socket path, and writes ``kubelet_internal_checkpoint`` when
and as the kubelet does: after every ListAndWatch message, fsynced, before the next is read (the cost
the benchmarks show; ``update_work=False`` leaves it out and records only the list).

The names it accepts follow the kubelet's own rules, written here from Kubernetes' sources
(``v1helper.IsExtendedResourceName``, apimachinery's ``IsQualifiedName``), independently of the
daemon's config validation, so that a bug in either shows up as a disagreement.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import re
import stat
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from .._proto import api_pb2, podresources_pb2
from ..node.holdings import ClaimUse

log = logging.getLogger(__name__)

VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
CHECKPOINT = "kubelet_internal_checkpoint"
MAX_RECEIVE = 4 * 1024 * 1024  # the kubelet's gRPC default receive limit
DIAL_TIMEOUT = 10.0  # the kubelet dials a registering plugin for up to 10 s, blocking Register
# devicemanager's endpointStopGracePeriod: a resource whose plugin went away is removed 5 minutes later.
ENDPOINT_STOP_GRACE = 300.0
# Go's syscall.SockaddrUnix refuses (EINVAL) a path as long as sun_path (108 bytes on Linux) unless it is
# abstract: the kubelet can dial at most 107 bytes.
SUN_PATH_MAX = 107
# A device's health as the device-plugin API spells it (k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1,
# constants.go: Healthy, Unhealthy): the kubelet compares these strings, so the emulator holds them as
# sent, written here rather than taken from the daemon's model.Health, which the daemon encodes from.
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"

# k8s.io/apimachinery/pkg/util/validation: a DNS-1123 label/subdomain, and a qualified name's name part.
# Go's regexp matches ASCII classes on bytes; Python's on str, hence ASCII only and fullmatch for "^...$".
_RFC1123_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_RFC1123_SUBDOMAIN = re.compile(rf"{_RFC1123_LABEL}(\.{_RFC1123_LABEL})*", re.ASCII)
_QUALIFIED_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]", re.ASCII)
_REQUESTS_PREFIX = "requests."  # v1.DefaultResourceRequestsPrefix
_NATIVE_NAMESPACE = "kubernetes.io/"  # v1.ResourceDefaultNamespacePrefix


def qualified_name_errors(value: str) -> list[str]:
    """Return what apimachinery's ``IsQualifiedName`` says about ``value`` (empty when it is valid)."""
    parts = value.split("/")
    if len(parts) > 2:
        return ["a qualified name has at most one '/'"]
    errors = []
    if len(parts) == 2:
        prefix, name = parts
        if not prefix:
            errors.append("prefix part must be non-empty")
        else:
            # IsDNS1123Subdomain counts bytes (Go's len).
            if len(prefix.encode()) > 253:
                errors.append("prefix part must be no more than 253 characters")
            if not _RFC1123_SUBDOMAIN.fullmatch(prefix):
                errors.append("prefix part must be a lowercase RFC 1123 subdomain")
    else:
        name = parts[0]
    if not name:
        errors.append("name part must be non-empty")
    elif len(name.encode()) > 63:
        errors.append("name part must be no more than 63 characters")
    if not _QUALIFIED_NAME.fullmatch(name):
        errors.append(
            "name part must consist of alphanumeric characters, '-', '_' or '.', "
            "and must start and end with an alphanumeric character"
        )
    return errors


def extended_resource_name_error(name: str) -> str | None:
    """Return why the kubelet's ``IsExtendedResourceName`` is false for ``name``; None when it is true."""
    # IsNativeResource: no "/" at all, or "kubernetes.io/" anywhere in it.
    if "/" not in name:
        return "no '/': an unprefixed name is a native resource"
    if _NATIVE_NAMESPACE in name:
        return f"{_NATIVE_NAMESPACE!r} in it: a native resource"
    if name.startswith(_REQUESTS_PREFIX):
        return f"starts with {_REQUESTS_PREFIX!r}, the quota prefix"
    # The name must stay a qualified name as the quota name "requests.<name>".
    errors = qualified_name_errors(_REQUESTS_PREFIX + name)
    return f"as the quota name {_REQUESTS_PREFIX}<name>: {'; '.join(errors)}" if errors else None


NO_TOPOLOGY = -1  # the checkpoint's NUMA key of a device listed without topology (nodeWithoutTopology)


class KubeletError(Exception):
    """A request the emulated kubelet refuses on its own side, before reaching the plugin."""


class InvariantViolation(AssertionError):
    """A strict emulator saw one device held by two running pods at once."""


@dataclass(frozen=True)
class DoubleHolding:
    """One device held by two running pods at once: the pod that got it last, and who held it already."""

    device: str
    pod: str  # UID of the pod admitted last
    resource: str
    holders: tuple[tuple[str, str], ...]  # (pod UID, resource) of the pods already holding it


@dataclass
class _Pod:
    """The kubelet's record of one admitted pod: per container, per resource, the device IDs it holds."""

    uid: str
    name: str
    namespace: str
    containers: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    responses: dict[tuple[str, str], bytes] = field(default_factory=dict)  # (container, resource) → resp
    active: bool = True  # False once deleted: its devices are freed at the next UpdateAllocatedDevices


@dataclass(frozen=True)
class Update:
    """One ListAndWatch message as the kubelet received it."""

    received: float  # time.monotonic() when the message was decoded
    devices: dict[str, str]  # ID -> health, in message order
    numa: dict[str, tuple[int, ...]]  # ID -> NUMA nodes of its topology
    size: int  # bytes of the serialized message
    # time.monotonic() when the kubelet's per-update work was done (the device set replaced, the
    # checkpoint written and fsynced); ``received`` when the emulator runs without that work.
    applied: float = 0.0

    @property
    def capacity(self) -> int:
        """Every listed device counts towards capacity."""
        return len(self.devices)

    @property
    def allocatable(self) -> int:
        """Only devices reported exactly "Healthy" are allocatable."""
        return sum(1 for health in self.devices.values() if health == HEALTHY)


@dataclass(eq=False)  # identity: replaced endpoints are kept in a set
class _Endpoint:
    """The kubelet's record of one registered resource."""

    resource: str
    socket: Path
    channel: grpc.aio.Channel | None
    stub: Any
    options: api_pb2.DevicePluginOptions
    stream: asyncio.Task[None] | None = None
    updates: list[Update] = field(default_factory=list)
    received: int = 0  # messages received, counting those no longer kept in ``updates``
    devices: dict[str, str] = field(default_factory=dict)
    numa: dict[str, tuple[int, ...]] = field(default_factory=dict)
    registrations: int = 0
    stream_ended: bool = False
    stream_error: str = ""
    removal: asyncio.TimerHandle | None = None  # the endpointStopGracePeriod timer once its stream ended


class KubeletEmulator:
    """Serves ``/v1beta1.Registration/Register`` on ``kubelet.sock`` in ``plugin_dir`` like the kubelet."""

    def __init__(
        self,
        plugin_dir: Path,
        *,
        dial_timeout: float = DIAL_TIMEOUT,
        checkpoint: bool = True,
        pod_resources_socket: Path | None = None,
        strict: bool = False,
        stop_grace: float = ENDPOINT_STOP_GRACE,
        update_work: bool = True,
        keep_updates: int | None = None,
    ) -> None:
        self.plugin_dir = Path(plugin_dir)
        # None keeps every message; a bound keeps the last few (a long benchmark's history of 2,048-device
        # lists is what its garbage collector would walk in the middle of a measurement).
        self.keep_updates = keep_updates
        # The real kubelet's cost of each ListAndWatch message (see _apply); off, the emulator only
        # records the list and writes the checkpoint once per burst, without fsync.
        self.update_work = update_work
        self.stop_grace = stop_grace
        self.socket_path = self.plugin_dir / KUBELET_SOCKET
        self.dial_timeout = dial_timeout
        self.write_checkpoint = checkpoint
        self.pod_resources_socket = pod_resources_socket
        self.strict = strict
        self.refusals: list[tuple[str, str]] = []  # (resource, message) of refused registrations
        self.double_holdings: list[DoubleHolding] = []
        self.list_calls = 0  # PodResources List calls served
        self._endpoints: dict[str, _Endpoint] = {}
        # Replaced endpoints whose stream still runs: the kubelet keeps following them (see _register).
        self._superseded: set[_Endpoint] = set()
        self._background: set[asyncio.Task[None]] = set()
        self._server: grpc.aio.Server | None = None
        self._pr_server: grpc.aio.Server | None = None
        self._changed = asyncio.Event()
        self._pods: dict[str, _Pod] = {}
        # Pods that use DRA claims, by (namespace, name): what PodResources lists as their
        # dynamic_resources (the DRA kubelet emulator prepared the claims: ``DraKubelet.claim_uses``).
        self._dra_pods: dict[tuple[str, str], tuple[ClaimUse, ...]] = {}
        self._allocated: dict[str, set[str]] = {}  # resource → IDs held (the device manager's view)
        self._pod_seq = 0
        self._checkpoint_pending = False
        self._admit_lock: asyncio.Lock | None = None
        # The checkpoint manager's mutex (pkg/kubelet/checkpointmanager): one writer at a time, and a
        # snapshot never replaces a newer one already on disk.
        self._store_lock = threading.Lock()
        self._snapshots = 0
        self._stored = 0
        self._writer: ThreadPoolExecutor | None = None

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        """Delete every socket in the plugin dir (other files stay), then serve Registration."""
        if self._server is not None:
            raise RuntimeError("kubelet emulator already running")
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        self._load_checkpoint()
        self._delete_sockets()
        self._server = await _serve(
            self.socket_path,
            "v1beta1.Registration",
            {
                "Register": grpc.unary_unary_rpc_method_handler(
                    self._register,
                    request_deserializer=api_pb2.RegisterRequest.FromString,
                    response_serializer=api_pb2.Empty.SerializeToString,
                )
            },
        )
        log.info("kubelet emulator: listening on %s", self.socket_path)
        if self.pod_resources_socket is not None:
            await self._serve_pod_resources(self.pod_resources_socket)

    async def stop(self) -> None:
        """Stop serving and drop every plugin connection, as a kubelet that exits does."""
        server, self._server = self._server, None
        if server is None:
            return
        self._write_checkpoint()
        await server.stop(0)
        pr_server, self._pr_server = self._pr_server, None
        if pr_server is not None:
            await pr_server.stop(0)
            if self.pod_resources_socket is not None:
                self.pod_resources_socket.unlink(missing_ok=True)
        # A copy: a Register the stopping server was still answering may add an endpoint meanwhile.
        for endpoint in [*self._superseded, *self._endpoints.values()]:
            await self._disconnect(endpoint)
        for task in list(self._background):
            await task
        for endpoint in self._endpoints.values():
            if endpoint.removal is not None:
                endpoint.removal.cancel()
                endpoint.removal = None
        self.socket_path.unlink(missing_ok=True)
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.shutdown(wait=False)  # a write in flight finishes; it cannot replace a newer one
        self._notify()

    async def restart(self) -> None:
        """Simulate a kubelet restart: stop, delete the plugin sockets, recreate ``kubelet.sock``."""
        await self.stop()
        await self.start()

    # -- Registration ------------------------------------------------------------------------------

    async def _register(self, request: api_pb2.RegisterRequest, context: grpc.aio.ServicerContext) -> Any:
        resource = request.resource_name
        error = self._validate(request)
        if error:
            self.refusals.append((resource, error))
            self._notify()
            log.warning("kubelet emulator: registration refused: %s", error)
            # The kubelet returns a plain Go error, which reaches the plugin as UNKNOWN with the text.
            await context.abort(grpc.StatusCode.UNKNOWN, error)
        socket_path = self.plugin_dir / request.endpoint
        # A subchannel of its own, as the kubelet's grpc-go Dial has: from gRPC's shared pool it could
        # be one an earlier dial left in reconnect backoff, and this dial would wait that out.
        channel = grpc.aio.insecure_channel(
            f"unix:{socket_path}",
            options=(("grpc.max_receive_message_length", MAX_RECEIVE), ("grpc.use_local_subchannel_pool", 1)),
        )
        try:
            # Like the kubelet: dial (blocking, with its timeout) and read the options inside Register.
            await asyncio.wait_for(channel.channel_ready(), self.dial_timeout)
            stub = _DevicePluginStub(channel)
            options = await stub.GetDevicePluginOptions(api_pb2.Empty())
        except (TimeoutError, grpc.aio.AioRpcError) as exc:
            await channel.close(None)
            message = f"failed to dial device plugin {resource} at {socket_path}: {exc!r}"
            self.refusals.append((resource, message))
            await context.abort(grpc.StatusCode.UNKNOWN, message)
        old = self._endpoints.get(resource)
        endpoint = _Endpoint(resource, socket_path, channel, stub, options)
        if old is not None:
            # A new registration replaces the old one; the resource's devices stay until the new list
            # arrives.  As in the v1.32 device manager (plugin/v1beta1/handler.go: connectClient,
            # registerClient), the old client is not disconnected: its ListAndWatch goes on feeding the
            # resource's list, and when it ends, runClient looks the resource up, finds the new client
            # and disconnects that one (_consume) -- the re-registration race of the reference.
            if old.removal is not None:
                old.removal.cancel()
                old.removal = None
            if old.stream is not None and not old.stream.done():
                self._superseded.add(old)
            endpoint.registrations = old.registrations
            endpoint.updates = old.updates
            endpoint.received = old.received
            endpoint.devices = old.devices
            endpoint.numa = old.numa
        endpoint.registrations += 1
        self._endpoints[resource] = endpoint
        endpoint.stream = asyncio.create_task(self._consume(endpoint), name=f"ListAndWatch {resource}")
        self._notify()
        log.info("kubelet emulator: registered %s at %s", resource, socket_path)
        return api_pb2.Empty()

    def _validate(self, request: api_pb2.RegisterRequest) -> str | None:
        if request.version != VERSION:
            return (
                f"unsupported API version {request.version!r} of {request.resource_name!r}: want {VERSION!r}"
            )
        # The kubelet's words (errInvalidResourceName), then which of its rules the name breaks.
        name_error = extended_resource_name_error(request.resource_name)
        if name_error:
            return f"the ResourceName {request.resource_name!r} is invalid: {name_error}"
        # Stricter than the kubelet, which dials filepath.Join(dir, endpoint): a plugin's socket belongs in
        # the plugin dir, whose sockets the kubelet deletes at its start.
        if not request.endpoint or "/" in request.endpoint:
            return f"endpoint {request.endpoint!r} must be a socket file name in {self.plugin_dir}"
        path = self.plugin_dir / request.endpoint
        if len(os.fsencode(path)) > SUN_PATH_MAX:
            return (
                f"failed to dial device plugin {request.resource_name} at {path}: invalid argument "
                f"({len(os.fsencode(path))} bytes, a unix socket path holds at most {SUN_PATH_MAX})"
            )
        return None

    async def _consume(self, endpoint: _Endpoint) -> None:
        """Follow the plugin's ListAndWatch; each message replaces the resource's whole device list."""
        try:
            call = endpoint.stub.ListAndWatch(api_pb2.Empty())
            async for response in call:
                received = time.monotonic()
                # The kubelet puts no rule on device IDs: genericDeviceUpdateCallback keys a map by
                # Device.ID, so a repeated ID is one device, as here.
                devices = {d.ID: d.health for d in response.devices}
                numa = {d.ID: tuple(n.ID for n in d.topology.nodes) for d in response.devices}
                # genericDeviceUpdateCallback is keyed by resource name: a replaced client's messages
                # still set the resource's list.
                target = self._endpoints.get(endpoint.resource, endpoint)
                if self.update_work:
                    await self._apply(target.resource, devices, numa)
                    applied = time.monotonic()
                else:
                    applied = received
                    self._checkpoint_soon()
                # The list, its record and the checkpoint agree whenever a test looks.
                target.devices = devices
                target.numa = numa
                target.updates.append(Update(received, devices, numa, response.ByteSize(), applied))
                target.received += 1
                if self.keep_updates is not None and len(target.updates) > self.keep_updates:
                    del target.updates[: -self.keep_updates]
                self._notify()
            endpoint.stream_error = "stream ended"
        except asyncio.CancelledError:
            endpoint.stream_error = endpoint.stream_error or "disconnected by the kubelet"
            raise
        except grpc.aio.AioRpcError as exc:
            endpoint.stream_error = f"{exc.code().name}: {exc.details()}"
        finally:
            endpoint.stream_ended = True
            self._superseded.discard(endpoint)
            current = self._endpoints.get(endpoint.resource)
            if current is endpoint:
                # The kubelet marks every device unhealthy (capacity kept, allocatable 0), never
                # redials, and removes the resource after endpointStopGracePeriod without a plugin.
                endpoint.devices = dict.fromkeys(endpoint.devices, UNHEALTHY)
                endpoint.removal = asyncio.get_running_loop().call_later(
                    self.stop_grace, self._remove, endpoint
                )
            elif current is not None and current.channel is not None and self._server is not None:
                # v1.32 runClient: the ended client's resource now names the newer client, which is
                # disconnected in its place (the plugin that registered last must register again).
                current.stream_error = "disconnected by the kubelet: a replaced client's stream ended"
                task = asyncio.get_running_loop().create_task(self._disconnect(current))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
            self._notify()
            log.info("kubelet emulator: %s ListAndWatch ended: %s", endpoint.resource, endpoint.stream_error)

    def _remove(self, endpoint: _Endpoint) -> None:
        """endpointStopGracePeriod expired without a new registration: the resource goes away."""
        endpoint.removal = None
        if self._endpoints.get(endpoint.resource) is endpoint and endpoint.stream_ended:
            del self._endpoints[endpoint.resource]
            self._notify()
            self._checkpoint_soon()
            log.info(
                "kubelet emulator: %s removed after %.0f s without a plugin",
                endpoint.resource,
                self.stop_grace,
            )

    async def _disconnect(self, endpoint: _Endpoint) -> None:
        task, endpoint.stream = endpoint.stream, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        channel, endpoint.channel = endpoint.channel, None
        if channel is not None:
            await channel.close(None)

    async def disconnect(self, resource: str) -> None:
        """Drop a resource's stream as the kubelet does when it stops an endpoint; it is not redialled."""
        endpoint = self._endpoints.get(resource)
        if endpoint is not None:
            await self._disconnect(endpoint)

    # -- the kubelet's calls into a plugin -------------------------------------------------------

    def _endpoint(self, resource: str) -> _Endpoint:
        endpoint = self._endpoints.get(resource)
        if endpoint is None or endpoint.channel is None:
            raise KubeletError(f"no device plugin registered for {resource!r}")
        return endpoint

    async def allocate(
        self, resource: str, ids: Sequence[str], *, check: bool = True
    ) -> api_pb2.ContainerAllocateResponse:
        """Allocate ``ids`` for one container; ``check=False`` skips the kubelet's own checks."""
        endpoint = self._endpoint(resource)
        if check:
            unknown = [i for i in ids if i not in endpoint.devices]
            unhealthy = [i for i in ids if i in endpoint.devices and endpoint.devices[i] != HEALTHY]
            if unknown or unhealthy:
                raise KubeletError(f"{resource}: unknown devices {unknown}, unhealthy devices {unhealthy}")
        request = api_pb2.AllocateRequest(
            container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=list(ids))]
        )
        response = await endpoint.stub.Allocate(request)
        if not response.container_responses:
            raise KubeletError(f"{resource}: plugin returned an empty AllocateResponse")
        first = response.container_responses[0]  # the kubelet uses only the first
        self._pod_seq += 1
        pod = _Pod(f"emulated-pod-{self._pod_seq}", f"emulated-pod-{self._pod_seq}", "default")
        self._hold(pod, "main", resource, list(ids), first.SerializeToString())
        return first

    # -- pods ------------------------------------------------------------------------------------

    async def create_pod(
        self,
        name: str,
        requests: dict[str, int | Sequence[str]],
        *,
        namespace: str = "default",
        container: str = "main",
        uid: str | None = None,
    ) -> dict[str, list[str]]:
        """Admit a pod of one container: for each resource pick free devices (or take the given IDs),
        ask the plugin's preference when offered, call Allocate, and hold them; return what it got.

        Free means listed Healthy and not allocated *under that resource name* — the kubelet's own
        accounting, which is blind to the same device listed under another resource.  Admissions run
        one at a time, as the kubelet admits pods one by one.
        """
        if self._admit_lock is None:
            self._admit_lock = asyncio.Lock()
        async with self._admit_lock:
            return await self._admit(name, requests, namespace, container, uid)

    async def _admit(
        self,
        name: str,
        requests: dict[str, int | Sequence[str]],
        namespace: str,
        container: str,
        uid: str | None,
    ) -> dict[str, list[str]]:
        self._update_allocated()
        pod = _Pod(uid or f"uid-{name}", name, namespace)
        if pod.uid in self._pods and self._pods[pod.uid].active:
            raise KubeletError(f"pod {pod.uid} exists")
        got: dict[str, list[str]] = {}
        for resource, want in requests.items():
            if want == 0 or (not isinstance(want, int) and not want):
                continue  # nothing needed: the kubelet calls no plugin
            endpoint = self._endpoint(resource)
            free = [i for i, h in endpoint.devices.items() if h == HEALTHY]
            free = [i for i in free if i not in self._allocated.get(resource, set())]
            if isinstance(want, int):
                if want > len(free):
                    raise KubeletError(f"{resource}: {want} requested, {len(free)} free")
                ids = free[:want]
                if endpoint.options.get_preferred_allocation_available:
                    chosen = await self.preferred(resource, free, [], want)
                    # The kubelet keeps only available IDs of the answer and fills a shortfall itself.
                    picked = [i for i in dict.fromkeys(chosen) if i in set(free)][:want]
                    ids = picked + [i for i in free if i not in set(picked)][: want - len(picked)]
            else:
                ids = list(want)
                taken = [i for i in ids if i not in set(free)]
                if taken:
                    raise KubeletError(f"{resource}: devices not free: {taken}")
            request = api_pb2.AllocateRequest(
                container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=ids)]
            )
            response = await endpoint.stub.Allocate(request)
            if not response.container_responses:
                raise KubeletError(f"{resource}: plugin returned an empty AllocateResponse")
            self._hold(pod, container, resource, ids, response.container_responses[0].SerializeToString())
            got[resource] = ids
        self._write_checkpoint()  # allocateContainerResources ends with a checkpoint, devices or not
        return got

    def delete_pod(self, uid: str) -> None:
        """Terminate a pod; as in the kubelet its devices are freed at the next UpdateAllocatedDevices
        (a PodResources List or the next admission), and the checkpoint is not rewritten for it."""
        pod = self._pods.get(uid)
        if pod is None:
            raise KubeletError(f"no pod {uid}")
        pod.active = False
        self._notify()

    def free(self, resource: str) -> list[str]:
        """Return the resource's devices the kubelet would hand out now: Healthy, not allocated under it."""
        self._update_allocated()
        taken = self._allocated.get(resource, set())
        return [i for i, h in self.devices(resource).items() if h == HEALTHY and i not in taken]

    def pods(self) -> dict[str, dict[str, list[str]]]:
        """Return the running pods: UID → resource → device IDs (all containers)."""
        out: dict[str, dict[str, list[str]]] = {}
        for pod in self._pods.values():
            if pod.active:
                merged: dict[str, list[str]] = {}
                for per_resource in pod.containers.values():
                    for resource, ids in per_resource.items():
                        merged.setdefault(resource, []).extend(ids)
                out[pod.uid] = merged
        return out

    def holders(self) -> dict[str, list[tuple[str, str]]]:
        """Return device ID → (pod UID, resource) of every running pod holding it."""
        out: dict[str, list[tuple[str, str]]] = {}
        for uid, per_resource in self.pods().items():
            for resource, ids in per_resource.items():
                for i in ids:
                    out.setdefault(i, []).append((uid, resource))
        return out

    def _hold(self, pod: _Pod, container: str, resource: str, ids: list[str], response: bytes) -> None:
        before = self.holders()
        clashes = [(i, tuple(before[i])) for i in ids if i in before]
        self._pods[pod.uid] = pod
        pod.containers.setdefault(container, {}).setdefault(resource, []).extend(ids)
        pod.responses[(container, resource)] = response
        self._allocated.setdefault(resource, set()).update(ids)
        for device, holders in clashes:
            self.double_holdings.append(DoubleHolding(device, pod.uid, resource, holders))
        self._write_checkpoint()  # allocateContainerResources checkpoints after every allocation
        self._notify()
        if clashes and self.strict:
            raise InvariantViolation(
                f"device held by two running pods: {clashes[0][0]} given to {pod.uid} under {resource}, "
                f"already held by {list(clashes[0][1])}"
            )

    def _update_allocated(self) -> None:
        """UpdateAllocatedDevices: forget the devices of pods that are no longer active."""
        gone = [uid for uid, pod in self._pods.items() if not pod.active]
        for uid in gone:
            del self._pods[uid]
        if gone:
            allocated: dict[str, set[str]] = {}
            for pod in self._pods.values():
                for per_resource in pod.containers.values():
                    for resource, ids in per_resource.items():
                        allocated.setdefault(resource, set()).update(ids)
            self._allocated = allocated

    # -- PodResources ----------------------------------------------------------------------------

    def run_dra_pod(self, namespace: str, name: str, uses: Sequence[ClaimUse]) -> None:
        """Run a pod whose container uses these DRA claim devices (listed under ``dynamic_resources``)."""
        self._dra_pods[(namespace, name)] = tuple(uses)

    def end_dra_pod(self, namespace: str, name: str) -> None:
        """The pod ended: List no longer shows it (the kubelet then unprepares its claims)."""
        self._dra_pods.pop((namespace, name), None)

    async def _serve_pod_resources(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        pr = podresources_pb2
        self._pr_server = await _serve(
            path,
            "v1.PodResourcesLister",
            {
                "List": grpc.unary_unary_rpc_method_handler(
                    self._pr_list,
                    request_deserializer=pr.ListPodResourcesRequest.FromString,
                    response_serializer=pr.ListPodResourcesResponse.SerializeToString,
                ),
                "GetAllocatableResources": grpc.unary_unary_rpc_method_handler(
                    self._pr_allocatable,
                    request_deserializer=pr.AllocatableResourcesRequest.FromString,
                    response_serializer=pr.AllocatableResourcesResponse.SerializeToString,
                ),
            },
        )

    def _container_devices(self, resource: str, ids: Sequence[str]) -> podresources_pb2.ContainerDevices:
        endpoint = self._endpoints.get(resource)
        nodes = sorted({n for i in ids for n in (endpoint.numa.get(i, ()) if endpoint else ())})
        return podresources_pb2.ContainerDevices(
            resource_name=resource,
            device_ids=list(ids),
            topology=podresources_pb2.TopologyInfo(nodes=[podresources_pb2.NUMANode(ID=n) for n in nodes]),
        )

    async def _pr_list(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """List: free the devices of pods no longer active, then list every running pod's devices."""
        self.list_calls += 1
        self._update_allocated()
        out = podresources_pb2.ListPodResourcesResponse()
        for pod in self._pods.values():
            pr = out.pod_resources.add(name=pod.name, namespace=pod.namespace)
            for cname, per_resource in pod.containers.items():
                c = pr.containers.add(name=cname)
                for resource, ids in per_resource.items():
                    c.devices.append(self._container_devices(resource, ids))
        pr_ = podresources_pb2
        for (namespace, name), uses in self._dra_pods.items():
            c = out.pod_resources.add(name=name, namespace=namespace).containers.add(name="main")
            # One DynamicResource per claim, one ClaimResource per device, as the kubelet's DRA manager
            # fills them (GetContainerClaimInfos: claim name, namespace, and per driver result).
            by_claim: dict[tuple[str, str], list[ClaimUse]] = {}
            for use in uses:
                by_claim.setdefault((use.namespace, use.name), []).append(use)
            for (claim_ns, claim_name), per_claim in by_claim.items():
                c.dynamic_resources.append(
                    pr_.DynamicResource(
                        claim_name=claim_name,
                        claim_namespace=claim_ns,
                        claim_resources=[
                            pr_.ClaimResource(
                                driver_name=u.driver,
                                pool_name=u.pool,
                                device_name=u.device,
                                cdi_devices=[pr_.CDIDevice(name=f"{u.driver}/claim={u.device}")],
                            )
                            for u in per_claim
                        ],
                    )
                )
        return out

    async def _pr_allocatable(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        out = podresources_pb2.AllocatableResourcesResponse()
        for name, endpoint in self._endpoints.items():
            healthy = [i for i, h in endpoint.devices.items() if h == HEALTHY]
            if healthy:
                out.devices.append(self._container_devices(name, healthy))
        return out

    async def preferred(
        self, resource: str, available: Sequence[str], must_include: Sequence[str], size: int
    ) -> list[str]:
        """Ask for a preferred allocation (only when the plugin offers it), as the kubelet does."""
        endpoint = self._endpoint(resource)
        if not endpoint.options.get_preferred_allocation_available:
            raise KubeletError(f"{resource}: plugin does not offer GetPreferredAllocation")
        request = api_pb2.PreferredAllocationRequest(
            container_requests=[
                api_pb2.ContainerPreferredAllocationRequest(
                    available_deviceIDs=list(available),
                    must_include_deviceIDs=list(must_include),
                    allocation_size=size,
                )
            ]
        )
        response = await endpoint.stub.GetPreferredAllocation(request)
        if not response.container_responses:
            return []
        return list(response.container_responses[0].deviceIDs)

    async def prestart(self, resource: str, ids: Sequence[str]) -> None:
        """Call PreStartContainer (only when the plugin requires it), as before every container start."""
        endpoint = self._endpoint(resource)
        if not endpoint.options.pre_start_required:
            raise KubeletError(f"{resource}: plugin does not require PreStartContainer")
        await endpoint.stub.PreStartContainer(
            api_pb2.PreStartContainerRequest(devices_ids=list(ids)), timeout=30.0
        )

    # -- what tests and the demo look at --------------------------------------------------------

    async def wait_for(self, predicate: Callable[[], bool], timeout: float) -> None:
        """Wait until ``predicate()`` holds, re-checking after every change; TimeoutError on expiry."""
        deadline = time.monotonic() + timeout
        while not predicate():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"kubelet emulator: condition not met within {timeout} s")
            changed = self._changed
            # Wake on every change, and at least every 50 ms: predicates may look at state outside us.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), min(remaining, 0.05))

    def resources(self) -> list[str]:
        """Return the names of every resource that registered."""
        return sorted(self._endpoints)

    def devices(self, resource: str) -> dict[str, str]:
        """Return ID -> health of the resource's devices as the kubelet holds them (empty if unknown)."""
        endpoint = self._endpoints.get(resource)
        return dict(endpoint.devices) if endpoint else {}

    def updates(self, resource: str) -> list[Update]:
        """Return the ListAndWatch messages kept for the resource (all, or the last ``keep_updates``)."""
        endpoint = self._endpoints.get(resource)
        return list(endpoint.updates) if endpoint else []

    def received(self, resource: str) -> int:
        """Return how many ListAndWatch messages the resource's plugin sent, across registrations."""
        endpoint = self._endpoints.get(resource)
        return endpoint.received if endpoint else 0

    def capacity(self, resource: str) -> int:
        """Return the number of devices listed for the resource."""
        return len(self.devices(resource))

    def allocatable(self, resource: str) -> int:
        """Return the number of healthy devices of the resource."""
        return sum(1 for health in self.devices(resource).values() if health == HEALTHY)

    def registrations(self, resource: str) -> int:
        """Return how many times the resource registered since the emulator was created."""
        endpoint = self._endpoints.get(resource)
        return endpoint.registrations if endpoint else 0

    def stream_ended(self, resource: str) -> bool:
        """Return whether the resource's current ListAndWatch stream has ended."""
        endpoint = self._endpoints.get(resource)
        return bool(endpoint and endpoint.stream_ended)

    def stream_error(self, resource: str) -> str:
        """Return why the resource's stream ended ("" while it runs)."""
        endpoint = self._endpoints.get(resource)
        return endpoint.stream_error if endpoint else ""

    def options(self, resource: str) -> api_pb2.DevicePluginOptions | None:
        """Return the options the plugin gave at registration."""
        endpoint = self._endpoints.get(resource)
        return endpoint.options if endpoint else None

    # -- internals -------------------------------------------------------------------------------

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def _delete_sockets(self) -> None:
        for entry in os.scandir(self.plugin_dir):
            try:
                if stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode):
                    os.unlink(entry.path)
            except FileNotFoundError:
                pass

    async def _apply(self, resource: str, devices: dict[str, str], numa: dict[str, tuple[int, ...]]) -> None:
        """The rest of the kubelet's work for one ListAndWatch message, done before it reads the next.

        v1.32 genericDeviceUpdateCallback (pkg/kubelet/cm/devicemanager/manager.go) rebuilds the
        resource's healthy and unhealthy sets and its device map from the whole message, then calls
        writeCheckpoint: every resource's healthy IDs and every pod's devices marshalled to JSON and
        written through the checkpoint manager's file store, which writes a temporary file, fsyncs it
        and renames it into place (pkg/kubelet/util/store/filestore.go writeFile).  So each update costs
        in proportion to the pool's size (the message) plus the node's (the checkpoint), with an fsync.
        The stream waits for it, as the kubelet's ListAndWatch loop does; the file work runs on a
        thread of its own so other streams keep being read meanwhile.
        """
        if not self.write_checkpoint or not self.plugin_dir.is_dir():
            return
        data = self._checkpoint_data({resource: (devices, numa)})
        self._snapshots += 1
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="kubelet-checkpoint")
        await asyncio.get_running_loop().run_in_executor(
            self._writer, self._store_checkpoint, data, self._snapshots, True
        )

    def _checkpoint_soon(self) -> None:
        """Write the checkpoint once at the end of this loop iteration (a burst of updates, one write)."""
        if not self._checkpoint_pending and self.write_checkpoint:
            self._checkpoint_pending = True
            asyncio.get_running_loop().call_soon(self._write_checkpoint)

    def _write_checkpoint(self) -> None:
        """Write ``kubelet_internal_checkpoint`` as the kubelet's device manager does.

        Same JSON as the Go structs marshal to (pkg/kubelet/cm/devicemanager/checkpoint): one
        PodDeviceEntries record per pod, container and resource, DeviceIDs keyed by the NUMA node of
        each device (-1 without topology), AllocResp the base64 of the ContainerAllocateResponse, a
        ``null`` list when no pod holds devices, RegisteredDevices the healthy IDs per resource.  The
        file is replaced by a rename, so watchers see IN_MOVED_TO.  The kubelet's Checksum is an FNV-32a
        over Go's spew dump of Data, which this emulator does not reproduce: readers must not rely on it.
        """
        self._checkpoint_pending = False
        if not self.write_checkpoint or not self.plugin_dir.is_dir():
            return
        self._snapshots += 1
        self._store_checkpoint(self._checkpoint_data(), self._snapshots, self.update_work)

    def _checkpoint_data(
        self, pending: dict[str, tuple[dict[str, str], dict[str, tuple[int, ...]]]] | None = None
    ) -> dict[str, Any]:
        """The checkpoint's Data as the kubelet holds it now (taken on the loop, written elsewhere), with
        ``pending``'s resources holding the list being applied (resource → devices, NUMA nodes)."""
        lists = {name: (e.devices, e.numa) for name, e in self._endpoints.items()}
        lists.update((name, new) for name, new in (pending or {}).items() if name in lists)
        entries: list[dict[str, Any]] = []
        for pod in self._pods.values():
            for cname, per_resource in pod.containers.items():
                for resource, ids in per_resource.items():
                    listed = lists.get(resource)
                    per_numa: dict[str, list[str]] = {}
                    for i in ids:
                        nodes = (listed[1].get(i) if listed else None) or (NO_TOPOLOGY,)
                        for n in nodes:
                            per_numa.setdefault(str(n), []).append(i)
                    entries.append(
                        {
                            "PodUID": pod.uid,
                            "ContainerName": cname,
                            "ResourceName": resource,
                            "DeviceIDs": per_numa,
                            "AllocResp": base64.b64encode(pod.responses.get((cname, resource), b"")).decode(),
                        }
                    )
        registered = {
            name: [i for i, h in devices.items() if h == HEALTHY] for name, (devices, _) in lists.items()
        }
        return {"PodDeviceEntries": entries or None, "RegisteredDevices": registered}

    def _store_checkpoint(self, data: dict[str, Any], snapshot: int, sync: bool) -> None:
        """Write one snapshot to the file (fsynced when ``sync``) unless a newer one is there already."""
        body = json.dumps(data, sort_keys=True)
        blob = json.dumps({"Data": data, "Checksum": zlib.crc32(body.encode())}).encode()
        path = self.plugin_dir / CHECKPOINT
        with self._store_lock:
            if snapshot < self._stored:
                return
            tmp = path.with_name(f".{CHECKPOINT}.{os.getpid()}.tmp")
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                try:
                    os.write(fd, blob)
                    if sync:
                        os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(tmp, path)
            except FileNotFoundError:
                return  # the directory went away (a test's teardown): nothing to keep
            self._stored = snapshot

    def _load_checkpoint(self) -> None:
        """Bring back resources listed in the checkpoint with no devices until their plugin registers,
        and, on a fresh emulator, the pods it names (the kubelet restores podDevices from it)."""
        path = self.plugin_dir / CHECKPOINT
        try:
            data = json.loads(path.read_text())["Data"]
            registered = data.get("RegisteredDevices") or {}
            entries = data.get("PodDeviceEntries") or []
        except (FileNotFoundError, ValueError, KeyError, TypeError, AttributeError):
            return
        for name in registered:
            if name not in self._endpoints:
                self._endpoints[name] = _Endpoint(name, Path(), None, None, api_pb2.DevicePluginOptions())
        if self._pods:
            return
        for e in entries:
            try:
                uid, cname, resource = str(e["PodUID"]), str(e["ContainerName"]), str(e["ResourceName"])
                ids = list(dict.fromkeys(i for per in e["DeviceIDs"].values() for i in per))
                response = base64.b64decode(e.get("AllocResp") or "")
            except (KeyError, TypeError, AttributeError, ValueError):
                continue
            pod = self._pods.setdefault(uid, _Pod(uid, uid, "default"))
            pod.containers.setdefault(cname, {}).setdefault(resource, []).extend(ids)
            pod.responses[(cname, resource)] = response
            self._allocated.setdefault(resource, set()).update(ids)


class _DevicePluginStub:
    """Client for ``/v1beta1.DevicePlugin/*`` on an aio channel."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        def unary(method: str, response: Any) -> Any:
            return channel.unary_unary(
                f"/v1beta1.DevicePlugin/{method}",
                request_serializer=_serialize,
                response_deserializer=response.FromString,
            )

        self.GetDevicePluginOptions = unary("GetDevicePluginOptions", api_pb2.DevicePluginOptions)
        self.Allocate = unary("Allocate", api_pb2.AllocateResponse)
        self.GetPreferredAllocation = unary("GetPreferredAllocation", api_pb2.PreferredAllocationResponse)
        self.PreStartContainer = unary("PreStartContainer", api_pb2.PreStartContainerResponse)
        self.ListAndWatch = channel.unary_stream(
            "/v1beta1.DevicePlugin/ListAndWatch",
            request_serializer=_serialize,
            response_deserializer=api_pb2.ListAndWatchResponse.FromString,
        )


def _serialize(message: Any) -> bytes:
    return bytes(message.SerializeToString())


async def _serve(path: Path, service: str, methods: dict[str, grpc.RpcMethodHandler]) -> grpc.aio.Server:
    """Start a gRPC server answering ``service``'s ``methods`` on the unix socket ``path``."""
    server = grpc.aio.server(options=(("grpc.so_reuseport", 0),))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, methods),))
    if server.add_insecure_port(f"unix:{path}") == 0:
        raise OSError(f"kubelet emulator: cannot listen on {path}")
    await server.start()
    return server
