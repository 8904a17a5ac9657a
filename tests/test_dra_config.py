"""DRA config keys (per pool ``api``, top-level ``draDriverName``), dra-slices and dra-manifests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from densedev import cli
from densedev.dra import names
from densedev.model import PoolApi
from densedev.pools import config
from densedev.testing import simnode


def _problems(doc: dict[str, Any]) -> tuple[str, ...]:
    with pytest.raises(config.ConfigError) as exc:
        config.parse(json.dumps(doc))
    return exc.value.problems


def test_api_defaults_to_the_device_plugin_and_dra_is_opt_in() -> None:
    cfg = config.parse(
        json.dumps({"resourceList": [{"resourceName": "a"}, {"resourceName": "b", "api": "dra"}]})
    )
    assert [p.api for p in cfg.pools] == [PoolApi.DEVICE_PLUGIN, PoolApi.DRA]
    assert cfg.dra_driver_name == names.DEFAULT_DRIVER_NAME == "net.densedev.io"
    explicit = config.parse(json.dumps({"resourceList": [{"resourceName": "a", "api": "devicePlugin"}]}))
    assert explicit.pools[0].api is PoolApi.DEVICE_PLUGIN
    named = config.parse(json.dumps({"resourceList": [], "draDriverName": "sriov.example.com"}))
    assert named.dra_driver_name == "sriov.example.com"


@pytest.mark.parametrize(
    ("pool", "top", "expected"),
    [
        ({"api": "DRA"}, {}, 'resourceList[0] (x): api: "DRA" is not one of devicePlugin, dra'),
        ({"api": 1}, {}, "resourceList[0] (x): api: expected a string, got number"),
        ({"api": "dra", "deviceType": "auxNetDevice"}, {}, "cannot serve auxNetDevice pools"),
        ({"api": "dra", "deviceType": "accelerator", "rdmaShared": 4}, {}, "cannot serve rdmaShared pools"),
        ({"api": "dra", "resourcePrefix": "a" * 60 + ".com"}, {}, "at most 64 characters"),
        ({}, {"draDriverName": "Net.Densedev.io"}, 'draDriverName: "Net.Densedev.io" is not a lowercase DNS'),
        ({}, {"draDriverName": "a" * 64}, "draDriverName: "),
        ({}, {"draDriverName": ["x"]}, "draDriverName: expected a string, got list"),
    ],
)
def test_bad_dra_values_are_one_line_naming_the_field(
    pool: dict[str, Any], top: dict[str, Any], expected: str
) -> None:
    problems = _problems({"resourceList": [{"resourceName": "x", **pool}], **top})
    assert len(problems) == 1 and expected in problems[0], problems
    assert "\n" not in problems[0]


def test_two_dra_pools_folding_into_one_device_class_are_refused() -> None:
    # Distinct resources with distinct PCIDEVICE_ variables, but DNS labels fold "__" into one "-".
    problems = _problems(
        {"resourceList": [{"resourceName": "vf_a", "api": "dra"}, {"resourceName": "vf__a", "api": "dra"}]}
    )
    assert problems == (
        'resourceList[1] (vf__a): DeviceClass "vf-a.intel.com" is also the class of resourceList[0]',
    )
    # The same two names on the device plugin API have no DeviceClass to share.
    config.parse(
        json.dumps({"resourceList": [{"resourceName": "vf_a", "api": "dra"}, {"resourceName": "vf__a"}]})
    )


def test_check_config_reports_the_bad_api(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"resourceList": [{"resourceName": "x", "api": "grpc"}]}))
    assert cli.main(["check-config", str(f)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out == [f'{f}: resourceList[0] (x): api: "grpc" is not one of devicePlugin, dra']


@pytest.fixture
def dra_node(tmp_path: Path) -> Path:
    layout = simnode.build_node(tmp_path, pfs=4, vfs_per_pf=64, rdma=True)
    simnode.write_config(tmp_path / "config.json", layout)
    doc = json.loads((tmp_path / "config.json").read_text())
    for r in doc["resourceList"]:
        if not r.get("rdmaShared"):
            r["api"] = "dra"
    (tmp_path / "config.json").write_text(json.dumps(doc))
    return tmp_path


def test_dra_slices_prints_slices_that_validate(dra_node: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["dra-slices", "--config", str(dra_node / "config.json"), "--sysfs-root", str(dra_node)]
    assert cli.main([*argv, "--node-name", "node-a"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["kind"] == "List"
    items = doc["items"]
    assert sum(len(s["spec"]["devices"]) for s in items) == 256
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in items} == {len(items)}
    for s in items:
        assert kubernetes_validate.validate(s, "1.34", strict=True)
    assert cli.main([*argv, "--node-name", "node-a", "--api-version", "v1beta1"]) == 0
    for s in json.loads(capsys.readouterr().out)["items"]:
        assert kubernetes_validate.validate(s, "1.32", strict=True)


def test_dra_manifests_print_classes_and_rbac_that_validate(
    dra_node: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        cli.main(["dra-manifests", "--config", str(dra_node / "config.json"), "--namespace", "densedev"]) == 0
    )
    items = json.loads(capsys.readouterr().out)["items"]
    kinds = [i["kind"] for i in items]
    assert kinds.count("DeviceClass") == 3 and kinds[-2:] == ["ClusterRole", "ClusterRoleBinding"]
    assert items[-1]["subjects"][0]["namespace"] == "densedev"
    for i in items:
        assert kubernetes_validate.validate(i, "1.34", strict=True)


def test_dra_commands_refuse_user_mistakes_in_one_line(dra_node: Path, child_env: dict[str, str]) -> None:
    env = {k: v for k, v in child_env.items() if k != "NODE_NAME"}
    base = [sys.executable, "-m", "densedev.cli", "dra-slices", "--config", str(dra_node / "config.json")]
    cases = [
        ([*base, "--sysfs-root", str(dra_node)], "--node-name (or $NODE_NAME) is required"),
        ([*base, "--sysfs-root", str(dra_node), "--node-name", "Node_A"], "'Node_A' is not a DNS subdomain"),
        ([*base[:4], "--config", str(dra_node / "missing.json"), "--node-name", "a"], "cannot read the file"),
    ]
    for argv, expected in cases:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
        assert proc.returncode != 0
        assert expected in proc.stderr and "Traceback" not in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    with_env = subprocess.run(
        [*base, "--sysfs-root", str(dra_node)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**env, "NODE_NAME": "b"},
    )
    assert with_env.returncode == 0 and json.loads(with_env.stdout)["items"][0]["spec"]["nodeName"] == "b"
