"""The suite's own async machinery (conftest.py): tests run on uvloop and fail on what the loop reported."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import uvloop

CONFTEST = Path(__file__).with_name("conftest.py")

INNER = """
import asyncio
import gc

import pytest
import uvloop


async def test_runs_on_uvloop():
    assert isinstance(asyncio.get_running_loop(), uvloop.Loop)


@pytest.fixture
async def loop_of_fixture():
    yield asyncio.get_running_loop()


async def test_fixture_and_test_share_one_loop(loop_of_fixture):
    assert loop_of_fixture is asyncio.get_running_loop()


async def test_a_callback_that_raised():
    asyncio.get_running_loop().call_soon(lambda: 1 / 0)
    await asyncio.sleep(0)
    await asyncio.sleep(0)


async def test_a_task_exception_never_retrieved():
    async def boom():
        raise RuntimeError("nobody awaited me")

    task = asyncio.create_task(boom())
    await asyncio.sleep(0)
    assert task.done()
    del task
    gc.collect()  # the task reports its unretrieved exception when it is collected


@pytest.fixture
async def raises_on_the_way_out():
    yield
    asyncio.get_running_loop().call_soon(lambda: {}["missing"])
    await asyncio.sleep(0)


async def test_clean_body_dirty_teardown(raises_on_the_way_out):
    pass


async def test_a_late_grpc_completion_for_a_closed_loop_is_counted_not_failed():
    asyncio.get_running_loop().call_exception_handler(
        {
            "message": "Exception in callback functools.partial(<bound method "
            "PollerCompletionQueue._handle_events of <grpc._cython.cygrpc.PollerCompletionQueue>>, <loop>)",
            "exception": RuntimeError("Event loop is closed"),
        }
    )


async def test_the_same_error_from_elsewhere_fails():
    asyncio.get_running_loop().call_exception_handler(
        {"message": "Exception in callback f()", "exception": RuntimeError("Event loop is closed")}
    )


"""


def test_async_tests_run_on_uvloop_and_fail_on_unhandled_loop_exceptions(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makeini(
        "[pytest]\n"
        "asyncio_mode = auto\n"
        "asyncio_default_fixture_loop_scope = function\n"
        "asyncio_default_test_loop_scope = function\n"
        "filterwarnings = error\n"
    )
    pytester.makepyfile(test_inner=INNER)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rfE")
    result.stdout.fnmatch_lines(
        [
            "FAILED test_inner.py::test_a_callback_that_raised*",
            "FAILED test_inner.py::test_a_task_exception_never_retrieved*",
            "FAILED test_inner.py::test_the_same_error_from_elsewhere_fails*",
            "ERROR test_inner.py::test_clean_body_dirty_teardown*",
        ],
        consecutive=False,
    )
    # Each failure names what the loop reported.
    lines = result.stdout.lines
    for what in (
        "ZeroDivisionError",
        "nobody awaited me",
        "KeyError",
        "Exception in callback f()",
    ):
        told = [line for line in lines if "unhandled exceptions in the event loop: [" in line]
        assert any(what in line for line in told), what
    # grpc.aio's late completion for an earlier test's closed loop is counted, and fails nothing.
    assert "grpc.aio: 1 completion(s) arrived for an earlier test's closed loop" in lines
    result.assert_outcomes(passed=4, failed=3, errors=1)


async def test_this_suite_runs_on_uvloop() -> None:
    assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
