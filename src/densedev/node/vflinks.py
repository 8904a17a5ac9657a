"""Where a VF's link settings are read and changed: the kernel's rtnetlink, or the simulated node's file.

A setting is named as the claim parameters name it (``mtu``, ``mac``, ``vlan``, ``qos``, ``trust``,
``spoofChk``, ``minTxRateMbps``, ``maxTxRateMbps``, ``linkState``) and carried as a JSON value (an int,
a bool, a lower-case MAC, ``auto|enable|disable``), so what is read can be written to the DRA
checkpoint's journal as it is and put back from there after a restart.

``VfLinks`` is the seam: ``NetlinkVfLinks`` talks to the kernel through ``node/vfnetlink.py`` (the PF's
``RTM_SETLINK`` with ``IFLA_VFINFO_LIST``, the VF netdev's ``IFLA_MTU``); ``SimVfLinks`` keeps the
values of a simulated node in ``.simnode/vflinks.json`` with injectable faults, so the DRA node service,
the kill tests and the demo run the same journal against either.  ``links_for`` picks by the sysfs
root (a simulated node has ``.simnode/``).  Every call blocks: run it with ``workers.run(Work.NETLINK)``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import threading
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from .. import files
from ..printable import clip
from .vfnetlink import LinkState, VfNetlink, VfNetlinkError, VfSettings, VfState

__all__ = [
    "LINK_STATES",
    "PF_SETTINGS",
    "SETTINGS",
    "NetlinkVfLinks",
    "SimVfLinks",
    "VfLinkError",
    "VfLinks",
    "VfTarget",
    "links_for",
]

# The order settings are applied and restored in (the kernel's do_setvfinfo() order for the PF's ones).
SETTINGS = (
    "mtu",
    "mac",
    "vlan",
    "qos",
    "minTxRateMbps",
    "maxTxRateMbps",
    "spoofChk",
    "linkState",
    "trust",
)
PF_SETTINGS = frozenset(SETTINGS) - {"mtu"}
LINK_STATES = {"auto": LinkState.AUTO, "enable": LinkState.ENABLE, "disable": LinkState.DISABLE}
_STATE_NAMES = {v: k for k, v in LINK_STATES.items()}

SIM_STATE = "vflinks.json"  # under .simnode/: the simulated values, by PF netdev and VF index
SIM_FAULTS = "vflinks-faults.json"  # under .simnode/: faults to inject (see SimVfLinks)
SIM_DEFAULTS: Mapping[str, Any] = {
    "mtu": 1500,
    "mac": "00:00:00:00:00:00",  # a VF no one gave a MAC (the PF driver picks a random one at probe)
    "vlan": 0,
    "qos": 0,
    "minTxRateMbps": 0,
    "maxTxRateMbps": 0,
    "spoofChk": True,
    "linkState": "auto",
    "trust": False,
}


class VfTarget(NamedTuple):
    """One VF as rtnetlink reaches it: its PF's netdev, its index there, its own netdev ("" when none)."""

    pf_netdev: str
    vf: int
    netdev: str = ""

    def __str__(self) -> str:
        return f"VF {self.vf} of {self.pf_netdev}"


class VfLinkError(Exception):
    """A read or change of a VF's settings that failed; the message is one line."""


class VfLinks(Protocol):
    """Reads and changes VF link settings (blocking; run off the event loop)."""

    def read(self, target: VfTarget, settings: Collection[str]) -> dict[str, Any]:
        """Return the current value of each named setting; VfLinkError if one cannot be read."""
        ...

    def apply(self, target: VfTarget, values: Mapping[str, Any]) -> None:
        """Set these values (in ``SETTINGS`` order); VfLinkError if any is refused (some may be set)."""
        ...


def _ordered(values: Mapping[str, Any]) -> list[tuple[str, Any]]:
    unknown = set(values) - set(SETTINGS)
    if unknown:
        raise VfLinkError(f"unknown VF settings {sorted(unknown)}")
    return [(s, values[s]) for s in SETTINGS if s in values]


# ----------------------------------------------------------------------------------------- the kernel


def _state_values(state: VfState) -> dict[str, Any]:
    """Return a VF's values as settings; a tri-state the driver does not report is left out."""
    out: dict[str, Any] = {
        "mac": state.mac,
        "vlan": state.vlan,
        "qos": state.qos,
        "minTxRateMbps": state.min_tx_rate,
        "maxTxRateMbps": state.max_tx_rate,
    }
    if state.spoofchk is not None:
        out["spoofChk"] = state.spoofchk
    if state.trust is not None:
        out["trust"] = state.trust
    name = _STATE_NAMES.get(LinkState(state.link_state)) if 0 <= state.link_state <= 2 else None
    if name is not None:
        out["linkState"] = name
    return out


class NetlinkVfLinks:
    """VF settings through the host's rtnetlink (``VfNetlink``); interfaces resolved under ``sysfs_root``."""

    def __init__(
        self,
        sysfs_root: Path = Path("/sys"),
        *,
        timeout_s: float = 2.0,
        netns: str | None = None,
        ifindex: Callable[[str], int] | None = None,
    ) -> None:
        self._root = Path(sysfs_root)
        self._timeout_s = timeout_s
        self._netns = netns  # None: the daemon's own (the host's) namespace
        self._lookup = ifindex  # None: from sysfs (which shows the namespace the daemon runs in)
        self._client: VfNetlink | None = None
        self._lock = threading.Lock()

    def close(self) -> None:
        """Close the rtnetlink socket (opened again on the next call)."""
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    def _nl(self) -> VfNetlink:
        with self._lock:
            if self._client is None:
                try:
                    self._client = VfNetlink(self._netns, timeout_s=self._timeout_s)
                except VfNetlinkError as e:
                    raise VfLinkError(e.reason) from None
            return self._client

    def _ifindex(self, ifname: str) -> int:
        if not ifname or "/" in ifname or ifname in (".", ".."):
            raise VfLinkError(f"no netdev {clip(ifname, 40)!r}")
        if self._lookup is not None:
            try:
                return self._lookup(ifname)
            except (KeyError, OSError):
                raise VfLinkError(f"netdev {ifname} is not in the namespace") from None
        # class/net/<if> is a symlink into the device's directory (sysfs), so it is followed here.
        try:
            return int((self._root / "class/net" / ifname / "ifindex").read_text().strip())
        except (OSError, ValueError):
            raise VfLinkError(f"netdev {ifname} is not on this node (no ifindex under sysfs)") from None

    def read(self, target: VfTarget, settings: Collection[str]) -> dict[str, Any]:
        """Return the current values of the named settings, read from the kernel."""
        out: dict[str, Any] = {}
        try:
            if PF_SETTINGS.intersection(settings):
                states = self._nl().read_vfs(self._ifindex(target.pf_netdev))
                state = next((s for s in states if s.vf == target.vf), None)
                if state is None:
                    raise VfLinkError(f"{target}: the PF reports no such VF")
                if state.vlan and state.vlan_proto != 0x8100:
                    raise VfLinkError(
                        f"{target}: on an 802.1ad VLAN {state.vlan}, which IFLA_VF_VLAN could not restore"
                    )
                values = _state_values(state)
                for s in PF_SETTINGS.intersection(settings):
                    if s not in values:
                        raise VfLinkError(
                            f"{target}: its driver does not report {s}, so it could not be restored"
                        )
                    out[s] = values[s]
            if "mtu" in settings:
                out["mtu"] = self._nl().read_mtu(self._ifindex(target.netdev))
        except VfNetlinkError as e:
            raise VfLinkError(f"{target}: {e.reason}") from None
        return out

    def apply(self, target: VfTarget, values: Mapping[str, Any]) -> None:
        """Set the values: the MTU on the VF's netdev, the rest in one RTM_SETLINK on the PF."""
        pairs = dict(_ordered(values))
        try:
            if "mtu" in pairs:
                self._nl().set_mtu(self._ifindex(target.netdev), int(pairs.pop("mtu")))
            if pairs:
                self._nl().set_vf(self._ifindex(target.pf_netdev), target.vf, _vf_settings(pairs))
        except VfNetlinkError as e:
            raise VfLinkError(f"{target}: {e.reason}") from None
        except ValueError as e:
            raise VfLinkError(f"{target}: {clip(str(e), 200)}") from None


def _vf_settings(pairs: Mapping[str, Any]) -> VfSettings:
    """Return the IFLA_VF_* settings of these values (the caller sends vlan+qos and both rates together)."""
    state = pairs.get("linkState")
    return VfSettings(
        mac=pairs.get("mac"),
        vlan=pairs.get("vlan"),
        qos=pairs.get("qos"),
        min_tx_rate=pairs.get("minTxRateMbps"),
        max_tx_rate=pairs.get("maxTxRateMbps"),
        spoofchk=pairs.get("spoofChk"),
        link_state=LINK_STATES[state] if state is not None else None,
        trust=pairs.get("trust"),
    )


# ---------------------------------------------------------------------------------- the simulated node


class SimVfLinks:
    """VF settings of a simulated node, kept in ``.simnode/vflinks.json`` (shared by every process).

    Faults come from ``.simnode/vflinks-faults.json``: a list of ``{"op": "read"|"apply", "pf", "vf",
    "setting", "errno", "times"}`` (every key but ``op`` optional).  An ``apply`` fault naming a
    ``setting`` stops there, the settings before it in ``SETTINGS`` order applied, as the kernel stops at
    the first refused IFLA_VF_* attribute; ``times`` counts down (absent: for ever).  A PF netdev that is
    not under ``class/net`` is refused as the kernel refuses an unknown ifindex (ENODEV).
    """

    def __init__(self, root: Path) -> None:
        self._root = Path(root)
        self._dir = self._root / ".simnode"

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        # Several daemons (a killed one's successor, a test) share the file: one writer at a time.
        fd = os.open(self._dir / "vflinks.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _load(self, name: str) -> Any:
        data = files.read_regular(self._dir, name, limit=16 << 20)
        return json.loads(data) if data else None

    def _save(self, name: str, doc: Any) -> None:
        files.write_atomic(self._dir, name, json.dumps(doc, sort_keys=True).encode(), mode=0o644)

    def values(self, target: VfTarget) -> dict[str, Any]:
        """Return every setting of the VF as the simulated node has it now (tests read it)."""
        with self._locked():
            state = self._load(SIM_STATE) or {}
        return self._of(state, target)

    @staticmethod
    def _key(target: VfTarget) -> str:
        return f"{target.pf_netdev}/{target.vf}"

    def _of(self, state: Mapping[str, Any], target: VfTarget) -> dict[str, Any]:
        return {**SIM_DEFAULTS, **state.get(self._key(target), {})}

    def _fault(self, op: str, target: VfTarget, names: Collection[str]) -> tuple[str, int] | None:
        """Return (setting or "", errno) of the first fault matching, counting it down; None if none."""
        faults = self._load(SIM_FAULTS)
        if not isinstance(faults, list):
            return None
        for n, f in enumerate(faults):
            if not isinstance(f, dict) or f.get("op", "apply") != op:
                continue
            if f.get("pf", target.pf_netdev) != target.pf_netdev or f.get("vf", target.vf) != target.vf:
                continue
            setting = f.get("setting", "")
            if setting and setting not in names:
                continue
            times = f.get("times")
            if isinstance(times, int):
                if times <= 0:
                    continue
                faults[n] = {**f, "times": times - 1}
                self._save(SIM_FAULTS, faults)
            return setting, int(f.get("errno", errno.EIO))
        return None

    def _check(self, target: VfTarget) -> None:
        if not (self._root / "class/net" / target.pf_netdev).is_symlink():
            raise VfLinkError(f"{target}: {os.strerror(errno.ENODEV)} (no such PF netdev)")

    def read(self, target: VfTarget, settings: Collection[str]) -> dict[str, Any]:
        """Return the named settings' simulated values."""
        with self._locked():
            self._check(target)
            fault = self._fault("read", target, settings)
            if fault is not None:
                raise VfLinkError(f"{target}: read: {os.strerror(fault[1])}")
            values = self._of(self._load(SIM_STATE) or {}, target)
        return {s: values[s] for s in settings}

    def apply(self, target: VfTarget, values: Mapping[str, Any]) -> None:
        """Set the values one after the other, stopping at an injected fault (the earlier ones stay set)."""
        pairs = _ordered(values)
        with self._locked():
            self._check(target)
            fault = self._fault("apply", target, values)
            state = self._load(SIM_STATE) or {}
            entry = dict(state.get(self._key(target), {}))
            for setting, value in pairs:
                if fault is not None and fault[0] in ("", setting):
                    if entry:  # what the kernel had applied before it refused this one
                        state[self._key(target)] = entry
                        self._save(SIM_STATE, state)
                    raise VfLinkError(f"{target}: set {setting}: {os.strerror(fault[1])}")
                entry[setting] = value
            state[self._key(target)] = entry
            self._save(SIM_STATE, state)


def inject_fault(root: Path, **fault: Any) -> None:
    """Add a fault to a simulated node's VF links (see ``SimVfLinks``); for tests and the demo."""
    links = SimVfLinks(root)
    with links._locked():
        faults = links._load(SIM_FAULTS) or []
        faults.append(fault)
        links._save(SIM_FAULTS, faults)


def clear_faults(root: Path) -> None:
    """Remove every injected fault of a simulated node's VF links."""
    files.remove(Path(root) / ".simnode", SIM_FAULTS)


def links_for(sysfs_root: Path) -> VfLinks:
    """Return the VF-links backend of a sysfs root: the simulated one when it is a simulated node."""
    root = Path(sysfs_root)
    if (root / ".simnode").is_dir():
        return SimVfLinks(root)
    return NetlinkVfLinks(root)
