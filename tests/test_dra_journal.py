"""Claim parameters' VF link settings: applied at Prepare after a durable journal, restored at Unprepare.

Against a simulated node (``densedev.testing.simnode``, scanned as the daemon scans it) whose VF links
live in ``.simnode/vflinks.json``: what a claim asks is set, what it had is put back, a refusal changes
nothing, a restart restores what no prepared claim asks, and a restore that fails keeps the device
withheld until a retry puts it back.
"""

from __future__ import annotations

import asyncio
import errno
import json
import uuid
from pathlib import Path
from typing import Any

import pytest
from helpers.devices import pool_of
from helpers.waiting import eventually

from densedev.dra import names
from densedev.dra.claims import (
    CHECKPOINT_NAME,
    Checkpoint,
    CheckpointError,
    ClaimRef,
    PoolGate,
    decode_record,
)
from densedev.dra.configure import JournalMetrics, JournalRecord, JournalState
from densedev.dra.node import NodeService, NodeSettings
from densedev.dra.params import API_VERSION, KIND
from densedev.model import Device, Pool, PoolApi, PoolConfig
from densedev.node import rebind
from densedev.node.scanner import scan
from densedev.node.vflinks import SIM_DEFAULTS, SimVfLinks, VfTarget, clear_faults, inject_fault
from densedev.ops.metrics import Registry
from densedev.pools.ownership import Ownership
from densedev.testing import simnode
from densedev.testing.dra_kubelet import ClaimStore, allocated_claim
from densedev.testing.simkernel import FaultRule, SimKernel, write_faults

DRIVER = "net.densedev.io"
NODE = "node-a"
NET = PoolConfig("vf_pool", "example.com", api=PoolApi.DRA)
ASK = {"mtu": 9000, "vlan": 100, "qos": 3, "trust": True, "maxTxRateMbps": 1000, "linkState": "enable"}


class JournalNode:
    """A scanned simulated node, its DRA NodeService with simulated VF links, and a claim store."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.sysfs = root / "sys"
        simnode.build_node(self.sysfs, pfs=2, vfs_per_pf=4)
        table = scan(self.sysfs)
        self.vfs: list[Device] = [d for d in table.by_id().values() if d.role == "vf" and d.netdevs]
        self.vfs.sort(key=lambda d: d.id)
        self.pool: Pool = pool_of(NET, self.vfs)
        self.links = SimVfLinks(self.sysfs)
        self.store = ClaimStore()
        self.registry = Registry()
        self.metrics = JournalMetrics(self.registry)
        self.settings = NodeSettings(
            DRIVER,
            NODE,
            plugin_dir=root / "plugins" / DRIVER,
            cdi_dir=root / "cdi",
            devinfo_dir=root / "devinfo",
            dev_root=root / "dev",
        )
        self.dev_root = root / "dev"
        self.dev_root = root / "dev"
        self.service = self.fresh()

    def fresh(self) -> NodeService:
        """A new service over the same files and links (a restarted daemon), not yet recovered."""
        gate = PoolGate(lambda i: True, [self.pool], lambda i: True)
        return NodeService(
            self.settings,
            self.store,
            gate,
            links=self.links,
            journal_metrics=self.metrics,
            restore_retry_s=(0.02, 0.1),
            sysfs_root=self.sysfs,
            rebind_timeout=5.0,
        )

    def target(self, vf: Device) -> VfTarget:
        return VfTarget(vf.pf_netdev, vf.vf_index, vf.netdevs[0])

    def values(self, vf: Device) -> dict[str, Any]:
        return self.links.values(self.target(vf))

    def claim(self, vf: Device, parameters: dict[str, Any], request: str = "vf") -> ClaimRef:
        uid = str(uuid.uuid4())
        config = [
            {
                "source": "FromClaim",
                "requests": [request],
                "opaque": {
                    "driver": DRIVER,
                    "parameters": {"apiVersion": API_VERSION, "kind": KIND, **parameters},
                },
            }
        ]
        results = [{"request": request, "driver": DRIVER, "pool": NODE, "device": names.device_name(vf.id)}]
        self.store.put(allocated_claim("default", f"c-{uid[:8]}", uid, results, config))
        return ClaimRef("default", f"c-{uid[:8]}", uid)

    def recorded(self) -> Any:
        return decode_record(DRIVER, (self.settings.plugin_dir / CHECKPOINT_NAME).read_bytes())

    def sample(self, name: str, **labels: str) -> float:
        for family in self.registry.collect():
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    return float(s.value)
        return 0.0


@pytest.fixture
def node(tmp_path: Path) -> JournalNode:
    return JournalNode(tmp_path)


async def test_prepare_applies_what_is_asked_and_unprepare_puts_back_what_was(node: JournalNode) -> None:
    vf = node.vfs[0]
    before = node.values(vf)
    assert before == dict(SIM_DEFAULTS)
    ref = node.claim(vf, {**ASK, "mac": "02:AA:bb:cc:dd:01"})
    result = (await node.service.prepare([ref]))[ref.uid]
    assert result.error == ""
    now = node.values(vf)
    asked = {**ASK, "mac": "02:aa:bb:cc:dd:01", "minTxRateMbps": 0}
    assert {k: now[k] for k in asked} == asked
    # What was applied, for the claim's status; the journal holds the old values, marked applied.
    assert node.service.prepared[ref.uid].applied == {vf.id: asked}
    (record,) = node.recorded().journal
    assert (record.claim, record.device_id, record.state) == (ref.uid, vf.id, JournalState.APPLIED)
    assert record.old == {k: before[k] for k in asked}
    assert node.sample("densedev_dra_configured_devices", setting="vlan") == 1
    assert node.sample("densedev_dra_configured_devices", setting="minTxRateMbps") == 0  # unchanged
    # A restart keeps a prepared claim's change as it is: nothing to restore.
    again = node.fresh()
    again.recover()
    assert again.unrestored() == frozenset()
    assert again.prepared[ref.uid].applied == {vf.id: asked}
    assert (await again.unprepare([ref]))[ref.uid] == ""
    assert node.values(vf) == before
    assert node.recorded().journal == ()
    assert node.sample("densedev_dra_restores_total", result="ok") == 1
    assert node.sample("densedev_dra_configured_devices", setting="vlan") == 0


@pytest.mark.parametrize(
    ("parameters", "field"),
    [
        ({"qos": 3}, "qos"),  # qos without vlan
        ({"vlan": 5000}, "vlan"),
        ({"mtu": 9000, "speed": 10}, "speed"),
        ({"driver": "vfio-pci", "mtu": 9000}, "mtu"),  # no netdev once bound to vfio-pci
    ],
)
async def test_refused_parameters_change_nothing(
    node: JournalNode, parameters: dict[str, Any], field: str
) -> None:
    vf = node.vfs[0]
    ref = node.claim(vf, parameters, request="kernel")
    error = (await node.service.prepare([ref]))[ref.uid].error
    assert "request kernel" in error and field in error, error
    assert "\n" not in error
    assert node.values(vf) == dict(SIM_DEFAULTS)
    assert not (node.settings.plugin_dir / CHECKPOINT_NAME).exists() or node.recorded().journal == ()
    assert ref.uid not in node.service.prepared


async def test_a_change_the_kernel_refuses_part_way_is_put_back(node: JournalNode) -> None:
    vf = node.vfs[1]
    # The kernel applies a message's IFLA_VF_* one after the other and stops at a refusal: the VLAN and
    # the rate are set when trust is refused.
    inject_fault(node.sysfs, op="apply", setting="trust", errno=errno.EPERM, times=1)
    ref = node.claim(vf, ASK)
    error = (await node.service.prepare([ref]))[ref.uid].error
    assert "Operation not permitted" in error and "nothing was changed" in error, error
    assert node.values(vf) == dict(SIM_DEFAULTS)
    assert node.recorded().journal == ()
    assert node.service.unrestored() == frozenset()
    # Nothing is left behind: the kubelet's retry prepares it.
    assert (await node.service.prepare([ref]))[ref.uid].error == ""


async def test_an_unreadable_device_is_refused_before_anything_is_recorded(node: JournalNode) -> None:
    vf = node.vfs[0]
    inject_fault(node.sysfs, op="read", errno=errno.ENODEV, times=1)
    ref = node.claim(vf, {"mtu": 9000})
    error = (await node.service.prepare([ref]))[ref.uid].error
    assert "cannot read the settings" in error and "nothing was changed" in error, error
    assert node.values(vf) == dict(SIM_DEFAULTS)
    assert not (node.settings.plugin_dir / CHECKPOINT_NAME).exists()


@pytest.mark.parametrize("state", [JournalState.APPLYING, JournalState.APPLIED, JournalState.RESTORING])
async def test_a_restart_restores_what_no_prepared_claim_asks_before_listing_it(
    node: JournalNode, state: JournalState
) -> None:
    """A crash mid-Prepare (applying), after the claim was dropped (applied, no claim) or mid-Unprepare."""
    vf = node.vfs[2]
    target = node.target(vf)
    old = {k: SIM_DEFAULTS[k] for k in ("mtu", "vlan", "qos")}
    new = {"mtu": 9000, "vlan": 7, "qos": 0}
    node.links.apply(target, {"vlan": 7})  # cut off after the PF's part: the MTU not set yet
    Checkpoint(node.settings.plugin_dir, DRIVER).save(
        {}, None, [JournalRecord("5b0c2f9e-0000-4000-8000-000000000001", vf.id, target, old, new, state)]
    )
    service = node.fresh()
    service.recover()
    # Withheld at once, before anything is served: not offered while changed.
    assert service.unrestored() == {vf.id}
    assert node.sample("densedev_dra_unrestored_devices") == 1
    await eventually(
        lambda: node.sample("densedev_dra_unrestored_devices") == 0, "the orphaned change restored", 10
    )
    assert not service.unrestored()
    assert node.values(vf) == dict(SIM_DEFAULTS)
    assert node.recorded().journal == ()
    await service.stop_restores()


async def test_a_failed_restore_withholds_the_device_until_a_retry_puts_it_back(node: JournalNode) -> None:
    vf = node.vfs[0]
    ref = node.claim(vf, {"mtu": 9000, "vlan": 100})
    assert (await node.service.prepare([ref]))[ref.uid].error == ""
    inject_fault(node.sysfs, op="apply", errno=errno.EBUSY)  # until cleared
    # The pod is gone either way: Unprepare succeeds, the device is withheld from every pool.
    assert (await node.service.unprepare([ref]))[ref.uid] == ""
    assert ref.uid not in node.service.prepared
    assert node.service.unrestored() == {vf.id}
    assert node.values(vf)["vlan"] == 100
    await eventually(
        lambda: node.sample("densedev_dra_restores_total", result="failed") >= 3, "restores retried", 10
    )
    assert node.sample("densedev_dra_unrestored_devices") == 1
    # Another claim cannot take it meanwhile.
    other = node.claim(vf, {})
    error = (await node.service.prepare([other]))[other.uid].error
    assert "not restored yet" in error, error
    # Withheld from every pool, DRA ones too.
    ownership = Ownership(None)
    ownership.set_claimed((), None, node.service.unrestored())
    kept, withheld = ownership.split([node.pool])
    assert withheld == {NET.full_name: (vf.id,)} and vf.id not in {m.id for m in kept[0].members}
    clear_faults(node.sysfs)
    await eventually(lambda: not node.service.unrestored(), "the retry restored it", 10)
    assert node.values(vf) == dict(SIM_DEFAULTS)
    assert (await node.service.prepare([other]))[other.uid].error == ""
    await node.service.stop_restores()


async def test_the_journal_is_under_the_checksum_and_old_checkpoints_load(node: JournalNode) -> None:
    vf = node.vfs[0]
    ref = node.claim(vf, {"mtu": 9000})
    assert (await node.service.prepare([ref]))[ref.uid].error == ""
    path = node.settings.plugin_dir / CHECKPOINT_NAME
    data = path.read_bytes()
    assert b'"journal"' in data
    with pytest.raises(CheckpointError, match="checksum"):
        decode_record(DRIVER, data.replace(b'"mtu":1500', b'"mtu":1400'))
    # A checkpoint without parameters has no journal key at all: the format it always had.
    assert (await node.service.unprepare([ref]))[ref.uid] == ""
    doc = json.loads(path.read_bytes())
    assert "journal" not in doc and doc["version"] == 1


@pytest.fixture
def kernel(node: JournalNode) -> Any:
    """The simulated node's kernel, answering driver rebinds (in a thread)."""
    k = SimKernel(node.sysfs, node.dev_root)
    k.start()
    try:
        yield k
    finally:
        k.stop()


async def test_a_rebind_to_vfio_is_journaled_handed_through_cdi_and_put_back(
    node: JournalNode, kernel: Any
) -> None:
    (node.dev_root / "vfio").mkdir(parents=True, exist_ok=True)
    (node.dev_root / "vfio" / "vfio").touch()  # the container node, there once vfio is loaded
    vf = node.vfs[0]
    before = rebind.binding_of(node.sysfs, vf.id)
    assert before.driver == "mlx5_core" and before.iommu_group
    ref = node.claim(vf, {"driver": "vfio-pci", "vlan": 100, "trust": True})
    result = (await node.service.prepare([ref]))[ref.uid]
    assert result.error == ""
    assert rebind.binding_of(node.sysfs, vf.id).driver == "vfio-pci"
    assert node.values(vf)["vlan"] == 100  # the PF's settings reach a vfio-bound VF all the same
    (record,) = node.recorded().journal
    assert record.old["driver"] == "mlx5_core" and record.old["driverOverride"] is None
    assert node.service.prepared[ref.uid].applied[vf.id]["driver"] == "vfio-pci"
    # The container gets the group's node and the container node, through CDI.
    spec = json.loads((node.settings.cdi_dir / node.service.prepared[ref.uid].spec_file).read_text())
    paths = {n["path"] for d in spec["devices"] for n in d.get("containerEdits", {}).get("deviceNodes", [])}
    assert {"/dev/vfio/vfio", f"/dev/vfio/{before.iommu_group}"} <= paths
    assert node.sample("densedev_dra_configured_devices", setting="driver") == 1
    assert (await node.service.unprepare([ref]))[ref.uid] == ""
    assert rebind.binding_of(node.sysfs, vf.id) == before
    assert rebind.override_of(node.sysfs, vf.id) is None
    assert node.values(vf) == dict(SIM_DEFAULTS)
    assert node.recorded().journal == ()


async def test_a_failed_probe_refuses_the_claim_with_the_vf_as_it_was(node: JournalNode, kernel: Any) -> None:
    vf = node.vfs[1]
    before = rebind.binding_of(node.sysfs, vf.id)
    write_faults(node.sysfs, [FaultRule(op="drivers_probe", pci=vf.id, probe_fails=True, times=1)])
    ref = node.claim(vf, {"driver": "vfio-pci", "vlan": 7})
    error = (await node.service.prepare([ref]))[ref.uid].error
    assert "nothing was changed" in error, error
    assert rebind.binding_of(node.sysfs, vf.id) == before
    assert node.values(vf) == dict(SIM_DEFAULTS)
    assert node.recorded().journal == ()
    assert node.service.unrestored() == frozenset()


async def test_a_rebound_vf_whose_nodes_are_missing_is_refused_and_put_back(
    node: JournalNode, kernel: Any
) -> None:
    """No /dev/vfio/vfio (vfio not loaded on the host): the claim cannot be handed out; nothing stays."""
    vf = node.vfs[2]
    before = rebind.binding_of(node.sysfs, vf.id)
    ref = node.claim(vf, {"driver": "vfio-pci", "trust": True})
    error = (await node.service.prepare([ref]))[ref.uid].error
    assert "/dev/vfio/vfio" in error, error
    assert rebind.binding_of(node.sysfs, vf.id) == before
    assert node.values(vf) == dict(SIM_DEFAULTS)
    assert node.recorded().journal == ()


async def test_a_vf_scanned_while_rebound_is_configured_as_it_is_now(node: JournalNode, kernel: Any) -> None:
    """The device table saw the VF on vfio-pci (a restore at start put it back before a rescan)."""
    (node.dev_root / "vfio").mkdir(parents=True, exist_ok=True)
    (node.dev_root / "vfio" / "vfio").touch()
    vf = node.vfs[3]
    before = rebind.binding_of(node.sysfs, vf.id)
    rebind.rebind(node.sysfs, vf.id, "vfio-pci", timeout=5.0, dev_root=node.dev_root)
    stale = {d.id: d for d in scan(node.sysfs).by_id().values()}[vf.id]
    assert stale.driver == "vfio-pci" and stale.netdevs == () and stale.link_type == ""
    rebind.restore(node.sysfs, vf.id, before, None, timeout=5.0)
    node.pool = pool_of(NET, [stale if d.id == vf.id else d for d in node.vfs])
    service = node.fresh()
    service.recover()
    ref = node.claim(vf, {"driver": "vfio-pci", "vlan": 100})
    assert (await service.prepare([ref]))[ref.uid].error == ""
    assert rebind.binding_of(node.sysfs, vf.id).driver == "vfio-pci"
    (record,) = node.recorded().journal
    assert record.old["driver"] == "mlx5_core"  # what it is, not what the table said
    assert (await service.unprepare([ref]))[ref.uid] == ""
    assert rebind.binding_of(node.sysfs, vf.id) == before
    assert node.values(vf) == dict(SIM_DEFAULTS)


@pytest.mark.netns
def test_the_kernel_refuses_vf_settings_on_a_veth_and_changes_nothing(netns: str) -> None:
    """The rtnetlink backend against the real kernel: a veth has no VFs; its own MTU is set and put back."""
    from densedev.node.vflinks import NetlinkVfLinks, VfLinkError
    from densedev.testing.netns import ifindexes, ip

    ip(netns, "link", "add", "pf0", "type", "veth", "peer", "name", "pf0p")
    index = ifindexes(netns)
    links = NetlinkVfLinks(netns=netns, ifindex=lambda name: index[name])
    target = VfTarget("pf0", 0, "pf0p")
    try:
        with pytest.raises(VfLinkError, match="no such VF"):
            links.read(target, ("vlan", "qos"))
        with pytest.raises(VfLinkError, match="VF 0 of pf0"):
            links.apply(target, {"vlan": 5, "qos": 0, "trust": True})
        assert links.read(target, ("mtu",)) == {"mtu": 1500}
        links.apply(target, {"mtu": 1400})
        assert links.read(target, ("mtu",)) == {"mtu": 1400}
        links.apply(target, {"mtu": 1500})
        assert links.read(target, ("mtu",)) == {"mtu": 1500}
    finally:
        links.close()


async def test_concurrent_calls_share_their_checkpoint_writes_and_keep_their_own_outcomes(
    node: JournalNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A node's pods start together: the kubelet sends one NodePrepareResources per pod, and every claim
    # with parameters costs a journal write and a record write, each fsynced.  Calls that arrive while
    # one is under way are done together: one journal write and one record write for all of them.
    saves: list[int] = []
    save = Checkpoint.save

    def counted(self: Checkpoint, *args: Any, **kwargs: Any) -> None:
        saves.append(len(args[0]))
        save(self, *args, **kwargs)

    monkeypatch.setattr(Checkpoint, "save", counted)
    refused = node.vfs[5]
    # The kernel refuses trust on one VF only: its claim is refused with its VF put back, the others of
    # the same pass are prepared as asked.
    inject_fault(node.sysfs, op="apply", pf=refused.pf_netdev, vf=refused.vf_index, setting="trust",
                 errno=errno.EPERM, times=1)  # fmt: skip
    refs = [node.claim(vf, ASK) for vf in node.vfs]
    answers = await asyncio.gather(*(node.service.prepare([ref]) for ref in refs))
    for vf, ref, answer in zip(node.vfs, refs, answers, strict=True):
        if vf is refused:
            assert "Operation not permitted" in answer[ref.uid].error, answer
            assert node.values(vf) == dict(SIM_DEFAULTS)
        else:
            assert answer == {ref.uid: answer[ref.uid]} and answer[ref.uid].error == "", answer
            assert {k: node.values(vf)[k] for k in ASK} == ASK
    # The first call finds the lock free and runs alone (journal, record); the seven waiting for it run
    # as one: their journal, the refused claim's records dropped once it is put back, their record.
    assert len(saves) <= 5, saves
    assert set(node.recorded().claims) == {r.uid for r in refs if r is not refs[5]}
    assert all(r.state is JournalState.APPLIED for r in node.recorded().journal)
    saves.clear()
    undone = await asyncio.gather(*(node.service.unprepare([ref]) for ref in refs))
    assert undone == [{ref.uid: ""} for ref in refs]
    assert len(saves) <= 4, saves  # the first alone (drop, restored), then the rest together
    assert all(node.values(vf) == dict(SIM_DEFAULTS) for vf in node.vfs)
    assert node.recorded().claims == {} and node.recorded().journal == ()


async def test_joined_calls_keep_their_order_and_a_call_cancelled_while_waiting_does_nothing(
    node: JournalNode,
) -> None:
    a, b = node.claim(node.vfs[0], ASK), node.claim(node.vfs[1], ASK)
    # Prepare a (runs at once), then while it runs: Unprepare a, Prepare a again, Prepare b.  Only runs of
    # one kind are joined, so a ends prepared (the last call) and is configured as asked.
    first = asyncio.ensure_future(node.service.prepare([a]))
    await asyncio.sleep(0)
    calls = [node.service.unprepare([a]), node.service.prepare([a]), node.service.prepare([b])]
    answers = await asyncio.gather(first, *calls)
    assert answers[1] == {a.uid: ""}
    assert answers[2][a.uid].error == "" and answers[3][b.uid].error == ""
    assert set(node.service.prepared) == {a.uid, b.uid}
    assert {k: node.values(node.vfs[0])[k] for k in ASK} == ASK
    # A call cancelled while it waits for the lock is dropped: its claim is not prepared.
    c = node.claim(node.vfs[2], ASK)
    holder = asyncio.ensure_future(node.service.unprepare([a, b]))
    await asyncio.sleep(0)
    waiting = asyncio.ensure_future(node.service.prepare([c]))
    await asyncio.sleep(0.001)
    waiting.cancel()
    assert await holder == {a.uid: "", b.uid: ""}
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert node.service.prepared == {}
    assert node.values(node.vfs[2]) == dict(SIM_DEFAULTS)
    assert (await node.service.prepare([c]))[c.uid].error == ""  # nothing left half done: it prepares
