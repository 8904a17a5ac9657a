"""An API-server stand-in for DRA tests: the resource.k8s.io endpoints the driver uses, over real HTTP.

No kube-apiserver runs on these machines, so this serves what ``dra/apiclient.py`` calls, the way the
real server answers it (aiohttp on the test's event loop, on 127.0.0.1):

* ``GET /apis/resource.k8s.io``: API group discovery, listing the versions this stand-in serves (v1 and
  v1beta1 by default; ``versions=("v1beta1",)`` plays a 1.32-1.33 cluster);
* ResourceSlices: list (``fieldSelector`` on ``spec.nodeName`` / ``spec.driver``), watch (newline-
  delimited events after a resourceVersion, ``410 Expired`` when it is too old), create, get, replace
  (``409 Conflict`` on a stale resourceVersion), delete (with UID / resourceVersion preconditions) and
  deletecollection (the kubelet's wipe of its node's slices at start);
* ResourceClaim get and its ``status`` subresource (PUT; the section at the end of the class), Node
  get; an optional bearer token (401 without it).

Every object written is checked as the real server would: against the official OpenAPI schema with
``kubernetes-validate`` (strict: unknown fields refused), plus the ResourceSlice limits the schema only
states in prose (128 devices, DNS-label device names, qualified attribute names, 32 attributes, one value
type each, 64-character strings, slice count above zero, immutable driver/pool/node).  Invalid writes
get ``422 Invalid`` with a Status body.  Counters record every write per slice for tests and benchmarks.

One stand-in serves a fleet (``FleetControls``, issue 26): every request is counted by node (from the
User-Agent's ``node/<name>``, else the object or field selector), verb and resource, with bytes in and
out and the stand-in's own CPU, and ``/_standin/`` endpoints (or ``srv.fleet``) make it restart (close
every watch, refuse for a while, come back with a newer resourceVersion), answer 429 with Retry-After,
or slow down.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import re
import uuid
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from ..printable import clip

GROUP = "resource.k8s.io"
MAX_EVENTS = 20000  # watch history kept; older resourceVersions get 410 Expired, as etcd compaction gives
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_C_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ATTR_TYPES = ("int", "bool", "string", "version")
_SHORT_TYPES = frozenset(("int", "bool"))
# Attribute names already found valid: a slice repeats the same dozen names on every device, and
# checking each again was the stand-in's biggest cost of a 128-device write (it is a measuring tool:
# its CPU per request is what a benchmark scales).
_GOOD_KEYS: set[str] = set()
# kubernetes-validate's schema for the Kubernetes minor each version is checked against: v1 exists from
# 1.34 (the first strict schema with resource.k8s.io/v1); v1beta1 is checked as 1.32 served it.
SCHEMA_VERSION = {"v1": "1.34", "v1beta1": "1.32"}


class _Invalid(Exception):
    """A write the real API server would refuse with 422 Invalid."""


def _json(obj: Any, status: int = 200) -> web.Response:
    """Answer one object as JSON (orjson: a 65,536-device start sends this stand-in 40 MB of slices,
    and json's encoder, not the driver, was then what a benchmark of the driver measured)."""
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


def _status(code: int, reason: str, message: str) -> web.Response:
    body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason, "message": message}
    return web.json_response({**body, "code": code}, status=code)


def _not_found(resource: str, name: str) -> web.Response:
    """Return the API server's 404 for a missing object: ``resourceslices.resource.k8s.io "x" not found``."""
    return _status(404, "NotFound", f'{resource} "{name}" not found')


class SchemaChecker:
    """Validates objects against kubernetes-validate's OpenAPI schemas, one compiled validator per kind."""

    def __init__(self) -> None:
        self._validators: dict[tuple[str, str, str], Any] = {}

    def _validator(self, kind: str, api_version: str, k8s: str) -> Any:
        key = (kind, api_version, k8s)
        v = self._validators.get(key)
        if v is None:
            import jsonschema
            from kubernetes_validate.utils import schema_contents
            from referencing import Registry, Resource

            group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
            base = f"kubernetes-json-schema/v{k8s}.0-local-strict"
            schema = schema_contents(f"{base}/{kind.lower()}-{group_version}.json", k8s)
            defs = schema_contents(f"{base}/_definitions.json", k8s)
            registry = Resource.from_contents(defs) @ (Resource.from_contents(schema) @ Registry())
            v = jsonschema.validators.Draft202012Validator(schema, registry=registry)
            self._validators[key] = v
        return v

    def check(self, obj: dict[str, Any], k8s: str) -> None:
        """Raise _Invalid naming the first schema violation of ``obj``."""
        import jsonschema

        try:
            self._validator(str(obj.get("kind")), str(obj.get("apiVersion")), k8s).validate(obj)
        except jsonschema.ValidationError as exc:
            where = ".".join(str(p) for p in exc.absolute_path) or "<root>"
            raise _Invalid(f"{where}: {exc.message[:300]}") from None


def _slice_rules(obj: dict[str, Any], version: str) -> None:
    """The ResourceSlice rules the API enforces in code (api resource/v1 types.go), not in the schema."""
    spec = obj.get("spec") or {}
    name = obj.get("metadata", {}).get("name", "")
    if not name or len(name) > 253 or not _DNS_SUBDOMAIN.fullmatch(name):
        raise _Invalid(f"metadata.name: {name!r} is not a DNS subdomain")
    driver = spec.get("driver", "")
    if len(driver) > 63 or not _DNS_SUBDOMAIN.fullmatch(driver):
        raise _Invalid(f"spec.driver: {driver!r} is not a DNS subdomain of at most 63 characters")
    pool = spec.get("pool") or {}
    if not pool.get("name") or len(pool["name"]) > 253:
        raise _Invalid("spec.pool.name: required, at most 253 characters")
    if int(pool.get("resourceSliceCount", 0)) <= 0:
        raise _Invalid("spec.pool.resourceSliceCount: must be greater than zero")
    if int(pool.get("generation", -1)) < 0:
        raise _Invalid("spec.pool.generation: must be non-negative")
    modes = [k for k in ("nodeName", "nodeSelector", "allNodes", "perDeviceNodeSelection") if spec.get(k)]
    if len(modes) != 1:
        raise _Invalid(
            f"spec: exactly one of nodeName, nodeSelector, allNodes, perDeviceNodeSelection, got {modes}"
        )
    devices = spec.get("devices") or []
    tainted = any(
        (d.get("taints") if version == "v1" else (d.get("basic") or {}).get("taints")) for d in devices
    )
    # 1.35+: at most 64 devices in a slice where any device has taints.
    limit = 64 if tainted else 128
    if len(devices) > limit:
        raise _Invalid(f"spec.devices: must have at most {limit} items, got {len(devices)}")
    seen: set[str] = set()
    for i, d in enumerate(devices):
        dname = d.get("name", "")
        if len(dname) > 63 or not _DNS_LABEL.fullmatch(dname):
            raise _Invalid(f"spec.devices[{i}].name: {dname!r} is not a DNS label")
        if dname in seen:
            raise _Invalid(f"spec.devices[{i}].name: duplicate {dname!r}")
        seen.add(dname)
        body = d if version == "v1" else (d.get("basic") or {})
        attrs = body.get("attributes") or {}
        if len(attrs) + len(body.get("capacity") or {}) > 32:
            raise _Invalid(f"spec.devices[{i}]: more than 32 attributes and capacities")
        for key, value in attrs.items():
            if key not in _GOOD_KEYS:
                prefix, _, ident = key.rpartition("/")
                if not _C_IDENT.fullmatch(ident) or len(ident) > 32:
                    raise _Invalid(
                        f"spec.devices[{i}].attributes[{key}]: not a C identifier of at most 32 characters"
                    )
                if prefix and (len(prefix) > 63 or not _DNS_SUBDOMAIN.fullmatch(prefix)):
                    raise _Invalid(f"spec.devices[{i}].attributes[{key}]: prefix is not a DNS subdomain")
                if len(_GOOD_KEYS) < 4096:
                    _GOOD_KEYS.add(key)
            if len(value) == 1:  # the usual: one type, a value of it (checked below when not)
                ((kind, v),) = value.items()
                if kind in _ATTR_TYPES and v is not None and (kind in _SHORT_TYPES or len(v) <= 64):
                    continue
            set_types = [t for t in _ATTR_TYPES if value.get(t) is not None]
            if len(set_types) != 1:
                raise _Invalid(
                    f"spec.devices[{i}].attributes[{key}]: exactly one value type, got {set_types}"
                )
            if set_types[0] in ("string", "version") and len(value[set_types[0]]) > 64:
                raise _Invalid(f"spec.devices[{i}].attributes[{key}]: longer than 64 characters")
        taints = body.get("taints") or []
        if len(taints) > 16:
            raise _Invalid(f"spec.devices[{i}].taints: at most 16")
        for t in taints:
            if t.get("effect") not in ("NoSchedule", "NoExecute", "None"):
                raise _Invalid(f"spec.devices[{i}].taints: effect {t.get('effect')!r}")


def _selector(text: str) -> list[tuple[str, str]]:
    """Parse ``a=b,c==d`` field selectors; raise ValueError on a field ResourceSlices do not index."""
    out: list[tuple[str, str]] = []
    for term in filter(None, text.split(",")):
        key, sep, value = term.partition("==") if "==" in term else term.partition("=")
        if not sep or key not in ("spec.nodeName", "spec.driver", "metadata.name"):
            raise ValueError(f'field label not supported: "{key}"')
        out.append((key, value))
    return out


def _field(obj: dict[str, Any], key: str) -> str:
    if key == "metadata.name":
        return str(obj["metadata"]["name"])
    return str((obj.get("spec") or {}).get(key.split(".", 1)[1]) or "")


@dataclass
class _Watcher:
    selector: list[tuple[str, str]]
    queue: asyncio.Queue[dict[str, Any] | None] = field(default_factory=asyncio.Queue)


class ApiServerStandIn:
    """Serves the DRA endpoints on 127.0.0.1; ``url`` once started. Objects are kept in memory."""

    def __init__(
        self,
        versions: Iterable[str] = ("v1", "v1beta1"),
        *,
        validate: bool = True,
        token: str | None = None,
        drop_taints: bool = False,
    ) -> None:
        if validate:
            # Fail here, not at the first write (as a 500): validation needs the test extra.
            import kubernetes_validate  # noqa: F401

        self.versions = tuple(versions)
        # Plays a server with the DRADeviceTaints gate off: device taints are dropped silently on write.
        self.drop_taints = drop_taints
        self.validate = validate
        self.token = token
        self.slices: dict[str, dict[str, Any]] = {}
        # Devices held per node, kept as slices are stored and removed: the fleet's log of what each
        # write left published read every slice of the node per write (a sixth of the stand-in's CPU
        # at 512 slices a node).
        self._devices_by_node: Counter[str] = Counter()
        self.claims: dict[tuple[str, str], dict[str, Any]] = {}
        self.nodes: dict[str, dict[str, Any]] = {}
        self.writes: Counter[str] = Counter()  # per slice name: creates + updates + deletes
        self.requests: Counter[str] = Counter()  # per "METHOD kind" ("PUT resourceslices", "GET node" ...)
        self.rejected: list[str] = []  # every 422 message, for tests to show
        self.tries: Counter[str] = Counter()  # per slice name: every write request, whatever its answer
        # Faults: the next ``fail_writes`` writes get 500; ``on_write(method, name)`` runs as a write
        # arrives, before it is checked (another writer slipping in: a real 409 follows).
        self.fail_writes = 0
        # Writes to these slice names are read and then never answered (a server, proxy or etcd that
        # accepted the request and went silent): held until ``release_hung`` or ``stop``, then answered
        # 504 without being applied; ``hung`` counts the requests held so far, per name, ``holding`` the
        # ones held now.
        self.hang_writes: set[str] = set()
        # Seconds a stored create waits before its answer goes out, its watch event already sent (the
        # watch cache is quick, the response path slow): the order a busy server often shows.
        self.answer_late_s = 0.0
        self.hung: Counter[str] = Counter()
        self.holding = 0
        self._release = asyncio.Event()
        # Every write to these slice names gets 409 Conflict (another writer that always wins).
        self.conflict_writes: set[str] = set()
        self.fail_discovery = 0  # the next N API discoveries get 503 (a server still starting)
        # While set, every watch is refused with this status (403: RBAC grants list but not watch; 405:
        # a proxy or aggregated server that does not serve watches).
        self.refuse_watch = 0
        # The next N watches end at once with a 410 Expired ERROR event, as the real server sends when
        # the watch's resourceVersion has been compacted out of etcd's history.
        self.expire_watches = 0
        self.on_write: Any = None
        self._rv = 0
        self._events: list[tuple[int, str, dict[str, Any]]] = []
        self._watchers: list[_Watcher] = []
        self._checker = SchemaChecker()
        self._runner: web.AppRunner | None = None
        self.url = ""
        self._init_claim_status()  # the resourceclaims/status section below
        self.fleet = FleetControls(self)  # per-node counters and the /_standin/ fault controls

    # -------------------------------------------------------------------------------------- lifecycle
    async def start(self) -> str:
        """Listen on an ephemeral port of 127.0.0.1; return the base URL."""
        app = web.Application(middlewares=[self.fleet.middleware, self._auth])
        r = app.router
        self.fleet.install(r)
        r.add_get(f"/apis/{GROUP}", self._group)
        r.add_get(f"/apis/{GROUP}/{{v}}/resourceslices", self._list)
        r.add_post(f"/apis/{GROUP}/{{v}}/resourceslices", self._create)
        r.add_delete(f"/apis/{GROUP}/{{v}}/resourceslices", self._delete_collection)
        r.add_get(f"/apis/{GROUP}/{{v}}/resourceslices/{{name}}", self._get)
        r.add_put(f"/apis/{GROUP}/{{v}}/resourceslices/{{name}}", self._replace)
        r.add_delete(f"/apis/{GROUP}/{{v}}/resourceslices/{{name}}", self._delete)
        r.add_get(f"/apis/{GROUP}/{{v}}/namespaces/{{ns}}/resourceclaims/{{name}}", self._claim)
        r.add_get("/api/v1/nodes/{name}", self._node)
        self._claim_status_routes(r)
        self._runner = web.AppRunner(app, handle_signals=False, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def stop(self) -> None:
        """End every watch, answer every held write, and stop listening."""
        self.release_hung()
        for w in self._watchers:
            w.queue.put_nowait(None)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> ApiServerStandIn:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ------------------------------------------------------------------------------- test-side helpers
    def add_node(self, name: str) -> dict[str, Any]:
        """Create a Node object (with a UID) and return it."""
        node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "uid": str(uuid.uuid4())}}
        self.nodes[name] = node
        return node

    def put_claim(self, claim: dict[str, Any]) -> None:
        """Store a ResourceClaim as the scheduler left it (validated like any write)."""
        version = str(claim.get("apiVersion", "")).rpartition("/")[2]
        if self.validate:
            self._checker.check(claim, SCHEMA_VERSION.get(version, "1.34"))
        meta = claim["metadata"]
        # What the server sets on every stored object (the status subresource checks resourceVersion).
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("generation", 1)
        meta["resourceVersion"] = self._next_rv()
        self.claims[(meta["namespace"], meta["name"])] = claim

    def node_slices(self, node: str) -> list[dict[str, Any]]:
        """Return the slices whose spec.nodeName is ``node``, by name."""
        return [s for _, s in sorted(self.slices.items()) if (s.get("spec") or {}).get("nodeName") == node]

    def external_update(self, name: str, mutate: Any) -> None:
        """Change a stored slice as another writer would (bumps its resourceVersion, emits MODIFIED)."""
        obj = copy.deepcopy(self.slices[name])
        mutate(obj)
        self._store("MODIFIED", obj)

    def release_hung(self) -> None:
        """Answer every write held so far with 504, unapplied; later writes to ``hang_writes`` hang again."""
        self._release.set()
        self._release = asyncio.Event()

    def wipe_node(self, node: str) -> int:
        """Delete the node's slices as the kubelet's deletecollection does at its start; return how many."""
        gone = [n for n, s in self.slices.items() if (s.get("spec") or {}).get("nodeName") == node]
        for n in gone:
            self._remove(n)
        return len(gone)

    # ------------------------------------------------------------------------------------- internals
    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if self.token is not None and request.headers.get("Authorization") != f"Bearer {self.token}":
            return _status(401, "Unauthorized", "Unauthorized")
        return await handler(request)

    def _version(self, request: web.Request) -> str:
        v = request.match_info["v"]
        if v not in self.versions:
            self.requests[f"{request.method} unserved"] += 1
            raise web.HTTPNotFound(text=json.dumps({"kind": "Status", "code": 404, "reason": "NotFound"}))
        return v

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def _emit(self, kind: str, obj: dict[str, Any]) -> None:
        rv = int(obj["metadata"]["resourceVersion"])
        self._events.append((rv, kind, obj))
        if len(self._events) > MAX_EVENTS:
            del self._events[: len(self._events) - MAX_EVENTS]
        for w in self._watchers:
            if all(_field(obj, k) == v for k, v in w.selector):
                w.queue.put_nowait({"type": kind, "object": obj})

    def _store(self, kind: str, obj: dict[str, Any]) -> dict[str, Any]:
        if self.drop_taints:
            for d in (obj.get("spec") or {}).get("devices") or ():
                d.pop("taints", None)
                (d.get("basic") or {}).pop("taints", None)
        obj["metadata"]["resourceVersion"] = self._next_rv()
        name = obj["metadata"]["name"]
        self._count_devices(self.slices.get(name), -1)
        self.slices[name] = obj
        self._count_devices(obj, 1)
        self._emit(kind, obj)
        return obj

    def _count_devices(self, obj: dict[str, Any] | None, sign: int) -> None:
        if obj is not None:
            spec = obj.get("spec") or {}
            self._devices_by_node[str(spec.get("nodeName"))] += sign * len(spec.get("devices") or ())

    def devices_of(self, node: str) -> int:
        """Devices held in the slices of ``node``."""
        return self._devices_by_node[node]

    def _remove(self, name: str) -> dict[str, Any]:
        self._count_devices(self.slices.get(name), -1)
        obj = copy.deepcopy(self.slices.pop(name))
        obj["metadata"]["resourceVersion"] = self._next_rv()
        self.writes[name] += 1
        self._emit("DELETED", obj)
        return obj

    def _check_write(self, obj: Any, version: str, old: dict[str, Any] | None) -> None:
        if not isinstance(obj, dict) or obj.get("kind") != "ResourceSlice":
            raise _Invalid("kind: expected ResourceSlice")
        if obj.get("apiVersion") != f"{GROUP}/{version}":
            raise _Invalid(f"apiVersion: {obj.get('apiVersion')!r} sent to the {version} endpoint")
        if self.validate:
            self._checker.check(obj, SCHEMA_VERSION[version])
        _slice_rules(obj, version)
        if old is not None:
            for key in ("driver", "nodeName"):
                if (old.get("spec") or {}).get(key) != obj["spec"].get(key):
                    raise _Invalid(f"spec.{key}: field is immutable")
            if old["spec"]["pool"]["name"] != obj["spec"]["pool"]["name"]:
                raise _Invalid("spec.pool.name: field is immutable")

    async def _body(self, request: web.Request) -> Any:
        try:
            return orjson.loads(await request.read())
        except ValueError:
            raise web.HTTPBadRequest(text="body is not JSON") from None

    async def _fault(self, method: str, name: str) -> web.Response | None:
        self.tries[name] += 1
        if self.on_write is not None:
            self.on_write(method, name)
        if name in self.hang_writes:
            await self._hold(name)
            # The kube-apiserver's answer to a request it gave up on (its --request-timeout).
            return _status(504, "Timeout", "stand-in: held write released, not applied")
        if name in self.conflict_writes:
            return _status(
                409, "Conflict", f'Operation cannot be fulfilled on resourceslices.{GROUP} "{name}": stand-in'
            )
        if self.fail_writes > 0:
            self.fail_writes -= 1
            return _status(500, "InternalError", "stand-in: injected failure")
        return None

    async def _hold(self, name: str) -> None:
        """Hold a request until ``release_hung`` (or ``stop``)."""
        self.hung[name] += 1
        self.holding += 1
        try:
            await self._release.wait()
        finally:
            self.holding -= 1

    def _invalid(self, exc: _Invalid, name: str) -> web.Response:
        message = f'ResourceSlice.{GROUP} "{name}" is invalid: {exc}'
        self.rejected.append(message)
        return _status(422, "Invalid", message)

    # -------------------------------------------------------------------------------------- handlers
    async def _group(self, request: web.Request) -> web.Response:
        if self.fail_discovery > 0:
            self.fail_discovery -= 1
            return _status(503, "ServiceUnavailable", "stand-in: injected failure")
        versions = [{"groupVersion": f"{GROUP}/{v}", "version": v} for v in self.versions]
        return web.json_response(
            {
                "kind": "APIGroup",
                "apiVersion": "v1",
                "name": GROUP,
                "versions": versions,
                "preferredVersion": versions[0],
            }
        )

    async def _list(self, request: web.Request) -> web.StreamResponse:
        version = self._version(request)
        try:
            selector = _selector(request.query.get("fieldSelector", ""))
        except ValueError as exc:
            return _status(400, "BadRequest", str(exc))
        if request.query.get("watch") in ("true", "1"):
            return await self._watch(request, selector)
        self.requests["LIST resourceslices"] += 1
        items = [
            s
            for _, s in sorted(self.slices.items())
            if s["apiVersion"].endswith("/" + version) and all(_field(s, k) == v for k, v in selector)
        ]
        return _json(
            {
                "kind": "ResourceSliceList",
                "apiVersion": f"{GROUP}/{version}",
                "metadata": {"resourceVersion": str(self._rv)},
                "items": items,
            }
        )

    async def _watch(self, request: web.Request, selector: list[tuple[str, str]]) -> web.StreamResponse:
        self.requests["WATCH resourceslices"] += 1
        if self.refuse_watch:
            reason = {403: "Forbidden", 405: "MethodNotAllowed"}.get(self.refuse_watch, "Refused")
            return _status(self.refuse_watch, reason, "stand-in: watching refused")
        since = int(request.query.get("resourceVersion") or self._rv)
        timeout = float(request.query.get("timeoutSeconds") or 1800)
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        w = _Watcher(selector)
        oldest = self._events[0][0] if self._events else self._rv + 1
        expired = self.expire_watches > 0
        if expired:
            self.expire_watches -= 1
        if expired or (since < self._rv and since + 1 < oldest):
            gone = {
                "kind": "Status",
                "code": 410,
                "reason": "Expired",
                "message": f"too old resource version: {since}",
            }
            await resp.write(json.dumps({"type": "ERROR", "object": gone}).encode() + b"\n")
            return resp
        for rv, kind, obj in self._events:
            if rv > since and all(_field(obj, k) == v for k, v in selector):
                w.queue.put_nowait({"type": kind, "object": obj})
        self._watchers.append(w)
        try:
            loop = asyncio.get_running_loop()
            end = loop.time() + timeout
            while True:
                left = end - loop.time()
                if left <= 0:
                    break
                try:
                    event = await asyncio.wait_for(w.queue.get(), left)
                except TimeoutError:
                    break
                if event is None:
                    break
                await resp.write(orjson.dumps(event) + b"\n")
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self._watchers.remove(w)
        with contextlib.suppress(ConnectionResetError):
            await resp.write_eof()
        return resp

    async def _create(self, request: web.Request) -> web.Response:
        version = self._version(request)
        obj = await self._body(request)
        self.requests["POST resourceslices"] += 1
        name = str((obj.get("metadata") or {}).get("name", "")) if isinstance(obj, dict) else ""
        if (fault := await self._fault("POST", name)) is not None:
            return fault
        try:
            self._check_write(obj, version, None)
        except _Invalid as exc:
            return self._invalid(exc, name)
        if name in self.slices:
            return _status(409, "AlreadyExists", f'resourceslices.{GROUP} "{name}" already exists')
        meta = obj["metadata"]
        if meta.get("resourceVersion"):
            return _status(400, "BadRequest", "resourceVersion should not be set on objects to be created")
        meta["uid"] = str(uuid.uuid4())
        meta["generation"] = 1
        self.writes[name] += 1
        stored = self._store("ADDED", obj)
        if self.answer_late_s > 0:
            await asyncio.sleep(self.answer_late_s)
        return _json(stored, status=201)

    async def _get(self, request: web.Request) -> web.Response:
        self._version(request)
        self.requests["GET resourceslices"] += 1
        name = request.match_info["name"]
        if name not in self.slices:
            return _not_found(f"resourceslices.{GROUP}", name)
        return _json(self.slices[name])

    async def _replace(self, request: web.Request) -> web.Response:
        version = self._version(request)
        name = request.match_info["name"]
        obj = await self._body(request)
        self.requests["PUT resourceslices"] += 1
        if (fault := await self._fault("PUT", name)) is not None:
            return fault
        old = self.slices.get(name)
        if old is None:
            return _not_found(f"resourceslices.{GROUP}", name)
        try:
            if (obj.get("metadata") or {}).get("name") != name:
                raise _Invalid("metadata.name: does not match the URL")
            self._check_write(obj, version, old)
        except _Invalid as exc:
            return self._invalid(exc, name)
        rv = obj["metadata"].get("resourceVersion")
        if rv and rv != old["metadata"]["resourceVersion"]:
            return _status(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on resourceslices.{GROUP} "{name}": the object has been '
                "modified; please apply your changes to the latest version and try again",
            )
        obj["metadata"]["uid"] = old["metadata"]["uid"]
        obj["metadata"]["generation"] = old["metadata"].get("generation", 1) + (old["spec"] != obj["spec"])
        self.writes[name] += 1
        return _json(self._store("MODIFIED", obj))

    async def _delete(self, request: web.Request) -> web.Response:
        self._version(request)
        name = request.match_info["name"]
        self.requests["DELETE resourceslices"] += 1
        if (fault := await self._fault("DELETE", name)) is not None:
            return fault
        old = self.slices.get(name)
        if old is None:
            return _not_found(f"resourceslices.{GROUP}", name)
        body = await request.json() if request.can_read_body else {}
        pre = (body or {}).get("preconditions") or {}
        if pre.get("uid") and pre["uid"] != old["metadata"]["uid"]:
            return _status(409, "Conflict", f"Precondition failed: UID in precondition: {pre['uid']}")
        if pre.get("resourceVersion") and pre["resourceVersion"] != old["metadata"]["resourceVersion"]:
            return _status(409, "Conflict", "Precondition failed: resourceVersion in precondition differs")
        return _json(self._remove(name))

    async def _delete_collection(self, request: web.Request) -> web.Response:
        version = self._version(request)
        self.requests["DELETECOLLECTION resourceslices"] += 1
        try:
            selector = _selector(request.query.get("fieldSelector", ""))
        except ValueError as exc:
            return _status(400, "BadRequest", str(exc))
        gone = [
            n
            for n, s in sorted(self.slices.items())
            if s["apiVersion"].endswith("/" + version) and all(_field(s, k) == v for k, v in selector)
        ]
        items = [self._remove(n) for n in gone]
        return web.json_response(
            {"kind": "ResourceSliceList", "apiVersion": f"{GROUP}/{version}", "items": items}
        )

    async def _claim(self, request: web.Request) -> web.Response:
        self._version(request)
        self.requests["GET resourceclaims"] += 1
        key = (request.match_info["ns"], request.match_info["name"])
        claim = self.claims.get(key)
        if claim is None:
            return _not_found(f"resourceclaims.{GROUP}", key[1])
        return web.json_response(claim)

    async def _node(self, request: web.Request) -> web.Response:
        self.requests["GET nodes"] += 1
        name = request.match_info["name"]
        node = self.nodes.get(name)
        if node is None:
            return _not_found("nodes", name)
        return web.json_response(node)

    # ------------------------------------------------------------------ resourceclaims/status (issue 25 §3)
    # The status subresource the driver writes status.devices[] through.  As the real server does
    # (pkg/registry/resource/resourceclaim/strategy.go, statusStrategy; validation of
    # ResourceClaimStatus): a PUT replaces the status only (spec and metadata stay the stored ones), a
    # stale resourceVersion gets 409, the allocation (with its config[]) cannot change, and every
    # device entry must name an allocated device, once, within the field limits.  Claims are served in
    # the version they were stored in (no conversion): a test stores a v1beta1 claim to play 1.32-1.33.

    def _init_claim_status(self) -> None:
        # Faults, each consumed by one status PUT: ``claim_status_fail`` 500s; ``claim_status_conflicts``
        # 409s, each after another writer changed the claim (its resourceVersion moves on).
        self.claim_status_fail = 0
        self.claim_status_conflicts = 0
        self.claim_status_delay = 0.0  # seconds each status PUT takes (to see how many run at once)
        # Plays a 1.32 server with the DRAResourceClaimDeviceStatus gate off: devices dropped silently.
        self.drop_device_status = False
        self.claim_status_writes: Counter[tuple[str, str]] = Counter()  # applied, per (namespace, name)
        self.claim_status_tries: Counter[tuple[str, str]] = Counter()  # every PUT, whatever its answer
        self.claim_status_in_flight = 0
        self.claim_status_peak = 0  # the most status PUTs running at once

    def _claim_status_routes(self, r: web.UrlDispatcher) -> None:
        r.add_put(f"/apis/{GROUP}/{{v}}/namespaces/{{ns}}/resourceclaims/{{name}}/status", self._claim_status)

    def claim(self, namespace: str, name: str) -> dict[str, Any]:
        """Return the stored claim ``namespace/name`` (KeyError when absent)."""
        return self.claims[(namespace, name)]

    async def _claim_status(self, request: web.Request) -> web.Response:
        version = self._version(request)
        key = (request.match_info["ns"], request.match_info["name"])
        obj = await self._body(request)
        self.requests["PUT resourceclaims/status"] += 1
        self.claim_status_tries[key] += 1
        self.claim_status_in_flight += 1
        self.claim_status_peak = max(self.claim_status_peak, self.claim_status_in_flight)
        try:
            if self.claim_status_delay:
                await asyncio.sleep(self.claim_status_delay)
            return self._claim_status_write(version, key, obj)
        finally:
            self.claim_status_in_flight -= 1

    def _claim_status_write(self, version: str, key: tuple[str, str], obj: Any) -> web.Response:
        name = key[1]
        resource = f"resourceclaims.{GROUP}"
        if self.claim_status_fail > 0:
            self.claim_status_fail -= 1
            return _status(500, "InternalError", "stand-in: injected failure")
        old = self.claims.get(key)
        if old is None:
            return _not_found(resource, name)
        if self.claim_status_conflicts > 0:
            self.claim_status_conflicts -= 1
            old["metadata"]["resourceVersion"] = self._next_rv()  # another writer got there first
        conflict = _status(
            409,
            "Conflict",
            f'Operation cannot be fulfilled on {resource} "{name}": the object has been modified; '
            "please apply your changes to the latest version and try again",
        )
        try:
            if not isinstance(obj, dict) or obj.get("kind") != "ResourceClaim":
                raise _Invalid("kind: expected ResourceClaim")
            if obj.get("apiVersion") != f"{GROUP}/{version}" or old.get("apiVersion") != obj["apiVersion"]:
                raise _Invalid(f"apiVersion: {obj.get('apiVersion')!r} sent to the {version} endpoint")
            meta = obj.get("metadata") or {}
            if (meta.get("namespace"), meta.get("name")) != key:
                raise _Invalid("metadata: namespace and name do not match the URL")
            if meta.get("uid") and meta["uid"] != old["metadata"]["uid"]:
                return _status(409, "Conflict", f"Precondition failed: UID in precondition: {meta['uid']}")
            rv = meta.get("resourceVersion")
            if rv and rv != old["metadata"]["resourceVersion"]:
                return conflict
            status = obj.get("status") or {}
            before = old.get("status") or {}
            if before.get("allocation") is not None and status.get("allocation") != before["allocation"]:
                raise _Invalid("status.allocation: field is immutable")  # its config[] included
            new = {**copy.deepcopy(old), "status": copy.deepcopy(status)}
            if self.drop_device_status:
                new["status"].pop("devices", None)
            _device_status_rules(new["status"])
            if self.validate:
                self._checker.check(new, SCHEMA_VERSION[version])
        except _Invalid as exc:
            message = f'ResourceClaim.{GROUP} "{name}" is invalid: {exc}'
            self.rejected.append(message)
            return _status(422, "Invalid", message)
        new["metadata"]["resourceVersion"] = self._next_rv()
        self.claims[key] = new
        self.claim_status_writes[key] += 1
        return web.json_response(new)


def _device_status_rules(status: dict[str, Any]) -> None:
    """The status.devices rules of the API's validation that its schema states in prose only."""
    allocated = {
        (r.get("driver"), r.get("pool"), r.get("device"), r.get("shareID"))
        for r in ((status.get("allocation") or {}).get("devices") or {}).get("results") or ()
    }
    seen: set[tuple[Any, ...]] = set()
    for i, e in enumerate(status.get("devices") or ()):
        where = f"status.devices[{i}]"
        k = (e.get("driver"), e.get("pool"), e.get("device"), e.get("shareID"))
        if k not in allocated:
            raise _Invalid(f"{where}: must be an allocated device in the claim")
        if k in seen:
            raise _Invalid(f"{where}: duplicate value")
        seen.add(k)
        conditions = e.get("conditions") or []
        if len(conditions) > 8:
            raise _Invalid(f"{where}.conditions: must have at most 8 items")
        if len({c.get("type") for c in conditions}) != len(conditions):
            raise _Invalid(f"{where}.conditions: duplicate type")
        if "data" in e and len(json.dumps(e["data"], separators=(",", ":"))) > 10 * 1024:
            raise _Invalid(f"{where}.data: must have at most 10240 bytes")
        net = e.get("networkData") or {}
        if len(net.get("interfaceName") or "") > 256:
            raise _Invalid(f"{where}.networkData.interfaceName: at most 256 characters")
        if len(net.get("hardwareAddress") or "") > 128:
            raise _Invalid(f"{where}.networkData.hardwareAddress: at most 128 characters")
        if len(net.get("ips") or ()) > 16:
            raise _Invalid(f"{where}.networkData.ips: at most 16 items")


# ------------------------------------------------------------------------------------------ the fleet
# One stand-in serves a whole fleet of daemons (issue 26): every request is counted by verb, resource
# and node, with its bytes, and the server can be told to restart, throttle or slow down, from the test
# (``srv.fleet.restart()``) or over HTTP (``POST /_standin/restart``) when it runs as its own process.

_AGENT_NODE = re.compile(r"(?:^|\s)node/([A-Za-z0-9.\-_]+)")
_FIELD_NODE = re.compile(r"spec\.nodeName==?([^,]+)")
LOG_LIMIT = 500_000  # request-log entries kept (a 32-node storm makes a few thousand a minute)


class FleetControls:
    """Per-node request accounting and fault controls (restart, 429, slow-down) of one stand-in."""

    def __init__(self, srv: ApiServerStandIn) -> None:
        self._srv = srv
        # (node, verb, resource, status) → requests, counted as answered (a watch when it ends; the log
        # has it from its start); node → bytes received / sent
        self.requests: Counter[tuple[str, str, str, int]] = Counter()
        self.bytes_in: Counter[str] = Counter()
        self.bytes_out: Counter[str] = Counter()
        self.handler_cpu: dict[str, float] = {}  # verb → CPU seconds spent in its handlers
        # (monotonic time of arrival, node, verb, resource, status): CLOCK_MONOTONIC is shared by the
        # processes of one machine, so a benchmark compares these times with its own.
        self.log: list[tuple[float, str, str, str, int]] = []
        # (monotonic time, node, devices published for the node after a successful slice write)
        self.published: list[tuple[float, str, int]] = []
        self.refuse_until = 0.0  # a restart in progress: every request answered 503 until then
        self.throttle_until = 0.0  # 429 with Retry-After until then ...
        self.retry_after = 1  # ... saying this many seconds ...
        self.throttle_fraction = 1.0  # ... to this share of requests (deterministic: every n-th)
        self._throttle_seen = 0.0
        self.delay_s = 0.0  # added before every answer (an overloaded server)
        self.restarts = 0

    # ------------------------------------------------------------------------------ accounting
    @staticmethod
    def verb(request: web.Request) -> str:
        """The kube-apiserver's verb for a request (apiserver_request_total's ``verb`` label)."""
        named = "name" in request.match_info
        method = request.method
        if method == "GET":
            if request.query.get("watch") in ("true", "1"):
                return "WATCH"
            return "GET" if named else "LIST"
        if method == "DELETE":
            return "DELETE" if named else "DELETECOLLECTION"
        return {"POST": "CREATE", "PUT": "UPDATE", "PATCH": "PATCH"}.get(method, method)

    @staticmethod
    def resource(request: web.Request) -> str:
        """The resource a path names (``resourceslices``, ``nodes``, ``discovery``...)."""
        parts = [p for p in request.path.split("/") if p]
        for kind in ("resourceslices", "resourceclaims", "nodes"):
            if kind in parts:
                return kind
        return "discovery" if parts[:1] == ["apis"] else (parts[0] if parts else "-")

    def node_of(self, request: web.Request, body: bytes) -> str:
        """Which node sent a request: its User-Agent's ``node/<name>``, else what the request names."""
        m = _AGENT_NODE.search(request.headers.get("User-Agent", ""))
        if m:
            return m.group(1)
        m = _FIELD_NODE.search(request.query.get("fieldSelector", ""))
        if m:
            return m.group(1)
        if body:
            with contextlib.suppress(ValueError, AttributeError, TypeError):
                node = (json.loads(body).get("spec") or {}).get("nodeName")
                if node:
                    return str(node)
        name = request.match_info.get("name")
        if name is not None and request.path.endswith(f"/resourceslices/{name}"):
            held = self._srv.slices.get(name)
            if held is not None:
                return str((held.get("spec") or {}).get("nodeName") or "-")
        return "-"

    def devices_of(self, node: str) -> int:
        """Devices the stand-in holds for ``node``, over all its slices."""
        return self._srv.devices_of(node)

    def reset(self) -> None:
        """Forget every count and log entry (a benchmark's scenario boundary)."""
        self.requests.clear()
        self.bytes_in.clear()
        self.bytes_out.clear()
        self.handler_cpu.clear()
        self.log.clear()
        self.published.clear()

    def per_node(self, verb: str | None = None, resource: str = "resourceslices") -> Counter[str]:
        """Requests per node (of one verb, or all), of one resource."""
        out: Counter[str] = Counter()
        for (node, v, res, _code), n in self.requests.items():
            if res == resource and (verb is None or v == verb):
                out[node] += n
        return out

    def stats(self, since: float = 0.0) -> dict[str, Any]:
        """Everything counted, as JSON-ready data; log entries from ``since`` (monotonic) on."""
        import resource as rusage
        import time

        ru = rusage.getrusage(rusage.RUSAGE_SELF)
        return {
            "now": time.monotonic(),
            "cpu_s": ru.ru_utime + ru.ru_stime,
            "handler_cpu_s": dict(self.handler_cpu),
            "requests": [[*k, n] for k, n in sorted(self.requests.items())],
            "bytes_in": dict(self.bytes_in),
            "bytes_out": dict(self.bytes_out),
            "devices": {n: self.devices_of(n) for n in self._srv.nodes},
            "log": [list(e) for e in self.log if e[0] >= since],
            "published": [list(e) for e in self.published if e[0] >= since],
            "restarts": self.restarts,
        }

    # --------------------------------------------------------------------------------- controls
    def restart(self, refuse_s: float = 2.0, rv_jump: int = 1000) -> None:
        """Play an API-server restart: close every watch, refuse requests for ``refuse_s``, then serve
        on with a resourceVersion ``rv_jump`` ahead and an empty watch cache (older ones get 410)."""
        import time

        srv = self._srv
        for w in srv._watchers:
            w.queue.put_nowait(None)
        # The new process's watch cache starts at etcd's current revision: resuming a watch from an
        # older resourceVersion is "too old" (410), the client must list again.
        srv._rv += rv_jump
        srv._events.clear()
        self.refuse_until = time.monotonic() + refuse_s
        self.restarts += 1

    def throttle(self, seconds: float, retry_after: int = 1, fraction: float = 1.0) -> None:
        """Answer 429 Too Many Requests with ``Retry-After`` to ``fraction`` of requests for ``seconds``
        (what API Priority and Fairness does when a priority level's queues are full)."""
        import time

        self.throttle_until = time.monotonic() + seconds
        self.retry_after = retry_after
        self.throttle_fraction = fraction
        self._throttle_seen = 0.0

    def slow(self, delay_s: float) -> None:
        """Add ``delay_s`` before every answer (0 ends it)."""
        self.delay_s = delay_s

    def install(self, router: web.UrlDispatcher) -> None:
        """Add the ``/_standin/`` control endpoints."""
        router.add_get("/_standin/stats", self._h_stats)
        router.add_post("/_standin/restart", self._h_restart)
        router.add_post("/_standin/throttle", self._h_throttle)
        router.add_post("/_standin/slow", self._h_slow)
        router.add_post("/_standin/reset", self._h_reset)
        router.add_post("/_standin/claims", self._h_claims)

    @staticmethod
    def _num(request: web.Request, key: str, default: float) -> float:
        try:
            return float(request.query.get(key, default))
        except ValueError:
            raise web.HTTPBadRequest(text=f"{key}: not a number") from None

    async def _h_stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.stats(self._num(request, "since", 0.0)))

    async def _h_restart(self, request: web.Request) -> web.Response:
        self.restart(self._num(request, "refuse_s", 2.0), int(self._num(request, "rv_jump", 1000)))
        return web.json_response({"restarted": self.restarts})

    async def _h_throttle(self, request: web.Request) -> web.Response:
        n = self._num
        seconds, fraction = n(request, "seconds", 10.0), n(request, "fraction", 1.0)
        self.throttle(seconds, int(n(request, "retry_after", 1)), fraction)
        return web.json_response({"throttle_until": self.throttle_until})

    async def _h_slow(self, request: web.Request) -> web.Response:
        self.slow(self._num(request, "delay_s", 0.0))
        return web.json_response({"delay_s": self.delay_s})

    async def _h_reset(self, request: web.Request) -> web.Response:
        self.reset()
        return web.json_response({})

    async def _h_claims(self, request: web.Request) -> web.Response:
        """Store a JSON list of ResourceClaims as the scheduler left them (a benchmark's pods)."""
        try:
            claims = json.loads(await request.read())
            if not isinstance(claims, list):
                raise TypeError("expected a JSON list of ResourceClaims")
            for claim in claims:
                self._srv.put_claim(claim)
        except (ValueError, KeyError, TypeError, _Invalid) as exc:
            raise web.HTTPBadRequest(text=f"claims: {clip(str(exc), 300)}") from None
        return web.json_response({"stored": len(claims)})

    # ------------------------------------------------------------------------------- middleware
    def _fault(self, now: float) -> web.Response | None:
        if now < self.refuse_until:
            return _status(503, "ServiceUnavailable", "stand-in: restarting")
        if now < self.throttle_until:
            self._throttle_seen += self.throttle_fraction
            if self._throttle_seen >= 1.0:
                self._throttle_seen -= 1.0
                resp = _status(429, "TooManyRequests", "stand-in: too many requests, please try again later")
                resp.headers["Retry-After"] = str(self.retry_after)
                return resp
        return None

    @web.middleware
    async def middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Count the request (node, verb, resource, status, bytes, CPU); apply any fault first."""
        import time

        if request.path.startswith("/_standin/"):
            return await handler(request)
        body = await request.read() if request.can_read_body else b""
        node = self.node_of(request, body)
        verb, res = self.verb(request), self.resource(request)
        if self.delay_s > 0:
            await asyncio.sleep(self.delay_s)
        cpu0, arrived = time.thread_time(), time.monotonic()
        resp: web.StreamResponse | None = self._fault(arrived)
        # A watch is logged as it opens (it may stay open for the whole run), and its status set after.
        at = len(self.log) if len(self.log) < LOG_LIMIT else -1
        if at >= 0:
            self.log.append((arrived, node, verb, res, resp.status if resp is not None else 200))
        if resp is None:
            try:
                resp = await handler(request)
            except web.HTTPException as exc:
                resp = exc
        # A watch's handler spans its whole life: its CPU is the events it wrote, counted all the same.
        self.handler_cpu[verb] = self.handler_cpu.get(verb, 0.0) + time.thread_time() - cpu0
        now = time.monotonic()
        code = resp.status
        self.requests[(node, verb, res, code)] += 1
        self.bytes_in[node] += len(body) + sum(len(k) + len(v) + 4 for k, v in request.headers.items())
        sent = resp.body_length if resp.prepared else len(getattr(resp, "body", b"") or b"")
        self.bytes_out[node] += sent
        if 0 <= at < len(self.log) and self.log[at][0] == arrived:  # not cleared by a reset meanwhile
            self.log[at] = (arrived, node, verb, res, code)
        if res == "resourceslices" and verb in ("CREATE", "UPDATE", "DELETE") and code < 300:
            self.published.append((now, node, self.devices_of(node)))
        if isinstance(resp, web.HTTPException):
            raise resp
        return resp


if __name__ == "__main__":
    import argparse
    from pathlib import Path

    import uvloop

    p = argparse.ArgumentParser(description="API-server stand-in for DRA (benchmarks, manual tests)")
    p.add_argument("--versions", default="v1,v1beta1")
    p.add_argument("--no-validate", action="store_true", help="skip schema checks (measure the driver alone)")
    p.add_argument("--node", action="append", default=[], help="create this Node (repeatable)")
    p.add_argument("--token", default=None, help="require this bearer token (401 without it)")
    p.add_argument(
        "--claim",
        action="append",
        default=[],
        type=Path,
        help="store the ResourceClaim in this JSON file, as the scheduler left it (repeatable)",
    )
    a = p.parse_args()

    async def _main() -> None:
        async with ApiServerStandIn(a.versions.split(","), validate=not a.no_validate, token=a.token) as srv:
            for n in a.node:
                srv.add_node(n)
            for f in a.claim:
                try:
                    srv.put_claim(json.loads(f.read_text()))
                except (OSError, ValueError, KeyError, TypeError, _Invalid) as exc:
                    raise SystemExit(f"--claim {f}: {exc}") from None
            print(srv.url, flush=True)
            await asyncio.Event().wait()

    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(_main())
