"""`pipeshard model list`: every family the exporter supports, with where its weights come from;
an unsupported architecture is refused with the supported ones named."""

from __future__ import annotations

import pytest

from pipeshard.cli import main
from pipeshard.errors import InvalidArgument
from pipeshard.exporter.families import FAMILIES, resolve_spec


def test_list_shows_every_family_and_its_sources(capsys):
    assert main(["model", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    rows = {line.split()[0]: line for line in lines}
    assert set(rows) == set(FAMILIES)
    assert "real weights: SmolLM2-135M-Instruct" in rows["llama"]
    assert "synthetic shapes: qwen3-0.6b, qwen3-8b" in rows["qwen3"] and "QK-norm" in rows["qwen3"]
    assert "phi-3-mini-4k" in rows["phi3"] and "fused qkv, gate-up" in rows["phi3"]
    assert "qwen3-30b-a3b" in rows["qwen3_moe"] and "routed experts" in rows["qwen3_moe"]
    assert "real weights: Gemma 3 270M" in rows["gemma3_text"] and "local/global" in rows["gemma3_text"]
    assert "real weights" not in rows["mistral"]


def test_an_unknown_architecture_is_refused_naming_the_supported_ones():
    with pytest.raises(InvalidArgument) as err:
        resolve_spec({"model_type": "gpt_neox", "hidden_size": 64})
    assert err.value.field == "model"
    assert "gpt_neox" in str(err.value)
    assert all(name in str(err.value) for name in FAMILIES)
