"""Structured logs: both formats, escaping that keeps one record on one line, levels, summaries."""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from densedev.ops.logs import (
    JsonFormatter,
    KeyValueFormatter,
    log_event,
    parse_level,
    setup_logging,
    summarise,
)

KV_PAIR = re.compile(r'([A-Za-z0-9_.\-]+)=("(?:[^"\\]|\\.)*"|[^ "]+)')


def parse_kv(line: str) -> dict[str, str]:
    """Parse one logfmt line back into a dict, undoing our escapes; fails on anything left over."""
    out: dict[str, str] = {}
    pos = 0
    while pos < len(line):
        m = KV_PAIR.match(line, pos)
        assert m, f"unparseable kv at {pos}: {line[pos:]!r}"
        key, raw = m.group(1), m.group(2)
        if raw.startswith('"'):
            body = raw[1:-1]
            raw = re.sub(
                r"\\(x[0-9a-f]{2}|.)",
                lambda e: {"n": "\n", "r": "\r", "t": "\t", '"': '"', "\\": "\\"}.get(
                    e.group(1), chr(int(e.group(1)[1:], 16)) if e.group(1).startswith("x") else e.group(1)
                ),
                body,
            )
        assert key not in out, f"duplicate key {key} in {line!r}"
        out[key] = raw
        pos = m.end()
        if pos < len(line):
            assert line[pos] == " ", line
            pos += 1
    return out


@pytest.fixture
def capture() -> Iterator[io.StringIO]:
    """A stream the root logger writes to in kv format; restores the root logger afterwards."""
    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    stream = io.StringIO()
    yield stream
    for handler in list(root.handlers):
        if handler not in saved_handlers:
            root.removeHandler(handler)
    root.setLevel(saved_level)
    logging.getLogger("densedev").setLevel(logging.NOTSET)


def lines(stream: io.StringIO) -> list[str]:
    return stream.getvalue().splitlines()


def test_kv_line_has_fixed_keys_then_fields(capture: io.StringIO) -> None:
    setup_logging("info", "kv", capture)
    log = logging.getLogger("densedev.health.tracker")
    log_event(log, "device unhealthy", level=logging.WARNING, pool="intel.com/sriov", device="0000:3b:00.2")
    [line] = lines(capture)
    assert re.fullmatch(
        r"ts=\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z level=warning logger=densedev\.health\.tracker "
        r'msg="device unhealthy" pool=intel\.com/sriov device=0000:3b:00\.2',
        line,
    ), line


def test_extra_fields_form_equals_helper(capture: io.StringIO) -> None:
    setup_logging("info", "kv", capture)
    log = logging.getLogger("densedev.kubelet.server")
    log.info("pool registered", extra={"fields": {"pool": "a/b", "devices": 64}})
    log_event(log, "pool registered", pool="a/b", devices=64)
    first, second = (parse_kv(line) for line in lines(capture))
    del first["ts"], second["ts"]
    assert (
        first
        == second
        == {
            "level": "info",
            "logger": "densedev.kubelet.server",
            "msg": "pool registered",
            "pool": "a/b",
            "devices": "64",
        }
    )


@pytest.mark.parametrize(
    ("value", "rendered"),
    [
        ("plain", "plain"),
        ("two words", '"two words"'),
        ('say "hi"', r'"say \"hi\""'),
        ("a\nb", r'"a\nb"'),
        ("tab\there", r'"tab\there"'),
        ("back\\slash", r'"back\\slash"'),
        ("k=v", '"k=v"'),
        ("", '""'),
        ("bell\x07", r'"bell\x07"'),
        (True, "true"),
        (None, "null"),
        (3, "3"),
        (0.25, "0.25"),
        (("eth0", "eth1"), "eth0,eth1"),
    ],
)
def test_kv_escaping(capture: io.StringIO, value: object, rendered: str) -> None:
    setup_logging("info", "kv", capture)
    log_event(logging.getLogger("densedev.t"), "x", value=value)
    [line] = lines(capture)
    assert line.endswith(f" value={rendered}"), line


@given(st.text(), st.text())
def test_kv_round_trips_any_text_on_one_line(msg: str, value: str) -> None:
    record = logging.LogRecord("densedev.t", logging.INFO, __file__, 1, msg, None, None)
    record.fields = {"reason": value}
    line = KeyValueFormatter().format(record)
    assert "\n" not in line and "\r" not in line
    parsed = parse_kv(line)
    assert parsed["msg"] == msg
    assert parsed["reason"] == value


@given(st.text(), st.text())
def test_json_round_trips_any_text_on_one_line(msg: str, value: str) -> None:
    record = logging.LogRecord("densedev.t", logging.INFO, __file__, 1, msg, None, None)
    record.fields = {"reason": value}
    line = JsonFormatter().format(record)
    # str.splitlines also splits on U+2028 and friends, which JSON leaves unescaped; a log shipper
    # splits on "\n" only, which is what must never appear.
    assert "\n" not in line and "\r" not in line
    obj = json.loads(line)
    assert obj["msg"] == msg
    assert obj["reason"] == value


def test_json_one_object_per_line_with_native_types(capture: io.StringIO) -> None:
    setup_logging("debug", "json", capture)
    log = logging.getLogger("densedev.node.scanner")
    log_event(log, "scan done", level=logging.DEBUG, devices=4096, seconds=0.012, ok=True, ids=("a", "b"))
    log.info("plain %s message", "formatted")
    first, second = (json.loads(line) for line in lines(capture))
    assert first["level"] == "debug"
    assert first["logger"] == "densedev.node.scanner"
    assert first["msg"] == "scan done"
    assert (first["devices"], first["seconds"], first["ok"], first["ids"]) == (4096, 0.012, True, ["a", "b"])
    assert list(first)[:4] == ["ts", "level", "logger", "msg"]
    assert second["msg"] == "plain formatted message"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", second["ts"])


def test_exception_stays_on_one_line(capture: io.StringIO) -> None:
    setup_logging("info", "kv", capture)
    log = logging.getLogger("densedev.t")
    try:
        raise RuntimeError("boom\nsecond line")
    except RuntimeError:
        log.exception("scan failed", extra={"fields": {"root": "/sys"}})
    [line] = lines(capture)
    parsed = parse_kv(line)
    assert parsed["level"] == "error"
    assert parsed["root"] == "/sys"
    assert "Traceback" in parsed["exc"] and "RuntimeError: boom\nsecond line" in parsed["exc"]


def test_reserved_field_names_do_not_clobber(capture: io.StringIO) -> None:
    setup_logging("info", "json", capture)
    log_event(logging.getLogger("densedev.t"), "real", msg="fake", level_="x", **{"bad key": 1})
    [line] = lines(capture)
    obj = json.loads(line)
    assert obj["msg"] == "real"
    assert obj["msg_"] == "fake"
    assert obj["bad_key"] == 1


def test_levels_filter(capture: io.StringIO) -> None:
    setup_logging("warning", "kv", capture)
    log = logging.getLogger("densedev.t")
    log_event(log, "hidden", level=logging.INFO)
    log.debug("hidden too")
    log_event(log, "shown", level=logging.WARNING)
    log.error("also shown")
    assert [parse_kv(line)["msg"] for line in lines(capture)] == ["shown", "also shown"]


def test_setup_twice_replaces_its_handler(capture: io.StringIO) -> None:
    setup_logging("info", "kv", capture)
    second = io.StringIO()
    setup_logging("info", "json", second)
    logging.getLogger("densedev.t").info("once")
    assert capture.getvalue() == ""
    assert len(lines(second)) == 1
    assert json.loads(second.getvalue())["msg"] == "once"


def test_default_stream_follows_sys_stderr(capture: io.StringIO, monkeypatch: pytest.MonkeyPatch) -> None:
    setup_logging("info", "kv")
    later = io.StringIO()
    monkeypatch.setattr("sys.stderr", later)  # replaced after setup, as a test runner or daemon may
    logging.getLogger("densedev.t").info("to the current stderr")
    assert parse_kv(later.getvalue().strip())["msg"] == "to the current stderr"


def test_bad_level_and_format_are_named() -> None:
    with pytest.raises(ValueError, match=r"log level 'loud' is not one of debug, info"):
        setup_logging("loud")
    with pytest.raises(ValueError, match=r"log format 'xml' is not one of kv, json"):
        setup_logging("info", "xml")
    assert parse_level("WARN") == logging.WARNING
    assert parse_level(" Debug ") == logging.DEBUG


def test_summarise() -> None:
    ids = [f"0000:3b:{i // 8:02x}.{i % 8}" for i in range(2, 258)]
    assert summarise(ids) == (
        "256 devices: 0000:3b:00.2, 0000:3b:00.3, 0000:3b:00.4, 0000:3b:00.5, 0000:3b:00.6, ... (+251)"
    )
    assert summarise(ids[:1]) == "1 device: 0000:3b:00.2"
    assert summarise(ids[:5]) == ", ".join(ids[:5]).join(["5 devices: ", ""])
    assert summarise(ids[:6], limit=5).endswith("0000:3b:00.6, ... (+1)")
    assert summarise([]) == "0 devices"
    assert summarise(ids, limit=0) == "256 devices"
    assert summarise({"mlx5_0", "mlx5_1"}, noun="port").startswith("2 ports: ")
    with pytest.raises(ValueError, match="limit must be >= 0"):
        summarise(ids, limit=-1)


def test_debug_is_densedevs_own_not_the_libraries(capture: io.StringIO) -> None:
    """At debug (the SR-IOV operators' --log-level=10) gRPC's per-stream debug lines stay out."""
    setup_logging("10", "kv", capture)
    logging.getLogger("grpc._cython.cygrpc").debug("Loaded running loop")
    logging.getLogger("densedev.kubelet.server").debug("ours")
    logging.getLogger("grpc._cython.cygrpc").warning("theirs, a warning")
    assert [parse_kv(line)["msg"] for line in lines(capture)] == ["ours", "theirs, a warning"]
