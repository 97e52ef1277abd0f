"""nodes.yaml and plan.yaml: clear errors naming the bad field; `pipeshard plan` writes a plan
and a topology; `pipeshard export --plan` exports the plan's ranges."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from pipeshard.cli import main
from pipeshard.errors import InvalidArgument
from pipeshard.planning.cost import Curve
from pipeshard.planning.nodes import load_nodes, parse_nodes
from pipeshard.planning.plan import Plan
from pipeshard.topology import Topology
from tests.exporter.tiny_models import tiny_model  # noqa: F401  (fixture)

GOOD = {"name": "a", "per_layer_ms": 1.0, "memory_bytes": 10**9}


@pytest.mark.parametrize(
    ("nodes", "field", "text"),
    [
        ([], "nodes", "is empty"),
        (None, "nodes", "is empty"),
        ({"name": "a"}, "nodes", "must be a list"),
        ([{**GOOD, "memory_bytes": 0}], "nodes[0].memory_bytes", "> 0"),
        ([GOOD, {**GOOD, "name": "b", "per_layer_ms": -1}], "nodes[1].per_layer_ms", ">= 0"),
        ([{**GOOD, "per_layer_ms": "fast"}], "nodes[0].per_layer_ms", "number of ms"),
        ([{**GOOD, "per_layer_ms": {1: 1.0, "1": 2.0}}], "nodes[0].per_layer_ms", "twice"),
        ([{k: v for k, v in GOOD.items() if k != "memory_bytes"}], "nodes[0].memory_bytes", "required"),
        ([{**GOOD, "cpu": "x"}], "nodes[0]", "unknown keys"),
        ([{**GOOD, "link_to_next": {"mbit": 0}}], "nodes[0].link_to_next.mbit", "> 0"),
        ([{**GOOD, "link_to_next": {"latency": 3}}], "nodes[0].link_to_next", "unknown keys"),
        ([GOOD, GOOD], "nodes[1].name", "earlier node"),
        ([{**GOOD, "reserve_bytes": 10**9}], "nodes[0].reserve_bytes", "leaves no memory"),
        ([{**GOOD, "profile": "missing.yaml"}], "nodes[0].profile", "no such file"),
        ([{**GOOD, "device": ""}], "nodes[0].device", "OpenVINO device"),
    ],
)
def test_bad_nodes_name_the_field(nodes, field, text, tmp_path):
    with pytest.raises(InvalidArgument, match=text) as info:
        parse_nodes(nodes, base=tmp_path)
    assert info.value.field == field


def test_profile_file_fills_a_node_and_fields_given_win(tmp_path):
    profile = {
        "name": "box",
        "address": "10.0.0.2:50061",
        "per_layer_ms": {1: 0.5, 4: 1.1},
        "head_ms": {1: 2.0, 4: 3.0},
        "memory_bytes": 5 * 10**9,
        "device": "GPU.1",
        "measured": {"decode": []},
    }
    (tmp_path / "box.yaml").write_text(yaml.safe_dump(profile))
    (tmp_path / "nodes.yaml").write_text(
        yaml.safe_dump([{"profile": "box.yaml", "memory_bytes": 10**9, "link_to_next": {"mbit": 100}}])
    )
    [node] = load_nodes(tmp_path / "nodes.yaml")
    assert node.name == "box" and node.address == "10.0.0.2:50061" and node.device == "GPU.1"
    assert node.memory_bytes == 10**9  # the nodes.yaml entry wins over the profile
    assert node.per_layer_ms == Curve(((1, 0.5), (4, 1.1)))
    assert node.per_layer_ms.at(2) == pytest.approx(0.7) and node.per_layer_ms.at(8) == pytest.approx(1.9)
    assert node.link_to_next.mbit == 100 and node.link_to_next.rtt_ms == 0
    assert math.isinf(parse_nodes([GOOD])[0].link_to_next.mbit)
    assert parse_nodes([GOOD])[0].device == "CPU"


def _tiny_config(folder, layers=6):
    folder.mkdir()
    config = {
        "model_type": "llama",
        "num_hidden_layers": layers,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 256,
        "max_position_embeddings": 128,
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_plan_cli_writes_plan_and_topology(tmp_path, capsys):
    model = _tiny_config(tmp_path / "tiny")
    nodes = [
        {"name": "a", "address": "10.0.0.1:7001", "per_layer_ms": 0.5, "memory_bytes": 10**9},
        {
            "name": "b",
            "address": "10.0.0.2:7002",
            "per_layer_ms": 1.0,
            "memory_bytes": 10**9,
            "device": "GPU",
        },
    ]
    # a is faster, but its memory holds only two layers with the embedding and their KV cache
    from pipeshard.planning.cli import model_cost

    cost = model_cost(model, "fp32", None)
    nodes[0]["memory_bytes"] = cost.stage_bytes(0, 2, 1)
    (tmp_path / "nodes.yaml").write_text(yaml.safe_dump(nodes))
    argv = ["plan", "--nodes", str(tmp_path / "nodes.yaml"), "--model", str(model), "--weights", "fp32"]
    argv += ["--out", str(tmp_path / "plan.yaml"), "--topology", str(tmp_path / "topology.yaml")]
    argv += ["--coordinator", "10.0.0.9", "--exporter", "10.0.0.8:7100"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "pipeshard export --split 0:2,2:6" in out and "predicted" in out
    plan = Plan.load(tmp_path / "plan.yaml")
    assert plan.split == [2, 4] and plan.ranges == "0:2,2:6"
    topo = Topology.load(tmp_path / "topology.yaml")
    assert topo.stage_addresses() == ["10.0.0.1:7001", "10.0.0.2:7002"]
    assert topo.stages[1].metrics_port == 7002 - 50000 + 9100
    assert [s.device for s in topo.stages] == ["CPU", "GPU"]  # each node's device reaches its stage
    assert (topo.coordinator.address, topo.coordinator.metrics_port) == ("10.0.0.9:50051", 9151)
    assert (topo.exporter.address, topo.exporter.metrics_port) == ("10.0.0.8:7100", 7100 - 50000 + 9100)


def test_plan_cli_reports_infeasible_memory(tmp_path, capsys):
    model = _tiny_config(tmp_path / "tiny")
    (tmp_path / "nodes.yaml").write_text(yaml.safe_dump([{**GOOD, "memory_bytes": 1000}]))
    assert main(["plan", "--nodes", str(tmp_path / "nodes.yaml"), "--model", str(model)]) == 2
    assert "memory constraint" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("edit", "text"),
    [
        (lambda raw: raw["stages"][1].update(layer_start=3), "contiguous"),
        (lambda raw: raw.update(num_layers=7), "does not cover"),
        (lambda raw: raw.pop("stages"), "malformed"),
    ],
)
def test_bad_plan_file(edit, text, tmp_path):
    raw = {
        "model": "m",
        "num_layers": 6,
        "objective": "latency",
        "batch": 1,
        "micro_batches": 1,
        "round_ms": 1.0,
        "tok_s": 1000.0,
        "stages": [
            {
                "node": n,
                "address": "",
                "layer_start": a,
                "layer_end": b,
                "step_ms": 1.0,
                "tok_s": 1.0,
                "memory_bytes": 1,
            }
            for n, a, b in (("a", 0, 2), ("b", 2, 6))
        ],
    }
    edit(raw)
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(InvalidArgument, match=text) as info:
        Plan.load(tmp_path / "plan.yaml")
    assert info.value.field == "plan"


def test_export_takes_a_plan(tiny_model, tmp_path):  # noqa: F811
    folder, _ = tiny_model("llama")
    (tmp_path / "nodes.yaml").write_text(
        yaml.safe_dump(
            [{**GOOD, "per_layer_ms": 1.0, "name": "a"}, {**GOOD, "name": "b", "per_layer_ms": 3.0}]
        )
    )
    # both nodes are needed only when the first cannot hold the LM head: give it room for 3 layers
    from pipeshard.planning.cli import model_cost

    cost = model_cost(folder, "fp32", None)
    nodes = yaml.safe_load((tmp_path / "nodes.yaml").read_text())
    nodes[0]["memory_bytes"] = cost.stage_bytes(0, 3, 1)
    (tmp_path / "nodes.yaml").write_text(yaml.safe_dump(nodes))
    plan_file = tmp_path / "plan.yaml"
    argv = ["plan", "--nodes", str(tmp_path / "nodes.yaml"), "--model", str(folder), "--weights", "fp32"]
    assert main([*argv, "--out", str(plan_file)]) == 0
    assert Plan.load(plan_file).ranges == "0:3,3:4"
    out = tmp_path / "export"
    argv = [
        "export",
        "--model",
        str(folder),
        "--plan",
        str(plan_file),
        "--weights",
        "fp32",
        "--out",
        str(out),
    ]
    assert main([*argv, "--in-process", "--no-ov-tokenizer"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["split"] == [3, 1]
    bad = tmp_path / "other.yaml"
    raw = yaml.safe_load(plan_file.read_text())
    raw["num_layers"], raw["stages"][-1]["layer_end"] = 5, 5
    bad.write_text(yaml.safe_dump(raw))
    assert main(["export", "--model", str(folder), "--plan", str(bad), "--out", str(tmp_path / "x")]) == 2


def test_plan_cli_throughput_chooses_micro_batches(tmp_path, capsys):
    model = _tiny_config(tmp_path / "tiny")
    nodes = [{"name": k, "per_layer_ms": {1: 1.0, 4: 4.0}, "memory_bytes": 10**9} for k in "abc"]
    (tmp_path / "nodes.yaml").write_text(yaml.safe_dump(nodes))
    argv = [
        "plan",
        "--nodes",
        str(tmp_path / "nodes.yaml"),
        "--model",
        str(model),
        "--objective",
        "throughput",
    ]
    assert main([*argv, "--batch", "4", "--out", str(tmp_path / "plan.yaml")]) == 0
    plan = Plan.load(tmp_path / "plan.yaml")
    assert plan.objective == "throughput" and plan.batch == 4
    assert plan.split == [2, 2, 2] and plan.micro_batches in (2, 4)  # compute-bound rows: pipeline them
    assert "micro-batch" in capsys.readouterr().out
    assert main([*argv[:-2], "--batch", "4"]) == 2  # --batch with the latency objective is refused
    assert "`batch` applies to the throughput objective" in capsys.readouterr().err
