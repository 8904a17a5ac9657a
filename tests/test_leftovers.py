"""Crash leftovers are reconciled at start (issue 12, section 5): CDI specs and device-info files.

The end-to-end test SIGKILLs a real daemon process holding allocations, then starts it again with a
config lacking one pool; the unit tests pin each ownership rule on real files in temp directories.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import pytest
from helpers.devices import dev
from helpers.node import GUARD_S, PREFIX, Node, pools_config, res

from densedev.alloc import cdi, devinfo, leftovers
from densedev.model import Device
from densedev.testing.kubelet import KubeletEmulator

A0, A1, A2 = "0000:3b:02.0", "0000:3b:02.1", "0000:3b:02.2"


def info(directory: Path, stem: str, device: str, body: str = '{"type":"pci"}\n') -> Path:
    p = directory / f"{stem}-{device}-device.json"
    p.write_text(body)
    return p


def spec(directory: Path, kind: str, devices: list[str]) -> Path:
    p = directory / cdi.spec_file_name(kind)
    p.write_bytes(
        cdi.spec_bytes(cdi.spec_document(kind, [{"name": d, "containerEdits": {}} for d in devices]))
    )
    return p


def visible(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if not p.name.startswith("."))


@pytest.fixture
def dirs(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    c, d = tmp_path / "cdi", tmp_path / "devinfo"
    c.mkdir()
    d.mkdir()
    yield c, d


def test_device_info_files_of_gone_pools_and_devices_go_others_stay(dirs: tuple[Path, Path]) -> None:
    _, d = dirs
    devinfo.write_owners(d, ["example.com-gone", "example.com-kept"])
    gone = [info(d, "example.com-gone", a) for a in (A0, A1)]
    kept = info(d, "example.com-kept", A0)
    left = info(d, "example.com-kept", A2)  # the device left the pool since
    # Same shape, stem never recorded nor configured: another device plugin's (the SR-IOV one's).
    foreign = [info(d, "example.com-other", A0), info(d, "intel.com-sriov", A1)]
    (d / "README").write_text("not a device-info file")
    (d / f".example.com-gone-{A0}-device.json.0123abcd.tmp").write_text("{")  # crash before rename
    (d / ".someone-elses.tmp").write_text("x")
    claim = leftovers.PoolClaim("", "example.com-kept", frozenset({A0, A1}))
    result = leftovers.reconcile(None, d, [claim])
    assert sorted(p.name for p in result.removed) == sorted(
        [p.name for p in (*gone, left)] + [f".example.com-gone-{A0}-device.json.0123abcd.tmp"]
    )
    assert visible(d) == sorted(["README", kept.name, *(p.name for p in foreign)])
    assert (d / ".someone-elses.tmp").exists()
    assert result.kept_info == {"example.com-kept": frozenset({A0})}
    assert devinfo.read_owners(d) == {"example.com-kept"}
    assert not result.problems


def test_files_of_devices_a_pod_still_holds_stay_whatever_their_pool(dirs: tuple[Path, Path]) -> None:
    c, d = dirs
    devinfo.write_owners(d, ["example.com-gone"])
    held_file = info(d, "example.com-gone", A0)
    free_file = info(d, "example.com-gone", A1)
    held_spec = spec(c, "example.com/gone", [A0, A1])
    free_spec = spec(c, "example.com/old", [A2])
    current = spec(c, "example.com/now", [A2])
    (c / "othervendor.com-x.json").write_text("{}")  # not ours: no densedev- prefix
    (c / ".densedev-example.com-now.json.99.tmp").write_text("{")
    claim = leftovers.PoolClaim("example.com/now", None, frozenset({A2}))
    result = leftovers.reconcile(c, d, [claim], held={"example.com/gone": {A0}})
    assert held_file.exists() and not free_file.exists()
    assert held_spec.exists() and current.exists() and not free_spec.exists()
    assert visible(c) == sorted([held_spec.name, current.name, "othervendor.com-x.json"])
    assert not [p for p in c.iterdir() if p.name.endswith(".tmp")]
    assert devinfo.read_owners(d) == {"example.com-gone"}
    assert sorted(result.kept_specs) == sorted([held_spec, current])
    # Released: the next start removes them, and the record with them.
    leftovers.reconcile(c, d, [claim], held={})
    assert visible(d) == [] and not (d / devinfo.OWNED_RECORD).exists()
    assert visible(c) == sorted([current.name, "othervendor.com-x.json"])


def test_one_cdi_rule_keeps_the_specs_of_configured_pools_and_of_resources_held(
    dirs: tuple[Path, Path],
) -> None:
    c, _ = dirs
    kept = spec(c, "intel.com/kept", [A0])
    held = spec(c, "intel.com/held", [A1])
    # Lists a held device, but the pod holds it under another resource: the kubelet's checkpointed
    # response names it intel.com/kept=..., never intel.com/moved=..., so nothing needs this spec.
    moved = spec(c, "intel.com/moved", [A0, A2])
    gone = spec(c, "intel.com/old_pool", [A2])
    for name in ("nvidia.com-gpu.json", "densedev.yaml"):
        (c / name).write_text("{}")
    temp = c / ".densedev-intel.com-kept.json.4242.tmp"  # a crash between write and rename
    temp.write_text("{")
    claims = [
        leftovers.PoolClaim("intel.com/kept", None, frozenset({A0})),
        leftovers.PoolClaim("", None, frozenset()),
    ]
    result = leftovers.prune_cdi(
        c, claims, {"intel.com/held": {A1}, "intel.com/kept": {A0}, "intel.com/idle": set()}
    )
    assert sorted(result.removed) == sorted([temp, moved, gone])
    assert sorted(result.kept_specs) == sorted([kept, held]) and result.problems == ()
    assert visible(c) == sorted([kept.name, held.name, "densedev.yaml", "nvidia.com-gpu.json"])
    # Released: the next prune takes the held resource's spec too.
    assert leftovers.prune_cdi(c, claims, {}).removed == (held,)


class Owner:
    """A pool's file side as the daemon's allocators present it: records what it is asked to keep."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.retained: list[list[str]] = []

    def claim(self) -> leftovers.PoolClaim:
        return leftovers.PoolClaim(self.kind, None, frozenset())

    def adopt_info(self, device_ids: Iterable[str]) -> None:
        raise AssertionError("not at a prune")

    def retain(self, devices: Sequence[Device]) -> None:
        self.retained.append([d.id for d in devices])
        if self.kind == "intel.com/broken":
            raise OSError("read-only file system")


def test_leftovers_prune_after_release_and_retain_what_is_held(dirs: tuple[Path, Path]) -> None:
    c, d = dirs
    spec(c, "intel.com/a", [A0])
    gone = spec(c, "intel.com/gone", [A1])
    owners = {"intel.com/a": Owner("intel.com/a"), "intel.com/broken": Owner("intel.com/broken")}
    files_ = leftovers.Leftovers(c, d)
    files_.prune(list(owners.values()), {"intel.com/gone": {A1}})
    assert gone.exists()
    files_.prune(list(owners.values()), {})
    assert not gone.exists()
    table = {i: dev(i) for i in (A0, A1)}
    # A pool whose files cannot be kept is logged; the next pool still keeps its own.
    files_.retain(owners, {"intel.com/a": {A1, A2}, "intel.com/broken": {A0}}, lambda: table)
    assert owners["intel.com/a"].retained == [[A1]] and owners["intel.com/broken"].retained == [[A0]]
    # Without CDI and device-info directories there is nothing to keep: the table is not even read.
    leftovers.Leftovers(None, None).retain(owners, {"intel.com/a": {A0}}, lambda: {})
    assert owners["intel.com/a"].retained == [[A1]]


def test_unreadable_directories_are_reported_not_raised(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    result = leftovers.reconcile(tmp_path / "link", tmp_path / "link", [])
    assert result.removed == () and len(result.problems) == 2


async def test_a_sigkilled_daemon_leaves_nothing_behind_for_a_pool_removed_before_restart(
    node: Node, tmp_path: Path, child_env: dict[str, str]
) -> None:
    cdi_dir, info_dir = tmp_path / "cdi", tmp_path / "devinfo"
    pf0, pf1 = node.layout.pfs[0], node.layout.pfs[1]
    gone, stays = res(f"sriov_{pf0.netdev}"), res(f"sriov_{pf1.netdev}")
    argv = [
        sys.executable, "-m", "densedev.cli", "run", "--config", str(node.config_path),
        "--sysfs-root", str(node.sysfs), "--kubelet-dir", str(node.kubelet_dir),
        "--dev-root", str(tmp_path / "dev"), "--cdi-dir", str(cdi_dir), "--devinfo-dir", str(info_dir),
        "--resource-prefix", PREFIX, "--no-netlink", "--pod-resources-socket", str(tmp_path / "pr.sock"),
    ]  # fmt: skip

    def stem(resource: str) -> str:
        return devinfo.stem(*resource.split("/"))

    emu = KubeletEmulator(node.kubelet_dir, pod_resources_socket=tmp_path / "pr.sock")
    await emu.start()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        # subprocess (vfork), not the loop's spawner: see densedev.testing.netns on gRPC and fork.
        procs.append(subprocess.Popen(argv, env=child_env, stderr=subprocess.DEVNULL))
        await emu.wait_for(lambda: bool(emu.updates(gone)) and bool(emu.updates(stays)), GUARD_S)
        await emu.allocate(gone, list(pf0.vf_addresses[:4]))
        await emu.allocate(gone, list(pf0.vf_addresses[4:6]))
        await emu.allocate(stays, list(pf1.vf_addresses[:2]))
        ours = {p.name for p in info_dir.iterdir() if not p.name.startswith(".")}
        assert len(ours) == 8
        # Other programs' files, including one shaped exactly like ours for an unknown pool.
        foreign = [
            info(info_dir, f"{PREFIX}-not_densedev", pf0.vf_addresses[0]),
            info(info_dir, "intel.com-sriov_netdevice", pf0.vf_addresses[1]),
        ]
        (cdi_dir / "othervendor.com-gpu.json").write_text("{}")
        gone_spec = cdi_dir / cdi.spec_file_name(gone)
        assert gone_spec.exists()

        procs[0].kill()  # SIGKILL: no cleanup runs
        await asyncio.to_thread(procs[0].wait, GUARD_S)
        assert {p.name for p in info_dir.iterdir() if not p.name.startswith(".")} >= ours
        # The pods of the pool about to be removed end while densedev is down: their devices are
        # free (PodResources says so), so nothing of that pool may stay.  Files of devices pods
        # still hold stay: tests/test_ownership.py.
        for uid, held in emu.pods().items():
            if gone in held:
                emu.delete_pod(uid)

        doc = pools_config(node.layout)
        doc["resourceList"] = [r for r in doc["resourceList"] if r["resourceName"] != f"sriov_{pf0.netdev}"]  # type: ignore[attr-defined,index]
        node.write_config(doc)
        before = emu.registrations(stays)
        procs.append(subprocess.Popen(argv, env=child_env, stderr=subprocess.DEVNULL))
        await emu.wait_for(lambda: emu.registrations(stays) > before, GUARD_S)

        left = visible(info_dir)
        assert not [n for n in left if n.startswith(stem(gone) + "-")], left
        assert sorted(left) == sorted(
            [
                *(p.name for p in foreign),
                *(f"{stem(stays)}-{a}-device.json" for a in pf1.vf_addresses[:2]),
            ]
        )
        assert all(p.read_text() == '{"type":"pci"}\n' for p in foreign)
        assert not gone_spec.exists()
        assert (cdi_dir / "othervendor.com-gpu.json").exists()
        assert (cdi_dir / cdi.spec_file_name(stays)).exists()
        record = json.loads((info_dir / devinfo.OWNED_RECORD).read_text())
        assert record == {"stems": [stem(stays)]}

        # A clean stop now removes the files the restarted daemon adopted for its pool.
        procs[1].send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(procs[1].wait, GUARD_S) == 0
        assert visible(info_dir) == sorted(p.name for p in foreign)
        assert not (info_dir / devinfo.OWNED_RECORD).exists()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                await asyncio.to_thread(proc.wait)
        await emu.stop()
