"""Bad export requests fail fast with InvalidArgument naming the field; shards are verified."""

from __future__ import annotations

import argparse
import json
import shutil

import pytest

from pipeshard.errors import FailedPrecondition, InvalidArgument, NotFound
from pipeshard.exporter.compress import choose_group_size, make_plan
from pipeshard.exporter.export import default_split, export_model, resolve_split
from pipeshard.exporter.families import get_family, resolve_spec
from pipeshard.shard.manifest import load_manifest, verify_export, verify_shard


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"stages": 5}, "stages"),
        ({"stages": 0}, "stages"),
        ({}, "stages"),
        ({"split": [2, 1]}, "split"),
        ({"split": [2, 2, 0]}, "split"),
        ({"split": "2,x"}, "split"),
        ({"split": "0:2,3:4"}, "split"),
        ({"split": "0:2,2:2,2:4"}, "split"),
        ({"split": "0:2,2:3"}, "split"),
        ({"split": "0:1,1:x"}, "split"),
        ({"stages": 3, "split": [2, 2]}, "stages"),
        ({"stages": 2, "weights": "int3"}, "weights"),
        ({"stages": 2, "weights": "int4", "group_size": 48}, "group_size"),
        ({"stages": 2, "weights": "int4", "group_size": "big"}, "group_size"),
        ({"stages": 2, "weights": "fp16", "group_size": 32}, "group_size"),
        ({"stages": 2, "max_context": 4096}, "max_context"),
        ({"stages": 2, "max_context": 0}, "max_context"),
        ({"stages": 2, "head_precision": "int2"}, "head_precision"),
    ],
)
def test_bad_request_names_field(kwargs, field, tiny_model, tmp_path):
    folder, _ = tiny_model("llama")
    with pytest.raises(InvalidArgument) as err:
        export_model(folder, tmp_path / "out", isolate=False, **kwargs)
    assert err.value.field == field, str(err.value)
    assert not (tmp_path / "out").exists()


def test_unsupported_family(tmp_path):
    with pytest.raises(InvalidArgument) as err:
        get_family("gpt2")
    assert err.value.field == "model"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_neox"}))
    with pytest.raises(InvalidArgument) as err:
        export_model(tmp_path, tmp_path / "out", stages=1, isolate=False)
    assert err.value.field == "model"


def test_not_a_model_folder(tmp_path):
    with pytest.raises(InvalidArgument) as err:
        export_model(tmp_path, tmp_path / "out", stages=1, isolate=False)
    assert err.value.field == "model"


def test_existing_output_needs_force(tiny_model, tiny_export, tmp_path):
    folder, _ = tiny_model("llama")
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(FailedPrecondition, match="--force"):
        export_model(folder, out, stages=1, weights="fp32", isolate=False)


def test_group_size_choice():
    assert choose_group_size([576, 1536]) == 64  # SmolLM2: 576 is not a multiple of 128
    assert choose_group_size([4096, 11008]) == 128
    assert choose_group_size([64, 96]) == 32
    assert choose_group_size([576, 1536], 32) == 32
    with pytest.raises(InvalidArgument) as err:
        choose_group_size([576, 1536], 128)
    assert err.value.field == "group_size"
    with pytest.raises(InvalidArgument):
        choose_group_size([40, 60])


def test_plan_for_smollm2_like_config():
    spec = resolve_spec(
        {
            "model_type": "llama",
            "num_hidden_layers": 30,
            "hidden_size": 576,
            "intermediate_size": 1536,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "vocab_size": 49152,
            "tie_word_embeddings": True,
        }
    )
    plan = make_plan(spec, "int4")
    assert plan.group_size == 64
    assert plan.to_json() == {
        "format": "int4",
        "group_size": 64,
        "mode": "int4_sym",
        "embedding_and_lm_head": "int8",
    }
    assert make_plan(spec, "fp16").group_size is None


def test_split_defaults():
    assert default_split(30, 4) == [8, 8, 7, 7]
    assert default_split(30, 1) == [30]
    assert resolve_split(30, None, "10,10,10") == [10, 10, 10]
    assert resolve_split(30, 3, None) == [10, 10, 10]
    assert resolve_split(30, None, "0:12,12:20,20:30") == [12, 8, 10]
    assert resolve_split(30, 3, " 0:1, 1:29 ,29:30") == [1, 28, 1]


def test_selective_weights_from_sharded_index(tmp_path):
    """A sharded checkpoint (index file) loads, and a stage reads only its own tensors."""
    from pipeshard.exporter.families import load_config
    from pipeshard.exporter.weights import load_stage_weights, weight_files
    from tests.exporter.tiny_models import build_tiny

    build_tiny("llama", tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(weight_files(tmp_path)) > 1
    spec = resolve_spec(load_config(tmp_path))
    middle = load_stage_weights(tmp_path, spec, 1, 3)
    assert not any(k.startswith(("embed_tokens", "lm_head", "norm")) for k in middle)
    assert {k.split(".")[1] for k in middle if k.startswith("layers.")} == {"0", "1"}
    last = load_stage_weights(tmp_path, spec, 3, 4)
    assert {"lm_head.weight", "norm.weight"} <= set(last) and "embed_tokens.weight" not in last


def test_tied_head_reuses_embedding(tiny_model):
    from pipeshard.exporter.families import load_config
    from pipeshard.exporter.weights import load_stage_weights

    folder, _ = tiny_model("qwen2")
    spec = resolve_spec(load_config(folder))
    assert spec.tie_word_embeddings and spec.qkv_bias
    weights = load_stage_weights(folder, spec, 0, 4)
    assert weights["lm_head.weight"] is weights["embed_tokens.weight"]


def test_manifest_contents(tiny_export):
    export = tiny_export("llama", 2)
    m = verify_export(export).to_dict()
    assert m["num_stages"] == 2 and m["split"] == [2, 2]
    assert m["model"]["family"] == "llama" and m["model"]["fingerprint"].startswith("sha256:")
    assert m["export_id"].startswith("sha256:")
    assert m["max_context"] == 128  # min(max_position_embeddings, 4096)
    assert m["weights"]["format"] == "fp32" and m["beam_idx"] is True
    s0, s1 = m["stages"]
    assert (s0["layer_start"], s0["layer_end"], s1["layer_start"], s1["layer_end"]) == (0, 2, 2, 4)
    assert [p["name"] for p in s0["inputs"]] == ["input_ids", "attention_mask", "position_ids", "beam_idx"]
    assert [p["name"] for p in s1["inputs"]] == [
        "hidden_states",
        "attention_mask",
        "position_ids",
        "logits_to_keep",
        "beam_idx",
    ]
    assert s0["outputs"] == [{"name": "hidden_states", "shape": [-1, -1, 64], "dtype": "f32"}]
    assert s1["outputs"] == [{"name": "logits", "shape": [-1, -1, 256], "dtype": "f32"}]
    assert s1["state_variables"] == [
        "past_key_values.2.key",
        "past_key_values.2.value",
        "past_key_values.3.key",
        "past_key_values.3.value",
    ]
    for s in m["stages"]:
        assert s["kv_reorder"] == {"read_values": 4, "beam_idx_gathers": 4}
        assert s["export"]["peak_rss_bytes"] > 0
        assert s["model"] in m["files"]
    assert "config.json" in m["files"] and "manifest.json" not in m["files"]


def test_tampered_shard_fails_verification(tiny_export, tmp_path):
    from pipeshard.shard.runtime import ShardRunner

    export = tmp_path / "copy"
    shutil.copytree(tiny_export("llama", 2), export)
    verify_shard(export, 1)
    weights = export / "stage_1" / "openvino_model.bin"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    verify_shard(export, 0)  # the other stage is untouched
    with pytest.raises(FailedPrecondition, match=r"stage_1/openvino_model\.bin has sha256"):
        verify_shard(export, 1)
    with pytest.raises(FailedPrecondition):
        ShardRunner(export, 1)
    weights.write_bytes(bytes(data[:-4]))
    with pytest.raises(FailedPrecondition, match="bytes"):
        verify_shard(export, 1, hashes=False)
    weights.unlink()
    with pytest.raises(FailedPrecondition, match="missing"):
        verify_shard(export, 1)
    with pytest.raises(InvalidArgument) as err:
        verify_shard(export, 2)
    assert err.value.field == "stage"


def test_missing_manifest(tmp_path):
    with pytest.raises(NotFound):
        load_manifest(tmp_path)


def test_interrupted_export_leaves_nothing(tiny_model, tmp_path, monkeypatch):
    import pipeshard.exporter.export as ex

    real = ex.export_stage

    def failing(job, progress):
        if job.index == 1:
            raise KeyboardInterrupt
        return real(job, progress)

    monkeypatch.setattr(ex, "export_stage", failing)
    folder, _ = tiny_model("llama")
    out = tmp_path / "shards" / "tiny-2s"
    with pytest.raises(KeyboardInterrupt):
        export_model(folder, out, stages=2, weights="fp32", isolate=False, progress=lambda e: None)
    assert not out.exists()
    assert list((tmp_path / "shards").iterdir()) == []


def test_cli_reports_bad_stages(tiny_model, capsys):
    from pipeshard.exporter import cli

    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command"))
    folder, _ = tiny_model("llama")
    args = parser.parse_args(["export", "--model", str(folder), "--stages", "9", "--weights", "fp32"])
    assert args.func(args) == 2
    assert "`stages` is 9" in capsys.readouterr().err


def test_cli_export_in_subprocess(tiny_model, tmp_path, capsys):
    """The CLI path: per-stage subprocess export (peak RSS measured there), then a local generate."""
    from pipeshard.exporter import cli

    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command"))
    folder, _ = tiny_model("mistral")
    out = tmp_path / "mistral-2s"
    args = parser.parse_args(
        [
            "export",
            "--model",
            str(folder),
            "--split",
            "3,1",
            "--weights",
            "fp16",
            "--out",
            str(out),
            "--max-context",
            "64",
        ]
    )
    assert args.func(args) == 0
    assert "peak RSS" in capsys.readouterr().out
    m = verify_export(out).to_dict()
    assert m["split"] == [3, 1] and m["max_context"] == 64 and m["weights"]["format"] == "fp16"
    assert all(s["export"]["rss_scope"] == "subprocess" for s in m["stages"])
