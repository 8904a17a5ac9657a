"""Prometheus metrics and the ``/metrics``, ``/healthz``, ``/readyz`` HTTP endpoints.

``Metrics`` owns its own ``Registry`` (never prometheus-client's process-global one, so tests and a
reloading daemon can make as many as they like) and offers plain methods the daemon calls at each event;
callers never touch prometheus-client objects.  The counters, gauges and histograms here are plain numbers
with prometheus-client's semantics; prometheus-client itself (~20 ms of imports, a tenth of the daemon's
start) is imported only when something collects them — a scrape of ``/metrics`` or a test — so a node
without ``--metrics-addr`` never loads it.  Series are labelled by ``resource`` (the pool's full extended
resource name, ``intel.com/sriov_a``), never by device: a node has thousands of devices and a label per
device would make every scrape as large as the device table.

``MetricsServer`` is a deliberately small HTTP/1.1 server on the running event loop (a protocol per
connection, accepted by its own loop of ``sock_accept``): GET or HEAD of three paths, one response per
connection, every resource a client can take bounded (see the class).  Serving it on the daemon's own
loop is the point — a liveness probe answered by it proves the loop still turns.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import re
import resource
import socket
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

from .. import __version__, accel, workers
from ..model import Health, RequestError
from ..workers import Work

if TYPE_CHECKING:
    from .._proto import api_pb2
    from ..kubelet.server import PoolService

log = logging.getLogger(__name__)
T = TypeVar("T")

# Event-to-send latency: the health engine aims at milliseconds, so most of the resolution sits between
# 0.5 ms and 50 ms; 1 s catches a stalled loop.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
# A full scan of 4k-16k devices takes milliseconds with the extension and tens to hundreds without.
SCAN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Allocate / GetPreferredAllocation: the kubelet sets no timeout and pod admission waits on us.
RPC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
# Events folded into one ListAndWatch message (a PF going down flips up to its 256 VFs at once).
EVENTS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)

# generate_latest writes the classic text format; every Prometheus version reads this content type.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

ALLOCATE = "Allocate"
PREFERRED = "GetPreferredAllocation"
PRESTART = "PreStartContainer"


# ------------------------------------------------------------------------------- plain metrics
# prometheus-client's metric types, as far as densedev uses them, over plain numbers.  Updated on the
# event loop's thread only; collected from any thread (a /metrics render runs in a worker), which reads
# a snapshot: copying a dict or list of str tuples and floats runs in C without releasing the GIL.

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


def _created_series() -> bool:
    """Whether counters and histograms export ``_created``, as prometheus-client decides it."""
    return os.environ.get("PROMETHEUS_DISABLE_CREATED_SERIES", "False").lower() not in ("true", "1", "t")


class _Child:
    """One series of a family (one combination of label values)."""

    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1) -> None:
        """Add ``amount`` to a gauge."""
        self.value += amount

    def set(self, value: float) -> None:
        """Set a gauge's value."""
        self.value = float(value)


class _CounterChild(_Child):
    """One series of a counter."""

    __slots__ = ()

    def inc(self, amount: float = 1) -> None:
        """Add ``amount`` (a counter refuses a negative one, as prometheus-client does)."""
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        self.value += amount


class _HistogramChild(_Child):
    """One series of a histogram: a count per bucket, and the sum (``value``)."""

    __slots__ = ("bounds", "counts")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        super().__init__()
        self.bounds = bounds
        self.counts = [0] * len(bounds)  # per bucket, not cumulative

    def observe(self, amount: float) -> None:
        """Count ``amount`` in the first bucket whose upper bound holds it, and add it to the sum."""
        self.value += amount
        i = bisect_left(self.bounds, amount)
        if i < len(self.bounds) and amount <= self.bounds[i]:  # NaN is in no bucket, as upstream
            self.counts[i] += 1


class _Family:
    """A metric name with its help, label names and series (prometheus-client's labelled metric)."""

    kind = ""
    suffixes: tuple[str, ...] = ()

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Iterable[str] = (),
        *,
        registry: Registry | None = None,
    ) -> None:
        if not _NAME.fullmatch(name):
            raise ValueError(f"Invalid metric name: {name}")
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        for label in self.labelnames:
            if not _LABEL.fullmatch(label) or label.startswith("__"):
                raise ValueError(f"Invalid label metric name: {label}")
        self._children: dict[tuple[str, ...], Any] = {}
        if not self.labelnames:
            self._children[()] = self._child()  # a label-less metric is its own single series
        if registry is not None:
            registry.register(self)

    def _child(self) -> Any:
        raise NotImplementedError

    def labels(self, *values: object) -> Any:
        """Return the series of these label values, made (at zero) the first time."""
        if not self.labelnames:
            raise ValueError(f"No label names were set when constructing {self.kind}:{self.name}")
        if len(values) != len(self.labelnames):
            raise ValueError("Incorrect label count")
        key = tuple(str(v) for v in values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._child()
        return child

    def remove(self, *values: object) -> None:
        """Drop the series of these label values (nothing when absent)."""
        if len(values) != len(self.labelnames):
            raise ValueError(f"Incorrect label count (expected {len(self.labelnames)}, got {values})")
        self._children.pop(tuple(str(v) for v in values), None)

    def remove_by_labels(self, labels: Mapping[str, str]) -> None:
        """Drop every series whose labels include all of ``labels``."""
        want = {self.labelnames.index(k): str(v) for k, v in labels.items()}
        for key in [k for k in list(self._children) if all(k[i] == v for i, v in want.items())]:
            self._children.pop(key, None)

    def remove_where(self, label: str, values: Collection[str]) -> None:
        """Drop every series whose ``label`` is one of ``values``, in one pass over the series.

        A reload removing 1,000 pools one ``remove_by_labels`` at a time walked every family's series
        1,000 times (3.7 s of a reload to 0 pools); this walks them once.
        """
        i = self.labelnames.index(label)
        for key in [k for k in list(self._children) if k[i] in values]:
            self._children.pop(key, None)

    def _single(self) -> Any:
        """The series of a label-less metric; a labelled one has none until ``labels()`` names it."""
        if self.labelnames:
            raise ValueError(f"{self.kind} metric is missing label values")
        return self._children[()]

    def _series(self) -> list[tuple[tuple[str, ...], Any]]:
        return list(self._children.items())

    def collect(self) -> Any:
        """Return the family as a prometheus-client metric family (imports prometheus-client)."""
        raise NotImplementedError


class Counter(_Family):
    """A counter: only goes up; exported as ``<name>_total`` (and ``<name>_created``)."""

    kind = "counter"
    suffixes = ("_total", "_created")

    def _child(self) -> _CounterChild:
        return _CounterChild()

    def inc(self, amount: float = 1) -> None:
        """Add ``amount`` to the label-less series."""
        self._single().inc(amount)

    def collect(self) -> Any:
        """Return the family as a prometheus-client ``CounterMetricFamily``."""
        from prometheus_client.core import CounterMetricFamily

        created = _created_series()
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for key, child in self._series():
            family.add_metric(key, child.value, created=child.created if created else None)
        return family


class Gauge(_Family):
    """A gauge: a value that is set."""

    kind = "gauge"

    def _child(self) -> _Child:
        return _Child()

    def set(self, value: float) -> None:
        """Set the label-less series."""
        self._single().set(value)

    def collect(self) -> Any:
        """Return the family as a prometheus-client ``GaugeMetricFamily``."""
        from prometheus_client.core import GaugeMetricFamily

        family = GaugeMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for key, child in self._series():
            family.add_metric(key, child.value)
        return family


class Histogram(_Family):
    """A histogram of observations in fixed buckets (``+Inf`` added), with their count and sum."""

    kind = "histogram"
    suffixes = ("_bucket", "_count", "_sum", "_created")

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Iterable[str] = (),
        *,
        buckets: Sequence[float],
        registry: Registry | None = None,
    ) -> None:
        bounds = [float(b) for b in buckets]
        if bounds != sorted(bounds):
            raise ValueError("Buckets not in sorted order")
        if bounds and bounds[-1] != math.inf:
            bounds.append(math.inf)
        if len(bounds) < 2:
            raise ValueError("Must have at least two buckets")
        if "le" in labelnames:
            raise ValueError("Invalid label metric name: le")
        self.bounds = tuple(bounds)
        super().__init__(name, documentation, labelnames, registry=registry)

    def _child(self) -> _HistogramChild:
        return _HistogramChild(self.bounds)

    def observe(self, amount: float) -> None:
        """Observe ``amount`` in the label-less series."""
        self._single().observe(amount)

    def collect(self) -> Any:
        """Return the family as a prometheus-client ``HistogramMetricFamily``, cumulative buckets."""
        from prometheus_client.core import HistogramMetricFamily
        from prometheus_client.samples import Sample
        from prometheus_client.utils import floatToGoString

        created = _created_series()
        les = [floatToGoString(b) for b in self.bounds]
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for key, child in self._series():
            total, sum_value, cumulative = 0, child.value, []
            for le, count in zip(les, child.counts[:], strict=True):
                total += count
                cumulative.append((le, total))
            family.add_metric(key, cumulative, sum_value if self.bounds[0] >= 0 else None)
            if created:
                labels = dict(zip(self.labelnames, key, strict=True))
                family.samples.append(Sample(self.name + "_created", labels, child.created))
        return family


class Registry:
    """The metric families of one owner, exported in order of registration."""

    def __init__(self) -> None:
        self._families: list[_Family] = []
        self._names: set[str] = set()

    def register(self, family: _Family) -> None:
        """Add ``family``; a name already taken (by a family or a series suffix) is refused."""
        names = {family.name, *(family.name + s for s in family.suffixes)}
        taken = names & self._names
        if taken:
            raise ValueError(f"Duplicated timeseries in CollectorRegistry: {taken}")
        self._names |= names
        self._families.append(family)

    def collect(self) -> Iterator[Any]:
        """Yield every family as prometheus-client metric families (what ``generate_latest`` reads)."""
        for family in list(self._families):
            yield family.collect()

    def render(self) -> bytes:
        """Return every family in the Prometheus text exposition format (prometheus-client's own)."""
        from prometheus_client import generate_latest

        return generate_latest(self)  # type: ignore[arg-type]  # any object with collect() will do


class _PoolSeries:
    """The children of one pool's per-message metrics, bound once so the send path skips label lookups."""

    __slots__ = ("bytes", "events", "events_per_message", "latency", "messages")

    def __init__(self, m: Metrics, resource: str) -> None:
        self.messages = m.lw_messages.labels(resource)
        self.bytes = m.lw_bytes.labels(resource)
        self.latency = m.send_latency.labels(resource)
        self.events = m.coalesced_events.labels(resource)
        self.events_per_message = m.events_per_message.labels(resource)


class Metrics:
    """Every densedev metric in one private registry, updated through plain methods."""

    def __init__(self, implementation: str | None = None, version: str = __version__) -> None:
        self.registry = Registry()
        r = self.registry
        self.build_info = Gauge(
            "densedev_build_info",
            "Always 1; labels say which densedev version and accelerator implementation run.",
            ["version", "implementation"],
            registry=r,
        )
        self.build_info.labels(version, implementation or accel.IMPLEMENTATION).set(1)

        # --- pools and health
        self.pool_devices = Gauge(
            "densedev_pool_devices",
            "Devices a pool advertises, by health as sent to the kubelet.",
            ["resource", "health"],
            registry=r,
        )
        self.pool_unhealthy = Gauge(
            "densedev_pool_unhealthy_devices",
            "Unhealthy devices of a pool by reason (a device with several reasons counts under each).",
            ["resource", "reason"],
            registry=r,
        )
        self.pool_registered = Gauge(
            "densedev_pool_registered",
            "1 while the pool is registered with the kubelet, else 0.",
            ["resource"],
            registry=r,
        )
        self.transitions = Counter(
            "densedev_health_transitions",
            "Device health changes reported to the kubelet, by the health changed to.",
            ["resource", "to"],
            registry=r,
        )

        # --- ListAndWatch
        self.lw_messages = Counter(
            "densedev_listandwatch_messages",
            "ListAndWatch messages sent (each one replaces the pool's whole device list).",
            ["resource"],
            registry=r,
        )
        self.lw_bytes = Counter(
            "densedev_listandwatch_bytes",
            "Bytes of ListAndWatch messages sent (the kubelet refuses a message over 4 MiB).",
            ["resource"],
            registry=r,
        )
        self.send_latency = Histogram(
            "densedev_event_to_send_seconds",
            "Time from the first event folded into a message to the message being sent.",
            ["resource"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.coalesced_events = Counter(
            "densedev_coalesced_events",
            "Events folded into ListAndWatch messages; divided by messages it is the coalescing ratio.",
            ["resource"],
            registry=r,
        )
        self.events_per_message = Histogram(
            "densedev_events_per_message",
            "Events folded into one ListAndWatch message.",
            ["resource"],
            buckets=EVENTS_BUCKETS,
            registry=r,
        )

        # --- discovery and event sources
        self.scans = Counter("densedev_scans", "Full sysfs scans.", registry=r)
        self.scan_duration = Histogram(
            "densedev_scan_duration_seconds",
            "Duration of a full sysfs scan.",
            buckets=SCAN_BUCKETS,
            registry=r,
        )
        self.scan_devices = Gauge("densedev_scan_devices", "Devices the last scan found.", registry=r)
        self.scan_warnings = Counter(
            "densedev_scan_skipped_devices",
            "Devices a scan skipped because their sysfs entry vanished or was half-written.",
            registry=r,
        )
        self.netlink_events = Counter(
            "densedev_netlink_events",
            "Netlink messages received, by source (link: rtnetlink links; uevent: kernel uevents).",
            ["source"],
            registry=r,
        )
        self.netlink_overruns = Counter(
            "densedev_netlink_overruns",
            "Netlink receive-buffer overruns (ENOBUFS: events were lost, a resync follows).",
            ["source"],
            registry=r,
        )
        self.netlink_reopens = Counter(
            "densedev_netlink_reopens",
            "Netlink sockets closed and opened again, by source and reason (overrun, error, stalled).",
            ["source", "reason"],
            registry=r,
        )
        self.netlink_malformed = Counter(
            "densedev_netlink_malformed",
            "Netlink datagrams that could not be decoded (logged, skipped, and a resync follows).",
            ["source"],
            registry=r,
        )
        self.netlink_resync = Histogram(
            "densedev_netlink_resync_seconds",
            "From a lost netlink event (overrun, socket error, stall) to the completed resync "
            "(link: the new socket's dump read; uevent: the rescan it asked for applied).",
            ["source"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self.resyncs = Counter(
            "densedev_resyncs", "Full resynchronisations of device state, by reason.", ["reason"], registry=r
        )

        # --- kubelet
        self.registrations = Counter(
            "densedev_kubelet_registrations",
            "Register calls to the kubelet, by result (the first and every re-registration).",
            ["resource", "result"],
            registry=r,
        )
        self.rpc_calls = Counter(
            "densedev_plugin_rpc_calls",
            "DevicePlugin calls the kubelet made, by method.",
            ["resource", "method"],
            registry=r,
        )
        self.rpc_errors = Counter(
            "densedev_plugin_rpc_errors",
            "DevicePlugin calls answered with an error, by method and gRPC status code name.",
            ["resource", "method", "code"],
            registry=r,
        )
        self.rpc_latency = Histogram(
            "densedev_plugin_rpc_duration_seconds",
            "Time to answer a DevicePlugin call (the kubelet has no timeout; pod admission waits).",
            ["resource", "method"],
            buckets=RPC_BUCKETS,
            registry=r,
        )

        # --- config
        self.task_restarts = Counter(
            "densedev_task_restarts",
            "Daemon loops restarted after an exception (each is a bug worth reporting), by task.",
            ["task"],
            registry=r,
        )
        self.reloads = Counter(
            "densedev_config_reloads", "Config reload attempts, by result.", ["result"], registry=r
        )
        self.config_last_ok = Gauge(
            "densedev_config_last_reload_successful",
            "1 if the last config reload was applied, 0 if it was refused (the last good config stays).",
            registry=r,
        )
        self.config_last_ok.set(1)
        self.config_last_time = Gauge(
            "densedev_config_last_reload_timestamp_seconds",
            "Unix time of the last config reload attempt.",
            registry=r,
        )

        # --- DRA ResourceSlice writes that did not go through (each is retried after a backoff)
        self.dra_slice_conflicts = Counter(
            "densedev_dra_slice_write_conflicts",
            "ResourceSlice writes the API server refused with 409 Conflict (another writer), by driver.",
            ["driver"],
            registry=r,
        )
        self.dra_slice_timeouts = Counter(
            "densedev_dra_slice_write_timeouts",
            "ResourceSlice writes cut for want of an answer within the write timeout, by driver.",
            ["driver"],
            registry=r,
        )

        # --- DRA claims' status.devices (issue 25 §3): best-effort writes after Prepare / at Unprepare
        self.dra_claim_status_writes = Counter(
            "densedev_dra_claim_status_writes",
            "ResourceClaim status writes that went through, by driver and op (report after Prepare, "
            "clear at Unprepare).",
            ["driver", "op"],
            registry=r,
        )
        self.dra_claim_status_failures = Counter(
            "densedev_dra_claim_status_failures",
            "ResourceClaim status attempts that failed, by driver and reason (conflict and error are "
            "retried; refused, dropped, gave_up and bug are not).",
            ["driver", "reason"],
            registry=r,
        )
        self.dra_claim_status_pending = Gauge(
            "densedev_dra_claim_status_pending",
            "Claims whose status write is queued, in flight or waiting to retry, by driver.",
            ["driver"],
            registry=r,
        )

        self.loop_lag = Gauge(
            "densedev_event_loop_lag_seconds",
            "How late the event loop ran the health monitor's last tick.",
            registry=r,
        )

        self._pools: dict[str, _PoolSeries] = {}
        self._reasons: dict[str, set[str]] = {}
        # Pre-create the label-less and result series so a scrape shows zeros before the first event.
        for result in ("success", "failure"):
            self.reloads.labels(result)

    # ----------------------------------------------------------------------------------- pools
    def _pool(self, resource: str) -> _PoolSeries:
        series = self._pools.get(resource)
        if series is None:
            series = self._pools[resource] = _PoolSeries(self, resource)
        return series

    def set_pool_devices(
        self, resource: str, healthy: int, unhealthy: int, reasons: Mapping[str, int] | None = None
    ) -> None:
        """Set a pool's device counts by health and its unhealthy devices by reason (absent ones → gone)."""
        self.pool_devices.labels(resource, Health.HEALTHY).set(healthy)
        self.pool_devices.labels(resource, Health.UNHEALTHY).set(unhealthy)
        reasons = reasons or {}
        old = self._reasons.get(resource, set())
        for reason in old - reasons.keys():
            # Removed, not zeroed: reasons are open-ended and each stale zero would live until restart.
            with contextlib.suppress(KeyError):
                self.pool_unhealthy.remove(resource, reason)
        for reason, count in reasons.items():
            self.pool_unhealthy.labels(resource, reason).set(count)
        self._reasons[resource] = set(reasons)
        self._pool(resource)

    def record_transitions(self, resource: str, to_unhealthy: int = 0, to_healthy: int = 0) -> None:
        """Count devices of a pool that turned Unhealthy and that turned Healthy in one update."""
        if to_unhealthy:
            self.transitions.labels(resource, Health.UNHEALTHY).inc(to_unhealthy)
        if to_healthy:
            self.transitions.labels(resource, Health.HEALTHY).inc(to_healthy)

    def record_send(self, resource: str, nbytes: int, latency_s: float | None, events: int = 0) -> None:
        """Count one ListAndWatch message of ``nbytes``; ``latency_s`` is None for sends no event caused."""
        series = self._pool(resource)
        series.messages.inc()
        series.bytes.inc(nbytes)
        if latency_s is not None:
            series.latency.observe(latency_s)
        if events:
            series.events.inc(events)
            series.events_per_message.observe(events)

    def set_registered(self, resource: str, registered: bool) -> None:
        """Mark whether a pool is registered with the kubelet now."""
        self.pool_registered.labels(resource).set(1 if registered else 0)

    def record_registration(self, resource: str, ok: bool) -> None:
        """Count a Register call to the kubelet and set the pool's registered gauge from its result."""
        self.registrations.labels(resource, "success" if ok else "failure").inc()
        self.set_registered(resource, ok)

    def remove_pool(self, resource: str) -> None:
        """Drop every series of a pool a config reload removed, so it does not linger at its last value."""
        self.remove_pools((resource,))

    def remove_pools(self, resources: Collection[str]) -> None:
        """Drop every series of the pools a config reload removed, walking each family once."""
        if not resources:
            return
        gone = frozenset(resources)
        for name in gone:
            self._pools.pop(name, None)
            self._reasons.pop(name, None)
        for metric in (
            self.pool_devices,
            self.pool_unhealthy,
            self.pool_registered,
            self.transitions,
            self.lw_messages,
            self.lw_bytes,
            self.send_latency,
            self.coalesced_events,
            self.events_per_message,
            self.registrations,
            self.rpc_calls,
            self.rpc_errors,
            self.rpc_latency,
        ):
            metric.remove_where("resource", gone)

    # ----------------------------------------------------------------------------------- RPCs
    def observe_rpc(self, resource: str, method: str, seconds: float, error: str | None = None) -> None:
        """Count one DevicePlugin call, its latency and, if ``error`` names a status code, the error."""
        self.rpc_calls.labels(resource, method).inc()
        self.rpc_latency.labels(resource, method).observe(seconds)
        if error is not None:
            self.rpc_errors.labels(resource, method, error).inc()

    def observe_allocate(self, resource: str, seconds: float, error: str | None = None) -> None:
        """Count one Allocate call (``error``: the gRPC status code name, e.g. ``"INVALID_ARGUMENT"``)."""
        self.observe_rpc(resource, ALLOCATE, seconds, error)

    def observe_preferred(self, resource: str, seconds: float, error: str | None = None) -> None:
        """Count one GetPreferredAllocation call."""
        self.observe_rpc(resource, PREFERRED, seconds, error)

    # ----------------------------------------------------------------------------------- sources
    def observe_scan(self, seconds: float, devices: int | None = None, skipped: int = 0) -> None:
        """Count one full scan, its duration, the devices found and those skipped with a warning."""
        self.scans.inc()
        self.scan_duration.observe(seconds)
        if devices is not None:
            self.scan_devices.set(devices)
        if skipped:
            self.scan_warnings.inc(skipped)

    def record_netlink(self, source: str, messages: int = 1) -> None:
        """Count netlink messages received from ``source`` (``"link"`` or ``"uevent"``)."""
        self.netlink_events.labels(source).inc(messages)

    def record_overrun(self, source: str) -> None:
        """Count a netlink overrun (ENOBUFS) on ``source``."""
        self.netlink_overruns.labels(source).inc()

    def record_reopen(self, source: str, reason: str) -> None:
        """Count a netlink socket of ``source`` closed and reopened for ``reason``."""
        self.netlink_reopens.labels(source, reason).inc()

    def record_malformed(self, source: str) -> None:
        """Count a netlink datagram from ``source`` that could not be decoded."""
        self.netlink_malformed.labels(source).inc()

    def observe_netlink_resync(self, source: str, seconds: float) -> None:
        """Record how long ``source`` took from a lost event to its completed resync."""
        self.netlink_resync.labels(source).observe(seconds)

    def record_resync(self, reason: str) -> None:
        """Count a full resync (``"overrun"``, ``"reconcile"``, ``"kubelet-restart"``, ...)."""
        self.resyncs.labels(reason).inc()

    def record_task_restart(self, task: str) -> None:
        """Count a daemon loop restarted after an exception."""
        self.task_restarts.labels(task).inc()

    def record_slice_conflict(self, driver: str) -> None:
        """Count a ResourceSlice write of ``driver`` refused with 409 Conflict."""
        self.dra_slice_conflicts.labels(driver).inc()

    def record_slice_timeout(self, driver: str) -> None:
        """Count a ResourceSlice write of ``driver`` cut by the write timeout."""
        self.dra_slice_timeouts.labels(driver).inc()

    def record_reload(self, ok: bool, when: float | None = None) -> None:
        """Count a config reload attempt; a refused one sets the last-reload-successful gauge to 0."""
        self.reloads.labels("success" if ok else "failure").inc()
        self.config_last_ok.set(1 if ok else 0)
        self.config_last_time.set(time.time() if when is None else when)

    def render(self) -> bytes:
        """Return the registry in the Prometheus text exposition format."""
        return self.registry.render()


class MeteredService:
    """Wraps a pool's allocator to time every kubelet call and count errors in the metrics."""

    def __init__(self, resource: str, inner: PoolService, metrics: Metrics) -> None:
        self.resource = resource
        self.inner = inner
        self.metrics = metrics

    def options(self) -> tuple[bool, bool]:
        """Return the pool's options (read by the kubelet once per registration)."""
        return self.inner.options()

    def allocate(self, ids: Sequence[str]) -> api_pb2.ContainerAllocateResponse:
        """Answer Allocate, timed."""
        return self._timed(ALLOCATE, self.inner.allocate, ids)

    def preferred(self, available: Sequence[str], must_include: Sequence[str], size: int) -> list[str]:
        """Answer GetPreferredAllocation, timed."""
        return self._timed(PREFERRED, self.inner.preferred, available, must_include, size)

    def prestart(self, ids: Sequence[str]) -> None:
        """Answer PreStartContainer, timed."""
        self._timed(PRESTART, self.inner.prestart, ids)

    def _timed(self, method: str, call: Callable[..., T], *args: Any) -> T:
        """Run one kubelet call, recording its latency and, if it fails, the status it is answered with."""
        t0 = time.perf_counter()
        try:
            result = call(*args)
        except RequestError as exc:
            # The status the server answers with; imported here, as only a refused call needs it (and
            # it brings in grpc).
            from ..kubelet.server import status_of

            self.metrics.observe_rpc(self.resource, method, time.perf_counter() - t0, status_of(exc).name)
            raise
        except Exception:
            self.metrics.observe_rpc(self.resource, method, time.perf_counter() - t0, "INTERNAL")
            raise
        self.metrics.observe_rpc(self.resource, method, time.perf_counter() - t0)
        return result


# ------------------------------------------------------------------------------------- HTTP


def parse_addr(addr: str) -> tuple[str, int]:
    """Split ``HOST:PORT`` (``:9477`` = every address, ``[::1]:9477`` for IPv6) into host and port."""
    text = addr.strip()
    if not text:
        raise ValueError("metrics address is empty; expected HOST:PORT such as :9477 or 127.0.0.1:9477")
    if text.startswith("["):
        end = text.find("]")
        if end < 0 or text[end + 1 : end + 2] != ":":
            raise ValueError(f"metrics address {addr!r}: an IPv6 host must look like [::1]:9477")
        host, port_text = text[1:end], text[end + 2 :]
        if not host:
            raise ValueError(f"metrics address {addr!r}: empty IPv6 host inside []")
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            raise ValueError(f"metrics address {addr!r} has no port; expected HOST:PORT such as :9477")
        if ":" in host:
            raise ValueError(f"metrics address {addr!r}: put an IPv6 host in brackets, e.g. [::1]:9477")
    if not port_text.isdigit():
        raise ValueError(f"metrics address {addr!r}: port {port_text!r} is not a number")
    port = int(port_text)
    if port > 65535:
        raise ValueError(f"metrics address {addr!r}: port {port} is out of range 0-65535")
    return host, port


class LoopLag:
    """The most recent and the worst recent lateness of the event loop, seen by a periodic tick."""

    # A plain class, not a dataclass: this mutable tick state is never compared or printed, and a
    # dataclass statement costs every start ~0.4 ms (3.11 execs each generated method).
    __slots__ = ("last", "ticks", "worst", "worst_at")

    def __init__(self) -> None:
        self.last = 0.0
        self.worst = 0.0
        self.worst_at = 0.0
        self.ticks = 0


_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    500: "Internal Server Error",
    503: "Service Unavailable",
}
_MAX_REQUEST = 8192  # request line and headers; we serve three fixed paths, nothing needs more
_REFUSE_WAIT_S = 0.5  # what a connection beyond max_connections has to send its request
# The kernel's queue of connections not yet accepted (capped by net.core.somaxconn): where clients
# beyond every cap wait, costing the daemon nothing.
_BACKLOG = 1024


class MetricsServer:
    """Serves ``/metrics``, ``/healthz`` and ``/readyz`` over HTTP/1.1 on the running event loop.

    Anyone who reaches the address may connect, so every resource a client can take is bounded (issue
    23, item 4: 400 clients looping on ``/metrics`` made a PF flip reach the kubelet 30x later):

    * renders: at most one at a time, in ``Work.METRICS``'s thread; every scrape that arrives while it
      runs waits for it and gets its body, and a body younger than ``min_render_interval_s`` is served
      as it is.  A render is pure Python under the GIL (~10 ms for 16 busy pools, ~100 ms for 64 on a
      2-core VM, bench_metrics.py) and takes that time from the loop whichever thread runs it, so the
      interval, not the thread, is what bounds its share of the loop: 1 s allows 1-10 % however many
      clients scrape.  Prometheus scrapes every 15-60 s, so a body at most ~1 s old is as fresh as any
      scrape can tell;
    * scrapes waiting on a render: at most ``max_waiting_scrapes``; more get 503;
    * connections: at most ``max_connections`` are served; up to ``max_extra_connections`` more (and
      never more than half the process's descriptor limit, so the kubelet's sockets and the daemon's
      files always have theirs) have half a second to send their request and get 503 unless they ask
      for ``/healthz`` or ``/readyz``; beyond both, nothing more is accepted until one closes (clients
      wait in the kernel's queue);
    * answers to ``/metrics`` not waiting on a render (the kept body, and both 503s): at most
      ``scrape_answers_per_s`` (100, bursts of 20), the others held in turn.  A client looping on the
      endpoint is only as fast as its answers: answered at once, 400 of them made 2,000+ requests a
      second and took a core between them and the daemon; paced, they sit idle on open sockets.
      Prometheus needs one answer per target every 15-60 s;
    * a client's time: its request line and headers must arrive within ``read_timeout_s`` (the whole
      head, not each read, so trickling a byte a second does not stretch it), and its answer must be
      sent (after its turn or its render) and taken within ``write_timeout_s`` of it; then the
      connection is cut.

    Each connection is a protocol (``_Connection``) driven by the loop's callbacks, not a task with
    streams: a scrape served from the kept body costs the loop three callbacks, so a flood of them
    leaves it the time its health messages need.  ``/healthz`` and ``/readyz`` are answered as soon as
    their request is in: never behind a render, the scrape caps or the pacing; a probe waits only when
    ``max_connections`` + ``max_extra_connections`` clients are all inside their deadlines.
    """

    def __init__(
        self,
        metrics: Metrics,
        ready: Callable[[], tuple[bool, str]],
        host: str,
        port: int,
        *,
        lag_interval_s: float = 1.0,
        max_lag_s: float = 5.0,
        lag_window_s: float = 30.0,
        read_timeout_s: float = 5.0,
        write_timeout_s: float = 10.0,
        max_connections: int = 64,
        max_extra_connections: int = 1024,
        max_waiting_scrapes: int = 16,
        min_render_interval_s: float = 1.0,
        scrape_answers_per_s: float = 100.0,
        scrape_answer_burst: int = 20,
    ) -> None:
        self.metrics = metrics
        self.ready = ready
        self.host = host
        self.port = port  # the bound port after start() (0 asks for an ephemeral one)
        self.lag = LoopLag()
        self._lag_interval = lag_interval_s
        self._max_lag = max_lag_s
        self._lag_window = lag_window_s
        self.read_timeout = read_timeout_s
        self.write_timeout = write_timeout_s
        self._max_connections = max_connections
        self._max_extra = max_extra_connections
        self._max_waiting = max_waiting_scrapes
        self._min_interval = min_render_interval_s
        self._pace = scrape_answers_per_s
        self._burst = float(scrape_answer_burst)
        self._tokens = self._burst
        self._tokens_at = -math.inf
        self._held: deque[tuple[_Connection, int, bytes, bool]] = deque()
        self._pacer: asyncio.TimerHandle | None = None
        self._sockets: list[socket.socket] = []
        self._acceptors: list[asyncio.Task[None]] = []
        self._room = asyncio.Event()
        self._monitor: asyncio.Task[None] | None = None
        self._connections: set[_Connection] = set()  # every open one, served or being refused
        self._serving = 0
        self._refusing = 0
        self._refused_logged = -math.inf
        # The last rendered exposition and when it was finished (loop time); the render running and
        # the scrapes waiting for it.
        self._body: bytes | None = None
        self._body_at = -math.inf
        self._render: asyncio.Future[bytes] | None = None
        self._waiters: list[tuple[_Connection, bool]] = []

    @property
    def _waiting(self) -> int:
        return len(self._waiters)

    async def start(self) -> None:
        """Bind and start serving, and start the loop-lag monitor."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY:
            self._max_extra = max(0, min(self._max_extra, soft // 2 - self._max_connections))
        self._sockets = await self._listen()
        self.port = self._sockets[0].getsockname()[1]
        self._acceptors = [
            asyncio.create_task(self._accept(sock), name="metrics-accept") for sock in self._sockets
        ]
        self._monitor = asyncio.create_task(self._watch_lag(), name="metrics-loop-lag")
        log.info("metrics and health endpoints on %s:%d", self.host or "*", self.port)

    async def _listen(self) -> list[socket.socket]:
        """Bind the listening sockets: every address for an empty host, else each the host resolves to."""
        if not self.host:
            # Every address, IPv4 and IPv6, as ":9477" means to Go and Prometheus users.
            if socket.has_dualstack_ipv6():
                return [_bind(("::", self.port), socket.AF_INET6, dualstack=True)]
            return [_bind(("0.0.0.0", self.port), socket.AF_INET)]
        # A name may need a resolver: off the loop, with the other start-up reads.
        infos = await workers.run(
            Work.CONFIG,
            socket.getaddrinfo,
            self.host,
            self.port,
            0,
            socket.SOCK_STREAM,
            0,
            socket.AI_PASSIVE,
        )
        socks: list[socket.socket] = []
        try:
            for family, _, _, _, addr in dict.fromkeys(infos):
                socks.append(_bind(addr, family))
        except OSError:
            for sock in socks:
                sock.close()
            raise
        return socks

    async def _accept(self, sock: socket.socket) -> None:
        """Accept connections while there is room for them; meanwhile they wait in the kernel's queue."""
        loop = asyncio.get_running_loop()
        while True:
            while len(self._connections) >= self._max_connections + self._max_extra:
                self._room.clear()
                await self._room.wait()
            try:
                conn, _ = await loop.sock_accept(sock)
            except OSError as exc:  # out of descriptors (EMFILE) and the like: try again shortly
                log.warning("metrics endpoint cannot accept a connection: %s", exc)
                await asyncio.sleep(0.1)
                continue
            try:
                await loop.connect_accepted_socket(lambda: _Connection(self), conn)
            except OSError:
                conn.close()  # reset before it could be served
            except Exception:  # the endpoint must outlive any one connection
                conn.close()
                log.exception("metrics endpoint failed to take a connection")

    async def stop(self) -> None:
        """Stop listening, drop open connections, stop waiting for a render, end the monitor."""
        for task in self._acceptors:
            task.cancel()
        for task in self._acceptors:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._acceptors = []
        for sock in self._sockets:
            sock.close()
        self._sockets = []
        if self._pacer is not None:
            self._pacer.cancel()
            self._pacer = None
        self._held.clear()
        if self._render is not None:
            self._render.cancel()  # the thread finishes its render unobserved
            self._render = None
        self._waiters.clear()
        for conn in list(self._connections):
            conn.drop()
        if self._monitor is not None:
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor
            self._monitor = None

    # ----------------------------------------------------------------------------------- health
    async def _watch_lag(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self._lag_interval
            await asyncio.sleep(self._lag_interval)
            now = loop.time()
            self._note_lag(max(0.0, now - due), now)

    def _note_lag(self, lag: float, now: float) -> None:
        state = self.lag
        state.last = lag
        state.ticks += 1
        if lag >= state.worst or now - state.worst_at > self._lag_window:
            state.worst, state.worst_at = lag, now
        self.metrics.loop_lag.set(lag)

    def health(self) -> tuple[bool, str]:
        """Return whether the loop is healthy: the lag monitor runs and no recent tick was too late."""
        if self._monitor is None or self._monitor.done():
            return False, "event loop monitor is not running"
        now = asyncio.get_running_loop().time()
        worst = self.lag.worst if now - self.lag.worst_at <= self._lag_window else self.lag.last
        if worst > self._max_lag:
            return (
                False,
                f"event loop lagged {worst:.3f}s in the last {self._lag_window:g}s (max {self._max_lag:g}s)",
            )
        return True, f"ok, event loop lag {self.lag.last:.4f}s"

    # ----------------------------------------------------------------------------------- connections
    def _opened(self, conn: _Connection) -> bool:
        """Admit a new connection; False: it is beyond the cap and is to be refused (or was dropped)."""
        self._connections.add(conn)
        if self._serving < self._max_connections:
            self._serving += 1
            return True
        now = asyncio.get_running_loop().time()
        if now - self._refused_logged >= 60:
            self._refused_logged = now
            log.warning(
                "metrics endpoint refusing connections: %d open (max %d); more refusals are not logged "
                "for a minute",
                self._serving,
                self._max_connections,
            )
        self._refusing += 1
        return False

    def _closed(self, conn: _Connection, admitted: bool) -> None:
        self._connections.discard(conn)
        if admitted:
            self._serving -= 1
        else:
            self._refusing -= 1
        self._room.set()

    def _dispatch(self, conn: _Connection, head: bytes, admitted: bool) -> None:
        """Answer one request head, now or when the render it waits for ends; a connection beyond the
        cap (not ``admitted``) is answered only on the health paths."""
        request_line = head.split(b"\r\n", 1)[0].decode("latin-1")
        parts = request_line.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            conn.respond(400, b"malformed request line\n", head_only=False)
            return
        method, target, _ = parts
        path = target.split("?", 1)[0]
        if method not in ("GET", "HEAD"):
            conn.respond(405, b"only GET and HEAD\n", head_only=False, allow=True)
            return
        head_only = method == "HEAD"
        if path == "/healthz":
            ok, detail = self.health()
            conn.respond(200 if ok else 503, detail.encode() + b"\n", head_only)
        elif path == "/readyz":
            try:
                ok, detail = self.ready()
            except Exception as exc:  # a broken readiness callable means "not ready", not a crash
                ok, detail = False, f"readiness check failed: {exc!r}"
            conn.respond(200 if ok else 503, detail.encode() + b"\n", head_only)
        elif not admitted:
            self._paced(conn, 503, b"too many connections\n", head_only)
        elif path == "/metrics":
            self._scrape(conn, head_only)
        else:
            conn.respond(404, b"not found; try /metrics, /healthz, /readyz\n", head_only)

    # ----------------------------------------------------------------------------------- renders
    def _scrape(self, conn: _Connection, head_only: bool) -> None:
        """Answer a scrape with the kept body, or queue it for the running render (starting one)."""
        loop = asyncio.get_running_loop()
        if self._body is not None and loop.time() - self._body_at < self._min_interval:
            self._paced(conn, 200, self._body, head_only)
            return
        if len(self._waiters) >= self._max_waiting:
            self._paced(conn, 503, b"too many scrapes waiting for a render\n", head_only)
            return
        self._waiters.append((conn, head_only))
        if self._render is None:
            # Rendering is pure Python and grows with pools x histogram buckets: in the metrics thread,
            # the GIL's switch interval (5 ms) bounds how long the loop waits behind it at a time.
            self._render = asyncio.ensure_future(workers.run(Work.METRICS, self.metrics.render))
            self._render.add_done_callback(self._rendered)

    def _rendered(self, render: asyncio.Future[bytes]) -> None:
        """Hand the render's body (or its failure, logged once) to every scrape that waited for it."""
        if render is not self._render:
            return  # cancelled by stop(), which dropped the waiting connections
        self._render = None
        waiters, self._waiters = self._waiters, []
        exc = render.exception()
        if exc is not None:
            log.error("rendering /metrics failed", exc_info=exc)
            for conn, head_only in waiters:
                conn.respond(500, b"rendering the metrics failed; see the daemon's log\n", head_only)
            return
        body = render.result()
        self._body, self._body_at = body, asyncio.get_running_loop().time()
        for conn, head_only in waiters:
            conn.respond(200, body, head_only, CONTENT_TYPE)

    def _paced(self, conn: _Connection, status: int, body: bytes, head_only: bool) -> None:
        """Answer a scrape now if the pace allows, else hold it until its turn."""
        if not self._held and self._take():
            self._answer(conn, status, body, head_only)
            return
        self._held.append((conn, status, body, head_only))
        if self._pacer is None:
            self._pacer = asyncio.get_running_loop().call_later(1 / self._pace, self._release)

    @staticmethod
    def _answer(conn: _Connection, status: int, body: bytes, head_only: bool) -> None:
        conn.respond(status, body, head_only, CONTENT_TYPE if status == 200 else None, retry=status == 503)

    def _take(self) -> bool:
        """Take one answer's token from the bucket (refilled at the pace, holding a burst at most)."""
        now = asyncio.get_running_loop().time()
        self._tokens = min(self._burst, self._tokens + (now - self._tokens_at) * self._pace)
        self._tokens_at = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True

    def _release(self) -> None:
        """Answer the held scrapes whose turn has come (those whose clients left take no turn)."""
        self._pacer = None
        while self._held:
            conn, status, body, head_only = self._held[0]
            if not conn.open:
                self._held.popleft()
                continue
            if not self._take():
                break
            self._held.popleft()
            self._answer(conn, status, body, head_only)
        if self._held:
            self._pacer = asyncio.get_running_loop().call_later(1 / self._pace, self._release)

    def _forget(self, conn: _Connection) -> None:
        """Stop holding a place in the render queue for a connection that went away."""
        self._waiters = [w for w in self._waiters if w[0] is not conn]


def _bind(addr: Any, family: int, dualstack: bool = False) -> socket.socket:
    """A non-blocking listening socket on ``addr``; a failure says which address, as asyncio's does."""
    try:
        sock = socket.create_server(addr, family=family, backlog=_BACKLOG, dualstack_ipv6=dualstack)
    except OSError as exc:
        reason = (exc.strerror or str(exc)).lower()
        raise OSError(exc.errno, f"error while attempting to bind on address {addr!r}: {reason}") from None
    sock.setblocking(False)
    return sock


class _Connection(asyncio.Protocol):
    """One client connection of ``MetricsServer``: one request head in, one answer out, then closed."""

    __slots__ = ("_admitted", "_buf", "_done", "_server", "_timer", "_transport")

    def __init__(self, server: MetricsServer) -> None:
        self._server = server
        self._transport: asyncio.Transport | None = None
        self._buf = b""
        self._admitted = False  # under the cap (else only a health path is answered)
        self._done = False  # the head was read (or the connection refused): nothing more is taken in
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport; uvloop's provide its methods without deriving from asyncio.Transport.
        self._transport = transport = cast(asyncio.Transport, transport)
        server = self._server
        loop = asyncio.get_running_loop()
        self._admitted = server._opened(self)
        # One deadline for the whole head: a client trickling a byte at a time is cut all the same.
        # One beyond the cap gets less: a probe or a scraper sends its request at once.
        wait = server.read_timeout if self._admitted else min(server.read_timeout, _REFUSE_WAIT_S)
        self._timer = loop.call_later(wait, self.drop)

    def data_received(self, data: bytes) -> None:
        if self._done:
            return  # one request per connection; whatever follows its head is not read
        self._buf += data
        end = self._buf.find(b"\r\n\r\n", 0, _MAX_REQUEST + 4)
        if end < 0:
            if len(self._buf) >= _MAX_REQUEST + 4:
                self.respond(400, b"request header too large\n", head_only=False)
            return
        self._done = True
        if self._timer is not None:
            # The head is in; its answer may wait its turn or a render, for a while only.
            self._timer.cancel()
            self._timer = asyncio.get_running_loop().call_later(self._server.write_timeout, self.drop)
        try:
            self._server._dispatch(self, self._buf[:end], self._admitted)
        except Exception:  # never let a request take down the daemon, nor leave its client hanging
            log.exception("metrics endpoint failed a request")
            self.respond(500, b"internal error; see the daemon's log\n", head_only=False)

    def eof_received(self) -> bool:
        # A client may half-close after its request and still read the answer (a render may be
        # running); one that half-closes before a whole head has nothing to be answered.
        return self._done

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._transport is None:
            return
        self._transport = None
        if self._done:
            self._server._forget(self)
        self._server._closed(self, self._admitted)

    @property
    def open(self) -> bool:
        """Whether the client is still there to be answered."""
        return self._transport is not None and not self._transport.is_closing()

    def drop(self) -> None:
        """Cut the connection now, unanswered or with its answer half sent (its deadline passed)."""
        if self._transport is not None:
            self._transport.abort()

    def respond(
        self,
        status: int,
        body: bytes,
        head_only: bool,
        content_type: str | None = None,
        allow: bool = False,
        retry: bool = False,
    ) -> None:
        """Send one answer and close (``retry``: a 503 that says when to come back)."""
        headers = [
            f"HTTP/1.1 {status} {_REASONS[status]}",
            f"Content-Type: {content_type or 'text/plain; charset=utf-8'}",
            f"Content-Length: {len(body)}",
            "Cache-Control: no-store",
            # One request per connection: scrapers and probes open a connection each time anyway, and
            # it keeps this server free of keep-alive state.
            "Connection: close",
        ]
        if allow:
            headers.append("Allow: GET, HEAD")
        if retry:
            headers.append("Retry-After: 1")
        head = ("\r\n".join(headers) + "\r\n\r\n").encode("latin-1")
        self._done = True
        self._send([head] if head_only else [head, body])

    def _send(self, data: list[bytes]) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            return  # gone while its render ran
        transport.writelines(data)
        transport.close()  # after what was written is sent
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if transport.get_write_buffer_size():
            # What the kernel would not take yet waits for the client to read it, for a while only.
            self._timer = asyncio.get_running_loop().call_later(self._server.write_timeout, self.drop)
