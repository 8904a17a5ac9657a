"""SIGKILL a real daemon at every step of a Prepare and an Unprepare that change a VF, then restart it.

The daemon runs as its own process (``python -m densedev.cli run`` on a simulated node whose VF links
live in ``.simnode/vflinks.json``, its kernel answering driver rebinds: ``testing.simkernel`` in a
thread here) against the DRA kubelet emulator and the API-server stand-in; the
fault hook ``DENSEDEV_STOP_AT=<step>`` makes it SIGKILL itself at the named step.  After the restart the
VF is either prepared for its claim exactly as asked, or back as it was and listed again — and while it
is listed without a claim prepared on it, it is never in between.  The kubelet's retry (it retries a
failed call) then ends in the state the call asked for.

Every wait is bounded (``GUARD``); the kubelet's calls carry a deadline.
"""

from __future__ import annotations

import asyncio
import json
import signal
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from helpers.child import Child
from helpers.dra_daemon import NODE, Node, pool

from densedev.dra import CHECKPOINT_NAME, names
from densedev.dra.claims import decode_record
from densedev.dra.configure import STEPS, STOP_ENV
from densedev.dra.names import DEFAULT_DRIVER_NAME as DRIVER
from densedev.dra.params import API_VERSION, KIND
from densedev.node import rebind
from densedev.node.vflinks import SIM_DEFAULTS, SimVfLinks, VfTarget
from densedev.testing.apiserver import ApiServerStandIn
from densedev.testing.dra_kubelet import DraKubelet, allocated_claim
from densedev.testing.simkernel import SimKernel

pytestmark = pytest.mark.faults

GUARD = 45.0  # hang guard for one wait (a loaded CI machine starts a daemon in seconds)
CALL_S = 20.0  # the kubelet's deadline for one call
LINKS = {"vlan": 100, "qos": 2, "trust": True, "maxTxRateMbps": 500, "linkState": "enable"}
# Netlink settings alone (with the VF netdev's MTU), or a rebind to vfio-pci with the PF's settings.
ASKS = {"netlink": {**LINKS, "mtu": 9000}, "rebind": {"driver": "vfio-pci", **LINKS}}
# Steps after which a change is on the device but no prepared claim asks it: restored at the restart.
RESTORED_AT_START = {
    "prepare-journaled",
    "prepare-rebound",
    "prepare-partial",
    "prepare-applied",
    "unprepare-marked",
    "unprepare-partial",
    "unprepare-links-back",
    "unprepare-restored",
}


class Party:
    """The node, the API-server stand-in, the DRA kubelet, and the daemon process of the moment."""

    def __init__(self, node: Node, api: ApiServerStandIn, kubelet: DraKubelet, env: dict[str, str]) -> None:
        self.node = node
        self.ask: dict[str, Any] = {}
        self.api = api
        self.kubelet = kubelet
        self.env = env
        self.child: Child | None = None
        self.kubeconfig = node.tmp / "kubeconfig"
        self.kubeconfig.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "c", "cluster": {"server": api.url}}],
                    "users": [{"name": "u", "user": {}}],
                    "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                    "current-context": "x",
                }
            )
        )
        pf1 = node.pf1
        self.vf = pf1.vf_addresses[0]
        self.target = VfTarget(pf1.netdev, 0)
        self.links = SimVfLinks(node.sysfs)

    def start(self, stop_at: str = "") -> Child:
        n = self.node
        env = dict(self.env)
        env.pop(STOP_ENV, None)
        if stop_at:
            env[STOP_ENV] = stop_at
        args = [
            "--config",
            str(n.config_path),
            "--sysfs-root",
            str(n.sysfs),
            "--kubelet-dir",
            str(n.kubelet_dir),
            "--dev-root",
            str(n.tmp / "dev"),
            "--cdi-dir",
            str(n.cdi_dir),
            "--devinfo-dir",
            str(n.devinfo_dir),
            "--resource-prefix",
            "example.com",
            "--node-name",
            NODE,
            "--kubeconfig",
            str(self.kubeconfig),
            "--kubelet-plugins-dir",
            str(n.plugins_dir),
            "--kubelet-registry-dir",
            str(n.registry_dir),
            "--no-netlink",
            "--log-level",
            "info",
        ]
        self.child = Child(args, env)
        return self.child

    async def killed(self) -> None:
        """Wait for the daemon to have killed itself (SIGKILL: no cleanup ran)."""
        assert self.child is not None
        code = await asyncio.wait_for(asyncio.to_thread(self.child.proc.wait, GUARD), GUARD + 5)
        assert code == -signal.SIGKILL, code
        self.child.stop()

    def claim(self) -> tuple[str, str, str]:
        uid = str(uuid.uuid4())
        name = f"claim-{uid[:8]}"
        result = {"request": "nic", "driver": DRIVER, "pool": NODE, "device": names.device_name(self.vf)}
        params = {"apiVersion": API_VERSION, "kind": KIND, **self.ask}
        opaque = {"driver": DRIVER, "parameters": params}
        entry = {"source": "FromClaim", "requests": ["nic"], "opaque": opaque}
        self.api.put_claim(allocated_claim("default", name, uid, [result], [entry]))
        return ("default", name, uid)

    def recorded(self) -> tuple[set[str], int]:
        """Return the claim UIDs the checkpoint records prepared and the number of journal records."""
        path = self.node.plugins_dir / DRIVER / CHECKPOINT_NAME
        if not path.exists():
            return set(), 0
        rec = decode_record(DRIVER, path.read_bytes())
        return set(rec.claims), len(rec.journal)

    def values(self) -> dict[str, Any]:
        return self.links.values(self.target)

    def driver(self) -> tuple[str | None, str | None] | None:
        """Return the VF's (bound driver, driver_override), or None while the kernel has a write to take."""
        try:
            override = rebind.override_of(self.node.sysfs, self.vf)
        except rebind.RebindError:
            return None  # a restore or a Prepare is mid-rebind: neither settled state, yet
        return rebind.binding_of(self.node.sysfs, self.vf).driver, override

    def listed(self) -> bool:
        return self.vf in self.node.published(DRIVER).values()

    async def until(self, cond: Callable[[], bool], what: str) -> None:
        try:
            await self.kubelet.wait_for(cond, GUARD)
        except TimeoutError:
            lines = "\n".join(self.child.lines[-40:]) if self.child is not None else ""
            raise AssertionError(f"never happened: {what}\n{lines}") from None

    async def registered(self, old: object = None) -> None:
        """Wait until the kubelet registered a daemon's plugin (another than ``old``) and its slice lists."""
        await self.until(
            lambda: (r := self.kubelet.plugins.get(DRIVER)) is not None and r is not old,
            "the DRA plugin registered",
        )


@pytest.fixture
async def party(tmp_path: Path, child_env: dict[str, str]) -> AsyncIterator[Party]:
    node = Node(tmp_path)
    node.write([pool("dp", [node.pf0.netdev]), pool("dra", [node.pf1.netdev], "dra")])
    api = ApiServerStandIn()
    await api.start()
    api.add_node(NODE)
    node.api = api

    async def wipe() -> None:
        api.wipe_node(NODE)

    kubelet = DraKubelet(node.registry_dir, on_start=wipe)
    await kubelet.start()
    (node.tmp / "dev" / "vfio").mkdir(parents=True, exist_ok=True)
    (node.tmp / "dev" / "vfio" / "vfio").touch()  # the container node, there once vfio is loaded
    kernel = SimKernel(node.sysfs, node.tmp / "dev").start()
    p = Party(node, api, kubelet, child_env)
    try:
        yield p
    finally:
        kernel.stop()
        if p.child is not None:
            if p.child.proc.poll() is None:
                p.child.proc.kill()
            await asyncio.to_thread(p.child.stop)
        await kubelet.stop()
        await api.stop()
        node.cleanup()


def settled(p: Party, uid: str) -> str:
    """Return "prepared", "restored" or "" (neither yet); fail on a VF listed unprepared while changed."""
    claims, journal = p.recorded()  # first: a claim not recorded now is not recorded later (no call runs)
    listed = p.listed()
    values, driver = p.values(), p.driver()
    asked = {k: v for k, v in p.ask.items() if k != "driver"} | {"minTxRateMbps": 0}  # rates go as a pair
    if uid in claims:
        assert {k: values[k] for k in asked} == asked, values  # prepared: exactly as asked
        if "driver" in p.ask:
            assert driver == (p.ask["driver"], p.ask["driver"]), driver
        return "prepared"
    if listed:
        assert values == dict(SIM_DEFAULTS), f"listed while changed: {values}"
        assert driver == ("mlx5_core", None), f"listed while rebound: {driver}"
        return "restored" if journal == 0 else ""
    return ""


@pytest.mark.parametrize("kind", sorted(ASKS))
@pytest.mark.parametrize("step", STEPS)
async def test_sigkill_at_a_step_then_restart(party: Party, step: str, kind: str) -> None:
    p = party
    p.ask = ASKS[kind]
    p.start(stop_at=step)
    await p.registered()
    await p.until(p.listed, "the VF listed in the DRA slice")
    ref = p.claim()
    uid = ref[2]
    if step.startswith("unprepare"):
        answer = (await p.kubelet.prepare(DRIVER, [ref], timeout=CALL_S))[uid]
        assert answer.error == "", answer.error
        assert settled(p, uid) == "prepared"
        call = p.kubelet.unprepare(DRIVER, [ref], timeout=CALL_S)
    else:
        call = p.kubelet.prepare(DRIVER, [ref], timeout=CALL_S)
    old = p.kubelet.plugins.get(DRIVER)
    # The daemon dies at the step, before it answers: the call fails (the step was reached).
    with pytest.raises(grpc.aio.AioRpcError):
        await call
    await p.killed()
    # The killed run's slices stay at the API server until a run publishes again; what they list is the
    # dead run's word (the claim's allocation covers the VF meanwhile, and a Prepare of any other claim
    # is refused while it is not restored).  What is checked is what the restarted daemon offers.
    p.api.wipe_node(NODE)

    # Restart: the VF is prepared as asked, or back as it was and listed again; never in between.
    child = p.start()
    await p.registered(old)
    outcome = ""

    def check() -> bool:
        nonlocal outcome
        outcome = settled(p, uid)
        return bool(outcome)

    await p.until(check, "the VF settled: prepared as asked, or restored and listed")
    assert outcome == ("prepared" if step == "prepare-recorded" else "restored"), outcome
    if step in RESTORED_AT_START:
        await child.line_with("DRA device restored")

    # The kubelet retries the call that failed; it ends as that call asked.
    if step.startswith("prepare"):
        answer = (await p.kubelet.prepare(DRIVER, [ref], timeout=CALL_S))[uid]
        assert answer.error == "", answer.error
        assert settled(p, uid) == "prepared"
    errors = await p.kubelet.unprepare(DRIVER, [ref], timeout=CALL_S)
    assert errors == {uid: ""}
    await p.until(lambda: settled(p, uid) == "restored", "the VF restored and listed after Unprepare")
    assert p.recorded() == (set(), 0)
    assert child.stop() == 0
