"""A kubelet's DRA side in miniature: plugin watcher, registration, Prepare/Unprepare, health stream.

It behaves as the real kubelet does (see the DRA reference): it watches the registry directory
(inotify, and a poll as the plugin manager's reconciler), registers every socket it finds — ``GetInfo``
within 1 s, type compared exactly, the driver name checked as a DNS subdomain, a version picked by
the rule of the emulated release — and tells the plugin with ``NotifyRegistrationStatus``.  It calls
``NodePrepareResources`` / ``NodeUnprepareResources`` on the long method paths with the kubelet's 45 s
deadline and checks the answers as the kubelet's DRA manager does; it keeps one health stream per
plugin (1.34+), re-opened 5 s after it ends, forgetting every device's health when it does.  A
"restart" drops every connection and walks the registry directory again, as a starting kubelet does,
after calling ``on_start`` (where a test deletes the node's ResourceSlices, as the kubelet does).

The name and CDI rules here are written from the Kubernetes and CDI documentation, independently of
the daemon's own, so that the two check each other.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import stat
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from .._proto import dra_health_v1alpha1_pb2, dra_v1_pb2, dra_v1beta1_pb2, pluginregistration_pb2
from ..node.holdings import ClaimUse
from ..node.watch import DirectoryWatch

log = logging.getLogger(__name__)

CALL_TIMEOUT = 45.0  # defaultClientCallTimeout
INFO_TIMEOUT = 1.0  # GetInfo deadline of the plugin watcher
NOTIFY_TIMEOUT = 5.0
HEALTH_RETRY = 5.0  # the kubelet re-opens a health stream 5 s after it ended
_HEALTH_NAMES = {v.number: v.name for v in dra_health_v1alpha1_pb2.HealthStatus.DESCRIPTOR.values}
HEALTH_HISTORY = 8  # health messages a record keeps (tests read the last few)

# RFC 1123 DNS subdomain: lowercase alphanumerics, '-' and '.', ≤253, alphanumeric at both ends of labels.
_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_SUBDOMAIN = re.compile(rf"{_DNS_LABEL}(\.{_DNS_LABEL})*")
# CDI: vendor (DNS-like) "/" class "=" device name (container-device-interface SPEC.md).
_CDI_ID = re.compile(
    r"[a-z0-9]([a-z0-9.-]*[a-z0-9])?/[a-zA-Z0-9]([a-zA-Z0-9_.-]*[a-zA-Z0-9])?=[a-zA-Z0-9]([a-zA-Z0-9_.:-]*[a-zA-Z0-9])?"
)

# What each emulated release accepts in supported_versions, and the gRPC service behind each string.
SERVICES = {
    "v1.DRAPlugin": "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin",
    "v1beta1.DRAPlugin": "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin",
    "v1alpha3.NodeService": "v1alpha3.Node",  # the v1alpha4 oddity: advertised name ≠ service name
}
_PB = {
    "v1.DRAPlugin": dra_v1_pb2,
    "v1beta1.DRAPlugin": dra_v1beta1_pb2,
    "v1alpha3.NodeService": dra_v1beta1_pb2,
}
HEALTH_PATH = "/v1alpha1.DRAResourceHealth/NodeWatchResources"
# Every dial gets its own connection, as each grpc.ClientConn of the kubelet does: gRPC's process-wide
# subchannel pool would hand a new channel to a re-created socket the old one's failed connection and
# its reconnect backoff (calls then fail with "connection refused" after the plugin is back).
CHANNEL_OPTIONS = (("grpc.use_local_subchannel_pool", 1),)


class RegistrationRefused(Exception):
    """The emulated kubelet refuses a plugin's registration (the text goes to NotifyRegistrationStatus)."""


def pick_version(release: str, offered: Sequence[str]) -> str:
    """Return the DRA service string a kubelet of ``release`` uses for these supported_versions."""
    if not offered:
        raise RegistrationRefused("empty list of supported versions")
    if release in ("1.32", "1.33"):
        # validateSupportedServices: v1beta1 preferred; otherwise the old v1alpha3 Node service, even
        # when the plugin did not offer it (observed: a silent fallback, then Unimplemented calls).
        return "v1beta1.DRAPlugin" if "v1beta1.DRAPlugin" in offered else "v1alpha3.NodeService"
    known = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
    for version in offered:
        if version in known:
            return version
    raise RegistrationRefused(
        f"none of services supported by the plugin {list(offered)} "
        f"are supported by this kubelet {list(known)}"
    )


@dataclass
class DraPluginRecord:
    """The kubelet's record of one registered DRA plugin."""

    name: str
    socket: Path  # the registration socket
    endpoint: str
    version: str  # the chosen supported_versions string
    versions: tuple[str, ...]
    channel: grpc.aio.Channel
    health_task: asyncio.Task[None] | None = None
    # The last few messages (time received, the message), and how many came in all: a whole history
    # at 65,536 devices is every device per message, hundreds of MiB over a benchmark.
    health_messages: deque[tuple[float, bytes]] = field(default_factory=lambda: deque(maxlen=HEALTH_HISTORY))
    health_received: int = 0
    # The message the health is read from now (None: no stream, or it ended), and that read, kept.
    health_message: bytes | None = None
    _read: tuple[Any, dict[tuple[str, str], str]] | None = None
    health_streams: int = 0  # streams opened
    health_error: str = ""

    @property
    def health(self) -> dict[tuple[str, str], str]:
        """The health the kubelet holds now: (pool, device) -> HEALTHY/UNHEALTHY/UNKNOWN."""
        message = self.health_message
        if message is None:
            return {}
        if self._read is None or self._read[0] is not message:
            # Read when asked, not as each message arrives: in a benchmark the emulator shares the
            # daemon's event loop, and reading 65,536 devices per message cost it 80 ms a change.
            self._read = (message, health_of(message))
        return self._read[1]


def health_of(message: Any) -> dict[tuple[str, str], str]:
    """Return what one NodeWatchResourcesResponse (or its bytes) says: (pool, device) -> status name."""
    # Each message is the complete list: the kubelet replaces what it held, never merges.
    if isinstance(message, bytes):
        message = dra_health_v1alpha1_pb2.NodeWatchResourcesResponse.FromString(message)
    name = _HEALTH_NAMES
    return {(d.device.pool_name, d.device.device_name): name[d.health] for d in message.devices}


@dataclass(frozen=True)
class PreparedAnswer:
    """One claim's answer to NodePrepareResources as the kubelet stores it."""

    devices: tuple[dict[str, Any], ...]
    error: str


class DraKubelet:
    """Registers DRA plugins found in ``registry_dir`` and calls them as a kubelet of ``release`` does."""

    def __init__(
        self,
        registry_dir: Path,
        *,
        release: str = "1.34",
        health: bool = True,
        poll: float = 0.05,
        health_retry: float = HEALTH_RETRY,
        on_start: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        if release not in ("1.32", "1.33", "1.34", "1.35", "1.36"):
            raise ValueError(f"release {release!r}: emulated are 1.32 to 1.36")
        self.registry_dir = Path(registry_dir)
        self.release = release
        # 1.34 to 1.36 with ResourceHealthStatus on open the stream whether or not it is advertised.
        self.health_enabled = health and release not in ("1.32", "1.33")
        self.poll = poll
        self.health_retry = health_retry
        self.on_start = on_start
        self.plugins: dict[str, DraPluginRecord] = {}
        self.errors: list[str] = []  # registration failures, in order
        self.starts = 0
        # Claims prepared (and not unprepared since) by UID: driver, namespace, name, devices answered.
        self.prepared: dict[str, tuple[str, str, str, tuple[dict[str, Any], ...]]] = {}
        self._seen: dict[Path, tuple[int, int, int]] = {}  # socket path -> identity registered (or tried)
        self._retry_at: dict[Path, float] = {}
        self._backoff: dict[Path, float] = {}
        self._watch: DirectoryWatch | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # -- lifecycle ----------------------------------------------------------------------------------

    async def start(self) -> None:
        """Create the registry dir (0755) if missing, then walk it and keep watching it."""
        os.makedirs(self.registry_dir, mode=0o755, exist_ok=True)
        self.starts += 1
        if self.on_start is not None:
            await self.on_start()
        self._watch = DirectoryWatch(self.registry_dir)
        self._watch.start()
        self._watch.subscribe(self._wake.set)
        await self.scan()
        self._task = asyncio.create_task(self._loop(), name="dra kubelet watcher")

    async def stop(self) -> None:
        """Stop watching and drop every plugin connection."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        for name in list(self.plugins):
            await self._drop(name)
        self._seen.clear()

    async def restart(self) -> None:
        """Act as a restarted kubelet: forget every plugin, then register what the registry dir holds."""
        await self.stop()
        self.errors.clear()
        await self.start()

    async def _loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.poll)
            self._wake.clear()
            try:
                await self.scan()
            except Exception:
                log.exception("dra kubelet: scanning %s failed", self.registry_dir)

    async def scan(self) -> None:
        """Register new or re-created sockets and deregister removed ones (the watcher + reconciler)."""
        found: dict[Path, tuple[int, int, int]] = {}
        for root, dirs, names in os.walk(self.registry_dir):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            for n in names:
                if n.startswith("."):
                    continue
                path = Path(root) / n
                with contextlib.suppress(OSError):
                    st = os.lstat(path)
                    if stat.S_ISSOCK(st.st_mode):
                        found[path] = (st.st_dev, st.st_ino, st.st_ctime_ns)
        for path in [p for p in self._seen if p not in found]:
            del self._seen[path]
            self._backoff.pop(path, None)
            self._retry_at.pop(path, None)
            for name, record in list(self.plugins.items()):
                if record.socket == path:
                    await self._drop(name)
        now = time.monotonic()
        for path, identity in found.items():
            previous = self._seen.get(path)
            if previous == identity:
                retry = self._retry_at.get(path)
                if retry is None or now < retry:
                    continue  # registered, or waiting out its backoff
            elif previous is not None:
                # Re-created at the same path: unregister the old instance, register the new one.
                self._backoff.pop(path, None)
                self._retry_at.pop(path, None)
                for name, record in list(self.plugins.items()):
                    if record.socket == path:
                        await self._drop(name)
            self._seen[path] = identity
            await self._register(path)

    # -- registration -------------------------------------------------------------------------------

    async def _register(self, path: Path) -> None:
        channel = grpc.aio.insecure_channel(f"unix:{path}", options=CHANNEL_OPTIONS)
        try:
            get_info = channel.unary_unary(
                "/pluginregistration.Registration/GetInfo",
                request_serializer=pluginregistration_pb2.InfoRequest.SerializeToString,
                response_deserializer=pluginregistration_pb2.PluginInfo.FromString,
            )
            notify = channel.unary_unary(
                "/pluginregistration.Registration/NotifyRegistrationStatus",
                request_serializer=pluginregistration_pb2.RegistrationStatus.SerializeToString,
                response_deserializer=pluginregistration_pb2.RegistrationStatusResponse.FromString,
            )
            try:
                info = await get_info(pluginregistration_pb2.InfoRequest(), timeout=INFO_TIMEOUT)
            except grpc.aio.AioRpcError as e:
                self._failed(path, f"{path}: GetInfo failed: {e.code().name}: {e.details()}")
                return
            try:
                record = self._validate(path, info)
            except RegistrationRefused as e:
                self._failed(path, f"{path}: {e}")
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await notify(
                        pluginregistration_pb2.RegistrationStatus(plugin_registered=False, error=str(e)),
                        timeout=NOTIFY_TIMEOUT,
                    )
                return
            old = self.plugins.get(record.name)
            if old is not None:
                await self._drop(record.name)  # a new registration under the same name replaces it
            self.plugins[record.name] = record
            self._retry_at.pop(path, None)
            self._backoff.pop(path, None)
            try:
                await notify(
                    pluginregistration_pb2.RegistrationStatus(plugin_registered=True), timeout=NOTIFY_TIMEOUT
                )
            except grpc.aio.AioRpcError as e:
                log.warning("dra kubelet: NotifyRegistrationStatus to %s failed: %s", path, e.code().name)
            if self.health_enabled:
                record.health_task = asyncio.create_task(self._health(record), name=f"health {record.name}")
        finally:
            await channel.close(None)

    def _failed(self, path: Path, error: str) -> None:
        self.errors.append(error)
        delay = self._backoff.get(path, 0.25) * 2  # 500 ms doubling (exponentialbackoff), capped below
        self._backoff[path] = min(delay, 122.0)
        self._retry_at[path] = time.monotonic() + self._backoff[path]
        log.info("dra kubelet: %s", error)

    def _validate(self, path: Path, info: Any) -> DraPluginRecord:
        if info.type != "DRAPlugin":
            raise RegistrationRefused(f"no handler registered for plugin type: {info.type}")
        if len(info.name) > 253 or not _DNS_SUBDOMAIN.fullmatch(info.name):
            raise RegistrationRefused(f"driver name {info.name!r} is not a DNS subdomain")
        version = pick_version(self.release, list(info.supported_versions))
        endpoint = info.endpoint or str(path)  # empty: the registration socket serves it all
        if not os.path.isabs(endpoint):
            raise RegistrationRefused(f"endpoint {endpoint!r} is not an absolute path")
        channel = grpc.aio.insecure_channel(f"unix:{endpoint}", options=CHANNEL_OPTIONS)
        return DraPluginRecord(info.name, path, endpoint, version, tuple(info.supported_versions), channel)

    async def _drop(self, name: str) -> None:
        record = self.plugins.pop(name, None)
        if record is None:
            return
        if record.health_task is not None:
            record.health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await record.health_task
        await record.channel.close(None)

    # -- health -------------------------------------------------------------------------------------

    async def _health(self, record: DraPluginRecord) -> None:
        call = record.channel.unary_stream(
            HEALTH_PATH,
            request_serializer=dra_health_v1alpha1_pb2.NodeWatchResourcesRequest.SerializeToString,
            # Kept as it arrived and decoded when read (health_of): at 65,536 devices decoding each
            # message took 5.7 ms of the loop this emulator shares with the daemon in a benchmark, and
            # its arrival time would have included it.
            response_deserializer=bytes,
        )
        while True:
            record.health_streams += 1
            try:
                async for message in call(dra_health_v1alpha1_pb2.NodeWatchResourcesRequest()):
                    record.health_message = message
                    record.health_messages.append((time.monotonic(), message))
                    record.health_received += 1
                record.health_error = "stream ended"
            except grpc.aio.AioRpcError as e:
                record.health_error = f"{e.code().name}: {e.details()}"
            # The kubelet marks every device of the driver Unknown when the stream ends.
            record.health_message = None
            await asyncio.sleep(self.health_retry)

    def health(self, driver: str) -> dict[tuple[str, str], str]:
        """Return the health the kubelet holds for a driver's devices: (pool, device) -> status name."""
        record = self.plugins.get(driver)
        return dict(record.health) if record is not None else {}

    # -- calls --------------------------------------------------------------------------------------

    def _plugin(self, driver: str) -> DraPluginRecord:
        record = self.plugins.get(driver)
        if record is None:
            raise KeyError(f"DRA driver {driver} is not registered")
        return record

    async def _call_claims(
        self, driver: str, method: str, claims: Sequence[tuple[str, str, str]], timeout: float
    ) -> Any:
        """Call ``method`` (NodePrepareResources or NodeUnprepareResources) for (namespace, name, uid)."""
        record = self._plugin(driver)
        pb = _PB[record.version]
        request_type, response_type = getattr(pb, f"{method}Request"), getattr(pb, f"{method}Response")
        call = record.channel.unary_unary(
            f"/{SERVICES[record.version]}/{method}",
            request_serializer=request_type.SerializeToString,
            response_deserializer=response_type.FromString,
        )
        request = request_type(
            claims=[pb.Claim(namespace=ns, name=name, uid=uid) for ns, name, uid in claims]
        )
        return await call(request, timeout=timeout)

    async def prepare(
        self, driver: str, claims: Sequence[tuple[str, str, str]], timeout: float = CALL_TIMEOUT
    ) -> dict[str, PreparedAnswer]:
        """Call NodePrepareResources for (namespace, name, uid) claims; return the answer per UID.

        Raises AssertionError for an answer the kubelet would reject as a whole (a UID it did not ask
        about, claims left out, a malformed CDI ID), and grpc.aio.AioRpcError for a failed call.
        """
        response = await self._call_claims(driver, "NodePrepareResources", claims, timeout)
        asked = {uid for _ns, _name, uid in claims}
        extra = set(response.claims) - asked
        assert not extra, f"NodePrepareResources answered claims it was not asked about: {sorted(extra)}"
        missing = asked - set(response.claims)
        assert not missing, f"NodePrepareResources left out {len(missing)} claims"
        out: dict[str, PreparedAnswer] = {}
        for uid, answer in response.claims.items():
            devices = tuple(
                {
                    "requests": list(d.request_names),
                    "pool": d.pool_name,
                    "device": d.device_name,
                    "cdi": list(d.cdi_device_ids),
                }
                for d in answer.devices
            )
            if not answer.error:
                for d in devices:
                    for cdi_id in d["cdi"]:
                        assert _CDI_ID.fullmatch(cdi_id), f"malformed CDI device ID {cdi_id!r}"
            out[uid] = PreparedAnswer(devices if not answer.error else (), answer.error)
        for ns, name, uid in claims:
            if not out[uid].error:
                self.prepared[uid] = (driver, ns, name, out[uid].devices)
        return out

    def claim_uses(self, uid: str) -> list[ClaimUse]:
        """Return what PodResources lists for a pod using this prepared claim (``run_dra_pod``)."""
        driver, ns, name, devices = self.prepared[uid]
        return [ClaimUse(driver, ns, name, d["pool"], d["device"]) for d in devices]

    async def unprepare(
        self, driver: str, claims: Sequence[tuple[str, str, str]], timeout: float = CALL_TIMEOUT
    ) -> dict[str, str]:
        """Call NodeUnprepareResources; return the error ("" for success) per claim UID."""
        response = await self._call_claims(driver, "NodeUnprepareResources", claims, timeout)
        asked = {uid for _ns, _name, uid in claims}
        assert set(response.claims) == asked, "NodeUnprepareResources must answer every claim, and only those"
        for uid, answer in response.claims.items():
            if not answer.error:
                self.prepared.pop(uid, None)
        return {uid: answer.error for uid, answer in response.claims.items()}

    async def wait_for(self, predicate: Callable[[], bool], timeout: float) -> None:
        """Wait until ``predicate()`` holds; TimeoutError after ``timeout`` seconds (a hang guard)."""
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError("condition not reached")
            await asyncio.sleep(0.01)


class ClaimStore:
    """ResourceClaims in memory, read through the ``ClaimReader`` protocol (tests, demo, benchmarks)."""

    def __init__(self) -> None:
        self.claims: dict[tuple[str, str], dict[str, Any]] = {}
        self.reads = 0

    def put(self, claim: Mapping[str, Any]) -> None:
        """Store (or replace) a claim object by its namespace and name."""
        meta = claim["metadata"]
        self.claims[(meta["namespace"], meta["name"])] = dict(claim)

    def delete(self, namespace: str, name: str) -> None:
        """Remove a claim (the API object is gone; Unprepare must still work)."""
        self.claims.pop((namespace, name), None)

    async def get(self, namespace: str, name: str) -> Mapping[str, Any]:
        """Return the claim, or raise LookupError as a 404 would."""
        self.reads += 1
        try:
            return self.claims[(namespace, name)]
        except KeyError:
            raise LookupError(f'resourceclaims.resource.k8s.io "{name}" not found') from None


def allocated_claim(
    namespace: str,
    name: str,
    uid: str,
    results: Sequence[Mapping[str, Any]],
    config: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """Return a resource.k8s.io/v1 ResourceClaim allocated with ``results`` (driver/pool/device/request).

    ``config`` is the allocation's ``devices.config`` (what the scheduler copies from class and claim).
    """
    requests = sorted({str(r["request"]).split("/", 1)[0] for r in results})
    devices: dict[str, Any] = {"results": [dict(r) for r in results]}
    if config:
        devices["config"] = [dict(c) for c in config]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"namespace": namespace, "name": name, "uid": uid},
        "spec": {
            "devices": {"requests": [{"name": r, "exactly": {"deviceClassName": "vf"}} for r in requests]}
        },
        "status": {"allocation": {"devices": devices}},
    }
