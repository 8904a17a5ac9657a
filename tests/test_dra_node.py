"""DRA NodePrepareResources / NodeUnprepareResources: CDI per claim, every per-claim error, checkpoint."""

from __future__ import annotations

import json
import logging
import os
import signal
import stat
import subprocess
import sys
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
from helpers.cdi import validate_spec
from helpers.devices import DPDK, RDMA, pool_of
from helpers.dra import DRIVER, KIND, NET, NODE, OFF_POOL, RDMA_VF, VF, VF2, VFIO, Node
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from densedev.alloc import devinfo
from densedev.alloc.respond import AllocationSettings, PoolAllocator
from densedev.dra import names
from densedev.dra.claims import (
    CHECKPOINT_NAME,
    Checkpoint,
    CheckpointError,
    ClaimRef,
    InfoFile,
    PreparedClaim,
    PreparedDevice,
    decode_checkpoint,
    encode_checkpoint,
    encode_claim,
)
from densedev.dra.node import NodeService, PrepareResult
from densedev.testing.dra_kubelet import allocated_claim


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return Node(tmp_path)


async def prepare(service: NodeService, *refs: ClaimRef) -> dict[str, PrepareResult]:
    """Prepare these claims on the service."""
    return await service.prepare(list(refs))


def edits(spec: dict[str, Any], cdi_ids: Iterable[str]) -> tuple[list[tuple[str, str, str]], dict[str, str]]:
    """Return the device nodes and env a runtime applies for these CDI IDs of one spec, in order."""
    by_name = {d["name"]: d["containerEdits"] for d in spec["devices"]}
    nodes: list[tuple[str, str, str]] = []
    env: dict[str, str] = {}
    for cdi_id in cdi_ids:
        kind, name = cdi_id.split("=", 1)
        assert kind == spec["kind"]
        e = by_name[name]
        for n in e.get("deviceNodes", []):
            t = (n["path"], n["hostPath"], n["permissions"])
            if t not in nodes:
                nodes.append(t)
        env.update(v.split("=", 1) for v in e.get("env", []))
    return nodes, env


# -- what a claim gets ---------------------------------------------------------------------------------


async def test_one_device_claim_gets_a_cdi_spec_with_what_allocate_gives(node: Node) -> None:
    ref = node.claim(("vf", VF))
    result = (await prepare(node.service, ref))[ref.uid]
    assert result.error == ""
    (d,) = result.devices
    assert (d.requests, d.pool, d.name, d.device_id) == (("vf",), NODE, "pci-0000-3b-00-2", VF)
    assert d.cdi_ids == (f"{KIND}={ref.uid}-pci-0000-3b-00-2", f"{KIND}={ref.uid}_vf")
    spec = node.spec(ref.uid)
    validate_spec(spec)
    # The same env the device-plugin Allocate answer and CDI spec give for this device.
    allocator = PoolAllocator(
        pool_of(NET, [node.table[VF][0]]),
        AllocationSettings(cdi_dir=node.root / "dp-cdi", devinfo_dir=None, dev_root=node.dev_root),
        lambda _i: True,
    )
    allocated = allocator.allocate([VF])
    dp_spec = json.loads(next((node.root / "dp-cdi").iterdir()).read_text())
    _nodes, dp_env = edits(dp_spec, [c.name for c in allocated.cdi_devices])
    nodes, env = edits(spec, d.cdi_ids)
    assert env == {**dict(allocated.envs), **dp_env}
    assert nodes == []  # a kernel netdev VF has no node: the CNI moves the netdev
    info = devinfo.file_name("example.com", "vf_pool", VF)
    assert json.loads((node.settings.devinfo_dir / info).read_text()) == devinfo.info_document(  # type: ignore[operator]
        node.table[VF][0], False, ""
    )
    # Claim names in every CDI name; the spec 0644 for runtimes, the checkpoint 0600.
    assert all(e["name"].startswith(ref.uid) for e in spec["devices"])
    spec_path = node.settings.cdi_dir / f"densedev_dra_{DRIVER}_{ref.uid}.json"
    assert stat.S_IMODE(spec_path.stat().st_mode) == 0o644
    assert stat.S_IMODE((node.settings.plugin_dir / CHECKPOINT_NAME).stat().st_mode) == 0o600


async def test_vfio_and_rdma_devices_get_their_nodes_and_env_as_allocate(node: Node) -> None:
    ref = node.claim(("dpdk", VFIO), ("rdma", RDMA_VF))
    result = (await prepare(node.service, ref))[ref.uid]
    assert result.error == ""
    spec = node.spec(ref.uid)
    validate_spec(spec)
    for request, device_id, config in (("dpdk", VFIO, DPDK), ("rdma", RDMA_VF, RDMA)):
        (d,) = [d for d in result.devices if d.requests == (request,)]
        allocated = PoolAllocator(
            pool_of(config, [node.table[device_id][0]]),
            AllocationSettings(cdi_dir=None, devinfo_dir=None, dev_root=node.dev_root),
            lambda _i: True,
        ).allocate([device_id])
        nodes, env = edits(spec, d.cdi_ids)
        assert nodes == [(n.container_path, n.host_path, n.permissions) for n in allocated.devices]
        for key, value in allocated.envs.items():
            assert env[key] == value
    # vfio: container node and group; RDMA: its verbs nodes and rdma_cm (as docs/allocation.md says).
    all_nodes, _env = edits(spec, [i for d in result.devices for i in d.cdi_ids])
    assert {n[0] for n in all_nodes} == {
        "/dev/vfio/vfio",
        "/dev/vfio/83",
        "/dev/infiniband/uverbs3",
        "/dev/infiniband/umad3",
        "/dev/infiniband/rdma_cm",
    }


async def test_two_devices_of_one_request_share_one_request_entry(node: Node) -> None:
    ref = node.claim(("vfs", VF), ("vfs", VF2))
    result = (await prepare(node.service, ref))[ref.uid]
    first, second = result.devices
    assert first.cdi_ids[1:] == (f"{KIND}={ref.uid}_vfs",) and len(second.cdi_ids) == 1
    _nodes, env = edits(node.spec(ref.uid), [*first.cdi_ids, *second.cdi_ids])
    assert env["PCIDEVICE_EXAMPLE_COM_VF_POOL"] == f"{VF},{VF2}"
    assert set(json.loads(env["PCIDEVICE_EXAMPLE_COM_VF_POOL_INFO"])) == {VF, VF2}


async def test_two_requests_of_one_pool_get_one_warning_naming_the_remedy(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    # A container naming both requests sees one request's PCIDEVICE_* (CDI env of one name is set by
    # the last device applied): the operator is told, once per claim, and how to ask instead.
    ref = node.claim(("a", VF), ("b", VF2))
    with caplog.at_level(logging.WARNING, logger="densedev"):
        result = (await prepare(node.service, ref))[ref.uid]
        assert result.error == ""
        await prepare(node.service, ref)  # a repeat returns the recorded result: no second line
    lines = [r for r in caplog.records if "share one pool" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "count: N" in lines[0].getMessage()
    assert lines[0].fields == {"claim": ref.uid, "pool": "example.com/vf_pool", "requests": "a,b"}
    await node.service.unprepare([ref])
    caplog.clear()
    one = node.claim(("vfs", VF), ("vfs", VF2), name="one")
    with caplog.at_level(logging.WARNING, logger="densedev"):
        assert (await prepare(node.service, one))[one.uid].error == ""
    assert not [r for r in caplog.records if "share one pool" in r.getMessage()]


async def test_subrequest_names_are_reported_as_their_base_request(node: Node) -> None:
    ref = node.claim(("nic/fast", VF))
    (d,) = (await prepare(node.service, ref))[ref.uid].devices
    assert d.requests == ("nic",)


async def test_results_of_other_drivers_are_left_alone(node: Node) -> None:
    uid = str(uuid.uuid4())
    node.store.put(
        allocated_claim(
            "default",
            "mixed",
            uid,
            [
                {"request": "gpu", "driver": "gpu.example.com", "pool": NODE, "device": "gpu-0"},
                {"request": "nic", "driver": DRIVER, "pool": NODE, "device": names.device_name(VF)},
            ],
        )
    )
    result = (await prepare(node.service, ClaimRef("default", "mixed", uid)))[uid]
    assert result.error == "" and [d.name for d in result.devices] == [names.device_name(VF)]


# -- idempotency and serialisation --------------------------------------------------------------------


async def test_a_repeated_prepare_returns_the_same_without_reading_the_claim_again(node: Node) -> None:
    ref = node.claim(("vf", VF))
    first = await prepare(node.service, ref)
    assert node.store.reads == 1
    again = await prepare(node.service, ref, ref)
    assert again == first and node.store.reads == 1
    # Even with the spec deleted meanwhile: the repeat puts it back.
    spec_path = node.settings.cdi_dir / f"densedev_dra_{DRIVER}_{ref.uid}.json"
    content = spec_path.read_bytes()
    spec_path.unlink()
    assert await prepare(node.service, ref) == first
    assert spec_path.read_bytes() == content


async def test_concurrent_prepares_of_one_device_give_it_to_one_claim(node: Node) -> None:
    a, b = node.claim(("vf", VF)), node.claim(("vf", VF))

    async def both() -> list[dict[str, PrepareResult]]:
        import asyncio

        return list(await asyncio.gather(node.service.prepare([a]), node.service.prepare([b])))

    ra, rb = await both()
    errors = [ra[a.uid].error, rb[b.uid].error]
    assert sorted(bool(e) for e in errors) == [False, True]
    assert "held elsewhere (claim default/" in next(e for e in errors if e)


# -- per-claim errors -----------------------------------------------------------------------------------


async def test_every_per_claim_error_fails_only_its_claim(node: Node, tmp_path: Path) -> None:
    node.unhealthy.add(VF2)
    node.holders[VFIO] = "pod default/dpdk-app under intel.com/intel_sriov_dpdk"
    held_by_claim = node.claim(("vf", VF), name="first")
    assert (await prepare(node.service, held_by_claim))[held_by_claim.uid].error == ""
    good = node.claim(("rdma", RDMA_VF), name="good")
    missing = ClaimRef("default", "gone", str(uuid.uuid4()))
    replaced = node.claim(("vf", VF), name="replaced")
    replaced = replaced._replace(uid=str(uuid.uuid4()))
    unallocated_uid = str(uuid.uuid4())
    node.store.put({"metadata": {"namespace": "default", "name": "pending", "uid": unallocated_uid}})
    unallocated = ClaimRef("default", "pending", unallocated_uid)
    other_uid = str(uuid.uuid4())
    node.store.put(
        allocated_claim(
            "default", "other", other_uid, [{"request": "g", "driver": "x.io", "pool": NODE, "device": "g0"}]
        )
    )
    other_driver = ClaimRef("default", "other", other_uid)
    other_node = node.claim(("vf", VF2), name="elsewhere", pool="node-b")
    not_ours_uid = str(uuid.uuid4())
    node.store.put(
        allocated_claim(
            "default",
            "foreign",
            not_ours_uid,
            [{"request": "r", "driver": DRIVER, "pool": NODE, "device": "eth0"}],
        )
    )
    foreign_name = ClaimRef("default", "foreign", not_ours_uid)
    absent = node.claim(("vf", "0000:99:00.1"), name="absent")
    off_pool = node.claim(("vf", OFF_POOL), name="offpool")
    unhealthy = node.claim(("vf", VF2), name="sick")
    held_by_pod = node.claim(("dpdk", VFIO), name="podheld")
    taken = node.claim(("vf", VF), name="taken")
    bad_uid = ClaimRef("default", "evil", "../../etc/passwd")
    expected = {
        missing.uid: 'default/gone: resourceclaims.resource.k8s.io "gone" not found',
        replaced.uid: "it was replaced",
        unallocated.uid: "is not allocated",
        other_driver.uid: f"has no allocation result for driver {DRIVER}",
        other_node.uid: f"node-b/pci-0000-3b-00-3: not on this node (this node's pool is {NODE})",
        foreign_name.uid: f"{NODE}/eth0: not a device name of driver {DRIVER}",
        absent.uid: f"{NODE}/pci-0000-99-00-1 (0000:99:00.1): not on this node",
        off_pool.uid: f"({OFF_POOL}): not in a pool served through DRA",
        unhealthy.uid: f"({VF2}): unhealthy",
        held_by_pod.uid: f"({VFIO}): held elsewhere (pod default/dpdk-app under intel.com/intel_sriov_dpdk)",
        taken.uid: f"({VF}): held elsewhere (claim default/first ({held_by_claim.uid}))",
        bad_uid.uid: "is not a Kubernetes UID",
    }
    refs = [missing, replaced, unallocated, other_driver, other_node, foreign_name, absent, off_pool]
    refs += [unhealthy, held_by_pod, taken, bad_uid, good]
    cdi_before = sorted(p.name for p in node.settings.cdi_dir.iterdir())
    results = await prepare(node.service, *refs)
    assert list(results) == [r.uid for r in refs]
    for uid, text in expected.items():
        assert text in results[uid].error, (uid, results[uid].error)
        assert results[uid].devices == ()
        assert len(results[uid].error) <= 1000
    assert results[good.uid].error == "" and results[good.uid].devices[0].device_id == RDMA_VF
    # Nothing was written for the refused claims: one new spec (the good one), no file named by a bad UID.
    cdi_after = sorted(p.name for p in node.settings.cdi_dir.iterdir())
    assert set(cdi_after) - set(cdi_before) == {f"densedev_dra_{DRIVER}_{good.uid}.json"}
    assert set(node.service.prepared) == {held_by_claim.uid, good.uid}
    assert not (tmp_path.parent / "etc").exists()


async def test_a_request_name_cdi_refuses_fails_only_its_claim(node: Node) -> None:
    # Request names are DNS labels (the API server validates them); one that is not would also make a
    # CDI name the runtime refuses (space, leading '-', trailing '.'), and once failed the whole call.
    good = node.claim(("vf", VF), name="good")
    bad = [node.claim((request, VF2), name=f"bad{n}") for n, request in enumerate(["a b", "-x", "x.", "é"])]
    results = await prepare(node.service, *bad, good)
    assert results[good.uid].error == "" and [d.device_id for d in results[good.uid].devices] == [VF]
    for ref in bad:
        assert "is not a DNS label" in results[ref.uid].error, results[ref.uid]
        assert not (node.settings.cdi_dir / f"densedev_dra_{DRIVER}_{ref.uid}.json").exists()
    assert set(node.service.prepared) == {good.uid}


async def test_a_bug_met_by_one_claim_fails_only_that_claim(
    node: Node, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    good, broken = node.claim(("vf", VF), name="good"), node.claim(("vf", VF2), name="broken")
    gate = node.service.gate

    def failing(device_id: str) -> object:
        if device_id == VF2:
            raise RuntimeError("gate bug")
        return gate(device_id)

    monkeypatch.setattr(node.service, "gate", failing)
    with caplog.at_level(logging.ERROR):
        results = await prepare(node.service, broken, good)
    assert results[good.uid].error == ""
    assert "cannot prepare it: RuntimeError('gate bug')" in results[broken.uid].error
    assert set(node.service.prepared) == {good.uid}


async def test_a_device_listed_twice_is_answered_and_recorded_once(node: Node) -> None:
    twice = node.claim(("vf", VF), ("vf", VF), ("vf", VF2))
    result = (await prepare(node.service, twice))[twice.uid]
    assert [(d.requests, d.device_id) for d in result.devices] == [(("vf",), VF), (("vf",), VF2)]
    _nodes, env = edits(node.spec(twice.uid), [i for d in result.devices for i in d.cdi_ids])
    assert env["PCIDEVICE_EXAMPLE_COM_VF_POOL"] == f"{VF},{VF2}"
    # Named by two requests: one device to the kubelet, naming both.
    both = node.claim(("a", VFIO), ("b", VFIO))
    (d,) = (await prepare(node.service, both))[both.uid].devices
    assert d.requests == ("a", "b") and len(d.cdi_ids) == 3


async def test_ten_thousand_results_naming_two_devices_make_a_two_device_answer(
    node: Node, tmp_path: Path
) -> None:
    many = node.claim(*[("vf", VF if n % 2 else VF2) for n in range(10_000)])
    results = await prepare(node.service, many)
    assert [d.device_id for d in results[many.uid].devices] == [VF2, VF]
    # The checkpoint is the one a claim with the two results alone makes (same UID, another node).
    other = Node(tmp_path / "other")
    few = other.claim(("vf", VF2), ("vf", VF), uid=many.uid, name=many.name)
    assert (await prepare(other.service, few))[few.uid] == results[many.uid]
    checkpoint = (node.settings.plugin_dir / CHECKPOINT_NAME).read_bytes()
    assert checkpoint == (other.settings.plugin_dir / CHECKPOINT_NAME).read_bytes().replace(
        bytes(other.root), bytes(node.root)
    )


async def test_a_missing_device_node_fails_the_claim(node: Node) -> None:
    (node.dev_root / "vfio" / "83").unlink()
    ref = node.claim(("dpdk", VFIO))
    error = (await prepare(node.service, ref))[ref.uid].error
    assert "required device nodes are missing" in error and "/dev/vfio/83" in error


async def test_admin_access_shares_a_device_in_use(node: Node) -> None:
    user = node.claim(("vf", VF))
    assert (await prepare(node.service, user))[user.uid].error == ""
    uid = str(uuid.uuid4())
    result = {"request": "mon", "driver": DRIVER, "pool": NODE, "device": names.device_name(VF)}
    node.store.put(allocated_claim("default", "monitor", uid, [{**result, "adminAccess": True}]))
    monitor = ClaimRef("default", "monitor", uid)
    answer = (await prepare(node.service, monitor))[uid]
    assert answer.error == "" and answer.devices[0].admin
    # The monitor holds nothing: its Unprepare leaves the user's device-info file in place.
    assert node.service.held() == {VF: user}
    assert await node.service.unprepare([monitor]) == {uid: ""}
    assert (node.settings.devinfo_dir / devinfo.file_name("example.com", "vf_pool", VF)).exists()  # type: ignore[operator]


# -- unprepare ------------------------------------------------------------------------------------------


async def test_unprepare_removes_what_prepare_made_and_frees_the_devices(node: Node) -> None:
    ref = node.claim(("vf", VF), ("dpdk", VFIO))
    assert (await prepare(node.service, ref))[ref.uid].error == ""
    info = node.settings.devinfo_dir / devinfo.file_name("example.com", "vf_pool", VF)  # type: ignore[operator]
    spec = node.settings.cdi_dir / f"densedev_dra_{DRIVER}_{ref.uid}.json"
    assert info.exists() and spec.exists() and set(node.service.held()) == {VF, VFIO}
    node.store.delete("default", ref.name)  # the object may be gone by then: Unprepare needs none
    assert await node.service.unprepare([ref]) == {ref.uid: ""}
    assert not info.exists() and not spec.exists()
    assert node.service.held() == {} and node.service.prepared == {}
    checkpoint = json.loads((node.settings.plugin_dir / CHECKPOINT_NAME).read_text())
    assert checkpoint["claims"] == []
    # Again, and for a claim never seen: both succeed.
    unknown = ClaimRef("default", "never", str(uuid.uuid4()))
    assert await node.service.unprepare([ref, unknown]) == {ref.uid: "", unknown.uid: ""}
    # The device is free for the next claim.
    nxt = node.claim(("vf", VF))
    assert (await prepare(node.service, nxt))[nxt.uid].error == ""


# -- checkpoint and recovery ----------------------------------------------------------------------------


async def test_a_restarted_service_recovers_its_claims_before_serving(node: Node) -> None:
    a = node.claim(("vf", VF))
    b = node.claim(("dpdk", VFIO), ("rdma", RDMA_VF))
    answers = await prepare(node.service, a, b)
    # A stale spec of ours from a crash between writing it and recording its claim, and a file of
    # another program: the first goes at recovery, the second stays.
    stale = node.settings.cdi_dir / f"densedev_dra_{DRIVER}_{uuid.uuid4()}.json"
    stale.write_text("{}")
    foreign = node.settings.cdi_dir / "vendor-gpu.json"
    foreign.write_text("{}")
    again = node.fresh()
    assert again.recover() == {VF, VFIO, RDMA_VF}
    assert again.prepared == node.service.prepared
    assert not stale.exists() and foreign.exists()
    reads = node.store.reads
    assert await prepare(again, a, b) == answers and node.store.reads == reads
    # Recovered claims hold their devices: a new claim for one of them is refused.
    c = node.claim(("vf", VF))
    assert "held elsewhere (claim default/" in (await prepare(again, c))[c.uid].error
    assert await again.unprepare([a, b]) == {a.uid: "", b.uid: ""}
    assert again.held() == {} and list(node.settings.cdi_dir.iterdir()) == [foreign]
    assert list(node.settings.devinfo_dir.glob("*-device.json")) == []  # type: ignore[union-attr]


_CHILD = """
import asyncio, sys, time
sys.path[:0] = {paths!r}
import helpers.dra as t
from pathlib import Path
node = t.Node(Path({root!r}))
ref = node.claim(("vf", t.VF), uid={uid!r})
result = asyncio.run(node.service.prepare([ref]))[ref.uid]
assert result.error == "", result.error
print("prepared", flush=True)
time.sleep(600)
"""


async def test_claims_survive_a_killed_process(tmp_path: Path, child_env: dict[str, str]) -> None:
    uid = str(uuid.uuid4())
    here = str(Path(__file__).parent)
    script = _CHILD.format(paths=[here, *sys.path], root=str(tmp_path), uid=uid)
    child = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, env=child_env, cwd=here, text=True
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "prepared"
        child.send_signal(signal.SIGKILL)  # no cleanup of any kind runs
        child.wait(30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        if child.stdout is not None:
            child.stdout.close()
    node = Node(tmp_path)
    assert node.service.recover() == {VF}
    assert node.service.prepared[uid].devices[0].device_id == VF
    c = node.claim(("vf", VF))
    assert "held elsewhere" in (await prepare(node.service, c))[c.uid].error


async def test_an_untrustworthy_checkpoint_fails_closed_with_one_line(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    ref = node.claim(("vf", VF))
    await prepare(node.service, ref)
    info = node.settings.devinfo_dir / devinfo.file_name("example.com", "vf_pool", VF)  # type: ignore[operator]
    path = node.settings.plugin_dir / CHECKPOINT_NAME
    doc = json.loads(path.read_text())
    doc["claims"][0]["devices"][0]["id"] = VF2  # a hand edit: the checksum no longer matches
    path.write_text(json.dumps(doc))
    service = node.fresh()
    with caplog.at_level(logging.ERROR):
        # The claim the spec on disk names is held: its device, its spec and its device-info file.
        assert service.recover() == {VF}
    (line,) = [r for r in caplog.records if r.levelno >= logging.ERROR]
    fields = line.fields  # type: ignore[attr-defined]
    assert "checksum mismatch" in fields["problem"] and fields["kept_as"].startswith("checkpoint.json.bad-")
    assert ref.uid in fields["claims"] and fields["devices"] == 1
    kept = [p for p in node.settings.plugin_dir.iterdir() if p.name.startswith("checkpoint.json.bad-")]
    assert len(kept) == 1 and json.loads(kept[0].read_text()) == doc
    assert node.spec(ref.uid)["kind"] == KIND and info.exists()
    assert service.unsettled is not None and set(service.unsettled.claims) == {ref.uid}
    # Another claim naming the device is refused while the lost record is unsettled.
    other = node.claim(("vf", VF))
    assert "held elsewhere (maybe: the record of prepared claims was lost" in (
        (await prepare(service, other))[other.uid].error
    )
    # A restart before the kubelet settles it holds it still (recorded in a fresh checkpoint).
    service = node.fresh()
    assert service.recover() == {VF} and service.unsettled is not None
    # The kubelet unprepares the old claim: released, and the device may be given again.
    assert await service.unprepare([ref]) == {ref.uid: ""}
    assert service.unsettled is None and service.withheld() == frozenset()
    assert not (node.settings.cdi_dir / f"densedev_dra_{DRIVER}_{ref.uid}.json").exists()
    assert (await prepare(service, other))[other.uid].error == ""
    assert node.fresh().recover() == {VF}  # the new claim, on record


async def test_a_prepare_of_an_unsettled_claim_records_it_again(node: Node) -> None:
    first, second = node.claim(("vf", VF)), node.claim(("vf", VF2))
    await prepare(node.service, first, second)
    (node.settings.plugin_dir / CHECKPOINT_NAME).write_bytes(b"")  # empty: lost
    service = node.fresh()
    assert service.recover() == {VF, VF2}
    # The kubelet re-sends Prepare for the first: prepared again (same answer), on record again.
    answer = (await prepare(service, first))[first.uid]
    assert answer.error == "" and [d.device_id for d in answer.devices] == [VF]
    assert set(service.prepared) == {first.uid}
    assert service.unsettled is not None and set(service.unsettled.claims) == {second.uid}
    # The first claim may not take the second's device, nor may a new claim.
    third = node.claim(("vf", VF2))
    assert "record of prepared claims was lost" in (await prepare(service, third))[third.uid].error
    assert await service.unprepare([second]) == {second.uid: ""}
    assert service.unsettled is None and service.withheld() == {VF}
    assert (await prepare(service, third))[third.uid].error == ""


async def test_the_driver_pool_is_withheld_while_unsettled(node: Node) -> None:
    ref = node.claim(("vf", VF))
    await prepare(node.service, ref)
    (node.settings.plugin_dir / CHECKPOINT_NAME).write_bytes(b"{}")
    service = node.fresh()
    service.recover()
    # Every device the driver's pool could give counts as held (the daemon widens with its DRA pools).
    assert service.widen([VF, VF2, VFIO]) and not service.widen([VF2])
    assert service.withheld() == {VF, VF2, VFIO}
    fresh = node.claim(("dpdk", VFIO))
    assert "record of prepared claims was lost" in (await prepare(service, fresh))[fresh.uid].error
    assert await service.unprepare([ref]) == {ref.uid: ""}
    assert service.withheld() == frozenset()
    assert (await prepare(service, fresh))[fresh.uid].error == ""


async def test_an_unsettled_claim_whose_spec_was_removed_by_hand_is_released_at_restart(
    node: Node,
) -> None:
    first, second = node.claim(("vf", VF)), node.claim(("vf", VF2))
    await prepare(node.service, first, second)
    (node.settings.plugin_dir / CHECKPOINT_NAME).write_bytes(b"\x00" * 10)
    assert node.fresh().recover() == {VF, VF2}
    # The operator made sure no pod uses the first claim and removed its spec: settled by hand.
    (node.settings.cdi_dir / f"densedev_dra_{DRIVER}_{first.uid}.json").unlink()
    service = node.fresh()
    assert service.recover() == {VF2}
    (node.settings.cdi_dir / f"densedev_dra_{DRIVER}_{second.uid}.json").unlink()
    service = node.fresh()
    assert service.recover() == frozenset() and service.unsettled is None


async def test_a_lost_checkpoint_with_no_spec_of_ours_holds_nothing(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    node.settings.plugin_dir.mkdir(parents=True)
    (node.settings.plugin_dir / CHECKPOINT_NAME).write_bytes(b"garbage")
    service = node.fresh()
    with caplog.at_level(logging.ERROR):
        assert service.recover() == frozenset()
    assert service.unsettled is None
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == [
        "DRA checkpoint cannot be read; no CDI spec of ours names a claim, so none is held"
    ]


async def test_a_symlink_planted_at_the_checkpoint_is_never_read_or_written_through(
    node: Node, tmp_path: Path
) -> None:
    first = node.claim(("vf", VF))
    await prepare(node.service, first)
    victim = tmp_path / "victim.json"
    # The victim holds a valid checkpoint of other claims: reading through the link would adopt them.
    victim.write_bytes((node.settings.plugin_dir / CHECKPOINT_NAME).read_bytes())
    before = victim.read_bytes()
    path = node.settings.plugin_dir / CHECKPOINT_NAME
    path.unlink()
    path.symlink_to(victim)
    # Not read through: the claim is held only because its spec on disk names it (fail closed).
    service = node.fresh()
    assert service.recover() == {VF} and service.prepared == {}
    path.unlink(missing_ok=True)
    path.symlink_to(victim)
    second = node.claim(("vf", VF2))
    service = node.fresh()
    service.recover()
    assert (await prepare(service, second))[second.uid].error == ""
    assert victim.read_bytes() == before
    assert not path.is_symlink() and stat.S_ISREG(path.lstat().st_mode)


async def test_a_symlink_planted_at_the_cdi_spec_path_is_replaced_not_followed(
    node: Node, tmp_path: Path
) -> None:
    ref = node.claim(("vf", VF))
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    node.settings.cdi_dir.mkdir(parents=True)
    spec = node.settings.cdi_dir / f"densedev_dra_{DRIVER}_{ref.uid}.json"
    spec.symlink_to(victim)
    assert (await prepare(node.service, ref))[ref.uid].error == ""
    assert victim.read_text() == "precious\n"
    assert not spec.is_symlink() and json.loads(spec.read_text())["kind"] == KIND


async def test_a_symlinked_plugin_dir_fails_the_claim_with_a_clear_error(node: Node, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    node.settings.plugin_dir.parent.mkdir(parents=True)
    node.settings.plugin_dir.symlink_to(elsewhere)
    ref = node.claim(("vf", VF))
    error = (await prepare(node.service, ref))[ref.uid].error
    assert "cannot record it in" in error and "symlink" in error
    assert list(elsewhere.iterdir()) == []
    assert not (node.settings.cdi_dir / f"densedev_dra_{DRIVER}_{ref.uid}.json").exists()
    assert node.service.prepared == {}


async def test_files_have_exact_modes_under_umask_000(node: Node) -> None:
    old = os.umask(0)
    try:
        ref = node.claim(("vf", VF))
        assert (await prepare(node.service, ref))[ref.uid].error == ""
    finally:
        os.umask(old)
    assert stat.S_IMODE(node.settings.plugin_dir.stat().st_mode) == 0o755
    assert stat.S_IMODE(node.settings.cdi_dir.stat().st_mode) == 0o755
    assert stat.S_IMODE((node.settings.plugin_dir / CHECKPOINT_NAME).stat().st_mode) == 0o600
    for p in node.settings.cdi_dir.iterdir():
        assert stat.S_IMODE(p.stat().st_mode) == 0o644


async def test_checkpoint_round_trip(node: Node) -> None:
    ref = node.claim(("vf", VF), ("dpdk", VFIO))
    await prepare(node.service, ref)
    loaded = Checkpoint(node.settings.plugin_dir, DRIVER).load()
    assert loaded.claims == dict(node.service.prepared) and loaded.damage is None
    # Another driver's checkpoint is not ours to trust: it is lost to us, and said so.
    other = Checkpoint(node.settings.plugin_dir, "other.example.com").load()
    assert other.claims == {} and other.damage is not None and "written for driver" in other.damage.problem


async def test_a_cancelled_prepare_keeps_the_lock_until_its_writes_are_done(node: Node) -> None:
    # gRPC cancels a handler when the kubelet's deadline passes; the file writes run in a thread that
    # cancellation cannot stop, so the next call must not start its own writes (and state update)
    # before that thread has finished.
    import asyncio
    import threading

    release = threading.Event()
    inside = threading.Event()
    active: list[int] = []
    overlaps: list[int] = []
    store = node.service._store

    def slow_store(plans: Any) -> dict[str, str]:
        active.append(1)
        if len(active) > 1:
            overlaps.append(1)
        inside.set()
        release.wait(10)
        try:
            return store(plans)
        finally:
            active.pop()

    node.service._store = slow_store  # type: ignore[method-assign]
    a, b = node.claim(("vf", VF)), node.claim(("vf", VF2))

    first = asyncio.ensure_future(node.service.prepare([a]))
    while not inside.is_set():
        await asyncio.sleep(0.001)
    first.cancel()
    second = asyncio.ensure_future(node.service.prepare([b]))
    await asyncio.sleep(0.05)  # lets a second call reach its writes if the lock were free
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert (await second)[b.uid].error == ""
    assert overlaps == []
    assert set(node.service.prepared) == {a.uid, b.uid}  # the cancelled call's writes still counted


async def test_an_unprepare_that_cannot_remove_files_fails_and_a_retry_finishes(
    node: Node, tmp_path: Path
) -> None:
    ref = node.claim(("vf", VF))
    assert (await prepare(node.service, ref))[ref.uid].error == ""
    cdi_dir = node.settings.cdi_dir
    moved = tmp_path / "cdi-real"
    cdi_dir.rename(moved)
    cdi_dir.symlink_to(moved)  # a planted symlink: nothing is removed through it
    error = (await node.service.unprepare([ref]))[ref.uid]
    assert "cannot remove its files" in error and "symlink" in error
    assert set(node.service.prepared) == {ref.uid} and node.service.held() == {VF: ref}
    assert (moved / f"densedev_dra_{DRIVER}_{ref.uid}.json").exists()
    cdi_dir.unlink()
    moved.rename(cdi_dir)
    assert await node.service.unprepare([ref]) == {ref.uid: ""}
    assert node.service.prepared == {} and list(cdi_dir.iterdir()) == []


_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)


@st.composite
def prepared_claims(draw: st.DrawFn) -> dict[str, PreparedClaim]:
    """Random prepared claims: any text in names and documents, as a corrupt reader could hand us."""
    out: dict[str, PreparedClaim] = {}
    for n in range(draw(st.integers(0, 4))):
        uid = f"uid-{n}-{draw(st.integers(0, 99))}"
        devices = tuple(
            PreparedDevice(
                (draw(_text),), draw(_text), draw(_text), draw(_text), (draw(_text),), draw(st.booleans())
            )
            for _ in range(draw(st.integers(0, 3)))
        )
        spec = draw(
            st.dictionaries(_text, st.one_of(_text, st.integers(), st.lists(_text, max_size=3)), max_size=3)
        )
        info = tuple(
            InfoFile(draw(_text), draw(_text), draw(_text), {"k": draw(_text)})
            for _ in range(draw(st.integers(0, 2)))
        )
        out[uid] = PreparedClaim(ClaimRef(draw(_text), draw(_text), uid), devices, f"s-{n}.json", spec, info)
    return out


@hypothesis_settings(max_examples=200, deadline=None)
@given(prepared_claims(), prepared_claims())
def test_checkpoint_bytes_round_trip_with_and_without_cached_entries(
    first: dict[str, PreparedClaim], second: dict[str, PreparedClaim]
) -> None:
    merged = {**first, **second}
    plain = encode_checkpoint(DRIVER, merged)
    reused = {uid: encode_claim(c) for uid, c in first.items() if merged[uid] is c}
    cached = encode_checkpoint(DRIVER, merged, reused)
    assert cached == plain
    assert decode_checkpoint(DRIVER, plain) == merged
    # The checksum covers the entries: any change to one is refused.
    if merged:
        doc = json.loads(plain)
        doc["claims"][0]["name"] += "x"
        with pytest.raises(CheckpointError, match="checksum"):
            decode_checkpoint(DRIVER, json.dumps(doc).encode())


def test_the_unsettled_state_is_checksummed_with_the_claims() -> None:
    from densedev.dra.claims import Unsettled, decode_record

    unsettled = Unsettled({"uid-1": frozenset({VF}), "uid-2": frozenset()}, frozenset({VF2}), "lost")
    data = encode_checkpoint(DRIVER, {}, None, unsettled)
    assert decode_record(DRIVER, data).unsettled == unsettled
    assert decode_record(DRIVER, encode_checkpoint(DRIVER, {})).unsettled is None
    # A hand edit releasing a device (or a claim) is refused as any other: the file is then lost.
    doc = json.loads(data)
    doc["unsettled"]["devices"] = []
    with pytest.raises(CheckpointError, match="checksum"):
        decode_record(DRIVER, json.dumps(doc).encode())
    doc = json.loads(data)
    del doc["unsettled"]
    with pytest.raises(CheckpointError, match="checksum"):
        decode_record(DRIVER, json.dumps(doc).encode())


def test_a_damaged_checkpoint_of_another_name_is_found_by_its_specs(tmp_path: Path) -> None:
    from densedev.dra.checkpoints import find_checkpoints

    plugins, cdi_dir = tmp_path / "plugins", tmp_path / "cdi"
    cdi_dir.mkdir()
    for name in ("old.example.com", "gone.example.com", "gpu.example.com"):
        (plugins / name).mkdir(parents=True)
    (plugins / "old.example.com" / CHECKPOINT_NAME).write_bytes(b"\x00garbage")
    (plugins / "gone.example.com" / CHECKPOINT_NAME).symlink_to("nowhere")
    (plugins / "gpu.example.com" / CHECKPOINT_NAME).write_text('{"checksum": 1, "v1": {}}')
    (cdi_dir / "densedev_dra_old.example.com_uid-1.json").write_text("{}")
    (cdi_dir / "densedev_dra_gone.example.com_uid-2.json").write_text("{}")
    assert sorted(find_checkpoints(plugins, cdi_dir=cdi_dir)) == ["gone.example.com", "old.example.com"]
    assert find_checkpoints(plugins) == []  # without the CDI dir: only readable checkpoints count


def test_the_unsettled_state_records_claims_podresources_named_and_a_pending_read() -> None:
    from densedev.dra.claims import Unsettled, decode_record

    named = {("team", "nic"): frozenset({VF}), ("team", "gone"): frozenset()}
    unsettled = Unsettled({}, frozenset({VF2}), "lost", named, pending=False)
    assert decode_record(DRIVER, encode_checkpoint(DRIVER, {}, None, unsettled)).unsettled == unsettled
    waiting = Unsettled({}, frozenset(), "lost", pending=True)
    data = encode_checkpoint(DRIVER, {}, None, waiting)
    assert decode_record(DRIVER, data).unsettled == waiting
    # A state of spec-named claims alone is recorded byte for byte as before.
    plain = Unsettled({"uid-1": frozenset({VF})}, frozenset(), "lost")
    assert b"named" not in encode_checkpoint(DRIVER, {}, None, plain)
    doc = json.loads(data)
    del doc["unsettled"]["pending"]
    with pytest.raises(CheckpointError):
        decode_record(DRIVER, json.dumps(doc).encode())


def test_a_named_claim_is_settled_by_namespace_and_name_and_by_a_read_that_no_longer_shows_it() -> None:
    from densedev.dra.claims import Unsettled

    state = Unsettled({"uid-1": frozenset({VF})}, frozenset(), "lost", pending=True)
    read = state.observed({("team", "nic"): frozenset({VF2})})
    assert read is not None and not read.pending and read.held() == {VF, VF2}
    assert read.holds("any-uid", ("team", "nic")) and not read.holds("any-uid", ("team", "other"))
    assert read.others("uid-1", ("x", "y")) == {VF2}
    # Unprepare of that claim (by namespace and name) releases its devices; the spec's claim stays.
    after = read.without(["uid-x"], [("team", "nic")])
    assert after is not None and after.held() == {VF}
    # A read that no longer shows it releases it too; the state ends once nothing is left.
    assert read.observed({}) is not None and read.observed({}).held() == {VF}  # type: ignore[union-attr]
    only_named = Unsettled({}, frozenset({"0000:99:00.7"}), "lost", {("team", "nic"): frozenset({VF2})})
    assert only_named.observed({}) is None
    assert only_named.without([], [("team", "nic")]) is None
    # Pending until the first read: with nothing named, a successful read ends it.
    assert Unsettled({}, frozenset({"0000:99:00.7"}), "lost", pending=True).observed({}) is None
    assert Unsettled({}, frozenset(), "lost", pending=True).unawaited() is None


async def test_a_lost_checkpoint_awaits_podresources_and_holds_the_claims_they_name(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    from densedev.node.holdings import ClaimUse

    first, second = node.claim(("vf", VF)), node.claim(("vf", VF2))
    await prepare(node.service, first, second)
    (node.settings.plugin_dir / CHECKPOINT_NAME).write_bytes(b"garbage")
    for ref in (first, second):  # both specs lost too: no file of ours names either claim
        (node.settings.cdi_dir / f"densedev_dra_{DRIVER}_{ref.uid}.json").unlink()
    service = node.fresh()
    service.kubelet_view = True
    with caplog.at_level(logging.ERROR):
        assert service.recover() == frozenset()
    assert "until the kubelet's PodResources say" in caplog.records[-1].getMessage()
    # Until the first read, the driver's pool is withheld.
    assert service.widen([VF, VF2, VFIO]) and service.withheld() == {VF, VF2, VFIO}

    def use(ref: ClaimRef, device_id: str, *, driver: str = DRIVER, pool: str = NODE) -> ClaimUse:
        return ClaimUse(driver, ref.namespace, ref.name, pool, names.device_name(device_id))

    stray = node.claim(("vf", VFIO), name="stray")
    assert await service.observe(
        [
            use(first, VF),
            use(second, VF2),
            use(stray, VFIO, driver="other.example.com"),
            use(stray, VFIO, pool="x"),
        ]
    )
    unsettled = service.unsettled
    assert unsettled is not None and not unsettled.pending
    assert dict(unsettled.named) == {
        (first.namespace, first.name): frozenset({VF}),
        (second.namespace, second.name): frozenset({VF2}),
    }
    # Recorded: a restart holds them still (and reads PodResources again).
    again = node.fresh()
    again.kubelet_view = True
    assert again.recover() >= {VF, VF2}
    # A new claim is refused the pool; the first claim's own Prepare takes its device, not the second's.
    fresh = node.claim(("dpdk", VFIO))
    assert "record of prepared claims was lost" in (await prepare(service, fresh))[fresh.uid].error
    assert (await prepare(service, first))[first.uid].error == ""
    assert (service.unsettled is not None) and set(service.unsettled.named) == {
        (second.namespace, second.name)
    }
    # The first is on record now: a read still showing it does not make it unsettled again.
    assert not await service.observe([use(first, VF), use(second, VF2)])
    # The second's pod ends: a read no longer showing it releases it, and the state ends.
    assert await service.observe([use(first, VF)])
    assert service.unsettled is None and service.withheld() == {VF}
    assert not await service.observe([use(second, VF2)])  # settled: reads change nothing any more
    assert (await prepare(service, fresh))[fresh.uid].error == ""


async def test_an_unprepare_releases_a_claim_podresources_named(node: Node) -> None:
    from densedev.node.holdings import ClaimUse

    ref = node.claim(("vf", VF))
    await prepare(node.service, ref)
    (node.settings.plugin_dir / CHECKPOINT_NAME).write_bytes(b"")
    (node.settings.cdi_dir / f"densedev_dra_{DRIVER}_{ref.uid}.json").unlink()
    service = node.fresh()
    service.kubelet_view = True
    service.recover()
    assert await service.observe([ClaimUse(DRIVER, ref.namespace, ref.name, NODE, names.device_name(VF))])
    assert service.withheld() == {VF}
    assert await service.unprepare([ref]) == {ref.uid: ""}
    assert service.unsettled is None and service.withheld() == frozenset()
    assert node.fresh().recover() == frozenset()  # recorded released


async def test_without_podresources_a_recorded_wait_for_them_ends_at_restart(node: Node) -> None:
    node.settings.plugin_dir.mkdir(parents=True)
    (node.settings.plugin_dir / CHECKPOINT_NAME).write_bytes(b"garbage")
    service = node.fresh()
    service.kubelet_view = True
    service.recover()
    assert service.unsettled is not None and service.unsettled.pending
    # Started again without the PodResources socket: nothing would ever read them.
    service = node.fresh()
    assert service.recover() == frozenset() and service.unsettled is None
