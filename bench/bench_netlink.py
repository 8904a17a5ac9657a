"""Benchmark decoding an rtnetlink link dump of N links: extension vs twin vs pyroute2, same run.

The dump is built from a real ``RTM_NEWLINK`` message captured from a veth (``tests/data/netlink/``,
with every attribute the kernel sends: stats, af_spec, linkinfo...), replicated with distinct ifindex
and name, and packed into ~32 KiB datagrams ending in ``NLMSG_DONE`` as a kernel dump arrives.
pyroute2 decodes the same bytes (``MarshalRtnl``) and its fields are extracted into the same tuples; the
script checks all three agree before timing.

    PYTHONPATH=src python bench/bench_netlink.py [--quick] [--json] [--links N]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import statistics
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

GOLDEN = ROOT / "tests" / "data" / "netlink" / "dump_veth.hex"
DATAGRAM = 32 * 1024  # netlink_dump() fills skbs of up to 32 KiB for a large enough receive buffer


def timed(fn: Callable[[], object], rounds: int) -> float:
    """Return the median seconds of ``rounds`` calls (the machine is shared and noisy)."""
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def template() -> tuple[bytes, int]:
    """Return the captured RTM_NEWLINK of the 6-character veth ``ens0f0`` and its name's offset."""
    data = bytes.fromhex(GOLDEN.read_text().split()[0])
    pos = 0
    while pos + 16 <= len(data):
        length, mtype = struct.unpack_from("=IH", data, pos)
        msg = data[pos : pos + length]
        if mtype == 16:
            at = 32
            while at + 4 <= length:
                rta_len, rta_type = struct.unpack_from("=HH", msg, at)
                if rta_type == 3 and msg[at + 4 : rta_len + at] == b"ens0f0\0":
                    return msg, at + 4
                at += (rta_len + 3) & ~3
        pos += (length + 3) & ~3
    raise SystemExit(f"{GOLDEN}: no RTM_NEWLINK for ens0f0 to use as a template")


def build_dump(count: int) -> list[bytes]:
    """Return ``count`` link messages packed into kernel-sized datagrams, the last ending in NLMSG_DONE."""
    msg, name_at = template()
    datagrams: list[bytes] = []
    current = bytearray()
    for i in range(count):
        m = bytearray(msg)
        struct.pack_into("=i", m, 20, 1000 + i)  # ifinfomsg.ifi_index
        m[name_at : name_at + 6] = f"e{i:05d}".encode()  # same length as "ens0f0": offsets stay valid
        if len(current) + len(m) > DATAGRAM:
            datagrams.append(bytes(current))
            current = bytearray()
        current += m
    current += struct.pack("=IHHIIi", 20, 3, 2, 1, 0, 0)  # NLMSG_DONE, NLM_F_MULTI
    datagrams.append(bytes(current))
    return datagrams


def pyroute2_decode(datagrams: list[bytes]) -> list[tuple[int, int, str, int, int, int, int]]:
    """Decode with pyroute2 and extract parse_links' fields."""
    from pyroute2.netlink.rtnl.ifinfmsg import state_by_name
    from pyroute2.netlink.rtnl.marshal import MarshalRtnl

    marshal = MarshalRtnl()
    out = []
    for data in datagrams:
        for msg in marshal.parse(data):
            mtype = msg["header"]["type"]
            if mtype not in (16, 17):
                continue
            oper = msg.get_attr("IFLA_OPERSTATE")
            carrier = msg.get_attr("IFLA_CARRIER")
            link = msg.get_attr("IFLA_LINK")
            out.append(
                (
                    mtype,
                    msg["index"],
                    msg.get_attr("IFLA_IFNAME") or "",
                    msg["flags"],
                    -1 if oper is None else state_by_name[oper],
                    -1 if carrier is None else carrier,
                    -1 if link is None else link,
                )
            )
    return out


def decode_with(mod: ModuleType, datagrams: list[bytes]) -> list[tuple[int, int, str, int, int, int, int]]:
    """Decode every datagram with one implementation."""
    out: list[tuple[int, int, str, int, int, int, int]] = []
    for data in datagrams:
        out.extend(mod.parse_links(data))
    return out


def main() -> int:
    """Run the benchmark and print figures (or JSON)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer links and repetitions (a smoke run)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--links", type=int, default=None, help="links in the dump (default 16384; quick 1024)"
    )
    args = parser.parse_args()
    count = args.links or (1024 if args.quick else 16384)
    rounds = 3 if args.quick else 9

    from densedev import _fast_py as twin

    datagrams = build_dump(count)
    impls: dict[str, ModuleType] = {"python": twin}
    with contextlib.suppress(ImportError):  # a missing build: report the twin alone
        impls["cython"] = importlib.import_module("densedev._fast")
    reference = pyroute2_decode(datagrams)
    assert len(reference) == count
    for name, mod in impls.items():
        assert decode_with(mod, datagrams) == reference, f"{name} disagrees with pyroute2"

    results: dict[str, object] = {
        "links": count,
        "datagrams": len(datagrams),
        "bytes": sum(map(len, datagrams)),
        "message_bytes": len(template()[0]),
    }
    for name, mod in impls.items():
        results[f"{name}_s"] = timed(lambda mod=mod: decode_with(mod, datagrams), rounds)  # type: ignore[misc]
    results["pyroute2_s"] = timed(lambda: pyroute2_decode(datagrams), max(1, rounds // 3))

    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(
        f"netlink bench: dump of {count} links ({results['message_bytes']} bytes each, "
        f"{results['datagrams']} datagrams, {int(results['bytes']) / 1e6:.1f} MB)"  # type: ignore[call-overload]
    )
    for name in (*impls, "pyroute2"):
        secs = float(results[f"{name}_s"])  # type: ignore[arg-type]
        print(f"  {name:<9} {secs * 1e3:9.2f} ms   {secs / count * 1e6:7.2f} µs/link")
    py, pr = float(results["python_s"]), float(results["pyroute2_s"])  # type: ignore[arg-type]
    if "cython_s" in results:
        cy = float(results["cython_s"])  # type: ignore[arg-type]
        print(
            f"  python/cython = {py / cy:.1f}x   pyroute2/cython = {pr / cy:.0f}x   "
            f"pyroute2/python = {pr / py:.0f}x"
        )
    else:
        print(f"  pyroute2/python = {pr / py:.0f}x (extension not built)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
