"""Configured devices as the rest of the node sees them (issue 25): what the pod is told, what the claim
shows, and health, rescans and reloads on a VF a claim changed.

``ifName`` reaches the container's ``_INFO`` variables and the device-info file (the two places a CNI or an
application reads it); a claim's ``mac`` and ``ifName`` reach its status at the API-server stand-in through
the real daemon; a configured VF whose PF goes down is reported unhealthy, stays held and configured
across a rescan and a reload, and Unprepare still puts it back.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers.dra_daemon import DRA, by_name, cluster, pool
from helpers.dra_daemon import NODE as DAEMON_NODE
from helpers.dra_daemon import Node as DaemonNode
from helpers.metrics import sample
from test_dra_journal import DRIVER, NODE, JournalNode

from densedev.alloc import devinfo
from densedev.dra import names
from densedev.dra.claims import ClaimRef
from densedev.dra.names import DEFAULT_DRIVER_NAME
from densedev.dra.params import API_VERSION, KIND
from densedev.node import rebind
from densedev.node.vflinks import SIM_DEFAULTS, SimVfLinks, VfTarget
from densedev.pools.ownership import DRA_CLAIMS
from densedev.testing.dra_kubelet import allocated_claim
from densedev.testing.simkernel import SimKernel

TEMPLATES = Path(__file__).parent / "data" / "dra_params"  # the templates docs/dra.md shows


@pytest.fixture
def node(tmp_path: Path) -> JournalNode:
    return JournalNode(tmp_path)


def env_of(node: JournalNode, uid: str) -> dict[str, str]:
    """Every env variable the claim's CDI spec sets, over all its entries."""
    spec = json.loads((node.settings.cdi_dir / node.service.prepared[uid].spec_file).read_text())
    out: dict[str, str] = {}
    for d in spec["devices"]:
        for e in d.get("containerEdits", {}).get("env", []):
            k, _, v = e.partition("=")
            out[k] = v
    return out


def info_file(node: JournalNode, device_id: str) -> dict[str, Any]:
    path = node.settings.devinfo_dir / devinfo.file_name("example.com", "vf_pool", device_id)  # type: ignore[operator]
    return json.loads(path.read_text())


@pytest.mark.parametrize("ask", [{"ifName": "net1"}, {"ifName": "net1", "vlan": 100, "mtu": 9000}])
async def test_if_name_reaches_info_env_device_info_and_applied(
    node: JournalNode, ask: dict[str, Any]
) -> None:
    vf, other = node.vfs[0], node.vfs[1]
    ref = node.claim(vf, ask)
    assert (await node.service.prepare([ref]))[ref.uid].error == ""
    env = env_of(node, ref.uid)
    infos = {k: json.loads(v) for k, v in env.items() if k.endswith("_INFO")}
    # The device's own <ENV>_<ADDRESS>_INFO and the request's combined _INFO both name it.
    assert len(infos) == 2, sorted(infos)
    for info in infos.values():
        assert info[vf.id]["generic"] == {"deviceID": vf.id, "ifName": "net1"}
    assert info_file(node, vf.id)["pci"]["interface-name"] == "net1"
    assert node.service.prepared[ref.uid].applied[vf.id]["ifName"] == "net1"
    # A claim without ifName tells nothing of the kind (the files as they always were).
    plain = node.claim(other, {})
    assert (await node.service.prepare([plain]))[plain.uid].error == ""
    for k, v in env_of(node, plain.uid).items():
        if k.endswith("_INFO"):
            assert json.loads(v)[other.id]["generic"] == {"deviceID": other.id}
    assert "interface-name" not in info_file(node, other.id)["pci"]
    # Kept over a restart (the checkpoint holds it) and gone with Unprepare.
    again = node.fresh()
    again.recover()
    assert again.prepared[ref.uid].applied[vf.id]["ifName"] == "net1"
    assert (await again.unprepare([ref]))[ref.uid] == ""
    assert node.values(vf) == dict(SIM_DEFAULTS)
    assert ref.uid not in again.prepared
    path = node.settings.devinfo_dir / devinfo.file_name("example.com", "vf_pool", vf.id)  # type: ignore[operator]
    assert not path.exists()


async def test_the_daemon_shows_a_claims_mac_and_if_name_in_its_status(tmp_path: Path) -> None:
    node = DaemonNode(tmp_path)
    try:
        node.write([pool("dp", [node.pf0.netdev]), pool("dra", [node.pf1.netdev], api="dra")])
        address = node.pf1.vf_addresses[1]
        links = SimVfLinks(node.sysfs)
        target = VfTarget(node.pf1.netdev, 1, "")
        before = links.read(target, ("mac", "vlan", "qos"))
        async with cluster(node) as c:
            await c.until(lambda: DEFAULT_DRIVER_NAME in c.dra_kubelet.plugins, "the DRA plugin registered")
            ask = {"mac": "02:00:00:00:00:2A", "ifName": "net1", "vlan": 100}
            ns, name, uid = put_claim(node, address, ask)
            answer = (await c.dra_kubelet.prepare(DEFAULT_DRIVER_NAME, [(ns, name, uid)]))[uid]
            assert answer.error == ""

            def ours() -> list[dict[str, Any]]:
                assert node.api is not None
                return node.api.claim(ns, name)["status"].get("devices") or []

            await c.until(lambda: len(ours()) == 1, "the claim's status written")
            (e,) = ours()
            # What the journal applied and the name asked, through NodeService.applied to the writer.
            assert e["networkData"] == {"interfaceName": "net1", "hardwareAddress": "02:00:00:00:00:2a"}
            applied = {"ifName": "net1", "mac": "02:00:00:00:00:2a", "vlan": 100, "qos": 0}
            assert e["data"]["applied"] == applied
            assert "ifName, mac, qos, vlan" in e["conditions"][0]["message"]
            assert links.read(target, ("mac", "vlan"))["mac"] == "02:00:00:00:00:2a"
            assert (await c.dra_kubelet.unprepare(DEFAULT_DRIVER_NAME, [(ns, name, uid)])) == {uid: ""}
            await c.until(lambda: ours() == [], "the claim's status cleared")
            assert links.read(target, ("mac", "vlan", "qos")) == before
    finally:
        node.cleanup()


def put_claim(node: DaemonNode, address: str, parameters: dict[str, Any]) -> tuple[str, str, str]:
    """Store at the stand-in a claim allocated one VF with a VfConfig for our driver; return its ref."""
    assert node.api is not None
    uid = str(uuid.uuid4())
    name = f"claim-{uid[:8]}"
    result = {
        "request": "nic",
        "driver": DEFAULT_DRIVER_NAME,
        "pool": DAEMON_NODE,
        "device": names.device_name(address),
    }
    config = {
        "source": "FromClaim",
        "requests": [],
        "opaque": {
            "driver": DEFAULT_DRIVER_NAME,
            "parameters": {"apiVersion": API_VERSION, "kind": KIND, **parameters},
        },
    }
    node.api.put_claim(allocated_claim("default", name, uid, [result], [config]))
    return ("default", name, uid)


async def test_configured_vfs_go_unhealthy_with_their_pf_and_survive_rescans_and_reloads(
    tmp_path: Path,
) -> None:
    node = DaemonNode(tmp_path)
    dev = node.tmp / "dev"
    (dev / "vfio").mkdir(parents=True, exist_ok=True)
    (dev / "vfio" / "vfio").touch()  # the container node, there once vfio is loaded
    kernel = SimKernel(node.sysfs, dev).start()  # answers the rebind to vfio-pci
    try:
        node.write([pool("dp", [node.pf0.netdev]), pool("dra", [node.pf1.netdev], api="dra")])
        pf1 = node.pf1.vf_addresses
        vlan_vf, dpdk_vf = pf1[1], pf1[2]
        links = SimVfLinks(node.sysfs)
        targets = {vlan_vf: VfTarget(node.pf1.netdev, 1, ""), dpdk_vf: VfTarget(node.pf1.netdev, 2, "")}
        before = {a: links.values(t) for a, t in targets.items()}
        bound = rebind.binding_of(node.sysfs, dpdk_vf)
        asks = {
            vlan_vf: {"vlan": 100, "qos": 2, "trust": True, "ifName": "net1"},
            dpdk_vf: {"driver": "vfio-pci", "vlan": 200, "spoofChk": True},
        }
        async with cluster(node) as c:
            daemon = c.daemon
            assert daemon is not None
            await c.until(lambda: DEFAULT_DRIVER_NAME in c.dra_kubelet.plugins, "the DRA plugin registered")
            await c.until(
                lambda: len(c.dra_kubelet.health(DEFAULT_DRIVER_NAME)) == len(pf1), "health streamed"
            )
            refs = {a: put_claim(node, a, ask) for a, ask in asks.items()}
            answers = await c.dra_kubelet.prepare(DEFAULT_DRIVER_NAME, list(refs.values()))
            assert {uid: a.error for uid, a in answers.items()} == {r[2]: "" for r in refs.values()}

            def health(address: str) -> str:
                key = (DAEMON_NODE, names.device_name(address))
                return c.dra_kubelet.health(DEFAULT_DRIVER_NAME).get(key, "")

            def configured() -> None:
                """Both VFs held by their claims and still as their claims asked."""
                for address in asks:
                    assert daemon.ownership.held.get(address) == frozenset({DRA_CLAIMS}), address
                assert {k: links.values(targets[vlan_vf])[k] for k in ("vlan", "qos", "trust")} == {
                    "vlan": 100,
                    "qos": 2,
                    "trust": True,
                }
                assert links.values(targets[dpdk_vf])["vlan"] == 200
                assert rebind.binding_of(node.sysfs, dpdk_vf).driver == "vfio-pci"
                assert daemon.dra is not None
                assert set(daemon.dra.plugin.service.prepared) == {r[2] for r in refs.values()}

            configured()
            # The PF goes down: its configured VFs are reported unhealthy like the others.
            daemon.set_links([(node.pf1.netdev, False)])
            await c.until(
                lambda: all(health(a) == "UNHEALTHY" for a in pf1), "the PF's VFs reported unhealthy"
            )
            assert sample(
                daemon, "densedev_pool_unhealthy_devices", resource=DRA, reason="pf-link-down"
            ) == len(pf1)

            # A full rescan sees the rebound VF as it is now (vfio-pci, no netdev): still held,
            # configured and unhealthy.
            rescans = sample(daemon, "densedev_resyncs_total", reason="rescan")
            daemon.request_rescan()
            await c.until(
                lambda: (
                    sample(daemon, "densedev_resyncs_total", reason="rescan") > rescans
                    and any(d.id == dpdk_vf and d.driver == "vfio-pci" for d in daemon.devices)
                ),
                "a rescan seeing the rebound VF",
            )
            async with daemon.rediscovery.lock:  # the rescan's apply done
                pass
            configured()
            assert health(vlan_vf) == health(dpdk_vf) == "UNHEALTHY"

            # A reload that rebuilds the DRA pool (its health policy changed): the same.
            node.write(
                [
                    pool("dp", [node.pf0.netdev]),
                    {**pool("dra", [node.pf1.netdev], api="dra"), "healthPolicy": {"holdDownSeconds": 0.1}},
                ]
            )
            assert await daemon.reload()
            configured()
            await c.until(
                lambda: all(health(a) == "UNHEALTHY" for a in pf1), "still unhealthy after the reload"
            )

            # The PF comes back: healthy again; Unprepare puts both VFs back as they were.
            daemon.set_links([(node.pf1.netdev, True)])
            try:
                await c.until(lambda: all(health(a) == "HEALTHY" for a in pf1), "the PF's VFs healthy again")
            except AssertionError:
                raise AssertionError({a: health(a) for a in pf1}) from None
            configured()
            assert (await c.dra_kubelet.unprepare(DEFAULT_DRIVER_NAME, list(refs.values()))) == {
                r[2]: "" for r in refs.values()
            }
            assert {a: links.values(t) for a, t in targets.items()} == before
            assert rebind.binding_of(node.sysfs, dpdk_vf) == bound
            for address in asks:
                assert address not in daemon.ownership.held
            await c.until(lambda: node.published() == by_name(pf1), "both VFs published again")
    finally:
        kernel.stop()
        node.cleanup()


@pytest.mark.parametrize("name", ["dpdk-vf.yaml", "vlan-vf.yaml", "rate-limited-vf.yaml"])
async def test_the_documented_templates_prepare_as_they_say(node: JournalNode, name: str) -> None:
    """docs/dra.md's template per use, allocated on the simulated node: prepared as asked, put back."""
    template = yaml.safe_load((TEMPLATES / name).read_text())
    devices = template["spec"]["spec"]["devices"]
    (request,) = devices["requests"]
    count = request["exactly"].get("count", 1)
    vfs = node.vfs[:count]
    results = [
        {"request": request["name"], "driver": DRIVER, "pool": NODE, "device": names.device_name(vf.id)}
        for vf in vfs
    ]
    config = [{"source": "FromClaim", **entry} for entry in devices["config"]]
    (asked,) = [
        {k: v for k, v in e["opaque"]["parameters"].items() if k not in ("apiVersion", "kind")}
        for e in devices["config"]
    ]
    uid = str(uuid.uuid4())
    node.store.put(allocated_claim("default", name, uid, results, config))
    ref = ClaimRef("default", name, uid)
    (node.dev_root / "vfio").mkdir(parents=True, exist_ok=True)
    (node.dev_root / "vfio" / "vfio").touch()
    bindings = {vf.id: rebind.binding_of(node.sysfs, vf.id) for vf in vfs}
    with SimKernel(node.sysfs, node.dev_root):
        assert (await node.service.prepare([ref]))[ref.uid].error == ""
        env = env_of(node, ref.uid)
        for vf in vfs:
            now = node.values(vf)
            links = {k: v for k, v in asked.items() if k not in ("driver", "ifName")}
            assert {k: now[k] for k in links} == links
            driver = rebind.binding_of(node.sysfs, vf.id).driver
            assert driver == asked.get("driver", bindings[vf.id].driver)
            # Every _INFO naming the VF (its own and the request's) carries what it is now.
            infos = [json.loads(v) for k, v in env.items() if k.endswith("_INFO")]
            (info,) = {json.dumps(i[vf.id], sort_keys=True) for i in infos if vf.id in i}
            assert json.loads(info)["generic"].get("ifName") == asked.get("ifName")
            assert ("vfio" in json.loads(info)) == (driver == "vfio-pci")
        assert (await node.service.unprepare([ref]))[ref.uid] == ""
        for vf in vfs:
            assert node.values(vf) == dict(SIM_DEFAULTS)
            assert rebind.binding_of(node.sysfs, vf.id) == bindings[vf.id]
