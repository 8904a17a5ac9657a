"""Selectors → pools: every selector key, ``#`` ranges, first pool wins, device types, shared RDMA pools, the
explain output, and agreement of the fast selection with the talkative per-device reasons (hypothesis)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from helpers.devices import unlinked as dev  # the selector tests' devices: linked to a PF only when said
from helpers.pools import THREE, VF_A, VF_B, VF_C, cfg, ids, select
from hypothesis import given, settings
from hypothesis import strategies as st

from densedev.model import Config, Device, Role
from densedev.pools import config
from densedev.pools import select as selectors

DATA = Path(__file__).parent / "data" / "configs"


def pf_with_vfs(bus: int, netdev: str, n: int, **kw: Any) -> list[Device]:
    """Return a PF ``0000:<bus>:00.0`` named ``netdev`` with ``n`` VFs (VF k at ``<bus>:<1+k//8>.<k%8>``)."""
    pf_id = f"0000:{bus:02x}:00.0"
    link = kw.pop("link_type", "ether")
    out = [
        dev(pf_id, Role.PF, total_vfs=64, num_vfs=n, netdevs=(netdev,), link_type=link, driver="mlx5_core")
    ]
    for k in range(n):
        out.append(
            dev(
                f"0000:{bus:02x}:{1 + k // 8:02x}.{k % 8}",
                pf=pf_id,
                vf_index=k,
                pf_netdev=netdev,
                netdevs=(f"{netdev}v{k}",),
                link_type=link,
                **kw,
            )
        )
    return out


# --- each key ------------------------------------------------------------------------------------------


def test_empty_selector_takes_every_device_of_the_type() -> None:
    assert select({}, THREE) == [VF_A.id, VF_B.id, VF_C.id]


def test_vendors_devices_drivers_or_within_and_across() -> None:
    assert select({"vendors": ["8086"]}, THREE) == [VF_A.id, VF_B.id]
    assert select({"vendors": ["8086", "15b3"]}, THREE) == [VF_A.id, VF_B.id, VF_C.id]
    assert select({"devices": ["10ed", "101e"]}, THREE) == [VF_B.id, VF_C.id]
    assert select({"drivers": ["vfio-pci"]}, THREE) == [VF_B.id]
    assert select({"vendors": ["8086"], "drivers": ["iavf", "mlx5_core"]}, THREE) == [VF_A.id]
    assert select({"vendors": ["8086"], "devices": ["101e"]}, THREE) == []


def test_pci_addresses_and_acpi_indexes() -> None:
    assert select({"pciAddresses": ["0000:3b:02.1", "5e:02.0"]}, THREE) == [VF_B.id, VF_C.id]
    nic = dev("0000:18:00.0", Role.PCI, acpi_index=196609, netdevs=("eno1",))
    other = dev("0000:18:00.1", Role.PCI, acpi_index=196610, netdevs=("eno2",))
    assert select({"acpiIndexes": ["196609"]}, [nic, other]) == [nic.id]


def test_pf_names_whole_pf_and_index_ranges() -> None:
    devices = pf_with_vfs(0x3B, "ens1f0", 10) + pf_with_vfs(0x3C, "ens1f1", 4)
    vfs0 = [d.id for d in devices if d.pf_netdev == "ens1f0"]
    vfs1 = [d.id for d in devices if d.pf_netdev == "ens1f1"]
    assert select({"pfNames": ["ens1f0"]}, devices) == vfs0
    assert select({"pfNames": ["ens1f0", "ens1f1"]}, devices) == vfs0 + vfs1
    assert select({"pfNames": ["ens1f0#0,2-4,9"]}, devices) == [vfs0[i] for i in (0, 2, 3, 4, 9)]
    # Two entries for one PF union their ranges; a bare name wins over any range.
    assert select({"pfNames": ["ens1f0#1", "ens1f0#8-20"]}, devices) == [vfs0[i] for i in (1, 8, 9)]
    assert select({"pfNames": ["ens1f0#1", "ens1f0"]}, devices) == vfs0
    assert select({"pfNames": ["ens9f9"]}, devices) == []


def test_root_devices_by_pf_address_with_ranges() -> None:
    devices = pf_with_vfs(0x3B, "ens1f0", 6) + pf_with_vfs(0x3C, "ens1f1", 6)
    vfs1 = [d.id for d in devices if d.pf == "0000:3c:00.0"]
    assert select({"rootDevices": ["0000:3c:00.0"]}, devices) == vfs1
    assert select({"rootDevices": ["3c:00.0#0-1,4"]}, devices) == [vfs1[i] for i in (0, 1, 4)]


def test_pf_names_and_root_devices_never_select_the_pf_itself() -> None:
    pf = dev("0000:3b:00.0", Role.PF, total_vfs=8, num_vfs=0, netdevs=("ens1f0",))
    assert select({"pfNames": ["ens1f0"]}, [pf]) == []
    assert select({"rootDevices": ["0000:3b:00.0"]}, [pf]) == []
    assert select({"pciAddresses": ["0000:3b:00.0"]}, [pf]) == [pf.id]


def test_vf_without_a_host_netdev_keeps_its_pool_by_pf_name_and_pf_link_type() -> None:
    # A VF bound to vfio-pci, or moved into a pod, has no netdev in the host: identity must not depend on it.
    devices = pf_with_vfs(0x3B, "ib0", 2, link_type="infiniband")
    moved = devices[2]._replace(netdevs=(), link_type="", driver="vfio-pci")
    devices[2] = moved
    assert select({"pfNames": ["ib0"], "linkTypes": ["infiniband"]}, devices) == [devices[1].id, moved.id]
    assert select({"linkTypes": ["ether"]}, devices) == []


def test_link_types() -> None:
    devices = pf_with_vfs(0x3B, "ens1f0", 2) + pf_with_vfs(0x3C, "ib0", 2, link_type="infiniband")
    assert select({"linkTypes": ["infiniband"]}, devices) == [d.id for d in devices[4:]]
    assert select({"linkTypes": ["ether"]}, devices) == [d.id for d in devices[1:3]]
    assert select({"linkTypes": ["ether", "infiniband"]}, devices) == [
        d.id for d in devices if d.role == Role.VF
    ]


def test_is_rdma_true_filters_false_does_not() -> None:
    rdma = VF_C._replace(rdma_device="mlx5_3")
    devices = [VF_A, VF_B, rdma]
    assert select({"isRdma": True}, devices) == [rdma.id]
    # As in the plugin, false is "no constraint", not "only non-RDMA devices".
    assert select({"isRdma": False}, devices) == [VF_A.id, VF_B.id, rdma.id]


def test_need_vhost_net_does_not_select() -> None:
    assert select({"needVhostNet": True}, THREE) == select({}, THREE)


def test_vdpa_type() -> None:
    vhost = VF_A._replace(vdpa="vdpa0", vdpa_driver="vhost_vdpa")
    virtio = VF_B._replace(vdpa="vdpa1", vdpa_driver="virtio_vdpa")
    devices = [vhost, virtio, VF_C]
    assert select({"vdpaType": "vhost"}, devices) == [vhost.id]
    assert select({"vdpaType": "virtio"}, devices) == [virtio.id]


def test_unsupported_pkeys_and_ddp_profiles_select_nothing() -> None:
    assert select({"pKeys": ["0x7fff"]}, THREE) == []
    assert select({"ddpProfiles": ["GTP"]}, THREE) == []
    # ... but the other selectors of the pool still work.
    assert select([{"pKeys": ["0x1"]}, {"vendors": ["15b3"]}], THREE) == [VF_C.id]


# --- device types --------------------------------------------------------------------------------------


def test_net_device_skips_pfs_with_vfs_enabled_and_non_network_functions() -> None:
    busy = dev("0000:3b:00.0", Role.PF, total_vfs=8, num_vfs=2, netdevs=("ens1f0",))
    idle = dev("0000:3c:00.0", Role.PF, total_vfs=8, num_vfs=0, netdevs=("ens2f0",))
    plain = dev("0000:18:00.0", Role.PCI, netdevs=("eno1",))
    ib = dev("0000:d8:00.0", Role.PCI, pci_class="020700", link_type="infiniband", netdevs=("ib0",))
    qat = dev("0000:6b:00.0", Role.PF, vendor="8086", device="4940", pci_class="0b4000", driver="4xxx")
    fpga = dev("0000:af:00.0", Role.PCI, vendor="8086", device="0d90", pci_class="120000", driver="vfio-pci")
    sf = dev("mlx5_core.sf.2", Role.SF, pf="0000:3b:00.0", pf_netdev="ens1f0", aux_type="sf")
    port = dev("0000:3a:00.0", Role.PCI, vendor="8086", device="347a", pci_class="060400", driver="pcieport")
    devices = [busy, idle, plain, ib, qat, fpga, sf, port]
    assert select({}, devices) == [plain.id, idle.id, ib.id]
    # accelerator: any PCI function that matches, PFs with VFs included; never a bridge or a subfunction.
    assert select({}, devices, deviceType="accelerator") == sorted(
        d.id for d in devices if d.role != Role.SF and d is not port
    )
    assert select({"vendors": ["8086"]}, devices, deviceType="accelerator") == [qat.id, fpga.id]


def test_aux_net_device_takes_subfunctions_by_type_parent_and_parent_address() -> None:
    sfs = [
        dev(f"mlx5_core.sf.{n}", Role.SF, pf="0000:03:00.0", pf_netdev="p0", aux_type="sf", vf_index=-1)
        for n in (2, 10, 3)
    ]
    other = dev("mlx5_core.sf.4", Role.SF, pf="0000:03:00.1", pf_netdev="p1", aux_type="sf")
    vf = VF_C
    devices = [*sfs, other, vf]
    aux = {"deviceType": "auxNetDevice"}
    # Subfunction names sort naturally: sf.2, sf.3, sf.10.
    assert select({"auxTypes": ["sf"]}, devices, **aux) == [
        "mlx5_core.sf.2",
        "mlx5_core.sf.3",
        "mlx5_core.sf.4",
        "mlx5_core.sf.10",
    ]
    assert select({"auxTypes": ["eth"]}, devices, **aux) == []
    assert select({"pciAddresses": ["0000:03:00.1"]}, devices, **aux) == [other.id]
    assert select({"pfNames": ["p0"]}, devices, **aux) == [
        "mlx5_core.sf.2",
        "mlx5_core.sf.3",
        "mlx5_core.sf.10",
    ]
    assert select({"rootDevices": ["0000:03:00.1"]}, devices, **aux) == [other.id]
    # A ranged pfNames matches an SF by vf_index, which discovery sets only when it knows the SF number.
    numbered = other._replace(vf_index=1)
    assert select({"pfNames": ["p1#1"]}, [*sfs, numbered], **aux) == [numbered.id]
    assert select({"pfNames": ["p0#1"]}, devices, **aux) == []


def test_dpu_subfunction_example_config() -> None:
    conf = config.load(DATA / "plugin_dpu_sf.json")
    sf0 = dev(
        "mlx5_core.sf.2", Role.SF, device="a2dc", pf="0000:03:00.0", pf_netdev="p0", vf_index=1, aux_type="sf"
    )
    sf1 = dev(
        "mlx5_core.sf.3", Role.SF, device="a2dc", pf="0000:03:00.1", pf_netdev="p1", vf_index=1, aux_type="sf"
    )
    p0, p1 = selectors.build_pools(conf, [sf1, sf0])
    assert (ids(p0), ids(p1)) == ([sf0.id], [sf1.id])


# --- ordering, lists of selectors, first pool wins -----------------------------------------------------


def test_members_are_in_address_order_whatever_the_input_order() -> None:
    devices = pf_with_vfs(0x3B, "ens1f0", 20)
    shuffled = devices[::-1]
    assert select({}, shuffled) == sorted(d.id for d in devices if d.role == Role.VF)


def test_selector_list_is_a_union_without_duplicates() -> None:
    sel = [{"vendors": ["8086"]}, {"drivers": ["vfio-pci", "mlx5_core"]}]
    assert select(sel, THREE) == [VF_A.id, VF_B.id, VF_C.id]
    assert select([{"drivers": ["mlx5_core"]}, {"drivers": ["iavf"]}], THREE) == [VF_A.id, VF_C.id]


def test_first_pool_in_config_order_wins() -> None:
    devices = pf_with_vfs(0x3B, "ens1f0", 8)
    conf = cfg(
        {"resourceName": "low", "selectors": {"pfNames": ["ens1f0#0-3"]}},
        {"resourceName": "all", "selectors": {"pfNames": ["ens1f0"]}},
        {"resourceName": "again", "selectors": [{"vendors": ["15b3"]}, {"pfNames": ["ens1f0#0"]}]},
    )
    low, rest, again = selectors.build_pools(conf, devices)
    vfs = [d.id for d in devices[1:]]
    assert ids(low) == vfs[:4]
    assert ids(rest) == vfs[4:]
    assert ids(again) == []
    assert [p.config.resource_name for p in (low, rest, again)] == ["low", "all", "again"]
    # Swapping the order swaps who wins.
    conf2 = cfg(
        {"resourceName": "all", "selectors": {"pfNames": ["ens1f0"]}},
        {"resourceName": "low", "selectors": {"pfNames": ["ens1f0#0-3"]}},
    )
    first, second = selectors.build_pools(conf2, devices)
    assert (ids(first), ids(second)) == (vfs, [])


def test_current_readme_config_over_a_mixed_node() -> None:
    conf = config.load(DATA / "plugin_readme_current.json")
    intel = pf_with_vfs(0x3B, "enp0s0f0", 4, vendor="8086", device="154c", driver="iavf")
    intel[3] = intel[3]._replace(driver="vfio-pci", netdevs=(), link_type="")
    mlx = pf_with_vfs(0x5E, "ens2f0", 2, device="1018", driver="mlx5_ib", rdma="mlx5_2")
    ib = pf_with_vfs(0x86, "ib0", 2, device="101e", driver="mlx5_core", link_type="infiniband")
    ib = [ib[0]] + [d._replace(rdma_device=f"mlx5_{9 + i}") for i, d in enumerate(ib[1:])]
    vdpa = dev("0000:af:02.0", pf="0000:af:00.0", vf_index=0, vdpa="vdpa0", vdpa_driver="virtio_vdpa")
    fpga = dev("0000:b1:00.0", Role.PCI, vendor="8086", device="0d90", pci_class="120000", driver="vfio-pci")
    pools = {
        p.config.resource_name: ids(p) for p in selectors.build_pools(conf, [*intel, *mlx, *ib, vdpa, fpga])
    }
    assert pools == {
        "intel_sriov_netdevice": [d.id for d in intel[1:3]] + [intel[4].id],
        "intel_sriov_dpdk": [intel[3].id],
        "mlnx_sriov_rdma": [d.id for d in mlx[1:]],
        "infiniband_rdma_netdevs": [d.id for d in ib[1:]],
        "ct6wind_sriov_vdpa_virtio": [vdpa.id],
        "intel_fpga": [fpga.id],
        "mlnx_sf": [],
    }


# --- shared RDMA pools ---------------------------------------------------------------------------------


def test_shared_rdma_pool_expands_each_rdma_device_into_ids() -> None:
    hca0 = dev("0000:5e:00.0", Role.PCI, rdma="mlx5_0", netdevs=("ens5f0",))
    hca1 = dev("0000:5e:00.1", Role.PCI, rdma="mlx5_1", netdevs=("ens5f1",))
    plain = dev("0000:5e:00.2", Role.PCI, netdevs=("ens5f2",))
    conf = cfg(
        {"resourceName": "shared", "rdmaShared": 3, "selectors": {"vendors": ["15b3"]}},
        {"resourceName": "rest", "selectors": {"vendors": ["15b3"]}},
    )
    shared, rest = selectors.build_pools(conf, [hca1, plain, hca0])
    assert ids(shared) == [
        "0000:5e:00.0/0",
        "0000:5e:00.0/1",
        "0000:5e:00.0/2",
        "0000:5e:00.1/0",
        "0000:5e:00.1/1",
        "0000:5e:00.1/2",
    ]
    assert [m.device for m in shared.members] == [hca0] * 3 + [hca1] * 3
    assert selectors.shared_id("0000:5e:00.0", 2) == "0000:5e:00.0/2"
    # The device without RDMA is not consumed by the shared pool: the next pool takes it.
    assert ids(rest) == [plain.id]


def test_shared_ids_keep_numeric_order_past_ten() -> None:
    hca = dev("0000:5e:00.0", Role.PCI, rdma="mlx5_0", netdevs=("ens5f0",))
    (pool,) = selectors.build_pools(cfg({"resourceName": "s", "rdmaShared": 12}), [hca])
    assert ids(pool) == [f"0000:5e:00.0/{k}" for k in range(12)]


# --- explain and the table -----------------------------------------------------------------------------


def test_explain_schema_and_reasons() -> None:
    devices = [
        *pf_with_vfs(0x3B, "ens1f0", 3, rdma=""),
        dev("0000:18:00.0", Role.PCI, vendor="8086", driver="", netdevs=()),
        dev("mlx5_core.sf.1", Role.SF, pf="0000:3b:00.0", pf_netdev="ens1f0", aux_type="sf"),
    ]
    devices[2] = devices[2]._replace(rdma_device="mlx5_4", numa_node=-1)
    conf = cfg(
        {"resourceName": "first", "resourcePrefix": "nvidia.com", "selectors": {"pfNames": ["ens1f0#0"]}},
        {"resourceName": "second", "selectors": [{"vendors": ["15b3"]}, {"drivers": ["ice"]}]},
    )
    out = selectors.explain(conf, devices)
    json.dumps(out)  # plain JSON types only
    assert out["devices"] == 6
    assert out["unpooled"] == ["0000:18:00.0", "0000:3b:00.0", "mlx5_core.sf.1"]
    first, second = out["pools"]
    assert first["resource"] == "nvidia.com/first"
    assert (first["device_type"], first["rdma_shared"], first["count"]) == ("netDevice", 0, 1)
    assert first["devices"] == [
        {
            "id": "0000:3b:01.0",
            "device_id": "0000:3b:01.0",
            "role": "vf",
            "vendor": "15b3",
            "device_code": "101e",
            "driver": "mlx5_core",
            "numa": 0,
            "pf": "0000:3b:00.0",
            "vf_index": 0,
            "netdev": "ens1f0v0",
            "link_type": "ether",
            "rdma_device": None,
            "pcie_root": "pci0000:3b",
        }
    ]
    reasons = {e["id"]: e["reason"] for e in first["excluded"]}
    assert reasons == {
        "0000:18:00.0": "pfNames: not a VF or SF (no parent PF)",
        "0000:3b:00.0": "PF with 3 VFs enabled: netDevice pools skip it (its VFs are the devices)",
        "0000:3b:01.1": "pfNames: index 1 of ens1f0 not in the selected range",
        "0000:3b:01.2": "pfNames: index 2 of ens1f0 not in the selected range",
        "mlx5_core.sf.1": "a subfunction: only auxNetDevice pools take SFs, this pool is netDevice",
    }
    assert [d["id"] for d in second["devices"]] == ["0000:3b:01.1", "0000:3b:01.2"]
    assert second["devices"][0]["numa"] is None and second["devices"][0]["rdma_device"] == "mlx5_4"
    reasons2 = {e["id"]: e["reason"] for e in second["excluded"]}
    assert reasons2["0000:3b:01.0"] == (
        "taken by nvidia.com/first (a device joins the first pool that selects it)"
    )
    assert reasons2["0000:18:00.0"] == (
        "no selector matches: selectors[0] vendors: 8086 not in [15b3]; "
        "selectors[1] drivers: unbound not in [ice]"
    )


def test_format_explain_shows_devices_and_counts_exclusions() -> None:
    devices = pf_with_vfs(0x3B, "ens1f0", 6)
    conf = cfg({"resourceName": "half", "selectors": {"pfNames": ["ens1f0#0-2"]}})
    text = selectors.format_explain(selectors.explain(conf, devices))
    lines = text.splitlines()
    assert lines[0] == "intel.com/half (netDevice): 3 IDs"
    assert lines[1].split() == ["id", "numa", "pf", "vf_index", "driver", "netdev", "rdma_device"]
    assert lines[2].split() == ["0000:3b:01.0", "0", "0000:3b:00.0", "0", "mlx5_core", "ens1f0v0", "-"]
    pf_line = "  excluded 1: PF with 6 VFs enabled: netDevice pools skip it (its VFs are the devices)"
    assert f"{pf_line} (0000:3b:00.0)" in lines
    # Reasons that name the VF index differ per device, so each is its own line.
    assert "  excluded 1: pfNames: index 3 of ens1f0 not in the selected range (0000:3b:01.3)" in lines
    assert lines[-1] == "7 devices, 4 in no pool"


def test_explain_carries_config_warnings() -> None:
    conf = config.load(DATA / "plugin_full_schema.json")
    out = selectors.explain(conf, THREE)
    assert len(out["warnings"]) == 2
    assert selectors.format_explain(out).startswith("warning: resourceList[0] (sriov_net_A): selectors.pKeys")


# --- the fast selection agrees with the per-device reasons (hypothesis) --------------------------------

_VENDORS = ("15b3", "8086")
_DRIVERS = ("mlx5_core", "iavf", "vfio-pci", "")
_NETDEVS = ("ens1f0", "ens1f1", "ib0")


@st.composite
def device_tables(draw: st.DrawFn) -> list[Device]:
    out: list[Device] = []
    for p in range(draw(st.integers(0, 3))):
        bus = 0x10 + p
        pf_id = f"0000:{bus:02x}:00.0"
        name = _NETDEVS[p % 3]
        link = "infiniband" if name == "ib0" else "ether"
        n = draw(st.integers(0, 6))
        out.append(
            dev(
                pf_id,
                Role.PF,
                vendor=draw(st.sampled_from(_VENDORS)),
                num_vfs=n,
                total_vfs=8,
                netdevs=(name,),
                link_type=link,
                rdma=draw(st.sampled_from(("", f"mlx5_{p}"))),
                pci_class=draw(st.sampled_from(("020000", "120000"))),
            )
        )
        for k in range(n):
            has_net = draw(st.booleans())
            out.append(
                dev(
                    f"0000:{bus:02x}:01.{k}",
                    vendor=draw(st.sampled_from(_VENDORS)),
                    device=draw(st.sampled_from(("101e", "154c"))),
                    driver=draw(st.sampled_from(_DRIVERS)),
                    pf=pf_id,
                    vf_index=k,
                    pf_netdev=name,
                    netdevs=(f"{name}v{k}",) if has_net else (),
                    link_type=link if has_net else "",
                    rdma=draw(st.sampled_from(("", f"mlx5_{p}{k}"))),
                    vdpa_driver=draw(st.sampled_from(("", "vhost_vdpa", "virtio_vdpa"))),
                )
            )
    for n in range(draw(st.integers(0, 3))):
        out.append(
            dev(
                f"mlx5_core.sf.{n}",
                Role.SF,
                pf="0000:10:00.0",
                pf_netdev="ens1f0",
                aux_type="sf",
                vf_index=draw(st.integers(-1, 2)),
            )
        )
    if draw(st.booleans()):
        out.append(dev("0000:0f:00.0", Role.PCI, vendor="15b3", pci_class="060400", driver="pcieport"))
    return draw(st.permutations(out))


_selector_dicts = st.fixed_dictionaries(
    {},
    optional={
        "vendors": st.lists(st.sampled_from(_VENDORS), min_size=1, max_size=2),
        "drivers": st.lists(st.sampled_from(_DRIVERS[:3]), min_size=1, max_size=2),
        "pfNames": st.lists(
            st.sampled_from(("ens1f0", "ens1f1#0-2", "ib0#1,3", "ens1f0#4-5", "nope")), min_size=1, max_size=2
        ),
        "rootDevices": st.lists(
            st.sampled_from(("0000:10:00.0", "0000:11:00.0#0,2")), min_size=1, max_size=2
        ),
        "linkTypes": st.lists(st.sampled_from(("ether", "infiniband")), min_size=1, max_size=1),
        "isRdma": st.booleans(),
        "pciAddresses": st.lists(
            st.sampled_from(("0000:10:01.0", "0000:11:00.0", "0000:10:00.0")), min_size=1
        ),
    },
)


@st.composite
def configs(draw: st.DrawFn) -> Config:
    pools = []
    for i in range(draw(st.integers(1, 4))):
        device_type = draw(st.sampled_from(("netDevice", "accelerator", "auxNetDevice")))
        sels = draw(st.lists(_selector_dicts, min_size=1, max_size=3))
        if device_type == "accelerator":
            sels = [
                {k: v for k, v in s.items() if k not in ("pfNames", "rootDevices", "linkTypes")} for s in sels
            ]
        if device_type == "auxNetDevice":
            sels = [{**s, "auxTypes": ["sf"]} for s in sels]
        pools.append(
            {
                "resourceName": f"p{i}",
                "deviceType": device_type,
                "selectors": sels,
                "rdmaShared": draw(st.sampled_from((0, 0, 2))),
            }
        )
    return cfg(*pools)


def reference_pools(conf: Config, devices: Sequence[Device]) -> list[list[str]]:
    """Select one device at a time with the explain path's reasons: the slow spec of build_pools."""
    pf_link = {d.id: d.link_type for d in devices if d.link_type and d.role != Role.SF}
    taken: set[str] = set()
    out = []
    for pc in conf.pools:
        chosen = [d for d in devices if d.id not in taken and selectors.pool_reason(pc, d, pf_link) is None]
        chosen.sort(
            key=lambda d: (d.role == Role.SF, selectors._natural(d.id) if d.role == Role.SF else d.id)
        )
        taken.update(d.id for d in chosen)
        k = pc.rdma_shared
        out.append(
            [selectors.shared_id(d.id, i) for d in chosen for i in range(k)] if k else [d.id for d in chosen]
        )
    return out


@settings(max_examples=150, deadline=None)
@given(device_tables(), configs())
def test_build_pools_agrees_with_the_per_device_reasons(devices: list[Device], conf: Config) -> None:
    fast = [ids(p) for p in selectors.build_pools(conf, devices)]
    assert fast == reference_pools(conf, devices)
    out = selectors.explain(conf, devices)
    for pool, got in zip(out["pools"], fast, strict=True):
        assert [d["id"] for d in pool["devices"]] == got
        # Every device is either in the pool or excluded with a reason, never both.
        in_pool = {d["device_id"] for d in pool["devices"]}
        excluded = {e["id"] for e in pool["excluded"]}
        assert in_pool | excluded == {d.id for d in devices}
        assert not in_pool & excluded


# --- end to end: simulated sysfs tree → discovery → pools ----------------------------------------------


def test_simulated_node_to_pools(tmp_path: Path) -> None:
    from densedev.node import scanner as discovery
    from densedev.testing import simnode

    layout = simnode.build_node(tmp_path / "sys", pfs=2, vfs_per_pf=8, rdma=True, extras=True)
    extras = layout.extras
    assert extras is not None
    pf0, pf1 = layout.pfs
    conf = cfg(
        {"resourceName": "p0_low", "selectors": {"pfNames": [f"{pf0.netdev}#0-3"]}},
        {"resourceName": "p1_by_root", "selectors": {"rootDevices": [f"{pf1.address}#2,4-5"]}},
        {"resourceName": "mlx_rest", "selectors": {"vendors": ["15b3"], "devices": ["101e"], "isRdma": True}},
        {
            "resourceName": "intel_dpdk",
            "selectors": {"vendors": ["8086"], "drivers": ["vfio-pci", "igb_uio"]},
        },
        {
            "resourceName": "qat",
            "deviceType": "accelerator",
            "selectors": {"vendors": ["8086"], "devices": ["4941"]},
        },
        {"resourceName": "sf", "deviceType": "auxNetDevice", "selectors": {"auxTypes": ["sf"]}},
        {"resourceName": "ib_shared", "rdmaShared": 2, "selectors": {"linkTypes": ["infiniband"]}},
        {"resourceName": "plain", "selectors": {"drivers": ["igb"]}},
    )

    def pools_now() -> dict[str, list[str]]:
        table = discovery.scan(tmp_path / "sys")
        assert table.warnings == ()
        return {p.config.resource_name: ids(p) for p in selectors.build_pools(conf, table.devices)}

    pools = pools_now()
    assert pools["p0_low"] == list(pf0.vf_addresses[:4])
    assert pools["p1_by_root"] == [pf1.vf_addresses[i] for i in (2, 4, 5)]
    taken = set(pools["p0_low"]) | set(pools["p1_by_root"])
    mlx_vfs = [a for a in (*pf0.vf_addresses, *pf1.vf_addresses) if a not in taken]
    assert set(mlx_vfs) <= set(pools["mlx_rest"])
    assert pools["intel_dpdk"] == sorted([extras.uio_vf, extras.vfio_vf, extras.noiommu_vf])
    assert pools["qat"] == list(extras.accel_vfs)
    assert pools["sf"] == list(extras.sfs)
    assert pools["ib_shared"] == [f"{extras.ib_pf}/0", f"{extras.ib_pf}/1"]
    assert pools["plain"] == [extras.plain]
    # No PF with VFs enabled is in a netDevice pool.
    assert pf0.address not in pools["mlx_rest"] and pf1.address not in pools["mlx_rest"]

    # A VF whose interface moved into a pod keeps its ID and its pool (its PF still names it).
    simnode.move_netdev_to_pod(tmp_path / "sys", pf0.vf_addresses[1])
    assert pools_now()["p0_low"] == list(pf0.vf_addresses[:4])

    # Fewer VFs on PF 1: the range pool shrinks, nothing else moves.
    simnode.set_num_vfs(tmp_path / "sys", pf1.address, 0)
    remaining = simnode.set_num_vfs(tmp_path / "sys", pf1.address, 5)
    after = pools_now()
    assert after["p1_by_root"] == [remaining[i] for i in (2, 4)]
    assert after["p0_low"] == pools["p0_low"]
