"""`pipeshard up --invariant-ladder` (`make up INVARIANT_LADDER=...`): the parser refuses an
unknown configuration before anything starts, and the ladder goes to every stage."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pipeshard.services import fleet_cli


def up_parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser()
    fleet_cli.register(root.add_subparsers())
    return root


def test_an_unknown_configuration_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        up_parser().parse_args(["up", "--invariant-ladder", "bf16-kv16,turbo"])
    err = capsys.readouterr().err
    assert "--invariant-ladder" in err and "turbo" in err


@pytest.mark.parametrize(
    "given, sent", [("f32-kv16,exact", ["--invariant-ladder", "f32-kv16,exact"]), ("", [])]
)
def test_the_ladder_goes_to_every_stage(given, sent, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    started: dict = {}

    def start_fleet(shards, stages, run_dir, **kwargs):
        started.update(kwargs)
        raise RuntimeError("stop before anything starts")

    monkeypatch.setattr(fleet_cli, "ensure_shards", lambda model, stages, weights: Path("shards"))
    monkeypatch.setattr(fleet_cli, "start_fleet", start_fleet)
    monkeypatch.setattr(fleet_cli, "feature_draft_args", lambda shards, choice: [])
    monkeypatch.setattr(fleet_cli, "draft_heads_args", lambda shards, choice: [])
    args = up_parser().parse_args(["up", "--precision", "invariant", "--invariant-ladder", given])
    with pytest.raises(RuntimeError, match="stop before"):
        fleet_cli.run_up(args)
    assert started["extra_stage_args"] == sent and started["precision"] == "invariant"
