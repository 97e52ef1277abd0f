"""Typed settings: one dataclass per service; every field is a CLI flag and an environment variable.

A service declares its settings as a dataclass (extend :class:`ServerSettings` for servers)::

    @dataclass
    class StageSettings(ServerSettings):
        port: int = setting(50061, "gRPC port of this stage")
        shards: Path | None = setting(None, "export folder holding manifest.json")

    settings = load_settings(StageSettings, argv, prog="pipeshard-stage")

Field ``idle_timeout_s`` becomes flag ``--idle-timeout-s`` and environment variable
``PIPESHARD_IDLE_TIMEOUT_S``
(the prefix can be changed per class with ``env_prefix: ClassVar[str] = "PIPESHARD_STAGE_"``).
Precedence: flag > environment > default. Supported types: str, int, float, bool, Path, ``X | None``
(an empty value or ``none`` means None) and ``list[X]`` (comma-separated). Booleans accept
``--flag``, ``--no-flag``, ``--flag=false``; in the environment 1/0, true/false, yes/no, on/off.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

DEFAULT_ENV_PREFIX = "PIPESHARD_"
MIB = 1024 * 1024

_TRUE = frozenset({"1", "true", "yes", "on", "y", "t"})
_FALSE = frozenset({"0", "false", "no", "off", "n", "f"})
_TYPE_WORDS = {int: "an integer", float: "a number", bool: "a boolean (true/false)", str: "a string"}


class SettingsError(ValueError):
    """A value that cannot be converted to its field's type (the message says what was expected)."""


def setting(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    choices: Sequence[Any] | None = None,
    default_factory: Callable[[], Any] | Any = dataclasses.MISSING,
) -> Any:
    """A dataclass field with a help string (and optional allowed values) for :func:`load_settings`."""
    metadata = {"help": help, "choices": tuple(choices) if choices is not None else None}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def env_name(field_name: str, prefix: str = DEFAULT_ENV_PREFIX) -> str:
    return prefix + field_name.upper()


# ---------------------------------------------------------------- conversion


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """``X | None`` -> (X, True); anything else -> (tp, False)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
        raise TypeError(f"unsupported settings type {tp!r}")
    return tp, False


def parse_bool(text: str) -> bool:
    word = text.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise SettingsError(f"expected a boolean (true/false, 1/0, yes/no, on/off), got {text!r}")


def _scalar(tp: Any, text: str) -> Any:
    if tp is bool:
        return parse_bool(text)
    if tp in (int, float):
        try:
            return tp(text.strip())
        except ValueError:
            raise SettingsError(f"expected {_TYPE_WORDS[tp]}, got {text!r}") from None
    if tp is str:
        return text
    if isinstance(tp, type) and issubclass(tp, Path):
        return tp(text).expanduser()
    raise TypeError(f"unsupported settings type {tp!r}")


def convert(tp: Any, text: str) -> Any:
    """Converts one textual value (from a flag or the environment) to ``tp``; raises SettingsError."""
    inner, optional = _unwrap_optional(tp)
    if optional and text.strip().lower() in ("", "none", "null"):
        return None
    if typing.get_origin(inner) is list:
        (item_type,) = typing.get_args(inner) or (str,)
        return [_scalar(item_type, part.strip()) for part in text.split(",") if part.strip()]
    return _scalar(inner, text)


# ---------------------------------------------------------------- parser


@dataclass(frozen=True)
class _Field:
    name: str
    type: Any
    help: str
    choices: tuple[Any, ...] | None
    default: Any  # dataclasses.MISSING when the field is required

    @property
    def is_bool(self) -> bool:
        return _unwrap_optional(self.type)[0] is bool

    def convert(self, text: str) -> Any:
        value = convert(self.type, text)
        if self.choices and isinstance(value, str) and value not in self.choices:
            value = value.lower() if value.lower() in self.choices else value  # INFO -> info
        return value


def _fields(cls: type) -> list[_Field]:
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = dataclasses.MISSING
        out.append(
            _Field(f.name, hints[f.name], f.metadata.get("help", ""), f.metadata.get("choices"), default)
        )
    return out


def _env_prefix(cls: type, env_prefix: str | None) -> str:
    return env_prefix if env_prefix is not None else getattr(cls, "env_prefix", DEFAULT_ENV_PREFIX)


def build_parser(
    cls: type, prog: str | None = None, env_prefix: str | None = None
) -> argparse.ArgumentParser:
    """The argparse parser for a settings dataclass (absent flags are left out of the namespace)."""
    prefix = _env_prefix(cls, env_prefix)
    doc = (cls.__doc__ or "").strip()
    if doc.startswith(cls.__name__ + "("):  # the signature dataclass() puts there, not a description
        doc = ""
    parser = argparse.ArgumentParser(
        prog=prog, description=doc.splitlines()[0] if doc else None, argument_default=argparse.SUPPRESS
    )
    for f in _fields(cls):

        def to_value(text: str, _f: _Field = f) -> Any:
            try:
                return _f.convert(text)
            except SettingsError as exc:
                raise argparse.ArgumentTypeError(str(exc)) from None

        shown = "required" if f.default is dataclasses.MISSING else f"default: {f.default!r}"
        help_text = f"{f.help} [env {env_name(f.name, prefix)}; {shown}]".strip()
        if f.is_bool:
            parser.add_argument(
                flag_name(f.name),
                dest=f.name,
                nargs="?",
                const=True,
                type=to_value,
                metavar="BOOL",
                help=help_text,
            )
            parser.add_argument(
                "--no-" + f.name.replace("_", "-"), dest=f.name, action="store_false", help=argparse.SUPPRESS
            )
        else:
            parser.add_argument(
                flag_name(f.name),
                dest=f.name,
                type=to_value,
                choices=f.choices,
                metavar=None if f.choices else f.name.upper(),
                help=help_text,
            )
    return parser


def load_settings(
    cls: type[T],
    argv: Sequence[str] | None = None,
    env: Mapping[str, str] | None = None,
    prog: str | None = None,
    env_prefix: str | None = None,
) -> T:
    """Builds ``cls`` from flags (``argv``, default ``sys.argv[1:]``), then ``env``, then defaults.

    Bad values exit with status 2 and a message naming the flag or environment variable
    (argparse behaviour), e.g. ``argument --port: expected an integer, got 'abc'``.
    """
    env = os.environ if env is None else env
    argv = sys.argv[1:] if argv is None else list(argv)
    prefix = _env_prefix(cls, env_prefix)
    parser = build_parser(cls, prog=prog, env_prefix=prefix)
    namespace = vars(parser.parse_args(argv))
    values: dict[str, Any] = {}
    for f in _fields(cls):
        var = env_name(f.name, prefix)
        if f.name in namespace:
            values[f.name] = namespace[f.name]
        elif var in env:
            try:
                value = f.convert(env[var])
            except SettingsError as exc:
                parser.error(f"environment variable {var} (flag {flag_name(f.name)}): {exc}")
            if f.choices is not None and value not in f.choices:
                choices = ", ".join(map(repr, f.choices))
                parser.error(f"environment variable {var}: invalid choice {value!r} (choose from {choices})")
            values[f.name] = value
        elif f.default is dataclasses.MISSING:
            parser.error(f"{flag_name(f.name)} is required (or set {var})")
    return cls(**values)


# ---------------------------------------------------------------- the common server fields


LOOPBACK = "127.0.0.1"  # the default listening address; a topology's host replaces it


@dataclass
class ServerSettings:
    """Settings every gRPC server shares; services subclass this and override defaults (e.g. port)."""

    host: str = setting(LOOPBACK, "address to listen on")
    port: int | None = setting(0, "gRPC port (0 = an ephemeral port, printed at start)")
    metrics_port: int | None = setting(0, "Prometheus /metrics port (0 = disabled)")
    metrics_host: str = setting(
        "127.0.0.1", "address /metrics listens on: loopback unless told (it is plaintext and unauthenticated)"
    )
    log_format: str = setting("json", "log line format", choices=("json", "console"))
    log_level: str = setting("info", "log level", choices=("debug", "info", "warning", "error", "critical"))
    grace_seconds: float = setting(10.0, "on SIGTERM/SIGINT, time in-flight calls get to finish")
    max_message_bytes: int = setting(64 * MIB, "largest gRPC message sent or received, in bytes")
    keepalive_time_ms: int = setting(30_000, "interval of keepalive pings the server sends, in ms")
    keepalive_timeout_ms: int = setting(10_000, "time to wait for a keepalive ack before closing, in ms")
    tls_dir: Path | None = setting(
        None, "fleet certificates from `pipeshard certs`; set, every link is TLS (stages: mutual TLS)"
    )
    tls_name: str = setting(
        "", "this node's certificate name in tls_dir (default: stageK, coordinator, exporter)"
    )
    token: str | None = setting(
        None,
        "token clients of the coordinator and exporter must present (a stage shows it to the exporter)",
    )
    api_keys: Path | None = setting(
        None,
        "key file of `pipeshard keys` (re-read when it changes): clients of the coordinator and "
        "exporter may present any listed key instead of the token, each key its own identity",
    )
    allow_plaintext: bool = setting(False, "listen without TLS on an address other than loopback")
    allow_anonymous: bool = setting(
        False,
        "coordinator and exporter: serve TLS without --token or --api-keys (anyone who reaches the "
        "port may call; logged as a warning); refused at start otherwise",
    )

    def __post_init__(self) -> None:
        # A host's bundle from `pipeshard certs --topology` holds the fleet token beside the
        # certificates: with --tls-dir set and no token given, that one.
        if self.token is None and self.tls_dir is not None:
            stored = Path(self.tls_dir) / "token"
            if stored.is_file():
                self.token = stored.read_text().strip() or None
