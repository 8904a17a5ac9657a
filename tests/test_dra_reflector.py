"""The publisher's reflector when the API server will not watch (403, 405) or expires a watch (410).

Each case runs the publisher against the API-server stand-in over real HTTP, on uvloop, with a backoff
of 30 s: only the path meant for that status (list instead of watch; re-list at once) can notice the
kubelet deleting a slice within the test's bound, so a status handled as an ordinary error fails it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pytest
from helpers.waiting import eventually

from densedev.dra import names, slices
from densedev.dra.apiclient import ResourceClient
from densedev.dra.publisher import Publisher, PublisherSettings
from densedev.model import Pool
from densedev.node import scanner
from densedev.pools import config, select
from densedev.testing import simnode
from densedev.testing.apiserver import ApiServerStandIn

NODE = "worker-1"
SLOW_BACKOFF = 30.0  # far beyond the test's bound: an error path that backs off cannot pass


@pytest.fixture(scope="module")
def pools(tmp_path_factory: pytest.TempPathFactory) -> tuple[Pool, ...]:
    node = simnode.build_node(tmp_path_factory.mktemp("node"), pfs=2, vfs_per_pf=64)
    vfs = {"vendors": ["15b3"], "devices": ["101e"]}
    resources = [{"resourceName": "vfs", "api": "dra", "selectors": vfs}]
    cfg = config.parse(json.dumps({"resourceList": resources}))
    return slices.dra_pools(select.build_pools(cfg, scanner.scan(node.root).devices))


async def _deleted_slice_comes_back(
    srv: ApiServerStandIn, pools: tuple[Pool, ...], **knobs: Any
) -> Publisher:
    """Start a publisher, let the kubelet delete one of its slices, and wait for it to be written again."""
    srv.add_node(NODE)
    kubelet = ResourceClient.for_url(srv.url)
    client = ResourceClient.for_url(srv.url)
    settings = PublisherSettings(
        NODE,
        names.DEFAULT_DRIVER_NAME,
        min_write_interval_s=0.0,
        backoff_min_s=SLOW_BACKOFF,
        backoff_max_s=SLOW_BACKOFF,
        **knobs,
    )
    pub = Publisher(client, settings, pools)
    try:
        await kubelet.discover()
        await pub.start()
        await asyncio.wait_for(pub.wait_idle(), 30)
        published = srv.node_slices(NODE)
        assert published and sum(len(s["spec"]["devices"]) for s in published) == 128
        name = published[0]["metadata"]["name"]
        await kubelet.delete_slice(name)
        await eventually(lambda: name in srv.slices, "the deleted slice written again", 10.0)
    finally:
        await pub.stop()
        await client.close()
        await kubelet.close()
    assert not srv.rejected, srv.rejected[:3]
    return pub


@pytest.mark.parametrize("status", [403, 405])
async def test_a_refused_watch_falls_back_to_listing(
    pools: tuple[Pool, ...], status: int, caplog: pytest.LogCaptureFixture
) -> None:

    with caplog.at_level(logging.WARNING, logger="densedev.dra.publisher"):
        async with ApiServerStandIn() as srv:
            srv.refuse_watch = status
            await _deleted_slice_comes_back(srv, pools, resync_s=0.05)
            assert srv.requests["WATCH resourceslices"] >= 1
            assert srv.requests["LIST resourceslices"] >= 2  # the deletion was seen by listing again
    assert f"cannot watch ResourceSlices ({status} " in caplog.text


async def test_an_expired_watch_relists_at_once(pools: tuple[Pool, ...]) -> None:
    async with ApiServerStandIn() as srv:
        srv.expire_watches = 1
        # Without the fallback to listing: only a re-list and a fresh watch can see the deletion.
        pub = await _deleted_slice_comes_back(srv, pools, resync_s=SLOW_BACKOFF)
        assert srv.expire_watches == 0 and pub.errors == 1
        assert srv.requests["LIST resourceslices"] >= 2
        assert srv.requests["WATCH resourceslices"] >= 2
