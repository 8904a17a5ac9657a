"""The API-server client DRA needs: ResourceSlices, ResourceClaims and Nodes, on the daemon's event loop.

Which client, and why (issue 16 asks for a maintained one that fits the loop):

* ``kubernetes`` (the official client) is synchronous (urllib3): every call would hold a worker thread,
  and a watch would pin one for good; on a 2-core node with a scan already in threads that is the
  wrong shape.
* a thin aiohttp/httpx client of our own fits the loop, but would have to re-implement what makes a
  client correct beyond the happy path: kubeconfig contexts, client certificates, exec credential
  plugins and OIDC refresh, and the in-cluster projected token that the kubelet rotates (bound tokens
  expire; the client must re-read the file).
* ``kubernetes_asyncio`` (maintained, generated from the same OpenAPI as the official client, released
  per Kubernetes minor) runs on aiohttp, so on the daemon's uvloop, and does all of the above.  **We use
  it** for configuration, authentication (``ApiClient.update_params_for_auth``) and transport (its
  aiohttp session, with the kubeconfig's TLS settings), and send and receive raw JSON ourselves: its
  generated models and ``sanitize_for_serialization`` cost a Python object or call per device attribute
  (measured: a third of a 4,096-device start), and resource.k8s.io v1 and v1beta1 are then one code
  path.  Its import costs ~0.36-0.7 s and ~40 MiB resident (measured here), so it is imported only on
  nodes with a DRA pool: by ``densedev run`` (``preload``) while its scan-ahead child reads sysfs, so
  that it is not paid again between the scan and the first slice, else when a client is made.

Versions: ``discover`` reads the ``resource.k8s.io`` API group and takes v1 (1.34+), else v1beta1
(1.32-1.33), as the official helper's client falls back when v1 is not served.
"""

from __future__ import annotations

import asyncio
import importlib
import re
import time
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote, urlencode

import orjson

from .. import __version__
from ..printable import clip
from .slices import ApiVersion

GROUP = "resource.k8s.io"
REQUEST_TIMEOUT_S = 30.0  # reads (list, get, discovery); a watch has its own read timeout
# Slice writes are cut sooner: the publisher retries a cut write (after a fresh read) and meanwhile
# writes its other slices, so the bound only decides how long one slice's newest state can sit behind a
# request nobody answers.  10 s is what the kubelet gives its own writes of node state: its heartbeat
# client's timeout is nodeStatusUpdateFrequency, 10 s by default (cmd/kubelet/app/server.go); a healthy
# API server answers a ResourceSlice write in milliseconds, and its own cut is --request-timeout, 60 s.
WRITE_TIMEOUT_S = 10.0
MAX_BODY = 16 << 20  # refuse a response larger than this (a 16k-device list is ~10 MiB of JSON)
# A Retry-After longer than this is taken as this: a server (or proxy) asking for an hour would leave a
# node's slices stale that long; client-go's own cap on a retry's wait is a minute too.
RETRY_AFTER_MAX_S = 60.0


TIMEOUT = "Timeout"  # ApiError.reason of a request cut by our own timeout (status 0)

# The head of an ADDED or MODIFIED watch event, up to its object's resourceVersion: the API server writes
# the event's type first and the object's metadata before its spec (Go's field order: ObjectMeta's
# name, uid, resourceVersion, ...), and nothing before it in a ResourceSlice has a key of that name
# (an escaped quote inside a string cannot end one, so only a real key matches).  A start's every slice
# comes back twice, in the write's answer and in this event: decoding the event too was ~0.7 s of a
# 65,536-device start, and what it would say is already held.
_ECHO = re.compile(
    rb'\{\s*"type"\s*:\s*"(?:ADDED|MODIFIED)"\s*,\s*"object"\s*:.*?"resourceVersion"\s*:\s*"([^"]*)"'
)


def preload() -> float:
    """Import the client library now (``densedev run`` does it while its scan-ahead child reads sysfs).

    Returns the seconds the import took (next to nothing when it was already imported; 0 when it
    failed).  An import that fails is left to the client's maker, which reports it as the DRA driver's
    start failing.
    """
    t0 = time.perf_counter()
    try:
        importlib.import_module("kubernetes_asyncio.client")
        importlib.import_module("kubernetes_asyncio.config")
    except Exception:  # reported once, where the client is made (DraUnavailable)
        return 0.0
    return time.perf_counter() - t0


class ApiError(Exception):
    """An API request that failed: HTTP status (0: no answer), the Status reason, a bounded message."""

    def __init__(self, status: int, reason: str, message: str, retry_after: float | None = None) -> None:
        self.status = status
        self.reason = reason
        self.message = clip(message, 300)
        # Seconds the server asked us to wait (Retry-After of a 429 or 503), at most RETRY_AFTER_MAX_S.
        self.retry_after = retry_after
        super().__init__(f"{status} {reason}: {self.message}")

    @property
    def timed_out(self) -> bool:
        """Whether no answer came within the request's timeout (the server may still apply a write)."""
        return self.status == 0 and self.reason == TIMEOUT


def retry_after(value: str | None) -> float | None:
    """Seconds a ``Retry-After`` header asks for (delta-seconds; an HTTP date is not sent by the API
    server), capped at ``RETRY_AFTER_MAX_S``; None when absent or unreadable."""
    if not value:
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        return None
    if seconds != seconds or seconds < 0:  # NaN, negative
        return None
    return min(seconds, RETRY_AFTER_MAX_S)


class TokenBucket:
    """A token bucket: ``qps`` tokens a second, up to ``burst`` saved; callers wait their turn in order.

    Reservation-style (as golang.org/x/time/rate's Reserve, which client-go's limiter uses): a caller
    takes its token at once, the count may go negative, and it waits until its token would have been
    there, so waiters are served first come, first served, without waking each other.  ``qps`` 0 or
    less turns the limit off.
    """

    def __init__(self, qps: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.qps = qps
        self.burst = max(1, burst)
        self._clock = clock
        self._tokens = float(self.burst)
        self._at = clock()
        self.waited = 0  # callers that had to wait, for tests and metrics

    def reserve(self) -> float:
        """Take a token; return the seconds to wait before using it (0: at once)."""
        if self.qps <= 0:
            return 0.0
        now = self._clock()
        self._tokens = min(float(self.burst), self._tokens + (now - self._at) * self.qps)
        self._at = now
        self._tokens -= 1.0
        if self._tokens >= 0:
            return 0.0
        self.waited += 1
        return -self._tokens / self.qps

    def give_back(self) -> None:
        """Return a token taken by ``reserve`` and not used (its caller was cancelled)."""
        if self.qps > 0:
            self._tokens = min(float(self.burst), self._tokens + 1.0)

    async def acquire(self) -> None:
        """Wait for a token."""
        wait = self.reserve()
        if wait > 0:
            try:
                await asyncio.sleep(wait)
            except asyncio.CancelledError:
                self.give_back()
                raise


class ClaimReader(Protocol):
    """Reads one ResourceClaim (resource.k8s.io) as a dict, as NodePrepareResources needs it."""

    async def get(self, namespace: str, name: str) -> Mapping[str, Any]:
        """Return the claim ``namespace/name``; raise ApiError (404 when it is gone)."""
        ...


class ResourceClient:
    """resource.k8s.io ResourceSlices and ResourceClaims, and Nodes, over one kubernetes_asyncio client."""

    def __init__(self, api: Any, version: ApiVersion | None = None) -> None:
        self._api = api  # kubernetes_asyncio.client.ApiClient
        self.version = version
        self.user_agent = f"densedev/{__version__}"
        self.writes = TokenBucket(0.0, 1)  # no limit until ``limit_writes``

    def identify(self, node: str) -> None:
        """Send ``densedev/<version> node/<name>`` as the User-Agent: the API server's audit log and
        APF's flow distinguisher then tell one node's requests from another's."""
        self.user_agent = f"densedev/{__version__} node/{node}"

    def limit_writes(self, qps: float, burst: int) -> None:
        """Meter slice writes through a token bucket of ``qps`` a second and ``burst`` (0 qps: none)."""
        self.writes = TokenBucket(qps, burst)

    # --------------------------------------------------------------------------------------- creation
    @classmethod
    async def from_kubeconfig(
        cls, kubeconfig: Path | None = None, context: str | None = None
    ) -> ResourceClient:
        """Return a client for the cluster: in-cluster config when ``kubeconfig`` is None, else that file."""
        from kubernetes_asyncio import client, config

        cfg = client.Configuration()
        if kubeconfig is None:
            # Re-reads the projected token file before it expires (try_refresh_token defaults on).
            config.load_incluster_config(client_configuration=cfg)
        else:
            await config.load_kube_config(
                config_file=str(kubeconfig), context=context, client_configuration=cfg
            )
        return cls(client.ApiClient(configuration=cfg))

    @classmethod
    def for_url(cls, url: str, token: str | None = None) -> ResourceClient:
        """Return a client for a plain URL (tests and the stand-in), optionally with a bearer token."""
        from kubernetes_asyncio import client

        cfg = client.Configuration(host=url.rstrip("/"))
        if token is not None:
            cfg.api_key = {"BearerToken": token}
            cfg.api_key_prefix = {"BearerToken": "Bearer"}
        return cls(client.ApiClient(configuration=cfg))

    async def close(self) -> None:
        """Close the HTTP session."""
        await self._api.close()

    # --------------------------------------------------------------------------------------- transport
    async def _call(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, str] | None = None,
        body: Any = None,
        timeout: float | tuple[float, float] | None = REQUEST_TIMEOUT_S,
        stream: bool = False,
    ) -> Any:
        import aiohttp

        api = self._api
        rest = api.rest_client
        params = list((query or {}).items())
        headers = {**api.default_headers, "Accept": "application/json", "User-Agent": self.user_agent}
        data = None
        if body is not None:
            # Serialised here, in one C-speed pass: the generated client's sanitize_for_serialization
            # walks every nested dict in Python (measured: a third of a 4,096-device start).  orjson
            # writes the same compact bytes as json.dumps 13 times faster (a 128-device slice: 0.07
            # against 0.94 ms) and reads them twice as fast: a node's start sends, and reads back
            # twice (the answer, the watch event), every device it has.
            headers["Content-Type"] = "application/json"
            data = orjson.dumps(body)
        if isinstance(timeout, tuple):
            client_timeout = aiohttp.ClientTimeout(sock_connect=timeout[0], sock_read=timeout[1])
        else:
            client_timeout = aiohttp.ClientTimeout(total=timeout)
        extra: dict[str, Any] = {}
        if rest.proxy:
            extra["proxy"] = rest.proxy
            extra["proxy_headers"] = rest.proxy_headers
        if rest.server_hostname:
            extra["server_hostname"] = rest.server_hostname
        try:
            # The bearer token as the configuration has it now (kubernetes_asyncio re-reads a rotated
            # in-cluster token here); TLS client certificates live in the session's connector.
            await api.update_params_for_auth(headers, params, ["BearerToken"])
            url = api.configuration.host + path + ("?" + urlencode(params) if params else "")
            resp = await rest.pool_manager.request(
                method, url, data=data, headers=headers, timeout=client_timeout, **extra
            )
        except asyncio.CancelledError:
            raise
        except TimeoutError:  # aiohttp's timeouts are asyncio.TimeoutError, the builtin since 3.11
            raise ApiError(0, TIMEOUT, f"{method} {path}: no answer within {timeout} s") from None
        except Exception as exc:  # aiohttp.ClientError, OSError, ssl errors
            raise ApiError(0, type(exc).__name__, str(exc) or type(exc).__name__) from None
        if stream and 200 <= resp.status < 300:
            return resp
        chunks: list[bytes] = []
        size = 0
        try:
            # StreamReader.read(n) returns what has arrived, up to n: read to the end, within the bound.
            while chunk := await resp.content.read(1 << 20):
                size += len(chunk)
                if size > MAX_BODY:
                    raise ApiError(
                        resp.status, "TooLarge", f"response of {method} {path} over {MAX_BODY} bytes"
                    )
                chunks.append(chunk)
        except ApiError:
            raise
        except asyncio.CancelledError:
            raise
        except TimeoutError:
            raise ApiError(0, TIMEOUT, f"{method} {path}: response unfinished within {timeout} s") from None
        except Exception as exc:
            raise ApiError(0, type(exc).__name__, str(exc) or "response broke off") from None
        finally:
            resp.release()
        data = b"".join(chunks)
        try:
            doc = orjson.loads(data) if data else {}
        except ValueError:
            if 200 <= resp.status < 300:
                raise ApiError(resp.status, "BadResponse", f"{method} {path}: not JSON") from None
            doc = {"message": data[:200].decode("utf-8", "replace")}
        if not isinstance(doc, dict):
            raise ApiError(resp.status, "BadResponse", f"{method} {path}: not a JSON object")
        if not 200 <= resp.status < 300:
            reason, message = doc.get("reason", ""), doc.get("message", "")
            wait = retry_after(resp.headers.get("Retry-After")) if resp.status in (429, 503) else None
            raise ApiError(resp.status, str(reason) or (resp.reason or ""), str(message), wait)
        return doc

    def _base(self) -> str:
        if self.version is None:
            raise RuntimeError("resource.k8s.io version unknown: call discover() first")
        return f"/apis/{GROUP}/{self.version.value}"

    # --------------------------------------------------------------------------------------- discovery
    async def discover(self) -> ApiVersion:
        """Use resource.k8s.io v1 when served, else v1beta1; raise ApiError when neither is."""
        doc = await self._call("GET", f"/apis/{GROUP}")
        served = {v.get("version") for v in doc.get("versions", ()) if isinstance(v, dict)}
        for version in (ApiVersion.V1, ApiVersion.V1BETA1):
            if version.value in served:
                self.version = version
                return version
        raise ApiError(404, "NotFound", f"{GROUP} serves {sorted(map(str, served))}, neither v1 nor v1beta1")

    # ---------------------------------------------------------------------------------- ResourceSlices
    async def list_slices(self, field_selector: str) -> tuple[list[dict[str, Any]], str]:
        """Return the slices matching a field selector and the list's resourceVersion."""
        doc = await self._call(
            "GET", f"{self._base()}/resourceslices", query={"fieldSelector": field_selector}
        )
        return list(doc.get("items") or ()), str(doc.get("metadata", {}).get("resourceVersion", ""))

    async def watch_slices(
        self,
        field_selector: str,
        resource_version: str,
        timeout_s: int = 300,
        known: Callable[[str], bool] | None = None,
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """Yield ``(type, object)`` events after ``resource_version`` until the server ends the watch.

        An ADDED or MODIFIED event whose object's resourceVersion ``known`` says the caller holds (the
        echo of its own write, whose answer it read already) is not decoded: it is yielded as a
        ``BOOKMARK`` carrying that resourceVersion, which moves the resume point and nothing else.
        """
        query = {
            "fieldSelector": field_selector,
            "watch": "true",
            "resourceVersion": resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(timeout_s),
        }
        # No total timeout: the server ends the watch after timeoutSeconds; the read timeout catches a
        # connection that went silent (the server sends bookmarks well within it).
        resp = await self._call(
            "GET",
            f"{self._base()}/resourceslices",
            query=query,
            timeout=(REQUEST_TIMEOUT_S, timeout_s + REQUEST_TIMEOUT_S),
            stream=True,
        )
        try:
            while True:
                try:
                    line = await resp.content.readline()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    raise ApiError(0, type(exc).__name__, str(exc) or "watch stream broke") from None
                if not line:
                    return
                if not line.strip():
                    continue
                if known is not None and (echo := _ECHO.match(line)) is not None:
                    rv = echo.group(1).decode("ascii", "replace")
                    if known(rv):
                        yield "BOOKMARK", {"metadata": {"resourceVersion": rv}}
                        continue
                try:
                    event = orjson.loads(line)
                    kind, obj = str(event["type"]), event["object"]
                except (ValueError, KeyError, TypeError):
                    raise ApiError(0, "BadWatchEvent", line[:200].decode("utf-8", "replace")) from None
                if kind == "ERROR":
                    raise ApiError(
                        int(obj.get("code", 0) or 0), str(obj.get("reason", "")), str(obj.get("message", ""))
                    )
                yield kind, obj
        finally:
            resp.release()

    async def create_slice(self, obj: Mapping[str, Any], timeout: float = WRITE_TIMEOUT_S) -> dict[str, Any]:
        """Create a slice; return it as stored."""
        path = f"{self._base()}/resourceslices"
        await self.writes.acquire()
        return dict(await self._call("POST", path, body=obj, timeout=timeout))

    async def replace_slice(self, obj: Mapping[str, Any], timeout: float = WRITE_TIMEOUT_S) -> dict[str, Any]:
        """Replace a slice (PUT; 409 when ``metadata.resourceVersion`` is stale); return it as stored."""
        path = f"{self._base()}/resourceslices/{quote(obj['metadata']['name'], safe='')}"
        await self.writes.acquire()
        return dict(await self._call("PUT", path, body=obj, timeout=timeout))

    async def get_slice(self, name: str, timeout: float = REQUEST_TIMEOUT_S) -> dict[str, Any]:
        """Return one slice by name."""
        path = f"{self._base()}/resourceslices/{quote(name, safe='')}"
        return dict(await self._call("GET", path, timeout=timeout))

    async def delete_slice(
        self, name: str, uid: str = "", resource_version: str = "", timeout: float = WRITE_TIMEOUT_S
    ) -> None:
        """Delete a slice, only if it still has this UID and resourceVersion when they are given."""
        pre: dict[str, str] = {}
        if uid:
            pre["uid"] = uid
        if resource_version:
            pre["resourceVersion"] = resource_version
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": pre} if pre else None
        path = f"{self._base()}/resourceslices/{quote(name, safe='')}"
        await self.writes.acquire()
        await self._call("DELETE", path, body=body, timeout=timeout)

    async def delete_slices(self, field_selector: str) -> None:
        """Delete every slice matching a field selector at once (what the kubelet does at its start)."""
        await self._call("DELETE", f"{self._base()}/resourceslices", query={"fieldSelector": field_selector})

    # --------------------------------------------------------------------------------- claims, nodes
    async def get_claim(self, namespace: str, name: str) -> dict[str, Any]:
        """Return the ResourceClaim ``namespace/name`` in the discovered version."""
        path = f"{self._base()}/namespaces/{quote(namespace, safe='')}/resourceclaims/{quote(name, safe='')}"
        return dict(await self._call("GET", path))

    async def replace_claim_status(
        self, obj: Mapping[str, Any], timeout: float = WRITE_TIMEOUT_S
    ) -> dict[str, Any]:
        """PUT a claim to ``resourceclaims/<name>/status`` (409 when its resourceVersion is stale)."""
        meta = obj["metadata"]
        path = (
            f"{self._base()}/namespaces/{quote(meta['namespace'], safe='')}"
            f"/resourceclaims/{quote(meta['name'], safe='')}/status"
        )
        return dict(await self._call("PUT", path, body=obj, timeout=timeout))

    async def get_node(self, name: str) -> dict[str, Any]:
        """Return the Node ``name`` (its UID makes the slices' ownerReference)."""
        return dict(await self._call("GET", f"/api/v1/nodes/{quote(name, safe='')}"))


class HttpClaimReader:
    """The daemon's ``ClaimReader``: GET through a ``ResourceClient``, its version discovered once."""

    def __init__(self, client: ResourceClient) -> None:
        self._client = client
        self._lock = asyncio.Lock()

    async def get(self, namespace: str, name: str) -> Mapping[str, Any]:
        """Return the claim ``namespace/name`` as a dict; raise ApiError (404 when it does not exist)."""
        if self._client.version is None:
            async with self._lock:
                if self._client.version is None:
                    await self._client.discover()
        return await self._client.get_claim(namespace, name)
