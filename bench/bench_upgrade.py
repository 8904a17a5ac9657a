"""Upgrade: a running ``densedev run`` replaced by a new process while the kubelet emulator admits pods.

Two ways, as a DaemonSet rolling update does them on one node (``--mode``, both by default):
  * ``sequential`` (``maxSurge: 0``): SIGTERM to the running daemon, wait for it to exit, start the new
    one (the same command, its own process, fork + exec);
  * ``overlap`` (``maxSurge: 1``, ``maxUnavailable: 0``): the new one starts first with
    ``--wait-for-lock`` beside the old one, scans and prepares, and once it says it waits for the lock
    (its pod would be Ready) the old one gets SIGTERM; the new one serves when the old one's lock is free.
Meanwhile the
kubelet emulator (densedev.testing.kubelet, strict: a device given to two running pods raises) admits a
pod asking one device every 10 ms and deletes it once admitted.  An admission fails while the kubelet
holds the resource's devices Unhealthy (the old stream ended) or knows no plugin for it; the figure is
the window from the first failed admission to the next successful one, p50/p99 over the upgrades.

Where the window goes, per upgrade (all CLOCK_MONOTONIC, shared with the daemon's processes):
  * ``stop_to_unhealthy``: SIGTERM until the old stream ended at the emulator (devices Unhealthy);
  * ``old_exit``: SIGTERM until the old process was reaped;
  * ``term_to_registered``: SIGTERM until the new process's Register reached the emulator;
  * ``start_to_registered`` (sequential): the new process's fork until its Register;
  * ``prepare`` (overlap, before the SIGTERM, outside the window): the fork until it waits for the lock;
  * ``registered_to_listed``: that Register until the full healthy list arrived;
  * ``unhealthy``: the emulator's own window, stream end until the full healthy list (what admissions
    see, without their 10 ms sampling).

The real kubelet adds its own time between the old container's exit and the new one's start (sandbox,
image, container create): not measured here.  Bounded: every wait has a timeout, and the run ends after
``--upgrades`` replacements.  As root with iproute2 the PFs' netdevs are real veth links in a private
network namespace and the daemon watches netlink there, as on a node; otherwise ``--no-netlink``.
``--admit-ms 0`` admits nothing (the emulator's window only, without this process's CPU beside the
daemons'); the output says how much CPU this process (the emulator) used.

    PYTHONPATH=src python bench/bench_upgrade.py [--quick] [--json] [--vfs 4096] [--upgrades 20]
        [--admit-ms 10] [--mode sequential|overlap|both]
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import _impl
import grpc
import uvloop

from densedev import accel
from densedev.testing import simnode
from densedev.testing.kubelet import HEALTHY, KubeletEmulator, KubeletError
from densedev.testing.netns import available, namespace

VFS_PER_PF = 256
RESOURCE = "intel.com/vfs"
WAIT_S = 60.0  # the longest any one step may take before the run is called failed
SETTLE_S = 0.3  # after an upgrade's full list, before the next one
MODES = ("sequential", "overlap")
STANDING_BY = "waiting for its lock"  # the stand-by's line once prepared (cli._start_after)


@dataclass
class Admissions:
    """Every admission attempt's time and outcome, in order."""

    attempts: list[tuple[float, bool]] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    pods: int = 0

    def windows(self, since: float, until: float) -> list[float]:
        """Seconds from each first failure to the next success, for failures in [since, until)."""
        out: list[float] = []
        failed_at: float | None = None
        for t, ok in self.attempts:
            if t < since:
                continue
            if not ok and failed_at is None and t < until:
                failed_at = t
            elif ok and failed_at is not None:
                out.append(t - failed_at)
                failed_at = None
        if failed_at is not None:
            out.append(float("inf"))  # never recovered within the run
        return out


async def admit_forever(emu: KubeletEmulator, record: Admissions, every: float) -> None:
    """Admit a one-device pod every ``every`` seconds (a fixed schedule, not after the last one ended)."""
    loop = asyncio.get_running_loop()
    next_at = loop.time()
    while True:
        record.pods += 1
        uid = f"pod-{record.pods}"
        ok = False
        try:
            await emu.create_pod(uid, {RESOURCE: 1}, uid=uid)
            ok = True
            emu.delete_pod(uid)
        except KubeletError as exc:
            key = str(exc).split(":")[0] if "no device plugin" not in str(exc) else "no device plugin"
            key = "0 free" if "free" in str(exc) else key
            record.errors[key] = record.errors.get(key, 0) + 1
        except grpc.aio.AioRpcError as exc:  # Allocate reached a plugin that was going away
            key = f"Allocate {exc.code().name}"
            record.errors[key] = record.errors.get(key, 0) + 1
        record.attempts.append((time.monotonic(), ok))
        next_at += every
        await asyncio.sleep(max(0.0, next_at - loop.time()))


def full_healthy(emu: KubeletEmulator, vfs: int) -> bool:
    """Whether the kubelet holds every device listed and Healthy."""
    devices = emu.devices(RESOURCE)
    return len(devices) == vfs and all(h == HEALTHY for h in devices.values())


Start = Callable[[bool], tuple[subprocess.Popen[bytes], Path]]


async def prepared(new: subprocess.Popen[bytes], log: Path) -> None:
    """Wait until the stand-by ``new`` says it has prepared and waits for the lock (its log file)."""
    deadline = time.monotonic() + WAIT_S
    while STANDING_BY not in log.read_text(errors="replace"):
        if new.poll() is not None:
            raise RuntimeError(f"the stand-by exited {new.returncode}: {log.read_text()[-500:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the stand-by did not prepare within {WAIT_S} s")
        await asyncio.sleep(0.01)


async def upgrade_once(
    emu: KubeletEmulator, old: subprocess.Popen[bytes], start: Start, vfs: int, mode: str
) -> tuple[subprocess.Popen[bytes], dict[str, float]]:
    """Replace ``old`` by a new daemon; return the new one and the pieces of this upgrade (seconds)."""
    registrations = emu.registrations(RESOURCE)
    updates = len(emu.updates(RESOURCE))
    new: subprocess.Popen[bytes] | None = None
    pieces: dict[str, float] = {}
    if mode == "overlap":
        t_spawn = time.monotonic()
        new, log = start(True)
        await prepared(new, log)
        pieces["prepare"] = time.monotonic() - t_spawn
        if emu.registrations(RESOURCE) != registrations:
            raise RuntimeError("the stand-by registered while the old daemon was serving")
    t_term = time.monotonic()
    old.send_signal(signal.SIGTERM)
    unhealthy_at: list[float] = []

    async def watch_unhealthy() -> None:
        await emu.wait_for(lambda: emu.stream_ended(RESOURCE), WAIT_S)
        unhealthy_at.append(time.monotonic())

    watcher = asyncio.create_task(watch_unhealthy())
    code = await asyncio.to_thread(old.wait, WAIT_S)
    t_exit = time.monotonic()
    if code != 0:
        raise RuntimeError(f"the old daemon exited {code}")
    if new is None:
        t_spawn = time.monotonic()
        new, _ = start(False)
    running = new
    await emu.wait_for(
        lambda: emu.registrations(RESOURCE) > registrations or running.poll() is not None, WAIT_S
    )
    t_registered = time.monotonic()
    if mode == "sequential":
        pieces["start_to_registered"] = t_registered - t_spawn
    await emu.wait_for(lambda: full_healthy(emu, vfs) or running.poll() is not None, WAIT_S)
    if new.poll() is not None:
        raise RuntimeError(f"the new daemon exited {new.returncode} before listing its devices")
    listed = next(u.received for u in emu.updates(RESOURCE)[updates:] if u.allocatable == vfs)
    await asyncio.wait_for(watcher, WAIT_S)
    return new, {
        "t_term": t_term,
        "t_listed": listed,
        "stop_to_unhealthy": unhealthy_at[0] - t_term,
        "old_exit": t_exit - t_term,
        "term_to_registered": t_registered - t_term,
        **pieces,
        "registered_to_listed": listed - t_registered,
        "unhealthy": listed - unhealthy_at[0],
    }


def ms(values: list[float]) -> dict[str, float]:
    """p50, p99 and max of ``values`` (seconds) in milliseconds."""
    return {
        "p50_ms": round(_impl.percentile(values, 0.5) * 1e3, 1),
        "p99_ms": round(_impl.percentile(values, 0.99) * 1e3, 1),
        "max_ms": round(max(values) * 1e3, 1),
    }


async def measure(
    work: Path, vfs: int, upgrades: int, admit_every: float, netns: str | None, modes: tuple[str, ...]
) -> dict[str, object]:
    """Every figure of one run: a node of ``vfs`` VFs, one pool, ``upgrades`` replacements per mode."""
    sysfs = work / "sys"
    layout = simnode.build_node(sysfs, pfs=vfs // VFS_PER_PF, vfs_per_pf=VFS_PER_PF, numa_nodes=2)
    config = work / "config.json"
    pool = {"resourceName": "vfs", "selectors": {"pfNames": [pf.netdev for pf in layout.pfs]}}
    config.write_text(json.dumps({"resourceList": [pool]}))
    if netns is not None:
        _impl.veth_pfs(netns, [pf.netdev for pf in layout.pfs])
    kubelet_dir = Path(tempfile.mkdtemp(prefix="dd-", dir="/tmp"))  # short: sun_path holds 107 bytes
    emu = KubeletEmulator(kubelet_dir, strict=True)
    await emu.start()
    cpu0 = os.times()
    argv = _impl.daemon_argv(config, sysfs, kubelet_dir, work / "dev", netns)
    env = _impl.daemon_env(work / "pycache")

    started = 0

    def start(wait: bool) -> tuple[subprocess.Popen[bytes], Path]:
        nonlocal started
        started += 1
        # Info lines to a file: the overlap mode reads the stand-by's "waiting for its lock" there.
        log = work / f"daemon-{started}.log"
        extra = ["--log-level", "info", *(["--wait-for-lock"] if wait else [])]
        with log.open("wb") as out:
            return subprocess.Popen([*argv, *extra], env=env, stderr=out), log

    record = Admissions()
    admitting: asyncio.Task[None] | None = None
    daemon, _ = start(False)
    pieces: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    try:
        await emu.wait_for(lambda: full_healthy(emu, vfs) or daemon.poll() is not None, WAIT_S)
        if daemon.poll() is not None:
            raise RuntimeError(f"densedev run exited {daemon.returncode} at its first start")
        if admit_every > 0:
            admitting = asyncio.create_task(admit_forever(emu, record, admit_every))
        await asyncio.sleep(SETTLE_S)
        for mode in modes:
            for _ in range(upgrades):
                daemon, p = await upgrade_once(emu, daemon, start, vfs, mode)
                pieces[mode].append(p)
                await asyncio.sleep(SETTLE_S)
    finally:
        if admitting is not None:
            admitting.cancel()
            await asyncio.gather(admitting, return_exceptions=True)
        if daemon.poll() is None:
            daemon.send_signal(signal.SIGTERM)
        await asyncio.to_thread(daemon.wait, WAIT_S)
        await emu.stop()
        shutil.rmtree(kubelet_dir, ignore_errors=True)
    cpu = os.times()
    by_mode: dict[str, object] = {}
    for mode, found_pieces in pieces.items():
        windows: list[float] = []
        for p in found_pieces:
            # One upgrade's failures begin after its SIGTERM; a window that straddles none counts as 0.
            found = record.windows(p["t_term"], p["t_listed"] + SETTLE_S)
            windows.append(max(found) if found else 0.0)
        names = [n for n in found_pieces[0] if not n.startswith("t_")]
        by_mode[mode] = {
            "failed_window": ms(windows) if admit_every > 0 else None,
            "failed_window_ms": [round(w * 1e3, 1) for w in windows],
            "pieces": {n: ms([p[n] for p in found_pieces]) for n in names},
            "median_ms": {n: round(statistics.median(p[n] for p in found_pieces) * 1e3, 1) for n in names},
        }
    return {
        "implementation": accel.IMPLEMENTATION,
        "netlink": "netns" if netns is not None else "off",
        "devices": vfs,
        "upgrades": upgrades,
        "admit_every_ms": admit_every * 1e3,
        # This process's CPU (the emulator admitting, checkpointing): it shares the machine with the daemons.
        "bench_cpu_s": round(cpu.user + cpu.system - cpu0.user - cpu0.system, 2),
        "admissions": len(record.attempts),
        "failed_admissions": sum(1 for _, ok in record.attempts if not ok),
        "errors": record.errors,
        "double_holdings": len(emu.double_holdings),
        "modes": by_mode,
    }


def main() -> int:
    p = _impl.arguments(__file__, __doc__, "1,024 VFs, 3 upgrades")
    p.add_argument("--vfs", type=int, default=4096, help="VFs on the node (a multiple of 256)")
    p.add_argument("--upgrades", type=int, default=20)
    p.add_argument(
        "--admit-ms",
        type=float,
        default=10.0,
        help="admit a pod every N ms (0: none, the emulator's window only)",
    )
    p.add_argument(
        "--mode",
        choices=(*MODES, "both"),
        default="both",
        help="sequential (maxSurge 0: stop, then start), overlap (maxSurge 1: --wait-for-lock), or both",
    )
    args = p.parse_args()
    if args.quick:
        args.vfs, args.upgrades = 1024, 3
    if args.vfs <= 0 or args.vfs % VFS_PER_PF or args.upgrades <= 0:
        p.error(f"--vfs must be a positive multiple of {VFS_PER_PF} and --upgrades positive")
    with ExitStack() as stack:
        # As root, the PFs' netdevs are real veth links in a private network namespace and the daemon
        # watches netlink there, as on a node; otherwise --no-netlink (said in the output).
        netns = stack.enter_context(namespace("densedev-u")) if available() is None else None
        work = stack.enter_context(_impl.scratch("densedev-upgrade-", _impl.tmpfs_dir(1 << 30)))
        modes = MODES if args.mode == "both" else (args.mode,)
        r = uvloop.run(measure(work, args.vfs, args.upgrades, args.admit_ms / 1e3, netns, modes))
    if args.json:
        print(json.dumps(r))
        return 0
    print(
        f"upgrade [{r['implementation']}, netlink {r['netlink']}] {r['devices']} VFs, 1 pool, "
        f"{r['upgrades']} upgrades per mode, a pod admitted every {r['admit_every_ms']:.0f} ms; "
        f"{r['failed_admissions']} of {r['admissions']} admissions failed {r['errors']}; "
        f"devices given twice: {r['double_holdings']}; this process used {r['bench_cpu_s']} s of CPU"
    )
    for mode, m in r["modes"].items():
        w = m["failed_window"] or {"p50_ms": "-", "p99_ms": "-", "max_ms": "-"}
        how = (
            "SIGTERM, exit, new start" if mode == "sequential" else "new start --wait-for-lock, then SIGTERM"
        )
        print(
            f"  {mode} ({how}): admissions fail for p50 {w['p50_ms']} ms, p99 {w['p99_ms']} ms "
            f"(max {w['max_ms']})"
        )
        for name, fig in m["pieces"].items():
            print(f"    {name:22s} p50 {fig['p50_ms']:7.1f} ms  p99 {fig['p99_ms']:7.1f} ms")
    return 1 if r["double_holdings"] else 0


if __name__ == "__main__":
    sys.exit(main())
