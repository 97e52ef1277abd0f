"""Llama 3.x rope scaling (``rope_type: llama3``): a synthetic model exported in two stages gives
the logits transformers gives, teacher-forced, at positions past the original context."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pipeshard.exporter.families import resolve_spec
from pipeshard.exporter.rope import inv_freq
from pipeshard.model.shapes import get_shape
from pipeshard.model.synth import synthesize
from pipeshard.shard.manifest import load_manifest
from pipeshard.shard.runtime import ShardRunner

TOKENS = 96  # past the test shape's original_max_position_embeddings (64)


@pytest.fixture(scope="module")
def llama3_model(tmp_path_factory):
    return synthesize(
        get_shape("test-llama3"), tmp_path_factory.mktemp("l3") / "m", seed=5, progress=lambda _: None
    )


def test_inv_freq_matches_transformers_llama3(llama3_model):
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = json.loads((llama3_model / "config.json").read_text())
    spec = resolve_spec(config)
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](AutoConfig.from_pretrained(llama3_model), "cpu")
    plain = resolve_spec({**config, "rope_scaling": None})
    assert not torch.allclose(inv_freq(plain), want)  # the scaling changes something here
    torch.testing.assert_close(inv_freq(spec), want.float(), rtol=1e-6, atol=0)


def test_two_stage_export_matches_transformers(llama3_model, tmp_path):
    from transformers import AutoModelForCausalLM

    from pipeshard.exporter.export import export_model

    out = tmp_path / "export"
    export_model(
        llama3_model, out, stages=2, weights="fp32", isolate=False, convert_tokenizer=False,
        progress=lambda _: None,
    )  # fmt: skip
    manifest = load_manifest(out)
    assert manifest.model.synthetic and manifest.model.spec["rope_scaling"]["factor"] == 8.0
    hf = AutoModelForCausalLM.from_pretrained(llama3_model, torch_dtype=torch.float32).eval()
    ids = np.random.default_rng(0).integers(0, 40000, size=(1, TOKENS), dtype=np.int64)
    with torch.no_grad():
        want = hf(torch.from_numpy(ids)).logits.numpy()
    x = ids
    for i in range(manifest.num_stages):
        x = (
            ShardRunner(out, i, precision="f32")
            .new_session()
            .run(x, np.arange(TOKENS)[None], return_last=TOKENS)
        )
    np.testing.assert_allclose(x, want, rtol=1e-4, atol=1e-4)
