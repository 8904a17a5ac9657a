"""Bad input (issue 12, section 3): never a dead task, never a traceback, never unbounded growth.

Each test here reproduces one observed finding: a config nested 100,000 levels deep, a FIFO as the
config file, VF ranges costing memory per index, names ending in a newline, a 2 MB Allocate status,
preferred answers outside the request's contract, ``scan | head`` and a reload dropping the coalescer.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import os
import subprocess
import sys
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from helpers.devices import dev, pool_of
from helpers.metrics import sample
from helpers.node import GUARD_S, NO_FILES, Node, res, three_pools

from densedev import cli
from densedev._proto import api_pb2
from densedev.alloc import cdi
from densedev.alloc.respond import AllocationSettings, PoolAllocator
from densedev.daemon import Daemon
from densedev.kubelet.feed import PoolFeed
from densedev.kubelet.server import PluginServer
from densedev.kubelet.wire import ListEncoder
from densedev.model import Config, PoolConfig, RequestError
from densedev.pools.config import ConfigError, load, parse, validate_resource_name
from densedev.poolset import PoolChanges
from densedev.testing import simnode

RESOURCE = "example.com/vf"
# Every control character a string can carry: C0, DEL and C1.
CONTROL = [chr(c) for c in (*range(0x20), *range(0x7F, 0xA0))]


def has_control(text: str) -> bool:
    return any(c in text for c in CONTROL)


def problems_of(doc: Any) -> tuple[str, ...]:
    text = doc if isinstance(doc, str) else json.dumps(doc)
    with pytest.raises(ConfigError) as info:
        parse(text)
    return info.value.problems


def cli_child(args: list[str], env: dict[str, str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "densedev.cli", *args], capture_output=True, text=True, env=env, **kw
    )


# --- config: deep nesting, FIFOs, size, VF ranges ----------------------------------------------------

DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize(
    "text",
    [
        DEEP,
        '{"resourceList": [{"resourceName": "a", "additionalInfo": '
        + '{"a":' * 50_000
        + "1"
        + "}" * 50_000
        + "}]}",
        '{"resourceList": ' + "[" * 2000,  # deep and truncated
    ],
    ids=["array", "inside-a-pool", "truncated"],
)
def test_a_deeply_nested_config_is_one_clear_problem(tmp_path: Path, text: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load(path)
    (problem,) = info.value.problems
    assert "nested deeper than" in problem and "line 1" in problem
    assert "\n" not in problem


def test_check_config_and_run_print_one_line_for_a_deep_config(
    tmp_path: Path, child_env: dict[str, str]
) -> None:
    path = tmp_path / "config.json"
    path.write_text(DEEP)
    proc = cli_child(["check-config", str(path)], child_env, timeout=60)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr and proc.stderr == ""
    (line,) = proc.stdout.splitlines()
    assert line.startswith(f"{path}: ") and "nested deeper than" in line
    proc = cli_child(["run", "--config", str(path), "--kubelet-dir", str(tmp_path)], child_env, timeout=60)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if "level=error" in x]
    assert "invalid config" in line and "nested deeper than" in line


def test_a_fifo_as_the_config_is_refused_not_waited_on(tmp_path: Path, child_env: dict[str, str]) -> None:
    # Opening a FIFO for reading blocks until a writer comes (fifo(7)); nobody ever writes to this one.
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    proc = cli_child(["check-config", str(fifo)], child_env, timeout=60)
    assert proc.returncode == 1
    (line,) = proc.stdout.splitlines()
    assert "not a regular file" in line and "FIFO" in line
    assert "Traceback" not in proc.stderr
    proc = cli_child(["run", "--config", str(fifo), "--kubelet-dir", str(tmp_path)], child_env, timeout=60)
    assert proc.returncode == 2
    assert "not a regular file" in proc.stderr and "Traceback" not in proc.stderr


def test_directories_and_oversized_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"not a regular file \(a directory\)"):
        load(tmp_path)
    big = tmp_path / "big.json"
    big.write_bytes(b'{"resourceList": []}' + b" " * (2 << 20))
    with pytest.raises(ConfigError) as info:
        load(big)
    (problem,) = info.value.problems
    assert "larger than" in problem and "1 MiB" in problem
    # A symlink to a good file is fine: a ConfigMap mount is a chain of symlinks (..data).
    good = tmp_path / "good.json"
    good.write_text('{"resourceList": [{"resourceName": "a"}]}')
    (tmp_path / "link.json").symlink_to(good)
    assert [p.resource_name for p in load(tmp_path / "link.json").pools] == ["a"]


def test_vf_ranges_cost_memory_per_range_not_per_index() -> None:
    # Observed: "ens1#0-65535" 100 times took 641 MB; each range must cost bytes, not one int per VF.
    doc = {
        "resourceList": [
            {
                "resourceName": "p",
                "selectors": {"pfNames": ["ens1#0-65535"] * 20 + [f"e{i}#0-65535" for i in range(20)]},
            }
        ]
    }
    text = json.dumps(doc)
    tracemalloc.start()
    try:
        cfg = parse(text)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * len(text) + (256 << 10), f"{peak} bytes to parse {len(text)} bytes"
    ranges = cfg.pools[0].selectors[0].pf_names
    assert len(ranges) == 40 and all(0 in r.indexes and 65535 in r.indexes for r in ranges if r.indexes)


# --- names and control characters --------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "example.com/vf\n",
        "example.com\n/vf",
        "example.com/v\x00f",
        "example.com/vf\t",
        "example.com/\nvf",
        "\nexample.com/vf",
    ],
)
def test_a_name_with_a_newline_or_control_character_is_refused(name: str) -> None:
    why = validate_resource_name(name)
    assert why is not None
    assert not has_control(why)


@pytest.mark.parametrize(
    "pool",
    [
        {"resourceName": "vf\n"},
        {"resourceName": "vf", "resourcePrefix": "example.com\n"},
        {"resourceName": "vf", "selectors": {"drivers": ["mlx5_core\n"]}},
        {"resourceName": "vf", "selectors": {"vendors": ["15b3\n"]}},
        {"resourceName": "vf", "selectors": {"devices": ["101e\r"]}},
        {"resourceName": "vf", "selectors": {"pciAddresses": ["0000:3b:00.2\n"]}},
        {"resourceName": "vf", "selectors": {"rootDevices": ["0000:3b:00.0\n#1"]}},
        {"resourceName": "vf", "selectors": {"pKeys": ["0x7fff\n"]}},
        {"resourceName": "vf", "deviceType": "auxNetDevice", "selectors": {"auxTypes": ["sf\x1b[2J"]}},
        {"resourceName": "vf", "selectors": {"ddpProfiles": ["gtp\x00"]}},
        {"resourceName": "vf", "additionalInfo": {"*": {"key\n": "v"}}},
        {"resourceName": "vf", "additionalInfo": {"*": {"k": "value\u0085"}}},
        {"resourceName": "vf", "additionalInfo": {"\x7f": {"k": "v"}}},
        {"resourceName": "vf", "resource\nName2": 1},
        {"resourceName": "vf", "deviceType": "netDevice\n"},
        {"resourceName": "vf", "preferredAllocation": "pack\n"},
    ],
)
def test_control_characters_are_refused_everywhere_and_never_printed(pool: dict[str, Any]) -> None:
    problems = problems_of({"resourceList": [pool]})
    assert problems
    assert not any(has_control(p) for p in problems), problems


def test_cdi_names_use_full_matches() -> None:
    with pytest.raises(cdi.CdiError):
        cdi.make_kind("example.com\n", "vf")
    with pytest.raises(cdi.CdiError):
        cdi.make_kind("example.com", "vf\n")
    with pytest.raises(cdi.CdiError):
        cdi.qualified_name("example.com/vf", "0000:3b:00.2\n")


def test_problems_are_bounded_in_length_and_number() -> None:
    huge = "x" * 100_000
    problems = problems_of({"resourceList": [{"resourceName": "vf", "selectors": {"pciAddresses": [huge]}}]})
    assert all(len(p) < 1000 for p in problems)
    many = {"resourceList": [{"resourceName": "vf", "selectors": {"pciAddresses": ["zz"] * 5000}}]}
    problems = problems_of(many)
    # One clear line per problem, and not 5,000 of them: the last says how many more there were.
    assert len(problems) <= 101
    assert problems[-1].endswith("more problems") and "4900" in problems[-1]


def test_warnings_are_bounded_in_length_and_number(tmp_path: Path) -> None:
    # Vendor IDs that match nothing load with a warning each (as the SR-IOV plugin loads them), so a
    # file of 5,000 of them must not print 5,000 lines, nor one of 100,000 characters.
    path = tmp_path / "c.json"
    vendors = [f"zz{i}" for i in range(5000)] + ["x" * 100_000]
    path.write_text(json.dumps({"resourceList": [{"resourceName": "vf", "selectors": {"vendors": vendors}}]}))
    warnings = load(path).warnings
    assert len(warnings) <= 101 and all(len(w) < 1000 for w in warnings)
    assert warnings[-1].endswith("more warnings") and "4901" in warnings[-1]


# --- Allocate and GetPreferredAllocation -------------------------------------------------------------


def vf_pool(count: int = 8) -> Any:
    devices = [dev(f"0000:3b:{2 + i // 8:02x}.{i % 8}", pf="0000:3b:00.0", vf_index=i) for i in range(count)]
    return pool_of(PoolConfig("vf", "example.com", preferred="pack"), devices)


def allocator(tmp_path: Path) -> PoolAllocator:
    s = AllocationSettings(cdi_dir=None, devinfo_dir=None, dev_root=tmp_path)
    return PoolAllocator(vf_pool(), s, lambda _id: True)


async def serve(tmp_path: Path, sock_dir: Path) -> tuple[PluginServer, grpc.aio.Channel]:
    alloc = allocator(tmp_path)
    feed = PoolFeed()
    ids = [m.id for m in alloc.pool.members]
    feed.publish(ListEncoder(ids, [0] * len(ids), name=RESOURCE).encode([True] * len(ids)))
    server = PluginServer(RESOURCE, sock_dir / "vf.sock", feed, alloc)
    await server.start()
    channel = grpc.aio.insecure_channel(f"unix:{sock_dir / 'vf.sock'}")
    return server, channel


async def test_allocate_with_100k_unknown_ids_is_invalid_argument_with_a_bounded_message(
    tmp_path: Path, sock_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ids = [f"0000:ff:{i >> 8 & 0x1F:02x}.{i & 7}-{i}" for i in range(100_000)] + ["evil\n\x1b[31mid"]

    with caplog.at_level(logging.INFO):
        server, channel = await serve(tmp_path, sock_dir)
        try:
            call = channel.unary_unary(
                "/v1beta1.DevicePlugin/Allocate",
                request_serializer=api_pb2.AllocateRequest.SerializeToString,
                response_deserializer=api_pb2.AllocateResponse.FromString,
            )
            request = api_pb2.AllocateRequest(
                container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=ids)]
            )
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call(request)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            details = info.value.details() or ""
            assert len(details) < 1024
            assert details.count(RESOURCE) == 1, details
            assert "and 99991 more" in details
            assert not has_control(details)
        finally:
            await channel.close()
            await server.stop()
    assert caplog.records
    assert all(len(r.getMessage()) < 2048 for r in caplog.records)
    assert not any(has_control(r.getMessage()) for r in caplog.records)


def test_allocate_messages_name_the_pool_once_and_escape_ids(tmp_path: Path) -> None:
    alloc = allocator(tmp_path)
    first = alloc.pool.members[0].id
    for ids in ([first, first], [first, "x\n"], [f"id{i}" for i in range(50)]):
        with pytest.raises(RequestError) as info:
            alloc.allocate(ids)
        assert info.value.kind == RequestError.INVALID
        assert RESOURCE not in info.value.message  # the server names the pool, once
        assert not has_control(info.value.message) and len(info.value.message) < 1024


@pytest.mark.parametrize(
    ("available", "must", "size", "why"),
    [
        (["0000:3b:02.0", "0000:3b:02.1"], ["0000:3b:02.5"], 1, "not in available"),
        (["0000:3b:02.0", "0000:3b:02.1", "0000:3b:02.2"], ["0000:3b:02.0", "0000:3b:02.1"], 1, "more than"),
        (["0000:3b:02.0"], [], -1, "< 0"),
    ],
)
def test_preferred_refuses_requests_outside_their_own_contract(
    tmp_path: Path, available: list[str], must: list[str], size: int, why: str
) -> None:
    # The kubelet asks with must_include ⊆ available and allocation_size > len(must_include)
    # (devicemanager's devicesToAllocate); anything else is not a kubelet and gets no guess.
    with pytest.raises(RequestError, match=why) as info:
        allocator(tmp_path).preferred(available, must, size)
    assert info.value.kind == RequestError.INVALID


def test_preferred_answers_within_the_contract(tmp_path: Path) -> None:
    alloc = allocator(tmp_path)
    ids = [m.id for m in alloc.pool.members]
    for size in range(0, len(ids) + 3):
        for must in ([], ids[3:4], ids[:2]):
            if len(must) > size:
                continue
            got = alloc.preferred(ids, must, size)
            assert len(got) == min(size, len(ids)) and len(set(got)) == len(got)
            assert set(got) <= set(ids) and got[: len(must)] == must


async def test_preferred_refusal_reaches_the_kubelet_as_invalid_argument(
    tmp_path: Path, sock_dir: Path
) -> None:
    server, channel = await serve(tmp_path, sock_dir)
    try:
        call = channel.unary_unary(
            "/v1beta1.DevicePlugin/GetPreferredAllocation",
            request_serializer=api_pb2.PreferredAllocationRequest.SerializeToString,
            response_deserializer=api_pb2.PreferredAllocationResponse.FromString,
        )
        req = api_pb2.ContainerPreferredAllocationRequest(
            available_deviceIDs=["0000:3b:02.0"],
            must_include_deviceIDs=["0000:3b:02.1"],
            allocation_size=1,
        )
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call(api_pb2.PreferredAllocationRequest(container_requests=[req]))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not in available" in (info.value.details() or "")
    finally:
        await channel.close()
        await server.stop()


# --- the command line ---------------------------------------------------------------------------------


def test_scan_piped_into_head_ends_without_a_traceback(tmp_path: Path, child_env: dict[str, str]) -> None:
    node = tmp_path / "node"
    simnode.simulate(node, 4, 64, "mellanox", True, 2)
    # A real pipe whose reader goes away after one line, as `densedev scan --json | head -1` does;
    # the JSON is far bigger than the pipe's 64 KiB buffer, so the writer hits EPIPE mid-way.
    proc = subprocess.Popen(
        [sys.executable, "-m", "densedev.cli", "scan", "--sysfs-root", str(node), "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=child_env,
    )
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline().strip() == b"{"
    proc.stdout.close()
    code = proc.wait(timeout=60)
    err = proc.stderr.read().decode()
    proc.stderr.close()
    assert "Traceback" not in err and "BrokenPipe" not in err, err
    assert err == ""
    assert code == 128 + 13  # as the shell reports a command ended by SIGPIPE: `set -o pipefail` sees it


def test_check_config_of_a_missing_file_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["check-config", str(tmp_path / "nope.json")]) == 1
    out = capsys.readouterr().out
    (line,) = out.splitlines()
    assert "cannot read" in line


# --- reload --------------------------------------------------------------------------------------------


@pytest.fixture
def node_options() -> dict[str, Any]:
    """A 4-PF node with pools for PFs 0-2."""
    return {"config": three_pools}


async def test_reload_survives_a_deep_config_and_applies_the_next_good_one(node: Node) -> None:
    daemon = node.daemon(**NO_FILES)
    await daemon.start()
    try:
        node.write_config(DEEP)
        daemon.request_reload()
        await wait(lambda: sample(daemon, "densedev_config_reloads_total", result="failure") == 1)
        assert len(daemon.config.pools) == 3
        doc = copy.deepcopy(node.doc)
        doc["resourceList"].pop(0)
        node.write_config(doc)
        daemon.request_reload()
        await wait(lambda: sample(daemon, "densedev_config_reloads_total", result="success") == 1)
        assert set(daemon.pools) == {res("pf1"), res("pf2")}
    finally:
        await daemon.stop()


class FailingDaemon(Daemon):
    """A daemon whose first config apply fails with an exception nobody planned for."""

    failures = 1

    async def apply_config(self, new: Config) -> PoolChanges:
        if self.failures:
            self.failures -= 1
            raise RuntimeError("a bug nobody planned for")
        return await super().apply_config(new)


async def test_reload_survives_any_exception_and_keeps_the_last_good_config(node: Node) -> None:
    base = node.daemon(**NO_FILES)
    daemon = FailingDaemon(base.settings, base.config)
    await daemon.start()
    try:
        before = daemon.config
        doc = copy.deepcopy(node.doc)
        doc["resourceList"].pop(0)
        node.write_config(doc)
        daemon.request_reload()
        await wait(lambda: sample(daemon, "densedev_config_reloads_total", result="failure") == 1)
        assert daemon.config == before and set(daemon.pools) == {res(n) for n in ("pf0", "pf1", "pf2")}
        assert 'densedev_config_reloads_total{result="failure"} 1.0' in daemon.metrics.render().decode()
        # The reload task lives on: the same file, asked again, applies.
        daemon.request_reload()
        await wait(lambda: sample(daemon, "densedev_config_reloads_total", result="success") == 1)
        assert set(daemon.pools) == {res("pf1"), res("pf2")}
    finally:
        await daemon.stop()


async def test_a_reload_carries_the_pending_flush_over_to_the_new_coalescer(node: Node) -> None:
    node.doc["coalesceMs"] = 60_000  # nothing flushes by itself while the test runs
    node.write_config(node.doc)
    daemon = node.daemon(**NO_FILES)
    await daemon.start()
    try:
        old = daemon.handoff.coalescer
        daemon.set_links([(node.layout.pfs[0].netdev, False)])
        assert old.pending
        doc = copy.deepcopy(node.doc)
        doc["coalesceMs"] = 30_000
        node.write_config(doc)
        assert await daemon.reload()
        assert daemon.config.coalesce_ms == 30_000
        # The old timer must not fire later (after a stop, or as a second flush); the burst it
        # held is the new coalescer's now.
        assert not old.pending
        assert daemon.handoff.coalescer is not old and daemon.handoff.coalescer.pending
    finally:
        await daemon.stop()
    assert not daemon.handoff.coalescer.pending


def reloads(daemon: Daemon, result: str = "success") -> float:
    """Return how many config reloads ended in ``result`` (success, failure), as /metrics counts them."""
    return sample(daemon, "densedev_config_reloads_total", result=result)


async def wait(predicate: Callable[[], bool], timeout: float = GUARD_S) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


def test_user_mistakes_on_the_command_line_get_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    # simulate into a path whose parent is a file: the OS refuses, the command says so in one line
    assert cli.main(["simulate", "--out", str(blocker / "node"), "--pfs", "1", "--vfs-per-pf", "1"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = err.splitlines()
    assert line.startswith("densedev simulate: ") and str(blocker) in line
    with pytest.raises(SystemExit) as info:
        cli.main(["check-config", str(blocker), "--log-level", "bogus"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "log level 'bogus'" in err
