"""One PCI address rule: every stage that reads an address agrees with the kernel's pci_name()."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from densedev import pci
from densedev.alloc import devinfo
from densedev.alloc.respond import build_lookup
from densedev.dra import names
from densedev.pools.config import normalize_pci_address


def kernel_name(domain: int, bus: int, dev: int, fn: int) -> str:
    """The kernel's pci_name(): "%04x:%02x:%02x.%d" (include/linux/pci.h), written here independently."""
    return f"{domain:04x}:{bus:02x}:{dev:02x}.{fn}"


@given(st.integers(0, 0xFFFFFFFF), st.integers(0, 0xFF), st.integers(0, 0x1F), st.integers(0, 7))
def test_every_address_the_kernel_prints_is_one_everywhere(domain: int, bus: int, dev: int, fn: int) -> None:
    address = kernel_name(domain, bus, dev, fn)
    assert pci.is_address(address)
    assert normalize_pci_address(address) == address
    assert normalize_pci_address(address.upper()) == address
    assert devinfo.parse_name(f"intel.com-sriov-{address}-device.json") == ("intel.com-sriov", address)
    assert names.pci_address(names.device_name(address)) == address


# Device numbers above 0x1f and functions above 7 do not fit devfn; the kernel writes lower case, a
# domain of at least 4 digits, and nothing around the address.
NOT_ADDRESSES = [
    "0000:3b:20.0",
    "0000:3b:ff.0",
    "0000:3b:02.8",
    "0000:3B:02.1",
    "000:3b:02.1",
    "100000000:3b:02.1",
    "0000:3b:02.1\n",
    " 0000:3b:02.1",
    "0000:3b:2.1",
    "mlx5_core.sf.4",
]


@pytest.mark.parametrize("text", NOT_ADDRESSES)
def test_what_the_kernel_never_prints_is_no_address_anywhere(text: str) -> None:
    assert not pci.is_address(text)
    assert devinfo.parse_name(f"intel.com-sriov-{text}-device.json") is None
    with pytest.raises(ValueError):
        names.device_name(text)
    assert names.pci_address("pci-" + text.replace(":", "-").replace(".", "-")) is None


@pytest.mark.parametrize("text", ["0000:3b:20.0", "0000:3b:02.8", "3b:ff.0"])
def test_the_config_refuses_what_the_kernel_never_prints(text: str) -> None:
    assert normalize_pci_address(text) is None


def test_the_config_may_leave_out_the_domain() -> None:
    # The SR-IOV plugin's selectors take "3b:02.1" for domain 0 (its pciAddresses examples).
    assert normalize_pci_address("3B:02.1") == "0000:3b:02.1"


def test_the_preferred_allocation_lookup_covers_4_digit_domains_only() -> None:
    # Fixed offsets into "dddd:bb:dd.f", as the accelerator's parse_bdf: a VMD domain is left out.
    lookup = build_lookup({"0000:3b:02.1": 0, "10000:00:01.0": 1, "0000:3b:20.0": 2})
    assert len(lookup) == 4 + 4 * 65536  # one domain block: only the first address fits it
