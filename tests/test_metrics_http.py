"""The metrics endpoint under load (issue 23, item 4): scrapes share renders, every client-held resource is
bounded, and the health paths never wait on a scrape.  Real sockets on 127.0.0.1, many clients at once."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from densedev.ops.metrics import Metrics, MetricsServer

WAIT_S = 30  # the bound on any wait here: a broken server fails the test rather than hanging it


class GatedMetrics(Metrics):
    """Metrics whose render counts itself and, while ``gate`` is clear, blocks its thread."""

    def __init__(self, body: bytes | None = None, fail: bool = False) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()
        self.started = threading.Event()
        self.renders = 0
        self._fixed = body
        self._fail = fail

    def render(self) -> bytes:
        self.renders += 1  # renders run in the one metrics thread, one at a time
        self.started.set()
        if not self.gate.wait(WAIT_S):
            raise TimeoutError("the test never opened the gate")
        if self._fail:
            raise RuntimeError("a collector broke")
        return self._fixed if self._fixed is not None else super().render()


@contextlib.asynccontextmanager
async def serving(metrics: Metrics, **kw: Any) -> AsyncIterator[MetricsServer]:
    """A server on an ephemeral port of 127.0.0.1; its render gate is opened whatever happens, so a
    blocked render never outlives the test in the shared metrics thread."""
    server = MetricsServer(metrics, lambda: (True, "all pools registered"), "127.0.0.1", 0, **kw)
    await server.start()
    try:
        yield server
    finally:
        if isinstance(metrics, GatedMetrics):
            metrics.gate.set()
        await asyncio.wait_for(server.stop(), WAIT_S)


async def request(port: int, path: str) -> tuple[int, bytes]:
    """GET ``path`` on a fresh connection; return the status and the body (the server closes after it)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        answer = await asyncio.wait_for(reader.read(), WAIT_S)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


async def until(condition: Callable[[], bool], what: str) -> None:
    """Wait, in bounded steps, until ``condition()`` holds."""
    for _ in range(WAIT_S * 100):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


async def render_started(m: GatedMetrics) -> None:
    await until(m.started.is_set, "a render started")


async def test_scrapes_that_arrive_during_a_render_get_its_body() -> None:
    m = GatedMetrics()
    m.gate.clear()
    # No minimum interval: only sharing the render that runs can make one render serve many scrapes.
    async with serving(m, min_render_interval_s=0, max_waiting_scrapes=200, max_connections=200) as server:
        first = asyncio.ensure_future(request(server.port, "/metrics"))
        await render_started(m)
        rest = [asyncio.ensure_future(request(server.port, "/metrics")) for _ in range(99)]
        await until(lambda: server._waiting == 100, "100 scrapes waiting on the render")
        m.observe_scan(0.5)  # recorded before the gate opens: the shared render shows it
        m.gate.set()
        answers = await asyncio.gather(first, *rest)
        assert m.renders == 1
        assert {status for status, _ in answers} == {200}
        assert len({body for _, body in answers}) == 1
        assert b"densedev_scans_total 1.0\n" in answers[0][1]
        # A scrape after the render ends gets a render of its own.
        m.observe_scan(0.5)
        status, body = await request(server.port, "/metrics")
        assert (status, m.renders) == (200, 2) and b"densedev_scans_total 2.0\n" in body


async def test_renders_at_most_once_per_interval_however_many_scrape() -> None:
    m = GatedMetrics()
    # Caps above the clients: every scrape is answered 200, by the first render or the kept body.
    async with serving(m, min_render_interval_s=3600, max_waiting_scrapes=64, max_connections=64) as server:
        for _ in range(3):  # rounds of concurrent scrapers, as clients looping on the endpoint
            answers = await asyncio.gather(*(request(server.port, "/metrics") for _ in range(50)))
            assert {status for status, _ in answers} == {200}
        assert m.renders == 1
    # The control: with no interval, sequential scrapes render each time.
    m = GatedMetrics()
    async with serving(m, min_render_interval_s=0) as server:
        for _ in range(5):
            assert (await request(server.port, "/metrics"))[0] == 200
        assert m.renders == 5


async def test_scrapes_beyond_the_cap_get_503_and_health_answers_while_a_render_is_blocked() -> None:
    m = GatedMetrics()
    m.gate.clear()
    async with serving(m, min_render_interval_s=0, max_waiting_scrapes=4, max_connections=32) as server:
        waiting = [asyncio.ensure_future(request(server.port, "/metrics")) for _ in range(4)]
        await render_started(m)
        await until(lambda: server._waiting == 4, "4 scrapes waiting on the render")
        excess = await asyncio.gather(*(request(server.port, "/metrics") for _ in range(20)))
        assert {status for status, _ in excess} == {503}
        assert excess[0][1] == b"too many scrapes waiting for a render\n"
        # The health paths never touch a render: answered while the only render is still blocked.
        health = await asyncio.gather(
            *(request(server.port, path) for path in ("/healthz", "/readyz") for _ in range(10))
        )
        assert {status for status, _ in health} == {200}
        assert not any(task.done() for task in waiting) and m.renders == 1  # still blocked: the control
        m.gate.set()
        assert {status for status, _ in await asyncio.gather(*waiting)} == {200}
        assert m.renders == 1


async def test_connections_beyond_the_cap_get_503_but_probes_are_answered() -> None:
    async with serving(Metrics(), max_connections=3, read_timeout_s=WAIT_S) as server:
        silent = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(3)]
        await until(lambda: server._serving == 3, "3 silent connections served")
        answers = await asyncio.gather(*(request(server.port, "/metrics") for _ in range(20)))
        assert answers == [(503, b"too many connections\n")] * 20
        # The health paths are answered all the same: a flood of scrapers never fails the kubelet's probes.
        probes = await asyncio.gather(*(request(server.port, p) for p in ("/healthz", "/readyz") * 10))
        assert {status for status, _ in probes} == {200}
        _, writer = silent.pop()
        writer.close()
        await writer.wait_closed()
        await until(lambda: server._serving == 2, "a slot freed")
        assert (await request(server.port, "/metrics"))[0] == 200
        for _, writer in silent:
            writer.close()
            await writer.wait_closed()


async def test_silent_and_trickling_clients_are_cut_and_free_their_slots() -> None:
    async with serving(Metrics(), max_connections=2, read_timeout_s=0.3) as server:
        silent_reader, silent_writer = await asyncio.open_connection("127.0.0.1", server.port)
        trickle_reader, trickle_writer = await asyncio.open_connection("127.0.0.1", server.port)
        await until(lambda: server._serving == 2, "both clients served")
        request_bytes = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Padding: " + b"a" * 400

        async def trickle() -> None:
            # A byte every 20 ms: each read succeeds, but the head is never complete in time.
            for byte in request_bytes:
                if trickle_reader.at_eof():
                    return
                with contextlib.suppress(ConnectionError):
                    trickle_writer.write(bytes([byte]))
                await asyncio.sleep(0.02)

        sender = asyncio.ensure_future(trickle())
        # Cut without an answer: the server closes both (EOF, or a reset for bytes it left unread).
        for reader in (silent_reader, trickle_reader):
            with contextlib.suppress(ConnectionError):
                assert await asyncio.wait_for(reader.read(), WAIT_S) == b""
        await until(lambda: server._serving == 0, "both slots freed")
        assert not sender.done()  # the trickler was cut before it finished: the deadline is per head
        sender.cancel()
        for writer in (silent_writer, trickle_writer):
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
        assert (await request(server.port, "/healthz"))[0] == 200


async def test_a_client_that_never_reads_its_answer_is_cut() -> None:
    # 64 MiB of body against a 4 KiB receive buffer: far beyond what loopback's buffers hold.
    m = GatedMetrics(body=b"#" * (64 << 20))
    async with serving(m, write_timeout_s=0.3) as server:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", server.port))
        reader, writer = await asyncio.open_connection(sock=sock)
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        await until(lambda: m.renders == 1 and server._serving == 1, "the answer being written")
        await until(lambda: server._serving == 0, "the reader-less client cut")
        assert (await request(server.port, "/healthz"))[0] == 200
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
        del reader


async def test_a_failed_render_answers_500_logs_once_not_kept(caplog: pytest.LogCaptureFixture) -> None:
    m = GatedMetrics(fail=True)
    m.gate.clear()
    async with serving(m, min_render_interval_s=3600) as server:
        with caplog.at_level(logging.ERROR, logger="densedev.ops.metrics"):
            scrapes = [asyncio.ensure_future(request(server.port, "/metrics")) for _ in range(10)]
            await render_started(m)
            await until(lambda: server._waiting == 10, "10 scrapes waiting on the render")
            m.gate.set()
            answers = await asyncio.gather(*scrapes)
        assert {status for status, _ in answers} == {500}
        # Errors only: the start's info line is captured too when an earlier test left the root at info.
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == [
            "rendering /metrics failed"
        ]
        # A failure is not served for the interval: the next scrape renders again.
        assert (await request(server.port, "/metrics"))[0] == 500
        assert m.renders == 2


async def test_stop_does_not_wait_for_a_blocked_render() -> None:
    m = GatedMetrics()
    m.gate.clear()
    async with serving(m) as server:
        scrapes = [asyncio.ensure_future(request(server.port, "/metrics")) for _ in range(5)]
        await render_started(m)
        await until(lambda: server._waiting == 5, "5 scrapes waiting on the render")
        await asyncio.wait_for(server.stop(), WAIT_S)
        # The waiting clients are let go without an answer (the connection closed or reset).
        for scrape in scrapes:
            with contextlib.suppress(ConnectionError, ValueError, IndexError):
                await scrape


async def test_scrape_answers_are_paced_and_probes_are_not() -> None:
    m = GatedMetrics()
    # One answer at most every 1,000 s after a burst of 2: the bucket, not a clock, decides here.
    kw = {"min_render_interval_s": 3600, "scrape_answers_per_s": 0.001, "scrape_answer_burst": 2}
    async with serving(m, **kw) as server:
        assert (await request(server.port, "/metrics"))[0] == 200  # the render's own scrape: not paced
        scrapes = [asyncio.ensure_future(request(server.port, "/metrics")) for _ in range(5)]
        await until(lambda: len(server._held) == 3, "3 scrapes held for their turn")
        await until(lambda: len([s for s in scrapes if s.done()]) == 2, "the burst answered")
        done = [s.result() for s in scrapes if s.done()]
        assert [status for status, _ in done] == [200, 200]
        # Probes are answered while scrapes wait their turn.
        for path in ("/healthz", "/readyz") * 5:
            assert (await request(server.port, path))[0] == 200
        assert len(server._held) == 3 and m.renders == 1
        await server.stop()  # the held clients are let go unanswered
        for scrape in scrapes:
            with contextlib.suppress(ConnectionError, ValueError, IndexError):
                await scrape


async def test_beyond_every_cap_clients_wait_in_the_kernels_queue() -> None:
    kw = {"max_connections": 1, "max_extra_connections": 1, "read_timeout_s": WAIT_S}
    async with serving(Metrics(), scrape_answers_per_s=0.001, scrape_answer_burst=1, **kw) as server:
        _, silent = await asyncio.open_connection("127.0.0.1", server.port)  # holds the one slot
        await until(lambda: server._serving == 1, "the slot taken")
        # An extra connection's 503 takes the only token; the next one's waits its turn, held open.
        assert await request(server.port, "/metrics") == (503, b"too many connections\n")
        held = asyncio.ensure_future(request(server.port, "/metrics"))
        await until(lambda: len(server._held) == 1, "a 503 held for its turn")
        assert not server._room.is_set()  # both caps full: the accept loop waits for room
        # A probe now connects (the kernel completes the handshake) but is not accepted yet.
        probe = asyncio.ensure_future(request(server.port, "/healthz"))
        await until(lambda: len(server._connections) == 2 and server._refusing == 1, "still full")
        assert not probe.done()
        silent.close()
        await silent.wait_closed()
        assert (await probe)[0] == 200  # accepted as soon as the slot freed
        held.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await held


async def test_a_request_that_breaks_is_answered_500_and_the_server_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A readiness callable that breaks its contract (a detail that is no string) fails past its own
    # guard: the client gets 500, the log one line with the traceback, and the next client an answer.
    server = MetricsServer(Metrics(), lambda: (True, 5), "127.0.0.1", 0)  # type: ignore[arg-type, return-value]
    await server.start()
    try:
        with caplog.at_level(logging.ERROR, logger="densedev.ops.metrics"):
            status, body = await request(server.port, "/readyz")
        assert (status, body) == (500, b"internal error; see the daemon's log\n")
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == [
            "metrics endpoint failed a request"
        ]
        assert (await request(server.port, "/healthz"))[0] == 200
    finally:
        await server.stop()
