"""Metrics scraped over real HTTP on 127.0.0.1, the health and readiness endpoints, and parse_addr."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from densedev import accel
from densedev.ops.metrics import ALLOCATE, PREFERRED, Metrics, MetricsServer, parse_addr

POOL_A = "intel.com/sriov_a"
POOL_B = "nvidia.com/rdma_b"


def get(port: int, path: str, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    """One request with the standard library's HTTP client (run in a thread: it blocks)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, path)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


async def fetch(port: int, path: str, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    return await asyncio.to_thread(get, port, path, method)


async def raw(port: int, data: bytes) -> bytes:
    """Send raw bytes, half-close, and read the whole answer (the server closes after one response)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    writer.write_eof()
    await writer.drain()
    answer = await reader.read()
    writer.close()
    await writer.wait_closed()
    return answer


def samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Parse an exposition into {(sample name, sorted labels): value}."""
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(text: bytes, name: str, **labels: str) -> float:
    return samples(text)[(name, tuple(sorted(labels.items())))]


@contextlib.asynccontextmanager
async def serving(
    metrics: Metrics,
    ready: Callable[[], tuple[bool, str]] = lambda: (True, "all pools registered"),
    **kw: Any,
) -> AsyncIterator[MetricsServer]:
    """A metrics server on an ephemeral port of 127.0.0.1, stopped afterwards (stop is idempotent)."""
    server = MetricsServer(metrics, ready, "127.0.0.1", 0, **kw)
    await server.start()
    try:
        assert server.port != 0
        yield server
    finally:
        await server.stop()


async def test_scrape_reports_what_the_daemon_recorded() -> None:
    m = Metrics()
    m.set_pool_devices(POOL_A, healthy=250, unhealthy=6, reasons={"pf_link_down": 4, "driver": 2})
    m.set_pool_devices(POOL_B, healthy=8, unhealthy=0, reasons={})
    m.record_transitions(POOL_A, to_unhealthy=6, to_healthy=2)
    m.record_send(POOL_A, 12_000, 0.0007, events=6)
    m.record_send(POOL_A, 12_000, 0.003, events=2)
    m.record_send(POOL_A, 11_000, None)  # the first message of a stream has no causing event
    m.observe_scan(0.012, devices=4096, skipped=1)
    m.record_netlink("link", 3)
    m.record_netlink("uevent")
    m.record_overrun("uevent")
    m.record_resync("overrun")
    m.record_registration(POOL_A, ok=True)
    m.record_registration(POOL_B, ok=False)
    m.observe_allocate(POOL_A, 0.0004)
    m.observe_allocate(POOL_A, 0.0002, error="INVALID_ARGUMENT")
    m.observe_preferred(POOL_A, 0.0011)
    m.record_reload(True)
    m.record_reload(False)

    async with serving(m) as server:
        status, headers, body = await fetch(server.port, "/metrics")
    assert status == 200
    assert headers["content-type"].startswith("text/plain; version=0.0.4")
    assert int(headers["content-length"]) == len(body)
    assert value(body, "densedev_build_info", version="0.1.0", implementation=accel.IMPLEMENTATION) == 1
    assert value(body, "densedev_pool_devices", resource=POOL_A, health="Healthy") == 250
    assert value(body, "densedev_pool_devices", resource=POOL_A, health="Unhealthy") == 6
    assert value(body, "densedev_pool_unhealthy_devices", resource=POOL_A, reason="pf_link_down") == 4
    assert value(body, "densedev_pool_unhealthy_devices", resource=POOL_A, reason="driver") == 2
    assert value(body, "densedev_pool_devices", resource=POOL_B, health="Healthy") == 8
    assert value(body, "densedev_health_transitions_total", resource=POOL_A, to="Unhealthy") == 6
    assert value(body, "densedev_health_transitions_total", resource=POOL_A, to="Healthy") == 2
    assert value(body, "densedev_listandwatch_messages_total", resource=POOL_A) == 3
    assert value(body, "densedev_listandwatch_bytes_total", resource=POOL_A) == 35_000
    # Two latencies observed: 0.7 ms lands in the 1 ms bucket, 3 ms only from the 5 ms bucket on.
    assert value(body, "densedev_event_to_send_seconds_count", resource=POOL_A) == 2
    assert value(body, "densedev_event_to_send_seconds_bucket", resource=POOL_A, le="0.0005") == 0
    assert value(body, "densedev_event_to_send_seconds_bucket", resource=POOL_A, le="0.001") == 1
    assert value(body, "densedev_event_to_send_seconds_bucket", resource=POOL_A, le="0.0025") == 1
    assert value(body, "densedev_event_to_send_seconds_bucket", resource=POOL_A, le="0.005") == 2
    assert value(body, "densedev_event_to_send_seconds_sum", resource=POOL_A) == pytest.approx(0.0037)
    # Coalescing ratio = events / messages that carried events.
    assert value(body, "densedev_coalesced_events_total", resource=POOL_A) == 8
    assert value(body, "densedev_events_per_message_count", resource=POOL_A) == 2
    assert value(body, "densedev_events_per_message_bucket", resource=POOL_A, le="4.0") == 1
    assert value(body, "densedev_scans_total") == 1
    assert value(body, "densedev_scan_duration_seconds_bucket", le="0.01") == 0
    assert value(body, "densedev_scan_duration_seconds_bucket", le="0.025") == 1
    assert value(body, "densedev_scan_devices") == 4096
    assert value(body, "densedev_scan_skipped_devices_total") == 1
    assert value(body, "densedev_netlink_events_total", source="link") == 3
    assert value(body, "densedev_netlink_events_total", source="uevent") == 1
    assert value(body, "densedev_netlink_overruns_total", source="uevent") == 1
    assert value(body, "densedev_resyncs_total", reason="overrun") == 1
    assert value(body, "densedev_kubelet_registrations_total", resource=POOL_A, result="success") == 1
    assert value(body, "densedev_kubelet_registrations_total", resource=POOL_B, result="failure") == 1
    assert value(body, "densedev_pool_registered", resource=POOL_A) == 1
    assert value(body, "densedev_pool_registered", resource=POOL_B) == 0
    assert value(body, "densedev_plugin_rpc_calls_total", resource=POOL_A, method=ALLOCATE) == 2
    assert value(body, "densedev_plugin_rpc_calls_total", resource=POOL_A, method=PREFERRED) == 1
    assert (
        value(
            body,
            "densedev_plugin_rpc_errors_total",
            resource=POOL_A,
            method=ALLOCATE,
            code="INVALID_ARGUMENT",
        )
        == 1
    )
    assert value(body, "densedev_plugin_rpc_duration_seconds_count", resource=POOL_A, method=ALLOCATE) == 2
    assert value(body, "densedev_config_reloads_total", result="success") == 1
    assert value(body, "densedev_config_reloads_total", result="failure") == 1
    assert value(body, "densedev_config_last_reload_successful") == 0
    assert value(body, "densedev_config_last_reload_timestamp_seconds") == pytest.approx(time.time(), abs=600)


def test_reasons_that_clear_disappear_and_removed_pools_vanish() -> None:
    m = Metrics()
    m.set_pool_devices(POOL_A, 250, 6, {"pf_link_down": 4, "driver": 2})
    m.set_pool_devices(POOL_A, 254, 2, {"driver": 2})
    got = samples(m.render())
    keys = {(n, dict(lbl).get("reason")) for n, lbl in got if n == "densedev_pool_unhealthy_devices"}
    assert keys == {("densedev_pool_unhealthy_devices", "driver")}

    m.set_pool_devices(POOL_B, 8, 0)
    m.record_send(POOL_A, 100, 0.001, events=1)
    m.record_registration(POOL_A, ok=True)
    m.observe_allocate(POOL_A, 0.001, error="FAILED_PRECONDITION")
    m.remove_pool(POOL_A)
    left = samples(m.render())
    assert not [k for k in left if ("resource", POOL_A) in k[1]]
    assert [k for k in left if ("resource", POOL_B) in k[1]]
    # A pool that comes back starts from zero rather than crashing on the dropped cache.
    m.record_send(POOL_A, 10, None)
    assert value(m.render(), "densedev_listandwatch_messages_total", resource=POOL_A) == 1


def test_a_reload_removing_many_pools_drops_all_their_series_and_no_other() -> None:
    m = Metrics()
    pools = [f"intel.com/p{i}" for i in range(50)]
    for i, pool in enumerate(pools):
        m.set_pool_devices(pool, 4, 1, {"pf_link_down": 1})
        m.record_send(pool, 100, 0.001, events=2)
        m.record_registration(pool, ok=True)
        m.observe_allocate(pool, 0.001, error="INTERNAL" if i % 2 else None)
    m.remove_pools(pools[:40])
    left = {dict(lbl).get("resource") for _n, lbl in samples(m.render())} - {None}
    assert left == set(pools[40:])
    m.remove_pools(())  # nothing to remove: nothing removed
    assert {dict(lbl).get("resource") for _n, lbl in samples(m.render())} - {None} == set(pools[40:])


def test_registries_are_private() -> None:
    # Two daemons (or two tests) in one process must not collide on the global registry.
    a, b = Metrics(implementation="cython"), Metrics(implementation="python")
    a.observe_scan(0.1)
    assert value(a.render(), "densedev_scans_total") == 1
    assert value(b.render(), "densedev_scans_total") == 0
    assert value(b.render(), "densedev_build_info", version="0.1.0", implementation="python") == 1


async def test_readyz_follows_the_readiness_callable() -> None:
    state = {"ready": (False, "not registered: intel.com/sriov_a, nvidia.com/rdma_b")}

    async with serving(Metrics(), lambda: state["ready"]) as server:
        status, _, body = await fetch(server.port, "/readyz")
        assert status == 503
        assert body == b"not registered: intel.com/sriov_a, nvidia.com/rdma_b\n"
        state["ready"] = (True, "all pools registered")
        status, _, body = await fetch(server.port, "/readyz")
        assert (status, body) == (200, b"all pools registered\n")


async def test_readyz_broken_callable_is_not_ready() -> None:
    def broken() -> tuple[bool, str]:
        raise KeyError("pool vanished")

    async with serving(Metrics(), broken) as server:
        status, _, body = await fetch(server.port, "/readyz")
        assert status == 503
        assert b"readiness check failed" in body and b"pool vanished" in body
        assert (await fetch(server.port, "/healthz"))[0] == 200  # still serving


async def test_healthz_ok_while_loop_turns() -> None:
    async with serving(Metrics(), lag_interval_s=0.01) as server:
        status, _, body = await fetch(server.port, "/healthz")
        assert status == 200 and body.startswith(b"ok, event loop lag ")


async def test_healthz_fails_after_the_loop_was_blocked() -> None:
    m = Metrics()
    async with serving(m, lag_interval_s=0.01, max_lag_s=0.1, lag_window_s=3600) as server:
        await asyncio.sleep(0.03)  # let the monitor take its first step and start waiting for a tick
        time.sleep(0.3)  # block the loop as a runaway callback would: the lag is at least this
        # The monitor's tick was due during the block, so it runs before this later timer fires.
        await asyncio.sleep(0.05)
        assert server.lag.worst >= 0.25
        status, _, body = await fetch(server.port, "/healthz")
        assert status == 503
        assert b"event loop lagged" in body
        assert value(m.render(), "densedev_event_loop_lag_seconds") >= 0


async def test_healthz_fails_when_the_monitor_died() -> None:
    async with serving(Metrics()) as server:
        assert server._monitor is not None
        server._monitor.cancel()
        await asyncio.sleep(0)
        status, _, body = await fetch(server.port, "/healthz")
        assert (status, body) == (503, b"event loop monitor is not running\n")


async def test_http_edges() -> None:
    async with serving(Metrics()) as server:
        status, _, body = await fetch(server.port, "/nope")
        assert status == 404 and b"/metrics" in body
        status, headers, body = await fetch(server.port, "/metrics", method="HEAD")
        assert status == 200 and body == b"" and int(headers["content-length"]) > 0
        assert (await fetch(server.port, "/metrics?name[]=x"))[0] == 200
        status, headers, _ = await fetch(server.port, "/metrics", method="POST")
        assert status == 405 and headers["allow"] == "GET, HEAD"
        answer = await raw(server.port, b"garbage\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 400 Bad Request\r\n")
        answer = await raw(server.port, b"GET /healthz HTTP/1.1\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 400 Bad Request\r\n")
        # A client that connects and leaves without a request must not disturb the server.
        assert await raw(server.port, b"GET /heal") == b""
        assert (await fetch(server.port, "/healthz"))[0] == 200


async def test_stop_closes_idle_connections() -> None:
    async with serving(Metrics()) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        await asyncio.sleep(0.01)
        await server.stop()  # must not wait for the idle client's read timeout
        assert await reader.read() == b""
        writer.close()
        await writer.wait_closed()
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", server.port)


@pytest.mark.parametrize(
    ("addr", "expected"),
    [
        (":9477", ("", 9477)),
        ("127.0.0.1:9477", ("127.0.0.1", 9477)),
        ("localhost:0", ("localhost", 0)),
        ("[::1]:9477", ("::1", 9477)),
        ("[::]:80", ("::", 80)),
        (" 0.0.0.0:9477 ", ("0.0.0.0", 9477)),
    ],
)
def test_parse_addr(addr: str, expected: tuple[str, int]) -> None:
    assert parse_addr(addr) == expected


@pytest.mark.parametrize(
    ("addr", "error"),
    [
        ("", "empty"),
        ("9477", "has no port"),
        ("host:", "port '' is not a number"),
        (":http", "port 'http' is not a number"),
        (":-1", "port '-1' is not a number"),
        (":65536", "port 65536 is out of range"),
        ("::1:9477", "IPv6 host in brackets"),
        ("[::1]9477", r"must look like \[::1\]:9477"),
        ("[]:9477", "empty IPv6 host"),
    ],
)
def test_parse_addr_errors(addr: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        parse_addr(addr)


async def test_readyz_follows_the_daemons_registration_with_the_kubelet(
    tmp_path: Path, sock_dir: Path
) -> None:
    # The readiness callable the daemon provides, over real registration against the kubelet emulator:
    # not ready while no kubelet listens, ready once every pool registered, not ready when it goes away.
    from densedev.daemon import Daemon, DaemonSettings
    from densedev.pools import config as config_mod
    from densedev.testing import simnode
    from densedev.testing.kubelet import KubeletEmulator

    sysfs = tmp_path / "sys"
    layout = simnode.build_node(sysfs, pfs=2, vfs_per_pf=4, vendor="intel", numa_nodes=1)
    simnode.write_config(tmp_path / "config.json", layout)
    cfg = config_mod.load(tmp_path / "config.json")
    pools = sorted(p.full_name for p in cfg.pools)
    assert pools
    kubelet_dir = sock_dir  # the pools' sockets: tmp_path can be too long for sun_path (under xdist)
    (tmp_path / "dev").mkdir()
    settings = DaemonSettings(
        sysfs_root=sysfs, kubelet_dir=kubelet_dir, dev_root=tmp_path / "dev", devinfo_dir=None, netlink=False
    )

    async def readyz_until(port: int, status: int, names: list[str] | None = None) -> bytes:
        for _ in range(600):  # a wait, not a timing assertion: up to ~60 s on a loaded machine
            got, _, body = await fetch(port, "/readyz")
            # Each pool notices on its own: wait until the body names every pool asked for.
            if got == status and all(n.encode() in body for n in names or ()):
                return body
            await asyncio.sleep(0.1)
        raise AssertionError(f"/readyz never answered {status}; last {got} {body!r}")

    daemon = Daemon(settings, cfg)
    await daemon.start()
    emulator = KubeletEmulator(kubelet_dir)
    try:
        async with serving(Metrics(), daemon.registered) as server:
            body = await readyz_until(server.port, 503)
            assert body.startswith(b"not registered: ")
            assert all(p.encode() in body for p in pools)
            await emulator.start()
            assert await readyz_until(server.port, 200) == f"{len(pools)} pools registered\n".encode()
            assert sorted(emulator.resources()) == pools
            await emulator.stop()  # the kubelet exits: its socket goes, the pools must register again
            body = await readyz_until(server.port, 503, pools)
            assert body.startswith(b"not registered: ")
    finally:
        await daemon.stop()
        await emulator.stop()


def _same_ops(counter: Any, gauge: Any, hist: Any, plain_counter: Any, plain_hist: Any) -> None:
    """The same updates, whichever library's metric objects they are applied to."""
    plain_counter.inc()
    plain_counter.inc(2.5)
    counter.labels("a", "x").inc(3)
    counter.labels("b", "x").inc()
    counter.labels("a", "y")
    counter.remove("b", "x")
    gauge.labels("a").set(7)
    gauge.labels(POOL_A).set(-1.5)
    gauge.labels("c").set(0)
    gauge.remove_by_labels({"resource": "c"})
    for amount in (0.0005, 0.001, 0.003, 0.05, 2.0, float("nan"), 0.0):  # bounds, between, over, NaN
        hist.labels(POOL_B).observe(amount)
        plain_hist.observe(amount)
    hist.labels(POOL_A)  # a series made and never observed


def test_plain_metrics_render_exactly_as_prometheus_client_would() -> None:
    # ops.metrics keeps its numbers itself so that prometheus-client is imported only when collected
    # (issue 14, start-up); the exposition must stay byte for byte what prometheus-client's own
    # Counter, Gauge and Histogram give, _created timestamps aside (each library takes its own).
    import prometheus_client as pc

    from densedev.ops import metrics as plain

    buckets = (0.0005, 0.001, 0.0025, 0.05, 1.0)
    ref = pc.CollectorRegistry(auto_describe=True)
    ours = plain.Registry()
    made = []
    for lib, registry in ((pc, ref), (plain, ours)):
        made.append(
            (
                lib.Counter("t_events", "Events, by kind.", ["resource", "kind"], registry=registry),
                lib.Gauge("t_devices", 'Devices "now"\\ with\na newline.', ["resource"], registry=registry),
                lib.Histogram("t_seconds", "Latency.", ["resource"], buckets=buckets, registry=registry),
                lib.Counter("t_scans", "Scans.", registry=registry),
                lib.Histogram("t_scan_seconds", "Scan time.", buckets=buckets, registry=registry),
            )
        )
    for objects in made:
        _same_ops(*objects)

    def stamped(text: bytes) -> str:
        lines = text.decode().splitlines()
        return "\n".join(
            ln.rsplit(" ", 1)[0] + " T" if "_created" in ln.split(" ")[0] else ln for ln in lines
        )

    expected = stamped(pc.generate_latest(ref))
    assert "t_seconds_created" in expected and "t_events_total" in expected  # the comparison is not empty
    assert stamped(ours.render()) == expected
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        plain.Counter("t_scans", "Again.", registry=ours)
    with pytest.raises(ValueError, match="non-negative"):
        made[1][0].labels("a", "x").inc(-1)
    with pytest.raises(ValueError, match="Incorrect label count"):
        made[1][1].labels("a", "b")
    with pytest.raises(ValueError, match="missing label values"):
        made[1][0].inc()
