"""The publisher against the API-server stand-in, over real HTTP, through the production client, on uvloop.

Every slice the publisher writes is validated by the stand-in (official OpenAPI schema, strict, plus the
API's written limits); a rejected write would leave the publisher never idle and fail the test.  Time is
a fake clock the tests move, so rate limits are asserted by counting writes, never by timing.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
from helpers.waiting import eventually

from densedev.dra import names, slices
from densedev.dra.apiclient import ApiError, HttpClaimReader, ResourceClient
from densedev.dra.publisher import WRITES_IN_FLIGHT, Publisher, PublisherSettings
from densedev.model import Pool
from densedev.node import scanner as discovery
from densedev.ops.metrics import Metrics
from densedev.pools import config
from densedev.pools import select as selectors
from densedev.testing import simnode
from densedev.testing.apiserver import ApiServerStandIn

NODE = "worker-1"
DRIVER = names.DEFAULT_DRIVER_NAME
SELECTOR = f"spec.nodeName={NODE}"


class Clock:
    """A monotonic clock that moves only when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> simnode.NodeLayout:
    # PFs of 256 VFs as at density, but few of them: every write is schema-validated, which costs.
    return simnode.build_node(tmp_path_factory.mktemp("node"), pfs=4, vfs_per_pf=256)


N = 4 * 256  # devices of ``node``
S = N // 128  # its slices


def _pools(root: Path, resources: list[dict[str, Any]]) -> tuple[Pool, ...]:
    cfg = config.parse(json.dumps({"resourceList": resources}))
    return slices.dra_pools(selectors.build_pools(cfg, discovery.scan(root).devices))


ALL_VFS = {"resourceName": "vfs", "api": "dra", "selectors": {"vendors": ["15b3"], "devices": ["101e"]}}


@pytest.fixture(scope="module")
def pools(node: simnode.NodeLayout) -> tuple[Pool, ...]:
    return _pools(node.root, [ALL_VFS])


@pytest.fixture(scope="module")
def pools4k(tmp_path_factory: pytest.TempPathFactory) -> tuple[Pool, ...]:
    big = simnode.build_node(tmp_path_factory.mktemp("node4k"), pfs=16, vfs_per_pf=256)
    return _pools(big.root, [ALL_VFS])


@contextlib.asynccontextmanager
async def published(
    pools: tuple[Pool, ...],
    *,
    versions: tuple[str, ...] = ("v1", "v1beta1"),
    clock: Clock | None = None,
    before: Callable[[ResourceClient], Coroutine[Any, Any, None]] | None = None,
    drop_taints: bool = False,
    metrics: Metrics | None = None,
    **knobs: Any,
) -> AsyncIterator[tuple[ApiServerStandIn, Publisher, ResourceClient]]:
    """A stand-in, a publisher of ``pools`` started against it and idle, and a second (kubelet's) client."""
    async with ApiServerStandIn(versions, drop_taints=drop_taints) as srv:
        srv.add_node(NODE)
        other = ResourceClient.for_url(srv.url)
        await other.discover()
        if before is not None:
            await before(other)
        client = ResourceClient.for_url(srv.url)
        settings = PublisherSettings(NODE, DRIVER, **knobs)
        pub = Publisher(client, settings, pools, clock=clock or Clock(), metrics=metrics)
        await pub.start()
        try:
            await asyncio.wait_for(pub.wait_idle(), 60)
            yield srv, pub, other
        finally:
            await pub.stop()
            await client.close()
            await other.close()
    assert not srv.rejected, srv.rejected[:3]


def _devices(srv: ApiServerStandIn) -> dict[str, str]:
    """Device name → the slice holding it, over the node's published slices."""
    return {d["name"]: s["metadata"]["name"] for s in srv.node_slices(NODE) for d in s["spec"]["devices"]}


async def test_start_publishes_4096_devices_with_one_write_per_slice(pools4k: tuple[Pool, ...]) -> None:
    async with published(pools4k) as (srv, pub, _):
        assert pub.version is slices.ApiVersion.V1
        got = srv.node_slices(NODE)
        assert len(got) == 32 and len(_devices(srv)) == 4096
        assert sum(srv.writes.values()) == 32 == pub.writes
        assert {(s["spec"]["pool"]["generation"], s["spec"]["pool"]["resourceSliceCount"]) for s in got} == {
            (1, 32)
        }
        uid = srv.nodes[NODE]["metadata"]["uid"]
        assert all(s["metadata"]["ownerReferences"][0]["uid"] == uid for s in got)
        assert srv.requests["PUT resourceslices"] == 0  # nothing rewritten after the creates


async def test_a_start_sends_its_first_create_before_rendering_every_slice(
    pools4k: tuple[Pool, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A create is rendered when its write goes out (the writes in flight are bounded): the server
    # works on the first slices while the rest are rendered, not after all of them (0.5 s at 65,536).
    rendered: list[str] = []
    real = slices.SliceBuilder.render

    def render(self: slices.SliceBuilder, state: slices.SliceState, *args: Any, **kw: Any) -> dict[str, Any]:
        rendered.append(state.name)
        return real(self, state, *args, **kw)

    monkeypatch.setattr(slices.SliceBuilder, "render", render)
    at_first_write: list[int] = []

    def on_write(method: str, name: str) -> None:
        if not at_first_write:
            at_first_write.append(len(rendered))

    async with ApiServerStandIn() as srv:
        srv.add_node(NODE)
        srv.on_write = on_write
        client = ResourceClient.for_url(srv.url)
        pub = Publisher(client, PublisherSettings(NODE, DRIVER), pools4k)
        try:
            await pub.start()
            await asyncio.wait_for(pub.wait_idle(), 60)
        finally:
            await pub.stop()
            await client.close()
        assert len(srv.node_slices(NODE)) == 32 and pub.writes == 32
    assert sorted(rendered) == sorted(s.name for s in pub.builder().states())  # each rendered once
    assert at_first_write and at_first_write[0] <= WRITES_IN_FLIGHT < 32, at_first_write


async def test_a_slice_stored_as_sent_is_held_as_rendered_not_as_a_decoded_second_copy(
    pools4k: tuple[Pool, ...],
) -> None:
    # The server's answer repeats every device; held as decoded, a 65,536-device node kept a second
    # copy of all of them (~400 MiB).  What the server stored as sent is held as the builder made it.
    async with published(pools4k) as (srv, pub, _):
        rendered = pub.builder()._devices
        for name, held in pub._mirror.items():
            assert held["metadata"]["resourceVersion"] == srv.slices[name]["metadata"]["resourceVersion"]
            assert all(d is rendered[d["name"]] for d in held["spec"]["devices"]), name
        # ... and it still compares equal to what the server holds, so nothing is rewritten.
        pub.poke()
        await asyncio.wait_for(pub.wait_idle(), 30)
        assert pub.writes == 32


async def test_pf_down_rewrites_only_its_two_slices_in_place(
    node: simnode.NodeLayout, pools: tuple[Pool, ...]
) -> None:
    clock = Clock()
    async with published(pools, clock=clock) as (srv, pub, _):
        before = {s["metadata"]["name"]: s["metadata"]["resourceVersion"] for s in srv.node_slices(NODE)}
        clock.now += 10
        down = set(node.pfs[2].vf_addresses)
        pub.update(unhealthy=down)
        await asyncio.wait_for(pub.wait_idle(), 30)
        after = {s["metadata"]["name"]: s["metadata"]["resourceVersion"] for s in srv.node_slices(NODE)}
        changed = [n for n in before if before[n] != after[n]]
        assert len(changed) == 2 and pub.writes == S + 2
        assert len(_devices(srv)) == N - 256
        assert not {names.device_name(a) for a in down} & set(_devices(srv))
        # Same generation: no device moved, so consumers never see one twice.
        assert {s["spec"]["pool"]["generation"] for s in srv.node_slices(NODE)} == {1}
        clock.now += 10
        pub.update(unhealthy=())
        await asyncio.wait_for(pub.wait_idle(), 30)
        assert len(_devices(srv)) == N and pub.writes == S + 4


async def test_conflict_is_retried_after_a_fresh_read(
    node: simnode.NodeLayout, pools: tuple[Pool, ...]
) -> None:
    clock = Clock()
    async with published(pools, clock=clock) as (srv, pub, _):
        target = srv.node_slices(NODE)[0]["metadata"]["name"]
        sneaked: list[str] = []

        def another_writer(method: str, name: str) -> None:
            # Another writer changes the slice just before our PUT lands: its resourceVersion is stale.
            if method == "PUT" and name == target and not sneaked:
                sneaked.append(name)
                srv.external_update(name, lambda o: o["metadata"].setdefault("labels", {}).update(x="y"))

        srv.on_write = another_writer
        clock.now += 10
        pub.update(unhealthy={node.pfs[0].vf_addresses[0]})
        await asyncio.wait_for(pub.wait_idle(), 30)
        assert sneaked == [target]
        assert pub.conflicts == 1
        final = srv.slices[target]
        assert "x" not in final["metadata"]["labels"]  # ours again, from a fresh read
        assert names.device_name(node.pfs[0].vf_addresses[0]) not in {
            d["name"] for d in final["spec"]["devices"]
        }
        assert srv.writes[target] == 2  # our create and our retried update (the other writer aside)


async def test_kubelet_deletecollection_and_single_deletes_are_republished(pools: tuple[Pool, ...]) -> None:
    clock = Clock()
    async with published(pools, clock=clock) as (srv, pub, kubelet):
        clock.now += 10
        # What the kubelet does at its start (DeleteCollection, fieldSelector spec.nodeName).
        await kubelet.delete_slices(SELECTOR)
        await eventually(lambda: len(_devices(srv)) == N, "every device republished")
        await asyncio.wait_for(pub.wait_idle(), 30)
        got = srv.node_slices(NODE)
        assert len(got) == S and pub.writes == 2 * S
        assert {s["spec"]["pool"]["resourceSliceCount"] for s in got} == {S}
        assert set(srv.writes.values()) == {3}  # created, wiped by the kubelet, created again
        # One slice deleted by someone: that one comes back, at the same generation, alone.
        clock.now += 10
        gone = got[3]
        await kubelet.delete_slice(gone["metadata"]["name"])
        await eventually(lambda: gone["metadata"]["name"] in srv.slices, "the deleted slice is back")
        await asyncio.wait_for(pub.wait_idle(), 30)
        assert pub.writes == 2 * S + 1
        assert (
            srv.slices[gone["metadata"]["name"]]["spec"]["pool"]["generation"]
            == gone["spec"]["pool"]["generation"]
        )


async def test_writes_per_slice_are_rate_limited_and_coalesced(
    node: simnode.NodeLayout, pools: tuple[Pool, ...]
) -> None:
    clock = Clock()
    async with published(pools, clock=clock, min_write_interval_s=5.0) as (srv, pub, _):
        pf = set(node.pfs[3].vf_addresses)
        clock.now += 10
        pub.update(unhealthy=pf)
        await asyncio.wait_for(pub.wait_idle(), 30)
        assert pub.writes == S + 2
        affected = {n for n, c in srv.writes.items() if c == 2}
        assert len(affected) == 2
        # A flapping PF within the interval: nothing is written, the two slices wait.
        for k in range(7):
            pub.update(unhealthy=pf if k % 2 else ())
            await asyncio.sleep(0)
        await eventually(lambda: pub.deferred == affected, "both slices deferred")
        assert pub.writes == S + 2
        # Interval over: one write per slice, with the newest state (the PF back up).
        clock.now += 5
        pub.poke()
        await asyncio.wait_for(pub.wait_idle(), 30)
        assert pub.writes == S + 4 and {srv.writes[n] for n in affected} == {3}
        assert len(_devices(srv)) == N


async def test_v1beta1_is_used_when_v1_is_not_served(pools: tuple[Pool, ...]) -> None:
    async with published(pools, versions=("v1beta1",)) as (srv, pub, _):
        assert pub.version is slices.ApiVersion.V1BETA1
        got = srv.node_slices(NODE)
        assert len(got) == S and all(s["apiVersion"] == "resource.k8s.io/v1beta1" for s in got)
        assert all("basic" in d for d in got[0]["spec"]["devices"])
    async with ApiServerStandIn(versions=("v1alpha3",)) as old:
        client = ResourceClient.for_url(old.url)
        with pytest.raises(ApiError, match="neither v1 nor v1beta1"):
            await client.discover()
        await client.close()


async def test_stale_slices_of_ours_go_and_others_stay(pools: tuple[Pool, ...]) -> None:
    def slice_of(name: str, driver: str, generation: int) -> dict[str, Any]:
        return {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": name},
            "spec": {
                "driver": driver,
                "nodeName": NODE,
                "pool": {"name": NODE, "generation": generation, "resourceSliceCount": 1},
                "devices": [{"name": "pci-0000-99-00-1"}],
            },
        }

    async def plant(client: ResourceClient) -> None:
        # Left by an earlier densedev with another layout, and a slice of another driver on the node.
        await client.create_slice(slice_of("worker-1-old-layout", DRIVER, 5))
        await client.create_slice(slice_of("worker-1-gpu", "gpu.example.com", 1))

    async with published(pools, before=plant) as (srv, _pub, _):
        assert "worker-1-old-layout" not in srv.slices
        assert "worker-1-gpu" in srv.slices
        ours = [s for s in srv.node_slices(NODE) if s["spec"]["driver"] == DRIVER]
        assert len(ours) == S
        assert {s["spec"]["pool"]["generation"] for s in ours} == {6}  # above what was there


async def test_devices_moving_between_slices_move_the_pool_to_a_new_generation(
    node: simnode.NodeLayout, pools: tuple[Pool, ...]
) -> None:
    clock = Clock()
    async with published(pools, clock=clock) as (srv, pub, _):
        pf0 = node.pfs[0]
        # A reload hands PF0's first 64 VFs to a device-plugin pool: PF0's other VFs shift slices.
        moved = _pools(
            node.root,
            [{"resourceName": "dp", "selectors": {"pfNames": [f"{pf0.netdev}#0-63"]}}, ALL_VFS],
        )
        clock.now += 10
        pub.update(pools=moved)
        await asyncio.wait_for(pub.wait_idle(), 30)
        got = srv.node_slices(NODE)
        assert len(got) == S and len(_devices(srv)) == N - 64
        assert {(s["spec"]["pool"]["generation"], s["spec"]["pool"]["resourceSliceCount"]) for s in got} == {
            (2, S)
        }
        assert pub.writes == 2 * S


async def test_server_errors_back_off_and_nothing_dies(pools: tuple[Pool, ...]) -> None:
    async with ApiServerStandIn() as srv:
        srv.fail_discovery = 2
        srv.fail_writes = 3
        client = ResourceClient.for_url(srv.url)
        pub = Publisher(client, PublisherSettings(NODE, DRIVER, backoff_min_s=0.01), pools)
        await pub.start()  # returns at once: discovery is retried in the background
        await asyncio.wait_for(pub.wait_idle(), 60)
        assert srv.fail_discovery == 0 and srv.fail_writes == 0
        assert pub.errors >= 3 and len(srv.node_slices(NODE)) == S
        # No Node object: slices go without ownerReferences rather than not at all.
        assert "ownerReferences" not in srv.node_slices(NODE)[0]["metadata"]
        await pub.stop()
        await client.close()


async def test_the_stand_in_refuses_what_the_api_server_refuses(pools: tuple[Pool, ...]) -> None:
    good = slices.build_slices(NODE, DRIVER, pools)[0]

    def spoiled(change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        obj = json.loads(json.dumps(good))
        change(obj)
        return obj

    bad = [
        spoiled(lambda o: o["spec"].update(bogus=1)),  # unknown field (strict schema)
        spoiled(lambda o: o["spec"]["devices"].extend(o["spec"]["devices"][:1])),  # 129 devices, a duplicate
        spoiled(lambda o: o["spec"]["devices"][0]["attributes"].update({"bad-name": {"int": 1}})),
        spoiled(lambda o: o["spec"]["devices"][0]["attributes"].update(x={"int": 1, "bool": True})),
        spoiled(lambda o: o["spec"]["devices"][0]["attributes"].update(x={"string": "s" * 65})),
        spoiled(lambda o: o["spec"]["pool"].update(resourceSliceCount=0)),
        spoiled(lambda o: o["spec"]["devices"][0].update(name="PCI_0")),
        spoiled(lambda o: o["spec"]["pool"].update(generation="1")),  # schema: integer
    ]

    async with ApiServerStandIn() as srv:
        client = ResourceClient.for_url(srv.url)
        await client.discover()
        for obj in bad:
            with pytest.raises(ApiError) as exc:
                await client.create_slice(obj)
            assert exc.value.status == 422 and len(exc.value.message) <= 300
        assert len(srv.rejected) == len(bad) and not srv.slices
        stored = await client.create_slice(good)
        # Immutable fields and stale resourceVersions, as the real server enforces them.
        moved = {**stored, "spec": {**stored["spec"], "nodeName": "elsewhere"}}
        with pytest.raises(ApiError, match="immutable"):
            await client.replace_slice(moved)
        await client.replace_slice(stored)
        with pytest.raises(ApiError) as conflict:
            await client.replace_slice(stored)
        assert conflict.value.status == 409
        await client.close()


async def test_claim_reader_reads_claims_and_tokens_are_required() -> None:
    claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "net", "namespace": "team", "uid": "0b1c"},
        "spec": {"devices": {"requests": [{"name": "vf", "exactly": {"deviceClassName": "vfs.intel.com"}}]}},
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {"request": "vf", "driver": DRIVER, "pool": NODE, "device": "pci-0000-19-00-2"}
                    ]
                }
            }
        },
    }

    async with ApiServerStandIn(token="s3cret") as srv:
        srv.put_claim(claim)
        anonymous = ResourceClient.for_url(srv.url)
        with pytest.raises(ApiError) as exc:
            await anonymous.discover()
        assert exc.value.status == 401
        await anonymous.close()
        client = ResourceClient.for_url(srv.url, token="s3cret")
        reader = HttpClaimReader(client)
        got = await reader.get("team", "net")
        assert got["metadata"]["uid"] == "0b1c"
        assert got["status"]["allocation"]["devices"]["results"][0]["device"] == "pci-0000-19-00-2"
        with pytest.raises(ApiError) as missing:
            await reader.get("team", "gone")
        assert missing.value.status == 404
        await client.close()


async def test_kubeconfig_is_read_for_server_and_token(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"

    async with ApiServerStandIn(token="t0ken") as srv:
        srv.add_node(NODE)
        kubeconfig.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "c", "cluster": {"server": srv.url}}],
                    "users": [{"name": "u", "user": {"token": "t0ken"}}],
                    "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                    "current-context": "x",
                }
            )
        )
        client = await ResourceClient.from_kubeconfig(kubeconfig)
        assert await client.discover() is slices.ApiVersion.V1
        assert (await client.get_node(NODE))["metadata"]["name"] == NODE
        await client.close()


async def test_taints_mark_unhealthy_devices_and_fall_back_when_the_server_drops_them(
    node: simnode.NodeLayout, pools: tuple[Pool, ...]
) -> None:
    down = set(node.pfs[1].vf_addresses)

    clock = Clock()
    async with published(pools, clock=clock, taints=True) as (srv, pub, _):
        assert len(srv.node_slices(NODE)) == 2 * S  # 64 devices a slice with taints
        clock.now += 10
        pub.update(unhealthy=down)
        await asyncio.wait_for(pub.wait_idle(), 30)
        tainted = [d for s in srv.node_slices(NODE) for d in s["spec"]["devices"] if d.get("taints")]
        assert len(tainted) == 256 and len(_devices(srv)) == N and pub.writes == 2 * S + 4
    # A server with the DRADeviceTaints gate off drops them silently: withdraw instead, or the
    # unhealthy devices would look healthy.
    clock = Clock()
    async with published(pools, clock=clock, taints=True, drop_taints=True) as (srv, pub, _):
        clock.now += 10
        pub.update(unhealthy=down)
        await eventually(lambda: pub.taints_dropped, "the dropped taints noticed")
        # The re-layout waits for the rate limit of the PF's four slices written a moment ago
        # (two to rewrite, two to delete), the others it rewrites at once.
        pf_slices = {n for n in srv.slices if node.pfs[1].address.replace(":", "-").replace(".", "-") in n}
        await eventually(lambda: pub.deferred == pf_slices, "the PF's slices wait for their rate limit")
        clock.now += 10
        pub.poke()
        await asyncio.wait_for(pub.wait_idle(), 30)
        got = srv.node_slices(NODE)
        assert len(got) == S and len(_devices(srv)) == N - 256
        assert {s["spec"]["pool"]["generation"] for s in got} == {2}


async def test_a_generation_move_held_by_the_rate_limit_resumes_without_a_second_move(
    node: simnode.NodeLayout, pools: tuple[Pool, ...]
) -> None:
    clock = Clock()
    async with published(pools, clock=clock) as (srv, pub, _):
        pf0 = node.pfs[0]
        clock.now += 10
        pub.update(unhealthy={pf0.vf_addresses[200]})  # PF0's second slice written just now
        await asyncio.wait_for(pub.wait_idle(), 30)
        assert pub.writes == S + 1
        moved = _pools(
            node.root,
            [{"resourceName": "dp", "selectors": {"pfNames": [f"{pf0.netdev}#0-63"]}}, ALL_VFS],
        )
        pub.update(pools=moved)  # same instant: that slice must wait, the others move at once
        await eventually(lambda: len(pub.deferred) == 1, "PF0's rewritten slice waits")
        clock.now += 10
        pub.poke()
        await asyncio.wait_for(pub.wait_idle(), 30)
        got = srv.node_slices(NODE)
        assert {(s["spec"]["pool"]["generation"], s["spec"]["pool"]["resourceSliceCount"]) for s in got} == {
            (2, S)
        }
        assert pub.writes == 2 * S + 1  # every slice once at generation 2, none twice


def _slice_of(srv: ApiServerStandIn, address: str) -> str:
    """The name of the published slice holding the device of this PCI address."""
    return _devices(srv)[names.device_name(address)]


def _published(srv: ApiServerStandIn, address: str) -> bool:
    return names.device_name(address) in _devices(srv)


async def _one_pass(pub: Publisher) -> None:
    """Wake the publisher and wait until it has made a pass."""
    before = pub.passes
    pub.poke()
    await eventually(lambda: pub.passes > before, "a publishing pass")


async def test_a_hung_write_holds_up_only_its_own_slice(
    node: simnode.NodeLayout, pools: tuple[Pool, ...]
) -> None:
    clock = Clock()
    async with published(pools, clock=clock) as (srv, pub, _):
        a_dev, b_dev = node.pfs[0].vf_addresses[0], node.pfs[1].vf_addresses[0]
        a, b = _slice_of(srv, a_dev), _slice_of(srv, b_dev)
        tried = srv.tries[a]
        srv.hang_writes = {a}  # the server takes slice A's write and never answers it
        clock.now += 10
        pub.update(unhealthy={a_dev})
        await eventually(lambda: srv.hung[a] == 1, "slice A's write held at the stand-in")
        # Both change now: B's write must not queue behind A's unanswered one, and A is not written a
        # second time while its first write is still out.
        clock.now += 10
        a_dev2 = node.pfs[0].vf_addresses[1]
        pub.update(unhealthy={a_dev, a_dev2, b_dev})
        await eventually(lambda: not _published(srv, b_dev), "B's update stored while A's write hangs", 10.0)
        await _one_pass(pub)
        assert srv.tries[a] == tried + 1 and srv.hung[a] == 1
        assert _published(srv, a_dev)  # A's write never went through
        # The server answers again (504 for the held write, as an API server that gave up on it).
        srv.hang_writes = set()
        srv.release_hung()
        await eventually(lambda: pub.retrying.keys() == {a}, "A backing off after its failed write")
        clock.now += 60
        pub.poke()
        await asyncio.wait_for(pub.wait_idle(), 30)
        # The newest state of A, not the one its hung write carried.
        assert not _published(srv, a_dev) and not _published(srv, a_dev2)
        assert srv.tries[a] == tried + 2 and srv.writes[a] == 2 and srv.writes[b] == 2
        assert len(_devices(srv)) == N - 3


async def test_a_hung_write_is_cut_and_retried(node: simnode.NodeLayout, pools: tuple[Pool, ...]) -> None:
    clock = Clock()
    metrics = Metrics()
    async with published(pools, clock=clock, metrics=metrics) as (srv, pub, _):
        a_dev = node.pfs[2].vf_addresses[7]
        a = _slice_of(srv, a_dev)
        tried = srv.tries[a]
        # A short timeout for the hung writes only: the stand-in's schema checks take tens of ms a write.
        pub.settings = dataclasses.replace(pub.settings, write_timeout_s=0.1)
        srv.hang_writes = {a}
        clock.now += 10
        pub.update(unhealthy={a_dev})
        # Cut after write_timeout_s (real time), then retried once its backoff is over (fake time).
        await eventually(lambda: pub.retrying.keys() == {a}, "A's write cut and backing off")
        assert pub.timeouts == 1 and srv.tries[a] == tried + 1
        clock.now += 60
        pub.poke()
        await eventually(lambda: pub.timeouts == 2 and a in pub.retrying, "A's write retried and cut again")
        assert srv.tries[a] == tried + 2
        srv.hang_writes = set()
        pub.settings = dataclasses.replace(pub.settings, write_timeout_s=30.0)
        clock.now += 60
        pub.poke()
        await asyncio.wait_for(pub.wait_idle(), 30)
        assert not _published(srv, a_dev) and srv.writes[a] == 2 and srv.tries[a] == tried + 3
    body = metrics.registry.render().decode()
    assert f'densedev_dra_slice_write_timeouts_total{{driver="{DRIVER}"}} 2.0' in body


async def test_persistent_conflicts_back_off_with_growing_delays(
    node: simnode.NodeLayout, pools: tuple[Pool, ...], caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    metrics = Metrics()
    knobs: dict[str, Any] = {"backoff_min_s": 1.0, "backoff_max_s": 8.0}
    with caplog.at_level(logging.INFO, logger="densedev.dra.publisher"):
        async with published(pools, clock=clock, metrics=metrics, **knobs) as (srv, pub, _):
            a_dev, b_dev = node.pfs[3].vf_addresses[200], node.pfs[0].vf_addresses[5]
            a = _slice_of(srv, a_dev)
            tried = srv.tries[a]
            srv.conflict_writes = {a}  # another writer always wins slice A
            clock.now += 10
            pub.update(unhealthy={a_dev})
            # A fresh read and one retry at once (a single conflict is optimistic concurrency at work),
            # then nothing until the backoff is over, however many passes run meanwhile.
            await eventually(lambda: srv.tries[a] >= tried + 2, "A's write and its retry")
            await asyncio.sleep(0.2)  # room for a spinning publisher to show itself
            spun = srv.tries[a] - tried
            assert spun == 2, f"409s tried {spun} times while the clock stood still"
            await eventually(lambda: pub.retrying.get(a, 0.0) > clock.now, "A backing off")
            # Another slice is written meanwhile: the conflicts hold up nothing else.
            pub.update(unhealthy={a_dev, b_dev})
            await eventually(lambda: not _published(srv, b_dev), "B written while A backs off")
            # Delays with jitter lie in [d/2, d], d doubling from 1 s to the 8 s cap: before d/2 no
            # retry may come, by d exactly one. The stand-in counts every try.
            for step, d in enumerate((1.0, 2.0, 4.0, 8.0, 8.0)):
                before = srv.tries[a]
                clock.now += d / 2 - 0.01
                await _one_pass(pub)
                assert srv.tries[a] == before, f"retry {step} came before {d / 2} s"
                clock.now += d / 2 + 0.01
                pub.poke()
                await eventually(lambda n=before + 1: srv.tries[a] == n, f"retry {step} by {d} s")
                # Backing off again, from the moment its 409 came (after the re-read).
                await eventually(
                    lambda: pub.retrying.get(a, 0.0) > clock.now, f"A backing off after retry {step}"
                )
                assert srv.tries[a] == before + 1
            # The state changes while A backs off: the newest is what gets written once it can be.
            a_dev2 = node.pfs[3].vf_addresses[201]
            pub.update(unhealthy={a_dev2, b_dev})
            srv.conflict_writes = set()
            clock.now += 8
            pub.poke()
            await asyncio.wait_for(pub.wait_idle(), 30)
            assert _published(srv, a_dev) and not _published(srv, a_dev2) and not _published(srv, b_dev)
            assert srv.writes[a] == 2  # created, then the one write that got through
            conflicts = srv.tries[a] - tried - 1
            assert pub.conflicts == conflicts == 7
    mine = [r for r in caplog.records if getattr(r, "fields", {}).get("slice") == a]
    warned = [r for r in mine if r.levelno >= logging.WARNING]
    assert len(warned) == 1, [r.getMessage() for r in warned]  # once per slice, not once per conflict
    assert len(mine) == 2  # and one line when it went through
    body = metrics.registry.render().decode()
    assert f'densedev_dra_slice_write_conflicts_total{{driver="{DRIVER}"}} 7.0' in body


async def test_writes_in_flight_are_bounded_when_every_write_hangs(
    node: simnode.NodeLayout, pools: tuple[Pool, ...]
) -> None:
    clock = Clock()
    # With taints, 64 devices a slice: twice as many slices as writes allowed in flight.
    async with published(pools, clock=clock, taints=True) as (srv, pub, _):
        assert len(srv.slices) == 2 * WRITES_IN_FLIGHT
        by_name = {names.device_name(a): a for pf in node.pfs for a in pf.vf_addresses}
        one_each = {by_name[s["spec"]["devices"][0]["name"]] for s in srv.node_slices(NODE)}
        srv.hang_writes = set(srv.slices)
        clock.now += 10
        pub.update(unhealthy=one_each)  # a tainted device in every slice: every slice rewritten
        await eventually(lambda: srv.holding >= WRITES_IN_FLIGHT, "the first writes held")
        for _ in range(3):
            await _one_pass(pub)
        assert srv.holding == WRITES_IN_FLIGHT and sum(srv.hung.values()) == WRITES_IN_FLIGHT
        # Released with 504s: those slices back off, the others' writes go out and through.
        srv.hang_writes = set()
        srv.release_hung()
        await eventually(lambda: len(pub.retrying) == WRITES_IN_FLIGHT, "the held slices backing off")
        clock.now += 60
        pub.poke()
        await asyncio.wait_for(pub.wait_idle(), 30)
        tainted = [d["name"] for s in srv.node_slices(NODE) for d in s["spec"]["devices"] if d.get("taints")]
        assert sorted(tainted) == sorted(names.device_name(a) for a in one_each)
        assert set(srv.writes.values()) == {2} and srv.holding == 0


async def test_creates_answered_404_back_off(pools: tuple[Pool, ...]) -> None:
    clock = Clock()
    async with published(pools, clock=clock) as (srv, pub, _):
        # The server stops serving resource.k8s.io/v1 (a downgrade) and the kubelet wipes the slices: the
        # creates get 404, which for a create means "not served", not "gone meanwhile".
        srv.versions = ("v1beta1",)
        clock.now += 10
        srv.wipe_node(NODE)
        await eventually(lambda: len(pub.retrying) == S, "every slice backing off")
        await asyncio.sleep(0.2)  # room for a spinning publisher to show itself
        assert srv.requests["POST unserved"] == S
        srv.versions = ("v1", "v1beta1")
        clock.now += 60
        pub.poke()
        await asyncio.wait_for(pub.wait_idle(), 30)
        assert len(_devices(srv)) == N


async def test_our_creates_seen_on_the_watch_before_their_answers_are_not_someone_elses(
    pools4k: tuple[Pool, ...],
) -> None:
    # A busy API server often sends a create's watch event before its answer.  Taken for another
    # writer's content, each such event made the next pass look at every published device for one that
    # moved: at 512 slices that was a quadratic start.
    async with ApiServerStandIn() as srv:
        srv.add_node(NODE)
        srv.answer_late_s = 0.02
        client = ResourceClient.for_url(srv.url)
        pub = Publisher(client, PublisherSettings(NODE, DRIVER, min_write_interval_s=0.0), pools4k)
        try:
            await pub.start()
            await asyncio.wait_for(pub.wait_idle(), 60)
            assert len(_devices(srv)) == 4096 and pub.writes == 32
            assert pub.layout_checks <= 1, pub.layout_checks
            # Another writer's change is still looked into.
            name = srv.node_slices(NODE)[0]["metadata"]["name"]
            srv.external_update(name, lambda s: s["metadata"].setdefault("labels", {}).update(x="y"))
            await eventually(lambda: pub.layout_checks == 2, "the foreign change checked")
        finally:
            await pub.stop()
            await client.close()
