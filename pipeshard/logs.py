"""Logging: structlog, one JSON object per line by default, a console renderer on request.

Call :func:`configure_logging` once at process start. Anything bound with
``structlog.contextvars.bind_contextvars(session_id=..., stage=...)`` (the gRPC interceptor binds
``request_id`` and ``rpc`` per call) appears in every line logged in that context. Records from the
standard ``logging`` module (grpc, libraries) go through the same renderer.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import IO, Any

import structlog

FORMATS = ("json", "console")


def _static_fields(fields: dict[str, Any]) -> structlog.typing.Processor:
    def add(_logger: Any, _method: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        for key, value in fields.items():
            event_dict.setdefault(key, value)
        return event_dict

    return add


def configure_logging(
    fmt: str = "json",
    level: str | int = "info",
    service: str | None = None,
    *,
    stream: IO[str] | None = None,
    **bound: Any,
) -> None:
    """Configures structlog and the stdlib root logger; ``service`` and ``bound`` go on every line.

    ``fmt`` is "json" (default) or "console"; ``stream`` defaults to stderr. Safe to call again
    (later calls replace the configuration).
    """
    if fmt not in FORMATS:
        raise ValueError(f"`log_format` must be one of {FORMATS}, got {fmt!r}")
    numeric_level = level if isinstance(level, int) else logging.getLevelName(level.upper())
    if not isinstance(numeric_level, int):
        raise ValueError(f"`log_level` must be a logging level name, got {level!r}")

    static = {"service": service, **bound} if service is not None else dict(bound)
    shared: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _static_fields(static),
        structlog.stdlib.PositionalArgumentsFormatter(),
        structlog.processors.StackInfoRenderer(),
    ]
    if fmt == "json":
        final: list[structlog.typing.Processor] = [
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(default=str),
        ]
    else:
        # Plain tracebacks: the default (rich's) prints every frame's locals, prompts among them.
        final = [
            structlog.dev.ConsoleRenderer(colors=False, exception_formatter=structlog.dev.plain_traceback)
        ]

    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *shared,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        # Not cached: configure_logging may run again (tests, CLI) and must take effect everywhere.
        cache_logger_on_first_use=False,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *final],
    )
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in list(root.handlers):
        if getattr(old, "_pipeshard", False):
            root.removeHandler(old)
    handler._pipeshard = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(numeric_level)


def get_logger(name: str | None = None, **initial: Any) -> structlog.stdlib.BoundLogger:
    """A structlog logger (``name`` shows as ``logger`` in each line)."""
    return structlog.get_logger(name, **initial)
