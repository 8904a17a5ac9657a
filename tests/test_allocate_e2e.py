"""Issue 5's "Done when", end to end: a real daemon on a simulated node, asked by the kubelet emulator.

One config holds a pool per device kind of ``build_node(extras=True)`` (kernel-netdev VF, vfio-pci VF
with and without an IOMMU, RoCE VF, InfiniBand PF, shared RDMA, vDPA, uio, QAT accelerator,
needVhostNet, subfunctions) plus a ``pack`` and a ``spread`` pool.  Every expectation is written per
kind from what the tree shows (IOMMU groups, the char devices under a function's ``infiniband_*``
class dirs), never from the allocator's own helpers, so a wrong env, node, CDI entry or device-info
file fails here.

Waits are bounded by generous guards that only turn a hang into a failure; nothing asserts speed.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from helpers import node as node_helpers
from helpers.node import GUARD_S, PREFIX, res

from densedev._proto import api_pb2
from densedev.daemon import Daemon, DaemonSettings
from densedev.testing import simnode
from densedev.testing.kubelet import HEALTHY, UNHEALTHY, KubeletEmulator, KubeletError

RW = "rw"
RDMA_CM = "/dev/infiniband/rdma_cm"
VFIO = "/dev/vfio/vfio"
DEVINFO_VERSION = "1.1.0"  # Network Plumbing WG device-info spec version the CNI side reads

Node3 = tuple[str, str, str]  # (container path, host path, permissions)


def env_of(name: str) -> str:
    """Return the SR-IOV-plugin variable name of a pool (``example.com/x`` → ``PCIDEVICE_EXAMPLE_COM_X``)."""
    return "PCIDEVICE_EXAMPLE_COM_" + name.upper()


def compact(doc: object) -> str:
    """Return JSON as the SR-IOV plugin's Go encoder writes it: compact, keys sorted."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class Kind:
    """What one pool's containers must get: per device its ``_INFO`` entry and nodes, and its files."""

    pool: str  # resourceName
    ids: tuple[str, ...]  # what the kubelet allocates, in its order
    devices: dict[str, tuple[dict[str, Any], list[Node3]]]  # every device of the pool → (_INFO, nodes)
    devinfo: dict[str, dict[str, Any]] | None  # allocated device → device-info document; None: not netDevice

    def distinct(self) -> list[str]:
        """Return the devices behind ``ids`` in request order (shared RDMA IDs map to their device)."""
        out: list[str] = []
        for i in self.ids:
            d = i.split("/", 1)[0]
            if d not in out:
                out.append(d)
        return out


class Node(node_helpers.Node):
    """A simulated node with every special kind, its /dev stand-ins, config and daemon paths."""

    def __init__(self, tmp: Path, kubelet_dir: Path | None = None) -> None:
        # The config names the extras' devices, so it is made from the tree once it is built.
        super().__init__(
            tmp,
            pfs=4,
            vfs_per_pf=4,
            extras=True,
            config=lambda _layout: self.config_doc(),
            kubelet_dir=kubelet_dir,
        )
        self.dev_root = tmp / "dev"
        self.cdi_dir = tmp / "cdi"
        self.devinfo_dir = tmp / "devinfo"
        self.make_dev_nodes()

    @property
    def ex(self) -> simnode.SimExtras:
        """The extras of ``build_node(extras=True)``: the special kinds' addresses."""
        assert self.layout.extras is not None
        return self.layout.extras

    # -- the tree, read the way udev and the kernel name things ------------------------------------
    def function_path(self, address: str) -> str:
        """Return the real sysfs directory of a PCI function or an auxiliary-bus subfunction."""
        bus = "auxiliary" if address.startswith("mlx5_core.sf.") else "pci"
        return os.path.realpath(self.sysfs / "bus" / bus / "devices" / address)

    def group(self, address: str) -> int:
        """Return a function's IOMMU group number (the ``iommu_group`` link's target)."""
        return int(os.path.basename(os.readlink(self.function_path(address) + "/iommu_group")))

    def char_nodes(self, address: str) -> dict[str, str]:
        """Return the RDMA char devices of a function by kind: ``{"uverbs": "uverbs6", "umad": ...}``."""
        out: dict[str, str] = {}
        for cls in ("infiniband_verbs", "infiniband_mad", "infiniband_cm"):
            d = self.function_path(address) + "/" + cls
            for name in sorted(os.listdir(d)) if os.path.isdir(d) else ():
                out[name.rstrip("0123456789")] = name
        return out

    def make_dev_nodes(self) -> None:
        """Create the /dev entries the kernel and udev would have made, as plain files."""
        ex = self.ex
        paths = [
            VFIO,
            f"/dev/vfio/{self.group(ex.vfio_vf)}",
            # drivers/vfio/group.c: a no-IOMMU group's node is noiommu-<g>; there is no /dev/vfio/<g>.
            f"/dev/vfio/noiommu-{ex.noiommu_group}",
            *(f"/dev/vfio/{self.group(a)}" for a in ex.accel_vfs),
            f"/dev/{ex.uio}",
            "/dev/vhost-net",
            "/dev/net/tun",
            "/dev/vhost-vdpa-0",
            RDMA_CM,
        ]
        # udev names every infiniband_verbs/_mad/_cm class device /dev/infiniband/<name>.
        for cls in ("infiniband_verbs", "infiniband_mad", "infiniband_cm"):
            d = self.sysfs / "class" / cls
            paths += [f"/dev/infiniband/{n}" for n in (os.listdir(d) if d.is_dir() else ())]
        for p in paths:
            f = self.dev_root / p.removeprefix("/dev/")
            f.parent.mkdir(parents=True, exist_ok=True)
            f.touch()

    # -- config ----------------------------------------------------------------------------------
    def config_doc(self) -> dict[str, object]:
        """One pool per device kind (disjoint selectors), then a pack and a spread pool."""
        pfs, ex = self.layout.pfs, self.ex

        def pool(name: str, selectors: dict[str, object], **kw: object) -> dict[str, object]:
            return {
                "resourceName": name,
                "resourcePrefix": PREFIX,
                "selectors": selectors,
                "healthPolicy": {"holdDownSeconds": 0.1},
                **kw,
            }

        return {
            "rdmaPollSeconds": 0.05,
            "coalesceMs": 2,
            "resourceList": [
                pool("kernel_vf", {"pfNames": [f"{pfs[0].netdev}#0-1"]}, preStart=True),
                pool("rdma_vf", {"pfNames": [f"{pfs[0].netdev}#2-3"], "isRdma": True}),
                pool(
                    "ib_pf",
                    {"pciAddresses": [ex.ib_pf], "linkTypes": ["infiniband"], "isRdma": True},
                ),
                pool(
                    "rdma_shared",
                    {"pciAddresses": [pfs[0].address, pfs[2].address], "isRdma": True},
                    deviceType="accelerator",
                    rdmaShared=2,
                ),
                pool("vfio_vf", {"pciAddresses": [ex.vfio_vf], "drivers": ["vfio-pci"]}),
                pool("noiommu_vf", {"pciAddresses": [ex.noiommu_vf], "drivers": ["vfio-pci"]}),
                pool("uio_vf", {"drivers": ["igb_uio"]}, preferredAllocation="none"),
                pool("vdpa_vf", {"vdpaType": "vhost"}),
                pool(
                    "qat",
                    {"vendors": ["8086"], "devices": ["4941"], "drivers": ["vfio-pci"]},
                    deviceType="accelerator",
                    additionalInfo={
                        "*": {"qat-gen": "4xxx", "service": "sym"},
                        ex.accel_vfs[1]: {"service": "asym"},
                    },
                ),
                pool("vhost_vf", {"pfNames": [f"{pfs[3].netdev}#2-3"], "needVhostNet": True}),
                pool("sf", {"auxTypes": ["sf"], "isRdma": True}, deviceType="auxNetDevice"),
                # Preferred allocation: pfs[1] is on NUMA node 0, pfs[2] on node 1.
                pool("pack_vf", {"pfNames": [pfs[1].netdev, pfs[2].netdev]}, preferredAllocation="pack"),
                pool(
                    "spread_vf",
                    {"pfNames": [f"{pfs[3].netdev}#0-1", f"{self.sf_pf_netdev}#0"]},
                    preferredAllocation="spread",
                ),
            ],
        }

    @property
    def sf_pf_netdev(self) -> str:
        """Return the netdev of the extras' ConnectX PF (its VF 0 joins the spread pool)."""
        return os.listdir(self.function_path(self.ex.sf_pf) + "/net")[0]

    def settings(self, cdi: bool = True, **kw: Any) -> DaemonSettings:
        """Daemon settings into the temp dir; CDI off when ``cdi`` is false; no config file to reload."""
        return super().settings(**{"config_path": None, "cdi_dir": self.cdi_dir if cdi else None, **kw})

    # -- what each kind must get -------------------------------------------------------------------
    def rdma_parts(self, address: str, ibdev: str) -> tuple[dict[str, str], list[Node3]]:
        """Return the ``rdma`` _INFO section and the nodes of an RDMA function (every node it has)."""
        names = self.char_nodes(address)
        section = {"rdma_dev": ibdev, "rdma_cm": RDMA_CM}
        for key in ("uverbs", "umad", "issm"):
            if key in names:
                section[key] = f"/dev/infiniband/{names[key]}"
        nodes = [(f"/dev/infiniband/{n}",) * 2 + (RW,) for n in names.values()]
        return section, [*nodes, (RDMA_CM, RDMA_CM, RW)]

    def kinds(self) -> dict[str, Kind]:
        """Return the expected outcome of every kind's pool."""
        pfs, ex = self.layout.pfs, self.ex

        def generic(a: str) -> dict[str, Any]:
            return {"generic": {"deviceID": a}}

        def pci_doc(a: str, pf: str = "", rdma: str = "", vhost: bool = False) -> dict[str, Any]:
            pci = {"pci-address": a}
            if pf:
                pci["pf-pci-address"] = pf
            if rdma:
                pci["rdma-device"] = rdma
            if vhost:
                pci["vhost-net"] = "/dev/vhost-net"
            return {"type": "pci", "version": DEVINFO_VERSION, "pci": pci}

        kinds: dict[str, Kind] = {}
        # Kernel netdev VFs: the address only; the device-info file names the PF and the VF's ibdev.
        vfs, ibs = pfs[0].vf_addresses[:2], pfs[0].vf_ibdevs[:2]
        kinds["kernel_vf"] = Kind(
            "kernel_vf",
            (vfs[1], vfs[0]),
            {a: (generic(a), []) for a in vfs},
            {a: pci_doc(a, pfs[0].address, ib) for a, ib in zip(vfs, ibs, strict=True)},
        )
        # RoCE VFs: uverbs, umad and rdma_cm; no issm (RoCE has none) and that must not fail.
        vfs, ibs = pfs[0].vf_addresses[2:4], pfs[0].vf_ibdevs[2:4]
        devices: dict[str, tuple[dict[str, Any], list[Node3]]] = {}
        for a, ib in zip(vfs, ibs, strict=True):
            section, nodes = self.rdma_parts(a, ib)
            assert "issm" not in section and len(nodes) == 3, (a, nodes)
            devices[a] = ({**generic(a), "rdma": section}, nodes)
        kinds["rdma_vf"] = Kind(
            "rdma_vf",
            vfs,
            devices,
            {a: pci_doc(a, pfs[0].address, ib) for a, ib in zip(vfs, ibs, strict=True)},
        )
        # InfiniBand PF: issm (and ucm, a node without an _INFO key) as well.
        section, nodes = self.rdma_parts(ex.ib_pf, ex.ib_ibdev)
        assert section["issm"].startswith("/dev/infiniband/issm") and len(nodes) == 5, nodes
        kinds["ib_pf"] = Kind(
            "ib_pf",
            (ex.ib_pf,),
            {ex.ib_pf: ({**generic(ex.ib_pf), "rdma": section}, nodes)},
            {ex.ib_pf: pci_doc(ex.ib_pf, rdma=ex.ib_ibdev)},
        )
        # Shared RDMA: IDs "<pf>/<k>"; two IDs of one HCA give it once, in env, _INFO and nodes.
        devices = {}
        for pf in (pfs[0], pfs[2]):
            section, nodes = self.rdma_parts(pf.address, pf.ibdev)
            devices[pf.address] = ({**generic(pf.address), "rdma": section}, nodes)
        kinds["rdma_shared"] = Kind(
            "rdma_shared",
            (f"{pfs[2].address}/1", f"{pfs[0].address}/0", f"{pfs[0].address}/1"),
            devices,
            None,
        )
        e810 = os.path.basename(os.readlink(self.function_path(ex.vfio_vf) + "/physfn"))
        # vfio-pci with an IOMMU: the container node and the group.
        g = self.group(ex.vfio_vf)
        kinds["vfio_vf"] = Kind(
            "vfio_vf",
            (ex.vfio_vf,),
            {
                ex.vfio_vf: (
                    {**generic(ex.vfio_vf), "vfio": {"mount": VFIO, "dev-mount": f"/dev/vfio/{g}"}},
                    [(VFIO, VFIO, RW), (f"/dev/vfio/{g}", f"/dev/vfio/{g}", RW)],
                )
            },
            {ex.vfio_vf: pci_doc(ex.vfio_vf, e810)},
        )
        # vfio-pci in a no-IOMMU group: the host's noiommu-<g> appears as /dev/vfio/<g> inside.
        g = ex.noiommu_group
        kinds["noiommu_vf"] = Kind(
            "noiommu_vf",
            (ex.noiommu_vf,),
            {
                ex.noiommu_vf: (
                    {**generic(ex.noiommu_vf), "vfio": {"mount": VFIO, "dev-mount": f"/dev/vfio/{g}"}},
                    [(VFIO, VFIO, RW), (f"/dev/vfio/{g}", f"/dev/vfio/noiommu-{g}", RW)],
                )
            },
            {ex.noiommu_vf: pci_doc(ex.noiommu_vf, e810)},
        )
        kinds["uio_vf"] = Kind(
            "uio_vf",
            (ex.uio_vf,),
            {
                ex.uio_vf: (
                    {**generic(ex.uio_vf), "uio": {"mount": f"/dev/{ex.uio}"}},
                    [(f"/dev/{ex.uio}", f"/dev/{ex.uio}", RW)],
                )
            },
            {ex.uio_vf: pci_doc(ex.uio_vf, e810)},
        )
        kinds["vdpa_vf"] = Kind(
            "vdpa_vf",
            (ex.vdpa_vf,),
            {
                ex.vdpa_vf: (
                    {**generic(ex.vdpa_vf), "vdpa": {"mount": "/dev/vhost-vdpa-0"}},
                    [("/dev/vhost-vdpa-0", "/dev/vhost-vdpa-0", RW)],
                )
            },
            {
                ex.vdpa_vf: {
                    "type": "vdpa",
                    "version": DEVINFO_VERSION,
                    "vdpa": {
                        "parent-device": ex.vdpa,
                        "driver": "vhost",
                        "path": "/dev/vhost-vdpa-0",
                        "pci-address": ex.vdpa_vf,
                        "pf-pci-address": ex.sf_pf,
                    },
                }
            },
        )
        # QAT VFs on vfio-pci, additionalInfo: "*" for all, the address entry overrides it.
        devices = {}
        for a in ex.accel_vfs:
            g = self.group(a)
            extra = {"qat-gen": "4xxx", "service": "asym" if a == ex.accel_vfs[1] else "sym"}
            devices[a] = (
                {**generic(a), "vfio": {"mount": VFIO, "dev-mount": f"/dev/vfio/{g}"}, "extra": extra},
                [(VFIO, VFIO, RW), (f"/dev/vfio/{g}", f"/dev/vfio/{g}", RW)],
            )
        kinds["qat"] = Kind("qat", (ex.accel_vfs[1], ex.accel_vfs[0]), devices, None)
        vfs, ibs = pfs[3].vf_addresses[2:4], pfs[3].vf_ibdevs[2:4]
        vhost = {"net-mount": "/dev/vhost-net", "tun-mount": "/dev/net/tun"}
        vhost_nodes = [("/dev/vhost-net", "/dev/vhost-net", RW), ("/dev/net/tun", "/dev/net/tun", RW)]
        kinds["vhost_vf"] = Kind(
            "vhost_vf",
            vfs,
            {a: ({**generic(a), "vhost": vhost}, vhost_nodes) for a in vfs},
            {a: pci_doc(a, pfs[3].address, ib, vhost=True) for a, ib in zip(vfs, ibs, strict=True)},
        )
        # Subfunctions (auxNetDevice): named by their aux device, RDMA from their own ibdev; no
        # device-info file (CNI finds SFs by name, the spec covers PCI and vDPA devices only).
        devices = {}
        for sf, ib in zip(ex.sfs, ex.sf_ibdevs, strict=True):
            section, nodes = self.rdma_parts(sf, ib)
            devices[sf] = ({**generic(sf), "rdma": section}, nodes)
        kinds["sf"] = Kind("sf", (ex.sfs[1], ex.sfs[0]), devices, None)
        return kinds


@pytest.fixture
def node(tmp_path: Path, sock_dir: Path) -> Iterator[Node]:
    """This module's node: every special kind (in place of conftest's plain one)."""
    n = Node(tmp_path, kubelet_dir=sock_dir)
    yield n
    n.cleanup()


@pytest.fixture
def kubelet_options() -> dict[str, Any]:
    """No checkpoint file: these tests look at the daemon's files only."""
    return {"checkpoint": False}


@pytest.fixture
def cdi() -> bool:
    """Whether the daemon writes CDI specs (parametrized where a test runs both ways)."""
    return True


@pytest.fixture
def daemon_settings(cdi: bool) -> dict[str, Any]:
    """The daemon's CDI switch."""
    return {"cdi": cdi}


def spec_path(node: Node, pool: str) -> Path:
    """Return where the pool's CDI spec lives (``densedev-<prefix>-<name>.json``)."""
    return node.cdi_dir / f"densedev-{PREFIX}-{pool}.json"


def devinfo_path(node: Node, pool: str, device: str) -> Path:
    """Return the device-info file Multus looks up: ``<prefix>-<name>-<address>-device.json``."""
    return node.devinfo_dir / f"{PREFIX}-{pool}-{device}-device.json"


def files(directory: Path) -> dict[str, tuple[bytes, int]]:
    """Return every file of a directory with its bytes and inode (a rename-over gives a new inode).

    Hidden names (densedev's device-info ownership record) are not files a runtime or CNI reads.
    """
    if not directory.is_dir():
        return {}
    listed = sorted(p for p in directory.iterdir() if not p.name.startswith("."))
    return {p.name: (p.read_bytes(), p.stat().st_ino) for p in listed}


def expected_spec(kind: Kind) -> dict[str, Any]:
    """Return the CDI spec of a kind's pool: one entry per device with its nodes and own _INFO env."""
    entries = []
    for device, (info, nodes) in sorted(kind.devices.items()):
        # Each entry carries its own device's _INFO only: CDI env of several devices would collide.
        var = f"{env_of(kind.pool)}_{device.replace(':', '_').replace('.', '_').upper()}_INFO"
        edits: dict[str, Any] = {"env": [f"{var}={compact({device: info})}"]}
        if nodes:
            edits["deviceNodes"] = [{"path": c, "hostPath": h, "permissions": p} for c, h, p in nodes]
        entries.append({"name": device, "containerEdits": edits})
    return {"cdiVersion": "0.5.0", "kind": res(kind.pool), "devices": entries}


def unordered_nodes(spec: dict[str, Any]) -> dict[str, Any]:
    """Return a spec with each entry's device nodes sorted: their order carries no meaning to a runtime."""
    out = json.loads(json.dumps(spec))
    for entry in out["devices"]:
        nodes = entry["containerEdits"].get("deviceNodes")
        if nodes:
            nodes.sort(key=lambda n: (n["path"], n["hostPath"]))
    return out


def check_response(kind: Kind, resp: api_pb2.ContainerAllocateResponse, cdi: bool) -> None:
    """Assert the exact response a kind's allocation must get."""
    distinct = kind.distinct()
    name = env_of(kind.pool)
    info = {d: kind.devices[d][0] for d in distinct}
    assert dict(resp.envs) == {name: ",".join(distinct), f"{name}_INFO": compact(info)}, kind.pool
    assert dict(resp.annotations) == {}, kind.pool
    if cdi:
        # The runtime injects the nodes from the spec: returning them too would add each twice.
        assert [c.name for c in resp.cdi_devices] == [f"{res(kind.pool)}={d}" for d in distinct], kind.pool
        assert list(resp.devices) == [], kind.pool
    else:
        # De-duplicated by host path (/dev/vfio/vfio once, rdma_cm once); order is not part of the API.
        want = {n for d in distinct for n in kind.devices[d][1]}
        got = [(d.container_path, d.host_path, d.permissions) for d in resp.devices]
        assert sorted(got) == sorted(want), kind.pool
        assert list(resp.cdi_devices) == [], kind.pool


# ------------------------------------------------------------------------------------------ the kinds


@pytest.mark.parametrize("cdi", [False, True], ids=["devices", "cdi"])
async def test_every_kind_gets_its_exact_response_spec_and_device_info(
    node: Node, cdi: bool, kubelet: KubeletEmulator, daemon: Daemon
) -> None:
    kinds = node.kinds()

    emu = kubelet
    specs_before = files(node.cdi_dir)
    for kind in kinds.values():
        # The default check=True: the emulated kubelet itself sees the IDs listed Healthy.
        resp = await emu.allocate(res(kind.pool), list(kind.ids))
        check_response(kind, resp, cdi)
        for device, doc in (kind.devinfo or {}).items():
            assert json.loads(devinfo_path(node, kind.pool, device).read_text()) == doc, device
    # Only the allocated devices of netDevice pools have files, nothing for accelerator pools.
    want = {devinfo_path(node, k.pool, d).name for k in kinds.values() for d in k.devinfo or {}}
    assert set(files(node.devinfo_dir)) == want
    if cdi:
        all_pools = {spec_path(node, p.resource_name).name for p in daemon.config.pools}
        assert set(specs_before) == all_pools
        for kind in kinds.values():
            spec = json.loads(spec_path(node, kind.pool).read_text())
            assert unordered_nodes(spec) == unordered_nodes(expected_spec(kind)), kind.pool
        # Allocate rewrote no spec: nothing in a pool changed (same bytes, same inode).
        assert files(node.cdi_dir) == specs_before
    else:
        assert not node.cdi_dir.exists()
    # The kubelet offers PreStartContainer / GetPreferredAllocation only where the pool asks.
    for kind in kinds.values():
        options = emu.options(res(kind.pool))
        assert options is not None
        assert options.pre_start_required == (kind.pool == "kernel_vf")
        assert options.get_preferred_allocation_available == (kind.pool != "uio_vf")
    await daemon.stop()  # to look at what stopping leaves (the fixture then leaves it stopped)
    # Shutdown removes every device-info file; CDI specs stay for the kubelet's restarts.
    assert files(node.devinfo_dir) == {}
    if cdi:
        assert set(files(node.cdi_dir)) == {
            spec_path(node, p.resource_name).name for p in daemon.config.pools
        }


async def test_device_info_and_cdi_follow_the_pool_across_rescans(
    node: Node, kubelet: KubeletEmulator, daemon: Daemon
) -> None:
    pf0 = node.layout.pfs[0]
    kinds = node.kinds()

    emu = kubelet
    for name in ("kernel_vf", "rdma_vf", "vfio_vf", "vdpa_vf"):
        await emu.allocate(res(name), list(kinds[name].ids))
    gone = [devinfo_path(node, "kernel_vf", a) for a in pf0.vf_addresses[:2]]
    gone += [devinfo_path(node, "rdma_vf", a) for a in pf0.vf_addresses[2:]]
    kept = [devinfo_path(node, k, d) for k in ("vfio_vf", "vdpa_vf") for d in kinds[k].ids]
    assert all(p.exists() for p in gone + kept)
    untouched = {k: v for k, v in files(node.cdi_dir).items() if "kernel_vf" not in k and "rdma_vf" not in k}
    # The PF's VFs go away (sriov_numvfs = 0): both pools empty, their files and specs go.
    simnode.set_num_vfs(node.sysfs, pf0.address, 0)
    daemon.request_rescan(pf0.address)
    await emu.wait_for(
        lambda: emu.devices(res("kernel_vf")) == {} and emu.devices(res("rdma_vf")) == {}, GUARD_S
    )
    assert [p for p in gone if p.exists()] == []
    assert all(p.exists() for p in kept)
    # A pool with no device has no spec (CDI requires at least one device); others keep theirs.
    assert not spec_path(node, "kernel_vf").exists() and not spec_path(node, "rdma_vf").exists()
    # The specs of pools the rescan did not change are not rewritten (same bytes, same inode).
    assert files(node.cdi_dir) == untouched
    # The VFs come back (same routing IDs, so the same addresses): the pool, its spec and its
    # files with them; the device-info file names the VF's new ibdev (the RDMA core renumbers).
    simnode.set_num_vfs(node.sysfs, pf0.address, 4)
    daemon.request_rescan(pf0.address)
    r = res("kernel_vf")
    await emu.wait_for(lambda: emu.devices(r) == dict.fromkeys(pf0.vf_addresses[:2], HEALTHY), GUARD_S)
    spec = json.loads(spec_path(node, "kernel_vf").read_text())
    assert unordered_nodes(spec) == unordered_nodes(expected_spec(kinds["kernel_vf"]))
    vf = pf0.vf_addresses[0]
    await emu.allocate(r, [vf])
    (ibdev,) = os.listdir(node.function_path(vf) + "/infiniband")
    assert ibdev != pf0.vf_ibdevs[0]
    assert json.loads(devinfo_path(node, "kernel_vf", vf).read_text()) == {
        "type": "pci",
        "version": DEVINFO_VERSION,
        "pci": {"pci-address": vf, "pf-pci-address": pf0.address, "rdma-device": ibdev},
    }
    await daemon.stop()  # to look at what stopping leaves (the fixture then leaves it stopped)
    assert files(node.devinfo_dir) == {}


# ------------------------------------------------------------------------------------------ errors


async def refused(emu: KubeletEmulator, pool: str, ids: list[str]) -> tuple[grpc.StatusCode, str]:
    """Allocate past the kubelet's own checks and return the plugin's status and message."""
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await emu.allocate(res(pool), ids, check=False)
    return err.value.code(), err.value.details() or ""


async def test_refused_requests_name_the_ids_and_leave_nothing_behind(
    node: Node, kubelet: KubeletEmulator, daemon: Daemon
) -> None:
    pfs, ex = node.layout.pfs, node.ex
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    precondition = grpc.StatusCode.FAILED_PRECONDITION

    emu = kubelet
    cdi_before = files(node.cdi_dir)
    assert cdi_before  # every pool has its spec
    kernel = pfs[0].vf_addresses[0]
    for ids, why in (
        (["0000:ff:1f.7"], "0000:ff:1f.7"),  # unknown
        ([pfs[0].vf_addresses[2]], pfs[0].vf_addresses[2]),  # rdma_vf's
        ([kernel, "0000:ff:1f.7"], "0000:ff:1f.7"),  # one good, one unknown
        ([kernel, kernel], kernel),  # twice
    ):
        code, text = await refused(emu, "kernel_vf", ids)
        assert code == invalid and why in text and res("kernel_vf") in text, (ids, code, text)

    # PF link down: every VF of that PF is unhealthy; a request mixing in a healthy VF of the
    # other PF fails whole, naming only the unhealthy one, and writes no file for the healthy.
    pack = res("pack_vf")
    down, up = pfs[1].vf_addresses[0], pfs[2].vf_addresses[0]
    daemon.set_links([(pfs[1].netdev, False)])
    await emu.wait_for(lambda: emu.devices(pack)[down] == UNHEALTHY, GUARD_S)
    assert emu.devices(pack)[up] == HEALTHY
    code, text = await refused(emu, "pack_vf", [up, down])
    assert code == precondition and down in text and up not in text, text

    # An RDMA port that is not ACTIVE: the RoCE VF and the shared IDs of that HCA.
    simnode.set_rdma_port(node.sysfs, pfs[0].vf_ibdevs[2], 1, 1)
    simnode.set_rdma_port(node.sysfs, pfs[0].ibdev, 1, 1)
    shared = res("rdma_shared")
    await emu.wait_for(
        lambda: (
            emu.devices(res("rdma_vf"))[pfs[0].vf_addresses[2]] == UNHEALTHY
            and emu.devices(shared)[f"{pfs[0].address}/0"] == UNHEALTHY
        ),
        GUARD_S,
    )
    assert emu.devices(res("rdma_vf"))[pfs[0].vf_addresses[3]] == HEALTHY
    assert emu.devices(shared)[f"{pfs[2].address}/0"] == HEALTHY
    code, text = await refused(emu, "rdma_vf", [pfs[0].vf_addresses[3], pfs[0].vf_addresses[2]])
    assert code == precondition and pfs[0].vf_addresses[2] in text, text
    code, text = await refused(emu, "rdma_shared", [f"{pfs[2].address}/0", f"{pfs[0].address}/1"])
    assert code == precondition and f"{pfs[0].address}/1" in text, text

    # A required node gone from /dev (the group node of a vfio-pci VF): named, nothing written.
    group = node.dev_root / "vfio" / str(node.group(ex.vfio_vf))
    group.unlink()
    code, text = await refused(emu, "vfio_vf", [ex.vfio_vf])
    assert code == precondition and ex.vfio_vf in text and f"/dev/vfio/{group.name}" in text, text

    # A device-info file that cannot be written (its path is a directory): the files this
    # request already wrote are taken back.
    a, b = pfs[2].vf_addresses[1], pfs[2].vf_addresses[2]
    blocker = devinfo_path(node, "pack_vf", b)
    blocker.mkdir(parents=True)
    code, text = await refused(emu, "pack_vf", [a, b])
    assert code == precondition and str(node.devinfo_dir) in text, text
    assert [p.name for p in node.devinfo_dir.iterdir()] == [blocker.name]

    # Nothing half written anywhere: no device-info file, every CDI spec untouched.
    assert files(node.cdi_dir) == cdi_before
    blocker.rmdir()
    assert files(node.devinfo_dir) == {}

    # And the same requests go through once the node is whole again.
    group.touch()
    resp = await emu.allocate(res("vfio_vf"), [ex.vfio_vf])
    assert resp.envs[env_of("vfio_vf")] == ex.vfio_vf
    resp = await emu.allocate(pack, [a, b])
    assert resp.envs[env_of("pack_vf")] == f"{a},{b}"
    assert set(files(node.devinfo_dir)) == {
        devinfo_path(node, p, d).name for p, d in (("vfio_vf", ex.vfio_vf), ("pack_vf", a), ("pack_vf", b))
    }


# ------------------------------------------------------------------------------ preferred and pre-start


async def test_preferred_allocation_pack_and_spread(
    node: Node, kubelet: KubeletEmulator, daemon: Daemon
) -> None:
    pfs = node.layout.pfs
    numa0, numa1 = pfs[1], pfs[2]  # the pack pool's two PFs
    assert (numa0.numa_node, numa1.numa_node) == (0, 1)
    packed = list(numa0.vf_addresses + numa1.vf_addresses)
    spread_pfs = {a: pfs[3].address for a in pfs[3].vf_addresses[:2]}
    sf_vf0 = os.path.basename(os.readlink(node.function_path(node.ex.sf_pf) + "/virtfn0"))
    spread_pfs[sf_vf0] = node.ex.sf_pf

    emu = kubelet
    pack = res("pack_vf")
    # The kubelet sees each VF on its PF's NUMA node.
    numa = emu.updates(pack)[-1].numa
    assert {numa[a] for a in numa0.vf_addresses} == {(0,)}
    assert {numa[a] for a in numa1.vf_addresses} == {(1,)}
    # A must-include on NUMA node 1: the rest comes from its PF (and so its node).
    must = numa1.vf_addresses[2]
    got = await emu.preferred(pack, packed, [must], 3)
    assert got[0] == must and len(set(got)) == 3 and set(got) <= set(numa1.vf_addresses), got
    must = numa0.vf_addresses[3]
    got = await emu.preferred(pack, packed, [must], 4)
    assert got[0] == must and sorted(got) == sorted(numa0.vf_addresses), got
    # No must-include: the node with most free devices (node 0: 4 free against 2).
    available = list(numa1.vf_addresses[:2]) + list(numa0.vf_addresses)
    got = await emu.preferred(pack, available, [], 2)
    assert len(set(got)) == 2 and set(got) <= set(numa0.vf_addresses), got
    # More than one PF holds: the must-include's PF whole, then one more, never a duplicate.
    got = await emu.preferred(pack, packed, [numa1.vf_addresses[0]], 5)
    assert len(set(got)) == 5 and set(got) <= set(packed)
    assert set(numa1.vf_addresses) <= set(got), got

    spread = res("spread_vf")
    ids = list(spread_pfs)
    assert set(emu.devices(spread)) == set(ids)
    got = await emu.preferred(spread, ids, [], 2)
    assert len(got) == 2 and {spread_pfs[a] for a in got} == {pfs[3].address, node.ex.sf_pf}, got
    got = await emu.preferred(spread, ids, [ids[0]], 2)
    assert got == [ids[0], sf_vf0], got
    got = await emu.preferred(spread, ids, [], 3)
    assert sorted(got) == sorted(ids), got
    # Shared RDMA under pack: a pod's IDs stay on the must-include's HCA.
    shared = [f"{pf.address}/{k}" for pf in (pfs[0], pfs[2]) for k in (0, 1)]
    got = await emu.preferred(res("rdma_shared"), shared, [f"{pfs[2].address}/1"], 2)
    assert got == [f"{pfs[2].address}/1", f"{pfs[2].address}/0"], got
    # A pool with preferredAllocation none does not offer the call at all.
    with pytest.raises(KubeletError):
        await emu.preferred(res("uio_vf"), [node.ex.uio_vf], [], 1)


async def test_prestart_passes_while_healthy_and_fails_once_not(
    node: Node, kubelet: KubeletEmulator, daemon: Daemon
) -> None:
    pf0 = node.layout.pfs[0]
    vfs = list(pf0.vf_addresses[:2])
    r = res("kernel_vf")

    emu = kubelet
    await emu.allocate(r, vfs)
    await emu.prestart(r, vfs)
    with pytest.raises(KubeletError):  # not offered by a pool without preStart
        await emu.prestart(res("vfio_vf"), [node.ex.vfio_vf])
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await emu.prestart(r, ["0000:ff:1f.7"])
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "0000:ff:1f.7" in (err.value.details() or "")
    daemon.set_links([(pf0.netdev, False)])
    await emu.wait_for(lambda: set(emu.devices(r).values()) == {UNHEALTHY}, GUARD_S)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await emu.prestart(r, vfs)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert all(v in (err.value.details() or "") for v in vfs), err.value.details()


@pytest.fixture
def uio_node_missing(node: Node) -> Path:
    """udev has not created /dev/uio0 yet when the daemon starts (the driver was bound just before)."""
    uio = node.dev_root / node.ex.uio
    uio.unlink()
    return uio


async def test_a_node_that_appears_later_gets_its_cdi_entry_at_allocate(
    node: Node, uio_node_missing: Path, kubelet: KubeletEmulator, daemon: Daemon
) -> None:
    uio = uio_node_missing
    kind = node.kinds()["uio_vf"]
    spec = spec_path(node, "uio_vf")

    emu = kubelet
    # A device missing a required node gets no CDI entry; a pool with no entry has no spec.
    assert not spec.exists() and spec_path(node, "vfio_vf").exists()
    code, text = await refused(emu, "uio_vf", list(kind.ids))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and f"/dev/{node.ex.uio}" in text, text
    assert not spec.exists() and files(node.devinfo_dir) == {}
    uio.touch()
    resp = await emu.allocate(res("uio_vf"), list(kind.ids))
    check_response(kind, resp, cdi=True)
    # The runtime resolves the name the response carries: the spec holds it by now.
    assert unordered_nodes(json.loads(spec.read_text())) == unordered_nodes(expected_spec(kind))
    assert set(files(node.devinfo_dir)) == {devinfo_path(node, "uio_vf", d).name for d in kind.ids}


# ------------------------------------------------------------------- RDMA char devices read at Allocate


def move_class_device(node: Node, cls: str, name: str, src: str, dst: str, new_name: str) -> None:
    """Move a class device (``infiniband_verbs/uverbs3``) from one function to another, as re-creation does.

    The kernel removes the old class device and adds the new one under its parent function, with the
    ``class/<cls>/<name>`` link following; the char devices' own uevents (subsystems infiniband_verbs
    and infiniband_mad) are none of the ones densedev rescans on, and a simulated node sends none.
    """
    old = Path(node.function_path(src)) / cls / name
    new = Path(node.function_path(dst)) / cls / new_name
    new.parent.mkdir(exist_ok=True)
    old.rename(new)
    link = node.sysfs / "class" / cls / new_name
    link.unlink(missing_ok=True)
    link.symlink_to(os.path.relpath(new, link.parent))


def swap_char_devices(node: Node, a: str, b: str) -> None:
    """Give ``a`` the uverbs/umad of ``b`` and the other way round (a module reload's renumbering)."""
    na, nb = node.char_nodes(a), node.char_nodes(b)
    for kind, cls in (("uverbs", "infiniband_verbs"), ("umad", "infiniband_mad")):
        move_class_device(node, cls, na[kind], a, b, na[kind] + ".tmp")
        move_class_device(node, cls, nb[kind], b, a, nb[kind])
        move_class_device(node, cls, na[kind] + ".tmp", b, b, na[kind])
        (node.sysfs / "class" / cls / (na[kind] + ".tmp")).unlink()


async def test_rdma_char_devices_renumbered_after_start_are_read_at_allocate(
    node: Node, kubelet: KubeletEmulator, daemon: Daemon
) -> None:
    """ib_uverbs/ib_umad reloaded in another order: two VFs swap their char devices, one ibdev renamed.

    Discovery's record of VF a now names VF b's char devices: handing them out would give a's
    container b's RDMA device (held by another pod, maybe).  The SR-IOV plugin reads them at
    Allocate since v3.11 (its #565); so does densedev.
    """
    kinds = node.kinds()
    a, b = kinds["rdma_vf"].ids
    na, nb = node.char_nodes(a), node.char_nodes(b)
    swap_char_devices(node, a, b)
    (ibdev_a,) = os.listdir(node.function_path(a) + "/infiniband")
    (Path(node.function_path(a)) / "infiniband" / ibdev_a).rename(
        Path(node.function_path(a)) / "infiniband" / "rdma_vf_a"
    )
    assert node.char_nodes(a) == nb and node.char_nodes(b) == na
    # What each VF now has, read from the tree: a's container must get nb's nodes and the new name.
    section, nodes = node.rdma_parts(a, "rdma_vf_a")
    assert section["uverbs"] == f"/dev/infiniband/{nb['uverbs']}"

    resp = await kubelet.allocate(res("rdma_vf"), [a])
    name = env_of("rdma_vf")
    assert json.loads(resp.envs[f"{name}_INFO"]) == {a: {"generic": {"deviceID": a}, "rdma": section}}
    # CDI on (this module's default): the nodes travel in the spec the response names.
    assert [c.name for c in resp.cdi_devices] == [f"{res('rdma_vf')}={a}"]
    spec = json.loads(spec_path(node, "rdma_vf").read_text())
    (entry,) = [e for e in spec["devices"] if e["name"] == a]
    got = {(n["path"], n["hostPath"], n["permissions"]) for n in entry["containerEdits"]["deviceNodes"]}
    assert got == set(nodes)
    assert f"/dev/infiniband/{na['uverbs']}" not in {n[1] for n in got}
    doc = json.loads(devinfo_path(node, "rdma_vf", a).read_text())
    assert doc["pci"]["rdma-device"] == "rdma_vf_a"


@pytest.mark.parametrize("cdi", [False], ids=["devices"])
async def test_rdma_char_devices_read_at_allocate_without_cdi(
    node: Node, cdi: bool, kubelet: KubeletEmulator, daemon: Daemon
) -> None:
    """The same with CDI off: the response's device specs name the VF's char devices of now."""
    a, b = node.kinds()["rdma_vf"].ids
    swap_char_devices(node, a, b)
    (ibdev_a,) = os.listdir(node.function_path(a) + "/infiniband")
    _, nodes = node.rdma_parts(a, ibdev_a)
    resp = await kubelet.allocate(res("rdma_vf"), [a])
    assert list(resp.cdi_devices) == []
    assert {(d.container_path, d.host_path, d.permissions) for d in resp.devices} == set(nodes)


async def test_an_rdma_device_gone_after_start_is_refused_not_handed_out_bare(
    node: Node, kubelet: KubeletEmulator, daemon: Daemon
) -> None:
    """The VF's RDMA device left the host (a driver reset, or exclusive mode moved it to a pod's netns)."""
    kinds = node.kinds()
    a, b = kinds["rdma_vf"].ids
    fn = Path(node.function_path(a))
    for cls in ("infiniband", "infiniband_verbs", "infiniband_mad"):
        for name in os.listdir(fn / cls):
            link = node.sysfs / "class" / cls / name
            link.unlink()
        shutil.rmtree(fn / cls)
    code, text = await refused(kubelet, "rdma_vf", [a])
    assert code == grpc.StatusCode.FAILED_PRECONDITION and a in text, text
    assert not devinfo_path(node, "rdma_vf", a).exists()
    # The other VF is untouched and still allocates.
    resp = await kubelet.allocate(res("rdma_vf"), [b])
    assert env_of("rdma_vf") in resp.envs
