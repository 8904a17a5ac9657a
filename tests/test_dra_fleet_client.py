"""A fleet of nodes against one API server (issue 26): the stand-in's accounting and faults, and what
the client and publisher do when every node meets them at once.

Everything runs against the API-server stand-in over real HTTP, through the production client, on
uvloop.  The stand-in counts each request by node, verb and resource, so each test asserts counts: how
many LISTs a lost watch costs, which User-Agent a node sends, that a 429's Retry-After held a write back.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from helpers.dra_daemon import NODE, cluster, pool
from helpers.dra_daemon import Node as DaemonNode
from helpers.waiting import eventually

from densedev import __version__
from densedev.dra import WRITE_BURST, WRITE_QPS, names, slices
from densedev.dra.apiclient import RETRY_AFTER_MAX_S, ApiError, ResourceClient, TokenBucket, retry_after
from densedev.dra.publisher import Publisher, PublisherSettings
from densedev.model import Pool
from densedev.node import scanner
from densedev.pools import config, select
from densedev.testing import simnode
from densedev.testing.apiserver import ApiServerStandIn
from densedev.testing.dra_kubelet import allocated_claim

DRIVER = names.DEFAULT_DRIVER_NAME


@pytest.fixture(scope="module")
def pools(tmp_path_factory: pytest.TempPathFactory) -> tuple[Pool, ...]:
    node = simnode.build_node(tmp_path_factory.mktemp("node"), pfs=2, vfs_per_pf=64)
    cfg = config.parse(json.dumps({"resourceList": [{"resourceName": "vfs", "api": "dra"}]}))
    return slices.dra_pools(select.build_pools(cfg, scanner.scan(node.root).devices))


def _slice(node: str, name: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {
            "driver": DRIVER,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": "d0"}],
        },
    }


# ------------------------------------------------------------------------------------- the stand-in
async def test_the_stand_in_counts_requests_per_node_verb_and_resource() -> None:
    async with ApiServerStandIn() as srv:
        a, b = ResourceClient.for_url(srv.url), ResourceClient.for_url(srv.url)
        try:
            await a.discover()
            await b.discover()
            await a.create_slice(_slice("node-a", "a-0"))
            await b.create_slice(_slice("node-b", "b-0"))
            stored = await b.get_slice("b-0")
            await b.replace_slice(stored)
            await a.list_slices("spec.nodeName=node-a")
        finally:
            await a.close()
            await b.close()
        fleet = srv.fleet
        # Without a node in the User-Agent, the node comes from the object or the field selector.
        assert fleet.requests[("node-a", "CREATE", "resourceslices", 201)] == 1
        assert fleet.requests[("node-b", "UPDATE", "resourceslices", 200)] == 1
        assert fleet.requests[("node-b", "GET", "resourceslices", 200)] == 1
        assert fleet.requests[("node-a", "LIST", "resourceslices", 200)] == 1
        assert fleet.per_node("CREATE") == {"node-a": 1, "node-b": 1}
        assert fleet.bytes_in["node-b"] > 0 and fleet.bytes_out["node-a"] > 0
        stats = fleet.stats()
        assert stats["cpu_s"] > 0 and {e[2] for e in stats["log"]} >= {"CREATE", "UPDATE", "LIST"}
        assert [(e[1], e[2]) for e in stats["published"]] == [("node-a", 1), ("node-b", 1), ("node-b", 1)]


async def test_the_stand_in_logs_the_devices_each_write_left_published_through_create_update_delete() -> None:
    def two(node: str, name: str) -> dict[str, Any]:
        obj = _slice(node, name)
        obj["spec"]["devices"] = [{"name": "d0"}, {"name": "d1"}]
        return obj

    async with ApiServerStandIn() as srv:
        c = ResourceClient.for_url(srv.url)
        try:
            await c.discover()
            await c.create_slice(two("node-a", "a-0"))
            await c.create_slice(_slice("node-a", "a-1"))
            await c.create_slice(two("node-b", "b-0"))
            stored = await c.get_slice("a-0")
            await c.replace_slice({**stored, "spec": {**stored["spec"], "devices": [{"name": "d9"}]}})
            await c.delete_slice("a-1")
            srv.external_update("b-0", lambda o: o["spec"]["devices"].pop())
        finally:
            await c.close()
        published = [(e[1], e[2]) for e in srv.fleet.stats()["published"]]
        assert published == [("node-a", 2), ("node-a", 3), ("node-b", 2), ("node-a", 2), ("node-a", 1)]
        assert (srv.fleet.devices_of("node-a"), srv.fleet.devices_of("node-b")) == (1, 1)


async def test_the_stand_in_restarts_throttles_and_slows_down() -> None:
    async with ApiServerStandIn() as srv:
        c = ResourceClient.for_url(srv.url)
        try:
            await c.discover()
            _, rv = await c.list_slices("spec.nodeName=n")
            events = c.watch_slices("spec.nodeName=n", rv)
            pending = asyncio.ensure_future(anext(events))
            await eventually(lambda: bool(srv._watchers), "the watch open")
            srv.fleet.restart(refuse_s=0.3, rv_jump=500)
            with pytest.raises(StopAsyncIteration):
                await asyncio.wait_for(pending, 5)  # the watch closed by the restart
            with pytest.raises(ApiError) as refused:
                await c.list_slices("spec.nodeName=n")
            assert refused.value.status == 503
            await asyncio.sleep(0.35)
            _, rv2 = await c.list_slices("spec.nodeName=n")
            assert int(rv2) >= int(rv) + 500
            with pytest.raises(ApiError) as gone:  # the old resourceVersion is out of the new cache
                await anext(c.watch_slices("spec.nodeName=n", rv))
            assert gone.value.status == 410
            srv.fleet.throttle(5.0, retry_after=3)
            with pytest.raises(ApiError) as throttled:
                await c.create_slice(_slice("n", "n-0"))
            assert throttled.value.status == 429 and throttled.value.retry_after == 3
            srv.fleet.throttle(0.0)
            srv.fleet.slow(0.2)
            t = time.monotonic()
            await c.create_slice(_slice("n", "n-0"))
            assert time.monotonic() - t >= 0.2
        finally:
            await c.close()


async def test_the_stand_in_takes_claims_over_http_and_refuses_a_bad_batch_in_one_line() -> None:
    # A benchmark runs the stand-in as its own process: its pods' claims reach it through a control.
    async with ApiServerStandIn(validate=False) as srv:
        claim = allocated_claim("default", "c-1", "uid-1", [], [])
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{srv.url}/_standin/claims", data=json.dumps([claim])) as resp:
                assert resp.status == 200 and (await resp.json()) == {"stored": 1}
            assert srv.claim("default", "c-1")["metadata"]["uid"] == "uid-1"
            async with http.post(f"{srv.url}/_standin/claims", data=b'{"not": "a list"}') as resp:
                assert resp.status == 400
                assert (await resp.text()) == "claims: expected a JSON list of ResourceClaims"


# ---------------------------------------------------------------------------- the client in a fleet
def _publisher(
    srv: ApiServerStandIn,
    node: str,
    pools: tuple[Pool, ...],
    rand: Callable[[], float] = lambda: 0.5,
    **knobs: Any,
) -> Publisher:
    srv.add_node(node)
    settings = PublisherSettings(node, DRIVER, min_write_interval_s=0.0, **knobs)
    return Publisher(ResourceClient.for_url(srv.url), settings, pools, rand=rand)


async def _stop(*pubs: Publisher) -> None:
    for pub in pubs:
        await pub.stop()
        await pub._client.close()


async def test_a_node_names_itself_in_its_user_agent(pools: tuple[Pool, ...]) -> None:
    async with ApiServerStandIn() as srv:
        pub = _publisher(srv, "node-7", pools)
        try:
            await pub.start()
            await asyncio.wait_for(pub.wait_idle(), 30)
        finally:
            await _stop(pub)
        assert pub._client.user_agent == f"densedev/{__version__} node/node-7"
        # Discovery and the Node read name no node themselves: only the User-Agent tells whose they are.
        by_node = {(node, verb, res) for (node, verb, res, _code) in srv.fleet.requests}
        assert ("node-7", "LIST", "discovery") in by_node or ("node-7", "GET", "discovery") in by_node
        assert ("node-7", "GET", "nodes") in by_node
        assert {node for node, _, _ in by_node} == {"node-7"}


async def test_a_lost_watch_is_resumed_with_one_list_and_no_write(pools: tuple[Pool, ...]) -> None:
    async with ApiServerStandIn() as srv:
        pub = _publisher(srv, "node-1", pools, backoff_min_s=0.05, reconnect_spread_s=0.1)
        try:
            await pub.start()
            await asyncio.wait_for(pub.wait_idle(), 30)
            srv.fleet.reset()
            srv.fleet.restart(refuse_s=1.0)
            # The watch is resumed (503 while refused, then 410 from the new cache), then listed once.
            await eventually(lambda: pub.lists == 2 and bool(srv._watchers), "listed again and watching")
            await asyncio.sleep(0.3)
        finally:
            await _stop(pub)
        lists = [e for e in srv.fleet.log if e[2] == "LIST" and e[3] == "resourceslices"]
        assert len(lists) == 1 and lists[0][4] == 200, lists
        assert srv.fleet.per_node("WATCH")["node-1"] >= 2  # refused or expired, then the new one
        assert not [e for e in srv.fleet.log if e[2] in ("CREATE", "UPDATE", "DELETE")]
        assert pub.watch_losses == 1


async def test_every_watch_dropped_at_once_comes_back_spread_out(pools: tuple[Pool, ...]) -> None:
    spread = 1.5
    async with ApiServerStandIn() as srv:
        pubs = [
            _publisher(srv, f"node-{k}", pools, reconnect_spread_s=spread, rand=lambda k=k: k / 6)
            for k in range(6)
        ]
        try:
            for pub in pubs:
                await pub.start()
            for pub in pubs:
                await asyncio.wait_for(pub.wait_idle(), 30)
            await eventually(lambda: len(srv._watchers) == 6, "six watches open")
            srv.fleet.reset()
            dropped = time.monotonic()
            srv.fleet.restart(refuse_s=0.0)
            watching = lambda: {e[1] for e in srv.fleet.log if e[2] == "WATCH"}  # noqa: E731
            await eventually(lambda: len(watching()) == 6, "six watches open again", 10)
        finally:
            await _stop(*pubs)
        first: dict[str, float] = {}
        for t, node, verb, _res, _code in srv.fleet.log:
            if verb == "WATCH":
                first.setdefault(node, t)
        assert len(first) == 6
        # Node k came back k/6 of the spread after the drop: none before its share, all within it.
        for k in range(6):
            assert first[f"node-{k}"] - dropped >= spread * k / 6 - 0.01
        assert max(first.values()) - min(first.values()) >= spread * 5 / 6 - 0.2


async def test_retry_after_holds_a_write_back(pools: tuple[Pool, ...]) -> None:
    async with ApiServerStandIn() as srv:
        pub = _publisher(srv, "node-1", pools, backoff_min_s=0.05, backoff_max_s=0.1)
        down = {d.id for d in pools[0].members[:4]}
        try:
            await pub.start()
            await asyncio.wait_for(pub.wait_idle(), 30)
            srv.fleet.reset()
            srv.fleet.throttle(0.6, retry_after=2)
            pub.update(unhealthy=down)
            await eventually(lambda: srv.fleet.per_node("UPDATE")["node-1"] >= 2, "the write retried", 10)
            await asyncio.wait_for(pub.wait_idle(), 10)
        finally:
            await _stop(pub)
        updates = [(t, code) for t, _n, verb, _r, code in srv.fleet.log if verb == "UPDATE"]
        # One 429, then the retry no sooner than the 2 s asked (a 0.05 s backoff alone retries at once).
        assert [code for _, code in updates] == [429, 200], updates
        assert updates[1][0] - updates[0][0] >= 2.0
        assert pub.throttled == 1
        published = srv.node_slices("node-1")
        assert sum(len(s["spec"]["devices"]) for s in published) == 128 - 4


def test_retry_after_is_read_as_seconds_and_capped() -> None:
    assert retry_after("3") == 3.0
    assert retry_after("3600") == RETRY_AFTER_MAX_S == 60.0
    assert retry_after("Wed, 21 Oct 2015 07:28:00 GMT") is None
    assert retry_after("-1") is None and retry_after(None) is None


def test_the_token_bucket_lets_a_burst_go_then_meters() -> None:
    now = [0.0]
    bucket = TokenBucket(10.0, 3, clock=lambda: now[0])
    assert [bucket.reserve() for _ in range(3)] == [0.0, 0.0, 0.0]
    # Then one every 0.1 s, each caller waiting its own turn.
    assert [round(bucket.reserve(), 3) for _ in range(3)] == [0.1, 0.2, 0.3]
    now[0] = 10.0  # refilled, but never past the burst
    assert [bucket.reserve() for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.reserve() > 0
    assert TokenBucket(0.0, 1).reserve() == 0.0  # off


async def test_slice_writes_go_through_the_nodes_token_bucket() -> None:
    async with ApiServerStandIn() as srv:
        c = ResourceClient.for_url(srv.url)
        c.limit_writes(5.0, 2)
        try:
            await c.discover()
            t = time.monotonic()
            await asyncio.gather(*(c.create_slice(_slice("n", f"n-{k}")) for k in range(6)))
            took = time.monotonic() - t
        finally:
            await c.close()
        assert srv.fleet.per_node("CREATE") == {"n": 6}
        # Two at once, then one per 200 ms: the last four waited (a stall of the loop between two of
        # them could refill one token, hence at least three), and the six took 0.8 s at least.
        assert c.writes.waited >= 3
        assert took >= (6 - 2) / 5.0 - 0.01


# ------------------------------------------------------------------------------- the daemon's wiring
def test_densedev_run_takes_the_write_budget_flags(capsys: pytest.CaptureFixture[str]) -> None:
    from densedev import cli

    args = cli.build_parser().parse_args(["run", "--dra-write-qps", "5", "--dra-write-burst", "3"])
    assert (args.dra_write_qps, args.dra_write_burst) == (5.0, 3)
    args = cli.build_parser().parse_args(["run"])
    assert (args.dra_write_qps, args.dra_write_burst) == (WRITE_QPS, WRITE_BURST) == (20.0, 512)
    for bad in (["--dra-write-qps", "-1"], ["--dra-write-qps", "nan"], ["--dra-write-burst", "0"]):
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args(["run", *bad])
    assert "--dra-write-burst: 0 is below the minimum 1" in capsys.readouterr().err.replace("argument ", "")


async def test_the_daemons_client_names_the_node_and_meters_writes(tmp_path: Path) -> None:
    node = DaemonNode(tmp_path)
    node.write([pool("dra", [node.pf1.netdev], api="dra")])
    try:
        async with cluster(node) as c:
            assert c.daemon is not None
            await c.until(lambda: len(node.published()) == len(node.pf1.vf_addresses), "published")
            client = c.daemon.dra.client if c.daemon.dra is not None else None
            assert client is not None
            assert client.user_agent == f"densedev/{__version__} node/{NODE}"
            assert (client.writes.qps, client.writes.burst) == (WRITE_QPS, WRITE_BURST)
            assert node.api is not None and set(node.api.fleet.per_node()) == {NODE}
    finally:
        node.cleanup()


@pytest.mark.parametrize(
    ("attributes", "error"),
    [
        ({"Bad-Name": {"int": 1}}, "not a C identifier"),
        ({"Bad_Prefix./ok": {"int": 1}}, "prefix is not a DNS subdomain"),
        ({"ok": {"int": 1, "bool": True}}, "exactly one value type"),
        ({"ok": {"int": None}}, "exactly one value type"),
        ({"ok": {"float": 1.5}}, "exactly one value type"),
        ({"ok": {"string": "x" * 65}}, "longer than 64 characters"),
        ({"ok": {"version": "1." + "0" * 63}}, "longer than 64 characters"),
    ],
)
def test_the_stand_in_refuses_bad_attributes_the_second_time_too(
    attributes: dict[str, Any], error: str
) -> None:
    # Valid names are remembered (a slice repeats them on every device): a bad value under a name seen
    # before is refused all the same, and a bad name never becomes a remembered one.
    from densedev.testing.apiserver import _Invalid, _slice_rules

    def slice_of(attrs: dict[str, Any]) -> dict[str, Any]:
        device = {"name": "d0", "attributes": attrs}
        pool = {"name": "n", "generation": 1, "resourceSliceCount": 1}
        spec = {"driver": "net.densedev.io", "nodeName": "n", "pool": pool, "devices": [device]}
        return {"metadata": {"name": "n-net-densedev-io-0"}, "spec": spec}

    _slice_rules(slice_of({"ok": {"int": 1}, "densedev.io/ok": {"bool": True}}), "v1")
    for _ in range(2):
        with pytest.raises(_Invalid, match=error):
            _slice_rules(slice_of(attributes), "v1")


# --------------------------------------------------------------------------- echoes of our own writes
def test_the_echo_pattern_reads_the_objects_resource_version_as_the_api_server_writes_it() -> None:
    from densedev.dra.apiclient import _ECHO

    # Go's encoding: the event's type first, then TypeMeta, then ObjectMeta in field order.
    go = (
        b'{"type":"MODIFIED","object":{"kind":"ResourceSlice","apiVersion":"resource.k8s.io/v1",'
        b'"metadata":{"name":"n-x-0","uid":"9d1","resourceVersion":"123456","generation":1,'
        b'"ownerReferences":[{"apiVersion":"v1","kind":"Node","name":"n","uid":"u"}]},'
        b'"spec":{"driver":"d","pool":{"name":"n","generation":1,"resourceSliceCount":1},'
        b'"devices":[{"name":"resourceVersion"}]}}}\n'
    )
    m = _ECHO.match(go)
    assert m is not None and m.group(1) == b"123456"
    spaced = go.replace(b'"type":"MODIFIED",', b'"type": "ADDED", ').replace(b'"object":', b'"object" :')
    assert (m := _ECHO.match(spaced)) is not None and m.group(1) == b"123456"
    # A deletion says the slice is gone, whatever resourceVersion it carries: always decoded.
    assert _ECHO.match(go.replace(b"MODIFIED", b"DELETED")) is None
    assert _ECHO.match(go.replace(b"MODIFIED", b"BOOKMARK")) is None
    # A quoted key inside a string value is escaped: it is no key, and the real one is found.
    tricky = go.replace(b'"uid":"9d1"', b'"uid":"\\"resourceVersion\\":\\"7\\""')
    assert (m := _ECHO.match(tricky)) is not None and m.group(1) == b"123456"


async def test_a_watch_hands_back_a_known_write_undecoded_and_everything_else_decoded() -> None:
    async with ApiServerStandIn() as srv:
        ours, other = ResourceClient.for_url(srv.url), ResourceClient.for_url(srv.url)
        try:
            await ours.discover()
            await other.discover()
            _, rv0 = await ours.list_slices("spec.nodeName=n")
            mine = await ours.create_slice(_slice("n", "n-0"))
            theirs = await other.create_slice(_slice("n", "n-1"))
            await other.delete_slice("n-0")
            known = {mine["metadata"]["resourceVersion"]}
            events = ours.watch_slices("spec.nodeName=n", rv0, known=known.__contains__)
            got = [await asyncio.wait_for(anext(events), 5) for _ in range(3)]
            await events.aclose()
        finally:
            await ours.close()
            await other.close()
        assert got[0] == ("BOOKMARK", {"metadata": {"resourceVersion": mine["metadata"]["resourceVersion"]}})
        assert got[1][0] == "ADDED" and got[1][1]["metadata"]["name"] == "n-1"
        assert got[1][1]["metadata"]["resourceVersion"] == theirs["metadata"]["resourceVersion"]
        assert got[2][0] == "DELETED" and got[2][1]["metadata"]["name"] == "n-0"


async def test_a_publisher_does_not_decode_the_echoes_of_its_own_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from densedev.dra import apiclient

    node = simnode.build_node(tmp_path / "node", pfs=8, vfs_per_pf=8)
    cfg = config.parse(json.dumps({"resourceList": [{"resourceName": "vfs", "api": "dra"}]}))
    many = slices.dra_pools(select.build_pools(cfg, scanner.scan(node.root).devices))
    decoded: list[bytes] = []
    real = apiclient.orjson

    class Counting:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        @staticmethod
        def loads(data: Any) -> Any:
            if bytes(data[:8]) == b'{"type":':
                decoded.append(bytes(data))
            return real.loads(data)

    monkeypatch.setattr(apiclient, "orjson", Counting())
    async with ApiServerStandIn() as srv:
        srv.add_node(NODE)
        client, kubelet = ResourceClient.for_url(srv.url), ResourceClient.for_url(srv.url)
        pub = Publisher(client, PublisherSettings(NODE, DRIVER, min_write_interval_s=0.0), many)
        try:
            await kubelet.discover()
            await pub.start()
            await asyncio.wait_for(pub.wait_idle(), 30)
            first = srv.node_slices(NODE)
            assert len(first) == 8
            # Another writer's change: the watch must decode it (and the slice comes back); every
            # echo before it in the stream has been read by then.
            gone = first[3]["metadata"]["name"]
            await kubelet.delete_slice(gone)
            await eventually(lambda: gone in {s["metadata"]["name"] for s in srv.node_slices(NODE)}, "back")
            await asyncio.wait_for(pub.wait_idle(), 30)
        finally:
            await pub.stop()
            await client.close()
            await kubelet.close()
    kinds = [json.loads(line)["type"] for line in decoded]
    # The deletion, and at most the echo of the re-creation if it came before the write's answer.
    assert kinds.count("DELETED") == 1 and len(kinds) <= 2, kinds
