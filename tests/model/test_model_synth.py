"""`pipeshard model synth`: published shapes, seeded tensor-by-tensor weights, the padded vocabulary."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors import safe_open

from pipeshard import paths
from pipeshard.errors import InvalidArgument
from pipeshard.model.shapes import SHAPES, get_shape
from pipeshard.model.synth import config_json, make_tensor, plan_shards, synthesize, tensor_specs

# Parameter counts as published (model cards), in billions, to two decimals.
PUBLISHED_PARAMS = {"llama-3.2-3b": 3.21, "llama-3.1-8b": 8.03, "qwen2.5-3b": 3.09, "mistral-7b": 7.25}
# Model cards that give one decimal only.
PUBLISHED_PARAMS_1 = {"qwen3-0.6b": 0.6, "qwen3-8b": 8.2, "phi-3-mini-4k": 3.8, "qwen3-30b-a3b": 30.5}


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_published_shapes_have_published_parameter_counts(name):
    shape = get_shape(name)
    assert round(shape.params / 1e9, 2) == PUBLISHED_PARAMS[name]
    assert sum(torch.Size(s.shape).numel() for s in tensor_specs(shape)) == shape.params


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS_1))
def test_new_family_shapes_have_published_counts_and_hf_tensor_names(name):
    """Qwen3's QK-norms, Phi-3's fused matrices, Qwen3-MoE's experts: the names and shapes HF's
    own class has."""
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = get_shape(name)
    assert round(shape.params / 1e9, 1) == PUBLISHED_PARAMS_1[name]
    assert sum(torch.Size(s.shape).numel() for s in tensor_specs(shape)) == shape.params
    small = shape.with_layers(2)
    config = config_json(small, 0, 1, 2)
    hf_config = AutoConfig.for_model(config.pop("model_type"), **config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    hf = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if small.tie_word_embeddings:
        hf.pop("lm_head.weight")
    assert {s.name: s.shape for s in tensor_specs(small)} == hf


def test_unknown_shape_and_layers_are_refused():
    with pytest.raises(InvalidArgument, match="like"):
        get_shape("gpt-5")
    with pytest.raises(InvalidArgument, match="layers"):
        SHAPES["mistral-7b"].with_layers(33)


def test_tensors_depend_on_seed_and_name_not_on_sharding():
    spec = tensor_specs(get_shape("test-llama3"))[2]
    a, b, c = make_tensor(spec, 1, 10), make_tensor(spec, 1, 10), make_tensor(spec, 2, 10)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert 0.015 < a.float().std().item() < 0.025
    specs = tensor_specs(get_shape("test-llama3"))
    small = plan_shards(specs, limit=20_000)
    assert len(small) > 1 and [s for g in small for s in g] == specs
    assert len(plan_shards(specs)) == 1


@pytest.fixture(scope="module")
def synth_folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("synth") / "m"
    return synthesize(get_shape("test-llama3").with_layers(2), out, seed=3, progress=lambda _: None)


def test_folder_is_marked_sharded_and_padded(synth_folder):
    config = json.loads((synth_folder / "config.json").read_text())
    assert config["pipeshard_synthetic"] is True
    assert config["num_hidden_layers"] == 2 and config["vocab_size"] == 50000
    assert config["rope_scaling"]["rope_type"] == "llama3"
    index = json.loads((synth_folder / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {s.name for s in tensor_specs(get_shape("test-llama3").with_layers(2))}
    tok = json.loads((synth_folder / "tokenizer.json").read_text())
    vocab = max(tok["model"]["vocab"].values()) + 1
    with safe_open(str(synth_folder / index["weight_map"]["lm_head.weight"]), "pt") as f:
        head = f.get_tensor("lm_head.weight")
    assert head.dtype == torch.bfloat16 and head.shape == (50000, 64)
    assert torch.count_nonzero(head[vocab:]) == 0 and torch.count_nonzero(head[:vocab]) > 0


def test_existing_folder_is_not_replaced_without_force(synth_folder):
    from pipeshard.errors import FailedPrecondition

    with pytest.raises(FailedPrecondition, match="exists"):
        synthesize(get_shape("test-llama3"), synth_folder)


def test_a_vocabulary_smaller_than_the_tokenizers_cuts_the_tokenizer_to_it(tmp_path):
    from transformers import AutoTokenizer

    shape = replace(get_shape("test-llama3").with_layers(1), vocab_size=1000)
    folder = synthesize(shape, tmp_path / "m", progress=lambda _: None)
    text = "The history of the printing press begins, Ünïcödé 🤗 1234567"
    bundled = AutoTokenizer.from_pretrained(paths.default_model_dir())
    assert max(bundled(text)["input_ids"]) >= 1000  # the uncut tokenizer would give ids the model lacks
    cut = AutoTokenizer.from_pretrained(folder)
    ids = cut(text)["input_ids"]
    assert len(cut) == 1000 and max(ids) < 1000 and cut.decode(ids) == text
    assert not (folder / "vocab.json").exists()  # no slow tokenizer that would disagree
