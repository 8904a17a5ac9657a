"""``densedev demo --dra``: the same simulated node served through DRA instead of the device-plugin API.

The daemon runs as in production; around it run the API-server stand-in (ResourceSlices and
ResourceClaims over HTTP, through the same client as production) and the DRA kubelet emulator
(registration, NodePrepareResources/NodeUnprepareResources, the health stream).  PFs flap at random;
each flip is timed until the stand-in's slices show it, and a 1-device claim is prepared and
unprepared each round, as a pod's would be.  The claim carries parameters (a ``VfConfig`` with a VLAN and
an MTU, as a VLAN'd kernel-networking pod's would): Prepare sets them through the simulated node's VF
links (``.simnode/vflinks.json``) and Unprepare must put back what the VF had; the demo reads the
simulated state after each and counts an error when either is not so.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
import uuid
from pathlib import Path
from typing import Any, NamedTuple

from . import accel
from .daemon import Daemon, DaemonSettings
from .dra import DraSettings, names
from .dra.apiclient import ResourceClient
from .dra.params import API_VERSION, KIND
from .node.scanner import scan
from .node.vflinks import SimVfLinks, VfTarget
from .pools import config as config_mod
from .testing import simnode
from .testing.apiserver import ApiServerStandIn
from .testing.dra_kubelet import DraKubelet, allocated_claim

NODE = "demo-node"
WAIT_S = 10.0  # how long a flip may take to show at the stand-in before the demo counts an error
# What each round's claim asks of its VF (a VLAN'd kernel VF with jumbo frames, docs/dra.md).
ASK: dict[str, Any] = {"vlan": 100, "mtu": 9000}


class RoundOutcome(NamedTuple):
    """One claim round: whether it was prepared and unprepared, and whether its settings were right."""

    prepared: bool
    applied: bool  # every asked setting was on the VF while prepared
    restored: bool  # the VF had its earlier values again after Unprepare
    before: dict[str, Any]
    during: dict[str, Any]


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def dra_config(path: Path) -> Path:
    """Write beside ``path`` the same config with every pool DRA can serve moved to DRA; return it."""
    doc = json.loads(path.read_text())
    # A shared RDMA pool cannot be a DRA pool (a DRA device belongs to one claim): it is left out.
    pools = [{**p, "api": "dra"} for p in doc.get("resourceList", []) if not p.get("rdmaShared")]
    out = path.with_name("config-dra.json")
    out.write_text(json.dumps({**doc, "resourceList": pools}, indent=2))
    return out


def _settings(values: dict[str, Any]) -> str:
    """Return the asked settings' values in ``values`` as "vlan 100, mtu 9000"."""
    return ", ".join(f"{k} {values[k]}" for k in ASK)


def _published(api: ApiServerStandIn) -> set[str]:
    return {d["name"] for s in api.node_slices(NODE) for d in s["spec"].get("devices") or []}


async def _until(cond: Any, stop: asyncio.Event, limit: float = WAIT_S) -> bool:
    """Poll ``cond`` every millisecond (the stand-in has no change feed for the demo) up to ``limit``."""
    end = time.monotonic() + limit
    while not cond():
        if time.monotonic() > end or stop.is_set():
            return False
        await asyncio.sleep(0.001)
    return True


async def run_dra(
    args: argparse.Namespace, work: Path, stop: asyncio.Event, layout: simnode.NodeLayout
) -> int:
    """Serve the simulated node through DRA until ``--seconds`` or a signal; print a summary line."""
    cfg_path = dra_config(work / "config.json")
    cfg = config_mod.load(cfg_path)
    # The kubelet's sockets live in short paths (sun_path holds 107 bytes).
    plugins, registry = work / "plugins", work / "registry"
    api = ApiServerStandIn(validate=_can_validate())
    url = await api.start()
    api.add_node(NODE)

    async def client() -> ResourceClient:
        return ResourceClient.for_url(url)

    async def wipe() -> None:
        api.wipe_node(NODE)  # the kubelet deletes the node's slices at its start

    kubelet = DraKubelet(registry, on_start=wipe)
    dra = DraSettings(node_name=NODE, plugins_dir=plugins, registry_dir=registry)
    settings = DaemonSettings(
        sysfs_root=work / "sys",
        kubelet_dir=work / "kubelet",
        dev_root=work / "dev",
        cdi_dir=work / "cdi",
        devinfo_dir=work / "devinfo",
        config_path=cfg_path,
        netlink=False,  # the simulated PF netdevs do not exist in this namespace: links are injected
        dra=dra,
    )
    (work / "kubelet").mkdir(exist_ok=True)
    daemon = Daemon(settings, cfg, dra_client=client)
    driver = cfg.dra_driver_name
    by_pf = {pf.netdev: {names.device_name(a) for a in pf.vf_addresses} for pf in layout.pfs}
    every = set().union(*by_pf.values())
    # The VFs a VLAN can be set on (Ethernet, with a netdev), by DRA device name, and their link targets.
    targets = {
        names.device_name(d.id): VfTarget(d.pf_netdev, d.vf_index, d.netdevs[0])
        for d in scan(work / "sys").by_id().values()
        if d.role == "vf" and d.netdevs and d.link_type == "ether" and d.pf_netdev
    }
    links = SimVfLinks(work / "sys")
    latencies: list[float] = []
    flips = prepared = errors = applied_ok = 0
    rng = random.Random(1)
    try:
        await kubelet.start()
        t0 = time.perf_counter()
        await daemon.start()
        if not await _until(lambda: _published(api) == every and driver in kubelet.plugins, stop, 30.0):
            print("the node's slices were not all published", file=sys.stderr)
            return 1
        print(
            f"{len(every)} devices published in {len(api.node_slices(NODE))} ResourceSlices and the DRA "
            f"plugin registered in {(time.perf_counter() - t0) * 1e3:.0f} ms "
            f"({sum(api.writes.values())} slice writes, every one schema-checked: {api.validate})"
        )
        down: set[str] = set()
        deadline = time.monotonic() + args.seconds if args.seconds > 0 else float("inf")
        next_line = time.monotonic() + 1.0
        while time.monotonic() < deadline and not stop.is_set():
            pf = rng.choice(layout.pfs)
            going_down = pf.netdev not in down
            simnode.set_link(work / "sys", pf.netdev, not going_down)
            t_flip = time.monotonic()
            daemon.set_links([(pf.netdev, not going_down)])
            flips += 1
            if going_down:
                down.add(pf.netdev)
                # Withdrawn from the slices; a flap inside the hold-down shows nothing new (absorbed).
                gone = by_pf[pf.netdev]
                if await _until(lambda gone=gone: not (_published(api) & gone), stop):
                    latencies.append(time.monotonic() - t_flip)
                elif not stop.is_set():
                    errors += 1
            else:
                down.discard(pf.netdev)
            outcome = await _claim_round(
                api, kubelet, driver, _published(api) & set(targets), rng, links, targets
            )
            if outcome is not None:
                prepared += outcome.prepared
                if not (outcome.prepared and outcome.applied and outcome.restored):
                    errors += 1
                    print(f"claim round wrong: {outcome}", file=sys.stderr)
                else:
                    applied_ok += 1
                    if applied_ok == 1:  # once: what a round does to its VF
                        had = _settings(outcome.before)
                        print(
                            f"claim with parameters: prepared with {_settings(outcome.during)} set on "
                            f"the VF; unprepared, it has {had} again"
                        )
            if time.monotonic() >= next_line:
                next_line = time.monotonic() + 1.0
                health = kubelet.health(driver)
                bad = sum(1 for v in health.values() if v != "HEALTHY")
                print(
                    f"published {len(_published(api))}/{len(every)}, kubelet health: {bad} unhealthy, "
                    f"{flips} flips, {prepared} claims prepared+unprepared "
                    f"({applied_ok} configured and restored), "
                    f"{sum(api.writes.values())} slice writes"
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), args.flip_interval)
    finally:
        await daemon.stop()
        await kubelet.stop()
        await api.stop()
    p50, p99 = _percentile(latencies, 0.5) * 1e3, _percentile(latencies, 0.99) * 1e3
    print(
        f"demo summary (DRA): {len(every)} devices, {flips} link flips, {prepared} claims prepared and "
        f"unprepared ({applied_ok} with {_settings(ASK)} applied and restored), "
        f"{sum(api.writes.values())} slice writes, flip-to-slice latency p50 {p50:.2f} ms "
        f"p99 {p99:.2f} ms (each slice written at most once per "
        f"{dra.min_write_interval_s:g} s), {errors} errors, implementation={accel.IMPLEMENTATION}"
    )
    return 0 if errors == 0 else 1


async def _claim_round(
    api: ApiServerStandIn,
    kubelet: DraKubelet,
    driver: str,
    published: set[str],
    rng: random.Random,
    links: SimVfLinks,
    targets: dict[str, VfTarget],
) -> RoundOutcome | None:
    """Allocate one published VF to a new claim with parameters (as the scheduler would), prepare and
    unprepare it, reading the VF's simulated settings before, while prepared and after."""
    if not published:
        return None
    device = rng.choice(sorted(published))
    target = targets[device]
    uid = str(uuid.uuid4())
    name = f"demo-{uid[:8]}"
    result = {"request": "nic", "driver": driver, "pool": NODE, "device": device}
    # As the scheduler copies the claim's spec.devices.config into status.allocation.devices.config.
    config = [
        {
            "source": "FromClaim",
            "requests": ["nic"],
            "opaque": {"driver": driver, "parameters": {"apiVersion": API_VERSION, "kind": KIND, **ASK}},
        }
    ]
    before = await asyncio.to_thread(links.values, target)  # a file read under a lock: off the loop
    api.put_claim(allocated_claim("default", name, uid, [result], config))
    answer = (await kubelet.prepare(driver, [("default", name, uid)]))[uid]
    during = await asyncio.to_thread(links.values, target)
    await kubelet.unprepare(driver, [("default", name, uid)])
    after = await asyncio.to_thread(links.values, target)
    if answer.error:
        print(f"claim {name}: {answer.error}", file=sys.stderr)
    return RoundOutcome(
        prepared=not answer.error,
        applied=all(during[k] == v for k, v in ASK.items()),
        restored=after == before,
        before=before,
        during=during,
    )


def _can_validate() -> bool:
    """Whether the official schemas are installed (kubernetes-validate, a dev dependency)."""
    try:
        import kubernetes_validate  # noqa: F401
    except ImportError:
        return False
    return True
