"""Benchmark DRA NodePrepareResources for a 1-device claim, excluding the claim GET; p50/p99 per call.

A node of 4,096 VFs in one DRA pool, ``--held`` claims already prepared (the checkpoint rewritten on
every call grows with them); each timed call prepares a fresh claim of one VF through the kubelet
emulator over the real DRA socket (gRPC, v1), which writes the claim's CDI spec, its device-info file
and the checkpoint (each fsynced) before answering.  The claim object comes from memory, so the GET
the real driver makes first is excluded.  Unprepare is timed too, and the service alone (no gRPC).
Target: prepare p99 <= 5 ms.

Claims with parameters (issue 25, ``--params``; a comma list, ``all`` by default, ``netlink`` under
``--quick``), on a simulated node (``densedev.testing.simnode``) whose VF links are the simulated ones
(``.simnode/vflinks.json``) and whose driver rebinds the simulated kernel answers:

  * ``netlink``: a one-device claim asking vlan+qos, mtu, trust, spoofChk, a max rate and the link state:
    Prepare (read the VF, journal, apply, mark applied) and Unprepare (restore, drop the record) p50/p99
    through gRPC.  Target: p99 <= 10 ms.
  * ``rebind``: a one-device claim asking ``driver: vfio-pci``, the simulated kernel taking
    ``--probe-delay-ms`` to answer each probe/bind (both ways).  Target: p99 <= delay + 10 ms.
  * ``load``: the whole daemon on a 4,096-VF node (16 PFs x 256: 8 PFs in a device-plugin pool, 8 in a
    DRA pool), the device-plugin kubelet emulator and the DRA one in this process; PF down -> the kubelet
    holding its VFs Unhealthy, p50/p99, first with nothing else running, then while waves of 100 claims
    with netlink parameters are prepared and unprepared concurrently (100 parallel gRPC calls each).
    Target: p99 during <= 10 ms (the health path does not stall behind claims).
  * ``none``: only the figures above (claims without parameters).

    PYTHONPATH=src python bench/bench_dra_prepare.py [--quick] [--json] [--held N]
        [--run-dir DIR (tmpfs: /dev/shm)] [--state-dir DIR (disk: /tmp)]
        [--params none|netlink|rebind|load|all (comma list)] [--probe-delay-ms 20] [--flips 50]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import _impl
from bench_dra import start_stand_in

from densedev import accel
from densedev.cli import SWITCH_INTERVAL_S
from densedev.daemon import Daemon, DaemonSettings
from densedev.dra import DraSettings, names
from densedev.dra.apiclient import ResourceClient
from densedev.dra.claims import ClaimRef, PoolGate
from densedev.dra.health import HealthStream
from densedev.dra.node import NodeService, NodeSettings, handlers
from densedev.dra.params import API_VERSION, KIND
from densedev.dra.registration import DraPlugin
from densedev.model import Device, Pool, PoolConfig, PoolMember
from densedev.node import rebind
from densedev.node.scanner import scan
from densedev.node.vflinks import SimVfLinks, VfTarget
from densedev.pools import config as config_mod
from densedev.testing import simnode
from densedev.testing.dra_kubelet import ClaimStore, DraKubelet, allocated_claim
from densedev.testing.kubelet import UNHEALTHY, KubeletEmulator
from densedev.testing.simkernel import FaultRule, write_faults

DRIVER = "net.densedev.io"
NODE = "bench-node"
PFS, VFS_PER_PF = 16, 256
KINDS = ("none", "netlink", "rebind", "load")
# What a VLAN'd, rate-limited kernel VF's claim asks (every rtnetlink setting but the MAC, and the MTU).
NETLINK_ASK: dict[str, Any] = {
    "vlan": 100,
    "qos": 3,
    "mtu": 9000,
    "trust": True,
    "spoofChk": False,
    "maxTxRateMbps": 1000,
    "linkState": "enable",
}
VFIO_ASK: dict[str, Any] = {"driver": "vfio-pci"}
KERNEL_ARGV = (sys.executable, "-m", "densedev.cli", "simulate-kernel")


def make_devices() -> list[Device]:
    """Build 4,096 kernel-netdev VFs under 16 PFs."""
    out = []
    for p in range(PFS):
        for v in range(VFS_PER_PF):
            out.append(
                _impl.MLX5_VF._replace(
                    id=f"0000:{p * 2 + 0x10 + v // 128:02x}:{v % 128 // 8:02x}.{v % 8}",
                    pf=f"0000:{p:02x}:00.0",
                    vf_index=v,
                    pf_netdev=f"ens{p}f0",
                    netdevs=(f"ens{p}f0v{v}",),
                    pcie_root="pci0000:00",
                )
            )
    return out


def percentile(samples: list[float], q: float) -> float:
    """Return the q-quantile (0..1) of samples, nearest rank."""
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def figures(samples: list[float]) -> dict[str, Any]:
    """Return p50/p99/max in milliseconds."""
    return {
        "p50_ms": statistics.median(samples) * 1e3,
        "p99_ms": percentile(samples, 0.99) * 1e3,
        "max_ms": max(samples) * 1e3,
        "calls": len(samples),
    }


async def bench(run_root: Path, root: Path, calls: int, held: int) -> dict[str, Any]:
    """Run the measurements (CDI and device-info dirs under ``run_root``, the rest under ``root``)."""
    devices = make_devices()
    config = PoolConfig("mlnx_sriov_netdevice", "nvidia.com")
    pool = Pool(config, tuple(PoolMember(d.id, d) for d in devices))
    ids = {d.id for d in devices}
    store = ClaimStore()
    settings = NodeSettings(
        DRIVER,
        NODE,
        plugin_dir=root / "plugins" / DRIVER,
        cdi_dir=run_root / "cdi",
        devinfo_dir=run_root / "devinfo",
        dev_root=root / "dev",
    )
    service = NodeService(settings, store, PoolGate(ids.__contains__, [pool], lambda _i: True))
    service.recover()
    free = iter(devices)

    def new_claim() -> tuple[str, str, str]:
        d = next(free)
        uid = str(uuid.uuid4())
        result = {"request": "vf", "driver": DRIVER, "pool": NODE, "device": names.device_name(d.id)}
        store.put(allocated_claim("default", f"c-{uid[:8]}", uid, [result]))
        return ("default", f"c-{uid[:8]}", uid)

    async with served(service, root) as kubelet:
        for _ in range(held):
            ns, name, uid = new_claim()
            assert not (await service.prepare([ClaimRef(ns, name, uid)]))[uid].error
        out: dict[str, Any] = {"held_claims": held}
        grpc_prepare: list[float] = []
        grpc_unprepare: list[float] = []
        for i in range(calls + 5):
            claim = new_claim()
            t = time.perf_counter()
            answer = await kubelet.prepare(DRIVER, [claim])
            dt = time.perf_counter() - t
            assert not answer[claim[2]].error, answer[claim[2]].error
            t = time.perf_counter()
            errors = await kubelet.unprepare(DRIVER, [claim])
            du = time.perf_counter() - t
            assert errors == {claim[2]: ""}
            if i >= 5:  # warm-up calls first
                grpc_prepare.append(dt)
                grpc_unprepare.append(du)
        direct: list[float] = []
        for _ in range(calls):
            ns, name, uid = new_claim()
            ref = ClaimRef(ns, name, uid)
            t = time.perf_counter()
            assert not (await service.prepare([ref]))[uid].error
            direct.append(time.perf_counter() - t)
            await service.unprepare([ref])
        out["grpc_prepare"] = figures(grpc_prepare)
        out["grpc_unprepare"] = figures(grpc_unprepare)
        out["service_prepare"] = figures(direct)
        return out


def vf_config(parameters: dict[str, Any], request: str, driver: str = DRIVER) -> list[dict[str, Any]]:
    """Return an allocation's ``devices.config``: one VfConfig for ``request``, as the scheduler copies it."""
    return [
        {
            "source": "FromClaim",
            "requests": [request],
            "opaque": {
                "driver": driver,
                "parameters": {"apiVersion": API_VERSION, "kind": KIND, **parameters},
            },
        }
    ]


def node_vfs(sysfs: Path) -> list[Device]:
    """Return the simulated node's Ethernet VFs with a netdev, by address."""
    table = scan(sysfs)
    return sorted(
        (d for d in table.by_id().values() if d.role == "vf" and d.netdevs and d.link_type == "ether"),
        key=lambda d: d.id,
    )


@contextlib.asynccontextmanager
async def served(service: NodeService, root: Path) -> AsyncIterator[DraKubelet]:
    """Serve ``service`` on a DRA plugin socket under ``root`` and yield a registered kubelet emulator."""
    health = HealthStream(NODE)
    plugin = DraPlugin(
        DRIVER,
        [*handlers(service), health.handler()],
        registry_dir=root / "registry",
        plugins_dir=root / "plugins",
    )
    kubelet = DraKubelet(root / "registry", poll=0.05)
    await plugin.start()
    await kubelet.start()
    try:
        await kubelet.wait_for(lambda: DRIVER in kubelet.plugins, 10)
        yield kubelet
    finally:
        health.stop()
        await plugin.stop()
        await kubelet.stop()


async def bench_params(
    run_root: Path, root: Path, kind: str, calls: int, probe_delay_ms: float
) -> dict[str, Any]:
    """Time Prepare and Unprepare of 1-device claims with ``kind``'s parameters on a small simulated node."""
    # sysfs is a pseudo-filesystem in memory: the simulated one (with its VF-link state) on the tmpfs.
    sysfs = run_root / "sys"
    simnode.build_node(sysfs, pfs=2, vfs_per_pf=8)
    vfs = node_vfs(sysfs)
    dev_root = run_root / "dev"
    (dev_root / "vfio").mkdir(parents=True, exist_ok=True)
    (dev_root / "vfio" / "vfio").touch()  # the container node, there once vfio-pci is loaded
    pool = Pool(PoolConfig("vf_pool", "example.com"), tuple(PoolMember(d.id, d) for d in vfs))
    ids = {d.id for d in vfs}
    store = ClaimStore()
    settings = NodeSettings(
        DRIVER,
        NODE,
        plugin_dir=root / "plugins" / DRIVER,
        cdi_dir=run_root / "cdi",
        devinfo_dir=run_root / "devinfo",
        dev_root=dev_root,
    )
    links = SimVfLinks(sysfs)
    service = NodeService(
        settings,
        store,
        PoolGate(ids.__contains__, [pool], lambda _i: True),
        links=links,
        sysfs_root=sysfs,
        rebind_timeout=10.0,
    )
    service.recover()
    ask = NETLINK_ASK if kind == "netlink" else VFIO_ASK
    kernel: subprocess.Popen[str] | None = None
    if kind == "rebind":
        # Each probe or bind the kernel answers after the delay (a driver's probe() taking that long).
        write_faults(sysfs, [FaultRule(op=op, delay_ms=probe_delay_ms) for op in ("drivers_probe", "bind")])
        # The kernel in its own process (``densedev simulate-kernel``), as the real one is not in the
        # daemon's: a thread here would wait for this process's GIL before answering each write.
        kernel = subprocess.Popen(
            [*KERNEL_ARGV, "--sysfs-root", str(sysfs), "--dev-root", str(dev_root)],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")},
        )
        assert kernel.stdout is not None
        ready = await asyncio.to_thread(kernel.stdout.readline)
        if not ready.startswith("simulate-kernel:"):
            kernel.kill()
            raise SystemExit(f"the simulated kernel did not start: {ready!r}")
    prepare: list[float] = []
    unprepare: list[float] = []
    try:
        async with served(service, root) as kubelet:
            for i in range(calls + 5):
                vf = vfs[i % len(vfs)]  # each VF is back as it was after Unprepare: reused
                target = VfTarget(vf.pf_netdev, vf.vf_index, vf.netdevs[0])
                before = links.values(target)
                driver_before = rebind.binding_of(sysfs, vf.id).driver
                uid = str(uuid.uuid4())
                claim = ("default", f"c-{uid[:8]}", uid)
                result = {"request": "vf", "driver": DRIVER, "pool": NODE, "device": names.device_name(vf.id)}
                store.put(allocated_claim("default", claim[1], uid, [result], vf_config(ask, "vf")))
                t = time.perf_counter()
                answer = await kubelet.prepare(DRIVER, [claim])
                dt = time.perf_counter() - t
                assert not answer[uid].error, answer[uid].error
                # Applied as asked (outside the timing), and put back by Unprepare.
                if kind == "netlink":
                    now = links.values(target)
                    assert all(now[k] == v for k, v in ask.items()), now
                else:
                    assert rebind.binding_of(sysfs, vf.id).driver == "vfio-pci"
                t = time.perf_counter()
                errors = await kubelet.unprepare(DRIVER, [claim])
                du = time.perf_counter() - t
                assert errors == {uid: ""}, errors
                assert links.values(target) == before
                assert rebind.binding_of(sysfs, vf.id).driver == driver_before
                if i >= 5:  # warm-up calls first
                    prepare.append(dt)
                    unprepare.append(du)
    finally:
        if kernel is not None:
            kernel.terminate()
            kernel.wait()
    out: dict[str, Any] = {"parameters": ask, "prepare": figures(prepare), "unprepare": figures(unprepare)}
    if kernel is not None:
        out["probe_delay_ms"] = probe_delay_ms
    return out


def _load_config(layout: simnode.NodeLayout, path: Path) -> None:
    """Write a config: the first half of the PFs a device-plugin pool, the other half a DRA pool."""
    half = len(layout.pfs) // 2
    health = {"holdDownSeconds": 0}  # a PF back up is reported at once: each flip measured alone
    doc = {
        "resourceList": [
            {
                "resourceName": "vfs_dp",
                "selectors": {"pfNames": [pf.netdev for pf in layout.pfs[:half]]},
                "healthPolicy": health,
            },
            {
                "resourceName": "vfs_dra",
                "api": "dra",
                "selectors": {"pfNames": [pf.netdev for pf in layout.pfs[half:]]},
                "healthPolicy": health,
            },
        ]
    }
    path.write_text(json.dumps(doc))


async def bench_load(work: Path, short: Path, claims: int, flips: int) -> dict[str, Any]:
    """PF down -> device-plugin kubelet p50/p99 without and during waves of ``claims`` concurrent Prepares."""
    layout = simnode.build_node(work / "sys", pfs=PFS, vfs_per_pf=VFS_PER_PF)
    cfg_path = work / "config.json"
    _load_config(layout, cfg_path)
    half = len(layout.pfs) // 2
    dp_pfs, dra_pfs = layout.pfs[:half], layout.pfs[half:]
    # The API server in its own process, as on a cluster: its handling of the claims' reads and status
    # writes is not the daemon's, and its objects stay out of this process's garbage collector.
    api, url = start_stand_in(validate=False)  # bench_dra's: the same node name
    http = aiohttp.ClientSession()
    lister = ResourceClient.for_url(url)

    async def client() -> ResourceClient:
        return ResourceClient.for_url(url)

    settings = DaemonSettings(
        sysfs_root=work / "sys",
        kubelet_dir=short / "dp",
        dev_root=work / "dev",
        cdi_dir=work / "cdi",
        devinfo_dir=work / "devinfo",
        config_path=cfg_path,
        netlink=False,  # the simulated PF netdevs are not links here: their changes are injected
        pod_resources_socket=None,
        dra=DraSettings(node_name=NODE, plugins_dir=short / "plugins", registry_dir=short / "registry"),
    )
    (short / "dp").mkdir()
    cfg = config_mod.load(cfg_path)
    driver = cfg.dra_driver_name
    # update_work off: the emulator runs in this process, and the real kubelet's per-update checkpoint
    # write would stall this loop, the daemon's; ``received`` is the figure either way.
    # A bounded history: 100 flips' 2,048-device lists would be what this process's collector walks.
    emu = KubeletEmulator(short / "dp", update_work=False, keep_updates=4)
    dra_kubelet = DraKubelet(short / "registry")
    daemon = Daemon(settings, cfg, dra_client=client)
    dra_vfs = [a for pf in dra_pfs for a in pf.vf_addresses]
    wanted = {names.device_name(a) for a in dra_vfs}
    links = SimVfLinks(work / "sys")
    targets = {d.id: VfTarget(d.pf_netdev, d.vf_index, d.netdevs[0]) for d in node_vfs(work / "sys")}
    try:
        await emu.start()
        await dra_kubelet.start()
        await daemon.start()
        await emu.wait_for(lambda: any(r.endswith("/vfs_dp") for r in emu.resources()), 60)
        (res,) = [r for r in emu.resources() if r.endswith("/vfs_dp")]
        await emu.wait_for(lambda: len(emu.devices(res)) == half * VFS_PER_PF, 60)

        async def published() -> set[str]:
            items, _ = await lister.list_slices(f"spec.nodeName={NODE}")
            return {d["name"] for s in items for d in s["spec"].get("devices") or []}

        await dra_kubelet.wait_for(lambda: driver in dra_kubelet.plugins, 60)
        await lister.discover()
        deadline = time.monotonic() + 60
        while await published() != wanted:
            if time.monotonic() > deadline:
                raise SystemExit("the DRA pool's devices were not all published within 60 s")
            await asyncio.sleep(0.1)
        await _impl.past_catch_up()
        # What `densedev run` does at the end of its start (Daemon.start): the set-up's objects -- here
        # the emulators', the stand-in's and the node builder's too -- frozen out of the collector's
        # full passes, which would otherwise walk them all in the middle of a flip (50-80 ms each).
        gc.collect()
        gc.freeze()
        flip_no = 0

        async def flip() -> float:
            """Take the next device-plugin PF down, time it to the kubelet, bring it back up."""
            nonlocal flip_no
            pf = dp_pfs[flip_no % len(dp_pfs)]
            flip_no += 1
            before = emu.received(res)
            simnode.set_link(work / "sys", pf.netdev, False)
            t0 = time.monotonic()
            daemon.set_links([(pf.netdev, False)])
            await emu.wait_for(lambda: emu.received(res) > before, 10)
            upd = emu.updates(res)[-1]
            assert all(upd.devices[a] == UNHEALTHY for a in pf.vf_addresses)
            lat = upd.received - t0
            before = emu.received(res)
            simnode.set_link(work / "sys", pf.netdev, True)
            daemon.set_links([(pf.netdev, True)])
            await emu.wait_for(lambda: emu.received(res) > before, 10)
            await asyncio.sleep(0.02)  # a gap between flips, as on a node
            return lat

        quiet = [await flip() for _ in range(flips)]

        waves: list[float] = []
        unwaves: list[float] = []
        calls_seen: list[float] = []
        done = asyncio.Event()
        prepared = 0

        async def claim_waves() -> None:
            """Prepare ``claims`` claims with parameters at once, check, unprepare them at once; repeat."""
            nonlocal prepared
            rng_vfs = iter(dra_vfs * 1000)
            while not done.is_set():
                refs = []
                objects = []
                for _ in range(claims):
                    vf = next(rng_vfs)
                    uid = str(uuid.uuid4())
                    result = {
                        "request": "vf",
                        "driver": driver,
                        "pool": NODE,
                        "device": names.device_name(vf),
                    }
                    entries = vf_config(NETLINK_ASK, "vf", driver)
                    objects.append(allocated_claim("default", f"c-{uid[:8]}", uid, [result], entries))
                    refs.append(("default", f"c-{uid[:8]}", uid, vf))
                async with http.post(f"{url}/_standin/claims", data=json.dumps(objects)) as resp:
                    assert resp.status == 200, await resp.text()
                t = time.perf_counter()
                answers = await asyncio.gather(*(timed_prepare(r[:3]) for r in refs))
                waves.append(time.perf_counter() - t)
                for r, a in zip(refs, answers, strict=True):
                    assert not a[r[2]].error, a[r[2]].error
                vlan = links.values(targets[refs[0][3]])["vlan"]
                assert vlan == NETLINK_ASK["vlan"], vlan
                t = time.perf_counter()
                undone = await asyncio.gather(*(dra_kubelet.unprepare(driver, [r[:3]]) for r in refs))
                unwaves.append(time.perf_counter() - t)
                assert all(u == {r[2]: ""} for r, u in zip(refs, undone, strict=True)), undone
                assert links.values(targets[refs[0][3]]) == links.values(targets[dra_vfs[-1]])  # restored
                prepared += len(refs)

        async def timed_prepare(ref: tuple[str, str, str]) -> Any:
            t = time.perf_counter()
            answer = await dra_kubelet.prepare(driver, [ref])
            calls_seen.append(time.perf_counter() - t)
            return answer

        task = asyncio.create_task(claim_waves())
        await asyncio.sleep(0.05)  # the first wave under way
        during = [await flip() for _ in range(flips)]
        done.set()
        await task
    finally:
        await daemon.stop()
        await dra_kubelet.stop()
        await emu.stop()
        await lister.close()
        await http.close()
        api.terminate()
        api.wait()

    def ms(values: list[float]) -> dict[str, Any]:
        return {
            "p50_ms": round(statistics.median(values) * 1e3, 2),
            "p99_ms": round(percentile(values, 0.99) * 1e3, 2),
            "max_ms": round(max(values) * 1e3, 2),
            "n": len(values),
        }

    return {
        "devices": PFS * VFS_PER_PF,
        "claims_per_wave": claims,
        "claims_prepared": prepared,
        "wave_prepare": ms(waves),
        "wave_unprepare": ms(unwaves),
        "prepare_call_in_wave": ms(calls_seen),
        "pf_down_to_kubelet_quiet": ms(quiet),
        "pf_down_to_kubelet_during_claims": ms(during),
    }


def kinds_of(value: str) -> tuple[str, ...]:
    """Parse ``--params``: a comma list of KINDS, or ``all``."""
    asked = tuple(k.strip() for k in value.split(",") if k.strip())
    if asked == ("all",):
        return KINDS
    bad = [k for k in asked if k not in KINDS]
    if bad or not asked:
        raise argparse.ArgumentTypeError(f"{value!r}: expected a comma list of {', '.join(KINDS)}, or all")
    return asked


async def run_params(args: argparse.Namespace, kinds: tuple[str, ...], calls: int) -> dict[str, Any]:
    """Run each asked kind of claim with parameters in its own scratch dirs."""
    out: dict[str, Any] = {}
    for kind in ("netlink", "rebind"):
        if kind in kinds:
            run_root = Path(tempfile.mkdtemp(prefix="dd-drp-", dir=args.run_dir))
            root = Path(tempfile.mkdtemp(prefix="dd-drp-", dir=args.state_dir))
            try:
                out[kind] = await bench_params(run_root, root, kind, calls, args.probe_delay_ms)
            finally:
                shutil.rmtree(root, ignore_errors=True)
                shutil.rmtree(run_root, ignore_errors=True)
    if "load" in kinds:
        logging.disable(logging.WARNING)  # the daemon's own lines (PF down, ...) are not the output
        work = Path(tempfile.mkdtemp(prefix="dd-drl-", dir=args.run_dir))
        short = Path(tempfile.mkdtemp(prefix="dl-", dir="/tmp"))  # sun_path holds 107 bytes
        try:
            out["load"] = await bench_load(work, short, 100, args.flips)
        finally:
            shutil.rmtree(work, ignore_errors=True)
            shutil.rmtree(short, ignore_errors=True)
    return out


def _line(label: str, f: dict[str, Any]) -> str:
    return (
        f"  {label:<24} p50 {f['p50_ms']:6.2f} ms   p99 {f['p99_ms']:6.2f} ms   "
        f"max {f['max_ms']:6.2f} ms   ({f.get('calls', f.get('n'))} calls)"
    )


def main() -> int:
    """Run the benchmark and print figures (or JSON)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls (a smoke run)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    # As on a node: /var/run (CDI specs, device-info files) is a tmpfs, /var/lib/kubelet (the plugin
    # dir with the checkpoint, fsynced on every call) a disk.
    parser.add_argument("--run-dir", default="/dev/shm", help="where the CDI and device-info dirs go")
    parser.add_argument("--state-dir", default="/tmp", help="where the plugin dir (checkpoint) goes")
    parser.add_argument("--held", type=int, default=100, help="claims prepared before timing")
    parser.add_argument(
        "--params",
        type=kinds_of,
        default=None,
        help="claims with parameters: a comma list of none,netlink,rebind,load or all "
        "(default: all; netlink under --quick)",
    )
    parser.add_argument(
        "--probe-delay-ms", type=float, default=20.0, help="the simulated kernel's probe time"
    )
    parser.add_argument("--flips", type=int, default=None, help="PF flips per phase of the load run")
    args = parser.parse_args()
    calls = 50 if args.quick else 1000
    held = min(args.held, 20) if args.quick else args.held
    kinds = args.params if args.params is not None else (("none", "netlink") if args.quick else KINDS)
    if args.flips is None:
        args.flips = 10 if args.quick else 50
    if held + 2 * calls + 5 > PFS * VFS_PER_PF:
        parser.error(f"--held {held} leaves too few of the {PFS * VFS_PER_PF} VFs for {calls} calls")
    run_root = Path(tempfile.mkdtemp(prefix="dd-dra-", dir=args.run_dir))
    root = Path(tempfile.mkdtemp(prefix="dd-dra-", dir=args.state_dir))
    # As `densedev run` sets it: the loop's thread waits at most this long for the GIL that a worker
    # thread (checkpoint writes, netlink) holds, on the health path's every wake-up.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        result = uvloop.run(bench(run_root, root, calls, held))
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(run_root, ignore_errors=True)
    # A rebind waits out the probe delay: fewer calls keep the run short.
    result["params"] = uvloop.run(run_params(args, kinds, calls if args.quick else 300))
    result["run_dir"], result["state_dir"] = args.run_dir, args.state_dir
    result["implementation"] = accel.IMPLEMENTATION
    if args.json:
        print(json.dumps({"bench": "dra_prepare", **result}))
        return 0
    print(
        f"DRA NodePrepareResources, 1-device claims, {PFS * VFS_PER_PF} VFs, "
        f"{result['held_claims']} claims held; CDI/device-info under {args.run_dir}, "
        f"checkpoint under {args.state_dir}"
    )
    for key, label in (
        ("grpc_prepare", "prepare via gRPC (v1)"),
        ("grpc_unprepare", "unprepare via gRPC"),
        ("service_prepare", "prepare, service only"),
    ):
        print(_line(label, result[key]))
    params = result["params"]
    if "netlink" in params:
        print(f"claims with netlink parameters ({params['netlink']['parameters']}), via gRPC:")
        print(_line("prepare", params["netlink"]["prepare"]))
        print(_line("unprepare", params["netlink"]["unprepare"]))
    if "rebind" in params:
        print(f"claims with driver: vfio-pci, simulated probe delay {args.probe_delay_ms:g} ms, via gRPC:")
        print(_line("prepare", params["rebind"]["prepare"]))
        print(_line("unprepare", params["rebind"]["unprepare"]))
    if "load" in params:
        load = params["load"]
        print(
            f"{load['devices']} VFs, waves of {load['claims_per_wave']} claims with netlink parameters "
            f"prepared+unprepared concurrently ({load['claims_prepared']} in all):"
        )
        print(_line("all 100 prepared", load["wave_prepare"]))
        print(_line("all 100 unprepared", load["wave_unprepare"]))
        print(_line("one prepare call", load["prepare_call_in_wave"]))
        print(_line("PF down -> kubelet, quiet", load["pf_down_to_kubelet_quiet"]))
        print(_line("  ... during the waves", load["pf_down_to_kubelet_during_claims"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
