"""Health bitmaps: each function against a plain set model, and the extension against its twin."""

from __future__ import annotations

from types import ModuleType

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

# The impl/both fixtures are stateless modules, so sharing them across generated inputs is safe.
FIXTURE_SAFE = settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def _bitmap(indexes: set[int], nbytes: int) -> bytes:
    out = bytearray(nbytes)
    for i in indexes:
        out[i >> 3] |= 1 << (i & 7)
    return bytes(out)


def _bits(nbytes: int) -> st.SearchStrategy[set[int]]:
    return st.sets(st.integers(0, nbytes * 8 - 1), max_size=64) if nbytes else st.just(set())


@st.composite
def _triples(draw: st.DrawFn) -> tuple[int, set[int], set[int], set[int]]:
    # Lengths around word boundaries (7, 8, 9, 15, 16, 17 ...) exercise the zero-padded last word.
    nbytes = draw(st.sampled_from([0, 1, 7, 8, 9, 15, 16, 17, 63, 64, 65, 200]))
    return nbytes, draw(_bits(nbytes)), draw(_bits(nbytes)), draw(_bits(nbytes))


def test_layout_is_little_endian_by_bit(impl: ModuleType) -> None:
    mask = b"\xff" * 16
    assert impl.select_bits(_bitmap({0, 9, 63, 64, 127}, 16), mask) == (0, 9, 63, 64, 127)
    assert impl.select_bits(b"\x01\x80", b"\xff\xff") == (0, 15)


def test_diff_respects_mask(impl: ModuleType) -> None:
    old = _bitmap({1, 5, 70}, 16)
    new = _bitmap({1, 6, 71, 100}, 16)
    mask = _bitmap({5, 6, 71, 100}, 16)  # 70 differs but is outside the mask
    assert impl.diff_bitmaps(old, new, mask) == (5, 6, 71, 100)
    assert impl.diff_bitmaps(old, old, b"\xff" * 16) == ()


@FIXTURE_SAFE
@given(_triples())
def test_functions_match_a_set_model(impl: ModuleType, t: tuple[int, set[int], set[int], set[int]]) -> None:
    nbytes, a, b, m = t
    ba, bb, bm = _bitmap(a, nbytes), _bitmap(b, nbytes), _bitmap(m, nbytes)
    assert impl.diff_bitmaps(ba, bb, bm) == tuple(sorted((a ^ b) & m))
    assert impl.select_bits(ba, bm) == tuple(sorted(a & m))
    assert impl.or_bitmaps([ba, bb], bm) == _bitmap((a | b) & m, nbytes)
    assert impl.or_bitmaps([], bm) == bytes(nbytes)
    assert impl.set_bits(ba, sorted(b), True) == _bitmap(a | b, nbytes)
    assert impl.set_bits(ba, sorted(b), False) == _bitmap(a - b, nbytes)


@FIXTURE_SAFE
@given(st.binary(max_size=80), st.binary(max_size=80), st.binary(max_size=80))
def test_extension_agrees_with_twin(
    both: tuple[ModuleType, ModuleType], a: bytes, b: bytes, m: bytes
) -> None:
    n = min(len(a), len(b), len(m))
    a, b, m = a[:n], b[:n], m[:n]
    fast, twin = both
    assert fast.diff_bitmaps(a, b, m) == twin.diff_bitmaps(a, b, m)
    assert fast.select_bits(a, m) == twin.select_bits(a, m)
    assert fast.or_bitmaps([a, b, m], m) == twin.or_bitmaps([a, b, m], m)


def test_65536_bits_few_changes(impl: ModuleType) -> None:
    size = 65536 // 8
    old = bytes(size)
    new = _bitmap({3, 4095, 40000, 65535}, size)
    assert impl.diff_bitmaps(old, new, b"\xff" * size) == (3, 4095, 40000, 65535)
    assert impl.select_bits(new, b"\xff" * size) == (3, 4095, 40000, 65535)


def test_length_mismatch_names_each_bitmap(impl: ModuleType) -> None:
    with pytest.raises(ValueError, match="old 8 bytes, new 16 bytes, mask 8 bytes"):
        impl.diff_bitmaps(bytes(8), bytes(16), bytes(8))
    with pytest.raises(ValueError, match=r"bitmaps\[1\] 2 bytes"):
        impl.or_bitmaps([bytes(1), bytes(2)], bytes(1))


@pytest.mark.parametrize("index", [-1, 16, 2**70])
def test_set_bits_rejects_out_of_range(impl: ModuleType, index: int) -> None:
    with pytest.raises(IndexError, match="outside a bitmap of 16 bits"):
        impl.set_bits(bytes(2), [index], True)


def test_set_bits_leaves_input_untouched(impl: ModuleType) -> None:
    original = bytes(4)
    assert impl.set_bits(original, [0, 31], True) == b"\x01\x00\x00\x80"
    assert original == bytes(4)
    # Regression: the extension once wrote into CPython's shared single-byte b"\x00" object.
    one = bytes([0])
    assert impl.set_bits(one, [0], True) == b"\x01"
    assert one == b"\x00" and bytes([0])[0] == 0
