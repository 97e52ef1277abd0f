"""`--log-format console` prints tracebacks without the frames' locals (a prompt is a local)."""

from __future__ import annotations

import io

import structlog

from pipeshard.logs import configure_logging


def test_console_tracebacks_carry_no_locals():
    stream = io.StringIO()
    configure_logging("console", "info", stream=stream)

    def generate():
        prompt = "a user's private prompt"
        raise ValueError(f"failed after {len(prompt)} characters")

    try:
        generate()
    except ValueError:
        structlog.get_logger("test").exception("generation_failed")
    out = stream.getvalue()
    assert "ValueError: failed after 23 characters" in out and "in generate" in out
    assert "private prompt" not in out
