"""Claim parameters for our DRA driver: the ``VfConfig`` kind, read, merged and checked before any change.

A claim says how it wants its devices through opaque config (kubelet-dra.md §9): the claim's
``spec.devices.config[]`` and its DeviceClass's ``spec.config[]`` reach the driver copied into
``status.allocation.devices.config[]``, each ``{source: FromClass|FromClaim, requests, opaque: {driver,
parameters}}``, class entries first.  The entries whose ``opaque.driver`` is ours apply, in order and later
fields winning, to the results of the requests they name (every request when they name none; naming
``main`` covers the subrequest result ``main/sub``).  The API server does not look inside ``parameters``,
so everything is checked here — kind, version, field names, types, ranges, and whether the device can
take the setting — and a refusal is one line naming the request, the field and the reason, before
anything on the node is touched.

This module is pure: what it knows of a device comes in as ``DeviceFacts``, filled by the caller.
"""

from __future__ import annotations

import difflib
import enum
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, NamedTuple

from ..model import Device, Role
from ..printable import clip

API_VERSION = "net.densedev.io/v1alpha1"
KIND = "VfConfig"
# One ``parameters`` may hold at most 10 Ki bytes of JSON (resource.k8s.io OpaqueDeviceConfiguration).
MAX_PARAMETERS_BYTES = 10 * 1024
ALL_REQUESTS = "*"  # the request label of an entry checked without a claim's requests (a DeviceClass's)

VFIO_PCI = "vfio-pci"
# Drivers that hand the function to user space: the VF has no netdev while one of them is bound.
USERSPACE_DRIVERS = frozenset({VFIO_PCI, "uio_pci_generic", "igb_uio"})

U32_MAX = 0xFFFF_FFFF
# ETH_MIN_MTU (68, the IPv4 minimum) to IP_MAX_MTU (65535): the kernel's outer bounds; each device's own
# max_mtu (unknown here) is checked by the kernel when the MTU is set.
MTU_MIN, MTU_MAX = 68, 65535
VLAN_MAX = 4095  # rtnetlink's do_setvfinfo refuses vlan > 4095 or qos > 7 (EINVAL)
QOS_MAX = 7
IFNAMSIZ = 16  # include/uapi/linux/if.h: the name and its NUL
DRIVER_NAME_MAX = 64  # our bound: a driver name is a sysfs directory under /sys/bus/pci/drivers

_MAC = re.compile(r"[0-9A-Fa-f]{2}(?::[0-9A-Fa-f]{2}){5}")
_DRIVER = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


class Field(enum.StrEnum):
    """A field of ``VfConfig`` as the JSON spells it."""

    DRIVER = "driver"
    MTU = "mtu"
    MAC = "mac"
    VLAN = "vlan"
    QOS = "qos"
    TRUST = "trust"
    SPOOF_CHK = "spoofChk"
    MIN_TX_RATE = "minTxRateMbps"
    MAX_TX_RATE = "maxTxRateMbps"
    LINK_STATE = "linkState"
    IF_NAME = "ifName"


# Settings made on the VF's own netdev (IFLA_MTU on the VF; the name a CNI gives it): need a netdev driver.
NETDEV_FIELDS = frozenset({Field.MTU, Field.IF_NAME})
# Settings sent as IFLA_VFINFO_LIST through the PF's rtnetlink: need a VF and a PF netdev.
PF_FIELDS = frozenset(
    {
        Field.MAC,
        Field.VLAN,
        Field.QOS,
        Field.TRUST,
        Field.SPOOF_CHK,
        Field.MIN_TX_RATE,
        Field.MAX_TX_RATE,
        Field.LINK_STATE,
    }
)
# Of those, what an InfiniBand PF takes: IPoIB's PF ops implement only ndo_set_vf_link_state (plus GUIDs,
# config and stats), since an IB port has no Ethernet MAC, no 802.1Q VLAN (P_Keys instead), no MAC
# anti-spoofing, no trust mode and no VF rate limit (drivers/infiniband/ulp/ipoib, mlx5 ib_virt.c).
IB_PF_FIELDS = frozenset({Field.LINK_STATE})


class LinkState(enum.StrEnum):
    """``linkState``: the VF's link policy (IFLA_VF_LINK_STATE_AUTO/ENABLE/DISABLE)."""

    AUTO = "auto"
    ENABLE = "enable"
    DISABLE = "disable"

    @property
    def kernel(self) -> int:
        """Return the value ``struct ifla_vf_link_state`` carries (0 auto, 1 enable, 2 disable)."""
        return _LINK_STATE_VALUES[self]


_LINK_STATE_VALUES = {LinkState.AUTO: 0, LinkState.ENABLE: 1, LinkState.DISABLE: 2}


class Source(enum.StrEnum):
    """Where an allocation's config entry came from (``DeviceAllocationConfiguration.source``)."""

    CLASS = "FromClass"
    CLAIM = "FromClaim"


class LinkType(enum.StrEnum):
    """The link type rtnetlink talks to for the device (``/sys/class/net/<if>/type`` as the scan names it)."""

    ETHER = "ether"
    INFINIBAND = "infiniband"
    NONE = ""  # no netdev: nothing to send VF settings through


@dataclass(frozen=True, slots=True)
class VfConfig:
    """What a claim asks of one device; ``None`` leaves a setting as the device has it.

    ``mac`` is lower-case ``aa:bb:cc:dd:ee:ff``; rates are Mbit/s (0 = no limit, as the kernel reads it).
    """

    driver: str | None = None
    mtu: int | None = None
    mac: str | None = None
    vlan: int | None = None
    qos: int | None = None
    trust: bool | None = None
    spoof_chk: bool | None = None
    min_tx_rate_mbps: int | None = None
    max_tx_rate_mbps: int | None = None
    link_state: LinkState | None = None
    if_name: str | None = None

    def settings(self) -> tuple[Field, ...]:
        """Return the fields this config sets, in the model's order."""
        return tuple(f for f, attr in _ATTRS.items() if getattr(self, attr) is not None)

    def over(self, base: VfConfig) -> VfConfig:
        """Return ``base`` with every field this config sets taken from this config (later wins)."""
        return replace(base, **{_ATTRS[f]: getattr(self, _ATTRS[f]) for f in self.settings()})

    def to_json(self) -> dict[str, Any]:
        """Return the config as the ``VfConfig`` document it would be written as."""
        doc: dict[str, Any] = {"apiVersion": API_VERSION, "kind": KIND}
        for f in self.settings():
            value = getattr(self, _ATTRS[f])
            doc[f.value] = value.value if isinstance(value, LinkState) else value
        return doc


_ATTRS: dict[Field, str] = {
    Field.DRIVER: "driver",
    Field.MTU: "mtu",
    Field.MAC: "mac",
    Field.VLAN: "vlan",
    Field.QOS: "qos",
    Field.TRUST: "trust",
    Field.SPOOF_CHK: "spoof_chk",
    Field.MIN_TX_RATE: "min_tx_rate_mbps",
    Field.MAX_TX_RATE: "max_tx_rate_mbps",
    Field.LINK_STATE: "link_state",
    Field.IF_NAME: "if_name",
}
assert sorted(_ATTRS.values()) == sorted(f.name for f in fields(VfConfig))
EMPTY = VfConfig()


class DeviceFacts(NamedTuple):
    """What the caller knows of an allocated device, which decides the settings it can take."""

    role: Role  # pf, vf, pci, sf
    link_type: LinkType  # for a VF: the PF's netdev's (rtnetlink goes through it); ``NONE`` when none
    driver: str  # the driver bound now; "" when none
    admin_access: bool = False  # the result has adminAccess: it shares the device and configures nothing
    iommu_group: int | None = None  # its IOMMU group, -1 when it has none; None: not known here


def facts_of(device: Device, pf: Device | None, *, admin_access: bool = False) -> DeviceFacts:
    """Return a scanned device's facts; a VF's link type is its PF's, whose netdev carries VF settings.

    ``pf`` is the VF's PF from the same device table (None when it is not there).  A VF whose PF netdev
    is unknown gets ``LinkType.NONE``, so the PF-side settings are refused rather than tried blind.
    """
    if device.role == Role.VF:
        if not device.pf_netdev:
            link = LinkType.NONE
        elif pf is not None and pf.link_type:
            link = LinkType(pf.link_type)
        else:  # the VF's own netdev is of its PF's type (one port); none while vfio-bound
            link = LinkType(device.link_type)
    else:
        link = LinkType(device.link_type)
    return DeviceFacts(Role(device.role), link, device.driver, admin_access, device.iommu_group)


class Problem(NamedTuple):
    """One refusal: the request it stops, the field, the reason, and which config entry asked."""

    request: str
    field: str
    reason: str
    where: str = ""  # "FromClaim config[1]"; "" when it is not one entry's doing

    def __str__(self) -> str:
        where = f" ({self.where})" if self.where else ""
        return f"request {clip(self.request, 64)}: {self.field}: {self.reason}{where}"


class Entry(NamedTuple):
    """One config entry for our driver, read: where it came from, the requests it names, what it asks."""

    source: Source | None  # None: a claim's or class's spec, before allocation
    position: int  # its index in the list it came from
    requests: tuple[str, ...]  # empty: every request
    config: VfConfig | None  # None when its parameters were refused
    problems: tuple[tuple[str, str], ...]  # (field, reason) of each refusal of its parameters

    @property
    def where(self) -> str:
        """Name the entry as a line can: ``FromClass config[0]``."""
        return f"{self.source.value + ' ' if self.source else ''}config[{self.position}]"

    def covers(self, request: str) -> bool:
        """Return whether the entry applies to the result of ``request`` (``main`` covers ``main/sub``)."""
        if not self.requests:
            return True
        return request in self.requests or request.split("/", 1)[0] in self.requests


class Plan(NamedTuple):
    """What Prepare should do: the effective config per device, or why the claim is refused."""

    configs: Mapping[str, VfConfig]  # device name → its config; only devices with something to set
    problems: tuple[Problem, ...]  # non-empty: refuse the claim, change nothing


class Result(NamedTuple):
    """One allocated device as Prepare sees it: its request (``main`` or ``main/sub``), name and facts."""

    request: str
    device: str
    facts: DeviceFacts


# ---- parameters ----------------------------------------------------------------------------------------


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _encoded_size(value: Any, limit: int) -> int:
    """Return the compact JSON size of ``value``, stopping once past ``limit`` (YAML aliases can nest a
    small file into an exponential document; a walk with its own stack survives any depth)."""
    size = 0
    stack = [value]
    while stack and size <= limit:
        v = stack.pop()
        if isinstance(v, dict):
            size += 1 + max(len(v) - 1, 0) + len(v)  # braces, commas, colons
            for k, item in v.items():
                size += len(json.dumps(str(k), ensure_ascii=False).encode("utf-8", "surrogatepass"))
                stack.append(item)
            size += 1
        elif isinstance(v, list):
            size += 2 + max(len(v) - 1, 0)
            stack.extend(v)
        elif isinstance(v, str):
            size += len(json.dumps(v, ensure_ascii=False).encode("utf-8", "surrogatepass"))
        else:
            try:
                size += len(json.dumps(v))
            except (TypeError, ValueError):
                size += len(str(v))
    return size


def _int(value: Any, low: int, high: int, unit: str = "") -> tuple[int | None, str]:
    # bool is an int to Python, not to JSON: ``true`` is refused where a number is asked.
    if isinstance(value, bool) or not isinstance(value, int):
        return None, f"must be an integer, not {_type_name(value)}"
    if not low <= value <= high:
        return None, f"{value} is out of range {low}-{high}{unit}"
    return value, ""


def _bool(value: Any) -> tuple[bool | None, str]:
    if not isinstance(value, bool):
        return None, f"must be true or false, not {_type_name(value)}"
    return value, ""


def _driver(value: Any) -> tuple[str | None, str]:
    if not isinstance(value, str):
        return None, f"must be a driver name, not {_type_name(value)}"
    if not value:
        return None, "must not be empty"
    # Written to driver_override and used as /sys/bus/pci/drivers/<name>: a plain name, never a path.
    if len(value) > DRIVER_NAME_MAX or not _DRIVER.fullmatch(value):
        return None, f"{clip(repr(value), 40)} is not a driver name (letters, digits, '_', '-', '.')"
    return value, ""


def _mac(value: Any) -> tuple[str | None, str]:
    if not isinstance(value, str):
        return None, f"must be a MAC address string, not {_type_name(value)}"
    if not _MAC.fullmatch(value):
        return None, f"{clip(repr(value), 40)} is not a MAC address like 02:00:00:00:00:01"
    octets = bytes.fromhex(value.replace(":", ""))
    # is_valid_ether_addr(): neither multicast (bit 0 of the first octet) nor all zeros.
    if octets[0] & 1:
        return None, f"{value} is a multicast address; a VF needs a unicast one"
    if not any(octets):
        return None, "00:00:00:00:00:00 is not a valid unicast address"
    return value.lower(), ""


def _link_state(value: Any) -> tuple[LinkState | None, str]:
    if not isinstance(value, str):
        return None, f"must be one of auto, enable, disable, not {_type_name(value)}"
    try:
        return LinkState(value), ""
    except ValueError:
        return None, f"{clip(repr(value), 40)} is not one of auto, enable, disable"


def _if_name(value: Any) -> tuple[str | None, str]:
    # The kernel's dev_valid_name(): 1 to IFNAMSIZ-1 bytes, not "." or "..", no '/', ':' or whitespace.
    if not isinstance(value, str):
        return None, f"must be an interface name, not {_type_name(value)}"
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        return None, "is not valid UTF-8"
    if size == 0:
        return None, "must not be empty"
    if size >= IFNAMSIZ:
        return None, f"{clip(repr(value), 40)} is {size} bytes; an interface name has at most {IFNAMSIZ - 1}"
    if value in (".", ".."):
        return None, f"{value!r} is not an interface name"
    bad = next((c for c in value if c in "/:" or c.isspace() or not c.isprintable()), None)
    if bad is not None:
        return None, f"{clip(repr(value), 40)} holds {bad!r}, which an interface name may not"
    return value, ""


_PARSERS = {
    Field.DRIVER: _driver,
    Field.MTU: lambda v: _int(v, MTU_MIN, MTU_MAX),
    Field.MAC: _mac,
    Field.VLAN: lambda v: _int(v, 0, VLAN_MAX),
    Field.QOS: lambda v: _int(v, 0, QOS_MAX),
    Field.TRUST: _bool,
    Field.SPOOF_CHK: _bool,
    Field.MIN_TX_RATE: lambda v: _int(v, 0, U32_MAX, " Mbit/s"),
    Field.MAX_TX_RATE: lambda v: _int(v, 0, U32_MAX, " Mbit/s"),
    Field.LINK_STATE: _link_state,
    Field.IF_NAME: _if_name,
}


def parse_parameters(parameters: Any) -> VfConfig | list[tuple[str, str]]:
    """Return the ``VfConfig`` of one ``opaque.parameters``, or every (field, reason) it is refused for.

    Any JSON value is taken (anything else too: it is refused, never raised on).
    """
    if not isinstance(parameters, dict):
        return [("parameters", f"must be a VfConfig object, not {_type_name(parameters)}")]
    size = _encoded_size(parameters, MAX_PARAMETERS_BYTES)
    if size > MAX_PARAMETERS_BYTES:
        return [("parameters", f"more than {MAX_PARAMETERS_BYTES} bytes of JSON (the API's limit)")]
    problems: list[tuple[str, str]] = []
    version, kind = parameters.get("apiVersion"), parameters.get("kind")
    if version != API_VERSION:
        shown = "missing" if version is None else f"{clip(repr(version), 60)} is not known"
        problems.append(("apiVersion", f"{shown}; this driver reads {API_VERSION}"))
    if kind != KIND:
        shown = "missing" if kind is None else f"{clip(repr(kind), 60)} is not known"
        problems.append(("kind", f"{shown}; this driver reads {KIND}"))
    values: dict[str, Any] = {}
    for key, value in parameters.items():
        if key in ("apiVersion", "kind"):
            continue
        try:
            f = Field(key)
        except ValueError:
            name = key if isinstance(key, str) else repr(key)
            close = difflib.get_close_matches(name, [m.value for m in Field], n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            problems.append((clip(name, 40), f"unknown field{hint}"))
            continue
        parsed, why = _PARSERS[f](value)
        if why:
            problems.append((f.value, why))
        else:
            values[_ATTRS[f]] = parsed
    if problems:
        return problems
    return VfConfig(**values)


def read_entries(
    config: Any, driver: str, *, source: Source | None = None
) -> tuple[list[Entry], list[tuple[str, str, str]]]:
    """Return our driver's entries of a ``config[]`` list, and (where, field, reason) of each malformed one.

    ``source`` is for a spec's list (a claim's or a class's); an allocation's entries carry their own.
    Entries for other drivers, and entries without ``opaque`` (a kind of config this driver does not
    read), are left alone.
    """
    if config is None:
        return [], []
    if not isinstance(config, list):
        return [], [("", "config", f"must be a list, not {_type_name(config)}")]
    entries: list[Entry] = []
    broken: list[tuple[str, str, str]] = []
    for i, item in enumerate(config):
        if not isinstance(item, dict):
            broken.append((f"config[{i}]", "config", f"must be an object, not {_type_name(item)}"))
            continue
        opaque = item.get("opaque")
        if not isinstance(opaque, dict) or opaque.get("driver") != driver:
            continue
        src = source
        if src is None:
            raw = item.get("source")
            src = Source(raw) if raw in tuple(Source) else None
        where = f"{src.value + ' ' if src else ''}config[{i}]"
        requests = item.get("requests") or []
        if not isinstance(requests, list) or not all(isinstance(r, str) and r for r in requests):
            broken.append((where, "requests", "must be a list of request names"))
            continue
        parsed = parse_parameters(opaque.get("parameters"))
        if isinstance(parsed, VfConfig):
            entries.append(Entry(src, i, tuple(requests), parsed, ()))
        else:
            entries.append(Entry(src, i, tuple(requests), None, tuple(parsed)))
    return entries, broken


def ordered(entries: Iterable[Entry]) -> list[Entry]:
    """Return entries as they apply: class entries first, then the claim's, each in list order."""
    return sorted(entries, key=lambda e: (e.source is not Source.CLASS, e.position))


def effective(entries: Sequence[Entry], request: str) -> tuple[VfConfig, list[Problem]]:
    """Return the config of one request's results and the refusals of the entries that cover it."""
    cfg = EMPTY
    problems: list[Problem] = []
    for e in ordered(entries):
        if not e.covers(request):
            continue
        if e.config is None:
            problems.extend(Problem(request, f, why, e.where) for f, why in e.problems)
        else:
            cfg = e.config.over(cfg)
    problems.extend(Problem(request, f, why) for f, why in check_config(cfg))
    return cfg, problems


# ---- what a config and a device allow -----------------------------------------------------------------


def check_config(cfg: VfConfig) -> list[tuple[str, str]]:
    """Return (field, reason) for each setting a merged config contradicts itself on (any device)."""
    problems: list[tuple[str, str]] = []
    if cfg.driver in USERSPACE_DRIVERS:
        # With vfio-pci (or a uio driver) bound the VF has no netdev: nothing to set an MTU or name on.
        problems.extend(
            (f.value, f"the VF has no netdev when bound to {cfg.driver}")
            for f in cfg.settings()
            if f in NETDEV_FIELDS
        )
    if cfg.qos is not None and cfg.vlan is None:
        # IFLA_VF_VLAN carries the VLAN and the priority together: a priority alone would reset the VLAN.
        problems.append((Field.QOS.value, "needs vlan in the same config (IFLA_VF_VLAN sets both)"))
    lo, hi = cfg.min_tx_rate_mbps, cfg.max_tx_rate_mbps
    if lo is not None and hi is not None and hi != 0 and lo > hi:
        problems.append((Field.MIN_TX_RATE.value, f"{lo} Mbit/s is above maxTxRateMbps {hi}"))
    return problems


def check_device(cfg: VfConfig, facts: DeviceFacts) -> list[tuple[str, str]]:
    """Return (field, reason) for each setting ``cfg`` asks that this device cannot take."""
    asked = cfg.settings()
    if not asked:
        return []
    if facts.admin_access:
        return [(f.value, "an admin-access result shares the device and may not configure it") for f in asked]
    problems: list[tuple[str, str]] = []
    is_vf = facts.role == Role.VF
    # The driver the VF will have once Prepare is done: the asked one, else the one bound now.
    bound = cfg.driver if cfg.driver is not None else facts.driver
    for f in asked:
        if f is Field.DRIVER and not is_vf:
            problems.append((f.value, f"only a VF's driver is rebound; this device is a {facts.role}"))
        elif f is Field.DRIVER and cfg.driver == VFIO_PCI and facts.iommu_group == -1:
            # vfio-pci binds only a device in an IOMMU group (or vfio's no-IOMMU mode, which gives one).
            problems.append((f.value, "vfio-pci needs an IOMMU group and this VF has none"))
        elif f in NETDEV_FIELDS and cfg.driver is None and (not bound or bound in USERSPACE_DRIVERS):
            # (a driver asked in the same config is check_config's: one line per cause)
            now = f"bound to {bound}" if bound else "bound to no driver"
            problems.append((f.value, f"the device has no netdev: it is {now}"))
        elif f in PF_FIELDS:
            if not is_vf:
                problems.append((f.value, f"set through the PF for a VF; this device is a {facts.role}"))
            elif facts.link_type is LinkType.NONE:
                problems.append((f.value, "the VF's PF has no netdev to carry it"))
            elif facts.link_type is LinkType.INFINIBAND and f not in IB_PF_FIELDS:
                problems.append((f.value, "does not apply to an InfiniBand VF"))
    return problems


def plan(config: Any, results: Sequence[Result], driver: str) -> Plan:
    """Return the effective config of every allocated device, or every refusal, from an allocation.

    ``config`` is ``status.allocation.devices.config`` (class entries are recognised by ``source``);
    ``results`` are the allocation's results this driver prepares.  A device named by two requests gets
    their configs only when they agree (or one asks nothing).
    """
    entries, broken = read_entries(config, driver)
    problems: list[Problem] = []
    for where, field, reason in broken:  # whom a malformed entry was meant for is unknown: all of them
        problems.extend(Problem(r, field, reason, where) for r in dict.fromkeys(r.request for r in results))
    per_request: dict[str, VfConfig] = {}
    for request in dict.fromkeys(r.request for r in results):
        cfg, found = effective(entries, request)
        per_request[request] = cfg
        problems.extend(found)
    configs: dict[str, VfConfig] = {}
    asked_by: dict[str, str] = {}
    for r in results:
        cfg = per_request[r.request]
        problems.extend(Problem(r.request, f, f"{why} ({r.device})") for f, why in check_device(cfg, r.facts))
        if not cfg.settings():
            continue
        other = configs.get(r.device)
        if other is not None and other != cfg:
            problems.append(
                Problem(
                    r.request,
                    "parameters",
                    f"{r.device} is also in request {asked_by[r.device]}, which asks otherwise",
                )
            )
            continue
        configs[r.device] = cfg
        asked_by.setdefault(r.device, r.request)
    if problems:
        return Plan({}, tuple(dict.fromkeys(problems)))
    return Plan(configs, ())


# ---- checking objects before they are applied (``densedev dra-check-params``) -------------------------

CHECKED_KINDS = ("ResourceClaimTemplate", "ResourceClaim", "DeviceClass")


class Checked(NamedTuple):
    """What checking one object found: its label, the effective config per request, the refusals."""

    label: str  # "ResourceClaimTemplate default/dpdk"
    configs: Mapping[str, VfConfig]  # request → effective config, for requests our entries reach
    problems: tuple[Problem, ...]
    other_drivers: tuple[str, ...]  # drivers of opaque entries not ours (a typo'd name is skipped here)


def _get(doc: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(doc, dict):
            return None
        doc = doc.get(key)
    return doc


def _request_names(devices: Any) -> list[str]:
    """Return a claim spec's request names, subrequests as ``main/sub`` (what results and config name)."""
    names: list[str] = []
    requests = _get(devices, "requests")
    for r in requests if isinstance(requests, list) else []:
        name = _get(r, "name")
        if not isinstance(name, str):
            continue
        subs = _get(r, "firstAvailable")
        sub_names = [s.get("name") for s in subs if isinstance(s, dict)] if isinstance(subs, list) else []
        if sub_names:
            names.extend(f"{name}/{s}" for s in sub_names if isinstance(s, str))
        else:
            names.append(name)
    return names


def check_object(doc: Mapping[str, Any], driver: str) -> Checked:
    """Check the opaque config for ``driver`` of a ResourceClaimTemplate, ResourceClaim or DeviceClass.

    A claim with an allocation is checked as Prepare would read it (the allocation's config, class entries
    included); otherwise its spec.  A DeviceClass's entries reach every request that picks the class,
    labelled ``*``.
    """
    kind = doc.get("kind")
    name, ns = _get(doc, "metadata", "name"), _get(doc, "metadata", "namespace")
    shown = "/".join(clip(str(x), 63) for x in (ns, name) if isinstance(x, str)) or "(no name)"
    label = f"{clip(str(kind), 40)} {shown}"
    source: Source | None = None
    requests: list[str]
    if kind == "DeviceClass":
        config, source, requests = _get(doc, "spec", "config"), Source.CLASS, [ALL_REQUESTS]
    elif kind == "ResourceClaim" and isinstance(_get(doc, "status", "allocation"), dict):
        config = _get(doc, "status", "allocation", "devices", "config")
        results = _get(doc, "status", "allocation", "devices", "results")
        found = [_get(r, "request") for r in results] if isinstance(results, list) else []
        requests = list(dict.fromkeys(r for r in found if isinstance(r, str)))
    else:
        devices = _get(doc, "spec", "spec", "devices") if kind == "ResourceClaimTemplate" else None
        devices = _get(doc, "spec", "devices") if kind == "ResourceClaim" else devices
        config, source, requests = _get(devices, "config"), Source.CLAIM, _request_names(devices)
    entries, broken = read_entries(config, driver, source=source)
    problems: list[Problem] = []
    labels = requests or [ALL_REQUESTS]
    for where, field, reason in broken:
        problems.extend(Problem(r, field, reason, where) for r in labels)
    if source is Source.CLAIM:
        known = set(requests) | {r.split("/", 1)[0] for r in requests}
        for e in entries:
            problems.extend(
                Problem(r, "requests", "names no request of this claim", e.where)
                for r in e.requests
                if r not in known
            )
    configs: dict[str, VfConfig] = {}
    for request in labels:
        if not any(e.covers(request) for e in entries):
            continue
        cfg, found_problems = effective(entries, request)
        problems.extend(found_problems)
        configs[request] = cfg
    others = [_get(c, "opaque", "driver") for c in config] if isinstance(config, list) else []
    other_drivers = tuple(dict.fromkeys(clip(d, 63) for d in others if isinstance(d, str) and d != driver))
    return Checked(label, configs, tuple(dict.fromkeys(problems)), other_drivers)
