"""Selective weight loading: read only the safetensors tensors one stage needs.

A stage needs its own layers; stage 0 also the token embeddings; the last stage also the
final norm and the LM head (the embedding matrix again when embeddings are tied). Both a
single ``model.safetensors`` and a sharded ``model.safetensors.index.json`` are handled;
``safe_open`` maps the file, so tensors a stage does not name are never read.
"""

from __future__ import annotations

import json
from collections import defaultdict
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


def layer_tensor_names(spec: ModelSpec, layer: int) -> dict[str, str]:
    """Module-relative name -> checkpoint tensor name for one decoder layer."""
    f = spec.family
    parts = {
        "self_attn.q_proj.weight": f.layer_tensor(layer, f.q_proj),
        "self_attn.k_proj.weight": f.layer_tensor(layer, f.k_proj),
        "self_attn.v_proj.weight": f.layer_tensor(layer, f.v_proj),
        "self_attn.o_proj.weight": f.layer_tensor(layer, f.o_proj),
        "mlp.gate_proj.weight": f.layer_tensor(layer, f.gate_proj),
        "mlp.up_proj.weight": f.layer_tensor(layer, f.up_proj),
        "mlp.down_proj.weight": f.layer_tensor(layer, f.down_proj),
        "input_layernorm.weight": f.layer_tensor(layer, f.input_norm),
        "post_attention_layernorm.weight": f.layer_tensor(layer, f.post_attention_norm),
    }
    if spec.qkv_bias:
        for proj, name in (("q_proj", f.q_proj), ("k_proj", f.k_proj), ("v_proj", f.v_proj)):
            parts[f"self_attn.{proj}.bias"] = f.layer_tensor(layer, name, "bias")
    if spec.o_bias:
        parts["self_attn.o_proj.bias"] = f.layer_tensor(layer, f.o_proj, "bias")
    return parts


def stage_tensor_names(spec: ModelSpec, layer_start: int, layer_end: int) -> dict[str, str]:
    """Stage-module state-dict key -> checkpoint tensor name for layers [layer_start, layer_end)."""
    f = spec.family
    names: dict[str, str] = {}
    if layer_start == 0:
        names["embed_tokens.weight"] = f.embed
    for local, layer in enumerate(range(layer_start, layer_end)):
        for key, tensor in layer_tensor_names(spec, layer).items():
            names[f"layers.{local}.{key}"] = tensor
    if layer_end == spec.num_layers:
        names["norm.weight"] = f.final_norm
        names["lm_head.weight"] = f.embed if spec.tie_word_embeddings else f.lm_head
    return names


def load_stage_weights(
    model_dir: Path, spec: ModelSpec, layer_start: int, layer_end: int
) -> dict[str, torch.Tensor]:
    """Read the tensors of one stage as float32, keyed by stage-module state-dict names."""
    model_dir = Path(model_dir)
    wanted = stage_tensor_names(spec, layer_start, layer_end)
    wmap = _weight_map(model_dir)
    missing = sorted({t for t in wanted.values() if t not in wmap})
    if missing:
        raise InvalidArgument(
            "model", f"weights lack tensors {missing[:4]}{' ...' if len(missing) > 4 else ''}"
        )
    by_file: dict[str, list[str]] = defaultdict(list)
    for tensor in set(wanted.values()):
        by_file[wmap[tensor]].append(tensor)
    loaded: dict[str, torch.Tensor] = {}
    for file, tensors in by_file.items():
        with safe_open(str(model_dir / file), framework="pt") as f:
            for t in tensors:
                loaded[t] = f.get_tensor(t).to(torch.float32)
    # A tied LM head is the very same tensor object as the embedding (no second copy in memory).
    return {key: loaded[tensor] for key, tensor in wanted.items()}
