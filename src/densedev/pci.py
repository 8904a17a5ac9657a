"""PCI function addresses as the kernel names them: the one definition every stage matches against.

The kernel names a PCI function ``pci_name()`` = ``"%04x:%02x:%02x.%d"`` (include/linux/pci.h): domain,
bus, device and function in lower-case hex.  The device number is 5 bits (``PCI_SLOT(devfn)``, 0-0x1f) and
the function 3 bits (``PCI_FUNC(devfn)``, 0-7).  The domain is printed with at least 4 digits but is an
``int`` (``pci_domain_nr()``): hosts with Intel VMD or several segment groups have domains past 0xffff,
which print with 5 or more digits (VMD's start at 0x10000, drivers/pci/controller/vmd.c).
"""

from __future__ import annotations

import re

DOMAIN = r"[0-9a-f]{4,8}"  # "%04x" of a 32-bit domain: 4 digits, more on VMD hosts
BUS = r"[0-9a-f]{2}"  # 8 bits
DEVICE = r"[01][0-9a-f]"  # PCI_SLOT(devfn): 5 bits, 0x00-0x1f
FUNCTION = r"[0-7]"  # PCI_FUNC(devfn): 3 bits
# One group per part, so users can take an address apart or embed the pattern in a larger one.
ADDRESS = rf"({DOMAIN}):({BUS}):({DEVICE})\.({FUNCTION})"
ADDRESS_RE = re.compile(ADDRESS)
CANONICAL_LENGTH = 12  # "0000:3b:02.1": the common 4-digit-domain form


def is_address(text: str) -> bool:
    """Return whether ``text`` is a PCI address exactly as the kernel writes one (lower-case, full)."""
    return ADDRESS_RE.fullmatch(text) is not None
