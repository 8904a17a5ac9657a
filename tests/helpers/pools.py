"""Pools chosen from hand-built devices by the real config parser and selection, and three sample VFs."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from densedev.model import Config, Device, Pool
from densedev.pools import config
from densedev.pools import select as selectors
from helpers.devices import unlinked as dev


def cfg(*pools: dict[str, Any]) -> Config:
    """Parse a config made of the given resourceList entries."""
    return config.parse(json.dumps({"resourceList": list(pools)}))


def ids(pool: Pool) -> list[str]:
    """The member IDs of a pool, in its order."""
    return [m.id for m in pool.members]


def select(
    sel: dict[str, Any] | list[dict[str, Any]], devices: Sequence[Device], **pool_kw: Any
) -> list[str]:
    """Return the IDs one pool with selector(s) ``sel`` takes from ``devices``."""
    (pool,) = selectors.build_pools(cfg({"resourceName": "p", "selectors": sel, **pool_kw}), devices)
    return ids(pool)


VF_A = dev("0000:3b:02.0", vendor="8086", device="154c", driver="iavf", pf="0000:3b:00.0", vf_index=0)
VF_B = dev("0000:3b:02.1", vendor="8086", device="10ed", driver="vfio-pci", pf="0000:3b:00.0", vf_index=1)
VF_C = dev("0000:5e:02.0", vendor="15b3", device="101e", driver="mlx5_core", pf="0000:5e:00.0", vf_index=0)
THREE = [VF_A, VF_B, VF_C]
