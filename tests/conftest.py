"""Shared fixtures: both accelerator implementations, and an asyncio runner on uvloop that fails a test
on any exception the loop saw but nobody awaited (as asyncpg's test base does)."""

from __future__ import annotations

import asyncio
import importlib
import os
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import uvloop


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


@pytest.fixture
def run() -> Callable[[Coroutine[Any, Any, Any]], Any]:
    """Run a coroutine on uvloop; fail if the loop reported an unhandled exception."""

    def _run(coro: Coroutine[Any, Any, Any]) -> Any:
        errors: list[dict[str, Any]] = []

        async def main() -> Any:
            asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: errors.append(ctx))
            return await coro

        result = uvloop.run(main())
        assert not errors, f"unhandled exceptions in the event loop: {errors}"
        return result

    return _run


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
