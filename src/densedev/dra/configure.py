"""What Prepare changes on a device, journaled so that it is put back whatever happens.

A claim's ``VfConfig`` (``params.py``) asks settings of its VFs: the MTU of the VF's netdev and, through
the PF's rtnetlink, MAC, VLAN and priority, trust, spoof checking, rates and link state.  A change to a
device outlives the daemon (the kernel keeps it), so it is recorded in the DRA checkpoint *before* it
is made — the device, the values it had, the values it gets — and every record is in one of three
states:

- ``applying``: written before the first change; the change may have been cut off part way;
- ``applied``: the claim was recorded prepared with every change made (one checkpoint write holds both);
- ``restoring``: the claim was unprepared (dropped in the same write); the old values go back.

A record is dropped only after its old values are back.  At start every record that is not ``applied``
for a claim still prepared is restored; until it is, its device is withheld from every pool (device
plugin and DRA: ``NodeService.unrestored``), and a restore that fails is retried with backoff.

Settings travel in pairs the kernel sets together: ``vlan`` with ``qos`` (one IFLA_VF_VLAN), the two
rates (one IFLA_VF_RATE); asking one records and sets both, the other kept at its current value.

``DENSEDEV_STOP_AT=<step>`` makes the process SIGKILL itself at a named step (``STEPS``): the fault
tests kill a real daemon at every step of a Prepare and an Unprepare this way.
"""

from __future__ import annotations

import enum
import logging
import os
import signal
from collections import Counter as Tally
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ..model import Device
from ..node.vflinks import SETTINGS, VfTarget
from ..ops.metrics import Counter, Gauge, Registry
from .params import LinkState, VfConfig

log = logging.getLogger(__name__)

STOP_ENV = "DENSEDEV_STOP_AT"
# Where a Prepare (``prepare-*``) and an Unprepare (``unprepare-*``) can be cut off, in order.
STEPS = (
    "prepare-read",  # old values read; nothing recorded, nothing changed
    "prepare-journaled",  # the journal records the change; nothing changed yet
    "prepare-rebound",  # the driver rebound (when asked); no link setting made yet
    "prepare-partial",  # the PF's settings made, the VF netdev's MTU not yet
    "prepare-applied",  # every change made; the claim not recorded yet
    "prepare-recorded",  # the claim recorded prepared; the kubelet not answered yet
    "unprepare-marked",  # the claim dropped, its records marked restoring; nothing put back yet
    "unprepare-partial",  # the MTU put back, the PF's settings not yet
    "unprepare-links-back",  # every link setting put back, the driver not yet (when rebound)
    "unprepare-restored",  # every old value back; the record not dropped yet
    "unprepare-dropped",  # the record dropped; the kubelet not answered yet
)


# A rebind is journaled as two more keys: the driver bound before ("" for none) and its driver_override
# (None for none), restored through node/rebind.py; the asked driver is ``new["driver"]``.
DRIVER = "driver"
OVERRIDE = "driverOverride"
KEYS = (*SETTINGS, DRIVER, OVERRIDE)


def stop_at(step: str) -> None:
    """SIGKILL this process when ``DENSEDEV_STOP_AT`` names ``step`` (a fault hook for the kill tests)."""
    if os.environ.get(STOP_ENV) == step:
        log.warning("%s=%s: killing myself", STOP_ENV, step)
        os.kill(os.getpid(), signal.SIGKILL)


class JournalState(enum.StrEnum):
    """Where a device's change stands (see the module docstring)."""

    APPLYING = "applying"
    APPLIED = "applied"
    RESTORING = "restoring"


@dataclass(frozen=True)
class JournalRecord:
    """One device a claim changes: where rtnetlink reaches it, its old values, the new ones, the state."""

    claim: str  # the claim's UID
    device_id: str  # the VF's PCI address
    target: VfTarget
    old: Mapping[str, Any] = field(hash=False)  # what restores it, setting → value
    new: Mapping[str, Any] = field(hash=False)  # what the claim asked (pairs completed)
    state: JournalState = JournalState.APPLYING

    def changed(self) -> dict[str, Any]:
        """Return the settings whose asked value differs from the old one."""
        return {k: v for k, v in self.new.items() if self.old.get(k) != v}


def record_doc(r: JournalRecord) -> dict[str, Any]:
    """Return the checkpoint form of a journal record."""
    return {
        "claim": r.claim,
        "id": r.device_id,
        "pf": r.target.pf_netdev,
        "vf": r.target.vf,
        "netdev": r.target.netdev,
        "old": dict(r.old),
        "new": dict(r.new),
        "state": r.state.value,
    }


def record_of(doc: Any) -> JournalRecord:
    """Return a journal record from its checkpoint form; KeyError/TypeError/ValueError if malformed."""
    if not isinstance(doc, dict):
        raise TypeError("a journal record is not an object")
    old, new = doc["old"], doc["new"]
    if not isinstance(old, dict) or not isinstance(new, dict):
        raise TypeError("a journal record's values are not objects")
    unknown = (set(old) | set(new)) - set(KEYS)
    if unknown:
        raise ValueError(f"a journal record names unknown settings {sorted(unknown)}")
    vf = doc["vf"]
    if not isinstance(vf, int) or isinstance(vf, bool):
        raise TypeError("a journal record's VF index is not an integer")
    target = VfTarget(str(doc["pf"]), vf, str(doc.get("netdev", "")))
    return JournalRecord(str(doc["claim"]), str(doc["id"]), target, old, new, JournalState(doc["state"]))


def wanted(cfg: VfConfig) -> dict[str, Any]:
    """Return the link settings a config asks, as setting → value (``driver`` and ``ifName`` are not)."""
    out: dict[str, Any] = {}
    if cfg.mtu is not None:
        out["mtu"] = cfg.mtu
    if cfg.mac is not None:
        out["mac"] = cfg.mac.lower()
    if cfg.vlan is not None:
        out["vlan"] = cfg.vlan
        out["qos"] = cfg.qos if cfg.qos is not None else 0  # IFLA_VF_VLAN sets both: no qos is 0
    if cfg.min_tx_rate_mbps is not None:
        out["minTxRateMbps"] = cfg.min_tx_rate_mbps
    if cfg.max_tx_rate_mbps is not None:
        out["maxTxRateMbps"] = cfg.max_tx_rate_mbps
    if cfg.trust is not None:
        out["trust"] = cfg.trust
    if cfg.spoof_chk is not None:
        out["spoofChk"] = cfg.spoof_chk
    if cfg.link_state is not None:
        out["linkState"] = LinkState(cfg.link_state).value
    return out


def touched(asked: Mapping[str, Any]) -> tuple[str, ...]:
    """Return every setting a change of ``asked`` touches: a rate with the other rate, in SETTINGS order."""
    names = set(asked)
    if names & {"minTxRateMbps", "maxTxRateMbps"}:
        names |= {"minTxRateMbps", "maxTxRateMbps"}  # IFLA_VF_RATE carries both
    if "vlan" in names:
        names.add("qos")
    return tuple(s for s in SETTINGS if s in names)


def completed(asked: Mapping[str, Any], old: Mapping[str, Any]) -> dict[str, Any]:
    """Return the values to set: what is asked, the other half of a pair kept as it is now."""
    return {s: asked[s] if s in asked else old[s] for s in touched(asked)}


def target_of(device: Device) -> VfTarget:
    """Return where rtnetlink reaches a scanned VF: its PF's netdev, its index, its own first netdev."""
    return VfTarget(device.pf_netdev, device.vf_index, device.netdevs[0] if device.netdevs else "")


def split(values: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Return (the driver, the PF's settings, the VF netdev's MTU) of some values: three steps."""
    driver = {k: v for k, v in values.items() if k in (DRIVER, OVERRIDE)}
    pf = {k: v for k, v in values.items() if k in SETTINGS and k != "mtu"}
    own = {k: v for k, v in values.items() if k == "mtu"}
    return driver, pf, own


def describe(values: Mapping[str, Any]) -> str:
    """Return ``mtu=9000 vlan=100`` for a log line."""
    return " ".join(f"{k}={values[k]}" for k in KEYS if k in values and k != OVERRIDE) or "-"


class JournalMetrics:
    """The journal's metrics, shared by every driver of the daemon (each reports its own counts)."""

    def __init__(self, registry: Registry) -> None:
        self._configured = Gauge(
            "densedev_dra_configured_devices",
            "Devices prepared DRA claims changed a link setting of, by setting (restored at Unprepare).",
            ["setting"],
            registry=registry,
        )
        self._restores = Counter(
            "densedev_dra_restores_total",
            "Restores of devices DRA claims had configured, by result (ok, failed: retried with backoff).",
            ["result"],
            registry=registry,
        )
        self._unrestored = Gauge(
            "densedev_dra_unrestored_devices",
            "Devices whose old settings are not back yet (a failed restore): withheld from every pool.",
            registry=registry,
        )
        self._owners: dict[str, tuple[Tally[str], int]] = {}

    def restored(self, ok: bool) -> None:
        """Count one restore attempt."""
        self._restores.labels("ok" if ok else "failed").inc()

    def report(self, owner: str, records: Iterable[JournalRecord], unrestored: int) -> None:
        """Take one driver's journal as it is now (configured devices by setting, devices not restored)."""
        tally: Tally[str] = Tally()
        for r in records:
            if r.state is JournalState.APPLIED:
                tally.update([k for k in r.changed() if k != OVERRIDE])
        self._owners[owner] = (tally, unrestored)
        total: Tally[str] = Tally()
        for t, _n in self._owners.values():
            total.update(t)
        for s in (*SETTINGS, DRIVER):
            self._configured.labels(s).set(total.get(s, 0))
        self._unrestored.set(sum(n for _t, n in self._owners.values()))


def applied_of(records: Iterable[JournalRecord], claim: str) -> dict[str, dict[str, Any]]:
    """Return what a claim's records set, per device ID (``PreparedClaim.applied``)."""
    return {
        r.device_id: {k: v for k, v in r.new.items() if k != OVERRIDE} for r in records if r.claim == claim
    }


def marked(
    records: Iterable[JournalRecord], claims: Iterable[str], state: JournalState
) -> tuple[JournalRecord, ...]:
    """Return the records with those of ``claims`` in ``state``."""
    uids = set(claims)
    return tuple(replace(r, state=state) if r.claim in uids else r for r in records)
