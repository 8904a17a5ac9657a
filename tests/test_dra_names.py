"""DRA device names are DNS labels and lead back to the PCI address."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from densedev.dra import names

DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


@given(st.integers(0, 0xFFFF), st.integers(0, 0xFF), st.integers(0, 0x1F), st.integers(0, 7))
def test_names_are_dns_labels_and_reversible(domain: int, bus: int, dev: int, fn: int) -> None:
    address = f"{domain:04x}:{bus:02x}:{dev:02x}.{fn}"
    name = names.device_name(address)
    assert DNS_LABEL.fullmatch(name) and len(name) <= 63
    assert names.pci_address(name) == address


@pytest.mark.parametrize("bad", ["", "0000:19:00.8", "0000:19:00.2\n", "0000:19:00", "../x", "0000:1G:00.0"])
def test_not_a_pci_address_is_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        names.device_name(bad)


@pytest.mark.parametrize("other", ["gpu-0", "pci-0000-19-00-8", "pci-0000-19-00-2-x", "PCI-0000-19-00-2"])
def test_names_not_ours_map_to_nothing(other: str) -> None:
    assert names.pci_address(other) is None
