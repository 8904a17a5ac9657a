"""The RDMA shared device plugin's ``config.json`` (``configList``), read into densedev's shared RDMA pools.

Each ``configList`` entry becomes one pool of the engine densedev already has (``rdmaShared``), with the
plugin's own meaning of its count: ``rdmaHcaMax`` IDs for the whole resource, named ``"0"`` …
``"N-1"`` as the plugin names them, each bringing the char devices of every HCA the entry selects
(k8s-rdma-shared-dev-plugin pkg/resources/server.go: ``newResourceServer`` advertises ``rdmaHcaMax``
devices when any selected device has RDMA char devices, and ``Allocate`` returns the specs of all of
them to every container).  What densedev keeps different is written down in ``docs/migrating.md``.

Rules follow the plugin's ``ValidateConfigs`` (pkg/resources/resources_manager.go): a file it refuses at
start is refused here unless the kubelet would accept the result, in which case it loads with a warning
(``check-config --strict`` makes those errors), as for the SR-IOV format.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ..model import Config, DeviceType, PoolConfig, Preferred, Selector, SharedScope
from ..printable import clip
from .validator import (
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

PLUGIN = "the RDMA shared device plugin"
DEFAULT_PREFIX = "rdma"  # its rdmaHcaResourcePrefix: what an empty or missing resourcePrefix means
DEFAULT_CONFIG_FILE = "/k8s-rdma-shared-dev-plugin/config.json"  # its --config-file default
MAX_HCA_SHARES = 65535  # densedev's bound on rdmaShared; the plugin's examples use up to 1,000

# "kubeletRootDir" sits in the plugin's own example ConfigMap (deployment/k8s/base/configmap.yaml).
TOP_KEYS = ("configList", "periodicUpdateInterval", "kubeletRootDir", *TIMING_KEYS)
ENTRY_KEYS = ("resourceName", "resourcePrefix", "rdmaHcaMax", "selectors", "devices")
SELECTOR_KEYS = ("vendors", "deviceIDs", "drivers", "ifNames", "linkTypes")

_REFUSES = "which the RDMA shared device plugin refuses (it would not start with this file)"
_NAME_RE = re.compile(r"[a-zA-Z0-9_]+")  # its validResourceName: no "-" or "." (unlike the SR-IOV plugin)


def read_document(r: Reader, f: Mapping[str, Any]) -> Config:
    """Read a decoded RDMA-shared-format document's top-level fields (``f``, canonical keys) into a Config.

    Problems go to ``r``; the caller raises them.
    """
    pools: list[tuple[int, PoolConfig]] = []
    if "configList" not in f:
        r.problem("configList", "required (a list of shared RDMA resources)")
    elif not isinstance(f["configList"], list):
        r.problem("configList", f"expected a list of resource objects, got {type_name(f['configList'])}")
    elif not f["configList"]:
        # ValidateConfigs: "no resources configuration found".
        r.problem("configList", "empty: no resource to serve")
    else:
        for i, obj in enumerate(f["configList"]):
            pool = _parse_entry(r, obj, i)
            if pool is not None:
                pools.append((i, pool))
    coalesce, rdma_poll, reconcile = read_timing(r, f)
    if "periodicUpdateInterval" in f:
        reconcile = _periodic_update(r, f["periodicUpdateInterval"], reconcile, "reconcileSeconds" in f)
    if "kubeletRootDir" in f and r.string(f["kubeletRootDir"], "kubeletRootDir") is not None:
        r.warn(
            "kubeletRootDir: not read from the file: densedev takes the kubelet's directories from its "
            "command line"
        )
    _same_names(r, pools)
    check_unique(r, pools, "configList")
    return Config(
        pools=tuple(pool for _, pool in pools),
        coalesce_ms=coalesce,
        rdma_poll_s=rdma_poll,
        reconcile_s=reconcile,
    )


def _periodic_update(r: Reader, value: Any, reconcile: float, explicit: bool) -> float:
    """Map ``periodicUpdateInterval`` (whole seconds, 0: none) onto densedev's full-rescan interval."""
    where = "periodicUpdateInterval"
    # The plugin decodes it into a Go *int: a fraction, a string or a boolean stops it at start.
    if isinstance(value, bool) or not isinstance(value, int):
        r.problem(where, f"expected a whole number of seconds, got {type_name(value)}")
        return reconcile
    if value < 0:
        r.problem(where, f"expected 0 or more seconds, got {clip(str(value), 40)}")
        return reconcile
    if explicit:
        r.problem(where, "given with reconcileSeconds: both set the full-rescan interval, keep one")
        return reconcile
    if value == 0:
        # densedev sees devices come and go from netlink and uevents; the rescan is only its safety net,
        # and a rescan never takes a device from a running pod, so it stays on at its default.
        r.warn(
            f"{where}: 0 turns the plugin's rescans off; densedev finds device changes from kernel "
            f"events anyway and keeps its safety-net rescan every {reconcile:g} s"
        )
        return reconcile
    return float(value)


def _parse_entry(r: Reader, obj: Any, index: int) -> PoolConfig | None:
    before = r.count
    opened = r.entry(obj, f"configList[{index}]", ENTRY_KEYS)
    if opened is None:
        return None
    where, f = opened

    name = ""
    if "resourceName" not in f or f["resourceName"] == "":
        r.problem(where, "resourceName: required")
    else:
        name = r.string(f["resourceName"], f"{where}: resourceName") or ""
    prefix = DEFAULT_PREFIX
    if "resourcePrefix" in f:
        # ValidateConfigs: an empty prefix is the default one.
        prefix = r.string(f["resourcePrefix"], f"{where}: resourcePrefix") or DEFAULT_PREFIX
    if name:
        full = f"{prefix}/{name}"
        why = validate_resource_name(full)
        if why is not None:
            r.problem(where, f"resourceName/resourcePrefix: the kubelet would refuse {why}")
        elif not _NAME_RE.fullmatch(name):
            r.warn(f'{where}: resourceName: "{name}" has characters outside [a-zA-Z0-9_], {_REFUSES}')
        if why is None and "-" in full:
            r.warn(
                f"{where}: resourceName/resourcePrefix: the container gets {env_var_name(full)} "
                '(with "-"); programs read it, shell scripts cannot'
            )

    shares = 0
    if "rdmaHcaMax" not in f:
        # Go leaves a missing int at 0: the plugin serves the resource with no devices.
        r.warn(f"{where}: rdmaHcaMax: missing: the resource is served with 0 devices, as the plugin does")
    else:
        v = f["rdmaHcaMax"]
        if isinstance(v, bool) or not isinstance(v, int):
            r.problem(f"{where}: rdmaHcaMax", f"expected a whole number of pods, got {type_name(v)}")
        elif not 0 <= v <= MAX_HCA_SHARES:
            r.problem(f"{where}: rdmaHcaMax", f"expected 0 to {MAX_HCA_SHARES}, got {clip(str(v), 40)}")
        else:
            shares = v

    # What was given decides, not what survived reading: a bad name is its own problem, not a missing key.
    raw_sel, raw_dev = f.get("selectors"), f.get("devices")
    sel_given = isinstance(raw_sel, Mapping) and any(v != [] and v is not None for v in raw_sel.values())
    dev_given = isinstance(raw_dev, list) and bool(raw_dev)
    selector = Selector()
    if "selectors" in f:
        selector = _parse_selector(r, raw_sel, f"{where}: selectors") or selector
    if "devices" in f:
        # The plugin's older field: the same as selectors.ifNames (ValidateConfigs copies it there).
        devices = _if_names(r, raw_dev, f"{where}: devices")
        if not sel_given:
            selector = Selector(if_names=devices)
    if sel_given and dev_given:
        r.problem(where, 'both "selectors" and "devices": give one (the plugin refuses both)')
    elif not sel_given and not dev_given:
        r.problem(where, 'no "selectors" or "devices": name the HCAs to share (the plugin refuses)')

    if r.count > before:
        return None
    return PoolConfig(
        resource_name=name,
        resource_prefix=prefix,
        # The plugin takes PCI network functions whatever their role (a PF with VFs enabled included):
        # densedev's accelerator type is the one that skips no PF.  It is not limited to class 02 as
        # the plugin is, but a shared pool keeps only functions with an RDMA device, in practice network
        # and InfiniBand controllers (docs/migrating.md).
        device_type=DeviceType.ACCELERATOR,
        selectors=(selector._replace(is_rdma=True),),
        # Its ListAndWatch sends no topology and it offers no GetPreferredAllocation; every ID brings
        # every HCA, so a NUMA node per ID would mislead the topology manager.
        exclude_topology=True,
        rdma_shared=shares,
        rdma_scope=SharedScope.POOL,
        preferred=Preferred.NONE,
    )


def _parse_selector(r: Reader, obj: Any, where: str) -> Selector | None:
    if not isinstance(obj, Mapping):
        r.problem(where, f"expected a selector object, got {type_name(obj)}")
        return None
    f = r.fields(obj, SELECTOR_KEYS, where)
    kw: dict[str, Any] = {}
    if "vendors" in f:
        kw["vendors"] = compat_ids(r, f["vendors"], join(where, "vendors"), "vendor", PLUGIN)
    if "deviceIDs" in f:
        kw["devices"] = compat_ids(r, f["deviceIDs"], join(where, "deviceIDs"), "device", PLUGIN)
    if "drivers" in f:
        kw["drivers"] = r.strings(f["drivers"], join(where, "drivers"))
    if "ifNames" in f:
        kw["if_names"] = _if_names(r, f["ifNames"], join(where, "ifNames"))
    if "linkTypes" in f:
        kw["link_types"] = compat_link_types(r, f["linkTypes"], join(where, "linkTypes"))
    return Selector(**kw)


def _if_names(r: Reader, value: Any, where: str) -> tuple[str, ...]:
    """Read interface names; one the kernel could never give an interface is refused."""
    names = r.strings(value, where)
    out: list[str] = []
    for i, name in enumerate(names):
        why = interface_name_problem(name)
        if why is not None:
            r.problem(f"{where}[{i}]", why)
        else:
            out.append(name)
    return tuple(out)


def _same_names(r: Reader, pools: list[tuple[int, PoolConfig]]) -> None:
    """Warn about one resourceName under two prefixes: the kubelet takes both, the plugin refuses them."""
    seen: dict[str, tuple[int, str]] = {}
    for i, pool in pools:
        first, prefix = seen.setdefault(pool.resource_name, (i, pool.resource_prefix))
        if first != i and pool.resource_prefix != prefix:
            r.warn(
                f"configList[{i}] ({pool.resource_name}): resourceName also used by configList[{first}] "
                f"(under another prefix), {_REFUSES}"
            )
