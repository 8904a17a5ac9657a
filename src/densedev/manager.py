"""The daemon: one device table, its pools, their health, one plugin server per pool, kept current.

Data flows one way: sysfs/netlink → device table (discovery) → pools (selectors) → health (health) →
wire (wire) → kubelet (server/registration).  This module owns the only mutable state and wires the
stages together; each stage stays ignorant of the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from . import accel, discovery, selectors
from . import config as config_mod
from .allocation import AllocationSettings, PoolAllocator
from .feed import PoolFeed
from .health import Coalescer, HealthTracker
from .model import Config, Device, Pool, PoolConfig
from .netlink import LinkMonitor, LinkTuple, UeventMonitor, UeventTuple, link_states
from .registration import PluginRunner
from .wire import ListEncoder

log = logging.getLogger("densedev.manager")


@dataclass(frozen=True)
class DaemonSettings:
    """Where the daemon reads and writes; every path is a parameter so tests and the demo relocate it."""

    sysfs_root: Path = Path("/sys")
    kubelet_dir: Path = Path("/var/lib/kubelet/device-plugins")
    dev_root: Path = Path("/dev")
    cdi_dir: Path | None = None
    devinfo_dir: Path | None = None
    resource_prefix: str = "intel.com"
    config_path: Path | None = None  # watched for changes when set
    metrics_addr: str | None = None
    netlink: bool = True  # watch rtnetlink links and kernel uevents
    config_poll_s: float = 1.0


def read_sysfs_links(sysfs_root: Path, ifnames: Iterable[str]) -> list[tuple[str, bool]]:
    """Read ``class/net/<if>/operstate`` for the named interfaces (simulated nodes carry no netlink).

    A real node's first netlink dump overrides these; on a simulated tree they are the only truth.
    Unreadable files are skipped: the interface may just have left the host namespace.
    """
    out: list[tuple[str, bool]] = []
    base = os.path.join(os.fspath(sysfs_root), "class", "net")
    for name in ifnames:
        try:
            with open(os.path.join(base, name, "operstate"), "rb") as f:
                state = f.read().strip()
        except OSError:
            continue
        out.append((name, state in (b"up", b"unknown")))
    return out


class PoolRuntime:
    """Everything that runs for one pool: its feed, encoder, allocator and kubelet-facing runner."""

    def __init__(self, pool: Pool, settings: DaemonSettings) -> None:
        self.pool = pool
        self.feed = PoolFeed()
        self.healthy: list[bool] = [True] * len(pool.members)
        self._index = {m.id: i for i, m in enumerate(pool.members)}
        self.encoder = self._new_encoder(pool)
        self.allocator = PoolAllocator(
            pool,
            AllocationSettings(
                cdi_dir=settings.cdi_dir, devinfo_dir=settings.devinfo_dir, dev_root=settings.dev_root
            ),
            self.is_healthy,
        )
        name = pool.config.full_name
        socket_name = "densedev-" + name.replace("/", "_") + ".sock"
        self.runner = PluginRunner(name, settings.kubelet_dir, socket_name, self.feed, self.allocator)

    @staticmethod
    def _new_encoder(pool: Pool) -> ListEncoder:
        numa = [-1 if pool.config.exclude_topology else m.device.numa_node for m in pool.members]
        return ListEncoder([m.id for m in pool.members], numa)

    @property
    def name(self) -> str:
        """Return the pool's extended resource name."""
        return self.pool.config.full_name

    def is_healthy(self, device_id: str) -> bool:
        """Return whether the ID is a member whose last advertised health is Healthy."""
        i = self._index.get(device_id)
        return i is not None and self.healthy[i]

    def publish(self, healthy: Sequence[bool], changed: Iterable[int] | None) -> None:
        """Encode the pool's list from the cache and hand it to the streams."""
        self.healthy = list(healthy)
        self.feed.publish(self.encoder.encode(self.healthy, changed))

    def replace(self, pool: Pool, healthy: Sequence[bool]) -> None:
        """Adopt a new membership (rescan or reload) and publish the whole list once."""
        self.pool = pool
        self._index = {m.id: i for i, m in enumerate(pool.members)}
        self.encoder = self._new_encoder(pool)
        self.allocator.update(pool)
        self.publish(healthy, None)


class Daemon:
    """Runs discovery, health and one plugin server per pool, and keeps them current."""

    def __init__(
        self,
        settings: DaemonSettings,
        config: Config,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.config = config
        self._clock = clock
        self.devices: tuple[Device, ...] = ()
        self.pools: dict[str, PoolRuntime] = {}
        self._order: list[str] = []  # pool names in config order (tracker indexes follow it)
        self.tracker: HealthTracker | None = None
        self._tasks: list[asyncio.Task[None]] = []
        # Coalescing: the first event of a burst arms one flush `coalesce_ms` later; later events in the
        # window ride along, so a PF taking 256 VFs down becomes one message per pool.
        self._coalescer = Coalescer(self.flush, config.coalesce_ms / 1e3)
        self._deadline_handle: asyncio.TimerHandle | None = None
        self._reload_requested = asyncio.Event()
        self._rescan_requested = asyncio.Event()
        self._link_monitor: object | None = None
        self._uevent_monitor: object | None = None
        self.stats = {
            "scans": 0,
            "flushes": 0,
            "events": 0,
            "reloads": 0,
            "reload_failures": 0,
            "overruns": 0,
        }

    # ----------------------------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Scan, build pools, serve and register every pool, then start the event sources."""
        table = self._scan()
        pools = selectors.build_pools(self.config, table.devices)
        self.devices = table.devices
        self.tracker = HealthTracker(self.devices, pools, clock=self._clock)
        self.tracker.set_links(read_sysfs_links(self.settings.sysfs_root, self._ifnames()))
        self._poll_rdma()
        initial = self.tracker.collect()
        for i, pool in enumerate(pools):
            runtime = PoolRuntime(pool, self.settings)
            upd = initial.get(i)
            runtime.publish(upd.healthy if upd is not None else [True] * len(pool.members), None)
            self.pools[pool.config.full_name] = runtime
            self._order.append(pool.config.full_name)
        await asyncio.gather(*(self._start_runner(r) for r in self.pools.values()))
        if self.settings.netlink:
            await self._start_netlink()
        self._tasks.append(asyncio.create_task(self._rdma_loop(), name="rdma-poll"))
        self._tasks.append(asyncio.create_task(self._rescan_loop(), name="rescan"))
        if self.settings.config_path is not None:
            self._tasks.append(asyncio.create_task(self._config_watch_loop(), name="config-watch"))
        self._tasks.append(asyncio.create_task(self._reload_loop(), name="reload"))
        log.info(
            "daemon started: %d devices, %d pools (%s), implementation=%s",
            len(self.devices),
            len(self.pools),
            ", ".join(f"{n}={len(r.pool.members)}" for n, r in self.pools.items()),
            accel.IMPLEMENTATION,
        )

    async def stop(self) -> None:
        """Stop event sources and servers, remove our sockets and files."""
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()
        self._coalescer.cancel()
        if self._deadline_handle is not None:
            self._deadline_handle.cancel()
        for mon in (self._link_monitor, self._uevent_monitor):
            if mon is not None:
                with contextlib.suppress(Exception):
                    mon.stop()  # type: ignore[attr-defined]
        await asyncio.gather(*(self._stop_runtime(r) for r in self.pools.values()))
        log.info("daemon stopped")

    async def _start_runner(self, runtime: PoolRuntime) -> None:
        # A failure in one pool (bad socket dir, refused name) must never take down another.
        try:
            await runtime.runner.start()
        except Exception:
            log.exception("pool %s failed to start", runtime.name)

    async def _stop_runtime(self, runtime: PoolRuntime) -> None:
        try:
            await runtime.runner.stop()
        except Exception:
            log.exception("pool %s failed to stop cleanly", runtime.name)
        with contextlib.suppress(Exception):
            runtime.allocator.close()

    def registered(self) -> tuple[bool, str]:
        """Return whether every pool is registered with the kubelet, and which are not."""
        missing = [n for n, r in self.pools.items() if not r.runner.registered]
        return (not missing, "not registered: " + ", ".join(missing) if missing else "all pools registered")

    # ----------------------------------------------------------------------------------- scanning
    def _scan(self) -> discovery.DeviceTable:
        t0 = time.perf_counter()
        table = discovery.scan(self.settings.sysfs_root)
        self.stats["scans"] += 1
        if table.warnings:
            log.warning(
                "scan skipped or degraded %d entries: %s", len(table.warnings), "; ".join(table.warnings[:5])
            )
        log.debug("scan: %d devices in %.1f ms", len(table.devices), (time.perf_counter() - t0) * 1e3)
        return table

    def _ifnames(self) -> set[str]:
        names: set[str] = set()
        for d in self.devices:
            names.update(d.netdevs)
            if d.pf_netdev:
                names.add(d.pf_netdev)
        return names

    def _ibdevs(self) -> list[str]:
        seen: dict[str, None] = {}
        for r in self.pools.values():
            for m in r.pool.members:
                if m.device.rdma_device:
                    seen[m.device.rdma_device] = None
        if not self.pools:  # before the runtimes exist, ask the table
            for d in self.devices:
                if d.rdma_device:
                    seen[d.rdma_device] = None
        return list(seen)

    def request_rescan(self) -> None:
        """Ask for a full rescan soon (uevent, overrun, or the reconcile interval)."""
        self._rescan_requested.set()

    async def _rescan_loop(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._rescan_requested.wait(), self.config.reconcile_s)
            # Events come in bursts (writing sriov_numvfs creates hundreds of VFs): let them settle.
            await asyncio.sleep(0.05)
            self._rescan_requested.clear()
            try:
                self.rescan()
            except Exception:
                log.exception("rescan failed; keeping the previous device table")

    def rescan(self) -> None:
        """Rescan the node and apply the new device table to every pool (grow, shrink, no restart)."""
        table = self._scan()
        self._apply(table.devices, self.config)
        assert self.tracker is not None
        self.tracker.set_links(read_sysfs_links(self.settings.sysfs_root, self._ifnames()))
        self._poll_rdma()
        self._coalescer.notify()

    def _apply(self, devices: tuple[Device, ...], config: Config) -> None:
        """Recompute pools from devices and config, and update pools whose membership changed."""
        pools = selectors.build_pools(config, devices)
        self.devices = devices
        assert self.tracker is not None
        self.tracker.replace(devices, pools)
        self._order = [p.config.full_name for p in pools]
        for pool in pools:
            runtime = self.pools.get(pool.config.full_name)
            if runtime is None:
                continue
            if runtime.pool.members != pool.members or runtime.pool.config != pool.config:
                runtime.replace(pool, self.tracker.pool_health(self._order.index(pool.config.full_name)))
                log.info("pool %s now has %d devices", runtime.name, len(pool.members))

    # ----------------------------------------------------------------------------------- health
    def on_links(self, links: tuple[LinkTuple, ...]) -> None:
        """Take parsed rtnetlink link messages (from the monitor, or injected by the demo)."""
        states, gone = link_states(links)
        if self.tracker is None or not (states or gone):
            return
        self.stats["events"] += len(states) + len(gone)
        self.tracker.set_links(states)
        # RTM_DELLINK: a VF netdev moved into a pod's namespace leaves the host's view; gone is not down.
        self.tracker.drop_links(gone)
        self._coalescer.notify()

    def set_links(self, states: Iterable[tuple[str, bool]]) -> None:
        """Take link states by interface name (the demo's and tests' way in)."""
        assert self.tracker is not None
        self.tracker.set_links(states)
        self._coalescer.notify()

    def on_overrun(self) -> None:
        """A netlink overrun lost events: resynchronise everything, never guess."""
        self.stats["overruns"] += 1
        log.warning("netlink overrun: full resync")
        if self._link_monitor is not None:
            with contextlib.suppress(Exception):
                self._link_monitor.resync()  # type: ignore[attr-defined]
        self.request_rescan()

    def on_uevent(self, event: UeventTuple) -> None:
        """A kernel uevent: PCI add/remove/bind/unbind/change and net moves trigger a rescan."""
        action, _devpath, env = event
        subsystem = dict(env).get("SUBSYSTEM", "")
        if subsystem in ("pci", "net", "infiniband", "auxiliary", "vdpa") and action in (
            "add",
            "remove",
            "bind",
            "unbind",
            "change",
            "move",
        ):
            self.stats["events"] += 1
            self.request_rescan()

    def _poll_rdma(self) -> None:
        ibdevs = self._ibdevs()
        if ibdevs and self.tracker is not None:
            ports = discovery.read_rdma_ports(self.settings.sysfs_root, ibdevs)
            self.tracker.set_rdma_ports((ib, port, state) for ib, port, state, _phys in ports)

    async def _rdma_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.rdma_poll_s)
            try:
                self._poll_rdma()
                self._coalescer.notify()
            except Exception:
                log.exception("RDMA port poll failed")

    def flush(self) -> None:
        """Send one message to every pool whose advertised health changed, and arm the hold-down timer."""
        if self.tracker is None:
            return
        updates = self.tracker.collect()
        self.stats["flushes"] += 1
        for idx, upd in updates.items():
            runtime = self.pools.get(self._order[idx]) if idx < len(self._order) else None
            if runtime is None:
                continue
            try:
                runtime.publish(upd.healthy, upd.changed)
            except Exception:
                log.exception("pool %s: publishing failed", runtime.name)
        deadline = self.tracker.next_deadline()
        if self._deadline_handle is not None:
            self._deadline_handle.cancel()
            self._deadline_handle = None
        if deadline is not None:
            loop = asyncio.get_running_loop()
            delay = max(0.0, deadline - self._clock())
            self._deadline_handle = loop.call_later(delay, self.flush)

    async def _start_netlink(self) -> None:
        try:
            links = LinkMonitor(self.on_links, self.on_overrun)
            await links.start()
            self._link_monitor = links
        except OSError as exc:
            log.error("cannot watch rtnetlink links (%s): link health comes from rescans only", exc)
        try:
            uevents = UeventMonitor(self.on_uevent, self.on_overrun)
            await uevents.start()
            self._uevent_monitor = uevents
        except OSError as exc:
            log.error("cannot watch kernel uevents (%s): devices change only on reconcile", exc)

    # ----------------------------------------------------------------------------------- reload
    def request_reload(self) -> None:
        """Reload the config file soon (SIGHUP or a change seen on disk)."""
        self._reload_requested.set()

    async def _config_watch_loop(self) -> None:
        # A ConfigMap mount updates by swapping the `..data` symlink, so watch the resolved target and its
        # stat, not just the path's mtime.
        path = self.settings.config_path
        assert path is not None
        last = _config_identity(path)
        while True:
            await asyncio.sleep(self.settings.config_poll_s)
            now = _config_identity(path)
            if now != last:
                last = now
                self.request_reload()

    async def _reload_loop(self) -> None:
        while True:
            await self._reload_requested.wait()
            self._reload_requested.clear()
            await self.reload()

    async def reload(self) -> bool:
        """Load the config file again and apply it: new pools start, removed stop, changed update in place."""
        path = self.settings.config_path
        if path is None:
            return False
        try:
            new = config_mod.load(path, default_prefix=self.settings.resource_prefix)
        except config_mod.ConfigError as exc:
            self.stats["reload_failures"] += 1
            for p in exc.problems:
                log.error("config reload refused, keeping the last good config: %s", p)
            return False
        except OSError as exc:
            self.stats["reload_failures"] += 1
            log.error("config reload refused, cannot read %s: %s", path, exc)
            return False
        await self.apply_config(new)
        return True

    async def apply_config(self, new: Config) -> None:
        """Diff pool definitions and apply them; untouched pools keep their streams and registration."""
        old_by_name = {p.full_name: p for p in self.config.pools}
        new_by_name = {p.full_name: p for p in new.pools}
        removed = [n for n in old_by_name if n not in new_by_name]
        added = [n for n in new_by_name if n not in old_by_name]
        # The kubelet reads options only at registration: a pool whose options change must re-register.
        reregister = [
            n
            for n in new_by_name
            if n in old_by_name and _options_of(old_by_name[n]) != _options_of(new_by_name[n])
        ]
        for n in removed + reregister:
            runtime = self.pools.pop(n)
            await self._stop_runtime(runtime)
        self.config = new
        self._apply(self.devices, new)
        assert self.tracker is not None
        started: list[PoolRuntime] = []
        for i, name in enumerate(self._order):
            if name in self.pools:
                continue
            pool = selectors.build_pools(new, self.devices)[i]
            runtime = PoolRuntime(pool, self.settings)
            runtime.publish(self.tracker.pool_health(i), None)
            self.pools[name] = runtime
            started.append(runtime)
        await asyncio.gather(*(self._start_runner(r) for r in started))
        self.stats["reloads"] += 1
        log.info(
            "config reloaded: %d added, %d removed, %d re-registered, %d pools",
            len(added),
            len(removed),
            len(reregister),
            len(self.pools),
        )


def _options_of(pool: PoolConfig) -> tuple[bool, bool]:
    return pool.prestart, pool.preferred != "none"


def _config_identity(path: Path) -> tuple[str, int, int, int] | None:
    try:
        real = os.path.realpath(path)
        st = os.stat(real)
    except OSError:
        return None
    return real, st.st_ino, st.st_mtime_ns, st.st_size
