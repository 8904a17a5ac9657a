"""Fault: structure-aware config fuzzing (issue 12, section 6).

Hypothesis builds valid configs (the SR-IOV plugin's keys and densedev's), checks that they load, then
mutates them the ways a hostile or careless file does: wrong types anywhere, nesting thousands of levels
deep, huge VF ranges, control characters in keys and values, megabyte strings, truncation, broken
UTF-8, repeated keys.  Whatever comes out, the loader, ``densedev check-config`` and a running daemon's
reload give a Config or clear one-line problems: never a traceback, never another exception, and the
memory a file costs stays proportional to its size.
"""

from __future__ import annotations

import json
import tempfile
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers.metrics import sample
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from densedev import cli
from densedev.daemon import Daemon, DaemonSettings
from densedev.model import Config
from densedev.pools import config as config_mod
from densedev.pools.config import MAX_CONFIG_BYTES, MAX_PROBLEMS, ConfigError
from densedev.printable import has_unprintable
from densedev.testing import simnode

pytestmark = pytest.mark.faults

FUZZ = settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# --- valid configs ----------------------------------------------------------------------------------

names = st.from_regex(r"[a-z][a-z0-9_]{0,14}[a-z0-9]", fullmatch=True)
hex16 = st.sampled_from(["15b3", "8086", "0x101e", "1017", "154c"])
ifnames = st.sampled_from(["ens1f0", "ens1f1", "enp59s0f0np0", "eth0"])
vf_ranges = st.builds(
    lambda a, b: f"#{min(a, b)}-{max(a, b)}" if a != b else f"#{a}", st.integers(0, 255), st.integers(0, 255)
)
common_selector = st.fixed_dictionaries(
    {},
    optional={
        "vendors": st.lists(hex16, min_size=1, max_size=3),
        "devices": st.lists(hex16, min_size=1, max_size=3),
        "drivers": st.lists(st.sampled_from(["mlx5_core", "iavf", "vfio-pci"]), min_size=1, max_size=2),
        "pciAddresses": st.lists(st.sampled_from(["0000:3b:02.1", "3b:02.2", "0000:86:00.0"]), min_size=1),
        "acpiIndexes": st.lists(st.sampled_from(["196", "7"]), min_size=1),
        "isRdma": st.booleans(),
    },
)
net_selector = st.tuples(
    common_selector,
    st.fixed_dictionaries(
        {},
        optional={
            "pfNames": st.lists(
                st.tuples(ifnames, vf_ranges | st.just("")).map("".join), min_size=1, max_size=4
            ),
            "rootDevices": st.lists(
                st.tuples(st.just("0000:3b:00.0"), vf_ranges | st.just("")).map("".join),
                min_size=1,
                max_size=2,
            ),
            "linkTypes": st.lists(st.sampled_from(["ether", "infiniband"]), min_size=1),
            "needVhostNet": st.booleans(),
        },
    ),
).map(lambda parts: {**parts[0], **parts[1]})
health = st.fixed_dictionaries(
    {},
    optional={
        "pfLink": st.booleans(),
        "ownLink": st.booleans(),
        "driver": st.booleans(),
        "holdDownSeconds": st.floats(0, 60),
    },
)


@st.composite
def valid_pool(draw: st.DrawFn, name: str) -> dict[str, Any]:
    pool: dict[str, Any] = {"resourceName": name}
    if draw(st.booleans()):
        pool["resourcePrefix"] = draw(st.sampled_from(["example.com", "nvidia.com"]))
    device_type = draw(st.sampled_from(["netDevice", "accelerator", None]))
    if device_type is not None:
        pool["deviceType"] = device_type
    selector = draw(net_selector if device_type != "accelerator" else common_selector)
    pool["selectors"] = draw(st.sampled_from([selector, [selector]]))
    for key, value in (
        ("healthPolicy", health),
        ("preferredAllocation", st.sampled_from(["pack", "spread", "none"])),
        ("excludeTopology", st.booleans()),
        ("preStart", st.booleans()),
        ("additionalInfo", st.just({"*": {"token": "x"}, "0000:3b:02.1": {"k": "v"}})),
    ):
        if draw(st.booleans()):
            pool[key] = draw(value)
    return pool


@st.composite
def valid_config(draw: st.DrawFn) -> dict[str, Any]:
    pool_names = draw(st.lists(names, min_size=1, max_size=4, unique=True))
    doc: dict[str, Any] = {"resourceList": [draw(valid_pool(n)) for n in pool_names]}
    if draw(st.booleans()):
        doc["coalesceMs"] = draw(st.floats(0, 100))
    if draw(st.booleans()):
        doc["reconcileSeconds"] = draw(st.floats(1, 3600))
    return doc


# --- mutations ----------------------------------------------------------------------------------------

MARK = "\ue000deep\ue000"  # a private-use placeholder the text mutation replaces by deep nesting
wrong_types = st.sampled_from([None, True, 0, -1, 1.5, "", "x", [], {}, [[]], {"a": {}}, 10**30, "0000:zz"])
# (a range, how many times a selector repeats it): the observed 641 MB was the second, 100 times
HUGE_RANGES = [
    ("ens1f0#0-65535", 2000),
    ("ens1f0#0-65535", 100),
    ("ens1f0#0-70000", 1),
    ("ens1f0#" + ",".join(map(str, range(0, 65536, 7))), 1),
    ("ens1f0#" + ",".join(f"{i}-{i + 3}" for i in range(0, 65000, 5)), 1),
]
controls = st.sampled_from(["\n", "\r", "\t", "\x00", "\x1b[2J", "\x7f", "\x85", "\u2028", "\ud800"])


def paths(node: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a JSON tree: the key or index path of each value."""
    out = [at]
    if isinstance(node, dict):
        for k, v in node.items():
            out += paths(v, (*at, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += paths(v, (*at, i))
    return out


def replace(node: Any, path: tuple[Any, ...], fn: Callable[[Any], Any]) -> Any:
    if not path:
        return fn(node)
    head, rest = path[0], path[1:]
    if isinstance(node, dict):
        return {k: replace(v, rest, fn) if k == head else v for k, v in node.items()}
    return [replace(v, rest, fn) if i == head else v for i, v in enumerate(node)]


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """A valid config mutated one to three times, as the bytes of a file."""
    doc: Any = draw(valid_config())
    deep = 0
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.sampled_from(paths(doc)))
        kind = draw(st.sampled_from(["type", "deep", "ranges", "control", "huge", "key"]))
        if kind == "type":
            value = draw(wrong_types)
            doc = replace(doc, where, lambda _old, v=value: v)
        elif kind == "deep":
            deep = draw(st.sampled_from([10, 63, 64, 65, 1000, 50_000]))
            doc = replace(doc, where, lambda _old: MARK)
        elif kind == "ranges":
            text, count = draw(st.sampled_from(HUGE_RANGES))
            doc = replace(doc, where, lambda _old, c=count, t=text: {"pfNames": [t] * c} if c > 1 else t)
        elif kind == "control":
            ch = draw(controls)
            doc = replace(doc, where, lambda old, c=ch: old + c if isinstance(old, str) else {f"key{c}": old})
        elif kind == "huge":
            doc = replace(doc, where, lambda _old: "x" * 100_000)
        else:
            doc = replace(doc, where, lambda old: {"resourceName": old, "ResourceName": old})
    ascii_only = draw(st.booleans())
    text = json.dumps(doc, ensure_ascii=ascii_only)
    if deep:
        opener, closer = ("[", "]") if draw(st.booleans()) else ('{"a":', "}")
        text = text.replace(json.dumps(MARK, ensure_ascii=ascii_only), opener * deep + "1" + closer * deep)
    data = text.encode("utf-8", "surrogatepass")
    tail = draw(st.sampled_from(["", "truncate", "bad-utf8", "bom"]))
    if tail == "truncate":
        data = data[: draw(st.integers(0, len(data)))]
    elif tail == "bad-utf8":
        cut = draw(st.integers(0, len(data)))
        data = data[:cut] + b"\xff\xc3" + data[cut:]
    elif tail == "bom":
        data = b"\xef\xbb\xbf" + data
    return data


def check_outcome(data: bytes, path: Path) -> Config | None:
    """Load the file under tracemalloc; return the Config or None, asserting clean problems and memory."""
    path.write_bytes(data)
    tracemalloc.start()
    try:
        try:
            cfg: Config | None = config_mod.load(path)
        except ConfigError as exc:
            cfg = None
            problems = exc.problems
            assert problems and len(problems) <= MAX_PROBLEMS + 1
            for p in problems:
                assert isinstance(p, str) and p and not has_unprintable(p) and len(p) < 1000, repr(p)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Python's objects for JSON cost tens of bytes per byte of text at worst (a dict per "{}"); a VF
    # range expanded to a set of ints cost 270,000 bytes per byte (641 MB for a 1.5 KB list).
    limit = 64 * len(data) + (1 << 20)
    assert peak < limit, f"{peak} bytes to load a {len(data)}-byte file"
    return cfg


@FUZZ
@given(doc=valid_config())
def test_generated_configs_are_valid(doc: dict[str, Any]) -> None:
    # The fuzzer's starting points must load, or its mutations test nothing.
    cfg = config_mod.parse(json.dumps(doc))
    assert [p.resource_name for p in cfg.pools] == [p["resourceName"] for p in doc["resourceList"]]


@FUZZ
@given(data=mutated())
def test_mutated_configs_give_a_config_or_clean_problems_in_bounded_memory(
    data: bytes, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assume(len(data) <= MAX_CONFIG_BYTES)  # the size limit has its own tests; these must reach the parser
    path = tmp_path / "config.json"
    cfg = check_outcome(data, path)
    code = cli.main(["check-config", str(path)])
    out, err = capsys.readouterr()
    assert code == (0 if cfg is not None else 1)
    assert "Traceback" not in err and "Traceback" not in out
    lines = out.splitlines()
    assert lines and all(line.startswith(f"{path}: ") for line in lines)


@settings(max_examples=25, deadline=None)
@given(data=mutated())
async def test_a_running_daemon_reloads_any_file_without_dying(data: bytes) -> None:
    with tempfile.TemporaryDirectory(prefix="dd-", dir="/tmp") as tmp:
        root = Path(tmp)
        layout = simnode.build_node(root / "sys", pfs=1, vfs_per_pf=4)
        path = root / "config.json"
        good = {"resourceList": [{"resourceName": "vf", "selectors": {"pfNames": [layout.pfs[0].netdev]}}]}
        path.write_text(json.dumps(good))
        settings_ = DaemonSettings(
            sysfs_root=root / "sys",
            kubelet_dir=root / "kubelet",
            cdi_dir=None,
            devinfo_dir=None,
            config_path=path,
            netlink=False,
        )
        try:
            expected: Config | None = config_mod.parse(data.decode("utf-8-sig"))
        except (ConfigError, UnicodeDecodeError):
            expected = None
        if len(data) > MAX_CONFIG_BYTES:
            expected = None  # refused for its size before it is parsed

        daemon = Daemon(settings_, config_mod.load(path))
        await daemon.start()
        try:
            before = (daemon.config, set(daemon.pools))
            path.write_bytes(data)
            ok = await daemon.reload()
            if expected is None:
                assert not ok and (daemon.config, set(daemon.pools)) == before
                failures = {"result": "failure"}
                assert sample(daemon, "densedev_config_reloads_total", **failures) == 1
            else:
                assert ok and daemon.config == expected
                assert set(daemon.pools) == {p.full_name for p in expected.pools}
        finally:
            await daemon.stop()
