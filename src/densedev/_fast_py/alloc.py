"""Twin of ``_pyx/alloc.pxi``: rank a pool's free devices for GetPreferredAllocation.

The kubelet sends every available ID of the resource (thousands on a dense node) and wants ``size`` of
them back; it intersects the answer with ``available`` and fills any shortfall itself, so the answer
must be valid and good, and fast because pod admission waits on it.

``topology`` packs one little-endian int32 triple ``(numa, root, pf)`` per pool member, indexed by
``index[id]``: ``numa`` is the kernel's ``numa_node`` (-1 unknown), ``root`` a dense id of the PCIe root
(``pci0000:3a``) and ``pf`` a dense id of the parent PF (a device without a PF is its own group).

Ranking (both policies put the target NUMA node first: the must-includes' most common node, else the
node with most free devices; lowest id on ties):

- pack: PFs ordered by (other NUMA node, not a must-include's PF, not under a must-include's root,
  cannot hold all ``need`` alone, best fit: fewest free among those that can / most free among those
  that cannot, root id, pf id); devices by (PF rank, position).
- spread: devices by (other NUMA node, round, PF rank, position), where a device's round is how many
  devices of its PF come before it (must-includes count first), so every PF gives one device before
  any gives two; PFs ordered by (other NUMA node, most free, root id, pf id).
- none: devices in the kubelet's order.

Every key ends on the position in ``available``, so the order is total and both implementations agree.

``lookup`` (optional, from ``allocation.build_lookup``) resolves canonical PCI addresses without the
dict: blocks of ``uint32 domain`` + 65,536 ``int32`` members indexed by ``bus << 8 | devfn`` (-1: none).
A canonical address whose domain has a block is resolved there only; anything else goes to ``index``.
The kubelet sends IDs as fresh strings, so a dict lookup also pays for hashing each one.
"""

from __future__ import annotations

import heapq
import re
import struct
from collections.abc import Mapping, Sequence

POLICY_PACK = 0
POLICY_SPREAD = 1
POLICY_NONE = 2

# The kernel's CONFIG_NODES_SHIFT is at most 10, so NUMA node ids are below 1024 (MAX_NUMNODES).
MAX_NUMA = 1024
# Positions, counts, roots and PFs are packed into 20-bit fields of 64-bit sort keys.
MAX_MEMBERS = (1 << 20) - 1
_F20 = 20
_MAX_ROUND = 0xFFFF
LOOKUP_BLOCK = 4 + 4 * 65536
# The kernel's name for a PCI function (pci_name(): "%04x:%02x:%02x.%d"), device number at most 0x1f.
_BDF = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[01][0-9a-f]\.[0-7]")


def parse_bdf(dev_id: str) -> int:
    """Return ``domain << 16 | bus << 8 | device << 3 | function`` of a canonical PCI address, else -1."""
    if len(dev_id) != 12 or not _BDF.fullmatch(dev_id):
        return -1
    return (
        int(dev_id[0:4], 16) << 16 | int(dev_id[5:7], 16) << 8 | int(dev_id[8:10], 16) << 3 | int(dev_id[11])
    )


def _check(available: Sequence[str], topology: bytes, policy: int) -> list[tuple[int, int, int]]:
    """Validate the arguments and unpack the topology triples."""
    if policy not in (POLICY_PACK, POLICY_SPREAD, POLICY_NONE):
        raise ValueError(f"unknown preferred-allocation policy {policy}")
    if len(topology) % 12:
        raise ValueError(f"topology is {len(topology)} bytes, not a whole number of int32 triples")
    members = len(topology) // 12
    if members > MAX_MEMBERS or len(available) > MAX_MEMBERS:
        raise ValueError(f"at most {MAX_MEMBERS} devices per pool are supported")
    triples = list(struct.iter_unpack("<iii", topology))
    for numa, root, pf in triples:
        if not -1 <= numa < MAX_NUMA:
            raise ValueError(f"NUMA node {numa} out of range [-1, {MAX_NUMA})")
        # Dense ids: there are never more roots or PF groups than members.
        if not (0 <= root < members and 0 <= pf < members):
            raise ValueError(f"root {root} / pf {pf} out of range [0, {members})")
    return triples


def _member(index: Mapping[str, int], dev_id: str, members: int, lookup: bytes) -> int:
    bdf = parse_bdf(dev_id) if lookup else -1
    if bdf >= 0:
        for off in range(0, len(lookup), LOOKUP_BLOCK):
            if struct.unpack_from("<I", lookup, off)[0] == bdf >> 16:
                (m,) = struct.unpack_from("<i", lookup, off + 4 + 4 * (bdf & 0xFFFF))
                break
        else:
            m = index.get(dev_id, -1)
    else:
        m = index.get(dev_id, -1)
    if m >= members:
        raise ValueError(f"index maps {dev_id!r} to {m}, beyond the topology's {members} members")
    return m


def _target_numa(counts: dict[int, int]) -> int:
    """Return the NUMA node with the highest count (lowest id on ties), -2 when there is none."""
    best, best_count = -2, 0
    for n in sorted(counts):
        if counts[n] > best_count:
            best, best_count = n, counts[n]
    return best


def pick_devices(
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
    index: Mapping[str, int],
    topology: bytes,
    policy: int,
    lookup: bytes = b"",
) -> tuple[str, ...]:
    """Return the preferred IDs: the must-includes, then the best-ranked free IDs up to ``size``."""
    triples = _check(available, topology, policy)
    if len(lookup) % LOOKUP_BLOCK:
        raise ValueError(f"lookup is {len(lookup)} bytes, not a whole number of {LOOKUP_BLOCK}-byte blocks")
    members = len(triples)

    taken: set[int] = set()
    seen_unknown: set[str] = set()
    chosen: list[str] = []
    must: list[int] = []
    for dev_id in must_include:
        m = _member(index, dev_id, members, lookup)
        if m < 0:
            if dev_id in seen_unknown:
                continue
            seen_unknown.add(dev_id)
        elif m in taken:
            continue
        else:
            taken.add(m)
            must.append(m)
        chosen.append(dev_id)
    need = size - len(chosen)
    if need <= 0:
        return tuple(chosen)

    free: list[tuple[int, int]] = []  # (position in available, member), first occurrence only
    unknown: list[str] = []
    for pos, dev_id in enumerate(available):
        m = _member(index, dev_id, members, lookup)
        if m < 0:
            if dev_id not in seen_unknown:
                seen_unknown.add(dev_id)
                unknown.append(dev_id)
        elif m not in taken:
            taken.add(m)
            free.append((pos, m))

    if policy == POLICY_NONE:
        positions = [pos for pos, _m in free[:need]]
    else:
        keys = _keys(free, must, triples, need, policy)
        positions = [key & MAX_MEMBERS for key in heapq.nsmallest(need, keys)]
    chosen.extend(available[pos] for pos in positions)
    # IDs without topology (never from a sane kubelet) are still available: they rank last.
    short = size - len(chosen)
    if short > 0:
        chosen.extend(unknown[:short])
    return tuple(chosen)


def _keys(
    free: list[tuple[int, int]], must: list[int], triples: list[tuple[int, int, int]], need: int, policy: int
) -> list[int]:
    """Return one 64-bit sort key per free device; the low 20 bits are its position."""
    numa_counts: dict[int, int] = {}
    for m in must if must else [m for _pos, m in free]:
        numa = triples[m][0]
        numa_counts[numa] = numa_counts.get(numa, 0) + 1
    target = _target_numa(numa_counts)

    must_pfs: dict[int, int] = {}
    must_roots: set[int] = set()
    for m in must:
        _numa, root, pf = triples[m]
        must_pfs[pf] = must_pfs.get(pf, 0) + 1
        must_roots.add(root)

    pf_count: dict[int, int] = {}
    pf_numa: dict[int, int] = {}
    pf_root: dict[int, int] = {}
    for _pos, m in free:
        numa, root, pf = triples[m]
        if pf not in pf_count:
            pf_count[pf] = 0
            pf_numa[pf] = numa
            pf_root[pf] = root
        pf_count[pf] += 1

    pf_keys = []
    for pf, count in pf_count.items():
        other = int(pf_numa[pf] != target)
        root = pf_root[pf]
        if policy == POLICY_PACK:
            fits = count >= need
            key = (
                other << 63
                | int(pf not in must_pfs) << 62
                | int(root not in must_roots) << 61
                | int(not fits) << 60
                | (count if fits else MAX_MEMBERS - count) << (2 * _F20)
                | root << _F20
                | pf
            )
        else:
            key = other << 63 | (MAX_MEMBERS - count) << (2 * _F20) | root << _F20 | pf
        pf_keys.append(key)
    pf_keys.sort()
    pf_rank = {key & MAX_MEMBERS: rank for rank, key in enumerate(pf_keys)}

    keys = []
    if policy == POLICY_PACK:
        for pos, m in free:
            keys.append(pf_rank[triples[m][2]] << _F20 | pos)
    else:
        rounds = dict(must_pfs)
        for pos, m in free:
            numa, _root, pf = triples[m]
            r = rounds.get(pf, 0)
            rounds[pf] = r + 1
            other = int(numa != target)
            keys.append(other << 56 | min(r, _MAX_ROUND) << (2 * _F20) | pf_rank[pf] << _F20 | pos)
    return keys
