"""Benchmark the ListAndWatch wire path at 16,384 devices: cached encoding vs protobuf objects.

For one pool of 16,384 VFs it times, per message:
  * ``protobuf``: building ``ListAndWatchResponse`` from ``Device`` objects and serializing it (what a
    plugin that keeps no cache does on every health flip);
  * ``cached``: re-encoding the changed devices (1, or a PF's 256) and joining the cached parts into one
    message, for the Cython extension and the Python twin, measured in the same run;
  * ``cold``: encoding every device from scratch (a pool's first message);
  * ``ListEncoder``: the class the daemon uses, over whichever implementation ``accel`` picked.
The ratios printed are protobuf/cached and twin/extension.

    PYTHONPATH=src python bench/bench_wire.py [--quick] [--json] [--devices N]
"""

from __future__ import annotations

import contextlib
import importlib
import json
import sys
from pathlib import Path
from types import ModuleType

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import _impl

from densedev import _fast_py as twin
from densedev import accel
from densedev._proto import api_pb2
from densedev.kubelet.wire import ListEncoder


def pci_ids(count: int) -> list[str]:
    """Return VF addresses as 64 PFs of 256 VFs lay them out: 0000:bb:dd.f."""
    return [f"0000:{0x18 + (i >> 8):02x}:{(i >> 3) & 0x1F:02x}.{i & 7}" for i in range(count)]


def bench_impl(mod: ModuleType, ids: list[bytes], numa: list[int], repeat: int) -> dict[str, float]:
    """Time cold, 1-change and 256-change messages with one implementation's functions."""
    count = len(ids)
    parts = [mod.encode_device(i, True, n) for i, n in zip(ids, numa, strict=True)]
    state = {"flip": False}

    def one_change() -> bytes:
        state["flip"] = not state["flip"]
        parts[77] = mod.encode_device(ids[77], state["flip"], numa[77])
        return mod.encode_list(parts)

    def pf_change() -> bytes:
        state["flip"] = not state["flip"]
        for k in range(4096, 4096 + 256):
            parts[k] = mod.encode_device(ids[k], state["flip"], numa[k])
        return mod.encode_list(parts)

    def cold() -> bytes:
        return mod.encode_list([mod.encode_device(i, True, n) for i, n in zip(ids, numa, strict=True)])

    return {
        "cold_s": _impl.timed(cold, max(3, repeat // 4)),
        "one_change_s": _impl.timed(one_change, repeat),
        "pf_change_s": _impl.timed(pf_change, repeat),
        "join_only_s": _impl.timed(lambda: mod.encode_list(parts), repeat),
        "devices": count,
    }


def main() -> int:
    """Run the benchmark and print figures (or JSON)."""
    parser = _impl.arguments(__file__, __doc__, "fewer repetitions (a smoke run)")
    parser.add_argument("--devices", type=int, default=16384)
    args = parser.parse_args()
    repeat = 5 if args.quick else 40

    str_ids = pci_ids(args.devices)
    ids = [i.encode() for i in str_ids]
    numa = [(i >> 13) & 1 for i in range(args.devices)]
    health = ["Healthy"] * args.devices

    def protobuf() -> bytes:
        health[77] = "Unhealthy" if health[77] == "Healthy" else "Healthy"
        message = api_pb2.ListAndWatchResponse()
        for device_id, h, n in zip(str_ids, health, numa, strict=True):
            device = message.devices.add(ID=device_id, health=h)
            device.topology.nodes.add(ID=n)
        return message.SerializeToString()

    results: dict[str, object] = {"devices": args.devices, "implementation": accel.IMPLEMENTATION}
    results["protobuf_s"] = _impl.timed(protobuf, max(3, repeat // 4))
    impls: dict[str, ModuleType] = {"python": twin}
    with contextlib.suppress(ImportError):  # a missing build: report the twin alone
        impls["cython"] = importlib.import_module("densedev._fast")
    for name, mod in impls.items():
        results[name] = bench_impl(mod, ids, numa, repeat)

    encoder = ListEncoder(str_ids, numa)
    healthy = [True] * args.devices
    encoder.encode(healthy)

    def encoder_one() -> bytes:
        healthy[77] = not healthy[77]
        return encoder.encode(healthy, changed=[77])

    results["list_encoder_one_change_s"] = _impl.timed(encoder_one, repeat)
    pf = range(4096, 4352)  # one PF's 256 VFs flip, named as the health tracker names them

    def encoder_pf() -> bytes:
        down = healthy[pf.start]
        for index in pf:
            healthy[index] = not down
        return encoder.encode(healthy, changed=pf)

    results["list_encoder_pf_s"] = _impl.timed(encoder_pf, repeat)
    # Proof the fast path makes the same message as protobuf.
    check = ListEncoder(str_ids, numa).encode([h == "Healthy" for h in health])
    message = api_pb2.ListAndWatchResponse()
    for device_id, h, n in zip(str_ids, health, numa, strict=True):
        message.devices.add(ID=device_id, health=h).topology.nodes.add(ID=n)
    assert check == message.SerializeToString()
    results["message_bytes"] = len(check)

    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    ms = 1e3
    pb = float(results["protobuf_s"])  # type: ignore[arg-type]
    print(f"wire bench: {args.devices} devices, message {len(check)} bytes, accel={accel.IMPLEMENTATION}")
    print(f"  protobuf objects, build + serialize     {pb * ms:9.3f} ms")
    for name, r in results.items():
        if not isinstance(r, dict):
            continue
        print(f"  [{name}] cold (encode all + join)       {r['cold_s'] * ms:9.3f} ms")
        print(
            f"  [{name}] 1 change (re-encode + join)    {r['one_change_s'] * ms:9.3f} ms"
            f"   protobuf/cached = {pb / r['one_change_s']:.1f}x"
        )
        print(f"  [{name}] PF flip, 256 changes           {r['pf_change_s'] * ms:9.3f} ms")
        print(f"  [{name}] join only                      {r['join_only_s'] * ms:9.3f} ms")
    if "cython" in results and "python" in results:
        py, cy = results["python"], results["cython"]
        assert isinstance(py, dict) and isinstance(cy, dict)
        for key in ("cold_s", "one_change_s", "pf_change_s"):
            print(f"  python/cython {key[:-2]:<12} = {py[key] / cy[key]:.1f}x")
    one = float(results["list_encoder_one_change_s"])  # type: ignore[arg-type]
    pf_s = float(results["list_encoder_pf_s"])  # type: ignore[arg-type]
    print(f"  ListEncoder 1 change ({accel.IMPLEMENTATION})          {one * ms:9.3f} ms")
    print(f"  ListEncoder PF flip, 256 changes ({accel.IMPLEMENTATION}) {pf_s * ms:9.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
