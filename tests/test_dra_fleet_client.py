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
from typing import Any

import pytest
from helpers.waiting import eventually

from densedev.dra import names, slices
from densedev.dra.apiclient import ApiError, ResourceClient
from densedev.model import Pool
from densedev.node import scanner
from densedev.pools import config, select
from densedev.testing import simnode
from densedev.testing.apiserver import ApiServerStandIn

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
            assert throttled.value.status == 429
            srv.fleet.throttle(0.0)
            srv.fleet.slow(0.2)
            t = time.monotonic()
            await c.create_slice(_slice("n", "n-0"))
            assert time.monotonic() - t >= 0.2
        finally:
            await c.close()
