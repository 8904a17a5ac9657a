"""A fleet of densedev daemons against one API server: what N nodes cost it, scenario by scenario.

Each node is a real ``densedev run`` process with its own simulated node (sysfs tree), its PF netdevs
real veth links in a network namespace of its own (netlink drives health as on a node), its own DRA
kubelet emulator (in this process), and every pool on DRA; all of them publish to one API-server stand-in
(``densedev.testing.apiserver``, its own process, schema checks off), which counts each request by node
(the daemons' User-Agent ``densedev/<v> node/<name>``), verb and resource, with bytes and its own CPU.
This process watches every slice too, to time when a change reached the API.  Scenarios, in order:

  1. cold start: every daemon started at once → every node's devices all published at the API: the
     time, and requests and bytes per node;
  2. idle: nothing changes for ``--idle`` s: requests per node per minute (target: 0 writes);
  3. flap storm: every node takes one PF down each second (the one before comes back up) for
     ``--storm`` s: slice writes per node per minute, PF down → its VFs gone from the node's slices at
     the API (p50/p99, as seen by a watch), the stand-in's CPU (share of a core, per request);
  4. API-server restart: every watch closed, requests refused for 2 s, then served with a newer
     resourceVersion and an empty watch cache: LISTs, WATCHes and writes per node in the next
     ``--window`` s, how the re-lists spread in time, and nodes stuck (no watch again);
  5. 429 under a storm: the stand-in answers half of all requests 429 with ``Retry-After: 1`` for half
     the storm: 429s per node, writes, and the time from the throttle's end until every node's slices
     hold what its links say (all PFs up again at the end): nothing lost, converged.

Figures are printed, never asserted.  Needs root (network namespaces).

    PYTHONPATH=src python bench/bench_fleet.py [--quick] [--json] [--nodes 32 --vfs-per-node 1024]
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _impl
import uvloop

from densedev import accel
from densedev.dra import names
from densedev.dra.apiclient import ApiError, ResourceClient
from densedev.testing import netns, simnode
from densedev.testing.dra_kubelet import DraKubelet
from densedev.testing.netns import LinkSwitch

DRIVER = names.DEFAULT_DRIVER_NAME
RESTART_REFUSE_S = 2.0
WRITES = ("CREATE", "UPDATE", "DELETE", "DELETECOLLECTION")


class StandIn:
    """The API-server stand-in as its own process, and its ``/_standin/`` controls."""

    def __init__(self, nodes: list[str]) -> None:
        argv = [sys.executable, "-m", "densedev.testing.apiserver", "--no-validate"]
        for n in nodes:
            argv += ["--node", n]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=_impl.daemon_env())
        assert self.proc.stdout is not None
        self.url = self.proc.stdout.readline().strip()
        if not self.url.startswith("http://"):
            self.proc.kill()
            raise SystemExit(f"stand-in did not start: {self.url!r}")

    def control(self, what: str, **query: float) -> Any:
        """POST a control (``restart``, ``throttle``, ``slow``, ``reset``) or GET ``stats``."""
        q = "&".join(f"{k}={v}" for k, v in query.items())
        method = "GET" if what == "stats" else "POST"
        req = urllib.request.Request(f"{self.url}/_standin/{what}?{q}", method=method, data=None)
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read())

    async def acontrol(self, what: str, **query: float) -> Any:
        """``control`` in a worker thread (the stats of a storm are megabytes of JSON)."""
        return await asyncio.to_thread(self.control, what, **query)

    def stop(self) -> None:
        """Terminate the stand-in."""
        self.proc.terminate()
        self.proc.wait(10)


class Watcher:
    """This process's own watch of every slice: per node, the PCI addresses published and when."""

    def __init__(self, url: str) -> None:
        self.client = ResourceClient.for_url(url)
        self.devices: dict[str, dict[str, set[str]]] = {}  # node → slice → PCI addresses
        self.changed = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        # node → [(PCI addresses that must go, when they were told to)], checked as the node's events
        # arrive (one check per event of that node, not a waiter per flip woken by every event)
        self.pending: dict[str, list[tuple[set[str], float]]] = {}
        self.latencies: list[float] = []

    def count(self, node: str) -> int:
        """Devices published for ``node`` now."""
        return sum(len(v) for v in self.devices.get(node, {}).values())

    def holds(self, node: str, addresses: set[str]) -> bool:
        """Whether any of ``addresses`` is published for ``node``."""
        return any(addresses & v for v in self.devices.get(node, {}).values())

    def _fold(self, kind: str, obj: dict[str, Any]) -> None:
        spec = obj.get("spec") or {}
        node, name = str(spec.get("nodeName", "")), obj["metadata"]["name"]
        slices = self.devices.setdefault(node, {})
        if kind == "DELETED":
            slices.pop(name, None)
        else:
            slices[name] = {names.pci_address(d["name"]) or d["name"] for d in spec.get("devices") or ()}
        waiting = self.pending.get(node)
        if waiting:
            now = time.monotonic()
            still = [(a, t0) for a, t0 in waiting if self.holds(node, a)]
            self.latencies += [now - t0 for a, t0 in waiting if (a, t0) not in still]
            self.pending[node] = still
        self.changed.set()

    async def run(self) -> None:
        """List and watch every densedev slice, again after any loss (the bench's own, not measured)."""
        selector = f"spec.driver={DRIVER}"
        while True:
            try:
                if self.client.version is None:
                    await self.client.discover()
                items, rv = await self.client.list_slices(selector)
                self.devices = {}
                for s in items:
                    self._fold("ADDED", s)
                async for kind, obj in self.client.watch_slices(selector, rv, 3600):
                    if kind != "BOOKMARK":
                        self._fold(kind, obj)
            except asyncio.CancelledError:
                raise
            except ApiError:
                await asyncio.sleep(0.2)

    async def until(self, cond: Any, limit: float) -> float | None:
        """Wait until ``cond()`` holds (checked at every event); return the monotonic time, or None."""
        end = time.monotonic() + limit
        while not cond():
            self.changed.clear()
            left = end - time.monotonic()
            if left <= 0:
                return None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), left)
        return time.monotonic()


class Node:
    """One simulated node: its sysfs tree, namespace with veth PFs, kubelet emulator and daemon."""

    def __init__(self, name: str, work: Path, ns: str, vfs: int, url: str) -> None:
        self.name = name
        per_pf = min(256, max(1, vfs // 4))
        self.layout = simnode.build_node(work / "sys", pfs=max(1, vfs // per_pf), vfs_per_pf=per_pf)
        self.ns = ns
        _impl.veth_pfs(ns, [pf.netdev for pf in self.layout.pfs])
        self.vfs = {pf.netdev: set(pf.vf_addresses) for pf in self.layout.pfs}
        self.devices = sum(len(v) for v in self.vfs.values())
        self.work = work
        self.short = Path(tempfile.mkdtemp(prefix="bf-", dir="/tmp"))  # sun_path holds 107 bytes
        (self.short / "dp").mkdir()
        (work / "config.json").write_text(
            json.dumps({"resourceList": [{"resourceName": "vfs", "api": "dra"}]})
        )
        (work / "kubeconfig").write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "standin", "cluster": {"server": url}}],
                    "users": [{"name": "node", "user": {"token": "fleet"}}],
                    "contexts": [{"name": "c", "context": {"cluster": "standin", "user": "node"}}],
                    "current-context": "c",
                }
            )
        )
        self.kubelet = DraKubelet(self.short / "registry")
        self.proc: subprocess.Popen[bytes] | None = None
        self.switch: LinkSwitch | None = None

    def argv(self) -> list[str]:
        """``densedev run`` for this node, every pool on DRA, errors-only logging."""
        w, s = self.work, self.short
        return [
            *_impl.daemon_argv(w / "config.json", w / "sys", s / "dp", w / "dev", self.ns),
            *("--node-name", self.name, "--kubeconfig", str(w / "kubeconfig")),
            *("--kubelet-plugins-dir", str(s / "plugins"), "--kubelet-registry-dir", str(s / "registry")),
            *("--pod-resources-socket", "", "--cdi-dir", str(w / "cdi")),
        ]

    def start(self, pycache: Path) -> None:
        """Start the daemon process."""
        self.proc = subprocess.Popen(self.argv(), env=_impl.daemon_env(pycache))

    def stop(self) -> None:
        """SIGTERM the daemon (and wait); close the link switch."""
        if self.switch is not None:
            self.switch.close()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.short, ignore_errors=True)


# ------------------------------------------------------------------------------------------- figures
def per_node(
    stats: dict[str, Any], nodes: list[str], verbs: tuple[str, ...] | None = None, resource: str = ""
) -> list[int]:
    """Requests of each node (of ``verbs``, of ``resource`` or any) from stats, in ``nodes`` order."""
    counts: Counter[str] = Counter()
    for node, verb, res, _code, n in stats["requests"]:
        if (verbs is None or verb in verbs) and resource in ("", res):
            counts[node] += n
    return [counts[n] for n in nodes]


def summary(values: list[float]) -> dict[str, float]:
    """min / mean / max of per-node figures."""
    if not values:
        return {"min": 0, "mean": 0, "max": 0}
    return {
        "min": round(min(values), 2),
        "mean": round(sum(values) / len(values), 2),
        "max": round(max(values), 2),
    }


async def flap(fleet: list[Node], watcher: Watcher, seconds: float) -> tuple[list[float], int, float | None]:
    """Every node takes PF k mod P down at second k and the one before back up, then every PF up.

    Return the latencies PF down → that PF's VFs gone from the node's slices at the API (as this
    process's watch saw it), the downs never seen (the last second's can be overtaken by the final
    "all up": the publisher writes the newest state, not every state), and the seconds from the storm's
    end until every node's slices held every device again (None: not within 2 minutes)."""
    watcher.latencies = []
    start = time.monotonic()
    k = 0
    while time.monotonic() - start < seconds:
        for node in fleet:
            pfs = node.layout.pfs
            assert node.switch is not None
            down, back = pfs[k % len(pfs)], pfs[(k - 1) % len(pfs)]
            t0 = time.monotonic()
            if k and back is not down:
                node.switch.set(back.netdev, True)
            node.switch.set(down.netdev, False)
            if watcher.holds(node.name, node.vfs[down.netdev]):
                watcher.pending.setdefault(node.name, []).append((node.vfs[down.netdev], t0))
        k += 1
        await asyncio.sleep(max(0.0, start + k - time.monotonic()))
    ended = time.monotonic()
    for node in fleet:  # every PF up again: the fleet ends the storm whole
        assert node.switch is not None
        for pf in node.layout.pfs:
            node.switch.set(pf.netdev, True)
    # Converged: every node's slices hold every device again (each PF's last down seen or overtaken).
    done = await watcher.until(lambda: all(watcher.count(n.name) == n.devices for n in fleet), 120)
    unseen = sum(len(v) for v in watcher.pending.values())
    watcher.pending.clear()
    return list(watcher.latencies), unseen, (done - ended if done is not None else None)


async def measure(args: Any, work: Path) -> dict[str, Any]:
    names_ = [f"node-{i:03d}" for i in range(args.nodes)]
    srv = StandIn(names_)
    fleet: list[Node] = []
    out: dict[str, Any] = {
        "bench": "fleet",
        "implementation": accel.IMPLEMENTATION,
        "nodes": args.nodes,
        "vfs_per_node": args.vfs_per_node,
        "load_before": round(os.getloadavg()[0], 2),
    }
    watcher = Watcher(srv.url)
    pycache = Path(tempfile.gettempdir()) / "densedev-bench-pycache"
    stack = contextlib.ExitStack()
    try:
        for n in names_:
            ns = stack.enter_context(netns.namespace("dd-fleet"))
            fleet.append(Node(n, work / n, ns, args.vfs_per_node, srv.url))
        for node in fleet:
            await node.kubelet.start()
            node.switch = LinkSwitch(node.ns)
        watcher.task = asyncio.create_task(watcher.run())
        await watcher.until(lambda: watcher.client.version is not None, 10)
        total = fleet[0].devices

        # Bytecode compiled once, before the clock runs: an installed densedev has it from its install.
        warm = "import densedev.cli, densedev.daemon, densedev.dra.driver, kubernetes_asyncio.client"
        subprocess.run([sys.executable, "-c", warm], env=_impl.daemon_env(pycache), check=True)

        # 1. cold start
        await srv.acontrol("reset")
        t0 = time.monotonic()
        for node in fleet:
            node.start(pycache)
        done = await watcher.until(lambda: all(watcher.count(n) == total for n in names_), 300)
        cold_s = (done or time.monotonic()) - t0
        await asyncio.sleep(2.0)  # the daemons' catch-up rescan (a second after start) is start-up too
        st = await srv.acontrol("stats")
        out["cold"] = {
            "all_published_s": round(cold_s, 2),
            "published": done is not None,
            "requests_per_node": summary(per_node(st, names_)),
            "writes_per_node": summary(per_node(st, names_, WRITES)),
            "lists_per_node": summary(per_node(st, names_, ("LIST",), "resourceslices")),
            "kib_in_per_node": summary([st["bytes_in"].get(n, 0) / 1024 for n in names_]),
            "kib_out_per_node": summary([st["bytes_out"].get(n, 0) / 1024 for n in names_]),
            "standin_cpu_s": round(st["cpu_s"], 2),
        }

        # 2. idle
        await srv.acontrol("reset")
        cpu0 = st["cpu_s"]
        await asyncio.sleep(args.idle)
        st = await srv.acontrol("stats")
        per_min = 60.0 / args.idle
        out["idle"] = {
            "seconds": args.idle,
            "requests_per_node_min": summary([x * per_min for x in per_node(st, names_)]),
            "writes_per_node_min": summary([x * per_min for x in per_node(st, names_, WRITES)]),
            "standin_cpu_pct": round(100 * (st["cpu_s"] - cpu0) / args.idle, 2),
        }

        # 3. flap storm
        await srv.acontrol("reset")
        cpu0 = st["cpu_s"]
        t = time.monotonic()
        lat, unseen, settled = await flap(fleet, watcher, args.storm)
        storm_s = time.monotonic() - t
        st = await srv.acontrol("stats")
        reqs = sum(per_node(st, names_))
        cpu = st["cpu_s"] - cpu0
        out["storm"] = {
            "seconds": round(storm_s, 1),
            "flips_per_node": int(args.storm),
            "writes_per_node_min": summary([x * 60 / storm_s for x in per_node(st, names_, WRITES)]),
            "requests_per_node_min": summary([x * 60 / storm_s for x in per_node(st, names_)]),
            "pf_down_to_api_p50_ms": round(_impl.percentile(lat, 0.5) * 1e3, 1) if lat else None,
            "pf_down_to_api_p99_ms": round(_impl.percentile(lat, 0.99) * 1e3, 1) if lat else None,
            "pf_down_samples": len(lat),
            "pf_down_unseen": unseen,
            "converged_after_storm_s": round(settled, 2) if settled is not None else None,
            "standin_cpu_pct": round(100 * cpu / storm_s, 1),
            "standin_cpu_ms_per_request": round(1e3 * cpu / max(1, reqs), 3),
            "standin_cpu_ms_per_write": round(1e3 * cpu / max(1, sum(per_node(st, names_, WRITES))), 3),
        }

        # 4. API-server restart
        await asyncio.sleep(2.0)
        await srv.acontrol("reset")
        tr = time.monotonic()
        await srv.acontrol("restart", refuse_s=RESTART_REFUSE_S, rv_jump=100000)
        await asyncio.sleep(args.window)
        st = await srv.acontrol("stats")
        lists: dict[str, list[float]] = {n: [] for n in names_}
        back: dict[str, float] = {}
        for tt, node, verb, res, code, *_ in st["log"]:
            if node in lists and res == "resourceslices" and verb == "LIST" and code == 200:
                lists[node].append(tt - tr)
            if node in lists and verb == "WATCH" and code == 200 and tt > tr + RESTART_REFUSE_S:
                back.setdefault(node, tt - tr)
        firsts = [v[0] for v in lists.values() if v]
        out["restart"] = {
            "window_s": args.window,
            "refused_s": RESTART_REFUSE_S,
            "lists_per_node": summary([len(v) for v in lists.values()]),
            "writes_per_node": summary(per_node(st, names_, WRITES)),
            "watch_requests_per_node": summary(per_node(st, names_, ("WATCH",))),
            "relist_first_s": round(min(firsts), 2) if firsts else None,
            "relist_last_s": round(max(firsts), 2) if firsts else None,
            "relist_spread_s": round(max(firsts) - min(firsts), 2) if firsts else None,
            "watching_again_last_s": round(max(back.values()), 2) if back else None,
            "stuck_nodes": sum(1 for n in names_ if n not in back),
        }

        # 5. 429 with Retry-After under a storm
        await srv.acontrol("reset")
        throttle_s = args.storm / 2
        await srv.acontrol("throttle", seconds=throttle_s, retry_after=1, fraction=0.5)
        _, _, conv = await flap(fleet, watcher, args.storm)
        st = await srv.acontrol("stats")
        codes: Counter[str] = Counter()
        for node, _verb, _res, code, n in st["requests"]:
            if code == 429 and node in names_:
                codes[node] += n
        out["throttled"] = {
            "throttle_s": throttle_s,
            "answered_429_per_node": summary([codes[n] for n in names_]),
            "writes_per_node": summary(per_node(st, names_, WRITES)),
            "converged": conv is not None,
            "converged_after_storm_s": round(conv, 2) if conv is not None else None,
            "devices_published": sum(watcher.count(n) for n in names_),
            "devices_expected": total * len(names_),
        }
        out["daemons_alive"] = sum(1 for node in fleet if node.proc is not None and node.proc.poll() is None)
        out["load_after"] = round(os.getloadavg()[0], 2)
    finally:
        if watcher.task is not None:
            watcher.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher.task
        await watcher.client.close()
        await asyncio.to_thread(lambda: [node.stop() for node in fleet])
        for node in fleet:
            await node.kubelet.stop()
        srv.stop()
        stack.close()
    return out


def report(r: dict[str, Any]) -> Iterator[str]:
    """The figures as lines for a person."""
    c, i, s, rs, t = r["cold"], r["idle"], r["storm"], r["restart"], r["throttled"]
    yield (
        f"{r['nodes']} nodes x {r['vfs_per_node']} VFs ({r['implementation']}, load {r['load_before']} → "
        f"{r['load_after']}):"
    )
    yield (
        f"  cold start: all published in {c['all_published_s']} s; per node {c['requests_per_node']['mean']} "
        f"requests ({c['writes_per_node']['mean']} writes, {c['lists_per_node']['mean']} LISTs), "
        f"sent {c['kib_in_per_node']['mean']:.0f} KiB, received {c['kib_out_per_node']['mean']:.0f} KiB"
    )
    yield (
        f"  idle {i['seconds']} s: {i['requests_per_node_min']['mean']} requests/node/min "
        f"({i['writes_per_node_min']['max']} writes max); stand-in CPU {i['standin_cpu_pct']} %"
    )
    yield (
        f"  flap storm {s['seconds']} s: {s['writes_per_node_min']['mean']} writes/node/min "
        f"(max {s['writes_per_node_min']['max']}); PF down → API p50 {s['pf_down_to_api_p50_ms']} ms "
        f"p99 {s['pf_down_to_api_p99_ms']} ms ({s['pf_down_samples']}); stand-in CPU "
        f"{s['standin_cpu_pct']} % ({s['standin_cpu_ms_per_write']} ms/write)"
    )
    yield (
        f"  API-server restart: per node {rs['lists_per_node']['max']} LISTs max, "
        f"{rs['writes_per_node']['max']} writes max in {rs['window_s']} s; re-lists from "
        f"{rs['relist_first_s']} to {rs['relist_last_s']} s (spread {rs['relist_spread_s']} s); "
        f"{rs['stuck_nodes']} stuck"
    )
    yield (
        f"  429 (half the requests, Retry-After 1, {t['throttle_s']} s): "
        f"{t['answered_429_per_node']['mean']} 429s/node, converged {t['converged']} "
        f"{t['converged_after_storm_s']} s after the storm "
        f"({t['devices_published']}/{t['devices_expected']} devices)"
    )


def main() -> int:
    """Run the fleet and print its figures."""
    p = _impl.arguments(__file__, __doc__, "4 nodes x 256 VFs, 3 s idle, 5 s storms, 12 s restart window")
    p.add_argument("--nodes", type=int, default=32)
    p.add_argument("--vfs-per-node", type=int, default=1024)
    p.add_argument("--idle", type=float, default=60.0, help="seconds of the idle scenario")
    p.add_argument("--storm", type=float, default=60.0, help="seconds of each flap storm")
    p.add_argument("--window", type=float, default=30.0, help="seconds watched after the restart")
    p.add_argument("--dir", type=Path, default=None, help="where the simulated nodes go")
    args = p.parse_args()
    if args.quick:
        args.nodes, args.vfs_per_node, args.idle, args.storm, args.window = 4, 256, 3.0, 5.0, 12.0
    why = netns.available()
    if why is not None:
        print(f"bench_fleet: skipped: {why}", file=sys.stderr)
        return 0
    logging.disable(logging.WARNING)
    where = args.dir or _impl.tmpfs_dir(args.nodes * args.vfs_per_node * 64 << 10)
    with tempfile.TemporaryDirectory(prefix="bench-fleet-", dir=where) as tmp:
        r = uvloop.run(measure(args, Path(tmp)))
    if args.json:
        print(json.dumps(r))
    else:
        for line in report(r):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
