"""The pool set: what tells two selections of pools apart, one diff for rescans and reloads alike.

A rescan (new devices, same config), a reload (same devices, new config) and a change in what pods
hold (other devices withheld) all end in one new tuple of pools.  ``diff`` compares it with the tuple
last applied, as the Intel device plugin framework's notifier compares device trees, and names the
pools whose server stops, re-registers or takes a new membership in place; the daemon applies that
through ``kubelet.pools.PoolSet``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from .model import Pool, PoolApi, PoolConfig

__all__ = ["PoolChanges", "diff", "options_of"]


class PoolChanges(NamedTuple):
    """The difference between two pool sets, by extended resource name (removed in the old set's order,
    the rest in the new set's)."""

    added: tuple[str, ...] = ()  # configured now, not before (either API)
    removed: tuple[str, ...] = ()  # configured before, not now
    changed: tuple[str, ...] = ()  # configured both times, differently
    reregister: tuple[str, ...] = ()  # options changed: the kubelet reads them only at registration
    to_dra: tuple[str, ...] = ()  # served through the device-plugin API before, through DRA now
    replaced: tuple[str, ...] = ()  # a device-plugin pool keeping its server: new membership or config

    @property
    def stopped(self) -> tuple[str, ...]:
        """Return the pools whose device-plugin server stops: removed, re-registering or moving to DRA."""
        return self.removed + self.reregister + self.to_dra


def options_of(pool: PoolConfig) -> tuple[bool, bool]:
    """Return the options the kubelet reads once per registration: PreStartContainer, preferred allocation."""
    return pool.prestart, pool.preferred != "none"


def diff(old: Sequence[Pool], new: Sequence[Pool]) -> PoolChanges:
    """Return what changed from the pool set ``old`` to ``new`` (both as ``select.build_pools`` makes them,
    after ownership withheld what pods hold)."""
    before = {p.config.full_name: p for p in old}
    after = {p.config.full_name: p for p in new}
    both = [n for n in after if n in before]
    reregister = tuple(n for n in both if options_of(before[n].config) != options_of(after[n].config))
    to_dra = tuple(
        n for n in both if before[n].config.api is not PoolApi.DRA and after[n].config.api is PoolApi.DRA
    )
    # A re-registering pool gets a new server with the new membership: nothing to replace in place.
    keep = [
        n
        for n in both
        if n not in reregister
        and before[n].config.api is PoolApi.DEVICE_PLUGIN
        and after[n].config.api is PoolApi.DEVICE_PLUGIN
    ]
    return PoolChanges(
        added=tuple(n for n in after if n not in before),
        removed=tuple(n for n in before if n not in after),
        changed=tuple(n for n in both if before[n].config != after[n].config),
        reregister=reregister,
        to_dra=to_dra,
        replaced=tuple(
            n
            for n in keep
            if before[n].members != after[n].members
            or before[n].config != after[n].config
            or before[n].shared != after[n].shared  # the HCAs behind a pool-wide shared RDMA pool
        ),
    )
