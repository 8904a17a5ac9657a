"""The claim's device status (issue 25 §3): status.devices[] written after Prepare, cleared at Unprepare.

Against the API-server stand-in over real HTTP, which serves ``resourceclaims/<name>/status`` the way the
real server does (resourceVersion checks, the allocation immutable, entries naming allocated devices only,
the official schema, strict) and injects 500s and 409s; the node service reads its claims from it too.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers.dra import DRIVER, NODE, VF, VF2, Node
from helpers.dra_daemon import Node as DaemonNode
from helpers.dra_daemon import cluster, pool
from helpers.metrics import sample

from densedev.dra import classes, names
from densedev.dra.apiclient import ApiError, HttpClaimReader, ResourceClient
from densedev.dra.claims import ClaimRef, PreparedDevice
from densedev.dra.names import DEFAULT_DRIVER_NAME
from densedev.dra.node import NodeService
from densedev.dra.status import ClaimStatus, NetInfo
from densedev.ops.metrics import Metrics
from densedev.testing.apiserver import ApiServerStandIn

ROOT = Path(__file__).resolve().parents[1]
OTHER = "gpu.example.com"  # another driver with a device in the same claim
# A config of ours that changes nothing: this node service has no VF links to change (the settings'
# own way to the status, through the journal, is tested end to end with a daemon).
PARAMS = {"apiVersion": "net.densedev.io/v1alpha1", "kind": "VfConfig"}
FAST = (0.01, 0.05)  # backoff bounds for tests: retries within milliseconds


def claim_doc(version: str, name: str, uid: str, results: list[dict[str, Any]]) -> dict[str, Any]:
    """An allocated claim as the scheduler leaves it, with a claim config for our driver, in ``version``."""
    requests = sorted({r["request"] for r in results})
    if version == "v1":
        reqs: list[dict[str, Any]] = [{"name": r, "exactly": {"deviceClassName": "vf"}} for r in requests]
    else:  # v1beta1 (1.32-1.33): the request's fields sit on the request itself
        reqs = [{"name": r, "deviceClassName": "vf"} for r in requests]
    config = [{"requests": [], "opaque": {"driver": DRIVER, "parameters": PARAMS}}]
    return {
        "apiVersion": f"resource.k8s.io/{version}",
        "kind": "ResourceClaim",
        "metadata": {"namespace": "default", "name": name, "uid": uid},
        "spec": {"devices": {"requests": reqs, "config": config}},
        "status": {
            "allocation": {
                "devices": {"results": results, "config": [{"source": "FromClaim", **config[0]}]},
            }
        },
    }


def result(request: str, device_id: str, driver: str = DRIVER, pool_name: str = NODE) -> dict[str, Any]:
    """One allocation result naming a device of ours by its PCI address (or another driver's device)."""
    device = names.device_name(device_id) if driver == DRIVER else device_id
    return {"request": request, "driver": driver, "pool": pool_name, "device": device}


class Setup:
    """A node service reading claims from the stand-in, its ClaimStatus writing to it."""

    def __init__(self, node: Node, srv: ApiServerStandIn, client: ResourceClient, version: str) -> None:
        self.node, self.srv, self.client, self.version = node, srv, client, version
        self.metrics = Metrics()
        self.connected = True
        self.status = self.claim_status()
        self.service = NodeService(node.settings, HttpClaimReader(client), node.gate())
        self.service.recover()
        self.service.claim_status = self.status

    def claim_status(self, **kw: Any) -> ClaimStatus:
        table = self.node.table

        def describe(device_id: str) -> NetInfo:
            d = table[device_id][0]
            return NetInfo(d.netdevs[0] if d.netdevs else "")

        kw.setdefault("backoff", FAST)
        return ClaimStatus(
            DRIVER,
            lambda: self.client if self.connected else None,
            describe=describe,
            metrics=self.metrics,
            **kw,
        )

    def put(self, *results: dict[str, Any], name: str = "") -> ClaimRef:
        uid = str(uuid.uuid4())
        name = name or f"claim-{uid[:8]}"
        self.srv.put_claim(claim_doc(self.version, name, uid, list(results)))
        return ClaimRef("default", name, uid)

    def stored(self, ref: ClaimRef) -> dict[str, Any]:
        return self.srv.claim(ref.namespace, ref.name)

    def entries(self, ref: ClaimRef, driver: str = DRIVER) -> list[dict[str, Any]]:
        devices = self.stored(ref)["status"].get("devices") or []
        return [e for e in devices if e["driver"] == driver]

    def counter(self, name: str, **labels: str) -> float:
        for family in self.metrics.registry.collect():
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    return float(s.value)
        return 0.0

    async def settled(self) -> None:
        await asyncio.wait_for(self.status.idle(), 10)


@pytest.fixture(params=["v1", "v1beta1"])
async def setup(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Setup]:
    version = request.param
    async with ApiServerStandIn(versions=(version,)) as srv:
        client = ResourceClient.for_url(srv.url)
        await client.discover()
        s = Setup(Node(tmp_path), srv, client, version)
        try:
            yield s
        finally:
            await s.status.close()
            await client.close()
            assert srv.rejected == [], srv.rejected


async def test_prepare_writes_ready_entries_for_our_devices(setup: Setup) -> None:
    ref = setup.put(result("vf", VF), result("vf", VF2))
    config_before = setup.stored(ref)["status"]["allocation"]["devices"]["config"]
    answer = (await setup.service.prepare([ref]))[ref.uid]
    assert answer.error == ""
    await setup.settled()
    entries = {e["device"]: e for e in setup.entries(ref)}
    assert set(entries) == {names.device_name(VF), names.device_name(VF2)}
    e = entries[names.device_name(VF)]
    assert (e["driver"], e["pool"]) == (DRIVER, NODE)
    (ready,) = e["conditions"]
    assert (ready["type"], ready["status"], ready["reason"]) == ("Ready", "True", "Prepared")
    assert ready["observedGeneration"] == 1
    assert e["networkData"] == {"interfaceName": "ens1f0v2"}  # no MAC known: none written
    assert e["data"] == {
        "apiVersion": "net.densedev.io/v1alpha1",
        "kind": "VfStatus",
        "pciAddress": VF,
        "adminAccess": False,
        "applied": {},
    }
    # Through the status subresource of the version the driver talks, the allocation (and the config
    # the scheduler copied into it) kept as it was.
    assert setup.srv.requests["PUT resourceclaims/status"] == 1
    assert setup.stored(ref)["apiVersion"] == f"resource.k8s.io/{setup.version}"
    assert setup.stored(ref)["status"]["allocation"]["devices"]["config"] == config_before
    assert setup.counter("densedev_dra_claim_status_writes_total", driver=DRIVER, op="report") == 1
    assert setup.counter("densedev_dra_claim_status_pending", driver=DRIVER) == 0
    # A repeated Prepare (kubelet restart) finds the status as wished: read, nothing written.
    await setup.service.prepare([ref])
    await setup.settled()
    assert setup.srv.requests["PUT resourceclaims/status"] == 1


async def test_applied_settings_show_in_data_and_network_data(setup: Setup) -> None:
    ref = setup.put(result("vf", VF))
    await setup.service.prepare([ref])
    await setup.settled()
    (first,) = setup.entries(ref)
    since = first["conditions"][0]["lastTransitionTime"]
    applied = {"mac": "02:00:00:00:00:2a", "ifName": "net1", "vlan": 100, "mtu": 9000}
    device = setup.service.prepared[ref.uid].devices
    setup.status.prepared(ref, device, {VF: applied})
    await setup.settled()
    (e,) = setup.entries(ref)
    # The name the CNI gives it in the pod and the MAC set on it, over the host's view.
    assert e["networkData"] == {"interfaceName": "net1", "hardwareAddress": "02:00:00:00:00:2a"}
    assert e["data"]["applied"] == applied
    assert "mac, mtu, vlan" in e["conditions"][0]["message"]
    assert e["conditions"][0]["lastTransitionTime"] == since  # still Ready: no transition


async def test_a_conflict_reads_again_and_writes(setup: Setup) -> None:
    setup.srv.claim_status_conflicts = 2  # another writer changes the claim twice first
    ref = setup.put(result("vf", VF))
    await setup.service.prepare([ref])
    await setup.settled()
    assert len(setup.entries(ref)) == 1
    assert setup.srv.claim_status_tries[("default", ref.name)] == 3
    assert setup.srv.claim_status_writes[("default", ref.name)] == 1
    assert setup.counter("densedev_dra_claim_status_failures_total", driver=DRIVER, reason="conflict") == 2


async def test_failures_are_retried_and_never_fail_or_delay_prepare(setup: Setup) -> None:
    setup.srv.claim_status_fail = 3
    setup.srv.claim_status_delay = 0.2  # each status request takes a while
    ref = setup.put(result("vf", VF))
    answer = (await setup.service.prepare([ref]))[ref.uid]
    # Prepare answered before any status write went through: they are queued.
    assert answer.error == "" and setup.status.pending == 1
    assert setup.srv.claim_status_writes[("default", ref.name)] == 0
    await setup.settled()
    assert len(setup.entries(ref)) == 1
    assert setup.srv.claim_status_tries[("default", ref.name)] == 4
    assert setup.counter("densedev_dra_claim_status_failures_total", driver=DRIVER, reason="error") == 3


async def test_an_api_server_away_gives_up_after_bounded_attempts(
    setup: Setup, caplog: pytest.LogCaptureFixture
) -> None:
    setup.connected = False
    ref = setup.put(result("vf", VF))
    with caplog.at_level(logging.WARNING, logger="densedev.dra.status"):
        answer = (await setup.service.prepare([ref]))[ref.uid]
        assert answer.error == ""
        await setup.settled()
    assert setup.entries(ref) == []
    assert setup.counter("densedev_dra_claim_status_failures_total", driver=DRIVER, reason="gave_up") == 1
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "given up (the claim stays prepared)" in lines[0], lines


async def test_unprepare_clears_our_entries_and_keeps_the_others(setup: Setup) -> None:
    ref = setup.put(result("vf", VF), result("gpu", "gpu-0", driver=OTHER, pool_name="gpus"))
    theirs = {
        "driver": OTHER,
        "pool": "gpus",
        "device": "gpu-0",
        "data": {"note": "written by the other driver"},
    }
    stored = setup.stored(ref)
    stored["status"]["devices"] = [theirs]
    await setup.service.prepare([ref])
    await setup.settled()
    assert [e["driver"] for e in setup.stored(ref)["status"]["devices"]] == [OTHER, DRIVER]
    assert (await setup.service.unprepare([ref])) == {ref.uid: ""}
    await setup.settled()
    assert setup.stored(ref)["status"]["devices"] == [theirs]
    assert setup.counter("densedev_dra_claim_status_writes_total", driver=DRIVER, op="clear") == 1


async def test_unprepare_right_after_prepare_ends_with_no_entry(setup: Setup) -> None:
    setup.srv.claim_status_fail = 1  # the report is in backoff when the clear comes
    # A backoff far beyond the hang guard: only the clear waking the report's wait ends it in time.
    setup.status = setup.service.claim_status = setup.claim_status(backoff=(30.0, 30.0))
    ref = setup.put(result("vf", VF))
    await setup.service.prepare([ref])
    await setup.service.unprepare([ref])
    await setup.settled()
    assert setup.entries(ref) == []
    # The clear replaced the report waiting to retry: nothing was written only to be removed.
    assert setup.srv.claim_status_writes[("default", ref.name)] == 0


async def test_writes_run_at_most_four_at_once(setup: Setup) -> None:
    setup.srv.claim_status_delay = 0.2
    refs = [setup.put(result("vf", VF), name=f"c{i}") for i in range(12)]
    for ref in refs:  # twelve claims of one device: reported straight to the writer (no gate)
        setup.status.prepared(ref, setup_devices_of(VF))
    assert setup.counter("densedev_dra_claim_status_pending", driver=DRIVER) == 12
    await setup.settled()
    assert all(len(setup.entries(r)) == 1 for r in refs)
    # Never more than four at the server; and four at once, all twelve having started together.
    assert setup.srv.claim_status_peak <= 4 and setup.status.peak == 4


async def test_a_replaced_claim_or_a_gone_one_is_left_alone(setup: Setup) -> None:
    ref = setup.put(result("vf", VF), name="same")
    await setup.service.prepare([ref])
    await setup.settled()
    replaced = setup.put(result("vf", VF2), name="same")  # deleted and made anew: another UID
    setup.status.unprepared(ref)
    setup.status.unprepared(ClaimRef("default", "gone", str(uuid.uuid4())))
    await setup.settled()
    assert setup.srv.claim_status_writes[("default", "same")] == 1  # only the first report
    assert replaced.uid != ref.uid


async def test_a_server_dropping_the_field_is_said_once_and_not_retried(
    setup: Setup, caplog: pytest.LogCaptureFixture
) -> None:
    setup.srv.drop_device_status = True  # a 1.32 server, DRAResourceClaimDeviceStatus off
    ref = setup.put(result("vf", VF))
    with caplog.at_level(logging.WARNING, logger="densedev.dra.status"):
        await setup.service.prepare([ref])
        await setup.settled()
    assert setup.srv.claim_status_tries[("default", ref.name)] == 1
    assert "DRAResourceClaimDeviceStatus" in caplog.text
    assert setup.counter("densedev_dra_claim_status_failures_total", driver=DRIVER, reason="dropped") == 1


async def test_the_stand_in_refuses_what_the_real_server_refuses(setup: Setup) -> None:
    ref = setup.put(result("vf", VF))
    stale = json.loads(json.dumps(setup.stored(ref)))
    await setup.client.replace_claim_status(stale)  # as read: accepted, and the claim's version moves on
    obj = setup.stored(ref)
    wrong = json.loads(json.dumps(obj))
    wrong["status"]["devices"] = [{"driver": DRIVER, "pool": NODE, "device": names.device_name(VF2)}]
    moved = json.loads(json.dumps(obj))
    moved["status"]["allocation"]["devices"]["config"] = []
    for body, code in ((stale, 409), (wrong, 422), (moved, 422)):
        with pytest.raises(ApiError) as exc:
            await setup.client.replace_claim_status(body)
        assert exc.value.status == code
    setup.srv.rejected.clear()


def test_rbac_grants_the_status_writes() -> None:
    objs = classes.manifests((), DRIVER)
    (role,) = [o for o in objs if o["kind"] == "ClusterRole"]
    rules = {r["resources"][0]: r for r in role["rules"]}
    assert set(rules["resourceclaims/status"]["verbs"]) == {"get", "update", "patch"}
    assert rules["resourceclaims/driver"]["resourceNames"] == [DRIVER]
    # The overlay's copy says the same (tests/test_deploy.py checks the whole of it agrees).
    docs = list(yaml.safe_load_all((ROOT / "deploy/components/dra/rbac.yaml").read_text()))
    (deployed,) = [d for d in docs if d["kind"] == "ClusterRole"]
    assert {r["resources"][0]: set(r["verbs"]) for r in deployed["rules"]}["resourceclaims/status"] == {
        "get",
        "update",
        "patch",
    }


# -- the daemon: the DRA kubelet emulator prepares, the stand-in shows the status ------------------------


async def test_the_daemon_reports_and_clears_a_claims_status(tmp_path: Path) -> None:
    node = DaemonNode(tmp_path)
    try:
        node.write([pool("dp", [node.pf0.netdev]), pool("dra", [node.pf1.netdev], api="dra")])
        address = node.pf1.vf_addresses[1]
        async with cluster(node) as c:
            daemon = c.daemon
            assert daemon is not None
            await c.until(lambda: DEFAULT_DRIVER_NAME in c.dra_kubelet.plugins, "the DRA plugin registered")
            ns, name, uid = node.claim(address)
            answer = (await c.dra_kubelet.prepare(DEFAULT_DRIVER_NAME, [(ns, name, uid)]))[uid]
            assert answer.error == ""

            def ours() -> list[dict[str, Any]]:
                return c.api.claim(ns, name)["status"].get("devices") or []

            await c.until(lambda: len(ours()) == 1, "the claim's status written")
            (e,) = ours()
            assert e["device"] == names.device_name(address)
            assert e["data"]["pciAddress"] == address
            assert e["conditions"][0]["type"] == "Ready"
            assert e["networkData"]["interfaceName"]  # the VF's netdev on the simulated node
            assert sample(daemon, "densedev_dra_claim_status_writes_total", op="report") == 1
            # A write lost with a restart (here: someone else removed it meanwhile) is made again
            # for the claims the restarted daemon recovers.
            await c.stop_daemon()
            c.api.claim(ns, name)["status"].pop("devices")
            daemon = await c.start_daemon()
            await c.until(lambda: len(ours()) == 1, "the recovered claim's status written again")
            assert ours()[0]["data"] == e["data"] and ours()[0]["networkData"] == e["networkData"]
            assert (await c.dra_kubelet.unprepare(DEFAULT_DRIVER_NAME, [(ns, name, uid)])) == {uid: ""}
            await c.until(lambda: ours() == [], "the claim's status cleared")
            assert sample(daemon, "densedev_dra_claim_status_writes_total", op="clear") == 1
    finally:
        node.cleanup()


class Refusing:
    """A StatusClient whose writes the server refuses with ``status`` (403: the RBAC rule missing)."""

    def __init__(self, status: int, claim: dict[str, Any]) -> None:
        self.status, self.claim, self.puts = status, claim, 0

    async def get_claim(self, namespace: str, name: str) -> dict[str, Any]:
        return self.claim

    async def replace_claim_status(self, obj: Any) -> dict[str, Any]:
        self.puts += 1
        raise ApiError(self.status, "Forbidden" if self.status == 403 else "Invalid", "refused")


@pytest.mark.parametrize("code", [403, 422])
async def test_a_refused_write_is_said_once_and_not_retried(
    code: int, caplog: pytest.LogCaptureFixture
) -> None:
    uid = str(uuid.uuid4())
    client = Refusing(code, claim_doc("v1", "c", uid, [result("vf", VF)]))
    metrics = Metrics()
    status = ClaimStatus(DRIVER, lambda: client, metrics=metrics, backoff=FAST)
    ref = ClaimRef("default", "c", uid)
    with caplog.at_level(logging.WARNING, logger="densedev.dra.status"):
        status.prepared(ref, setup_devices_of(VF))
        await asyncio.wait_for(status.idle(), 10)
    assert client.puts == 1
    (line,) = [r.getMessage() for r in caplog.records]
    assert "not retried" in line and (code != 403 or "resourceclaims/status" in line)
    refused = metrics.dra_claim_status_failures.labels(DRIVER, "refused")
    assert refused.value == 1


def setup_devices_of(device_id: str) -> tuple[Any, ...]:
    """One PreparedDevice of request ``vf`` for this device, as Prepare gives it."""
    return (PreparedDevice(("vf",), NODE, names.device_name(device_id), device_id, ()),)


async def test_the_docs_example_is_what_the_driver_writes(tmp_path: Path) -> None:
    section = (ROOT / "docs/dra.md").read_text().split("## What a claim shows after Prepare", 1)[1]
    shown = yaml.safe_load(re.findall(r"```yaml\n(.*?)```", section, re.S)[0])["status"]["devices"]
    ours, theirs = shown
    applied = ours["data"]["applied"]
    async with ApiServerStandIn(versions=("v1",)) as srv:
        client = ResourceClient.for_url(srv.url)
        await client.discover()
        uid = str(uuid.uuid4())
        doc = claim_doc("v1", "c", uid, [result("vf", VF), result("gpu", "gpu-0", OTHER, "gpus")])
        doc["status"]["devices"] = [theirs]
        srv.put_claim(doc)
        status = ClaimStatus(
            DRIVER,
            lambda: client,
            describe=lambda _id: NetInfo("ens1f0v2"),
            now=lambda: datetime(2026, 12, 5, 7, 30, tzinfo=UTC),
        )
        status.prepared(ClaimRef("default", "c", uid), setup_devices_of(VF), {VF: applied})
        await asyncio.wait_for(status.idle(), 10)
        await client.close()
        written = srv.claim("default", "c")["status"]["devices"]
        # Entry for entry (ours go after the entries already there; the page shows ours first).
        assert sorted(written, key=lambda e: e["driver"]) == sorted(shown, key=lambda e: e["driver"])
        assert srv.rejected == []
