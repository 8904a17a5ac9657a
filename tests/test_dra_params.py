"""Claim parameters (dra/params.py): the VfConfig kind, the merge of class and claim config, every refusal
in one line, and ``densedev dra-check-params`` as a user runs it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers.devices import dev
from hypothesis import given, settings
from hypothesis import strategies as st

from densedev.dra import params
from densedev.dra.params import (
    API_VERSION,
    KIND,
    DeviceFacts,
    LinkState,
    LinkType,
    Problem,
    Result,
    VfConfig,
)
from densedev.model import Role

DRIVER = "net.densedev.io"
DATA = Path(__file__).parent / "data" / "dra_params"
DOCS = Path(__file__).parents[1] / "docs" / "dra.md"
GUARD = 120.0  # hang guard only

ETH_VF = DeviceFacts(Role.VF, LinkType.ETHER, "iavf")
IB_VF = DeviceFacts(Role.VF, LinkType.INFINIBAND, "mlx5_core")
VFIO_VF = DeviceFacts(Role.VF, LinkType.ETHER, "vfio-pci")
UNBOUND_VF = DeviceFacts(Role.VF, LinkType.ETHER, "")
ORPHAN_VF = DeviceFacts(Role.VF, LinkType.NONE, "iavf")
PF = DeviceFacts(Role.PF, LinkType.ETHER, "ice")
ADMIN_VF = DeviceFacts(Role.VF, LinkType.ETHER, "iavf", admin_access=True)


def vf(**fields: Any) -> dict[str, Any]:
    """Return VfConfig parameters with ``fields``."""
    return {"apiVersion": API_VERSION, "kind": KIND, **fields}


def entry(parameters: Any, *requests: str, source: str = "FromClaim", driver: str = DRIVER) -> dict[str, Any]:
    """Return one allocation config entry."""
    e: dict[str, Any] = {"source": source, "opaque": {"driver": driver, "parameters": parameters}}
    if requests:
        e["requests"] = list(requests)
    return e


def one(problems: tuple[Problem, ...] | list[Problem]) -> str:
    """Return the only refusal as its line, failing when there is not exactly one."""
    assert len(problems) == 1, problems
    line = str(problems[0])
    assert "\n" not in line
    return line


# ---- refusals: each one line naming the request, the field and the reason ------------------------------

PARAMETER_REFUSALS = [
    # (parameters, field, reason the line must hold)
    ({"kind": KIND, "vlan": 1}, "apiVersion", "missing; this driver reads net.densedev.io/v1alpha1"),
    (vf(apiVersion="net.densedev.io/v1"), "apiVersion", "'net.densedev.io/v1' is not known"),
    (vf(kind="VfConf"), "kind", "'VfConf' is not known; this driver reads VfConfig"),
    ({"apiVersion": API_VERSION}, "kind", "missing"),
    (vf(vlan_id=3), "vlan_id", "unknown field"),
    (vf(spoofchk=True), "spoofchk", "unknown field (did you mean spoofChk?)"),
    (vf(vlan=True), "vlan", "must be an integer, not a boolean"),
    (vf(vlan="100"), "vlan", "must be an integer, not a string"),
    (vf(vlan=100.0), "vlan", "must be an integer, not a number"),
    (vf(vlan=None), "vlan", "must be an integer, not null"),
    (vf(vlan=4096), "vlan", "4096 is out of range 0-4095"),
    (vf(vlan=-1), "vlan", "-1 is out of range 0-4095"),
    (vf(vlan=1, qos=8), "qos", "8 is out of range 0-7"),
    (vf(mtu=67), "mtu", "67 is out of range 68-65535"),
    (vf(mtu=65536), "mtu", "65536 is out of range 68-65535"),
    (vf(trust=1), "trust", "must be true or false, not an integer"),
    (vf(spoofChk="true"), "spoofChk", "must be true or false, not a string"),
    (vf(maxTxRateMbps=2**32), "maxTxRateMbps", "4294967296 is out of range 0-4294967295 Mbit/s"),
    (vf(minTxRateMbps=-5), "minTxRateMbps", "-5 is out of range"),
    (vf(minTxRateMbps=2000, maxTxRateMbps=1000), "minTxRateMbps", "2000 Mbit/s is above maxTxRateMbps 1000"),
    (vf(linkState="up"), "linkState", "'up' is not one of auto, enable, disable"),
    (vf(linkState=1), "linkState", "must be one of auto, enable, disable, not an integer"),
    (vf(mac="01:00:5e:00:00:01"), "mac", "is a multicast address"),
    (vf(mac="00:00:00:00:00:00"), "mac", "not a valid unicast address"),
    (vf(mac="02:00:00:00:00"), "mac", "is not a MAC address"),
    (vf(mac="02-00-00-00-00-01"), "mac", "is not a MAC address"),
    (vf(ifName=""), "ifName", "must not be empty"),
    (vf(ifName="a" * 16), "ifName", "is 16 bytes; an interface name has at most 15"),
    (vf(ifName="é" * 8), "ifName", "is 16 bytes"),  # bytes, not characters: IFNAMSIZ counts bytes
    (vf(ifName="."), "ifName", "'.' is not an interface name"),
    (vf(ifName=".."), "ifName", "'..' is not an interface name"),
    (vf(ifName="net/1"), "ifName", "holds '/'"),
    (vf(ifName="net 1"), "ifName", "holds ' '"),
    (vf(ifName="net:1"), "ifName", "holds ':'"),
    (vf(ifName="net\n1"), "ifName", "holds '\\n'"),
    (vf(driver=""), "driver", "must not be empty"),
    (vf(driver="../vfio-pci"), "driver", "is not a driver name"),
    (vf(driver="vfio pci"), "driver", "is not a driver name"),
    (vf(driver=7), "driver", "must be a driver name, not an integer"),
    (vf(qos=3), "qos", "needs vlan in the same config"),
    (vf(driver="vfio-pci", mtu=9000), "mtu", "the VF has no netdev when bound to vfio-pci"),
    (vf(driver="vfio-pci", ifName="net1"), "ifName", "the VF has no netdev when bound to vfio-pci"),
    ([1, 2], "parameters", "must be a VfConfig object, not a list"),
    ("vlan: 100", "parameters", "must be a VfConfig object, not a string"),
    (None, "parameters", "must be a VfConfig object, not null"),
    (vf(padding="x" * 10_300), "parameters", "more than 10240 bytes of JSON"),
]


@pytest.mark.parametrize(("parameters", "field", "reason"), PARAMETER_REFUSALS)
def test_bad_parameters_are_refused_in_one_line(parameters: Any, field: str, reason: str) -> None:
    plan = params.plan([entry(parameters, "nic")], [Result("nic", "pci-0000-3b-00-2", ETH_VF)], DRIVER)
    line = one(plan.problems)
    assert line.startswith(f"request nic: {field}: "), line
    assert reason in line, line
    assert plan.configs == {}  # refused: nothing to apply, not even the valid fields


DEVICE_REFUSALS = [
    # (parameters, device facts, field, reason)
    (vf(mtu=9000), VFIO_VF, "mtu", "the device has no netdev: it is bound to vfio-pci"),
    (vf(ifName="net1"), VFIO_VF, "ifName", "no netdev: it is bound to vfio-pci"),
    (vf(mtu=9000), UNBOUND_VF, "mtu", "no netdev: it is bound to no driver"),
    (vf(vlan=100), IB_VF, "vlan", "does not apply to an InfiniBand VF"),
    (vf(mac="02:00:00:00:00:01"), IB_VF, "mac", "does not apply to an InfiniBand VF"),
    (vf(spoofChk=False), IB_VF, "spoofChk", "does not apply to an InfiniBand VF"),
    (vf(trust=True), IB_VF, "trust", "does not apply to an InfiniBand VF"),
    (vf(maxTxRateMbps=100), IB_VF, "maxTxRateMbps", "does not apply to an InfiniBand VF"),
    (vf(vlan=100), ORPHAN_VF, "vlan", "the VF's PF has no netdev to carry it"),
    (vf(trust=True), ADMIN_VF, "trust", "an admin-access result shares the device and may not configure it"),
    (vf(driver="vfio-pci"), ADMIN_VF, "driver", "admin-access"),
    (vf(driver="vfio-pci"), PF, "driver", "only a VF's driver is rebound; this device is a pf"),
    (vf(vlan=5), PF, "vlan", "set through the PF for a VF; this device is a pf"),
    (
        vf(driver="vfio-pci"),
        DeviceFacts(Role.VF, LinkType.ETHER, "iavf", iommu_group=-1),
        "driver",
        "vfio-pci needs an IOMMU group and this VF has none",
    ),
    (
        vf(driver="vfio-pci"),
        DeviceFacts(Role.PCI, LinkType.NONE, "ixgbe"),
        "driver",
        "this device is a pci",
    ),
]


@pytest.mark.parametrize(("parameters", "facts", "field", "reason"), DEVICE_REFUSALS)
def test_settings_the_device_cannot_take_are_refused(
    parameters: dict[str, Any], facts: DeviceFacts, field: str, reason: str
) -> None:
    plan = params.plan([entry(parameters)], [Result("nic", "pci-0000-3b-00-2", facts)], DRIVER)
    line = one(plan.problems)
    assert line.startswith(f"request nic: {field}: "), line
    assert reason in line and "pci-0000-3b-00-2" in line, line
    assert plan.configs == {}


DEVICE_ACCEPTS = [
    # Through the PF, whatever the VF is bound to: the SR-IOV CNI's DPDK case.
    (vf(driver="vfio-pci", vlan=100, qos=2, spoofChk=False), ETH_VF),
    (vf(vlan=100, trust=True, mac="02:AA:bb:00:00:01"), VFIO_VF),
    # A kernel driver asked for a vfio-bound VF brings its netdev back: MTU and name apply.
    (vf(driver="iavf", mtu=9000, ifName="net1"), VFIO_VF),
    (vf(driver="mlx5_core", mtu=9000, ifName="net1"), UNBOUND_VF),
    # InfiniBand: IPoIB's PF takes the VF link state; the VF's own netdev takes an MTU.
    (vf(linkState="disable", mtu=2044, ifName="ib1"), IB_VF),
    (vf(mtu=9000), PF),  # a whole PF handed out: its own netdev
    (vf(vlan=0, minTxRateMbps=500, maxTxRateMbps=0), ETH_VF),  # max 0 is "no limit": any min
    (vf(), ADMIN_VF),  # nothing asked: admin access is fine
    (vf(driver="vfio-pci"), DeviceFacts(Role.VF, LinkType.ETHER, "iavf", iommu_group=12)),
    (vf(driver="iavf"), DeviceFacts(Role.VF, LinkType.ETHER, "vfio-pci", iommu_group=-1)),
]


@pytest.mark.parametrize(("parameters", "facts"), DEVICE_ACCEPTS)
def test_settings_the_device_takes_pass(parameters: dict[str, Any], facts: DeviceFacts) -> None:
    plan = params.plan([entry(parameters)], [Result("nic", "dev", facts)], DRIVER)
    assert plan.problems == ()
    expected = params.parse_parameters(parameters)
    assert isinstance(expected, VfConfig)
    assert plan.configs == ({"dev": expected} if expected.settings() else {})


def test_every_problem_of_a_claim_is_listed_each_naming_its_request() -> None:
    config = [entry(vf(vlan=9999, trust="yes"), "a"), entry(vf(mtu=9000), "b")]
    results = [Result("a", "d1", ETH_VF), Result("b", "d2", VFIO_VF)]
    lines = sorted(str(p) for p in params.plan(config, results, DRIVER).problems)
    assert lines == [
        "request a: trust: must be true or false, not a string (FromClaim config[0])",
        "request a: vlan: 9999 is out of range 0-4095 (FromClaim config[0])",
        "request b: mtu: the device has no netdev: it is bound to vfio-pci (d2)",
    ]


def test_a_bad_entry_for_every_request_refuses_each_request() -> None:
    results = [Result("a", "d1", ETH_VF), Result("b", "d2", ETH_VF)]
    plan = params.plan([entry(vf(vlan=-3))], results, DRIVER)
    assert [p.request for p in plan.problems] == ["a", "b"]
    plan = params.plan(
        [{"source": "FromClaim", "requests": "a", "opaque": {"driver": DRIVER}}], results, DRIVER
    )
    assert [(p.request, p.field) for p in plan.problems] == [("a", "requests"), ("b", "requests")]


def test_a_request_and_field_from_outside_cannot_break_the_line() -> None:
    plan = params.plan([entry(vf(**{"x\nvlan": 1}))], [Result("r\x1b[2J", "d", ETH_VF)], DRIVER)
    line = one(plan.problems)
    assert "\x1b" not in line and "\\x1b" in line and "x\\nvlan: unknown field" in line


def test_facts_of_a_scanned_vf_take_the_pfs_link_type() -> None:
    ib_pf = dev("0000:3b:00.0", Role.PF, link_type="infiniband", pf="", pf_netdev="")
    vfio_vf = dev("0000:3b:00.2", driver="vfio-pci", link_type="", netdevs=())
    # vfio-bound: no netdev of its own, but its PF's says InfiniBand, so a VLAN is refused for what it is.
    facts = params.facts_of(vfio_vf, ib_pf)
    assert facts == DeviceFacts(Role.VF, LinkType.INFINIBAND, "vfio-pci", False, -1)
    assert params.check_device(VfConfig(vlan=3), facts) == [("vlan", "does not apply to an InfiniBand VF")]
    # Without the PF in the table, the VF's own netdev's type stands in; with neither, nothing is sent.
    assert params.facts_of(dev("0000:3b:00.3", link_type="ether"), None).link_type is LinkType.ETHER
    assert params.facts_of(vfio_vf, None).link_type is LinkType.NONE
    assert params.facts_of(dev("0000:3b:00.4", pf_netdev=""), ib_pf).link_type is LinkType.NONE
    assert params.facts_of(ib_pf, None, admin_access=True) == DeviceFacts(
        Role.PF, LinkType.INFINIBAND, "mlx5_core", True, -1
    )
    assert params.facts_of(dev("0000:3b:00.5", iommu_group=40), None).iommu_group == 40


# ---- merging: class entries first, then the claim's, later fields win --------------------------------


def merged(config: list[dict[str, Any]], request: str = "nic", facts: DeviceFacts = ETH_VF) -> VfConfig:
    """Return the effective config of one request's device, failing on any refusal."""
    plan = params.plan(config, [Result(request, "dev", facts)], DRIVER)
    assert plan.problems == ()
    return plan.configs.get("dev", params.EMPTY)


def test_claim_entries_override_class_entries_whatever_the_list_order() -> None:
    cls = entry(vf(vlan=10, trust=False, mtu=1500), source="FromClass")
    claim = entry(vf(vlan=20, mtu=9000))
    expected = VfConfig(vlan=20, trust=False, mtu=9000)
    assert merged([cls, claim]) == expected
    assert merged([claim, cls]) == expected  # the class still applies first


def test_later_entries_override_earlier_ones_field_by_field() -> None:
    config = [
        entry(vf(vlan=10, qos=1, linkState="enable")),
        entry(vf(vlan=30, maxTxRateMbps=100)),
        entry(vf(linkState="auto")),
    ]
    assert merged(config) == VfConfig(vlan=30, qos=1, max_tx_rate_mbps=100, link_state=LinkState.AUTO)


def test_cross_field_checks_see_the_merged_config() -> None:
    # qos alone is refused, but a class entry supplying the vlan makes it whole.
    assert merged([entry(vf(vlan=7), source="FromClass"), entry(vf(qos=5))]) == VfConfig(vlan=7, qos=5)
    # The class's vfio-pci and the claim's MTU contradict each other once merged.
    plan = params.plan(
        [entry(vf(driver="vfio-pci"), source="FromClass"), entry(vf(mtu=9000))],
        [Result("nic", "d", ETH_VF)],
        DRIVER,
    )
    assert one(plan.problems) == "request nic: mtu: the VF has no netdev when bound to vfio-pci"
    # A later kernel driver lifts it.
    assert merged([entry(vf(driver="vfio-pci")), entry(vf(driver="iavf", mtu=9000))]).mtu == 9000


def test_entries_apply_to_the_requests_they_name() -> None:
    config = [entry(vf(vlan=1)), entry(vf(vlan=2), "a"), entry(vf(trust=True), "b", "c")]
    results = [Result("a", "d1", ETH_VF), Result("b", "d2", ETH_VF), Result("z", "d3", ETH_VF)]
    plan = params.plan(config, results, DRIVER)
    assert plan.problems == ()
    assert plan.configs == {
        "d1": VfConfig(vlan=2),
        "d2": VfConfig(vlan=1, trust=True),
        "d3": VfConfig(vlan=1),
    }


def test_a_request_covers_its_subrequests_and_a_subrequest_only_itself() -> None:
    config = [entry(vf(vlan=5), "main"), entry(vf(mtu=9000), "main/big"), entry(vf(mtu=4000), "mainx")]
    results = [
        Result("main/big", "d1", ETH_VF),
        Result("main/small", "d2", ETH_VF),
        Result("mainx", "d3", ETH_VF),
    ]
    plan = params.plan(config, results, DRIVER)
    assert plan.configs == {
        "d1": VfConfig(vlan=5, mtu=9000),
        "d2": VfConfig(vlan=5),
        "d3": VfConfig(mtu=4000),
    }


def test_entries_of_other_drivers_and_other_kinds_of_config_are_left_alone() -> None:
    config: list[Any] = [
        entry({"anything": True}, driver="gpu.example.com"),
        {"source": "FromClaim", "future": {"x": 1}},  # a config kind this driver does not read
        entry(vf(vlan=3)),
    ]
    assert merged(config) == VfConfig(vlan=3)
    assert params.plan(None, [Result("nic", "d", ETH_VF)], DRIVER) == params.Plan({}, ())


def test_the_driver_name_is_a_parameter() -> None:
    config = [entry(vf(vlan=3), driver="vf.example.org"), entry(vf(vlan=4))]
    plan = params.plan(config, [Result("nic", "d", ETH_VF)], "vf.example.org")
    assert plan.configs == {"d": VfConfig(vlan=3)}


def test_one_device_in_two_requests_must_be_asked_the_same() -> None:
    results = [Result("a", "d", ETH_VF), Result("b", "d", ETH_VF)]
    same = params.plan([entry(vf(vlan=3))], results, DRIVER)
    assert same.configs == {"d": VfConfig(vlan=3)} and same.problems == ()
    differ = params.plan([entry(vf(vlan=3), "a"), entry(vf(vlan=4), "b")], results, DRIVER)
    assert one(differ.problems) == "request b: parameters: d is also in request a, which asks otherwise"


def test_a_config_writes_back_as_the_document_it_was_read_from() -> None:
    doc = vf(driver="vfio-pci", vlan=100, qos=3, mac="02:00:00:00:00:0a", linkState="disable", spoofChk=False)
    cfg = params.parse_parameters(doc)
    assert isinstance(cfg, VfConfig)
    assert cfg.to_json() == doc
    assert cfg.link_state is LinkState.DISABLE and cfg.link_state.kernel == 2
    assert params.parse_parameters(vf(mac="02:AB:CD:EF:00:01")) == VfConfig(mac="02:ab:cd:ef:00:01")


def test_sizes_are_measured_without_expanding_shared_or_deep_structures() -> None:
    # YAML aliases can make a small file a huge document: 2**60 leaves, measured only up to the limit.
    shared: Any = ["x" * 8]
    for _ in range(60):
        shared = [shared, shared]
    assert one(params.plan([entry(vf(n=shared))], [Result("r", "d", ETH_VF)], DRIVER).problems).endswith(
        "parameters: more than 10240 bytes of JSON (the API's limit) (FromClaim config[0])"
    )
    deep: Any = 1
    for _ in range(100_000):
        deep = [deep]
    assert params.parse_parameters(vf(n=deep)) == [
        ("parameters", "more than 10240 bytes of JSON (the API's limit)")
    ]
    # Just under the limit is still read (and then refused for its unknown field, not its size).
    doc = vf(pad="")
    doc["pad"] = "x" * (10240 - len(json.dumps(doc, separators=(",", ":"))))
    assert len(json.dumps(doc, separators=(",", ":"))) == 10240
    assert params.parse_parameters(doc) == [("pad", "unknown field")]


# ---- any JSON: a VfConfig or refusals, never an exception ------------------------------------------------

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
)
_json = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=20,
)
_field_values = {
    "driver": st.sampled_from(["vfio-pci", "iavf", "", "a/b"]) | _scalars,
    "mtu": st.integers(0, 70_000) | _scalars,
    "mac": st.sampled_from(["02:00:00:00:00:01", "01:00:00:00:00:01", "zz"]) | _scalars,
    "vlan": st.integers(-2, 4100) | _scalars,
    "qos": st.integers(-1, 9) | _scalars,
    "trust": _scalars,
    "spoofChk": _scalars,
    "minTxRateMbps": st.integers(-1, 2**33) | _scalars,
    "maxTxRateMbps": st.integers(-1, 2**33) | _scalars,
    "linkState": st.sampled_from(["auto", "enable", "disable", "up"]) | _scalars,
    "ifName": st.text(max_size=20) | _scalars,
}
_vfconfig_like = st.fixed_dictionaries(
    {"apiVersion": st.sampled_from([API_VERSION, "v1"]), "kind": st.sampled_from([KIND, "Other"])},
    optional={**_field_values, "extra": _json},
)
_facts = st.builds(
    DeviceFacts,
    st.sampled_from(list(Role)),
    st.sampled_from(list(LinkType)),
    st.sampled_from(["", "vfio-pci", "iavf", "mlx5_core"]),
    st.booleans(),
)
_entries = st.lists(
    st.fixed_dictionaries(
        {"opaque": st.fixed_dictionaries({"driver": st.just(DRIVER), "parameters": _vfconfig_like | _json})},
        optional={
            "source": st.sampled_from(["FromClass", "FromClaim"]) | _scalars,
            "requests": st.lists(st.sampled_from(["a", "b", "a/x"]), max_size=2) | _json,
        },
    )
    | _json,
    max_size=4,
)


@settings(max_examples=300, deadline=None)
@given(doc=_vfconfig_like | _json)
def test_any_json_parameters_give_a_config_or_refusals(doc: Any) -> None:
    parsed = params.parse_parameters(doc)
    if isinstance(parsed, VfConfig):
        assert isinstance(doc, dict) and doc.get("apiVersion") == API_VERSION and doc.get("kind") == KIND
        assert params.parse_parameters(parsed.to_json()) == parsed  # what was read reads back the same
    else:
        assert parsed and all(isinstance(f, str) and why and "\n" not in why for f, why in parsed)


@settings(max_examples=300, deadline=None)
@given(doc=_json)
def test_the_size_measured_is_that_of_compact_json(doc: Any) -> None:
    exact = len(json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "surrogatepass"))
    assert params._encoded_size(doc, 1 << 30) == exact
    assert params._encoded_size(doc, 10) >= min(exact, 11)  # stops past the limit, never short of it


@settings(max_examples=200, deadline=None)
@given(
    config=_entries | _json,
    results=st.lists(
        st.builds(Result, st.sampled_from(["a", "b", "a/x", "a/y"]), st.sampled_from(["d1", "d2"]), _facts),
        max_size=4,
    ),
)
def test_any_allocation_config_gives_a_plan_or_one_line_refusals(config: Any, results: list[Result]) -> None:
    plan = params.plan(config, results, DRIVER)
    assert not (plan.configs and plan.problems)
    for p in plan.problems:
        assert "\n" not in str(p) and p.request in {r.request for r in results}
    for device, cfg in plan.configs.items():
        assert cfg.settings()
        for r in results:
            if r.device == device:
                assert params.check_device(cfg, r.facts) == [] and params.check_config(cfg) == []


# ---- densedev dra-check-params, as a user runs it --------------------------------------------------------


def check_params(args: list[str], env: dict[str, str], code: str = "") -> subprocess.CompletedProcess[str]:
    """Run ``densedev dra-check-params ARGS`` to completion (``code`` replaces the entry point)."""
    argv = ["-c", code, *args] if code else ["-m", "densedev.cli", "dra-check-params", *args]
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=GUARD, env=env)


# One template per use (docs/dra.md): what each asks of its VF, as the command reports it.
USES = {
    "dpdk-vf.yaml": ("vf", {"driver": "vfio-pci", "vlan": 200, "spoofChk": True}),
    "vlan-vf.yaml": ("vf", {"mtu": 9000, "vlan": 100, "qos": 3, "trust": True, "ifName": "net1"}),
    "rate-limited-vf.yaml": ("vfs", {"minTxRateMbps": 1000, "maxTxRateMbps": 10000, "linkState": "auto"}),
}


@pytest.mark.parametrize("name", sorted(USES))
def test_the_documented_templates_pass(name: str, child_env: dict[str, str]) -> None:
    done = check_params([str(DATA / name)], child_env)
    assert (done.returncode, done.stderr) == (0, "")
    (line,) = done.stdout.splitlines()
    request, settings = USES[name]
    head, _, asked = line.partition(f": OK, request {request}: ")
    assert head.startswith(str(DATA / name)) and json.loads(asked) == settings, line


def test_the_templates_are_the_ones_the_docs_show_and_kubernetes_takes() -> None:
    import yaml

    from densedev.testing.apiserver import SchemaChecker

    section = DOCS.read_text().split("## Claim parameters", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```yaml\n(.*?)```", section, re.S)
    files = {p.name: p.read_text() for p in DATA.glob("*.yaml")}
    assert sorted(files) == ["dpdk-vf.yaml", "rate-limited-vf.yaml", "vlan-vf.yaml"]
    for text in files.values():
        assert text in blocks  # the docs show each file as it is
        SchemaChecker().check(yaml.safe_load(text), "1.34")  # and the API server would take it


def test_the_output_the_docs_show_is_what_the_command_prints(child_env: dict[str, str]) -> None:
    section = DOCS.read_text().split("## Claim parameters", 1)[1]
    shown = re.search(r"\$ densedev dra-check-params vlan-vf.yaml\n(.*?)\n", section)
    assert shown is not None
    done = subprocess.run(
        [sys.executable, "-m", "densedev.cli", "dra-check-params", "vlan-vf.yaml"],
        capture_output=True,
        text=True,
        timeout=GUARD,
        env=child_env,
        cwd=DATA,
    )
    assert (done.returncode, done.stdout) == (0, shown[1] + "\n")


BROKEN = [
    # (template, (old, new) edit, the line expected after "<file>: ResourceClaimTemplate default/<name>: ")
    (
        "dpdk-vf.yaml",
        ("driver: vfio-pci", "driver: vfio-pci\n            mtu: 9000"),
        "request vf: mtu: the VF has no netdev when bound to vfio-pci",
    ),
    (
        "dpdk-vf.yaml",
        ("vlan: 200", "vlan: 4096"),
        "request vf: vlan: 4096 is out of range 0-4095 (FromClaim config[0])",
    ),
    (
        "dpdk-vf.yaml",
        ("requests: [vf]", "requests: [nic]"),
        "request nic: requests: names no request of this claim (FromClaim config[0])",
    ),
    (
        "vlan-vf.yaml",
        ("trust: true", "trust: yes please"),
        "request vf: trust: must be true or false, not a string (FromClaim config[0])",
    ),
    (
        "vlan-vf.yaml",
        ("            vlan: 100\n", ""),
        "request vf: qos: needs vlan in the same config (IFLA_VF_VLAN sets both)",
    ),
    (
        "vlan-vf.yaml",
        ("ifName: net1", "ifName: eth-pod-uplink-1"),
        "request vf: ifName: 'eth-pod-uplink-1' is 16 bytes; an interface name has at most 15"
        " (FromClaim config[0])",
    ),
    (
        "rate-limited-vf.yaml",
        ("minTxRateMbps: 1000", "minTxRateMbps: 20000"),
        "request vfs: minTxRateMbps: 20000 Mbit/s is above maxTxRateMbps 10000",
    ),
    (
        "rate-limited-vf.yaml",
        ("linkState: auto", "linkState: on"),
        "request vfs: linkState: must be one of auto, enable, disable, not a boolean (FromClaim config[0])",
    ),
    (
        "rate-limited-vf.yaml",
        ("kind: VfConfig", "kind: VFConfig"),
        "request vfs: kind: 'VFConfig' is not known; this driver reads VfConfig (FromClaim config[0])",
    ),
]


@pytest.mark.parametrize(("name", "edit", "expected"), BROKEN)
def test_broken_templates_fail_with_the_right_line(
    name: str, edit: tuple[str, str], expected: str, tmp_path: Path, child_env: dict[str, str]
) -> None:
    text = (DATA / name).read_text()
    assert edit[0] in text
    path = tmp_path / name
    path.write_text(text.replace(edit[0], edit[1], 1))
    done = check_params([str(path)], child_env)
    label = re.search(r"name: (\S+)", text)
    assert label is not None
    assert (done.returncode, done.stderr) == (1, "")
    assert done.stdout.splitlines() == [f"{path}: ResourceClaimTemplate default/{label[1]}: {expected}"]


def test_json_lists_classes_and_allocated_claims(tmp_path: Path, child_env: dict[str, str]) -> None:
    cls = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": "dpdk.net.densedev.io"},
        "spec": {"config": [{"opaque": {"driver": DRIVER, "parameters": vf(driver="vfio-pci", vlan=5)}}]},
    }
    claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "c", "namespace": "ns"},
        "spec": {"devices": {"requests": [{"name": "vf"}]}},
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {"request": "vf", "driver": DRIVER, "pool": "p", "device": "pci-0000-3b-00-2"}
                    ],
                    "config": [entry(vf(vlan=5, trust=True), source="FromClass"), entry(vf(vlan=6), "vf")],
                }
            }
        },
    }
    path = tmp_path / "objects.json"
    path.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": [cls, claim]}))
    done = check_params([str(path)], child_env)
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.splitlines() == [
        f'{path}: DeviceClass dpdk.net.densedev.io: OK, request *: {{"driver": "vfio-pci", "vlan": 5}}',
        f'{path}: ResourceClaim ns/c: OK, request vf: {{"vlan": 6, "trust": true}}',
    ]
    cls["spec"]["config"][0]["opaque"]["parameters"]["mtu"] = 1500
    path.write_text(json.dumps(cls))
    done = check_params([str(path)], child_env)
    assert done.returncode == 1
    assert (
        done.stdout
        == f"{path}: DeviceClass dpdk.net.densedev.io: request *: mtu: the VF has no netdev when bound to"
        " vfio-pci\n"
    )


def test_another_driver_name_is_checked_with_driver_and_noted_without(
    tmp_path: Path, child_env: dict[str, str]
) -> None:
    path = tmp_path / "t.yaml"
    path.write_text(
        (DATA / "dpdk-vf.yaml").read_text().replace("driver: net.densedev.io", "driver: vf.example.org")
    )
    done = check_params([str(path)], child_env)
    assert done.returncode == 0
    assert done.stdout.splitlines() == [
        f"{path}: ResourceClaimTemplate default/dpdk-vf: OK, no config for net.densedev.io",
        f"{path}: ResourceClaimTemplate default/dpdk-vf: note: config for driver vf.example.org is not"
        " checked (not net.densedev.io)",
    ]
    done = check_params([str(path), "--driver", "vf.example.org"], child_env)
    assert done.returncode == 0 and '"driver": "vfio-pci"' in done.stdout


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (None, "cannot read the file: No such file or directory"),
        ("apiVersion: v1\nkind: [\n", "neither JSON nor YAML: "),
        (b"\xff\xfe{}", "not UTF-8 text (byte 0)"),
        ('{"kind": "Pod"}', "no ResourceClaimTemplate, ResourceClaim, DeviceClass in it (found Pod)"),
        ("[" * 100_000, "nested too deeply"),
    ],
)
def test_a_file_that_cannot_be_checked_is_one_line_and_exit_2(
    content: str | bytes | None, reason: str, tmp_path: Path, child_env: dict[str, str]
) -> None:
    path = tmp_path / "claim.yaml"
    if isinstance(content, str):
        path.write_text(content)
    elif isinstance(content, bytes):
        path.write_bytes(content)
    done = check_params([str(path)], child_env)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.startswith(f"densedev dra-check-params: error: {path}: {reason}"), done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path, child_env: dict[str, str]) -> None:
    import os

    os.mkfifo(tmp_path / "fifo")
    done = check_params([str(tmp_path / "fifo")], child_env)
    assert (done.returncode, done.stderr) == (
        2,
        f"densedev dra-check-params: error: {tmp_path / 'fifo'}: not a regular file (a FIFO)\n",
    )


def test_without_pyyaml_json_is_read_and_yaml_refused_in_one_line(
    tmp_path: Path, child_env: dict[str, str]
) -> None:
    # sys.modules["yaml"] = None makes "import yaml" fail as if PyYAML were not installed.
    code = (
        "import sys; sys.modules['yaml'] = None; from densedev.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    import yaml

    doc = yaml.safe_load((DATA / "vlan-vf.yaml").read_text())
    (tmp_path / "t.json").write_text(json.dumps(doc))
    done = check_params(["dra-check-params", str(tmp_path / "t.json")], child_env, code)
    assert (done.returncode, done.stderr) == (0, "") and ": OK, request vf: " in done.stdout
    done = check_params(["dra-check-params", str(DATA / "vlan-vf.yaml")], child_env, code)
    assert done.returncode == 2
    assert (
        done.stderr.endswith("(YAML needs PyYAML, which is not installed)\n")
        and len(done.stderr.splitlines()) == 1
    )
