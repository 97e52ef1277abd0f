"""Logging: JSON lines carry contextvars (request/session ids), static fields, and stdlib records."""

from __future__ import annotations

import io
import json
import logging

import pytest
import structlog

from pipeshard.logs import configure_logging, get_logger


@pytest.fixture
def out(restore_logging) -> io.StringIO:
    structlog.contextvars.clear_contextvars()
    return io.StringIO()


def _lines(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_line_has_bound_ids_and_static_fields(out):
    configure_logging("json", "info", service="stage", stream=out, stage=1)
    with structlog.contextvars.bound_contextvars(request_id="r-1", session_id="sess-9"):
        get_logger("pipeshard.test").info("step done", step=3)
    get_logger("pipeshard.test").info("after")
    first, second = _lines(out)
    assert first["event"] == "step done" and first["step"] == 3
    assert (first["request_id"], first["session_id"]) == ("r-1", "sess-9")
    assert (first["service"], first["stage"], first["level"], first["logger"]) == (
        "stage",
        1,
        "info",
        "pipeshard.test",
    )
    assert first["timestamp"].endswith("Z")
    assert "request_id" not in second and second["service"] == "stage"


def test_level_filters_and_stdlib_records_are_rendered_too(out):
    configure_logging("json", "warning", service="coord", stream=out)
    structlog.contextvars.bind_contextvars(session_id="s-2")
    get_logger().info("hidden")
    logging.getLogger("grpc.somewhere").warning("from %s", "stdlib")
    try:
        raise ValueError("bad")
    except ValueError:
        get_logger().exception("failed")
    stdlib_line, error_line = _lines(out)
    assert stdlib_line["event"] == "from stdlib" and stdlib_line["logger"] == "grpc.somewhere"
    assert stdlib_line["session_id"] == "s-2" and stdlib_line["service"] == "coord"
    assert error_line["level"] == "error" and "ValueError: bad" in error_line["exception"]


def test_console_format_is_not_json(out):
    configure_logging("console", "info", stream=out)
    with structlog.contextvars.bound_contextvars(request_id="r-7"):
        get_logger().info("hello")
    text = out.getvalue()
    assert "hello" in text and "request_id=r-7" in text
    with pytest.raises(json.JSONDecodeError):
        json.loads(text.splitlines()[0])


def test_bad_format_or_level_is_rejected(restore_logging):
    with pytest.raises(ValueError, match="log_format"):
        configure_logging("xml")
    with pytest.raises(ValueError, match="log_level"):
        configure_logging("json", "loud")
