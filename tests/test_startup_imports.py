"""What ``densedev run`` imports on a node that serves the device plugin API only.

Start-up is mostly imports (issue 14: ~95 ms of a 0.21 s start at 4,096 VFs), so what a device-plugin-only
node does not use is imported only when asked for: prometheus-client with ``--metrics-addr``, the DRA
driver and its API-server clients (kubernetes_asyncio, aiohttp) with a DRA pool, pyroute2 and
``densedev.testing`` never.  The daemon runs as its own process under ``python -X importtime``, which
names every module the process imported — at start, and lazily later — so an import that creeps back
in fails here instead of slowing every node silently.
"""

from __future__ import annotations

import asyncio
import gc
import json
import re
import signal
import socket
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from helpers.interpreter import fresh_interpreter

from densedev import accel, cli
from densedev.testing import simnode
from densedev.testing.kubelet import KubeletEmulator

GUARD = 60.0  # hang guard only
RESOURCE = "intel.com/vfs"

# Each name stands for the module and everything under it.
NOT_FOR_DEVICE_PLUGIN_ONLY = (
    "prometheus_client",  # only with --metrics-addr
    "kubernetes_asyncio",  # DRA's API-server client
    "aiohttp",  # under kubernetes_asyncio
    "yaml",  # kubeconfig files, under kubernetes_asyncio
    "pyroute2",  # the tests' reference decoder
    "densedev.testing",  # simulated nodes and emulators
    "densedev.dra.commands",  # the dra-slices and dra-manifests commands (their parsers too)
    "densedev.dra.slices",
    "densedev.dra.driver",  # the DRA side: driver, kubelet plugin, publisher
    "densedev.dra.plugin",
    "densedev.dra.publisher",
    "densedev._proto.dra_v1_pb2",
    "densedev._proto.dra_v1beta1_pb2",
    "densedev._proto.dra_health_v1alpha1_pb2",
)
# Needed only once a pool has sent its first list: the generated protobuf classes and the protobuf runtime
# (GetDevicePluginOptions, RegisterRequest and the PodResources reply are encoded and decoded by hand; the
# first Allocate, or the warm-up after the first list, imports them), and the other commands' code.
NOT_BEFORE_THE_FIRST_LIST = (
    "google.protobuf",
    "densedev._proto",
    "ctypes.util",  # the inotify watch finds the C library's calls among the process's own symbols
    "shutil",  # argparse's formatter's terminal size (cli._Formatter reads it itself) and simulate's
    "lzma",  # shutil's
    "secrets",  # files.temp_name draws from os.urandom, as secrets does
    "densedev.dra.claims",  # prepared claims' records: the start only looks for checkpoints (dra.checkpoints)
)
_IMPORTED = re.compile(r"^import time:\s+\d+ \|\s+\d+ \| +(\S+)$", re.MULTILINE)


@pytest.fixture
def node(tmp_path: Path) -> tuple[Path, Path]:
    """A node of 2 PFs x 8 VFs and a config of one device-plugin pool holding all 16; (sysfs, config)."""
    layout = simnode.build_node(tmp_path / "sys", pfs=2, vfs_per_pf=8)
    config = tmp_path / "config.json"
    pfs = [pf.netdev for pf in layout.pfs]
    config.write_text(json.dumps({"resourceList": [{"resourceName": "vfs", "selectors": {"pfNames": pfs}}]}))
    return tmp_path / "sys", config


async def imported_by_run(
    node: tuple[Path, Path],
    sock_dir: Path,
    env: dict[str, str],
    *extra: str,
    scrape: int = 0,
    before_first_list: bool = False,
) -> set[str]:
    """Every module ``densedev run`` imported from its start until it stopped, its full list sent (and
    ``/metrics`` scraped on port ``scrape`` when given); with ``before_first_list``, only those imported
    before its ListAndWatch stream opened (the log line is written just before the first list)."""
    sysfs, config = node
    argv = [sys.executable, "-X", "importtime", "-m", "densedev.cli", "run", "--config", str(config)]
    argv += ["--sysfs-root", str(sysfs), "--kubelet-dir", str(sock_dir), "--no-netlink", "--devinfo-dir", ""]
    argv += ["--log-level", "info" if before_first_list else "error", *extra]

    async def main() -> str:
        emulator = KubeletEmulator(sock_dir)
        await emulator.start()
        try:
            with tempfile.TemporaryFile() as err:
                child = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, env=env)
                try:
                    await emulator.wait_for(lambda: len(emulator.devices(RESOURCE)) == 16, GUARD)
                    if scrape:
                        body = await asyncio.to_thread(_get, f"http://127.0.0.1:{scrape}/metrics")
                        assert f'densedev_pool_devices{{health="Healthy",resource="{RESOURCE}"}}' in body
                finally:
                    child.send_signal(signal.SIGTERM)
                    code = child.wait(GUARD)
                err.seek(0)
                text = err.read().decode()
            assert code == 0, text[-3000:]
            return text
        finally:
            await emulator.stop()

    stderr = await main()
    if before_first_list:
        # -X importtime and the log write to the same stderr, each line as it happens.
        stderr, opened, _ = stderr.partition("ListAndWatch stream opened")
        assert opened, stderr[-3000:]
    modules = set(_IMPORTED.findall(stderr))
    assert "densedev.daemon" in modules, stderr[-3000:]  # the parse saw the run's own imports
    return modules


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=GUARD) as response:
        return str(response.read().decode())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def unwanted(modules: set[str]) -> list[str]:
    """The modules of ``modules`` a device-plugin-only run must not import."""
    return sorted(
        m for m in modules if any(m == n or m.startswith(n + ".") for n in NOT_FOR_DEVICE_PLUGIN_ONLY)
    )


async def test_a_device_plugin_only_run_imports_neither_metrics_nor_dra_nor_test_helpers(
    node: tuple[Path, Path], sock_dir: Path, child_env: dict[str, str]
) -> None:
    modules = await imported_by_run(node, sock_dir, child_env)
    assert unwanted(modules) == []
    if accel.IMPLEMENTATION == "cython":  # the child runs what this process runs (same environment)
        assert "densedev._fast_py" not in modules  # the twin is the fallback, not a dependency


async def test_the_path_to_the_first_list_loads_no_protobuf_nor_other_commands(
    node: tuple[Path, Path], sock_dir: Path, child_env: dict[str, str]
) -> None:
    modules = await imported_by_run(node, sock_dir, child_env, before_first_list=True)
    early = sorted(
        m for m in modules if any(m == n or m.startswith(n + ".") for n in NOT_BEFORE_THE_FIRST_LIST)
    )
    assert early == []


async def test_metrics_addr_brings_prometheus_client_and_nothing_else_it_does_not_need(
    node: tuple[Path, Path], sock_dir: Path, child_env: dict[str, str]
) -> None:
    # The other side of the test above: the same run serving /metrics imports prometheus-client once
    # scraped (so the parse of -X importtime sees lazy imports), and still none of the rest.
    port = _free_port()
    modules = await imported_by_run(
        node, sock_dir, child_env, "--metrics-addr", f"127.0.0.1:{port}", scrape=port
    )
    assert "prometheus_client" in modules
    assert [m for m in unwanted(modules) if not m.startswith("prometheus_client")] == []


def test_run_keeps_the_cyclic_gc_off_while_it_starts_and_on_afterwards(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Start-up's objects live as long as the daemon: collections over them before gc.freeze() were a
    # tenth of the start's CPU at 4,096 VFs.  Whatever the command did, the process must leave with
    # the GC on again, or the daemon would never collect a cycle.
    seen: list[bool] = []

    def fake_run(coro: Any) -> int:
        coro.close()
        seen.append(gc.isenabled())
        return 0

    before = sys.getswitchinterval()
    monkeypatch.setattr("uvloop.run", fake_run)
    try:
        assert gc.isenabled()
        assert cli.main(["run", "--config", "/nonexistent.json"]) == 0
        assert seen == [False] and gc.isenabled()
    finally:
        sys.setswitchinterval(before)
        gc.enable()


# The dataclasses ``densedev run`` creates as it imports its modules, and why each stays one.  A
# dataclass statement costs ~0.3-1 ms in 3.11 (each generated method is exec'd on its own) against
# ~0.05 ms for a NamedTuple, and the start path once made ~20 of them (issue 14: start-up).
START_PATH_DATACLASSES = {
    "densedev.node.table.DeviceTable": "it keeps an index built in __post_init__ beside its fields",
}


def test_importing_the_start_path_creates_only_the_dataclasses_listed() -> None:
    # A fresh interpreter: every class statement of the run's modules executes once, under the count.
    code = (
        "import dataclasses, sys\n"
        "made = []\n"
        "process = dataclasses._process_class\n"
        "def counted(cls, *args):\n"
        "    made.append(cls.__module__ + '.' + cls.__qualname__)\n"
        "    return process(cls, *args)\n"
        "dataclasses._process_class = counted\n"
        "import densedev.cli, densedev.daemon, densedev.dra.checkpoints\n"
        "print('\\n'.join(m for m in made if m.startswith('densedev.')))\n"
    )
    assert sorted(fresh_interpreter(code).stdout.split()) == sorted(START_PATH_DATACLASSES)


def test_the_warm_up_imports_the_generated_classes_off_the_event_loop() -> None:
    # A fresh interpreter: this one imported them long ago.  The first Allocate then finds them loaded.
    code = (
        "import sys, threading\n"
        "from densedev.kubelet import server\n"
        "assert 'densedev._proto.api_pb2' not in sys.modules\n"
        "server.WARM_UP_DELAY_S = 0\n"
        "server.warm_up(); server.warm_up()\n"
        "threads = [t for t in threading.enumerate() if t.name == 'densedev-warm-up']\n"
        "assert len(threads) == 1, threads\n"
        "threads[0].join(60)\n"
        "assert 'densedev._proto.api_pb2' in sys.modules and 'google.protobuf' in sys.modules\n"
    )
    fresh_interpreter(code)


# Counts the collector's passes while the command loads: through the entry point (``densedev``,
# ``python -m densedev``) or by importing densedev.cli as any other module would (the control).
_COUNT_COLLECTIONS = """
import gc, sys
passes = []


def loading():  # densedev.cli not yet imported whole (main is defined near its end)
    return not hasattr(sys.modules.get("densedev.cli"), "main")


gc.callbacks.append(lambda phase, info: passes.append(1) if phase == "start" and loading() else None)
import densedev  # the package itself is loaded before the entry point runs
passes.clear()
if sys.argv[1] == "entry":
    sys.argv[1:] = ["--version"]
    from densedev.__main__ import main
    try:
        main()
    except SystemExit:
        pass
else:
    import densedev.cli
print(len(passes), gc.isenabled())
"""


@pytest.mark.parametrize(("how", "collected"), [("entry", False), ("import", True)])
def test_the_entry_point_loads_the_command_with_the_collector_off(
    how: str, collected: bool, child_env: dict[str, str]
) -> None:
    out = fresh_interpreter(_COUNT_COLLECTIONS, how, env=child_env).stdout.split()
    passes, enabled = int(out[-2]), out[-1]
    assert (passes > 0) is collected, out
    assert enabled == "True"  # on again for the command (run turns it off again itself)
