"""The RDMA shared device plugin's config (``configList``): read as it is, checked, served as it serves.

The documents below are the shapes of k8s-rdma-shared-dev-plugin's README and example ConfigMap; every
expectation is written from that plugin's behaviour (pkg/resources: ``ValidateConfigs``, the selectors,
``newResourceServer`` advertising ``rdmaHcaMax`` IDs "0" … "N-1", ``Allocate`` returning the char devices
of every selected HCA), never from densedev's own helpers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from helpers.node import GUARD_S, Node
from hypothesis import given
from hypothesis import strategies as st

from densedev import cli, poolset
from densedev.daemon import Daemon
from densedev.model import DeviceType, Preferred, Selector, SharedScope
from densedev.node import scanner
from densedev.pools import rdma_format, select
from densedev.pools.config import ConfigError, Format, check, detect_format, parse
from densedev.testing import simnode
from densedev.testing.kubelet import HEALTHY, UNHEALTHY, KubeletEmulator

RDMA_CM = "/dev/infiniband/rdma_cm"

# The plugin's README example, as it is.
README = {
    "configList": [
        {"resourceName": "hca_shared_devices_a", "rdmaHcaMax": 1000, "devices": ["ib0", "ib1"]},
        {
            "resourceName": "hca_shared_devices_b",
            "rdmaHcaMax": 500,
            "selectors": {"vendors": ["15b3"], "deviceIDs": ["1017"], "ifNames": ["ib3", "ib4"]},
        },
    ]
}


def problems_of(doc: Any) -> tuple[str, ...]:
    """Return the problems parse() reports for a document (a dict is dumped to JSON first)."""
    with pytest.raises(ConfigError) as info:
        parse(doc if isinstance(doc, str) else json.dumps(doc))
    return info.value.problems


def entry(**kw: Any) -> dict[str, Any]:
    """A one-entry configList document; ``kw`` replaces or adds the entry's keys (None removes one)."""
    e: dict[str, Any] = {"resourceName": "hca", "rdmaHcaMax": 4, "devices": ["ib0"], **kw}
    return {"configList": [{k: v for k, v in e.items() if v is not None}]}


# ------------------------------------------------------------------------------------------ reading


def test_readme_example_loads_as_pool_wide_shared_rdma_pools() -> None:
    cfg = parse(json.dumps(README))
    a, b = cfg.pools
    assert [p.full_name for p in cfg.pools] == ["rdma/hca_shared_devices_a", "rdma/hca_shared_devices_b"]
    assert (a.rdma_shared, a.rdma_scope) == (1000, SharedScope.POOL)
    assert a.selectors == (Selector(if_names=("ib0", "ib1"), is_rdma=True),)
    assert b.selectors == (
        Selector(vendors=("15b3",), devices=("1017",), if_names=("ib3", "ib4"), is_rdma=True),
    )
    for p in cfg.pools:
        # The plugin takes network functions of any role, sends no topology, offers no preferred allocation.
        assert (p.device_type, p.exclude_topology, p.preferred) == (
            DeviceType.ACCELERATOR,
            True,
            Preferred.NONE,
        )
    assert cfg.reconcile_s == 60  # the plugin's default periodicUpdateInterval, densedev's default rescan
    assert cfg.warnings == ()


def test_example_configmap_with_interval_and_kubelet_root_dir() -> None:
    # deployment/k8s/base/configmap.yaml of the plugin: kubeletRootDir sits beside configList.
    doc = {"kubeletRootDir": "/var/lib/kubelet", "periodicUpdateInterval": 300, **README}
    cfg = parse(json.dumps(doc))
    assert cfg.reconcile_s == 300
    assert len(cfg.warnings) == 1 and cfg.warnings[0].startswith("kubeletRootDir: not read from the file")


def test_prefix_and_interval_zero() -> None:
    cfg = parse(json.dumps({**entry(resourcePrefix="nvidia.com"), "periodicUpdateInterval": 0}))
    assert cfg.pools[0].full_name == "nvidia.com/hca"
    assert cfg.reconcile_s == 60
    assert cfg.warnings[0].startswith("periodicUpdateInterval: 0 turns the plugin's rescans off")
    # An empty prefix is the default one (ValidateConfigs), whatever --resource-prefix says.
    assert parse(json.dumps(entry(resourcePrefix="")), default_prefix="intel.com").pools[0].full_name == (
        "rdma/hca"
    )


@pytest.mark.parametrize(
    ("doc", "expected"),
    [
        ({"configList": []}, "configList: empty: no resource to serve"),
        ({"configList": {}}, "configList: expected a list of resource objects, got object"),
        ({"periodicUpdateInterval": 5}, "configList: required (a list of shared RDMA resources)"),
        (
            {**entry(), "periodicUpdateInterval": -1},
            "periodicUpdateInterval: expected 0 or more seconds, got -1",
        ),
        (
            {**entry(), "periodicUpdateInterval": 1.5},
            "periodicUpdateInterval: expected a whole number of seconds, got number",
        ),
        (
            {**entry(), "periodicUpdateInterval": 5, "reconcileSeconds": 5},
            "periodicUpdateInterval: given with reconcileSeconds: both set the full-rescan interval",
        ),
        (entry(rdmaHcaMax=-1), "configList[0] (hca): rdmaHcaMax: expected 0 to 65535, got -1"),
        (
            entry(rdmaHcaMax="4"),
            "configList[0] (hca): rdmaHcaMax: expected a whole number of pods, got string",
        ),
        (entry(resourceName=None), "configList[0] (no resourceName): resourceName: required"),
        (
            entry(selectors={"vendors": ["15b3"]}),
            'configList[0] (hca): both "selectors" and "devices": give one (the plugin refuses both)',
        ),
        (
            entry(devices=None),
            'configList[0] (hca): no "selectors" or "devices": name the HCAs to share (the plugin refuses)',
        ),
        (
            entry(devices=[], selectors={}),
            'configList[0] (hca): no "selectors" or "devices": name the HCAs to share (the plugin refuses)',
        ),
        (entry(devices=["ib/0"]), 'configList[0] (hca): devices[0]: "ib/0" is not a valid interface name'),
        (
            entry(devices=None, selectors={"vendor": ["15b3"]}),
            'configList[0] (hca): selectors: unknown key "vendor" (did you mean "vendors"?)',
        ),
        (
            entry(devices=None, selectors={"pfNames": ["ib0"]}),
            'configList[0] (hca): selectors: unknown key "pfNames"',
        ),
        (entry(deviceType="netDevice"), 'configList[0] (hca): unknown key "deviceType"'),
        (
            entry(resourceName="Hca!"),
            'configList[0] (Hca!): resourceName/resourcePrefix: the kubelet would refuse "rdma/Hca!": '
            'name part "Hca!" must be [A-Za-z0-9._-], starting and ending alphanumeric',
        ),
        (
            {"configList": [entry()["configList"][0], entry()["configList"][0]]},
            'configList[1] (hca): resource "rdma/hca" already defined by configList[0]',
        ),
        ({**entry(), "draDriverName": "x.io"}, "mixes two formats"),
    ],
)
def test_each_problem_is_one_line_naming_entry_and_key(doc: Any, expected: str) -> None:
    got = problems_of(doc)
    assert len(got) == 1, got
    assert got[0].startswith(expected), got


def test_what_the_plugin_refuses_but_the_kubelet_takes_loads_with_a_warning() -> None:
    cfg = parse(json.dumps(entry(resourceName="hca.a-1", rdmaHcaMax=None)))
    assert cfg.pools[0].rdma_shared == 0
    assert any('"hca.a-1" has characters outside [a-zA-Z0-9_]' in w for w in cfg.warnings)
    assert any("rdmaHcaMax: missing" in w for w in cfg.warnings)
    assert any("RDMA_HCA.A-1" not in w and "PCIDEVICE_RDMA_HCA_A-1" in w for w in cfg.warnings)


def test_vendor_ids_compare_as_exact_strings_with_a_warning() -> None:
    cfg = parse(json.dumps(entry(devices=None, selectors={"vendors": ["0x15B3"]})))
    assert cfg.pools[0].selectors[0].vendors == ("0x15B3",)
    assert 'write "15b3"' in cfg.warnings[0] and "the RDMA shared device plugin" in cfg.warnings[0]


@pytest.mark.parametrize(
    "doc",
    [
        {"resourceList": [], "configList": []},
        {"ResourceList": [], "periodicUpdateInterval": 1},  # keys match case-insensitively, as Go's
        {"configList": [], "draDriverName": "a.io"},
    ],
)
def test_a_file_mixing_the_formats_gets_one_clear_line(doc: dict[str, Any]) -> None:
    (line,) = problems_of(doc)
    assert line.startswith("mixes two formats: ")
    assert "the SR-IOV network device plugin's" in line and "the RDMA shared device plugin's" in line
    assert line.endswith("a file is one or the other")
    assert not isinstance(detect_format(doc), Format)


def test_formats_are_named_by_their_list() -> None:
    assert detect_format(README) is Format.RDMA_SHARED
    assert detect_format({"resourceList": []}) is Format.SRIOV
    assert detect_format({}) is Format.SRIOV  # the format densedev always read: names the missing list


def test_check_config_names_problems_as_for_the_other_format(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({"configList": [{"resourceName": "a", "rdmaHcaMax": -2, "devices": ["ib0"]}]}))
    assert check(bad) == ("configList[0] (a): rdmaHcaMax: expected 0 to 65535, got -2",)
    assert cli.main(["check-config", str(bad)]) == 1
    assert capsys.readouterr().out == f"{bad}: configList[0] (a): rdmaHcaMax: expected 0 to 65535, got -2\n"
    good = tmp_path / "good.json"
    good.write_text(json.dumps(README))
    assert cli.main(["check-config", "--strict", str(good)]) == 0
    assert capsys.readouterr().out == f"{good}: OK\n"


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 70000) | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=12,
)
_RDMA_KEYS = [*rdma_format.ENTRY_KEYS, *rdma_format.SELECTOR_KEYS]


@given(
    st.lists(
        st.dictionaries(
            st.sampled_from(_RDMA_KEYS) | st.text(max_size=6), _json_values | st.just("ib0"), max_size=5
        ),
        max_size=4,
    ),
    st.dictionaries(st.sampled_from(rdma_format.TOP_KEYS), _json_values, max_size=3),
)
def test_any_rdma_document_gives_a_config_or_a_config_error(
    entries: list[dict[str, Any]], top: dict[str, Any]
) -> None:
    # Bad input never escapes as anything but ConfigError: the daemon reloads configs while running.
    try:
        cfg = parse(json.dumps({**top, "configList": entries}))
    except ConfigError as exc:
        assert exc.problems and all(isinstance(p, str) and p and "\n" not in p for p in exc.problems)
    else:
        assert len(cfg.pools) == len(entries)
        assert all(p.rdma_scope is SharedScope.POOL for p in cfg.pools)


# ---------------------------------------------------------------------------------------- selecting


def test_selection_matches_the_plugin_on_a_simulated_node(tmp_path: Path) -> None:
    layout = simnode.build_node(tmp_path, pfs=4, vfs_per_pf=2, rdma=True)
    pfs = layout.pfs
    doc = {
        "configList": [
            {"resourceName": "a", "rdmaHcaMax": 3, "devices": [pfs[0].netdev, pfs[1].netdev]},
            # Fewer IDs than HCAs: every ID still brings all three.
            {"resourceName": "b", "rdmaHcaMax": 2, "selectors": {"ifNames": [p.netdev for p in pfs[1:]]}},
            {
                "resourceName": "vfs",
                "rdmaHcaMax": 7,
                "selectors": {"vendors": ["15b3"], "linkTypes": ["ether"]},
            },
            {"resourceName": "none", "rdmaHcaMax": 9, "devices": ["nosuch0"]},
        ]
    }
    a, b, vfs, none = select.build_pools(parse(json.dumps(doc)), scanner.scan(tmp_path).devices)
    # IDs "0" … "rdmaHcaMax-1" for the resource, as the plugin lists them.
    assert [m.id for m in a.members] == ["0", "1", "2"]
    assert [d.id for d in a.shared] == [pfs[0].address, pfs[1].address]
    # A PF is the first pool's: b keeps the HCAs no earlier resource took.
    assert [m.id for m in b.members] == ["0", "1"]
    assert [d.id for d in b.shared] == [pfs[2].address, pfs[3].address]
    assert {m.device.id for m in b.members} == {pfs[2].address, pfs[3].address}
    # vendors + linkTypes: every RDMA VF left (the PFs were taken).
    assert sorted(d.id for d in vfs.shared) == sorted(layout.vf_addresses)
    assert len(vfs.members) == 7
    # Nothing selected: no devices advertised, as the plugin's "no Rdma Devices were found".
    assert (none.members, none.shared) == ((), ())


# ---------------------------------------------------------------------------------- end to end


def rdma_doc(layout: simnode.NodeLayout) -> dict[str, Any]:
    """The node's config in the RDMA shared device plugin's shape: two HCAs shared by 5 pods, one by 3."""
    pfs = layout.pfs
    return {
        "periodicUpdateInterval": 300,
        "rdmaPollSeconds": 0.05,
        "configList": [
            {"resourceName": "hca_shared_a", "rdmaHcaMax": 5, "devices": [pfs[0].netdev, pfs[1].netdev]},
            {
                "resourceName": "hca_shared_b",
                "resourcePrefix": "nvidia.com",
                "rdmaHcaMax": 3,
                "selectors": {"vendors": ["15b3"], "ifNames": [pfs[2].netdev]},
            },
        ],
    }


@pytest.fixture
def node_options() -> dict[str, Any]:
    """A node of four RDMA PFs (two VFs each) whose config is in the RDMA shared plugin's shape."""
    return {"pfs": 4, "vfs_per_pf": 2, "rdma": True, "config": rdma_doc}


@pytest.fixture
def daemon_settings(node: Node) -> dict[str, Any]:
    """No CDI, so that the response carries the device nodes; /dev stand-ins made as udev names them."""
    for cls in ("infiniband_verbs", "infiniband_mad", "infiniband_cm"):
        d = node.sysfs / "class" / cls
        for name in os.listdir(d) if d.is_dir() else ():
            (node.tmp / "dev" / "infiniband").mkdir(parents=True, exist_ok=True)
            (node.tmp / "dev" / "infiniband" / name).touch()
    (node.tmp / "dev" / "infiniband" / "rdma_cm").touch()
    return {"cdi_dir": None}


def char_devices(node: Node, address: str) -> set[str]:
    """Return the /dev paths of a function's RDMA char devices, read from its sysfs class dirs."""
    fn = os.path.realpath(node.sysfs / "bus" / "pci" / "devices" / address)
    out: set[str] = set()
    for cls in ("infiniband_verbs", "infiniband_mad", "infiniband_cm"):
        d = os.path.join(fn, cls)
        out.update(f"/dev/infiniband/{n}" for n in (os.listdir(d) if os.path.isdir(d) else ()))
    return out


@pytest.fixture
def hcas(node: Node) -> tuple[str, ...]:
    """The PF addresses of the node, in order."""
    return tuple(pf.address for pf in node.layout.pfs)


async def test_kubelet_sees_rdma_hca_max_ids_and_allocate_gives_every_hca(
    node: Node, kubelet: KubeletEmulator, daemon: Daemon, hcas: tuple[str, ...]
) -> None:
    emu = kubelet
    a, b = "rdma/hca_shared_a", "nvidia.com/hca_shared_b"
    assert emu.devices(a) == dict.fromkeys(map(str, range(5)), HEALTHY)
    assert emu.devices(b) == dict.fromkeys(map(str, range(3)), HEALTHY)
    for resource, ids, selected in ((a, ["3"], hcas[:2]), (a, ["0", "4"], hcas[:2]), (b, ["1"], hcas[2:3])):
        resp = await emu.allocate(resource, ids)
        want = {RDMA_CM}.union(*(char_devices(node, h) for h in selected))
        assert all(char_devices(node, h) for h in selected)  # the node has them: the check can fail
        got = [(d.container_path, d.host_path, d.permissions) for d in resp.devices]
        assert sorted(got) == sorted((p, p, "rw") for p in want), resource
        # densedev's variables name the HCAs (the plugin sets none; see docs/migrating.md).
        env = "PCIDEVICE_" + resource.upper().replace(".", "_").replace("/", "_")
        assert resp.envs[env] == ",".join(selected)


async def test_an_hca_port_down_marks_the_ids_laid_on_it_and_recovers(
    node: Node, kubelet: KubeletEmulator, daemon: Daemon
) -> None:
    emu = kubelet
    a = "rdma/hca_shared_a"
    down = node.layout.pfs[1].ibdev
    simnode.set_rdma_port(node.sysfs, down, 1, 1)  # DOWN: densedev polls RDMA port state
    # IDs are laid on the HCAs in turn (0, 2, 4 on the first; 1, 3 on the second).
    want = {"0": HEALTHY, "1": UNHEALTHY, "2": HEALTHY, "3": UNHEALTHY, "4": HEALTHY}
    await emu.wait_for(lambda: emu.devices(a) == want, GUARD_S)
    simnode.set_rdma_port(node.sysfs, down, 1, 4)
    await emu.wait_for(lambda: emu.devices(a) == dict.fromkeys(want, HEALTHY), GUARD_S)


async def test_a_reload_of_the_file_changes_the_count(
    node: Node, kubelet: KubeletEmulator, daemon: Daemon
) -> None:
    emu = kubelet
    doc = rdma_doc(node.layout)
    doc["configList"][0]["rdmaHcaMax"] = 2
    node.write_config(doc)
    await emu.wait_for(lambda: emu.devices("rdma/hca_shared_a") == {"0": HEALTHY, "1": HEALTHY}, GUARD_S)
    # A reload into the other format's mistakes is refused whole; the last good config stays.
    node.write_config({**doc, "resourceList": []})
    await emu.wait_for(lambda: daemon.config.pools[0].rdma_shared == 2, GUARD_S)


def test_an_hca_leaving_replaces_the_pool_even_when_its_ids_stay(tmp_path: Path) -> None:
    # Two IDs over three HCAs: the third HCA is named by no ID, yet every ID brings it, so losing it
    # must reach the allocator (poolset.diff replaces the pool) although the members are the same.
    layout = simnode.build_node(tmp_path, pfs=3, vfs_per_pf=0, rdma=True)
    cfg = parse(
        json.dumps(
            {"configList": [{"resourceName": "a", "rdmaHcaMax": 2, "selectors": {"vendors": ["15b3"]}}]}
        )
    )
    devices = scanner.scan(tmp_path).devices
    before = select.build_pools(cfg, devices)
    after = select.build_pools(cfg, [d for d in devices if d.id != layout.pfs[2].address])
    assert before[0].members == after[0].members
    assert poolset.diff(before, after) == poolset.PoolChanges(replaced=("rdma/a",))


def test_withholding_an_id_keeps_every_hca_the_pool_brings(tmp_path: Path) -> None:
    # An HCA held under another resource withholds the IDs laid on it; the IDs that stay must still
    # bring every selected HCA (Pool.shared), as they did before anything was withheld.
    from densedev.pools.ownership import Ownership

    layout = simnode.build_node(tmp_path, pfs=3, vfs_per_pf=0, rdma=True)
    cfg = parse(
        json.dumps(
            {"configList": [{"resourceName": "a", "rdmaHcaMax": 6, "selectors": {"vendors": ["15b3"]}}]}
        )
    )
    [pool] = select.build_pools(cfg, scanner.scan(tmp_path).devices)
    assert len(pool.shared) == 3
    ownership = Ownership(None)
    ownership.held = {layout.pfs[0].address: frozenset({"intel.com/other"})}
    ownership.source = ownership.source.PODRESOURCES  # a successful read said so
    [kept], withheld = ownership.split([pool])
    assert withheld == {"rdma/a": ("0", "3")}
    assert kept.shared == pool.shared


async def test_two_resources_hand_out_the_same_id_numbers_without_a_clash(
    node: Node, kubelet: KubeletEmulator, daemon: Daemon
) -> None:
    """Each resource of that plugin numbers its IDs "0" … "rdmaHcaMax-1": an ID names a share of the
    resource, no device, so "0" of one resource held by a pod must not refuse "0" of another (it did,
    as "devices held by running pods under another resource", found by the CI run of its DaemonSet)."""
    a, b = "rdma/hca_shared_a", "nvidia.com/hca_shared_b"
    await kubelet.allocate(a, ["0", "1"])
    resp = await kubelet.allocate(b, ["0", "1"])
    assert {d.container_path for d in resp.devices} >= {RDMA_CM}
