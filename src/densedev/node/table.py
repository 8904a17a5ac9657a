"""The device table: every device one scan found, immutable, indexed by id for every later stage."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from ..model import Device


@dataclass(frozen=True)
class DeviceTable:
    """Every device one scan found, sorted by id, and the warnings about what it skipped or left empty."""

    devices: tuple[Device, ...]
    warnings: tuple[str, ...] = ()
    _index: dict[str, int] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Built once: pools, health and allocation all look devices up by id.
        index = {d.id: i for i, d in enumerate(self.devices)}
        object.__setattr__(self, "_index", index)

    @property
    def index(self) -> Mapping[str, int]:
        """Return the table's id → position index (shared, not copied: the health tracker reads it too)."""
        return self._index

    def by_id(self) -> Mapping[str, Device]:
        """Return a read-only mapping of device id → device."""
        devices = self.devices
        return _ById(self._index, devices)

    def index_of(self, device_id: str) -> int:
        """Return the position of ``device_id`` in ``devices`` (raises KeyError naming an unknown id)."""
        try:
            return self._index[device_id]
        except KeyError:
            raise KeyError(f"no device {device_id!r} in the device table") from None

    def __len__(self) -> int:
        return len(self.devices)

    def merged(self, update: DeviceTable, scope: Iterable[str]) -> DeviceTable:
        """Return this table with the ids in ``scope`` replaced by ``update``'s (or dropped)."""
        drop = set(scope) | {d.id for d in update.devices}
        kept = [d for d in self.devices if d.id not in drop]
        kept.extend(update.devices)
        kept.sort(key=lambda d: d.id)
        return DeviceTable(tuple(kept), update.warnings)


class _ById(Mapping[str, Device]):
    """A mapping view over a table's index and devices, so ``by_id`` costs nothing to call."""

    __slots__ = ("_devices", "_index")

    def __init__(self, index: dict[str, int], devices: tuple[Device, ...]) -> None:
        self._index = index
        self._devices = devices

    def __getitem__(self, key: str) -> Device:
        return self._devices[self._index[key]]

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)
