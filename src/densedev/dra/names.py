"""Names DRA gives our devices: DNS labels derived from PCI addresses, reversible.

ResourceSlice device names must be DNS labels (RFC 1123: lowercase alphanumerics and '-', at most 63
characters, starting and ending with an alphanumeric; resource.k8s.io Device.name).  A PCI address
``DDDD:BB:DD.F`` has ':' and '.', so both become '-' behind a fixed ``pci-`` prefix; the mapping is
one-to-one because PCI addresses have a fixed shape, so a claim's device name leads back to the device ID
(its PCI address) the device plugin API uses, and one ownership map serves both APIs.
"""

from __future__ import annotations

import re

from .. import pci
from ..model import DEFAULT_DRIVER_NAME as DEFAULT_DRIVER_NAME  # the config's default, named here too

PREFIX = "pci-"
_NAME = re.compile(rf"pci-({pci.DOMAIN})-({pci.BUS})-({pci.DEVICE})-({pci.FUNCTION})")


def device_name(pci_address: str) -> str:
    """Return the DRA device name of a PCI address (``0000:19:00.2`` → ``pci-0000-19-00-2``)."""
    m = pci.ADDRESS_RE.fullmatch(pci_address)
    if m is None:
        raise ValueError(f"not a PCI address: {pci_address!r}")
    return PREFIX + "-".join(m.groups())


def pci_address(name: str) -> str | None:
    """Return the PCI address a DRA device name stands for, or None when it is not one of ours."""
    m = _NAME.fullmatch(name)
    if m is None:
        return None
    domain, bus, dev, fn = m.groups()
    return f"{domain}:{bus}:{dev}.{fn}"
