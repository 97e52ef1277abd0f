"""`pipeshard up --invariant-ladder` (`make up INVARIANT_LADDER=...`): the parser refuses an
unknown configuration before anything starts, and the ladder goes to every stage and into the
topology file, so a stage started from that file alone (`make run-stage`) tries it too; a file
without one (written before it existed) still loads, and one naming an unknown configuration is
refused naming the field."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml

from pipeshard.errors import InvalidArgument
from pipeshard.services import fleet_cli
from pipeshard.services.stage.main import StageSettings, resolve
from pipeshard.settings import load_settings
from pipeshard.topology import Topology


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
    monkeypatch.setattr(fleet_cli, "draft_watch_args", lambda shards, feature, choice: [])
    args = up_parser().parse_args(["up", "--precision", "invariant", "--invariant-ladder", given])
    with pytest.raises(RuntimeError, match="stop before"):
        fleet_cli.run_up(args)
    assert started["extra_stage_args"] == sent and started["precision"] == "invariant"
    assert Topology.load(tmp_path / fleet_cli.TOPOLOGY).invariant_ladder == given


def stage_settings(topology: Path, *flags: str) -> StageSettings:
    return resolve(load_settings(StageSettings, ["--topology", str(topology), "--stage", "1", *flags]))


def test_a_stage_started_from_the_topology_takes_its_ladder(tmp_path):
    path = tmp_path / "topology.yaml"
    Topology.loopback("shards/x", 2, invariant_ladder="bf16-kv16-single,exact").save(path)
    assert stage_settings(path).invariant_ladder == "bf16-kv16-single,exact"
    assert stage_settings(path, "--invariant-ladder", "exact").invariant_ladder == "exact"  # the flag wins


def test_a_topology_without_a_ladder_loads_and_an_unknown_one_is_refused(tmp_path):
    path = tmp_path / "topology.yaml"
    Topology.loopback("shards/x", 2).save(path)
    raw = yaml.safe_load(path.read_text())
    del raw["invariant_ladder"]  # a file written before the field existed
    path.write_text(yaml.safe_dump(raw))
    assert Topology.load(path).invariant_ladder == "" and stage_settings(path).invariant_ladder == ""
    raw["invariant_ladder"] = "bf16-kv16,turbo"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(InvalidArgument) as err:
        Topology.load(path)
    assert err.value.field == "invariant_ladder" and "turbo" in str(err.value)
