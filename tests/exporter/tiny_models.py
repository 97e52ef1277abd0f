"""Tiny random-weight models of every supported family, and fixtures exporting them (shared per session).

Imported by tests/exporter/conftest.py and tests/shard/conftest.py.

Each family gets GQA ratios other than SmolLM2's 3 and at least one untied head:
llama 4 heads / 2 KV (untied), qwen2 8 heads / 1 KV with q/k/v bias (tied),
mistral 8 heads / 2 KV with head_dim 16 != hidden / heads (untied), qwen3 8 heads / 2 KV with
QK-norm and head_dim 16 (tied), phi3 4 heads / 4 KV with fused qkv and gate-up (untied), gemma3_text
4 heads / 1 KV, a window of 4 tokens on three of its four layers and a query scale != head_dim,
qwen3_moe 8 heads / 2 KV with QK-norm, 8 experts of which 2 per token (renormalised) on three
layers and a plain MLP on layer 1 (``mlp_only_layers``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

TINY_CONFIGS = {
    "llama": dict(
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, rope_theta=10000.0
    ),
    "qwen2": dict(
        num_attention_heads=8, num_key_value_heads=1, tie_word_embeddings=True, rope_theta=1000000.0
    ),
    "mistral": dict(
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
        rope_theta=10000.0,
    ),
    "qwen3": dict(
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
    ),
    "phi3": dict(
        num_attention_heads=4,
        num_key_value_heads=4,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        pad_token_id=None,
        sliding_window=None,
    ),
    "qwen3_moe": dict(
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        mlp_only_layers=[1],
    ),
    "gemma3_text": dict(
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        query_pre_attn_scalar=24,
        sliding_window=4,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_theta=1000000.0,
        rope_local_base_freq=10000.0,
        tie_word_embeddings=True,
        hidden_activation="gelu_pytorch_tanh",
    ),
}
# Families whose norm weights are drawn, not HF's ones, so a QK-norm or norm read from the wrong
# tensor cannot pass.
NORMS_DRAWN = ("qwen3", "phi3", "gemma3_text", "qwen3_moe")
COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    max_position_embeddings=128,
    initializer_range=0.2,
    rms_norm_eps=1e-6,
)


def build_tiny(family: str, folder: Path, max_shard_size: str | None = None):
    """Build, save (safetensors) and return a tiny random HF model of ``family``."""
    import torch
    from transformers import (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    classes = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        "phi3": (Phi3Config, Phi3ForCausalLM),
        "gemma3_text": (Gemma3TextConfig, Gemma3ForCausalLM),
        "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    }
    config_cls, model_cls = classes[family]
    torch.manual_seed(1234)
    config = config_cls(**COMMON, **TINY_CONFIGS[family])
    model = model_cls(config).eval()
    if family in NORMS_DRAWN:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.uniform_(0.5, 1.5)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    return model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """Factory: family -> (model folder, HF model); built once per session."""
    cache: dict[str, tuple[Path, object]] = {}

    def get(family: str):
        if family not in cache:
            folder = tmp_path_factory.mktemp(f"tiny-{family}")
            cache[family] = (folder, build_tiny(family, folder))
        return cache[family]

    return get


@pytest.fixture(scope="session")
def tiny_export(tiny_model, tmp_path_factory):
    """Factory: (family, stages, weights, beam_idx) -> export folder, exported in-process once."""
    from pipeshard.exporter.export import export_model

    cache: dict[tuple, Path] = {}

    def get(family: str, stages: int, weights: str = "fp32", beam_idx: bool = True) -> Path:
        key = (family, stages, weights, beam_idx)
        if key not in cache:
            folder, _ = tiny_model(family)
            out = (
                tmp_path_factory.mktemp("exports")
                / f"{family}-{stages}s-{weights}{'' if beam_idx else '-nobeam'}"
            )
            export_model(
                folder,
                out,
                stages=stages,
                weights=weights,
                beam_idx=beam_idx,
                isolate=False,
                convert_tokenizer=False,
                progress=lambda event: None,
            )
            cache[key] = out
        return cache[key]

    return get
