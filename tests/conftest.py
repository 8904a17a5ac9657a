"""Shared fixtures: both accelerator implementations, and async tests on uvloop that fail on any exception
the loop saw but nobody awaited (as asyncpg's test base does).

Async tests and fixtures are plain ``async def`` (pytest-asyncio in auto mode, one loop per test); the loop
comes from ``new_loop`` below, through pytest-asyncio's loop-factory hook, so the suite runs on the loop the
daemon runs on.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import pytest
import uvloop
from hypothesis import HealthCheck, settings

if TYPE_CHECKING:  # imported where used: test_conftest.py runs this file where tests/helpers is not
    from helpers.node import Node

    from densedev.daemon import Daemon
    from densedev.testing.kubelet import KubeletEmulator

pytest_plugins = ("pytester",)  # test_conftest.py runs small suites under these hooks

# Property tests share two cores with the other xdist worker (and, in CI, the machine's other jobs): a
# 200 ms per-example deadline or the too_slow health check fails a correct test on a busy machine, so
# neither applies (each test bounds its work with max_examples).  Built on the profile Hypothesis chose
# (its "ci" profile under CI=true keeps its derandomized runs).
settings.register_profile(
    "densedev",
    settings(
        settings.default,
        deadline=None,
        suppress_health_check=[*settings.default.suppress_health_check, HealthCheck.too_slow],
    ),
)
settings.load_profile("densedev")


def _cython() -> ModuleType:
    from densedev import accel

    if accel.NO_EXTENSIONS:
        pytest.skip("DENSEDEV_NO_EXTENSIONS=1: the Cython extension is not under test")
    # A missing build is an error, not a skip: CI must prove the extension it ships.
    return importlib.import_module("densedev._fast")


@pytest.fixture(params=["cython", "python"])
def impl(request: pytest.FixtureRequest) -> ModuleType:
    """Each implementation of the hot paths in turn."""
    if request.param == "cython":
        return _cython()
    return importlib.import_module("densedev._fast_py")


@pytest.fixture
def both() -> tuple[ModuleType, ModuleType]:
    """The extension and its twin, for tests that assert they agree."""
    return _cython(), importlib.import_module("densedev._fast_py")


# Exceptions reported by the loops made for the current test, one list per loop: a task of an earlier
# test's loop that is garbage-collected later reports to that loop's list, not to this test.
_loop_errors: list[list[dict[str, Any]]] = []


# grpc.aio completions that arrived for an earlier test's loop after it had closed (see below).
_late_grpc_events: list[str] = []


def _late_grpc_event(ctx: dict[str, Any]) -> bool:
    # grpc.aio has one completion queue for every loop it was used on: an operation of an earlier test's
    # loop that completes after that loop closed is handed to it with call_soon_threadsafe, which raises
    # "Event loop is closed" inside PollerCompletionQueue._handle_events on whichever loop polls next.
    # It is no exception of the test that runs then, and nothing can tell which test left it.
    exc = ctx.get("exception")
    return (
        isinstance(exc, RuntimeError)
        and str(exc) == "Event loop is closed"
        and "PollerCompletionQueue._handle_events" in str(ctx.get("message", ""))
    )


def new_loop() -> asyncio.AbstractEventLoop:
    """Return a new uvloop loop whose reported exceptions fail the test that made it."""
    errors: list[dict[str, Any]] = []
    _loop_errors.append(errors)
    loop = uvloop.new_event_loop()

    # The loop calls its exception handler for what no one can raise to: a callback that raised, a task
    # whose exception was never retrieved (reported when the task is collected), a transport error.
    def report(_loop: asyncio.AbstractEventLoop, ctx: dict[str, Any]) -> None:
        if _late_grpc_event(ctx):
            _late_grpc_events.append(str(ctx.get("message", "")))
        else:
            errors.append(ctx)

    loop.set_exception_handler(report)
    return loop


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Say how many grpc.aio completions came for an earlier test's closed loop (counted, not failed)."""
    if _late_grpc_events:
        terminalreporter.write_line(
            f"grpc.aio: {len(_late_grpc_events)} completion(s) arrived for an earlier test's closed loop"
        )


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, Any]:
    """Run every async test and fixture on uvloop, as ``densedev run`` does."""
    # One factory: pytest-asyncio then keeps the test names unchanged.
    return {"uvloop": new_loop}


def _fail_on_loop_errors() -> None:
    reported = [ctx for errors in _loop_errors for ctx in errors]
    for errors in _loop_errors:
        errors.clear()  # reported once: a failure in the call is not reported again at teardown
    assert not reported, f"unhandled exceptions in the event loop: {reported}"


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Forget the loops of earlier tests."""
    _loop_errors.clear()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """Fail the test if a loop it ran reported an exception during its set-up or its body."""
    result = yield
    _fail_on_loop_errors()
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Report an error if a loop reported an exception while the fixtures stopped or the loop closed."""
    result = yield
    _fail_on_loop_errors()
    return result


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A short directory for unix sockets (sun_path holds 108 bytes; pytest's tmp_path can be longer)."""
    path = Path(tempfile.mkdtemp(prefix="dd-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def node_options() -> dict[str, Any]:
    """Keyword arguments of the ``node`` fixture's Node (parametrize or override this name to change them)."""
    return {}


@pytest.fixture
def node(tmp_path: Path, sock_dir: Path, node_options: dict[str, Any]) -> Iterator[Node]:
    """A simulated node with its config file, its kubelet dir ``sock_dir`` (helpers.node.Node)."""
    from helpers.node import Node

    n = Node(tmp_path, kubelet_dir=sock_dir, **node_options)
    yield n
    n.cleanup()


@pytest.fixture
def kubelet_options() -> dict[str, Any]:
    """Keyword arguments of the ``kubelet`` fixture's emulator (parametrize this name to change them)."""
    return {}


@pytest.fixture
async def kubelet(sock_dir: Path, kubelet_options: dict[str, Any]) -> AsyncIterator[KubeletEmulator]:
    """The kubelet emulator serving ``sock_dir`` (the node's kubelet dir), stopped after the test."""
    from densedev.testing.kubelet import KubeletEmulator

    emu = KubeletEmulator(sock_dir, **kubelet_options)
    await emu.start()
    try:
        yield emu
    finally:
        await emu.stop()


@pytest.fixture
def daemon_settings() -> dict[str, Any]:
    """DaemonSettings fields the ``daemon`` fixture overrides (parametrize this name to change them)."""
    return {}


@pytest.fixture
async def daemon(
    node: Node, kubelet: KubeletEmulator, daemon_settings: dict[str, Any]
) -> AsyncIterator[Daemon]:
    """A daemon on the node, yielded once every pool has listed at the kubelet, stopped after."""
    from helpers.node import daemon_on

    async with daemon_on(node, kubelet, **daemon_settings) as d:
        yield d


@pytest.fixture
def pr_dir() -> Iterator[Path]:
    """A short directory for the kubelet's PodResources socket (sun_path, as ``sock_dir``)."""
    path = Path(tempfile.mkdtemp(prefix="pr-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def child_env() -> dict[str, str]:
    """Environment for a ``python -m densedev.cli`` child that imports the same densedev as the tests."""
    import densedev

    here = str(Path(densedev.__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH", "")) if p)
    return env


@pytest.fixture
def netns() -> Iterator[str]:
    """A fresh network namespace (root only), deleted afterwards; skips with the reason otherwise."""
    from densedev.testing import netns as nsmod

    why = nsmod.available()
    if why is not None:
        pytest.skip(why)
    with nsmod.namespace() as name:
        yield name
