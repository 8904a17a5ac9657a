"""ResourceSlices and DeviceClasses as pure functions: layout, stability, attributes, schema validity."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

import pytest

from densedev.dra import classes, names, slices
from densedev.model import Pool, PoolApi
from densedev.node import scanner as discovery
from densedev.pools import config
from densedev.pools import select as selectors
from densedev.testing import simnode
from densedev.testing.apiserver import SchemaChecker, _slice_rules

DRIVER = names.DEFAULT_DRIVER_NAME
_CHECK = SchemaChecker()


def _valid(obj: dict[str, Any], k8s: str = "1.34") -> None:
    """Validate as the stand-in does: the official OpenAPI schema (strict) plus the API's written limits."""
    _CHECK.check(obj, k8s)
    if obj["kind"] == "ResourceSlice":
        _slice_rules(obj, obj["apiVersion"].rpartition("/")[2])


def _pools(root: Path, resources: list[dict[str, Any]]) -> tuple[Pool, ...]:
    cfg = config.parse(json.dumps({"resourceList": resources}))
    return slices.dra_pools(selectors.build_pools(cfg, discovery.scan(root).devices))


@pytest.fixture(scope="module")
def node4k(tmp_path_factory: pytest.TempPathFactory) -> simnode.NodeLayout:
    return simnode.build_node(tmp_path_factory.mktemp("node4k"), pfs=16, vfs_per_pf=256, rdma=True)


@pytest.fixture(scope="module")
def pools4k(node4k: simnode.NodeLayout) -> tuple[Pool, ...]:
    vfs = {"resourceName": "vfs", "api": "dra", "selectors": {"vendors": ["15b3"], "devices": ["101e"]}}
    return _pools(node4k.root, [vfs])


def test_4096_devices_split_into_valid_slices_of_at_most_128(
    node4k: simnode.NodeLayout, pools4k: tuple[Pool, ...]
) -> None:
    out = slices.build_slices("worker-7", DRIVER, pools4k)
    assert len(out) == 32  # 16 PFs x 256 VFs, two slices per PF
    seen: list[str] = []
    for s in out:
        _valid(s)
        spec = s["spec"]
        assert spec["pool"] == {"name": "worker-7", "generation": 1, "resourceSliceCount": 32}
        assert spec["nodeName"] == "worker-7" and spec["driver"] == DRIVER
        assert len(spec["devices"]) == 128
        seen += [d["name"] for d in spec["devices"]]
        # A slice holds the VFs of one PF only: a PF's change never touches another PF's slices.
        assert len({d["attributes"]["pfPciAddress"]["string"] for d in spec["devices"]}) == 1
    assert len(seen) == len(set(seen)) == 4096
    assert {names.pci_address(n) for n in seen} == set(node4k.vf_addresses)
    assert len({s["metadata"]["name"] for s in out}) == 32


def test_device_attributes_carry_what_pods_and_multus_select_by(
    node4k: simnode.NodeLayout, pools4k: tuple[Pool, ...]
) -> None:
    pf = node4k.pfs[1]
    out = slices.build_slices("n", DRIVER, pools4k)
    by_name = {d["name"]: d for s in out for d in s["spec"]["devices"]}
    dev = by_name[names.device_name(pf.vf_addresses[5])]
    a = {k: next(iter(v.values())) for k, v in dev["attributes"].items()}
    assert a["resourceName"] == "intel.com/vfs"
    assert a["pciAddress"] == pf.vf_addresses[5]
    assert a["pfName"] == pf.netdev and a["pfPciAddress"] == pf.address
    assert a["vfIndex"] == 5 and dev["attributes"]["vfIndex"] == {"int": 5}
    assert (a["vendor"], a["deviceID"], a["driver"]) == ("15b3", "101e", "mlx5_core")
    assert a["linkType"] == "ether" and a["netdev"] == pf.vf_netdevs[5]
    assert a["numaNode"] == pf.numa_node and dev["attributes"]["dra.net/numaNode"] == {"int": pf.numa_node}
    assert dev["attributes"]["rdma"] == {"bool": True} and a["rdmaDevice"] == pf.vf_ibdevs[5]
    assert re.fullmatch(r"pci[0-9a-f]{4}:[0-9a-f]{2}", a["resource.kubernetes.io/pcieRoot"])
    assert a["k8s.cni.cncf.io/resourceName"] == "intel.com/vfs"
    assert a["k8s.cni.cncf.io/deviceID"] == pf.vf_addresses[5]
    assert len(dev["attributes"]) <= 32


@pytest.mark.parametrize("version", list(slices.ApiVersion))
def test_a_builders_shared_attributes_equal_device_attributes_key_order_too(
    pools4k: tuple[Pool, ...], version: slices.ApiVersion
) -> None:
    # The builder shares what one PF's functions have in common; every device's attributes must still
    # be exactly device_attributes' (values, absent keys and order), whatever a device lacks.
    base = pools4k[0].members[0].device
    long = "x" * (slices.MAX_STRING + 1)
    variants = [m.device for m in pools4k[0].members[:40]] + [
        base._replace(vf_index=-1),
        base._replace(netdevs=()),
        base._replace(netdevs=(long,)),
        base._replace(rdma_device=""),
        base._replace(rdma_device=long),
        base._replace(id=long),
        base._replace(numa_node=-1),
        base._replace(driver="vfio-pci", netdevs=(), link_type="", rdma_device=""),
        base._replace(role="pf", pf="", pf_netdev="", vf_index=-1),
        base._replace(pf_netdev="", pcie_root=""),
    ]
    build = slices._Attributes(version)
    for full in ("intel.com/vfs", "example.com/other"):
        for d in variants + variants:  # the second round from the templates already made
            want = slices.device_attributes(d, full, version)
            got = build(d, full)
            assert list(got.items()) == list(want.items()), d


def test_v1beta1_wraps_attributes_in_basic_without_pcie_root(pools4k: tuple[Pool, ...]) -> None:
    out = slices.build_slices("n", DRIVER, pools4k, version=slices.ApiVersion.V1BETA1)
    for s in out[:3]:
        _valid(s, "1.32")
        assert s["apiVersion"] == "resource.k8s.io/v1beta1"
    dev = out[0]["spec"]["devices"][0]
    assert set(dev) == {"name", "basic"}
    assert "resource.kubernetes.io/pcieRoot" not in dev["basic"]["attributes"]
    # The v1 shape is refused by the v1beta1 schema (strict): the two really differ.
    with pytest.raises(Exception, match="attributes"):
        _CHECK.check(
            {**slices.build_slices("n", DRIVER, pools4k)[0], "apiVersion": "resource.k8s.io/v1beta1"}, "1.32"
        )


def test_a_pf_going_unhealthy_changes_only_its_two_slices(
    node4k: simnode.NodeLayout, pools4k: tuple[Pool, ...]
) -> None:
    b = slices.SliceBuilder("n", DRIVER, pools4k)
    before = b.states()
    pf = node4k.pfs[6]
    after = b.states(unhealthy=set(pf.vf_addresses))
    changed = [x.name for x, y in zip(before, after, strict=True) if x != y]
    assert len(changed) == 2
    assert [len(y.devices) for x, y in zip(before, after, strict=True) if x != y] == [0, 0]
    # The emptied slices stay (count and names unchanged): an empty pool part is not a missing one.
    assert [s.name for s in after] == [s.name for s in before]
    # One withheld device (held by a pod under the device plugin API) touches its slice alone.
    held = b.states(withheld={node4k.pfs[2].vf_addresses[200]})
    assert sum(x != y for x, y in zip(before, held, strict=True)) == 1


@pytest.mark.parametrize("taints", [False, True])
def test_states_asked_again_and_again_answer_as_a_fresh_builder_would(
    node4k: simnode.NodeLayout, pools4k: tuple[Pool, ...], taints: bool
) -> None:
    # The builder shows anew only the slices of devices that changed since its last call: a sequence
    # of PFs going down and up and devices withheld and given back must read as a fresh builder's.
    rng = random.Random(7)
    vfs = [a for pf in node4k.pfs for a in pf.vf_addresses]
    b = slices.SliceBuilder("n", DRIVER, pools4k, taints=taints)
    bad: set[str] = set()
    held: set[str] = set()
    for step in range(40):
        pf = rng.choice(node4k.pfs)
        if rng.random() < 0.6:
            bad |= set(pf.vf_addresses)
        else:
            bad -= set(pf.vf_addresses)
        held ^= set(rng.sample(vfs, 3))
        if step % 7 == 0:
            bad.add("0000:ff:1f.7")  # an ID no slice holds changes nothing
        got = b.states(frozenset(bad), frozenset(held))
        again = b.states(frozenset(bad), frozenset(held))  # equal sets, not the same objects
        want = slices.SliceBuilder("n", DRIVER, pools4k, taints=taints).states(bad, held)
        assert got == again == want, f"step {step}"


def test_taints_keep_unhealthy_devices_tainted_in_slices_of_64(
    node4k: simnode.NodeLayout, pools4k: tuple[Pool, ...]
) -> None:
    bad = node4k.pfs[0].vf_addresses[3]
    out = slices.build_slices("n", DRIVER, pools4k, unhealthy={bad}, taints=True)
    assert len(out) == 64 and all(len(s["spec"]["devices"]) == 64 for s in out)
    devices = {d["name"]: d for s in out for d in s["spec"]["devices"]}
    assert len(devices) == 4096
    assert devices[names.device_name(bad)]["taints"] == [
        {"key": f"{DRIVER}/unhealthy", "effect": "NoSchedule"}
    ]
    assert sum("taints" in d for d in devices.values()) == 1
    _valid(out[0])
    # v1beta1 has no device taints before 1.33 (and then behind an alpha gate): withdrawn instead.
    beta = slices.build_slices(
        "n", DRIVER, pools4k, unhealthy={bad}, taints=True, version=slices.ApiVersion.V1BETA1
    )
    assert sum(len(s["spec"]["devices"]) for s in beta) == 4095


def test_pools_sharing_a_pf_and_non_vf_functions(tmp_path: Path) -> None:
    layout = simnode.build_node(tmp_path, pfs=4, vfs_per_pf=8)
    pf0, pf1 = layout.pfs[0], layout.pfs[1]
    resources = [
        {"resourceName": "low", "api": "dra", "selectors": {"pfNames": [f"{pf0.netdev}#0-3"]}},
        {"resourceName": "high", "api": "dra", "selectors": {"pfNames": [f"{pf0.netdev}#4-7"]}},
        {"resourceName": "dp", "selectors": {"pfNames": [pf1.netdev]}},  # stays on the device plugin API
        {
            "resourceName": "pfs",
            "api": "dra",
            "deviceType": "accelerator",
            "selectors": {"pciAddresses": [layout.pfs[2].address, layout.pfs[3].address]},
        },
    ]
    cfg = config.parse(json.dumps({"resourceList": resources}))
    pools = selectors.build_pools(cfg, discovery.scan(tmp_path).devices)
    assert [p.config.api for p in pools].count(PoolApi.DRA) == 3
    out = slices.build_slices("n", DRIVER, slices.dra_pools(pools))
    assert len(out) == 2  # pf0's eight VFs (two pools, one slice), then the PFs ("fn")
    first = {
        d["attributes"]["vfIndex"]["int"]: d["attributes"]["resourceName"]["string"]
        for d in out[0]["spec"]["devices"]
    }
    assert first == {i: "intel.com/low" if i < 4 else "intel.com/high" for i in range(8)}
    assert out[1]["metadata"]["name"].endswith("-fn-0")
    assert [d["attributes"]["pciAddress"]["string"] for d in out[1]["spec"]["devices"]] == [
        layout.pfs[2].address,
        layout.pfs[3].address,
    ]
    assert all("vfIndex" not in d["attributes"] for d in out[1]["spec"]["devices"])
    for s in out:
        _valid(s)


def test_no_dra_pool_gives_no_slice_and_long_node_names_stay_valid(pools4k: tuple[Pool, ...]) -> None:
    assert slices.build_slices("n", DRIVER, ()) == []
    node = ".".join(["a" * 63] * 3) + ".b" * 30  # a 251-character DNS subdomain
    out = slices.build_slices(node, DRIVER, pools4k[:1])
    names_ = [s["metadata"]["name"] for s in out]
    assert all(len(n) <= 253 for n in names_) and len(set(names_)) == len(names_)
    _valid(out[0])


def test_device_classes_and_rbac_validate() -> None:
    cfg = config.parse(
        json.dumps(
            {
                "resourceList": [
                    {"resourceName": "sriov_A.x", "api": "dra"},
                    {"resourceName": "dp_only"},
                ],
                "draDriverName": "nics.example.com",
            }
        )
    )
    out = classes.manifests(cfg.pools, cfg.dra_driver_name)
    assert [o["kind"] for o in out] == ["DeviceClass", "ClusterRole", "ClusterRoleBinding"]
    cls = out[0]
    assert cls["metadata"]["name"] == "sriov-a-x.intel.com"
    assert cls["spec"]["extendedResourceName"] == "intel.com/sriov_A.x"
    assert cls["spec"]["selectors"][0]["cel"]["expression"] == (
        'device.driver == "nics.example.com" && '
        'device.attributes["nics.example.com"].resourceName == "intel.com/sriov_A.x"'
    )
    rules = {r["resources"][0]: set(r["verbs"]) for r in out[1]["rules"]}
    assert rules["resourceslices"] >= {"list", "watch", "create", "update", "delete", "deletecollection"}
    assert rules["resourceclaims"] == {"get"} and rules["nodes"] == {"get"}
    for o in out:
        _valid(o)
    beta = classes.manifests(cfg.pools, cfg.dra_driver_name, version="v1beta1")[0]
    assert "extendedResourceName" not in beta["spec"]
    _valid(beta, "1.32")
