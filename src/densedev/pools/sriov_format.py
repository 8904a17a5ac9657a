"""The SR-IOV network device plugin's ``config.json`` (``resourceList``) plus densedev's own keys.

Any file that plugin accepts loads here unchanged (see ``docs/config.md``); densedev's additions are
optional keys with defaults, so old files stay valid.  Everything is checked at load, never at match
time, and every problem found is reported at once, each naming the pool, the key and the reason.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .. import pci
from ..model import (
    DEFAULT_DRIVER_NAME,
    Config,
    DeviceType,
    HealthPolicy,
    IndexRange,
    IndexSpans,
    PoolApi,
    PoolConfig,
    Preferred,
    Selector,
    VdpaType,
)
from ..printable import clip
from .validator import (
    DNS_SUBDOMAIN_RE,
    HEX16_RE,
    TIMING_KEYS,
    Reader,
    check_unique,
    compat_ids,
    compat_link_types,
    env_var_name,
    interface_name_problem,
    join,
    read_timing,
    type_name,
    validate_resource_name,
)

PLUGIN = "the SR-IOV network device plugin"
DEVICE_TYPES = tuple(DeviceType)
PREFERRED_POLICIES = tuple(Preferred)
VDPA_TYPES = tuple(VdpaType)
MAX_VF_INDEX = 65535  # the SR-IOV capability's NumVFs/TotalVFs are 16-bit registers
MAX_RDMA_SHARED = 65535
# The SR-IOV plugin's pciAddresses and rootDevices: the kernel's address, domain optional, any case.
_PCI_ADDRESS_RE = re.compile(
    rf"(?:({pci.DOMAIN}):)?({pci.BUS}):({pci.DEVICE})\.({pci.FUNCTION})", re.IGNORECASE
)

# Keys of internal Go structs that leak into files the SR-IOV network operator marshals from the plugin's
# own types; the plugin ignores them and so do we, as long as they are null.
_GO_INTERNAL_KEYS = ("SelectorObj", "SelectorObjs")

# isRdma is common here (the plugin has it for net devices only): accelerator-type shared RDMA pools use it.
_COMMON_SELECTOR_KEYS = ("vendors", "devices", "drivers", "pciAddresses", "acpiIndexes", "isRdma")
_NET_SELECTOR_KEYS = ("pfNames", "rootDevices", "linkTypes")
_SELECTOR_KEYS_BY_TYPE: dict[DeviceType, tuple[str, ...]] = {
    # The plugin's selector struct depends on deviceType; a key of another type is almost always a
    # forgotten deviceType, so it is reported rather than silently ignored as Go's decoder would.
    DeviceType.NET_DEVICE: (
        *_COMMON_SELECTOR_KEYS,
        *_NET_SELECTOR_KEYS,
        "needVhostNet",
        "vdpaType",
        "pKeys",
        "ddpProfiles",
    ),
    DeviceType.ACCELERATOR: _COMMON_SELECTOR_KEYS,
    # needVhostNet on subfunctions: the plugin's v3.11 (its PR #682) accepts it there too.
    DeviceType.AUX_NET_DEVICE: (*_COMMON_SELECTOR_KEYS, *_NET_SELECTOR_KEYS, "needVhostNet", "auxTypes"),
}
_ALL_SELECTOR_KEYS = tuple(dict.fromkeys(k for keys in _SELECTOR_KEYS_BY_TYPE.values() for k in keys))
_POOL_KEYS = (
    "resourceName",
    "resourcePrefix",
    "deviceType",
    "excludeTopology",
    "additionalInfo",
    "selectors",
    "isRdma",  # legacy: the plugin's early README put it beside resourceName
    "rdmaShared",
    "healthPolicy",
    "preferredAllocation",
    "preStart",
    "api",
    *_GO_INTERNAL_KEYS,
)
_TOP_KEYS = ("resourceList", *TIMING_KEYS, "draDriverName")
_HEALTH_KEYS = ("pfLink", "ownLink", "rdmaPort", "driver", "holdDownSeconds")


def parse_index_range(text: str) -> IndexRange:
    """Parse a ``pfNames``/``rootDevices`` value like ``"ens1f0#0,2-7"``; raise ValueError saying why not.

    The indexes stay spans (``0-65535`` is one pair of ints), so a file costs memory in proportion to
    its own size, never to the number of VFs its ranges name.
    """
    name, sep, ranges = text.partition("#")
    if not name:
        raise ValueError(f'bad VF range "{clip(text)}": no name before "#"')
    if not sep:
        return IndexRange(name)
    if not ranges:
        raise ValueError(f'bad VF range "{clip(text)}": no VF index after "#"')
    spans: list[tuple[int, int]] = []
    for item in ranges.split(","):
        start_s, dash, end_s = item.partition("-")
        if not item:
            raise ValueError(f'bad VF range "{clip(text)}": empty item in the list')
        start = _vf_index(text, start_s)
        end = _vf_index(text, end_s) if dash else start
        if start > end:
            raise ValueError(f'bad VF range "{clip(text)}": start > end')
        spans.append((start, end))
    return IndexRange(name, IndexSpans.of(spans))


def _vf_index(text: str, s: str) -> int:
    if not s.isdigit() or not s.isascii():
        raise ValueError(
            f'bad VF range "{clip(text)}": "{clip(s)}" is not a VF index (a non-negative integer)'
        )
    # Checked by length first: int() of a megabyte of digits is slow (and refused past 4,300 digits);
    # leading zeros are no reason to refuse (Go's strconv.Atoi, which the plugin uses, accepts them).
    digits = s.lstrip("0") or "0"
    value = int(digits) if len(digits) <= 6 else MAX_VF_INDEX + 1
    if value > MAX_VF_INDEX:
        raise ValueError(
            f'bad VF range "{clip(text)}": index {clip(s, 12)} above {MAX_VF_INDEX} '
            "(SR-IOV has 16-bit VF counts)"
        )
    return value


def normalize_pci_address(text: str) -> str | None:
    """Return ``text`` as a full lower-case PCI address (``0000:3b:02.1``, domain added), or None."""
    m = _PCI_ADDRESS_RE.fullmatch(text)
    if m is None:
        return None
    domain, bus, dev, fn = m.groups()
    return f"{(domain or '0000').lower()}:{bus.lower()}:{dev.lower()}.{fn}"


def _pkey(text: str) -> str | None:
    if not HEX16_RE.fullmatch(text):
        return None
    return f"0x{int(text, 16):04x}"


def _acpi_index(text: str) -> str | None:
    # The kernel prints acpi_index as an unsigned decimal (pci-sysfs.c acpi_index_show).
    if not text.isascii() or not text.isdigit():
        return None
    return str(int(text))


def _one_of(choices: Sequence[str]) -> Callable[[str], str | None]:
    return lambda text: text if text in choices else None


def _parse_selector(
    r: Reader, obj: Any, where: str, device_type: DeviceType, legacy_rdma: bool | None
) -> Selector | None:
    if not isinstance(obj, Mapping):
        r.problem(where, f"expected a selector object, got {type_name(obj)}")
        return None
    f = r.fields(obj, _ALL_SELECTOR_KEYS, where)
    allowed = _SELECTOR_KEYS_BY_TYPE[device_type]
    for key in f:
        if key not in allowed:
            users = [t for t, keys in _SELECTOR_KEYS_BY_TYPE.items() if key in keys]
            r.problem(
                join(where, key),
                f'not a selector of deviceType "{device_type}" (only of {", ".join(users)})',
            )
    kw: dict[str, Any] = {}
    if "vendors" in f:
        kw["vendors"] = compat_ids(r, f["vendors"], join(where, "vendors"), "vendor", PLUGIN)
    if "devices" in f:
        kw["devices"] = compat_ids(r, f["devices"], join(where, "devices"), "device", PLUGIN)
    if "drivers" in f:
        kw["drivers"] = r.strings(f["drivers"], join(where, "drivers"))
    if "pciAddresses" in f:
        kw["pci_addresses"] = r.strings(
            f["pciAddresses"],
            join(where, "pciAddresses"),
            normalize_pci_address,
            "a PCI address (0000:3b:02.1)",
        )
    if "acpiIndexes" in f:
        kw["acpi_indexes"] = r.strings(
            f["acpiIndexes"], join(where, "acpiIndexes"), _acpi_index, "an ACPI index (a decimal number)"
        )
    for key, attr, is_pci in (("pfNames", "pf_names", False), ("rootDevices", "root_devices", True)):
        if key in f:
            kw[attr] = _parse_ranges(r, f[key], join(where, key), is_pci)
    if "linkTypes" in f:
        kw["link_types"] = compat_link_types(r, f["linkTypes"], join(where, "linkTypes"))
    if "isRdma" in f:
        kw["is_rdma"] = r.boolean(f["isRdma"], join(where, "isRdma"), False)
    elif legacy_rdma is not None:
        kw["is_rdma"] = legacy_rdma
    if "needVhostNet" in f:
        kw["need_vhost_net"] = r.boolean(f["needVhostNet"], join(where, "needVhostNet"), False)
    if "vdpaType" in f:
        text = r.string(f["vdpaType"], join(where, "vdpaType"))
        if text is not None and text not in VDPA_TYPES:
            r.problem(join(where, "vdpaType"), f'"{clip(text)}" is not one of {", ".join(VDPA_TYPES)}')
        elif text is not None:
            kw["vdpa_type"] = VdpaType(text)
    if "pKeys" in f:
        kw["pkeys"] = r.strings(f["pKeys"], join(where, "pKeys"), _pkey, "a partition key (0x7fff)")
        if kw["pkeys"]:
            r.warn(
                f"{join(where, 'pKeys')}: not supported (the device table has no partition keys); "
                "this selector matches no device"
            )
    if "auxTypes" in f:
        kw["aux_types"] = r.strings(f["auxTypes"], join(where, "auxTypes"))
    _compat_selector_warnings(r, f, kw, where, device_type)
    if "ddpProfiles" in f:
        kw["ddp_profiles"] = r.strings(f["ddpProfiles"], join(where, "ddpProfiles"))
        if kw["ddp_profiles"]:
            r.warn(
                f"{join(where, 'ddpProfiles')}: not supported (densedev does not query DDP profiles "
                "with devlink or ddptool); this selector matches no device"
            )
    return Selector(**kw)


# ------------------------------------------------------------------------ SR-IOV plugin compatibility
# A file the SR-IOV network device plugin loads must load here, selecting what it selects; what it would
# refuse at start (or crash on) is accepted when the kubelet accepts it, with a warning, because mixed
# fleets and rollbacks run the same ConfigMap through both.  `check-config --strict` turns the warnings
# into errors.  Each rule below cites what the Go plugin does (pkg/resources, pkg/utils, pkg/types).

_GO_REFUSES = "which the SR-IOV network device plugin refuses (it would not start with this file)"
_GO_NAME_RE = re.compile(r"[a-zA-Z0-9_-]+")  # its resourceName check (pkg/resources/server.go)


def _compat_name_warnings(r: Reader, where: str, name: str, full: str) -> None:
    """Warn about names the kubelet accepts but that trouble shells or the Go plugin."""
    if "-" in full:
        # The Go plugin keeps the "-" in the variable (its own tests assert "sriov-net_0" valid): Go
        # programs and CNIs read such variables through the environment fine; only shells cannot.
        r.warn(
            f'{where}: resourceName/resourcePrefix: the container gets {env_var_name(full)} (with "-", as '
            "the SR-IOV network device plugin names it); programs read it, shell scripts cannot"
        )
    if not _GO_NAME_RE.fullmatch(name):
        r.warn(f'{where}: resourceName: "{name}" has characters outside [a-zA-Z0-9_-], {_GO_REFUSES}')


def _compat_selector_warnings(
    r: Reader, f: Mapping[str, Any], kw: Mapping[str, Any], where: str, device_type: DeviceType
) -> None:
    """Warn about selectors the Go plugin refuses at start, and auxTypes that select nothing."""
    if kw.get("is_rdma") and kw.get("vdpa_type"):
        r.warn(f"{where}: isRdma with vdpaType in one selector, {_GO_REFUSES}")
    if device_type != DeviceType.AUX_NET_DEVICE:
        return
    aux = kw.get("aux_types", ())
    if "auxTypes" not in f or not aux:
        r.warn(f'{where}: auxTypes: missing or empty, {_GO_REFUSES} (it needs ["sf"])')
    for i, text in enumerate(aux):
        if text != "sf":
            r.warn(f'{where}: auxTypes[{i}]: "{text}" matches no device (only "sf" exists), {_GO_REFUSES}')


def _parse_ranges(r: Reader, value: Any, where: str, is_pci: bool) -> tuple[IndexRange, ...]:
    out: list[IndexRange] = []
    for at, text in r.string_items(value, where):
        try:
            rng = parse_index_range(text)
        except ValueError as exc:
            r.problem(at, str(exc))
            continue
        if is_pci:
            address = normalize_pci_address(rng.name)
            if address is None:
                r.problem(at, f'"{clip(rng.name)}" is not a PCI address (0000:3b:00.0)')
                continue
            rng = IndexRange(address, rng.indexes)
        else:
            why = interface_name_problem(rng.name)
            if why is not None:
                r.problem(at, why)
                continue
        out.append(rng)
    return tuple(out)


def _parse_health(r: Reader, value: Any, where: str) -> HealthPolicy:
    if not isinstance(value, Mapping):
        r.problem(where, f"expected an object, got {type_name(value)}")
        return HealthPolicy()
    f = r.fields(value, _HEALTH_KEYS, where)
    d = HealthPolicy()
    return HealthPolicy(
        pf_link=r.boolean(f["pfLink"], join(where, "pfLink"), d.pf_link) if "pfLink" in f else d.pf_link,
        own_link=r.boolean(f["ownLink"], join(where, "ownLink"), d.own_link)
        if "ownLink" in f
        else d.own_link,
        rdma_port=r.boolean(f["rdmaPort"], join(where, "rdmaPort"), d.rdma_port)
        if "rdmaPort" in f
        else d.rdma_port,
        driver=r.boolean(f["driver"], join(where, "driver"), d.driver) if "driver" in f else d.driver,
        hold_down_s=r.number(
            f["holdDownSeconds"], join(where, "holdDownSeconds"), d.hold_down_s, minimum=0, strict=False
        )
        if "holdDownSeconds" in f
        else d.hold_down_s,
    )


def _parse_additional_info(
    r: Reader, value: Any, where: str
) -> tuple[tuple[str, tuple[tuple[str, str], ...]], ...]:
    if not isinstance(value, Mapping):
        r.problem(where, f"expected an object of objects, got {type_name(value)}")
        return ()
    for dup in getattr(value, "duplicates", ()):
        r.problem(join(where, dup), "key given more than once")
    out: list[tuple[str, tuple[tuple[str, str], ...]]] = []
    for device, info in value.items():
        at = f'{where}["{clip(device)}"]'
        if not device:
            r.problem(where, 'empty key (use a device ID or "*")')
            continue
        if not r.printable(device, where):
            continue
        if not isinstance(info, Mapping):
            r.problem(at, f"expected an object of strings, got {type_name(info)}")
            continue
        pairs: list[tuple[str, str]] = []
        for k, v in info.items():
            # Keys and values become JSON in the container's _INFO variable and device-info files.
            if not r.printable(k, at):
                continue
            if not isinstance(v, str):
                r.problem(f'{at}["{clip(k)}"]', f"expected a string, got {type_name(v)}")
            elif r.printable(v, f'{at}["{clip(k)}"]'):
                pairs.append((k, v))
        out.append((device, tuple(pairs)))
    return tuple(out)


# resource.k8s.io string attributes hold at most 64 characters; a DRA pool's resource name is one.
DRA_MAX_STRING = 64
DRA_MAX_DRIVER_NAME = 63  # ResourceSlice spec.driver: a DNS subdomain of at most 63 characters


def _parse_api(r: Reader, f: Mapping[str, Any], where: str, pool: PoolConfig) -> PoolApi:
    """Read a pool's ``api`` (devicePlugin | dra) and report what DRA cannot serve."""
    if "api" not in f:
        return PoolApi.DEVICE_PLUGIN
    text = r.string(f["api"], f"{where}: api")
    if text is None:
        return PoolApi.DEVICE_PLUGIN
    try:
        api = PoolApi(text)
    except ValueError:
        r.problem(f"{where}: api", f'"{clip(text)}" is not one of {", ".join(a.value for a in PoolApi)}')
        return PoolApi.DEVICE_PLUGIN
    if api is PoolApi.DRA:
        # DRA device names are DNS labels made from PCI addresses (dra/names.py); a subfunction has none.
        if pool.device_type == DeviceType.AUX_NET_DEVICE:
            r.problem(
                f"{where}: api", '"dra" cannot serve auxNetDevice pools (subfunctions have no PCI address)'
            )
        # A DRA device goes to one claim at a time: shared RDMA IDs have no DRA equivalent here.
        if pool.rdma_shared:
            r.problem(f"{where}: api", '"dra" cannot serve rdmaShared pools (a DRA device has one claim)')
        if pool.resource_name and len(pool.full_name) > DRA_MAX_STRING:
            r.problem(
                f"{where}: api",
                f'"dra" needs a resource name of at most {DRA_MAX_STRING} characters '
                f"(a ResourceSlice string attribute), {pool.full_name!r} has {len(pool.full_name)}",
            )
    return api


def _parse_driver_name(r: Reader, value: Any) -> str:
    text = r.string(value, "draDriverName")
    if text is None:
        return DEFAULT_DRIVER_NAME
    if len(text) > DRA_MAX_DRIVER_NAME or not DNS_SUBDOMAIN_RE.fullmatch(text):
        r.problem(
            "draDriverName",
            f'"{clip(text)}" is not a lowercase DNS subdomain of at most {DRA_MAX_DRIVER_NAME} characters',
        )
        return DEFAULT_DRIVER_NAME
    return text


def _parse_pool(r: Reader, obj: Any, index: int) -> PoolConfig | None:
    before = r.count
    opened = r.entry(obj, f"resourceList[{index}]", _POOL_KEYS)
    if opened is None:
        return None
    where, f = opened

    name = ""
    if "resourceName" not in f:
        r.problem(where, "resourceName: required")
    else:
        name = r.string(f["resourceName"], f"{where}: resourceName") or ""
        if f["resourceName"] == "":
            r.problem(where, "resourceName: empty")
    prefix = r.default_prefix
    if "resourcePrefix" in f:
        prefix = r.string(f["resourcePrefix"], f"{where}: resourcePrefix") or prefix
    if name:
        full = f"{prefix}/{name}"
        why = validate_resource_name(full)
        if why is not None:
            r.problem(where, f"resourceName/resourcePrefix: the kubelet would refuse {why}")
        else:
            _compat_name_warnings(r, where, name, full)

    device_type = DeviceType.NET_DEVICE
    if "deviceType" in f:
        text = r.string(f["deviceType"], f"{where}: deviceType")
        if text is not None and text not in DEVICE_TYPES:
            r.problem(f"{where}: deviceType", f'"{clip(text)}" is not one of {", ".join(DEVICE_TYPES)}')
        elif text is not None:
            device_type = DeviceType(text)

    legacy_rdma: bool | None = None
    if "isRdma" in f:
        legacy_rdma = r.boolean(f["isRdma"], f"{where}: isRdma", False)

    selectors: tuple[Selector, ...] = (Selector(is_rdma=legacy_rdma),)
    if "selectors" in f:
        raw = f["selectors"]
        if isinstance(raw, Mapping):
            sel = _parse_selector(r, raw, f"{where}: selectors", device_type, legacy_rdma)
            selectors = (sel,) if sel is not None else ()
        elif isinstance(raw, list):
            if not raw:
                r.problem(f"{where}: selectors", "empty list: the pool would select no device")
            parsed = [
                _parse_selector(r, s, f"{where}: selectors[{i}]", device_type, legacy_rdma)
                for i, s in enumerate(raw)
            ]
            selectors = tuple(s for s in parsed if s is not None)
        else:
            r.problem(f"{where}: selectors", f"expected an object or a list of objects, got {type_name(raw)}")

    if "selectors" not in f:
        r.warn(
            f"{where}: selectors: missing: densedev takes every device of the pool's deviceType, "
            f"{_GO_REFUSES}"
        )
    for key in _GO_INTERNAL_KEYS:
        if key in f and f[key] is not None:
            r.problem(f"{where}: {key}", "internal field of the Go plugin: only null is accepted")

    exclude_topology = False
    if "excludeTopology" in f:
        exclude_topology = r.boolean(f["excludeTopology"], f"{where}: excludeTopology", False)
    additional_info: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = ()
    if "additionalInfo" in f:
        additional_info = _parse_additional_info(r, f["additionalInfo"], f"{where}: additionalInfo")
    rdma_shared = 0
    if "rdmaShared" in f:
        v = f["rdmaShared"]
        if isinstance(v, bool) or not isinstance(v, int):
            r.problem(
                f"{where}: rdmaShared", f"expected a whole number of IDs per RDMA device, got {type_name(v)}"
            )
        elif not 0 <= v <= MAX_RDMA_SHARED:
            r.problem(f"{where}: rdmaShared", f"expected 0 to {MAX_RDMA_SHARED}, got {clip(str(v), 40)}")
        else:
            rdma_shared = v
    health = HealthPolicy()
    if "healthPolicy" in f:
        health = _parse_health(r, f["healthPolicy"], f"{where}: healthPolicy")
    preferred = Preferred.PACK
    if "preferredAllocation" in f:
        text = r.string(f["preferredAllocation"], f"{where}: preferredAllocation")
        if text is not None and text not in PREFERRED_POLICIES:
            r.problem(
                f"{where}: preferredAllocation",
                f'"{clip(text)}" is not one of {", ".join(PREFERRED_POLICIES)}',
            )
        elif text is not None:
            preferred = Preferred(text)
    prestart = False
    if "preStart" in f:
        prestart = r.boolean(f["preStart"], f"{where}: preStart", False)

    pool = PoolConfig(
        resource_name=name,
        resource_prefix=prefix,
        device_type=device_type,
        selectors=selectors,
        exclude_topology=exclude_topology,
        additional_info=additional_info,
        rdma_shared=rdma_shared,
        health=health,
        preferred=preferred,
        prestart=prestart,
    )
    api = _parse_api(r, f, where, pool)
    if r.count > before:
        return None
    return pool._replace(api=api) if api is not PoolApi.DEVICE_PLUGIN else pool


def read_document(r: Reader, f: Mapping[str, Any]) -> Config:
    """Read a decoded SR-IOV-format document's top-level fields (``f``, canonical keys) into a Config.

    Problems go to ``r``; the caller raises them.
    """
    pools: list[tuple[int, PoolConfig]] = []
    if "resourceList" not in f:
        r.problem("resourceList", "required (a list of resource pools)")
    elif not isinstance(f["resourceList"], list):
        r.problem("resourceList", f"expected a list of resource objects, got {type_name(f['resourceList'])}")
    else:
        for i, obj in enumerate(f["resourceList"]):
            pool = _parse_pool(r, obj, i)
            if pool is not None:
                pools.append((i, pool))
    d = Config(pools=())
    coalesce, rdma_poll, reconcile = read_timing(r, f)
    driver_name = _parse_driver_name(r, f["draDriverName"]) if "draDriverName" in f else DEFAULT_DRIVER_NAME
    check_unique(r, pools, "resourceList")
    return d._replace(
        pools=tuple(pool for _, pool in pools),
        coalesce_ms=coalesce,
        rdma_poll_s=rdma_poll,
        reconcile_s=reconcile,
        dra_driver_name=driver_name,
    )
