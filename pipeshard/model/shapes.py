"""Published architectures as typed data: what `pipeshard model synth --like NAME` reproduces.

Numbers are those of each model's published ``config.json``; ``qk_norm`` (Qwen3) adds per-head
query and key norms, ``fused`` (Phi-3) stores q/k/v and gate/up as one matrix each, ``experts``
(Qwen3-MoE) replaces every layer's MLP by that many routed experts, ``experts_per_token`` of them
per token, each ``moe_intermediate_size`` wide.
``test-llama3`` is not a published model: a few-megabyte Llama 3-style shape (llama3 rope scaling,
GQA, untied head) for tests.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from pipeshard.errors import InvalidArgument

# The config.json key marking random weights; the exporter copies it into every manifest.
SYNTHETIC_KEY = "pipeshard_synthetic"


@dataclass(frozen=True)
class Shape:
    """One decoder-only architecture (Llama-style tensor names, RMSNorm, SwiGLU, rotary GQA)."""

    name: str
    model_type: str  # llama | qwen2 | mistral | qwen3 | phi3 | qwen3_moe
    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float
    rms_eps: float
    max_positions: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    rope_scaling: dict[str, Any] | None = None
    qk_norm: bool = False
    fused: bool = False
    sliding_window: int | None = None
    experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0

    def with_layers(self, layers: int | None) -> Shape:
        """The same shape cut to its first ``layers`` layers (tests, quick runs)."""
        if layers is None:
            return self
        if not 1 <= layers <= self.num_layers:
            raise InvalidArgument("layers", f"must be 1..{self.num_layers} for {self.name}, got {layers}")
        return replace(self, num_layers=layers)

    @property
    def layer_params(self) -> int:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = q + 2 * kv if self.qkv_bias else 0
        norms = 2 * self.head_dim if self.qk_norm else 0
        mlp = 3 * self.hidden_size * self.intermediate_size
        if self.experts:  # every expert's gate, up and down, and the router
            mlp = self.experts * (3 * self.hidden_size * self.moe_intermediate_size + self.hidden_size)
        return self.hidden_size * (2 * q + 2 * kv) + mlp + bias + norms

    @property
    def params(self) -> int:
        table = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else table
        return self.num_layers * (self.layer_params + 2 * self.hidden_size) + table + head + self.hidden_size


def _llama3_rope(factor: float, original: int = 8192) -> dict[str, Any]:
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": original,
    }


SHAPES: dict[str, Shape] = {
    s.name: s
    for s in (
        Shape(
            "llama-3.2-3b", "llama", "LlamaForCausalLM", 28, 3072, 8192, 24, 8, 128, 128256,
            500000.0, 1e-5, 131072, tie_word_embeddings=True, rope_scaling=_llama3_rope(32.0),
        ),
        Shape(
            "llama-3.1-8b", "llama", "LlamaForCausalLM", 32, 4096, 14336, 32, 8, 128, 128256,
            500000.0, 1e-5, 131072, tie_word_embeddings=False, rope_scaling=_llama3_rope(8.0),
        ),
        Shape(
            "qwen2.5-3b", "qwen2", "Qwen2ForCausalLM", 36, 2048, 11008, 16, 2, 128, 151936,
            1000000.0, 1e-6, 32768, tie_word_embeddings=True, qkv_bias=True,
        ),
        Shape(
            "mistral-7b", "mistral", "MistralForCausalLM", 32, 4096, 14336, 32, 8, 128, 32768,
            1000000.0, 1e-5, 32768, tie_word_embeddings=False,
        ),
        Shape(
            "qwen3-0.6b", "qwen3", "Qwen3ForCausalLM", 28, 1024, 3072, 16, 8, 128, 151936,
            1000000.0, 1e-6, 40960, tie_word_embeddings=True, qk_norm=True,
        ),
        Shape(
            "qwen3-8b", "qwen3", "Qwen3ForCausalLM", 36, 4096, 12288, 32, 8, 128, 151936,
            1000000.0, 1e-6, 40960, tie_word_embeddings=False, qk_norm=True,
        ),
        Shape(
            "qwen3-30b-a3b", "qwen3_moe", "Qwen3MoeForCausalLM", 48, 2048, 6144, 32, 4, 128, 151936,
            1000000.0, 1e-6, 40960, tie_word_embeddings=False, qk_norm=True,
            experts=128, experts_per_token=8, moe_intermediate_size=768,
        ),
        Shape(
            "phi-3-mini-4k", "phi3", "Phi3ForCausalLM", 32, 3072, 8192, 32, 32, 96, 32064,
            10000.0, 1e-5, 4096, tie_word_embeddings=False, fused=True, sliding_window=2047,
        ),
        Shape(
            "test-llama3", "llama", "LlamaForCausalLM", 4, 64, 128, 4, 2, 16, 50000,
            500000.0, 1e-5, 4096, tie_word_embeddings=False, rope_scaling=_llama3_rope(8.0, 64),
        ),
    )
}  # fmt: skip


def get_shape(name: str) -> Shape:
    shape = SHAPES.get(name)
    if shape is None:
        raise InvalidArgument("like", f"is {name!r}; known shapes: {', '.join(SHAPES)}")
    return shape
