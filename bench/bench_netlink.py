"""Benchmark decoding an rtnetlink link dump of N links: extension vs twin vs pyroute2, same run.

The dump is built from a real ``RTM_NEWLINK`` message captured from a veth (``tests/data/netlink/``,
with every attribute the kernel sends: stats, af_spec, linkinfo...), replicated with distinct ifindex
and name, and packed into ~32 KiB datagrams ending in ``NLMSG_DONE`` as a kernel dump arrives.
pyroute2 decodes the same bytes (``MarshalRtnl``) and its fields are extracted into the same tuples; the
script checks all three agree before timing.

``--live`` (root) adds the event path on real links: 64 veth "PF netdevs" in a private network
namespace, a ``HealthTracker`` over their 16,384 VFs in 16 pools of 1,024, the ``LinkMonitor`` and a
``Coalescer`` (2 ms window).  Each flip sets one PF admin-down with an ``RTM_NEWLINK`` request from a
second netlink socket and times, from just before that send, (a) the monitor's callback and (b) the
collect that returns the pool update with that PF's 256 VFs Unhealthy (window included): p50/p99.

    PYTHONPATH=src python bench/bench_netlink.py [--quick] [--json] [--links N] [--live [--flips N]]
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import math
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import _impl

from densedev import accel
from densedev.health.coalesce import Coalescer
from densedev.health.tracker import HealthTracker
from densedev.model import Device, HealthPolicy, Pool, PoolConfig, PoolMember, Role
from densedev.node.events import NETLINK_ROUTE, LinkMonitor, link_states, open_netlink_socket, resolve_netns
from densedev.testing.reference import pyroute2_links

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "data" / "netlink" / "dump_veth.hex"
DATAGRAM = 32 * 1024  # netlink_dump() fills skbs of up to 32 KiB for a large enough receive buffer


def template() -> tuple[bytes, int]:
    """Return the captured RTM_NEWLINK of the 6-character veth ``ens0f0`` and its name's offset."""
    data = bytes.fromhex(GOLDEN.read_text().split()[0])
    pos = 0
    while pos + 16 <= len(data):
        length, mtype = struct.unpack_from("=IH", data, pos)
        msg = data[pos : pos + length]
        if mtype == 16:
            at = 32
            while at + 4 <= length:
                rta_len, rta_type = struct.unpack_from("=HH", msg, at)
                if rta_type == 3 and msg[at + 4 : rta_len + at] == b"ens0f0\0":
                    return msg, at + 4
                at += (rta_len + 3) & ~3
        pos += (length + 3) & ~3
    raise SystemExit(f"{GOLDEN}: no RTM_NEWLINK for ens0f0 to use as a template")


def build_dump(count: int) -> list[bytes]:
    """Return ``count`` link messages packed into kernel-sized datagrams, the last ending in NLMSG_DONE."""
    msg, name_at = template()
    datagrams: list[bytes] = []
    current = bytearray()
    for i in range(count):
        m = bytearray(msg)
        struct.pack_into("=i", m, 20, 1000 + i)  # ifinfomsg.ifi_index
        m[name_at : name_at + 6] = f"e{i:05d}".encode()  # same length as "ens0f0": offsets stay valid
        if len(current) + len(m) > DATAGRAM:
            datagrams.append(bytes(current))
            current = bytearray()
        current += m
    current += struct.pack("=IHHIIi", 20, 3, 2, 1, 0, 0)  # NLMSG_DONE, NLM_F_MULTI
    datagrams.append(bytes(current))
    return datagrams


def pyroute2_decode(datagrams: list[bytes]) -> list[tuple[int, int, str, int, int, int, int]]:
    """Decode with pyroute2 (one marshal for every datagram) and extract parse_links' fields."""
    from pyroute2.netlink.rtnl.marshal import MarshalRtnl

    marshal = MarshalRtnl()
    return [row for data in datagrams for row in pyroute2_links(data, marshal)]


def decode_with(mod: ModuleType, datagrams: list[bytes]) -> list[tuple[int, int, str, int, int, int, int]]:
    """Decode every datagram with one implementation."""
    out: list[tuple[int, int, str, int, int, int, int]] = []
    for data in datagrams:
        out.extend(mod.parse_links(data))
    return out


def live_devices(pfs: int, vfs: int) -> list[Device]:
    """PF records with netdev ens<p>f0 and their VFs (no host netdev), as discovery reports them."""
    out: list[Device] = []
    for p in range(pfs):
        pf = f"0000:{0x18 + p:02x}:00.0"
        out.append(
            Device(
                pf, Role.PF, "8086", "1592", "020000", "8086", "0000", "ice", 0, -1, False, -1, vfs, vfs, "",
                -1, "", (f"ens{p}f0",), "ether", "", (), "", "", "", "pci0000:00", "",
            )
        )  # fmt: skip
        for k in range(vfs):
            out.append(
                Device(
                    f"0000:{0x18 + p:02x}:{1 + (k >> 3):02x}.{k & 7}", Role.VF, "8086", "1889", "020000",
                    "8086", "0000", "iavf", 0, -1, False, -1, 0, 0, pf, k, f"ens{p}f0", (), "", "", (), "",
                    "", "", "pci0000:00", "",
                )
            )  # fmt: skip
    return out


def run_live(pfs: int, vfs: int, flips: int, window: float) -> dict[str, object]:
    """Flip real veth links in a private namespace and time monitor → tracker → coalesced update."""
    ns = f"densedev-bench-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        script = "".join(
            f"link add ens{p}f0 type veth peer name ens{p}f0p\nlink set ens{p}f0p up\nlink set ens{p}f0 up\n"
            for p in range(pfs)
        )
        subprocess.run(["ip", "-n", ns, "-batch", "-"], input=script, text=True, check=True)
        devices = live_devices(pfs, vfs)
        vf_list = [d for d in devices if d.role == Role.VF]
        npools = min(16, pfs)  # 16 pools of 1,024 at full size; whole PFs per pool either way
        per_pool = len(vf_list) // npools
        # Hold-down 0 so a PF can be flipped again as soon as it is reported healthy.
        policy = HealthPolicy(hold_down_s=0.0)
        pools = [
            Pool(
                PoolConfig(f"pool{k}", "intel.com", health=policy),
                tuple(PoolMember(d.id, d) for d in vf_list[k * per_pool : (k + 1) * per_pool]),
            )
            for k in range(npools)
        ]
        pool_of_pf = {p: (p * vfs) // per_pool for p in range(pfs)}
        out = uvloop.run(_live_flips(ns, devices, pools, pool_of_pf, pfs, vfs, flips, window))
        out["implementation"] = accel.IMPLEMENTATION
        return out
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)


async def _live_flips(
    ns: str,
    devices: list[Device],
    pools: list[Pool],
    pool_of_pf: dict[int, int],
    pfs: int,
    vfs: int,
    flips: int,
    window: float,
) -> dict[str, object]:
    loop = asyncio.get_running_loop()
    tracker = HealthTracker(devices, pools)
    tracker.collect()
    ifindex: dict[str, int] = {}
    seen: dict[str, float] = {}
    updates: dict[str, tuple[float, int]] = {}  # pool name -> (when, members unhealthy)
    changed = asyncio.Event()

    def flush() -> None:
        now = time.perf_counter()
        for name, upd in tracker.collect().items():
            updates[name] = (now, upd.healthy.count(False))
        changed.set()
        deadline = tracker.next_deadline()
        if deadline is not None:
            loop.call_later(max(0.0, deadline - time.monotonic()), flush)

    coalescer = Coalescer(flush, window=window)

    def on_links(batch: tuple[tuple[int, int, str, int, int, int, int], ...]) -> None:
        now = time.perf_counter()
        for row in batch:
            ifindex[row[2]] = row[1]
            seen.setdefault(row[2], now)
        states, gone = link_states(batch)
        tracker.set_links(states)
        tracker.drop_links(gone)
        coalescer.notify()

    monitor = LinkMonitor(on_links, lambda: print("netlink overrun", file=sys.stderr), netns=ns)
    await monitor.start()
    ctl = open_netlink_socket(NETLINK_ROUTE, 0, resolve_netns(ns))

    async def wait_for(cond: Callable[[], bool]) -> None:
        while not cond():
            changed.clear()
            await asyncio.wait_for(changed.wait(), 30)

    def set_link(name: str, up: bool) -> None:
        # RTM_NEWLINK with ifi_change=IFF_UP: what `ip link set <if> up/down` sends.
        body = struct.pack("=BBHiII", 0, 0, 0, ifindex[name], 1 if up else 0, 1)
        ctl.send(struct.pack("=IHHII", 16 + len(body), 16, 1, 0, 0) + body)

    try:
        await wait_for(lambda: all(f"ens{p}f0" in ifindex for p in range(pfs)))
        await asyncio.sleep(0.2)
        callback: list[float] = []
        update: list[float] = []
        for i in range(flips):
            p = i % pfs
            name, idx = f"ens{p}f0", pools[pool_of_pf[p]].config.full_name
            # Earlier flips in this pool must have recovered (linkwatch may delay carrier-up by ~1 s).
            await wait_for(lambda idx=idx: updates.get(idx, (0.0, 0))[1] == 0)  # type: ignore[misc]
            seen.pop(name, None)
            updates.pop(idx, None)
            t0 = time.perf_counter()
            set_link(name, False)
            await wait_for(lambda idx=idx: updates.get(idx, (0.0, 0))[1] >= vfs)  # type: ignore[misc]
            callback.append(seen[name] - t0)
            update.append(updates[idx][0] - t0)
            set_link(name, True)
        return {"callback_s": callback, "update_s": update}
    finally:
        monitor.stop()
        coalescer.cancel()
        ctl.close()


def percentile(samples: list[float], q: float) -> float:
    """Return the nearest-rank percentile ``q`` (0..100) of ``samples``."""
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def main() -> int:
    """Run the benchmark and print figures (or JSON)."""
    parser = _impl.arguments(__file__, __doc__, "fewer links and repetitions (a smoke run)")
    parser.add_argument(
        "--links", type=int, default=None, help="links in the dump (default 16384; quick 1024)"
    )
    parser.add_argument("--live", action="store_true", help="also time PF flips on real veth links (root)")
    parser.add_argument("--flips", type=int, default=None, help="live flips (default 100; quick 20)")
    parser.add_argument("--window-ms", type=float, default=2.0, help="coalescing window for --live")
    args = parser.parse_args()
    count = args.links or (1024 if args.quick else 16384)
    rounds = 3 if args.quick else 9

    from densedev import _fast_py as twin

    datagrams = build_dump(count)
    impls: dict[str, ModuleType] = {"python": twin}
    with contextlib.suppress(ImportError):  # a missing build: report the twin alone
        impls["cython"] = importlib.import_module("densedev._fast")
    reference = pyroute2_decode(datagrams)
    assert len(reference) == count
    for name, mod in impls.items():
        assert decode_with(mod, datagrams) == reference, f"{name} disagrees with pyroute2"

    results: dict[str, object] = {
        "links": count,
        "datagrams": len(datagrams),
        "bytes": sum(map(len, datagrams)),
        "message_bytes": len(template()[0]),
    }
    for name, mod in impls.items():
        results[f"{name}_s"] = _impl.timed(lambda mod=mod: decode_with(mod, datagrams), rounds)  # type: ignore[misc]
    results["pyroute2_s"] = _impl.timed(lambda: pyroute2_decode(datagrams), max(1, rounds // 3))
    if args.live:
        pfs, vfs = (8, 256) if args.quick else (64, 256)
        live = run_live(pfs, vfs, args.flips or (20 if args.quick else 100), args.window_ms / 1e3)
        cb, up = live["callback_s"], live["update_s"]
        assert isinstance(cb, list) and isinstance(up, list)
        results["live"] = {
            "pfs": pfs,
            "vfs_per_pf": vfs,
            "flips": len(up),
            "window_ms": args.window_ms,
            "implementation": live["implementation"],
            "callback_p50_s": percentile(cb, 50),
            "callback_p99_s": percentile(cb, 99),
            "update_p50_s": percentile(up, 50),
            "update_p99_s": percentile(up, 99),
        }

    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(
        f"netlink bench: dump of {count} links ({results['message_bytes']} bytes each, "
        f"{results['datagrams']} datagrams, {int(results['bytes']) / 1e6:.1f} MB)"  # type: ignore[call-overload]
    )
    for name in (*impls, "pyroute2"):
        secs = float(results[f"{name}_s"])  # type: ignore[arg-type]
        print(f"  {name:<9} {secs * 1e3:9.2f} ms   {secs / count * 1e6:7.2f} µs/link")
    py, pr = float(results["python_s"]), float(results["pyroute2_s"])  # type: ignore[arg-type]
    if "cython_s" in results:
        cy = float(results["cython_s"])  # type: ignore[arg-type]
        print(
            f"  python/cython = {py / cy:.1f}x   pyroute2/cython = {pr / cy:.0f}x   "
            f"pyroute2/python = {pr / py:.0f}x"
        )
    else:
        print(f"  pyroute2/python = {pr / py:.0f}x (extension not built)")
    lv = results.get("live")
    if isinstance(lv, dict):
        print(
            f"live: {lv['pfs']} veth PFs x {lv['vfs_per_pf']} VFs, {lv['flips']} PF-down flips, "
            f"window {lv['window_ms']} ms, accel={lv['implementation']}"
        )
        cb50, cb99 = lv["callback_p50_s"] * 1e3, lv["callback_p99_s"] * 1e3
        up50, up99 = lv["update_p50_s"] * 1e3, lv["update_p99_s"] * 1e3
        print(f"  request -> monitor callback                p50 {cb50:7.3f} ms   p99 {cb99:7.3f} ms")
        print(
            f"  request -> pool update, {lv['vfs_per_pf']} VFs Unhealthy   p50 {up50:7.3f} ms   "
            f"p99 {up99:7.3f} ms   (target p99 <= 10 ms)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
