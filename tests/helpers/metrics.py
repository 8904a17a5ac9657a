"""Reading a daemon's metrics in tests, as a scrape of /metrics would see them."""

from __future__ import annotations

from densedev.daemon import Daemon


def sample(daemon: Daemon, name: str, **labels: str) -> float:
    """Return the value of the sample ``name`` whose labels include ``labels`` (0 when there is none)."""
    for family in daemon.metrics.registry.collect():
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return 0.0
