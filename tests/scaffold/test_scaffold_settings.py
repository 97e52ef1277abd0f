"""Typed settings: flag > environment > default, conversions, and errors that name the flag/env var.

(RUF009 flags ``setting(...)`` for non-scalar annotations; it returns a dataclasses.field, so the
``noqa`` is safe. Adding ``pipeshard.settings.setting`` to ruff's
``lint.flake8-bugbear.extend-immutable-calls`` would make it unnecessary.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pipeshard.settings import MIB, ServerSettings, load_settings, setting


@dataclass
class DemoSettings(ServerSettings):
    """Demo service settings."""

    port: int = setting(50061, "gRPC port")
    shard_dir: Path = setting(Path("shards/demo"), "shard folder")
    reuse: bool = setting(False, "reuse sessions")
    ratio: float = setting(0.5, "a ratio")
    next_hop: str | None = setting(None, "next stage address")
    stages: list[str] = setting(help="stage addresses", default_factory=list)
    plain: int = field(default=3)  # no help metadata: still a flag


def test_defaults_when_nothing_is_given():
    s = load_settings(DemoSettings, [], env={})
    assert s == DemoSettings()
    assert (s.host, s.port, s.metrics_port, s.log_format, s.grace_seconds) == (
        "127.0.0.1",
        50061,
        0,
        "json",
        10.0,
    )
    assert s.max_message_bytes == 64 * MIB
    assert s.shard_dir == Path("shards/demo") and s.next_hop is None and s.stages == []


def test_flag_beats_env_beats_default():
    env = {"PIPESHARD_PORT": "7000", "PIPESHARD_RATIO": "0.25", "PIPESHARD_SHARD_DIR": "/tmp/env-shards"}
    s = load_settings(DemoSettings, ["--port", "8000"], env=env)
    assert s.port == 8000  # flag over env
    assert s.ratio == 0.25  # env over default
    assert s.shard_dir == Path("/tmp/env-shards")
    assert s.grace_seconds == 10.0  # default
    assert s.plain == 3


def test_types_convert():
    s = load_settings(
        DemoSettings,
        ["--shard-dir=/x/y", "--next-hop", "10.0.0.2:50062", "--stages", "a:1, b:2", "--plain", "9"],
        env={"PIPESHARD_GRACE_SECONDS": "2.5", "PIPESHARD_MAX_MESSAGE_BYTES": "1024"},
    )
    assert s.shard_dir == Path("/x/y") and isinstance(s.shard_dir, Path)
    assert s.next_hop == "10.0.0.2:50062"
    assert s.stages == ["a:1", "b:2"]
    assert s.plain == 9 and s.grace_seconds == 2.5 and s.max_message_bytes == 1024


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        (["--reuse"], {}, True),
        (["--reuse", "false"], {}, False),
        (["--reuse=yes"], {}, True),
        (["--no-reuse"], {"PIPESHARD_REUSE": "true"}, False),
        ([], {"PIPESHARD_REUSE": "1"}, True),
        ([], {"PIPESHARD_REUSE": "Off"}, False),
        ([], {"PIPESHARD_REUSE": "TRUE"}, True),
        ([], {}, False),
    ],
)
def test_bool_parsing(argv, env, expected):
    assert load_settings(DemoSettings, argv, env=env).reuse is expected


def test_optional_can_be_reset_to_none_from_env():
    assert load_settings(DemoSettings, [], env={"PIPESHARD_NEXT_HOP": ""}).next_hop is None


def test_bad_int_flag_names_the_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_settings(DemoSettings, ["--port", "abc"], env={}, prog="demo")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --port: expected an integer, got 'abc'" in err


def test_bad_env_value_names_the_env_var_and_flag(capsys):
    with pytest.raises(SystemExit):
        load_settings(DemoSettings, [], env={"PIPESHARD_METRICS_PORT": "91OO"}, prog="demo")
    err = capsys.readouterr().err
    assert "environment variable PIPESHARD_METRICS_PORT (flag --metrics-port)" in err
    assert "expected an integer, got '91OO'" in err


def test_bad_bool_and_bad_choice(capsys):
    with pytest.raises(SystemExit):
        load_settings(DemoSettings, [], env={"PIPESHARD_REUSE": "maybe"})
    assert "PIPESHARD_REUSE" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        load_settings(DemoSettings, ["--log-format", "xml"], env={})
    assert "argument --log-format: invalid choice: 'xml'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        load_settings(DemoSettings, [], env={"PIPESHARD_LOG_FORMAT": "xml"})
    assert "environment variable PIPESHARD_LOG_FORMAT: invalid choice 'xml'" in capsys.readouterr().err


def test_choices_are_case_insensitive():
    s = load_settings(DemoSettings, ["--log-format", "JSON"], env={"PIPESHARD_LOG_LEVEL": "DEBUG"})
    assert (s.log_format, s.log_level) == ("json", "debug")


def test_help_lists_flag_env_and_default(capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_settings(DemoSettings, ["--help"], env={}, prog="demo")
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--grace-seconds" in out and "PIPESHARD_GRACE_SECONDS" in out and "default: 10.0" in out


def test_required_field_and_env_prefix(capsys):
    @dataclass
    class Needs:
        env_prefix = "PIPESHARD_STAGE_"  # a class attribute, not a field
        shard: Path = setting(help="shard folder")
        port: int = setting(1, "port")

    assert load_settings(Needs, [], env={"PIPESHARD_STAGE_SHARD": "/s"}).shard == Path("/s")
    assert load_settings(Needs, [], env={"PIPESHARD_STAGE_SHARD": "/s", "PIPESHARD_PORT": "5"}).port == 1
    with pytest.raises(SystemExit):
        load_settings(Needs, [], env={})
    assert "--shard is required (or set PIPESHARD_STAGE_SHARD)" in capsys.readouterr().err
