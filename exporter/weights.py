"""Selective weight loading: read only the safetensors tensors one stage needs.

A stage needs its own layers; stage 0 also the token embeddings; the last stage also the
final norm and the LM head (the embedding matrix again when embeddings are tied). Both a
single ``model.safetensors`` and a sharded ``model.safetensors.index.json`` are handled;
``safe_open`` maps the file, so tensors a stage does not name are never read. A family with
fused projections (Phi-3's qkv_proj, gate_up_proj) is split here into the stage module's q/k/v
and gate/up by rows, so one module serves every family; a MoE layer's per-expert matrices are
stacked here into the stage module's [experts, in, out] tensors.
"""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from pipeshard.errors import InvalidArgument
from pipeshard.exporter.families import ModelSpec

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def weight_files(model_dir: Path) -> list[Path]:
    """Every safetensors file of a model folder, in a stable order."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    if (model_dir / SINGLE_FILE).is_file():
        return [model_dir / SINGLE_FILE]
    raise InvalidArgument("model", f"{model_dir} has neither {SINGLE_FILE} nor {INDEX_FILE}")


def _weight_map(model_dir: Path) -> dict[str, str]:
    index = model_dir / INDEX_FILE
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    path = model_dir / SINGLE_FILE
    if not path.is_file():
        raise InvalidArgument("model", f"{model_dir} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    with safe_open(str(path), framework="pt") as f:
        return dict.fromkeys(f.keys(), SINGLE_FILE)


@dataclass(frozen=True)
class TensorRef:
    """A checkpoint tensor, or the rows [start, stop) of one (a part of a fused projection)."""

    name: str
    start: int | None = None
    stop: int | None = None

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name,)

    def build(self, loaded: dict[str, torch.Tensor]) -> torch.Tensor:
        tensor = loaded[self.name]
        return tensor if self.start is None else tensor[self.start : self.stop]


@dataclass(frozen=True)
class StackedRef:
    """Per-expert checkpoint matrices ([out, in] each, as stored) stacked into one tensor: expert
    e's matrices in ``experts[e]``, joined along out, the experts stacked on ``axis``: 0 gives
    [experts, out, in], 1 gives [out, experts, in]."""

    experts: tuple[tuple[str, ...], ...]
    axis: int = 0

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for names in self.experts for n in names)

    def build(self, loaded: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.stack([torch.cat([loaded[n] for n in names]) for names in self.experts], dim=self.axis)


WeightRef = TensorRef | StackedRef


def _fused(name: str, sizes: list[int]) -> list[TensorRef]:
    bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    return [TensorRef(name, a, b) for a, b in itertools.pairwise(bounds)]


def _expert_names(spec: ModelSpec, layer: int) -> dict[str, WeightRef]:
    """A MoE layer's router and stacked experts (see stage_module.SparseMoe)."""
    f, moe = spec.family, spec.moe
    assert moe is not None

    def part(e: int, name: str) -> str:
        return f.layer_tensor(layer, f.expert.format(e=e) + name)

    experts = range(moe.num_experts)
    return {
        "mlp.router.weight": TensorRef(f.layer_tensor(layer, f.router)),
        "mlp.gate_up": StackedRef(tuple((part(e, "gate_proj"), part(e, "up_proj")) for e in experts)),
        "mlp.down": StackedRef(tuple((part(e, "down_proj"),) for e in experts), axis=1),
    }


def layer_tensor_names(spec: ModelSpec, layer: int) -> dict[str, WeightRef]:
    """Module-relative name -> checkpoint tensor (or rows of one) for one decoder layer."""
    f = spec.family
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    parts: dict[str, WeightRef] = {}
    projections = (("q_proj", f.q_proj), ("k_proj", f.k_proj), ("v_proj", f.v_proj))
    if f.qkv_proj is None:
        for proj, name in projections:
            parts[f"self_attn.{proj}.weight"] = TensorRef(f.layer_tensor(layer, name))
            if spec.qkv_bias:
                parts[f"self_attn.{proj}.bias"] = TensorRef(f.layer_tensor(layer, name, "bias"))
    else:
        for kind in ("weight", "bias") if spec.qkv_bias else ("weight",):
            split = _fused(f.layer_tensor(layer, f.qkv_proj, kind), [q, kv, kv])
            for (proj, _), ref in zip(projections, split, strict=True):
                parts[f"self_attn.{proj}.{kind}"] = ref
    parts["self_attn.o_proj.weight"] = TensorRef(f.layer_tensor(layer, f.o_proj))
    if spec.o_bias:
        parts["self_attn.o_proj.bias"] = TensorRef(f.layer_tensor(layer, f.o_proj, "bias"))
    if f.q_norm is not None and f.k_norm is not None:
        parts["self_attn.q_norm.weight"] = TensorRef(f.layer_tensor(layer, f.q_norm))
        parts["self_attn.k_norm.weight"] = TensorRef(f.layer_tensor(layer, f.k_norm))
    if spec.is_moe(layer):
        parts.update(_expert_names(spec, layer))
    else:
        if f.gate_up_proj is None:
            parts["mlp.gate_proj.weight"] = TensorRef(f.layer_tensor(layer, f.gate_proj))
            parts["mlp.up_proj.weight"] = TensorRef(f.layer_tensor(layer, f.up_proj))
        else:
            gate, up = _fused(f.layer_tensor(layer, f.gate_up_proj), [spec.intermediate_size] * 2)
            parts["mlp.gate_proj.weight"], parts["mlp.up_proj.weight"] = gate, up
        parts["mlp.down_proj.weight"] = TensorRef(f.layer_tensor(layer, f.down_proj))
    parts["input_layernorm.weight"] = TensorRef(f.layer_tensor(layer, f.input_norm))
    parts["post_attention_layernorm.weight"] = TensorRef(f.layer_tensor(layer, f.post_attention_norm))
    if f.pre_mlp_norm is not None and f.post_mlp_norm is not None:
        parts["pre_feedforward_layernorm.weight"] = TensorRef(f.layer_tensor(layer, f.pre_mlp_norm))
        parts["post_feedforward_layernorm.weight"] = TensorRef(f.layer_tensor(layer, f.post_mlp_norm))
    return parts


def stage_tensor_names(spec: ModelSpec, layer_start: int, layer_end: int) -> dict[str, WeightRef]:
    """Stage-module state-dict key -> checkpoint tensor for layers [layer_start, layer_end)."""
    f = spec.family
    names: dict[str, WeightRef] = {}
    if layer_start == 0:
        names["embed_tokens.weight"] = TensorRef(f.embed)
    for local, layer in enumerate(range(layer_start, layer_end)):
        for key, tensor in layer_tensor_names(spec, layer).items():
            names[f"layers.{local}.{key}"] = tensor
    if layer_end == spec.num_layers:
        names["norm.weight"] = TensorRef(f.final_norm)
        names["lm_head.weight"] = TensorRef(f.embed if spec.tie_word_embeddings else f.lm_head)
    return names


def load_stage_weights(
    model_dir: Path, spec: ModelSpec, layer_start: int, layer_end: int
) -> dict[str, torch.Tensor]:
    """Read the tensors of one stage as float32, keyed by stage-module state-dict names."""
    model_dir = Path(model_dir)
    wanted = stage_tensor_names(spec, layer_start, layer_end)
    wmap = _weight_map(model_dir)
    needed = {n for ref in wanted.values() for n in ref.names}
    missing = sorted(n for n in needed if n not in wmap)
    if missing:
        raise InvalidArgument(
            "model", f"weights lack tensors {missing[:4]}{' ...' if len(missing) > 4 else ''}"
        )
    by_file: dict[str, list[str]] = defaultdict(list)
    for tensor in needed:
        by_file[wmap[tensor]].append(tensor)
    loaded: dict[str, torch.Tensor] = {}
    for file, tensors in by_file.items():
        with safe_open(str(model_dir / file), framework="pt") as f:
            for t in tensors:
                loaded[t] = f.get_tensor(t).to(torch.float32)
    # A tied LM head is the very same tensor object as the embedding (no second copy in memory).
    return {key: ref.build(loaded) for key, ref in wanted.items()}
