"""The whole daemon end to end: simulated node → discovery → pools → health → gRPC → kubelet emulator.

Waits are bounded by generous guards that only turn a hang into a failure; nothing asserts speed.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import pytest
from helpers.metrics import sample
from helpers.node import GUARD_S, PREFIX, Node, pools_config, res
from helpers.waiting import until as _until

from densedev.daemon import Daemon
from densedev.pools import config as config_mod
from densedev.testing import simnode
from densedev.testing.kubelet import HEALTHY, UNHEALTHY, KubeletEmulator


async def test_every_pool_registers_and_lists_every_device(
    node: Node, kubelet: KubeletEmulator, daemon: Daemon
) -> None:
    emu = kubelet
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
    await daemon.stop()
    # Shutdown removes our sockets; the kubelet's own socket is not ours.
    assert not [p for p in node.kubelet_dir.iterdir() if p.name.startswith("densedev-")]


async def test_rdma_port_flip_in_the_tree_reaches_the_kubelet_and_recovers(
    node: Node, kubelet: KubeletEmulator, daemon: Daemon
) -> None:
    emu = kubelet
    pf = node.layout.pfs[3]
    shared_ids = {f"{pf.address}/{k}" for k in range(4)}
    r = res("rdma_shared")
    simnode.set_rdma_port(node.sysfs, pf.ibdev, 1, 1)  # DOWN, as the HCA reports it
    await emu.wait_for(
        lambda: {i for i, h in emu.devices(r).items() if h == UNHEALTHY} == shared_ids, GUARD_S
    )
    assert daemon.tracker is not None and "rdma-port-down" in daemon.tracker.reasons(pf.address)
    simnode.set_rdma_port(node.sysfs, pf.ibdev, 1, 4)  # ACTIVE again: healthy after the hold-down
    await emu.wait_for(lambda: set(emu.devices(r).values()) == {HEALTHY}, GUARD_S)
    # Other pools never heard of it.
    assert len(emu.updates(res("other_vfs"))) == 1


async def test_pf_link_down_takes_its_vfs_in_one_message(
    node: Node, kubelet: KubeletEmulator, daemon: Daemon
) -> None:
    emu = kubelet
    pf = node.layout.pfs[0]
    r = res(f"sriov_{pf.netdev}")
    before = len(emu.updates(r))
    daemon.set_links([(pf.netdev, False)])
    await emu.wait_for(lambda: set(emu.devices(r).values()) == {UNHEALTHY}, GUARD_S)
    assert len(emu.updates(r)) == before + 1  # the burst of 8 VFs is one message
    assert emu.allocatable(r) == 0 and emu.capacity(r) == len(pf.vf_addresses)
    daemon.set_links([(pf.netdev, True)])
    await emu.wait_for(lambda: set(emu.devices(r).values()) == {HEALTHY}, GUARD_S)
    assert len(emu.updates(res("other_vfs"))) == 1


async def test_allocate_statuses(node: Node, kubelet: KubeletEmulator, daemon: Daemon) -> None:
    emu = kubelet
    pf = node.layout.pfs[0]
    r = res(f"sriov_{pf.netdev}")
    other = node.layout.pfs[2].vf_addresses[0]

    async def status(ids: list[str]) -> tuple[grpc.StatusCode, str]:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await emu.allocate(r, ids, check=False)
        return err.value.code(), err.value.details() or ""

    ok = await emu.allocate(r, list(pf.vf_addresses[:2]))
    env = dict(ok.envs)
    key = "PCIDEVICE_EXAMPLE_COM_SRIOV_" + pf.netdev.upper()
    assert env[key] == ",".join(pf.vf_addresses[:2])
    assert set(json.loads(env[key + "_INFO"])) == set(pf.vf_addresses[:2])
    code, text = await status(["0000:ff:1f.7"])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "0000:ff:1f.7" in text
    code, text = await status([other])  # a device of another pool
    assert code == grpc.StatusCode.INVALID_ARGUMENT and other in text
    daemon.set_links([(pf.netdev, False)])
    await emu.wait_for(lambda: emu.allocatable(r) == 0, GUARD_S)
    code, text = await status([pf.vf_addresses[3]])
    assert code == grpc.StatusCode.FAILED_PRECONDITION and pf.vf_addresses[3] in text


async def test_kubelet_restart_leads_to_reregistration_and_a_fresh_full_list(
    kubelet: KubeletEmulator, daemon: Daemon
) -> None:
    emu = kubelet
    names = [p.full_name for p in daemon.config.pools]
    await emu.restart()
    await emu.wait_for(lambda: all(emu.registrations(n) >= 1 and emu.updates(n) for n in names), GUARD_S)
    for n in names:
        assert len(emu.devices(n)) == len(daemon.pools[n].pool.members)
    await asyncio.sleep(0)  # the daemon's housekeeping counts re-registrations


async def test_vfs_created_and_destroyed_grow_and_shrink_pools_live(
    node: Node, kubelet: KubeletEmulator, daemon: Daemon
) -> None:
    emu = kubelet
    pf = node.layout.pfs[1]
    r = res(f"sriov_{pf.netdev}")
    simnode.set_num_vfs(node.sysfs, pf.address, 0)
    daemon.events.on_uevent(("change", f"/devices/pci0000:00/{pf.address}", (("SUBSYSTEM", "pci"),)))
    await emu.wait_for(lambda: emu.devices(r) == {}, GUARD_S)
    created = simnode.set_num_vfs(node.sysfs, pf.address, 6)
    daemon.events.on_uevent(("change", f"/devices/pci0000:00/{pf.address}", (("SUBSYSTEM", "pci"),)))
    await emu.wait_for(lambda: set(emu.devices(r)) == set(created), GUARD_S)
    assert emu.registrations(r) == 1  # grew and shrank without re-registering
    assert set(emu.devices(r).values()) == {HEALTHY}


def test_bad_resource_name_is_refused_with_a_clear_message(node: Node) -> None:
    doc = pools_config(node.layout)
    doc["resourceList"][0]["resourceName"] = "bad name!"
    node.write_config(doc)
    problems = config_mod.check(node.config_path, default_prefix=PREFIX)
    assert any("resourceList[0]" in p and "resourceName" in p for p in problems), problems


@pytest.fixture
def cdi_dir(node: Node) -> tuple[Path, Path, Path]:
    """The CDI dir with a stale spec of ours and a foreign one, made before the daemon starts."""
    cdi = node.tmp / "cdi"
    cdi.mkdir()
    stale = cdi / "densedev-example.com-gone_pool.json"
    stale.write_text("{}")
    foreign = cdi / "vendor-other.json"  # not ours: never touched
    foreign.write_text("{}")
    return cdi, stale, foreign


async def test_cdi_specs_follow_the_pools(
    node: Node, cdi_dir: tuple[Path, Path, Path], kubelet: KubeletEmulator, daemon: Daemon
) -> None:
    emu = kubelet
    cdi, stale, foreign = cdi_dir
    ours = sorted(p.name for p in cdi.glob("densedev-*.json"))
    assert stale.name not in ours and foreign.exists()
    assert len(ours) == len(daemon.pools)
    spec = json.loads((cdi / ours[0]).read_text())
    assert spec["kind"].startswith(PREFIX + "/") and spec["devices"]
    # Deleting a pool from the config takes its spec along.
    doc = pools_config(node.layout)
    removed = doc["resourceList"].pop(0)
    node.write_config(doc)
    await emu.wait_for(
        lambda: sample(daemon, "densedev_config_reloads_total", result="success") == 1, GUARD_S
    )
    left = sorted(p.name for p in cdi.glob("densedev-*.json"))
    assert len(left) == len(ours) - 1
    assert not any(removed["resourceName"] in name for name in left)
    await daemon.stop()
    # A restart (stop) keeps the specs: the kubelet restarts containers from its checkpoint.
    assert sorted(p.name for p in cdi.glob("densedev-*.json")) == left


async def test_restart_advertises_the_same_devices_including_vfs_moved_into_pods(
    node: Node, kubelet: KubeletEmulator, daemon: Daemon
) -> None:
    emu = kubelet
    pf = node.layout.pfs[0]
    moved = pf.vf_addresses[:3]
    r = res(f"sriov_{pf.netdev}")
    first = {n: dict(emu.devices(n)) for n in emu.resources()}
    for address in moved:  # the CNI moved these VFs' interfaces into pods
        simnode.move_netdev_to_pod(node.sysfs, address)
    await daemon.stop()
    again = node.daemon()
    await again.start()
    try:
        await emu.wait_for(lambda: all(emu.registrations(n) == 2 for n in first), GUARD_S)
        await emu.wait_for(lambda: all(len(emu.updates(n)) >= 2 for n in first), GUARD_S)
        assert {n: dict(emu.devices(n)) for n in first} == first
        # Gone from the host's view is not down: the moved VFs stay Healthy.
        assert all(emu.devices(r)[a] == HEALTHY for a in moved)
    finally:
        await again.stop()


async def test_driver_rules_unbound_and_rebound(node: Node, kubelet: KubeletEmulator, daemon: Daemon) -> None:
    emu = kubelet
    pf = node.layout.pfs[0]
    r = res(f"sriov_{pf.netdev}")
    unbound, rebound = pf.vf_addresses[0], pf.vf_addresses[1]

    def uevent(action: str, address: str) -> None:
        daemon.events.on_uevent((action, f"/devices/pci0000:00/{address}", (("SUBSYSTEM", "pci"),)))

    simnode.bind_driver(node.sysfs, unbound, None)
    uevent("unbind", unbound)
    simnode.bind_driver(node.sysfs, rebound, "vfio-pci")
    uevent("bind", rebound)
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
    uevent("bind", rebound)
    await emu.wait_for(lambda: emu.devices(r).get(rebound) == HEALTHY, GUARD_S)


@pytest.mark.parametrize("daemon_settings", [{"metrics_addr": "127.0.0.1:0"}])
async def test_metrics_endpoint_of_a_running_daemon(
    node: Node, kubelet: KubeletEmulator, daemon: Daemon
) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    emu = kubelet
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
    assert got[("densedev_pool_unhealthy_devices", (("reason", "pf-link-down"), ("resource", r)))] == 8
    assert got[("densedev_health_transitions_total", (("resource", r), ("to", "Unhealthy")))] == 8
    assert any(name == "densedev_event_to_send_seconds_count" and v >= 1 for (name, _), v in got.items())
    assert any(name.startswith("densedev_listandwatch_bytes") and v > 0 for (name, _), v in got.items())
    other = res("other_vfs")
    assert got[("densedev_plugin_rpc_calls_total", (("method", "Allocate"), ("resource", other)))] == 1
    assert (await asyncio.to_thread(scrape, port, "/healthz"))[0] == 200


@pytest.mark.parametrize("daemon_settings", [{"cdi_annotations": True}])
async def test_cdi_annotations_when_asked(node: Node, kubelet: KubeletEmulator, daemon: Daemon) -> None:
    pf = node.layout.pfs[0]
    r = res(f"sriov_{pf.netdev}")
    resp = await kubelet.allocate(r, [pf.vf_addresses[0]])
    names = [d.name for d in resp.cdi_devices]
    assert names and all(n.startswith(PREFIX + "/") for n in names)
    annotations = dict(resp.annotations)
    assert [k for k in annotations if k.startswith("cdi.k8s.io/")]
    assert ",".join(names) in annotations.values()


@pytest.mark.parametrize(
    "node_options", [{"config": lambda layout: pools_config(layout, reconcileSeconds=0.3)}]
)
async def test_the_periodic_reconcile_finds_what_no_event_announced(
    node: Node, kubelet: KubeletEmulator, daemon: Daemon
) -> None:
    # No uevent is injected: only the safety-net reconcile (a one-thread full scan) can see this.
    emu = kubelet
    pf = node.layout.pfs[0]
    r = res(f"sriov_{pf.netdev}")
    assert set(emu.devices(r)) == set(pf.vf_addresses)
    # Reconciles that find nothing changed keep the table they hold and send nothing.
    table, sent = daemon.rediscovery.table, len(emu.updates(r))
    await asyncio.sleep(1.0)  # three reconciles or more
    assert daemon.rediscovery.table.devices is table.devices and len(emu.updates(r)) == sent
    simnode.set_num_vfs(node.sysfs, pf.address, 0)  # the kernel wants 0 before a new count
    created = simnode.set_num_vfs(node.sysfs, pf.address, 2)
    await emu.wait_for(lambda: set(emu.devices(r)) == set(created), GUARD_S)
    assert len(created) == 2
    assert emu.registrations(r) == 1


@pytest.mark.parametrize("daemon_settings", [{"housekeeping_s": 0.01}])
async def test_a_daemon_loop_that_raises_is_restarted_not_lost(daemon: Daemon) -> None:
    # No task of the daemon may die on an exception: a bug in one pass of a loop (here the housekeeping
    # loop's metrics call) is logged and counted, and the loop runs again.
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
