"""The config file: the SR-IOV plugin's documented configs load unchanged, densedev's keys parse, and every
validation problem is reported (all at once) naming the pool, the key and the reason."""

from __future__ import annotations

import copy
import json
import pickle
from pathlib import Path
from typing import Any

import pytest
from helpers.devices import unlinked
from helpers.pools import VF_C, select
from hypothesis import given
from hypothesis import strategies as st

from densedev.model import DeviceType, HealthPolicy, IndexRange, IndexSpans, Preferred, Selector, VdpaType
from densedev.pools import config
from densedev.pools.config import (
    ConfigError,
    check,
    env_var_name,
    load,
    parse,
    parse_index_range,
    validate_resource_name,
)

DATA = Path(__file__).parent / "data" / "configs"


def problems_of(doc: Any, **kw: Any) -> tuple[str, ...]:
    """Return the problems parse() reports for a document (a dict is dumped to JSON first)."""
    text = doc if isinstance(doc, str) else json.dumps(doc)
    with pytest.raises(ConfigError) as info:
        parse(text, **kw)
    return info.value.problems


def pool(**kw: Any) -> dict[str, Any]:
    """Return a one-pool document with the given pool keys (resourceName "p" unless given)."""
    return {"resourceList": [{"resourceName": "p", **kw}]}


# --- the plugin's documented examples ------------------------------------------------------------------


@pytest.mark.parametrize("path", sorted(DATA.glob("plugin_*.json")), ids=lambda p: p.stem)
def test_plugin_documented_configs_load_unchanged(path: Path) -> None:
    cfg = load(path)
    raw = json.loads(path.read_text())
    assert [p.resource_name for p in cfg.pools] == [r["resourceName"] for r in raw["resourceList"]]
    assert check(path) == ()


def test_legacy_readme_prefixes_rdma_and_selector_shapes() -> None:
    cfg = load(DATA / "plugin_readme_legacy.json")
    names = [p.full_name for p in cfg.pools]
    assert names == [
        "intel.com/intel_sriov_netdevice",
        "intel.com/intel_sriov_dpdk",
        "mellanox.com/mlnx_sriov_rdma",
        "intel.com/infiniband_rdma_netdevs",
    ]
    first = cfg.pools[0]
    assert first.device_type == "netDevice"
    assert first.selectors == (
        Selector(vendors=("8086",), devices=("154c", "10ed"), drivers=("i40evf", "ixgbevf")),
    )
    # The early README put isRdma beside resourceName: it applies to every selector of the pool.
    assert cfg.pools[2].selectors[0].is_rdma is True
    assert cfg.pools[3].selectors == (Selector(link_types=("infiniband",), is_rdma=True),)
    assert cfg.pools[1].selectors[0].pf_names == (IndexRange("enp0s0f0"), IndexRange("enp2s2f1"))


def test_current_readme_device_types_and_keys() -> None:
    cfg = load(DATA / "plugin_readme_current.json")
    by_name = {p.resource_name: p for p in cfg.pools}
    assert by_name["intel_fpga"].device_type == "accelerator"
    sf = by_name["mlnx_sf"]
    assert sf.device_type == "auxNetDevice"
    assert sf.selectors[0].aux_types == ("sf",)
    assert sf.selectors[0].pf_names == (IndexRange("enp0s0f0np0", IndexSpans.from_indexes({1, 2, 3, 4, 5})),)
    assert by_name["ct6wind_sriov_vdpa_virtio"].selectors[0].vdpa_type == "virtio"
    assert by_name["intel_sriov_dpdk"].selectors[0].need_vhost_net is True
    assert cfg.warnings == ()


def test_default_prefix_is_the_plugins_and_overridable() -> None:
    doc = json.dumps(pool())
    assert parse(doc).pools[0].full_name == "intel.com/p"
    assert config.DEFAULT_PREFIX == "intel.com"
    assert parse(doc, default_prefix="example.org").pools[0].full_name == "example.org/p"
    # An explicit resourcePrefix wins over the flag.
    assert parse(json.dumps(pool(resourcePrefix="acme.io")), default_prefix="x.org").pools[0].full_name == (
        "acme.io/p"
    )


def test_an_empty_prefix_means_the_default_as_in_the_plugin() -> None:
    assert parse(json.dumps(pool(resourcePrefix="")), default_prefix="example.org").pools[0].full_name == (
        "example.org/p"
    )


def test_keys_are_case_insensitive_like_gos_decoder_and_null_go_internals_are_ignored() -> None:
    cfg = load(DATA / "plugin_node_specific.json")
    sel = cfg.pools[0].selectors[0]
    assert sel.pf_names == (
        IndexRange("ens785f0", IndexSpans.from_indexes(range(5))),
        IndexRange("ens785f1", IndexSpans.from_indexes(range(10))),
    )
    assert sel.is_rdma is False
    assert problems_of(pool(SelectorObj={"vendors": []})) == (
        "resourceList[0] (p): SelectorObj: internal field of the Go plugin: only null is accepted",
    )


def test_unsupported_selector_keys_load_with_warnings() -> None:
    cfg = load(DATA / "plugin_full_schema.json")
    assert len(cfg.warnings) == 2
    assert cfg.warnings[0].startswith("resourceList[0] (sriov_net_A): selectors.pKeys: not supported")
    assert "ddpProfiles: not supported" in cfg.warnings[1]
    sel = cfg.pools[0].selectors[0]
    assert sel.pkeys == ("0x0001",)
    assert sel.acpi_indexes == ("196",)
    assert cfg.pools[1].additional_info == (("*", (("token", "3e49019f-412f-4f02-824e-4cd195944205"),)),)


def test_densedev_keys() -> None:
    cfg = load(DATA / "densedev_extended.json")
    assert (cfg.coalesce_ms, cfg.rdma_poll_s, cfg.reconcile_s) == (5.0, 2.0, 120.0)
    first, shared = cfg.pools
    assert len(first.selectors) == 2
    assert first.selectors[1].root_devices == (IndexRange("0000:3b:00.1", IndexSpans.from_indexes(range(8))),)
    assert first.health == HealthPolicy(
        pf_link=True, own_link=False, rdma_port=True, driver=True, hold_down_s=2.5
    )
    assert (first.preferred, first.prestart) == ("spread", True)
    assert (shared.rdma_shared, shared.device_type, shared.full_name) == (
        16,
        "accelerator",
        "rdma/rdma_shared_hca",
    )
    assert shared.preferred == "none"


def test_defaults_of_an_old_file() -> None:
    cfg = parse(json.dumps(pool()))
    p = cfg.pools[0]
    assert p.selectors == (Selector(),)  # no selectors: every device of the type
    assert (p.rdma_shared, p.preferred, p.prestart, p.exclude_topology) == (0, "pack", False, False)
    assert p.health == HealthPolicy()
    assert (cfg.coalesce_ms, cfg.rdma_poll_s, cfg.reconcile_s) == (2.0, 1.0, 60.0)


def test_values_are_normalised() -> None:
    cfg = parse(
        json.dumps(
            pool(
                selectors={
                    "vendors": ["15b3", "8086"],
                    "devices": ["101e"],
                    "pciAddresses": ["3B:02.1", "0000:3b:02.2"],
                    "acpiIndexes": ["0196"],
                    "rootDevices": ["3b:00.0#1"],
                }
            )
        )
    )
    sel = cfg.pools[0].selectors[0]
    assert sel.vendors == ("15b3", "8086")
    assert sel.devices == ("101e",)
    assert sel.pci_addresses == ("0000:3b:02.1", "0000:3b:02.2")
    assert sel.acpi_indexes == ("196",)
    assert sel.root_devices == (IndexRange("0000:3b:00.0", IndexSpans.from_indexes({1})),)


# --- #-ranges ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("ens1f0", IndexRange("ens1f0")),
        ("ens1f0#3", IndexRange("ens1f0", IndexSpans.from_indexes({3}))),
        ("ens1f0#0,2-7", IndexRange("ens1f0", IndexSpans.from_indexes({0, 2, 3, 4, 5, 6, 7}))),
        ("netpf0#0,2-7,9", IndexRange("netpf0", IndexSpans.from_indexes({0, 2, 3, 4, 5, 6, 7, 9}))),
        ("0000:86:00.0#0-1,3,4", IndexRange("0000:86:00.0", IndexSpans.from_indexes({0, 1, 3, 4}))),
        ("p#5-5,5", IndexRange("p", IndexSpans.from_indexes({5}))),
    ],
)
def test_index_range_syntax(text: str, expected: IndexRange) -> None:
    assert parse_index_range(text) == expected


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("ens1f0#5-2", 'bad VF range "ens1f0#5-2": start > end'),
        ("ens1f0#", 'bad VF range "ens1f0#": no VF index after "#"'),
        ("#1-2", 'bad VF range "#1-2": no name before "#"'),
        ("ens1f0#1,,2", 'bad VF range "ens1f0#1,,2": empty item in the list'),
        ("ens1f0#a", 'bad VF range "ens1f0#a": "a" is not a VF index (a non-negative integer)'),
        ("ens1f0#-3", 'bad VF range "ens1f0#-3": "" is not a VF index (a non-negative integer)'),
        ("ens1f0#3-", 'bad VF range "ens1f0#3-": "" is not a VF index (a non-negative integer)'),
        ("ens1f0#1-2-3", 'bad VF range "ens1f0#1-2-3": "2-3" is not a VF index (a non-negative integer)'),
        (
            "ens1f0#70000",
            'bad VF range "ens1f0#70000": index 70000 above 65535 (SR-IOV has 16-bit VF counts)',
        ),
    ],
)
def test_bad_index_ranges(text: str, reason: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_index_range(text)
    assert str(info.value) == reason


@given(st.lists(st.tuples(st.integers(0, 300), st.integers(0, 300)), min_size=1, max_size=6))
def test_index_range_equals_the_union_of_its_parts(parts: list[tuple[int, int]]) -> None:
    items = [f"{a}-{b}" if a != b else str(a) for a, b in ((min(p), max(p)) for p in parts)]
    expected = set().union(*(range(min(p), max(p) + 1) for p in parts))
    assert parse_index_range("ens1f0#" + ",".join(items)) == IndexRange(
        "ens1f0", IndexSpans.from_indexes(expected)
    )


def test_vf_indexes_with_leading_zeros_or_too_many_digits() -> None:
    assert parse_index_range("ens1f0#0007-00065535") == IndexRange("ens1f0", IndexSpans.of([(7, 65535)]))
    with pytest.raises(ValueError, match="index 1000000 above 65535"):
        parse_index_range("ens1f0#1000000")
    with pytest.raises(ValueError, match="above 65535"):
        parse_index_range("ens1f0#" + "9" * 100_000)


def test_index_spans_are_an_immutable_value() -> None:
    # What the frozen dataclass it was gave: equality and hash by value, no assignment, a copy or a
    # pickle equal to the original (IndexRange, and so the config, holds them).
    a, b = IndexSpans.of([(0, 3), (7, 7)]), IndexSpans.from_indexes([0, 1, 2, 3, 7])
    assert a == b and hash(a) == hash(b) and a != IndexSpans.of([(0, 3)]) and a != (a.starts, a.ends)
    assert repr(a) == "IndexSpans(starts=(0, 7), ends=(3, 7))" and str(a) == "0-3,7"
    with pytest.raises(AttributeError, match="immutable"):
        a.starts = ()  # type: ignore[misc]
    with pytest.raises(AttributeError, match="immutable"):
        del a.ends
    assert copy.deepcopy(a) == a and pickle.loads(pickle.dumps(a)) == a
    assert IndexSpans() == IndexSpans.of([]) and not IndexSpans() and len(a) == 5


@given(st.lists(st.tuples(st.integers(0, 200), st.integers(0, 200)), max_size=8), st.data())
def test_index_spans_behave_as_the_sets_they_stand_for(
    pairs: list[tuple[int, int]], data: st.DataObject
) -> None:
    spans = [(min(p), max(p)) for p in pairs]
    split = data.draw(st.integers(0, len(spans)))
    a, b = IndexSpans.of(spans[:split]), IndexSpans.of(spans[split:])
    expected = {i for lo, hi in spans for i in range(lo, hi + 1)}
    union = a | b
    assert union == IndexSpans.from_indexes(expected)  # normalised: equal sets, equal spans
    assert {i for i in range(-2, 205) if i in union} == expected and len(union) == len(expected)
    assert all(
        s <= e and (k == 0 or s > union.ends[k - 1] + 1)
        for k, (s, e) in enumerate(zip(union.starts, union.ends, strict=True))
    )


# --- resource names ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["intel.com/sriov_net_A", "nvidia.com/a.b-c_d", "x/y", "a-b.c/Z9", "rdma/hca"]
)
def test_valid_resource_names(name: str) -> None:
    assert validate_resource_name(name) is None


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        ("intel_sriov", 'has no "/"'),
        ("kubernetes.io/sriov", "reserved for native resources"),
        ("foo.kubernetes.io/sriov", "reserved for native resources"),
        ("requests.intel.com/sriov", 'starting "requests."'),
        ("/sriov", 'prefix before "/" is empty'),
        ("Intel.com/sriov", 'prefix "Intel.com" is not a lowercase DNS subdomain'),
        ("intel_com/sriov", "not a lowercase DNS subdomain"),
        ("-intel.com/sriov", "not a lowercase DNS subdomain"),
        ("intel.com/", 'the name after "/" is empty'),
        ("intel.com/a/b", 'more than one "/"'),
        ("intel.com/" + "a" * 64, "longer than 63 characters (64)"),
        ("intel.com/_sriov", "starting and ending alphanumeric"),
        ("intel.com/sriov-", "starting and ending alphanumeric"),
        ("intel.com/sr iov", "starting and ending alphanumeric"),
        ("a" * 250 + ".com/x", "prefix longer than 244 characters"),
    ],
)
def test_resource_names_the_kubelet_refuses(name: str, fragment: str) -> None:
    reason = validate_resource_name(name)
    assert reason is not None
    assert fragment in reason


def test_env_var_name_follows_the_plugin_convention() -> None:
    assert env_var_name("intel.com/sriov") == "PCIDEVICE_INTEL_COM_SRIOV"


# --- every validation error ----------------------------------------------------------------------------


def test_all_problems_are_reported_at_once_with_pool_key_and_reason() -> None:
    doc = {
        "resourceList": [
            {"resourceName": "ok", "selectors": {"vendors": ["8086"]}},
            {"resourceName": "bad_vendor", "selectors": {"vendor": ["8086"]}},
            {
                "resourceName": "mlnx_rdma",
                "selectors": [{"pfNames": ["ens1f0#0-3"]}, {"pfNames": ["ens1f1", "ens1f0#5-2"]}],
            },
        ],
        "coalesceMs": "fast",
    }
    assert problems_of(doc) == (
        'resourceList[1] (bad_vendor): selectors: unknown key "vendor" (did you mean "vendors"?)',
        'resourceList[2] (mlnx_rdma): selectors[1].pfNames[1]: bad VF range "ens1f0#5-2": start > end',
        "coalesceMs: expected a number, got string",
    )


@pytest.mark.parametrize(
    ("doc", "expected"),
    [
        ([], "expected a JSON object with resourceList or configList, got list"),
        ({}, "resourceList: required (a list of resource pools)"),
        ({"resourceList": {}}, "resourceList: expected a list of resource objects, got object"),
        ({"resourceList": ["x"]}, "resourceList[0]: expected a resource object, got string"),
        ({"resourceList": [], "extra": 1}, 'unknown key "extra"'),
        ({"resourceList": [], "rdmaPollSeconds": 0}, "rdmaPollSeconds: expected a number > 0, got 0"),
        ({"resourceList": [], "reconcileSeconds": True}, "reconcileSeconds: expected a number, got boolean"),
        ({"resourceList": [], "coalesceMs": -1}, "coalesceMs: expected a number >= 0, got -1"),
        # A number beyond any float is shown cut short: a problem line stays short whatever the file holds.
        (
            {"resourceList": [], "coalesceMs": 10**400},
            f"coalesceMs: expected a number >= 0, got 1{'0' * 39}… (361 more characters)",
        ),
        ({"resourceList": [{}]}, "resourceList[0] (no resourceName): resourceName: required"),
        (pool(resourceName=""), "resourceList[0] (no resourceName): resourceName: empty"),
        (
            pool(resourceName=7),
            "resourceList[0] (no resourceName): resourceName: expected a string, got number",
        ),
        (pool(resourcePrefix=["a"]), "resourceList[0] (p): resourcePrefix: expected a string, got list"),
        (pool(typo=1), 'resourceList[0] (p): unknown key "typo"'),
        (pool(deviceTyp="x"), 'resourceList[0] (p): unknown key "deviceTyp" (did you mean "deviceType"?)'),
        (
            pool(deviceType="vfio"),
            'resourceList[0] (p): deviceType: "vfio" is not one of netDevice, accelerator, auxNetDevice',
        ),
        (
            pool(excludeTopology="yes"),
            "resourceList[0] (p): excludeTopology: expected true or false, got string",
        ),
        (pool(isRdma=1), "resourceList[0] (p): isRdma: expected true or false, got number"),
        (
            pool(selectors="x"),
            "resourceList[0] (p): selectors: expected an object or a list of objects, got string",
        ),
        (pool(selectors=[]), "resourceList[0] (p): selectors: empty list: the pool would select no device"),
        (pool(selectors=[1]), "resourceList[0] (p): selectors[0]: expected a selector object, got number"),
        (
            pool(selectors={"vendors": "8086"}),
            "resourceList[0] (p): selectors.vendors: expected a list of strings, got string",
        ),
        (
            pool(selectors={"vendors": [8086]}),
            "resourceList[0] (p): selectors.vendors[0]: expected a string, got number",
        ),
        (pool(selectors={"vendors": [""]}), "resourceList[0] (p): selectors.vendors[0]: empty string"),
        (
            pool(selectors={"drivers": [None]}),
            "resourceList[0] (p): selectors.drivers[0]: expected a string, got null",
        ),
        (
            pool(selectors={"pciAddresses": ["3b:2.1"]}),
            'resourceList[0] (p): selectors.pciAddresses[0]: "3b:2.1" is not a PCI address (0000:3b:02.1)',
        ),
        (
            pool(selectors={"acpiIndexes": ["-1"]}),
            'resourceList[0] (p): selectors.acpiIndexes[0]: "-1" is not an ACPI index (a decimal number)',
        ),
        (
            pool(selectors={"pfNames": ["averyveryverylongname"]}),
            'resourceList[0] (p): selectors.pfNames[0]: interface name "averyveryverylongname" '
            "longer than 15 bytes (IFNAMSIZ)",
        ),
        (
            pool(selectors={"pfNames": ["ens1/f0"]}),
            'resourceList[0] (p): selectors.pfNames[0]: "ens1/f0" is not a valid interface name',
        ),
        (
            pool(selectors={"rootDevices": ["ens1f0#1"]}),
            'resourceList[0] (p): selectors.rootDevices[0]: "ens1f0" is not a PCI address (0000:3b:00.0)',
        ),
        (
            pool(selectors={"rootDevices": ["0000:3b:00.0#2-1"]}),
            'resourceList[0] (p): selectors.rootDevices[0]: bad VF range "0000:3b:00.0#2-1": start > end',
        ),
        (
            pool(selectors={"isRdma": "true"}),
            "resourceList[0] (p): selectors.isRdma: expected true or false, got string",
        ),
        (
            pool(selectors={"needVhostNet": 0}),
            "resourceList[0] (p): selectors.needVhostNet: expected true or false, got number",
        ),
        (
            pool(selectors={"vdpaType": "vduse"}),
            'resourceList[0] (p): selectors.vdpaType: "vduse" is not one of vhost, virtio',
        ),
        (
            pool(selectors={"vdpaType": ["vhost"]}),
            "resourceList[0] (p): selectors.vdpaType: expected a string, got list",
        ),
        (
            pool(selectors={"pKeys": ["0x10000"]}),
            'resourceList[0] (p): selectors.pKeys[0]: "0x10000" is not a partition key (0x7fff)',
        ),
        (
            pool(selectors={"auxTypes": ["sf"]}),
            'resourceList[0] (p): selectors.auxTypes: not a selector of deviceType "netDevice" '
            "(only of auxNetDevice)",
        ),
        (
            pool(deviceType="accelerator", selectors={"pfNames": ["ens1f0"]}),
            'resourceList[0] (p): selectors.pfNames: not a selector of deviceType "accelerator" '
            "(only of netDevice, auxNetDevice)",
        ),
        (
            pool(selectors={"vendors": ["8086"], "Vendors": ["15b3"]}),
            'resourceList[0] (p): selectors.Vendors: same key as "vendors" (keys are case-insensitive)',
        ),
        (
            pool(additionalInfo=[]),
            "resourceList[0] (p): additionalInfo: expected an object of objects, got list",
        ),
        (
            pool(additionalInfo={"*": "x"}),
            'resourceList[0] (p): additionalInfo["*"]: expected an object of strings, got string',
        ),
        (
            pool(additionalInfo={"*": {"k": 1}}),
            'resourceList[0] (p): additionalInfo["*"]["k"]: expected a string, got number',
        ),
        (
            pool(additionalInfo={"": {}}),
            'resourceList[0] (p): additionalInfo: empty key (use a device ID or "*")',
        ),
        (
            pool(rdmaShared=1.5),
            "resourceList[0] (p): rdmaShared: expected a whole number of IDs per RDMA device, got number",
        ),
        (pool(rdmaShared=-1), "resourceList[0] (p): rdmaShared: expected 0 to 65535, got -1"),
        (pool(healthPolicy=True), "resourceList[0] (p): healthPolicy: expected an object, got boolean"),
        (
            pool(healthPolicy={"pfLink": "no"}),
            "resourceList[0] (p): healthPolicy.pfLink: expected true or false, got string",
        ),
        (
            pool(healthPolicy={"link": True}),
            'resourceList[0] (p): healthPolicy: unknown key "link" (did you mean "pfLink"?)',
        ),
        (
            pool(healthPolicy={"holdDownSeconds": -0.5}),
            "resourceList[0] (p): healthPolicy.holdDownSeconds: expected a number >= 0, got -0.5",
        ),
        (
            pool(preferredAllocation="random"),
            'resourceList[0] (p): preferredAllocation: "random" is not one of pack, spread, none',
        ),
        (pool(preStart="no"), "resourceList[0] (p): preStart: expected true or false, got string"),
    ],
)
def test_each_validation_error(doc: Any, expected: str) -> None:
    assert problems_of(doc) == (expected,)


def test_resource_names_the_kubelet_would_refuse_are_reported_per_pool() -> None:
    assert problems_of(pool(resourceName="sriov-")) == (
        'resourceList[0] (sriov-): resourceName/resourcePrefix: the kubelet would refuse "intel.com/sriov-": '
        'name part "sriov-" must be [A-Za-z0-9._-], starting and ending alphanumeric',
    )
    assert problems_of(pool(resourcePrefix="kubernetes.io")) == (
        'resourceList[0] (p): resourceName/resourcePrefix: the kubelet would refuse "kubernetes.io/p": '
        "the kubernetes.io/ namespace is reserved for native resources",
    )


def test_names_with_a_dash_load_with_the_go_plugins_variable_name() -> None:
    # The SR-IOV plugin's own tests assert "sriov-net_0" valid and it exports PCIDEVICE_..._SRIOV-NET_0.
    cfg = parse(json.dumps(pool(resourceName="sriov-net_0", selectors={"drivers": ["iavf"]})))
    assert cfg.pools[0].full_name == "intel.com/sriov-net_0"
    assert env_var_name(cfg.pools[0].full_name) == "PCIDEVICE_INTEL_COM_SRIOV-NET_0"
    assert cfg.warnings == (
        "resourceList[0] (sriov-net_0): resourceName/resourcePrefix: the container gets "
        'PCIDEVICE_INTEL_COM_SRIOV-NET_0 (with "-", as the SR-IOV network device plugin names it); '
        "programs read it, shell scripts cannot",
    )
    # A prefix with "-" is a fine DNS name: the same warning.
    assert len(parse(json.dumps(pool(resourcePrefix="my-corp.com", selectors={}))).warnings) == 1


def test_kinds_are_parsed_once_into_enum_members() -> None:
    # Later stages compare members (DeviceType.ACCELERATOR), never the file's strings.
    doc = pool(deviceType="accelerator", preferredAllocation="none", selectors={"drivers": ["x"]})
    got = parse(json.dumps(doc)).pools[0]
    assert type(got.device_type) is DeviceType and got.device_type is DeviceType.ACCELERATOR
    assert type(got.preferred) is Preferred and got.preferred is Preferred.NONE
    default = parse(json.dumps(pool(selectors={"drivers": ["x"]}))).pools[0]
    assert (default.device_type, default.preferred) == (DeviceType.NET_DEVICE, Preferred.PACK)
    assert type(default.device_type) is DeviceType and type(default.preferred) is Preferred
    vdpa = parse(json.dumps(pool(selectors={"vdpaType": "virtio"}))).pools[0].selectors[0]
    assert vdpa.vdpa_type is VdpaType.VIRTIO and vdpa.vdpa_type.driver == "virtio_vdpa"
    assert default.selectors[0].vdpa_type is None
    # What a file, a log line or JSON shows is the value itself (StrEnum's str and format).
    assert f"{got.device_type}/{got.preferred}" == "accelerator/none"
    assert json.dumps([got.device_type, got.preferred]) == '["accelerator", "none"]'


def test_duplicate_full_names_and_env_var_collisions() -> None:
    doc = {
        "resourceList": [
            {"resourceName": "a"},
            {"resourceName": "a"},
            {"resourceName": "a", "resourcePrefix": "other.com"},
            {"resourceName": "com_a", "resourcePrefix": "intel"},
        ]
    }
    assert problems_of(doc) == (
        'resourceList[1] (a): resource "intel.com/a" already defined by resourceList[0]',
        'resourceList[3] (com_a): resource "intel/com_a" has the same variable name PCIDEVICE_INTEL_COM_A as '
        "resourceList[0]",
    )


def test_duplicate_json_keys_are_reported() -> None:
    text = '{"resourceList": [{"resourceName": "a", "resourceName": "b"}]}'
    assert problems_of(text) == ("resourceList[0] (b): resourceName: key given more than once",)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            '{"resourceList": [\n  {"resourceName": "a",}\n]}',
            "invalid JSON at line 2 column 24: Expecting property name",
        ),
        ("", "invalid JSON at line 1 column 1: Expecting value"),
        ('{"resourceList": []', "invalid JSON at line 1 column 20: Expecting ',' delimiter"),
        ('{"resourceList": [], "coalesceMs": NaN}', "invalid JSON: NaN is not valid JSON"),
    ],
)
def test_invalid_json_names_line_and_column(text: str, expected: str) -> None:
    problems = problems_of(text)
    assert len(problems) == 1
    assert problems[0].startswith(expected)


def test_config_error_message_lists_source_and_problems(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"resourceList": [{"resourceName": "x", "bogus": 1}], "extra": 2}))
    with pytest.raises(ConfigError) as info:
        load(path)
    assert info.value.source == str(path)
    text = str(info.value)
    assert text.startswith(f"{path}: 2 problem(s) in the config:")
    assert 'resourceList[0] (x): unknown key "bogus"' in text
    assert check(path) == info.value.problems


def test_load_reports_unreadable_and_non_utf8_files(tmp_path: Path) -> None:
    assert check(tmp_path / "missing.json") == ("cannot read the file: No such file or directory",)
    bad = tmp_path / "latin1.json"
    bad.write_bytes(b'{"resourceList": [{"resourceName": "caf\xe9"}]}')
    assert check(bad) == ("not UTF-8 text (byte 39)",)
    bom = tmp_path / "bom.json"
    bom.write_bytes(b"\xef\xbb\xbf" + json.dumps(pool()).encode())
    assert load(bom).pools[0].resource_name == "p"


def test_check_passes_the_prefix(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps(pool()))
    assert check(path) == ()
    assert check(path, default_prefix="Bad_Prefix") != ()


def test_the_example_in_the_docs_loads() -> None:
    doc = (Path(__file__).parents[1] / "docs" / "config.md").read_text()
    example = doc.split("## Example\n\n```json\n", 1)[1].split("```", 1)[0]
    cfg = parse(example)
    assert [p.full_name for p in cfg.pools] == ["nvidia.com/mlx_vf_p0", "rdma/rdma_shared_hca"]
    assert cfg.pools[0].health == HealthPolicy(own_link=False, hold_down_s=2.5)


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 70000) | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=12,
)
_KEYS = [*config._POOL_KEYS, *config._ALL_SELECTOR_KEYS, *config._HEALTH_KEYS, "resourceList"]


@given(
    st.lists(
        st.dictionaries(
            st.sampled_from(_KEYS) | st.text(max_size=6), _json_values | st.just("ens1f0#1-3"), max_size=6
        ),
        max_size=4,
    ),
    st.dictionaries(st.sampled_from(config._TOP_KEYS), _json_values, max_size=3),
)
def test_any_document_gives_a_config_or_a_config_error(
    pools: list[dict[str, Any]], top: dict[str, Any]
) -> None:
    # Bad input never escapes as anything but ConfigError: the daemon reloads configs while running.
    doc = {**top, "resourceList": pools}
    try:
        cfg = parse(json.dumps(doc))
    except ConfigError as exc:
        assert exc.problems
        assert all(isinstance(p, str) and p for p in exc.problems)
    else:
        assert len(cfg.pools) == len(pools)


# --- the SR-IOV network device plugin's decisions: what it loads loads, what it refuses warns -----------


@pytest.mark.parametrize(
    ("doc", "warning"),
    [
        (pool(selectors={"linkTypes": ["other2"]}), 'linkTypes[0]: "other2" is not a link type'),
        (pool(selectors={"devices": ["fakeid"]}), 'devices[0]: "fakeid" matches no device'),
        (pool(selectors={"vendors": ["0x15b3"]}), 'vendors[0]: "0x15b3" matches no device'),
        (pool(selectors={"vendors": ["15B3"]}), 'write "15b3"'),
        (pool(resourceName="sriov.net", selectors={}), 'resourceName: "sriov.net" has characters outside'),
        (pool(selectors={"isRdma": True, "vdpaType": "vhost"}), "isRdma with vdpaType in one selector"),
        (pool(deviceType="auxNetDevice", selectors={}), "auxTypes: missing or empty"),
        (pool(deviceType="auxNetDevice", selectors={"auxTypes": []}), "auxTypes: missing or empty"),
        (pool(deviceType="auxNetDevice", selectors={"auxTypes": ["foo"]}), 'auxTypes[0]: "foo" matches no'),
        (pool(), "selectors: missing: densedev takes every device"),
    ],
)
def test_files_the_go_plugin_loads_or_refuses_load_with_a_warning(doc: dict[str, Any], warning: str) -> None:
    # Before: the first four were refused (the Go plugin loads them), the rest accepted in silence (the Go
    # plugin refuses them at start, or crashes without selectors).
    cfg = parse(json.dumps(doc))
    assert len(cfg.pools) == 1
    assert [w for w in cfg.warnings if warning in w], cfg.warnings
    if warning.startswith(("isRdma", "auxTypes: missing", "selectors: missing", "resourceName")):
        assert [w for w in cfg.warnings if "SR-IOV network device plugin refuses" in w]


def test_vendor_and_device_ids_select_as_exact_strings() -> None:
    assert select({"vendors": ["15b3"], "devices": ["101e"]}, [VF_C]) == [VF_C.id]
    # The Go plugin picks nothing with these (exact string compare), so densedev neither.
    for sel in ({"vendors": ["0x15b3"]}, {"vendors": ["15B3"]}, {"devices": ["101E"]}):
        assert select(sel, [VF_C]) == [], sel


def test_pf_names_select_case_insensitively() -> None:
    pf = "0000:3b:00.0"
    vfs = [unlinked(f"0000:3b:02.{i}", pf=pf, vf_index=i, pf_netdev="ens1f0") for i in range(3)]
    # The Go plugin picks two VFs with "ENS1F0#0-1" (strings.EqualFold); densedev picked none.
    assert select({"pfNames": ["ENS1F0#0-1"]}, vfs) == [vfs[0].id, vfs[1].id]
    assert select({"pfNames": ["Ens1F0"]}, vfs) == [v.id for v in vfs]
