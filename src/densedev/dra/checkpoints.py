"""Which DRA drivers left a densedev claims checkpoint in the kubelet's plugins dir.

The daemon asks this at every start, DRA pools or not (a renamed driver's claims must be recovered), so
it is kept apart from ``claims``, whose records and checkpoint writer only a DRA driver needs: a
device-plugin-only node never imports those (issue 14: start-up).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from .. import files
from . import CHECKPOINT_NAME

# The warnings below keep the logger they were always written under (log lines name it).
log = logging.getLogger("densedev.dra.claims")

CHECKPOINT_KIND = "DensedevDRACheckpoint"
MAX_CHECKPOINT = 64 * 1024 * 1024  # a node's claims take kilobytes each; anything bigger is not ours


def checkpoint_driver(directory: Path, name: str = CHECKPOINT_NAME) -> str | None:
    """Return the driver a densedev claims checkpoint in ``directory`` was written for, else None.

    Read only, never moved or changed: ``<plugins dir>`` is shared with other vendors' DRA drivers, and
    the official helper's drivers keep a ``checkpoint.json`` of their own in their directory too (a
    checkpointmanager envelope, ``{"checksum", "v1", ...}``).  Ours says what it is: ``kind``
    ``DensedevDRACheckpoint`` and the ``driver`` it was written for, in every version so far; a file
    without both is someone else's (or no longer readable as ours) and does not count.
    """
    data = files.read_regular(directory, name, limit=MAX_CHECKPOINT)
    # The kind is searched as bytes first: a foreign file (possibly large) is then never parsed.
    if data is None or CHECKPOINT_KIND.encode() not in data:
        return None
    try:
        doc = json.loads(data)
    except ValueError:
        return None
    if not isinstance(doc, dict) or doc.get("kind") != CHECKPOINT_KIND:
        return None
    driver = doc.get("driver")
    return driver if isinstance(driver, str) else None


def find_checkpoints(plugins_dir: Path, name: str = CHECKPOINT_NAME) -> list[str]:
    """Return the drivers whose own directory under ``plugins_dir`` holds a densedev claims checkpoint.

    A directory counts when its checkpoint records the directory's own name as its driver (so a copied
    or moved directory is not taken for another driver's); one that does not is named in a warning
    and left alone.
    """
    try:
        entries = files.list_names(plugins_dir)
    except OSError as e:
        log.warning("cannot list the kubelet plugins dir %s: %s", plugins_dir, e)
        return []
    found: list[str] = []
    for entry in entries:
        if entry.startswith("."):
            continue
        driver = checkpoint_driver(plugins_dir / entry, name)
        if driver is None:
            continue
        if driver != entry:
            log.warning(
                "DRA checkpoint %s was written for driver %r, not %r; ignored",
                plugins_dir / entry / name,
                driver,
                entry,
            )
            continue
        found.append(driver)
    return found
