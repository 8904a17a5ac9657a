"""The ``densedev`` command as a user runs it: simulate, scan, check-config, demo."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from densedev import cli


def test_simulate_then_scan_json_lists_every_vf(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "node"
    assert cli.main(["simulate", "--out", str(out), "--pfs", "3", "--vfs-per-pf", "5", "--rdma"]) == 0
    assert "3 PFs, 15 VFs" in capsys.readouterr().out
    assert cli.main(["scan", "--sysfs-root", str(out), "--json"]) == 0
    devices = json.loads(capsys.readouterr().out)["devices"]
    vfs = [d for d in devices if d["role"] == "vf"]
    assert len(vfs) == 15
    assert all(d["pf"] and d["vf_index"] >= 0 and d["rdma_device"] for d in vfs)


def test_scan_with_config_reports_pools(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "node"
    cli.main(["simulate", "--out", str(out), "--pfs", "2", "--vfs-per-pf", "4"])
    capsys.readouterr()
    assert cli.main(["scan", "--sysfs-root", str(out), "--config", str(out / "config.json"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    sizes = {p["resource"]: len(p["devices"]) for p in result["pools"]}
    assert sizes == {"intel.com/sriov_ens1f0": 4, "intel.com/mellanox_vfs": 4}


def test_check_config_names_every_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({"resourceList": [{"resourceName": "ok_one"}, {"resourceName": "bad name!"}]}))
    assert cli.main(["check-config", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "resourceList[1]" in out and "resourceName" in out
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"resourceList": [{"resourceName": "ok_one"}]}))
    assert cli.main(["check-config", str(good)]) == 0


def test_run_refuses_an_invalid_config(tmp_path: Path, child_env: dict[str, str]) -> None:
    bad = tmp_path / "config.json"
    bad.write_text('{"resourceList": [{"resourceName": "x", "selectors": {"vendors": "15b3"}}]}')
    proc = subprocess.run(
        [sys.executable, "-m", "densedev.cli", "run", "--config", str(bad), "--kubelet-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env,
    )
    assert proc.returncode == 2
    assert "vendors" in proc.stderr


def test_run_and_demo_shorten_the_switch_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    # Scans run in worker threads holding the GIL: the event loop must get it back within ~1 ms.
    seen: list[float] = []

    def fake_run(coro: Any) -> int:
        coro.close()
        seen.append(sys.getswitchinterval())
        return 0

    before = sys.getswitchinterval()
    monkeypatch.setattr("uvloop.run", fake_run)  # cli imports uvloop inside the commands that use it
    try:
        assert cli.main(["demo", "--seconds", "1"]) == 0
        assert cli.main(["run", "--config", "/nonexistent.json"]) == 0
    finally:
        sys.setswitchinterval(before)
    assert seen == [cli.SWITCH_INTERVAL_S, cli.SWITCH_INTERVAL_S] and before > cli.SWITCH_INTERVAL_S


def test_demo_ends_with_its_summary(tmp_path: Path, child_env: dict[str, str]) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "densedev.cli", "demo", "--seconds", "2", "--pfs", "4", "--vfs-per-pf", "16"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=child_env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = proc.stdout.strip().splitlines()[-1]
    assert summary.startswith("demo summary: 64 devices") or summary.startswith("demo summary: 128 devices")
    assert " 0 errors" in summary


def test_check_config_prints_warnings_for_accepted_but_unsupported_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"resourceList": [{"resourceName": "ib", "selectors": {"pKeys": ["0x1"]}}]}))
    assert cli.main(["check-config", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "warning:" in out and "pKeys" in out and out.rstrip().endswith("OK")


def test_scan_json_and_scan_config_json_share_field_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "node"
    cli.main(["simulate", "--out", str(out), "--pfs", "2", "--vfs-per-pf", "2"])
    capsys.readouterr()
    assert cli.main(["scan", "--sysfs-root", str(out), "--json"]) == 0
    plain = {d["id"]: d for d in json.loads(capsys.readouterr().out)["devices"]}
    assert cli.main(["scan", "--sysfs-root", str(out), "--config", str(out / "config.json"), "--json"]) == 0
    pooled = [d for p in json.loads(capsys.readouterr().out)["pools"] for d in p["devices"]]
    assert pooled
    for d in pooled:
        same = plain[d["device_id"]]
        # No name means two things: every field both outputs carry holds the same value.
        shared = (set(same) & set(d)) - {"rdma_device", "driver", "pf"}  # None vs "" for unset in scan
        assert shared >= {"id", "device_code", "numa", "vendor", "role", "vf_index", "link_type", "pcie_root"}
        assert {k: same[k] for k in shared} == {k: d[k] for k in shared}


def test_scan_escapes_control_characters_in_names_read_from_sysfs(
    tmp_path: Path, child_env: dict[str, str]
) -> None:
    # The kernel's dev_valid_name() refuses only '/', ':', whitespace and "."/".." in interface names, so
    # an ESC sequence can name a netdev; `scan` must not send it to the operator's terminal raw.
    import os

    from densedev.testing import simnode

    sysfs = tmp_path / "sys"
    layout = simnode.build_node(sysfs, pfs=1, vfs_per_pf=2)
    old = layout.pfs[0].netdev
    evil = old + "\x1b[2J"
    link = sysfs / "class" / "net" / old
    target = os.readlink(link)
    (link.parent / target).rename(link.parent / (target.rsplit("/", 1)[0] + "/" + evil))
    link.unlink()
    (link.parent / evil).symlink_to(target.rsplit("/", 1)[0] + "/" + evil)
    for extra in ([], ["--config", str(_write_one_pool(tmp_path))]):
        done = subprocess.run(
            [sys.executable, "-m", "densedev.cli", "scan", "--sysfs-root", str(sysfs), *extra],
            env=child_env,
            capture_output=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        assert b"\x1b" not in done.stdout and b"\x1b" not in done.stderr
        if not extra:  # the device table names every netdev: there it shows, escaped
            assert rb"\x1b[2J" in done.stdout


def _write_one_pool(tmp_path: Path) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"resourceList": [{"resourceName": "vf", "selectors": {"drivers": ["x"]}}]}))
    return path


def test_scan_config_groups_exclusions_and_lists_them_all_with_verbose(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Exclusions are grouped by reason with a count and three examples; --verbose names every device.
    from densedev.testing import simnode

    sysfs = tmp_path / "sys"
    layout = simnode.build_node(sysfs, pfs=2, vfs_per_pf=16)
    config = _write_one_pool(tmp_path)
    assert cli.main(["scan", "--sysfs-root", str(sysfs), "--config", str(config)]) == 0
    short = capsys.readouterr().out
    vfs = [a for pf in layout.pfs for a in pf.vf_addresses]
    group = next(
        line for line in short.splitlines() if line.lstrip().startswith(f"excluded {len(vfs)}: drivers")
    )
    assert group.endswith(", ...)") and sum(a in group for a in vfs) == 3
    assert cli.main(["scan", "--sysfs-root", str(sysfs), "--config", str(config), "--verbose"]) == 0
    full = capsys.readouterr().out
    group = next(
        line for line in full.splitlines() if line.lstrip().startswith(f"excluded {len(vfs)}: drivers")
    )
    assert all(a in group for a in vfs) and not group.endswith(", ...)")
