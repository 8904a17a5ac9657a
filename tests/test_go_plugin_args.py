"""The SR-IOV network device plugin's command line: densedev's image swapped into the DaemonSets that run
the Go plugin's image with its own arguments (no command word) starts as ``densedev run`` would."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.child import Child

from densedev import __main__ as entry
from densedev import cli
from densedev.argv import go_plugin_argv
from densedev.ops.logs import parse_level
from densedev.testing import simnode
from densedev.testing.kubelet import KubeletEmulator

GUARD = 60.0  # hang guard only


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        # The sriov-network-operator's DaemonSet: no command word, --flag=value.
        (
            ["--log-level=10", "--resource-prefix=openshift.io", "--config-file=/etc/pcidp/n1", "--use-cdi"],
            [
                "run",
                "--log-level=10",
                "--resource-prefix=openshift.io",
                "--config-file=/etc/pcidp/n1",
                "--use-cdi",
            ],
        ),
        # The Go plugin's own DaemonSet, and the --flag value form.
        (
            ["--log-dir", "sriovdp", "--log-level", "10", "--config-file", "/etc/pcidp/n1"],
            ["run", "--log-dir", "sriovdp", "--log-level", "10", "--config-file", "/etc/pcidp/n1"],
        ),
        # The binary's own spelling: Go's flag package takes one dash too.
        (
            ["-config-file=/c", "-resource-prefix", "x.io"],
            ["run", "--config-file=/c", "--resource-prefix", "x.io"],
        ),
        # glog: -v is the log level; the rest are dropped, with their values where they take one.
        (
            [
                "--logtostderr",
                "-v",
                "10",
                "--stderrthreshold",
                "INFO",
                "--alsologtostderr=true",
                "--vmodule=a=1",
            ],
            ["run", "--log-level=10"],
        ),
        (["-logtostderr", "--v=3", "--config-file=/c"], ["run", "--log-level=3", "--config-file=/c"]),
        # The RDMA shared device plugin's version flags: -v is a boolean there.
        (["-v"], ["--version"]),
        (["-version"], ["--version"]),
        (["-v", "--config-file=/c"], ["--version"]),
        (["--v=true"], ["--version"]),
        (["-v", "4"], ["run", "--log-level=4"]),
        # densedev's own command lines are untouched...
        (["run", "--config", "/c"], ["run", "--config", "/c"]),
        (["scan", "--sysfs-root", "/s"], ["scan", "--sysfs-root", "/s"]),
        (["--version"], ["--version"]),
        (["--help"], ["--help"]),
        ([], []),
        # ...and a run spelled with densedev's word takes the Go plugin's flags as well.
        (["run", "-config-file", "/c", "--logtostderr"], ["run", "--config-file", "/c"]),
    ],
)
def test_the_go_plugins_arguments_read_as_a_run(argv: list[str], expected: list[str]) -> None:
    assert go_plugin_argv(argv)[0] == expected


def test_every_dropped_glog_flag_is_named_once() -> None:
    _, notes = go_plugin_argv(["--logtostderr", "-v=4", "--stderrthreshold", "INFO", "--config-file=/c"])
    assert len(notes) == 3
    assert "--logtostderr" in notes[0] and "-v 4" in notes[1] and "--stderrthreshold INFO" in notes[2]


@pytest.mark.parametrize(("text", "level"), [("0", 20), ("3", 20), ("4", 10), ("10", 10), ("info", 20)])
def test_a_glog_verbosity_maps_onto_our_levels(text: str, level: int) -> None:
    assert parse_level(text) == level


def test_run_finds_the_config_where_the_replaced_plugin_keeps_it(tmp_path: Path) -> None:
    """No --config: the first candidate that exists (the RDMA shared plugin's DaemonSet passes none)."""
    candidates = (tmp_path / "pcidp.json", tmp_path / "rdma.json", tmp_path / "densedev.json")
    assert cli.default_config(candidates) == candidates[0]  # none: the first is named in the error
    candidates[2].write_text("{}")
    assert cli.default_config(candidates) == candidates[2]
    candidates[1].write_text("{}")
    assert cli.default_config(candidates) == candidates[1]
    assert cli.build_parser("run").parse_args(["run"]).config is None  # resolved when the run starts


def test_the_entry_point_forks_the_scan_of_a_go_plugin_command_line() -> None:
    """The first scan's child is forked for the operator's argument list, as for ``densedev run``."""
    assert entry.early_scan_root(["--config-file=/etc/pcidp/n1", "--log-level=10"]) == "/sys"
    assert entry.early_scan_root(["--log-dir", "sriovdp", "--sysfs-root", "/x"]) == "/x"


def test_use_cdi_writes_specs_where_the_go_plugin_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """--use-cdi alone means /var/run/cdi; an explicit --cdi-dir wins whatever the order."""
    parser = cli.build_parser("run")
    args = parser.parse_args(["run", "--use-cdi"])
    assert args.use_cdi and args.cdi_dir is None  # _serve resolves it: see the process test below
    args = parser.parse_args(["run", "--cdi-dir", "/x", "--use-cdi"])
    assert args.cdi_dir == Path("/x")


@pytest.fixture
def kdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="dd-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _configmap(root: Path, key: str, text: str) -> Path:
    """Lay out a ConfigMap volume as the kubelet does: ``key -> ..data/key``, ``..data -> ..<timestamp>``."""
    stamp = root / "..2026_12_04_00_00_00.000000001"
    stamp.mkdir(parents=True)
    (stamp / key).write_text(text)
    os.symlink(stamp.name, root / "..data")
    os.symlink(f"..data/{key}", root / key)
    return root / key


async def test_an_operator_daemonsets_arguments_serve_the_same_resources(
    tmp_path: Path, kdir: Path, child_env: dict[str, str]
) -> None:
    """The sriov-network-operator's arguments, config from a per-node ConfigMap key: the kubelet
    emulator gets the pools under the operator's prefix, and an Allocate answers with CDI devices."""
    node = tmp_path / "node"
    simnode.simulate(node, pfs=2, vfs_per_pf=4)
    # The operator's per-node config names no prefix: --resource-prefix gives it.
    doc = json.loads((node / "config.json").read_text())
    for pool in doc["resourceList"]:
        pool.pop("resourcePrefix", None)
    config = _configmap(tmp_path / "pcidp", "node-1", json.dumps(doc))
    cdi = tmp_path / "cdi"
    cdi.mkdir()
    emulator = KubeletEmulator(kdir)
    await emulator.start()
    # What the operator passes, then only the paths a container would have at their real places.
    operator = ["--log-level=10", "--resource-prefix=openshift.io", f"--config-file={config}", "--use-cdi"]
    paths = ["--sysfs-root", str(node), "--kubelet-dir", str(kdir), "--cdi-dir", str(cdi), "--no-netlink"]
    child = Child(
        [*operator, *paths, "--devinfo-dir", "", "--pod-resources-socket", ""], child_env, entry_point=True
    )
    try:
        await child.line_with("daemon started")
        expected = {"openshift.io/sriov_ens1f0", "openshift.io/mellanox_vfs"}
        await emulator.wait_for(lambda: expected <= set(emulator.resources()), GUARD)
        assert sorted(emulator.resources()) == sorted(expected)
        resource = "openshift.io/sriov_ens1f0"
        await emulator.wait_for(lambda: len(emulator.devices(resource)) == 4, GUARD)
        first = sorted(emulator.devices(resource))[0]
        answer = await emulator.allocate(resource, [first])
        assert [d.name for d in answer.cdi_devices] and any(cdi.iterdir())
    finally:
        code = child.stop()
        await emulator.stop()
    assert code == 0
    assert not any("Traceback" in line for line in child.lines)
    assert any("level=debug" in line for line in child.lines)  # --log-level=10: glog's 4 and up
