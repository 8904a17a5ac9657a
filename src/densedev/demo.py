"""``densedev demo``: the real daemon on a simulated node, against the kubelet emulator, with a live view.

It builds a simulated node (thousands of VFs) in a temp dir, starts the plugin servers and the kubelet
emulator, flips PF links now and then the way rtnetlink reports them, allocates devices through the
emulator, and shows pools, healthy/total, updates and the flip-to-kubelet latency.  No root, kubelet or
hardware needed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import grpc

from . import accel
from .daemon import Daemon, DaemonSettings
from .kubelet import sockets
from .pools import config as config_mod
from .testing import simnode
from .testing.kubelet import HEALTHY, KubeletEmulator


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[k]


class DemoView:
    """Prints the live table: a redrawn screen on a terminal, a line per second otherwise."""

    def __init__(self, emulator: KubeletEmulator, out=sys.stdout) -> None:  # type: ignore[no-untyped-def]
        self.emulator = emulator
        self.out = out
        self.tty = out.isatty()
        self.started = time.monotonic()

    def render(self, latencies: list[float], flips: int, allocations: int) -> None:
        """Write the current state of every pool as the kubelet emulator sees it."""
        rows = []
        total_healthy = total = updates = 0
        for res in sorted(self.emulator.resources()):
            devs = self.emulator.devices(res)
            healthy = sum(1 for h in devs.values() if h == HEALTHY)
            n_upd = len(self.emulator.updates(res))
            rows.append(f"  {res:<44} {healthy:>6}/{len(devs):<6} {n_upd:>6}")
            total_healthy += healthy
            total += len(devs)
            updates += n_upd
        last = f"{latencies[-1] * 1e3:.2f} ms" if latencies else "-"
        p99 = f"{_percentile(latencies, 0.99) * 1e3:.2f} ms" if latencies else "-"
        head = (
            f"densedev demo ({accel.IMPLEMENTATION}) t={time.monotonic() - self.started:5.1f}s  "
            f"devices {total_healthy}/{total} healthy  updates {updates}  flips {flips}  "
            f"allocations {allocations}  last latency {last}  p99 {p99}"
        )
        if self.tty:
            self.out.write("\x1b[H\x1b[2J" + head + "\n")
            self.out.write(
                f"  {'resource':<44} {'healthy/total':>13} {'updates':>6}\n" + "\n".join(rows) + "\n"
            )
        else:
            self.out.write(head + "\n")
        self.out.flush()


def _scratch(need: int = 2 << 30) -> str | None:
    """Prefer tmpfs for the simulated tree (thousands of tiny files build ~5x faster than on disk)."""
    shm = "/dev/shm"
    try:
        if os.access(shm, os.W_OK) and shutil.disk_usage(shm).free >= need:
            return shm
    except OSError:
        pass
    return None


class _Stopped(Exception):
    """Raised from the build's progress callback when Ctrl-C or SIGTERM arrived: abandon the build."""


async def run_demo(args: argparse.Namespace) -> int:
    """Run the demo until ``--seconds`` elapse, Ctrl-C or SIGTERM, and print a one-line summary."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # Both signals only ask the demo to stop: it then prints its summary, stops the servers and removes
    # its sockets and temp tree (SIGTERM's default action would leave all of them behind).
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        with contextlib.ExitStack() as stack:
            if args.workdir is not None:
                work = Path(args.workdir)
                work.mkdir(parents=True, exist_ok=True)
            else:
                work = Path(
                    stack.enter_context(tempfile.TemporaryDirectory(prefix="densedev-demo-", dir=_scratch()))
                )
            return await _run(args, work, stop)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def _layout_file(work: Path) -> Path:
    return work / "layout.json"


def _load_kept(work: Path, args: argparse.Namespace) -> simnode.NodeLayout | None:
    """Return the layout of a node an earlier ``--workdir`` run kept, when it has the asked-for shape."""
    try:
        saved = json.loads(_layout_file(work).read_text())
        if saved["shape"] != [args.pfs, args.vfs_per_pf, args.vendor]:
            return None
        pfs = tuple(
            simnode.SimPF(
                address=str(pf["address"]),
                netdev=str(pf["netdev"]),
                numa_node=int(pf["numa_node"]),
                vf_addresses=tuple(map(str, pf["vf_addresses"])),
                vf_netdevs=tuple(map(str, pf["vf_netdevs"])),
                ibdev=str(pf["ibdev"]),
                vf_ibdevs=tuple(map(str, pf["vf_ibdevs"])),
                vendor=str(pf["vendor"]),
            )
            for pf in saved["pfs"]
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not (work / "sys" / ".simnode").is_dir() or not (work / "config.json").is_file():
        return None
    return simnode.NodeLayout(root=work / "sys", pfs=pfs, vendor=args.vendor, rdma=args.vendor == "mellanox")


def _keep(work: Path, args: argparse.Namespace, layout: simnode.NodeLayout) -> None:
    shape = [args.pfs, args.vfs_per_pf, args.vendor]
    data = {"shape": shape, "pfs": [dataclasses.asdict(pf) for pf in layout.pfs]}
    tmp = _layout_file(work).with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, _layout_file(work))


async def _build(args: argparse.Namespace, work: Path, stop: asyncio.Event) -> simnode.NodeLayout:
    """Build the simulated node in a worker thread (the loop stays free to see signals) with progress."""
    sysfs = work / "sys"
    if sysfs.is_symlink() or (sysfs.exists() and not (sysfs / ".simnode").is_dir()):
        raise FileExistsError(f"{sysfs} exists and is not a simulated node; not replacing it")
    _layout_file(work).unlink(missing_ok=True)
    # Built beside its final place and renamed there: a build stopped half-way leaves nothing behind.
    partial = Path(tempfile.mkdtemp(prefix=".sys.partial-", dir=work))
    bar = simnode.BuildProgress(sys.stdout, "building the simulated node", " PFs")

    def progress(done: int, total: int) -> None:
        if stop.is_set():
            raise _Stopped()
        bar(done, total)

    try:
        built = await asyncio.to_thread(
            simnode.build_node,
            partial,
            pfs=args.pfs,
            vfs_per_pf=args.vfs_per_pf,
            vendor=args.vendor,
            rdma=args.vendor == "mellanox",
            numa_nodes=2,
            progress=progress,
        )
        if sysfs.exists():
            shutil.rmtree(sysfs)  # a kept node of another shape
        os.rename(partial, sysfs)
    finally:
        bar.done()
        shutil.rmtree(partial, ignore_errors=True)
    layout = dataclasses.replace(built, root=sysfs)
    simnode.write_config(work / "config.json", layout)
    if args.workdir is not None:
        _keep(work, args, layout)
    return layout


def _reset(sysfs: Path, layout: simnode.NodeLayout) -> None:
    """Bring every link and RDMA port of a kept node up again, as a fresh node starts."""
    for pf in layout.pfs:
        simnode.set_link(sysfs, pf.netdev, True)
        if pf.ibdev:
            simnode.set_rdma_port(sysfs, pf.ibdev, 1, 4)


def _check_socket_room(kubelet_dir: Path) -> None:
    """Raise OSError (one line) when a pool's socket in ``kubelet_dir`` could not be bound (sun_path)."""
    # A pool's socket name is its readable name when that fits, else a 16-hex digest: the digest's
    # path is the longest the daemon may need (kubelet.sock is shorter).  Past 107 bytes neither the
    # daemon nor the emulator could bind, and the registrations the demo waits for could never come.
    longest = kubelet_dir / f"{sockets.PREFIX}{'0' * 16}{sockets.SUFFIX}"
    if len(os.fsencode(longest)) > sockets.MAX_UNIX_PATH:
        raise OSError(
            f"{kubelet_dir}: a socket path there would exceed {sockets.MAX_UNIX_PATH} bytes (sun_path); "
            "use a shorter --workdir"
        )


async def _run(args: argparse.Namespace, work: Path, stop: asyncio.Event) -> int:
    _check_socket_room(work / "kubelet")
    sysfs = work / "sys"
    t0 = time.perf_counter()
    layout = _load_kept(work, args) if args.workdir is not None else None
    if layout is not None:
        _reset(sysfs, layout)
        how = "reused"
    else:
        try:
            layout = await _build(args, work, stop)
        except _Stopped:
            print("demo stopped while building the simulated node")
            return 130
        how = "built"
    cfg_path = work / "config.json"
    nvfs = sum(len(pf.vf_addresses) for pf in layout.pfs)
    took = time.perf_counter() - t0
    print(f"simulated node: {len(layout.pfs)} PFs, {nvfs} VFs {how} in {took:.1f} s ({work})")
    if stop.is_set():
        return 130
    if getattr(args, "dra", False):
        from .demo_dra import run_dra

        return await run_dra(args, work, stop, layout)
    cfg = config_mod.load(cfg_path)
    kubelet_dir = work / "kubelet"
    kubelet_dir.mkdir(exist_ok=True)
    emulator = KubeletEmulator(kubelet_dir)
    settings = DaemonSettings(
        sysfs_root=sysfs,
        kubelet_dir=kubelet_dir,
        dev_root=work / "dev",
        cdi_dir=work / "cdi",
        devinfo_dir=work / "devinfo",
        config_path=cfg_path,
        netlink=False,  # the simulated PF netdevs do not exist in this namespace: links are injected
    )
    daemon = Daemon(settings, cfg)
    expected = {p.full_name for p in cfg.pools}
    latencies: list[float] = []
    flips = port_flips = allocations = refused = errors = absorbed = 0
    view = DemoView(emulator)
    try:
        await emulator.start()
        t1 = time.perf_counter()
        await daemon.start()
        registered = asyncio.ensure_future(
            emulator.wait_for(
                lambda: (
                    expected <= set(emulator.resources())
                    and all(emulator.devices(r) is not None and emulator.updates(r) for r in expected)
                ),
                10.0,
            )
        )
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait((registered, stopping), return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if not registered.done():
            registered.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await registered
            return 130
        registered.result()
        print(
            f"daemon up and all {len(expected)} pools registered in {(time.perf_counter() - t1) * 1e3:.0f} ms"
        )
        print(_legend(cfg, emulator, layout, args.flip_interval))
        view.started = time.monotonic()
        rng = random.Random(1)
        down: set[str] = set()
        ports_down: set[str] = set()
        deadline = time.monotonic() + args.seconds if args.seconds > 0 else float("inf")
        next_render = 0.0
        pool_of_pf = _pool_of_pf(daemon, layout)
        while time.monotonic() < deadline and not stop.is_set():
            now = time.monotonic()
            if now >= next_render:
                view.render(latencies, flips, allocations)
                next_render = now + 1.0
            pf = rng.choice(layout.pfs)
            if pf.ibdev and rng.random() < 0.25:
                # An RDMA port flip goes through the tree for real: the daemon's port poll reads it.
                port_down = pf.ibdev not in ports_down
                simnode.set_rdma_port(sysfs, pf.ibdev, 1, 1 if port_down else 4)
                (ports_down.add if port_down else ports_down.discard)(pf.ibdev)
                port_flips += 1
            else:
                going_down = pf.netdev not in down
                resource = pool_of_pf.get(pf.address)
                before = len(emulator.updates(resource)) if resource else 0
                # The tree and the daemon learn together, as sysfs and rtnetlink do on a node (the
                # simulated PF netdevs do not exist in this namespace, so the link event is injected).
                simnode.set_link(sysfs, pf.netdev, not going_down)
                t_flip = time.monotonic()
                daemon.set_links([(pf.netdev, not going_down)])
                flips += 1
                if not going_down:
                    down.discard(pf.netdev)
                else:
                    down.add(pf.netdev)
                    # A PF that went up less than the hold-down ago is still advertised Unhealthy: its
                    # flap is absorbed (nothing to send), so only flips of advertised-healthy VFs are timed.
                    if resource is None or not _advertised_healthy(emulator, resource, pf.vf_addresses):
                        absorbed += 1
                    elif (
                        latency := await _flip_latency(emulator, resource, before, t_flip, pf.vf_addresses)
                    ) is not None:
                        latencies.append(latency)
                    else:
                        errors += 1
            allocated, stale = await _allocate_one(emulator, rng)
            allocations += allocated
            refused += stale
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), args.flip_interval)
        view.render(latencies, flips, allocations)
    finally:
        await daemon.stop()
        await emulator.stop()
    total = sum(len(emulator.devices(r) or {}) for r in emulator.resources())
    updates = sum(len(emulator.updates(r)) for r in emulator.resources())
    p50, p99 = _percentile(latencies, 0.5) * 1e3, _percentile(latencies, 0.99) * 1e3
    print(
        f"demo summary: {total} devices in {len(expected)} pools, {flips} link flips, "
        f"{port_flips} RDMA port flips, {updates} updates, "
        f"{allocations} allocations ({refused} refused: went unhealthy first), "
        f"{absorbed} flaps absorbed by the hold-down, "
        f"flip-to-kubelet latency p50 {p50:.2f} ms p99 {p99:.2f} ms, {errors} errors, "
        f"implementation={accel.IMPLEMENTATION}"
    )
    return 0 if errors == 0 else 1


def _legend(
    cfg: config_mod.Config, emulator: KubeletEmulator, layout: simnode.NodeLayout, flip_interval: float
) -> str:
    """Say what the live view's numbers mean, in this node's own counts."""
    total = sum(len(emulator.devices(r) or {}) for r in emulator.resources())
    shared_pools = [p for p in cfg.pools if p.rdma_shared > 0]
    shared = sum(len(emulator.devices(p.full_name) or {}) for p in shared_pools)
    nvfs = sum(len(pf.vf_addresses) for pf in layout.pfs)
    parts = [f"{nvfs:,} VFs"]
    if shared:
        per = ", ".join(str(p.rdma_shared) for p in shared_pools)
        parts.append(f"{shared:,} shared RDMA device IDs ({len(layout.pfs)} PFs x {per} pods each)")
    return (
        f"what the numbers mean: {total:,} devices = {' + '.join(parts)}; "
        f"every {flip_interval:g} s a random PF link or RDMA port flips, so healthy counts drift down "
        f"and back; latency = injected link change -> kubelet emulator holding the update, inside this "
        f"process (2 ms coalescing window included), not the README's cross-process benchmark figure"
    )


async def _flip_latency(
    emulator: KubeletEmulator,
    resource: str,
    before: int,
    t_flip: float,
    ids: Sequence[str],
    timeout: float = 2.0,
) -> float | None:
    """Return the time from ``t_flip`` to the kubelet holding ``ids`` Unhealthy; None on timeout.

    Only an update received at or after the flip that shows the PF's VFs unhealthy answers it: with
    the kubelet's per-update work on, an update received just before the flip (the same pool's
    hold-down recovery) is appended after it, and taking the newest update would time that one.
    """
    answer: list[float] = []

    def arrived() -> bool:
        for update in emulator.updates(resource)[before:]:
            listed = [update.devices[i] for i in ids if i in update.devices]
            if update.received >= t_flip and listed and HEALTHY not in listed:
                answer.append(update.received - t_flip)
                return True
        return False

    try:
        await emulator.wait_for(arrived, timeout)
    except TimeoutError:
        return None
    return answer[0]


def _advertised_healthy(emulator: KubeletEmulator, resource: str, ids: Sequence[str]) -> bool:
    """Return whether the kubelet currently holds every one of ``ids`` as Healthy."""
    devices = emulator.devices(resource) or {}
    return all(devices.get(i) == HEALTHY for i in ids if i in devices)


def _pool_of_pf(daemon: Daemon, layout: simnode.NodeLayout) -> dict[str, str]:
    """Map each simulated PF address to the pool that holds its VFs (for latency measurement)."""
    owner: dict[str, str] = {}
    for name, runtime in daemon.pools.items():
        for m in runtime.pool.members:
            if m.device.pf and m.device.pf not in owner:
                owner[m.device.pf] = name
    return {pf.address: owner[pf.address] for pf in layout.pfs if pf.address in owner}


async def _allocate_one(emulator: KubeletEmulator, rng: random.Random) -> tuple[int, int]:
    """Ask for one healthy device of a random pool, as the kubelet does at pod admission.

    Returns (allocated, refused).  The kubelet picks from the last list it received; a device the
    daemon has marked Unhealthy since (its update still on the way) is refused with
    FAILED_PRECONDITION, as a real kubelet would see it, and counted rather than treated as an error.
    """
    resources = sorted(emulator.resources())
    if not resources:
        return 0, 0
    res = rng.choice(resources)
    healthy = [i for i, h in (emulator.devices(res) or {}).items() if h == HEALTHY]
    if not healthy:
        return 0, 0
    try:
        await emulator.allocate(res, [rng.choice(healthy)])
    except grpc.aio.AioRpcError as exc:
        if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
            raise
        return 0, 1
    return 1, 0
