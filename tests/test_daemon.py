"""The whole daemon end to end: simulated node → discovery → pools → health → gRPC → kubelet emulator.

Waits are bounded by generous guards that only turn a hang into a failure; nothing asserts speed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from densedev.daemon import Daemon, DaemonSettings
from densedev.model import HEALTHY, UNHEALTHY
from densedev.pools import config as config_mod
from densedev.testing import simnode
from densedev.testing.kubelet import KubeletEmulator

Run = Callable[[Coroutine[Any, Any, Any]], Any]
GUARD_S = 20.0
PREFIX = "example.com"


def pools_config(layout: simnode.NodeLayout, **top: object) -> dict[str, object]:
    """Pools of a typical SR-IOV node: one per PF for two PFs, one for every other VF, shared RDMA."""
    pfs = layout.pfs
    resources: list[dict[str, object]] = [
        {
            "resourceName": f"sriov_{pf.netdev}",
            "resourcePrefix": PREFIX,
            "selectors": {"pfNames": [pf.netdev]},
            "healthPolicy": {"holdDownSeconds": 0.2},
        }
        for pf in pfs[:2]
    ]
    resources.append(
        {
            "resourceName": "other_vfs",
            "resourcePrefix": PREFIX,
            "selectors": {"pfNames": [pf.netdev for pf in pfs[2:]]},
            "healthPolicy": {"holdDownSeconds": 0.2},
        }
    )
    resources.append(
        {
            "resourceName": "rdma_shared",
            "resourcePrefix": PREFIX,
            "deviceType": "accelerator",
            "rdmaShared": 4,
            "selectors": {"pciAddresses": [pf.address for pf in pfs], "isRdma": True},
            "healthPolicy": {"holdDownSeconds": 0.2},
        }
    )
    return {"resourceList": resources, "rdmaPollSeconds": 0.05, "coalesceMs": 2, **top}


class Node:
    """A simulated node, its config file and the paths a daemon on it uses."""

    def __init__(self, tmp: Path, pfs: int = 4, vfs_per_pf: int = 8) -> None:
        self.sysfs = tmp / "sys"
        self.layout = simnode.build_node(self.sysfs, pfs=pfs, vfs_per_pf=vfs_per_pf, rdma=True)
        self.config_path = tmp / "config.json"
        self.write_config(pools_config(self.layout))
        # A short dir like the kubelet's own: unix socket paths are limited to 107 bytes.
        self.kubelet_dir = Path(tempfile.mkdtemp(prefix="dd-", dir="/tmp"))
        self.tmp = tmp

    def write_config(self, doc: dict[str, object]) -> None:
        """Replace the config file atomically, as a ConfigMap update does."""
        tmp = self.config_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc))
        tmp.replace(self.config_path)

    def settings(self, **kw: Any) -> DaemonSettings:
        """Daemon settings pointing every path into the temp dir."""
        base: dict[str, Any] = dict(
            sysfs_root=self.sysfs,
            kubelet_dir=self.kubelet_dir,
            dev_root=self.tmp / "dev",
            cdi_dir=self.tmp / "cdi",
            devinfo_dir=self.tmp / "devinfo",
            resource_prefix=PREFIX,
            config_path=self.config_path,
            netlink=False,
            config_poll_s=0.05,
        )
        base.update(kw)
        return DaemonSettings(**base)

    def daemon(self, **kw: Any) -> Daemon:
        """A daemon on this node with its current config."""
        return Daemon(self.settings(**kw), config_mod.load(self.config_path, default_prefix=PREFIX))


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    n = Node(tmp_path)
    yield n
    shutil.rmtree(n.kubelet_dir, ignore_errors=True)


def res(name: str) -> str:
    return f"{PREFIX}/{name}"


async def started(node: Node, **kw: Any) -> tuple[KubeletEmulator, Daemon]:
    """Start the kubelet emulator and a daemon, and wait until every pool has sent its list."""
    emu = KubeletEmulator(node.kubelet_dir)
    await emu.start()
    daemon = node.daemon(**kw)
    await daemon.start()
    names = {p.full_name for p in daemon.config.pools}
    await emu.wait_for(lambda: names <= set(emu.resources()) and all(emu.updates(n) for n in names), GUARD_S)
    return emu, daemon


async def stopped(emu: KubeletEmulator, daemon: Daemon) -> None:
    await daemon.stop()
    await emu.stop()


@contextlib.asynccontextmanager
async def running(node: Node, **kw: Any) -> AsyncIterator[tuple[KubeletEmulator, Daemon]]:
    """A kubelet emulator and a started daemon on the node, both stopped afterwards."""
    emu, daemon = await started(node, **kw)
    try:
        yield emu, daemon
    finally:
        await stopped(emu, daemon)


def test_every_pool_registers_and_lists_every_device(run: Run, node: Node) -> None:
    async def main() -> None:
        async with running(node) as (emu, daemon):
            pfs = node.layout.pfs
            for pf in pfs[:2]:
                assert set(emu.devices(res(f"sriov_{pf.netdev}"))) == set(pf.vf_addresses)
            others = {a for pf in pfs[2:] for a in pf.vf_addresses}
            assert set(emu.devices(res("other_vfs"))) == others
            shared = emu.devices(res("rdma_shared"))
            assert set(shared) == {f"{pf.address}/{k}" for pf in pfs for k in range(4)}
            for r in emu.resources():
                assert set(emu.devices(r).values()) == {HEALTHY}
                assert emu.registrations(r) == 1
                assert emu.options(r) is not None and emu.options(r).get_preferred_allocation_available
            # Topology: every VF carries its PF's NUMA node.
            numa = emu.updates(res(f"sriov_{pfs[1].netdev}"))[-1].numa
            assert set(numa.values()) == {(pfs[1].numa_node,)}
            assert daemon.registered()[0]
        # Shutdown removes our sockets; the kubelet's own socket is not ours.
        assert not [p for p in node.kubelet_dir.iterdir() if p.name.startswith("densedev-")]

    run(main())


def test_rdma_port_flip_in_the_tree_reaches_the_kubelet_and_recovers(run: Run, node: Node) -> None:
    pf = node.layout.pfs[3]
    shared_ids = {f"{pf.address}/{k}" for k in range(4)}

    async def main() -> None:
        emu, daemon = await started(node)
        r = res("rdma_shared")
        try:
            simnode.set_rdma_port(node.sysfs, pf.ibdev, 1, 1)  # DOWN, as the HCA reports it
            await emu.wait_for(
                lambda: {i for i, h in emu.devices(r).items() if h == UNHEALTHY} == shared_ids, GUARD_S
            )
            assert daemon.tracker is not None and "rdma-port-down" in daemon.tracker.reasons(pf.address)
            simnode.set_rdma_port(node.sysfs, pf.ibdev, 1, 4)  # ACTIVE again: healthy after the hold-down
            await emu.wait_for(lambda: set(emu.devices(r).values()) == {HEALTHY}, GUARD_S)
            # Other pools never heard of it.
            assert len(emu.updates(res("other_vfs"))) == 1
        finally:
            await stopped(emu, daemon)

    run(main())


def test_pf_link_down_takes_its_vfs_in_one_message(run: Run, node: Node) -> None:
    pf = node.layout.pfs[0]
    r = res(f"sriov_{pf.netdev}")

    async def main() -> None:
        async with running(node) as (emu, daemon):
            before = len(emu.updates(r))
            daemon.set_links([(pf.netdev, False)])
            await emu.wait_for(lambda: set(emu.devices(r).values()) == {UNHEALTHY}, GUARD_S)
            assert len(emu.updates(r)) == before + 1  # the burst of 8 VFs is one message
            assert emu.allocatable(r) == 0 and emu.capacity(r) == len(pf.vf_addresses)
            daemon.set_links([(pf.netdev, True)])
            await emu.wait_for(lambda: set(emu.devices(r).values()) == {HEALTHY}, GUARD_S)
            assert len(emu.updates(res("other_vfs"))) == 1

    run(main())


def test_allocate_statuses(run: Run, node: Node) -> None:
    pf = node.layout.pfs[0]
    r = res(f"sriov_{pf.netdev}")
    other = node.layout.pfs[2].vf_addresses[0]

    async def status(emu: KubeletEmulator, ids: list[str]) -> tuple[grpc.StatusCode, str]:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await emu.allocate(r, ids, check=False)
        return err.value.code(), err.value.details() or ""

    async def main() -> None:
        async with running(node) as (emu, daemon):
            ok = await emu.allocate(r, list(pf.vf_addresses[:2]))
            env = dict(ok.envs)
            key = "PCIDEVICE_EXAMPLE_COM_SRIOV_" + pf.netdev.upper()
            assert env[key] == ",".join(pf.vf_addresses[:2])
            assert set(json.loads(env[key + "_INFO"])) == set(pf.vf_addresses[:2])
            code, text = await status(emu, ["0000:ff:1f.7"])
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "0000:ff:1f.7" in text
            code, text = await status(emu, [other])  # a device of another pool
            assert code == grpc.StatusCode.INVALID_ARGUMENT and other in text
            daemon.set_links([(pf.netdev, False)])
            await emu.wait_for(lambda: emu.allocatable(r) == 0, GUARD_S)
            code, text = await status(emu, [pf.vf_addresses[3]])
            assert code == grpc.StatusCode.FAILED_PRECONDITION and pf.vf_addresses[3] in text

    run(main())


def test_kubelet_restart_leads_to_reregistration_and_a_fresh_full_list(run: Run, node: Node) -> None:
    async def main() -> None:
        async with running(node) as (emu, daemon):
            names = [p.full_name for p in daemon.config.pools]
            await emu.restart()
            await emu.wait_for(
                lambda: all(emu.registrations(n) >= 1 and emu.updates(n) for n in names), GUARD_S
            )
            for n in names:
                assert len(emu.devices(n)) == len(daemon.pools[n].pool.members)
            await asyncio.sleep(0)  # the daemon's housekeeping counts re-registrations

    run(main())


def test_vfs_created_and_destroyed_grow_and_shrink_pools_live(run: Run, node: Node) -> None:
    pf = node.layout.pfs[1]
    r = res(f"sriov_{pf.netdev}")

    async def main() -> None:
        async with running(node) as (emu, daemon):
            simnode.set_num_vfs(node.sysfs, pf.address, 0)
            daemon.on_uevent(("change", f"/devices/pci0000:00/{pf.address}", (("SUBSYSTEM", "pci"),)))
            await emu.wait_for(lambda: emu.devices(r) == {}, GUARD_S)
            created = simnode.set_num_vfs(node.sysfs, pf.address, 6)
            daemon.on_uevent(("change", f"/devices/pci0000:00/{pf.address}", (("SUBSYSTEM", "pci"),)))
            await emu.wait_for(lambda: set(emu.devices(r)) == set(created), GUARD_S)
            assert emu.registrations(r) == 1  # grew and shrank without re-registering
            assert set(emu.devices(r).values()) == {HEALTHY}

    run(main())


def test_bad_resource_name_is_refused_with_a_clear_message(node: Node) -> None:
    doc = pools_config(node.layout)
    doc["resourceList"][0]["resourceName"] = "bad name!"  # type: ignore[index]
    node.write_config(doc)
    problems = config_mod.check(node.config_path, default_prefix=PREFIX)
    assert any("resourceList[0]" in p and "resourceName" in p for p in problems), problems


def test_cdi_specs_follow_the_pools(run: Run, node: Node) -> None:
    cdi_dir = node.tmp / "cdi"
    cdi_dir.mkdir()
    stale = cdi_dir / "densedev-example.com-gone_pool.json"
    stale.write_text("{}")
    foreign = cdi_dir / "vendor-other.json"  # not ours: never touched
    foreign.write_text("{}")

    async def main() -> None:
        async with running(node) as (emu, daemon):
            ours = sorted(p.name for p in cdi_dir.glob("densedev-*.json"))
            assert stale.name not in ours and foreign.exists()
            assert len(ours) == len(daemon.pools)
            spec = json.loads((cdi_dir / ours[0]).read_text())
            assert spec["kind"].startswith(PREFIX + "/") and spec["devices"]
            # Deleting a pool from the config takes its spec along.
            doc = pools_config(node.layout)
            removed = doc["resourceList"].pop(0)  # type: ignore[attr-defined]
            node.write_config(doc)
            await emu.wait_for(
                lambda: (
                    daemon.metrics.registry.get_sample_value(
                        "densedev_config_reloads_total", {"result": "success"}
                    )
                    == 1
                ),
                GUARD_S,
            )
            left = sorted(p.name for p in cdi_dir.glob("densedev-*.json"))
            assert len(left) == len(ours) - 1
            assert not any(removed["resourceName"] in name for name in left)
        # A restart (stop) keeps the specs: the kubelet restarts containers from its checkpoint.
        assert sorted(p.name for p in cdi_dir.glob("densedev-*.json")) == left

    run(main())


def test_restart_advertises_the_same_devices_including_vfs_moved_into_pods(run: Run, node: Node) -> None:
    pf = node.layout.pfs[0]
    moved = pf.vf_addresses[:3]
    r = res(f"sriov_{pf.netdev}")

    async def main() -> None:
        emu, daemon = await started(node)
        try:
            first = {n: dict(emu.devices(n)) for n in emu.resources()}
            for address in moved:  # the CNI moved these VFs' interfaces into pods
                simnode.move_netdev_to_pod(node.sysfs, address)
            await daemon.stop()
            daemon = node.daemon()
            await daemon.start()
            await emu.wait_for(lambda: all(emu.registrations(n) == 2 for n in first), GUARD_S)
            await emu.wait_for(lambda: all(len(emu.updates(n)) >= 2 for n in first), GUARD_S)
            assert {n: dict(emu.devices(n)) for n in first} == first
            # Gone from the host's view is not down: the moved VFs stay Healthy.
            assert all(emu.devices(r)[a] == HEALTHY for a in moved)
        finally:
            await stopped(emu, daemon)

    run(main())


def test_driver_rules_unbound_and_rebound(run: Run, node: Node) -> None:
    pf = node.layout.pfs[0]
    r = res(f"sriov_{pf.netdev}")
    unbound, rebound = pf.vf_addresses[0], pf.vf_addresses[1]

    def uevent(daemon: Daemon, action: str, address: str) -> None:
        daemon.on_uevent((action, f"/devices/pci0000:00/{address}", (("SUBSYSTEM", "pci"),)))

    async def main() -> None:
        async with running(node) as (emu, daemon):
            simnode.bind_driver(node.sysfs, unbound, None)
            uevent(daemon, "unbind", unbound)
            simnode.bind_driver(node.sysfs, rebound, "vfio-pci")
            uevent(daemon, "bind", rebound)
            await emu.wait_for(
                lambda: emu.devices(r).get(unbound) == UNHEALTHY and emu.devices(r).get(rebound) == UNHEALTHY,
                GUARD_S,
            )
            assert daemon.tracker is not None
            assert "driver-unbound" in daemon.tracker.reasons(unbound)
            assert "driver-changed" in daemon.tracker.reasons(rebound)
            assert len(emu.devices(r)) == len(pf.vf_addresses)  # still listed: present but unusable
            # Bound back to the driver it was selected with: healthy again after the hold-down.
            simnode.bind_driver(node.sysfs, rebound, "mlx5_core")
            uevent(daemon, "bind", rebound)
            await emu.wait_for(lambda: emu.devices(r).get(rebound) == HEALTHY, GUARD_S)

    run(main())


def test_metrics_endpoint_of_a_running_daemon(run: Run, node: Node) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    pf = node.layout.pfs[0]
    r = res(f"sriov_{pf.netdev}")

    def scrape(port: int, path: str) -> tuple[int, str]:
        import urllib.error
        import urllib.request

        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()

    def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    async def main() -> None:
        async with running(node, metrics_addr="127.0.0.1:0") as (emu, daemon):
            assert daemon.metrics_port is not None
            port = daemon.metrics_port
            await emu.wait_for(lambda: daemon.registered()[0], GUARD_S)
            assert (await asyncio.to_thread(scrape, port, "/readyz"))[0] == 200
            daemon.set_links([(pf.netdev, False)])
            await emu.wait_for(lambda: emu.allocatable(r) == 0, GUARD_S)
            await emu.allocate(res("other_vfs"), [node.layout.pfs[2].vf_addresses[0]])
            status, text = await asyncio.to_thread(scrape, port, "/metrics")
            assert status == 200
            got = samples(text)
            assert got[("densedev_pool_devices", (("health", "Unhealthy"), ("resource", r)))] == 8
            assert got[("densedev_pool_devices", (("health", "Healthy"), ("resource", r)))] == 0
            assert (
                got[("densedev_pool_unhealthy_devices", (("reason", "pf-link-down"), ("resource", r)))] == 8
            )
            assert got[("densedev_health_transitions_total", (("resource", r), ("to", "Unhealthy")))] == 8
            assert any(
                name == "densedev_event_to_send_seconds_count" and v >= 1 for (name, _), v in got.items()
            )
            assert any(
                name.startswith("densedev_listandwatch_bytes") and v > 0 for (name, _), v in got.items()
            )
            other = res("other_vfs")
            assert (
                got[("densedev_plugin_rpc_calls_total", (("method", "Allocate"), ("resource", other)))] == 1
            )
            assert (await asyncio.to_thread(scrape, port, "/healthz"))[0] == 200

    run(main())


def test_cdi_annotations_when_asked(run: Run, node: Node) -> None:
    pf = node.layout.pfs[0]
    r = res(f"sriov_{pf.netdev}")

    async def main() -> None:
        async with running(node, cdi_annotations=True) as (emu, _daemon):
            resp = await emu.allocate(r, [pf.vf_addresses[0]])
            names = [d.name for d in resp.cdi_devices]
            assert names and all(n.startswith(PREFIX + "/") for n in names)
            annotations = dict(resp.annotations)
            assert [k for k in annotations if k.startswith("cdi.k8s.io/")]
            assert ",".join(names) in annotations.values()

    run(main())


def test_the_periodic_reconcile_finds_what_no_event_announced(run: Run, node: Node) -> None:
    # No uevent is injected: only the safety-net reconcile (a one-thread full scan) can see this.
    node.write_config(pools_config(node.layout, reconcileSeconds=0.3))
    pf = node.layout.pfs[0]
    r = res(f"sriov_{pf.netdev}")

    async def main() -> None:
        async with running(node) as (emu, daemon):
            assert set(emu.devices(r)) == set(pf.vf_addresses)
            # Reconciles that find nothing changed keep the table they hold and send nothing.
            table, sent = daemon.table, len(emu.updates(r))
            await asyncio.sleep(1.0)  # three reconciles or more
            assert daemon.table.devices is table.devices and len(emu.updates(r)) == sent
            simnode.set_num_vfs(node.sysfs, pf.address, 0)  # the kernel wants 0 before a new count
            created = simnode.set_num_vfs(node.sysfs, pf.address, 2)
            await emu.wait_for(lambda: set(emu.devices(r)) == set(created), GUARD_S)
            assert len(created) == 2
            assert emu.registrations(r) == 1

    run(main())


def test_a_daemon_loop_that_raises_is_restarted_not_lost(run: Run, node: Node) -> None:
    # No task of the daemon may die on an exception: a bug in one pass of a loop (here the housekeeping
    # loop's metrics call) is logged and counted, and the loop runs again.
    async def main() -> None:
        async with running(node, housekeeping_s=0.01) as (_emu, daemon):
            calls: list[str] = []
            real = daemon.metrics.set_registered

            def flaky(name: str, registered: bool) -> None:
                calls.append(name)
                if len(calls) == 1:
                    raise RuntimeError("a bug in one pass")
                real(name, registered)

            daemon.metrics.set_registered = flaky  # type: ignore[method-assign]
            await asyncio.wait_for(_until(lambda: len(calls) > 5), GUARD_S)
            text = daemon.metrics.render().decode()
            assert 'densedev_task_restarts_total{task="housekeeping"} 1.0' in text
            assert all(not t.done() for t in daemon._tasks if t.get_name() == "housekeeping")

    run(main())


async def _until(predicate: Callable[[], bool]) -> None:
    while not predicate():
        await asyncio.sleep(0.005)
