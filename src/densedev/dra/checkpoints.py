"""Which DRA drivers left a densedev claims checkpoint in the kubelet's plugins dir.

The daemon asks this at every start, DRA pools or not (a renamed driver's claims must be recovered), so
it is kept apart from ``claims``, whose records and checkpoint writer only a DRA driver needs: a
device-plugin-only node never imports those (issue 14: start-up).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Collection
from pathlib import Path

from .. import files
from . import CHECKPOINT_NAME

# The warnings below keep the logger they were always written under (log lines name it).
log = logging.getLogger("densedev.dra.claims")

CHECKPOINT_KIND = "DensedevDRACheckpoint"
MAX_CHECKPOINT = 64 * 1024 * 1024  # a node's claims take kilobytes each; anything bigger is not ours
SPEC_PREFIX = "densedev_dra_"  # not "densedev-": the device-plugin side prunes its densedev-*.json specs


def spec_stem(driver: str) -> str:
    """Return the start of every CDI spec file name of a driver's claims (``densedev_dra_<driver>_``)."""
    part = driver if len(driver) <= 120 else hashlib.sha256(driver.encode()).hexdigest()[:32]
    return f"{SPEC_PREFIX}{part}_"


def specs_of(stem: str, cdi_entries: Collection[str]) -> list[str]:
    """Return the CDI spec file names in ``cdi_entries`` that a driver of this stem wrote for claims."""
    return [n for n in cdi_entries if n.startswith(stem) and n.endswith(".json")]


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


def find_checkpoints(
    plugins_dir: Path, name: str = CHECKPOINT_NAME, cdi_dir: Path | None = None
) -> list[str]:
    """Return the drivers whose own directory under ``plugins_dir`` holds a densedev claims checkpoint.

    A directory counts when its checkpoint records the directory's own name as its driver (so a copied
    or moved directory is not taken for another driver's); one that does not is named in a warning
    and left alone — unless it is a damaged checkpoint of ours: something is at its checkpoint path
    and ``cdi_dir`` holds CDI specs a densedev driver of the directory's name wrote for claims.  Such a
    driver is found too, so that its claims are held and its plugin served (fail closed: the record of
    its claims is lost, not their use).
    """
    try:
        entries = files.list_names(plugins_dir)
    except OSError as e:
        log.warning("cannot list the kubelet plugins dir %s: %s", plugins_dir, e)
        return []
    cdi_entries: list[str] | None = None
    found: list[str] = []
    for entry in entries:
        if entry.startswith("."):
            continue
        driver = checkpoint_driver(plugins_dir / entry, name)
        if driver != entry and cdi_dir is not None and _present(plugins_dir / entry, name):
            if cdi_entries is None:
                try:
                    cdi_entries = files.list_names(cdi_dir)
                except OSError:
                    cdi_entries = []
            if specs_of(spec_stem(entry), cdi_entries):
                log.warning(
                    "DRA checkpoint %s is not a readable checkpoint of driver %r, but CDI specs of its "
                    "claims are in %s: taken as its damaged checkpoint",
                    plugins_dir / entry / name,
                    entry,
                    cdi_dir,
                )
                found.append(entry)
                continue
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


def _present(directory: Path, name: str) -> bool:
    """Return whether anything (a file, a symlink, a FIFO...) is at ``directory/name``, never following it."""
    try:
        dirfd = files.open_dir(directory)
    except OSError:
        return False
    try:
        os.stat(name, dir_fd=dirfd, follow_symlinks=False)
    except OSError:
        return False
    finally:
        os.close(dirfd)
    return True
