"""`pipeshard model synth`: a Hugging Face folder with a published architecture and random weights.

What size changes (export memory and time, stage memory, step time, the planner's choices) does
not depend on what the weights say, so a real-size model can be made here without downloading
one. Weights are seeded normal(0, 0.02) (norms 1, biases 0), each tensor drawn from its own seed
(its name and ``--seed``), written one safetensors shard at a time: at most one shard is ever in
memory. The tokenizer is the bundled model's; embedding and LM head rows past its vocabulary are
zero, so a random model's argmax never picks a token the tokenizer cannot decode. A shape with a
smaller vocabulary than the tokenizer's (Phi-3's 32,064 against 49,152) gets the tokenizer cut to
its ids: the tokens and the merges that make them are dropped, so text still tokenizes (into shorter
pieces) and never into an id the model lacks. config.json
carries ``pipeshard_synthetic: true``, which the exporter copies into every manifest.
"""

from __future__ import annotations

import json
import shutil
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from pipeshard import paths
from pipeshard.errors import FailedPrecondition
from pipeshard.model.shapes import SYNTHETIC_KEY, Shape

INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
)
# Not written for a cut tokenizer: tokenizer.json alone describes it.
SLOW_TOKENIZER_FILES = ("vocab.json", "merges.txt")
STD = 0.02
SHARD_BYTES = 2 * 2**30
DTYPE = torch.bfloat16

Progress = Callable[[str], object]


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    kind: str  # normal | ones | zeros | table (normal, rows past the tokenizer zero)

    @property
    def nbytes(self) -> int:
        n = 2
        for d in self.shape:
            n *= d
        return n


def tensor_specs(shape: Shape) -> list[TensorSpec]:
    """Every tensor of the checkpoint, in file order (Llama-style names; Phi-3's fused q/k/v and
    gate/up, Qwen3's q_norm and k_norm, Qwen3-MoE's router and experts where the shape has them)."""
    h, q, kv = shape.hidden_size, shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    inter = shape.intermediate_size
    specs = [TensorSpec("model.embed_tokens.weight", (shape.vocab_size, h), "table")]
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        specs.append(TensorSpec(p + "input_layernorm.weight", (h,), "ones"))
        if shape.fused:
            specs.append(TensorSpec(p + "self_attn.qkv_proj.weight", (q + 2 * kv, h), "normal"))
        else:
            specs += [
                TensorSpec(p + "self_attn.q_proj.weight", (q, h), "normal"),
                TensorSpec(p + "self_attn.k_proj.weight", (kv, h), "normal"),
                TensorSpec(p + "self_attn.v_proj.weight", (kv, h), "normal"),
            ]
        specs.append(TensorSpec(p + "self_attn.o_proj.weight", (h, q), "normal"))
        if shape.qk_norm:
            specs += [
                TensorSpec(p + "self_attn.q_norm.weight", (shape.head_dim,), "ones"),
                TensorSpec(p + "self_attn.k_norm.weight", (shape.head_dim,), "ones"),
            ]
        specs.append(TensorSpec(p + "post_attention_layernorm.weight", (h,), "ones"))
        if shape.experts:
            specs += _expert_specs(shape, p)
        elif shape.fused:
            specs.append(TensorSpec(p + "mlp.gate_up_proj.weight", (2 * inter, h), "normal"))
        else:
            specs += [
                TensorSpec(p + "mlp.gate_proj.weight", (inter, h), "normal"),
                TensorSpec(p + "mlp.up_proj.weight", (inter, h), "normal"),
            ]
        if not shape.experts:
            specs.append(TensorSpec(p + "mlp.down_proj.weight", (h, inter), "normal"))
        if shape.qkv_bias:
            specs += [
                TensorSpec(p + "self_attn.q_proj.bias", (q,), "zeros"),
                TensorSpec(p + "self_attn.k_proj.bias", (kv,), "zeros"),
                TensorSpec(p + "self_attn.v_proj.bias", (kv,), "zeros"),
            ]
    specs.append(TensorSpec("model.norm.weight", (h,), "ones"))
    if not shape.tie_word_embeddings:
        specs.append(TensorSpec("lm_head.weight", (shape.vocab_size, h), "table"))
    return specs


def _expert_specs(shape: Shape, prefix: str) -> list[TensorSpec]:
    """A MoE layer's router [experts, hidden] and each expert's gate, up and down."""
    h, inter = shape.hidden_size, shape.moe_intermediate_size
    specs = [TensorSpec(prefix + "mlp.gate.weight", (shape.experts, h), "normal")]
    for e in range(shape.experts):
        p = f"{prefix}mlp.experts.{e}."
        specs += [
            TensorSpec(p + "gate_proj.weight", (inter, h), "normal"),
            TensorSpec(p + "up_proj.weight", (inter, h), "normal"),
            TensorSpec(p + "down_proj.weight", (h, inter), "normal"),
        ]
    return specs


def make_tensor(spec: TensorSpec, seed: int, tokenizer_vocab: int) -> torch.Tensor:
    """One tensor, the same for the same (seed, name) whatever the sharding."""
    if spec.kind == "ones":
        return torch.ones(spec.shape, dtype=DTYPE)
    if spec.kind == "zeros":
        return torch.zeros(spec.shape, dtype=DTYPE)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(spec.name.encode()))
    out = torch.empty(spec.shape, dtype=DTYPE)
    out.normal_(0.0, STD, generator=gen)
    if spec.kind == "table":
        out[tokenizer_vocab:] = 0
    return out


def plan_shards(specs: list[TensorSpec], limit: int = SHARD_BYTES) -> list[list[TensorSpec]]:
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def config_json(shape: Shape, seed: int, bos: int, eos: int) -> dict:
    config = {
        "architectures": [shape.architecture],
        "model_type": shape.model_type,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "vocab_size": shape.vocab_size,
        "max_position_embeddings": shape.max_positions,
        "rope_theta": shape.rope_theta,
        "rope_scaling": shape.rope_scaling,
        "rms_norm_eps": shape.rms_eps,
        "tie_word_embeddings": shape.tie_word_embeddings,
        "hidden_act": "silu",
        "mlp_bias": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        SYNTHETIC_KEY: True,
        "pipeshard_like": shape.name,
        "pipeshard_seed": seed,
    }
    if shape.model_type in ("llama", "qwen3", "qwen3_moe"):
        config["attention_bias"] = False
    if shape.model_type == "qwen2":
        config.update(use_sliding_window=False, sliding_window=shape.max_positions)
    if shape.model_type in ("qwen3", "qwen3_moe"):
        config.update(use_sliding_window=False, sliding_window=None)
    if shape.experts:
        config.update(
            num_experts=shape.experts,
            num_experts_per_tok=shape.experts_per_token,
            moe_intermediate_size=shape.moe_intermediate_size,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    if shape.model_type == "phi3":
        config.update(
            sliding_window=shape.sliding_window,
            original_max_position_embeddings=shape.max_positions,
            partial_rotary_factor=1.0,
        )
    return config


def _tokenizer_source() -> Path:
    from pipeshard.model.fetch import ensure_default_model, is_model_folder

    folder = paths.default_model_dir()
    return folder if is_model_folder(folder) else ensure_default_model()


def _tokenizer_vocab(folder: Path) -> int:
    """Ids the bundled tokenizer can produce: its model vocabulary and added tokens."""
    data = json.loads((folder / "tokenizer.json").read_text())
    ids = list(data["model"]["vocab"].values()) + [t["id"] for t in data.get("added_tokens", [])]
    return max(ids) + 1


def _cut_tokenizer(folder: Path, vocab: int) -> None:
    """Keep the byte-level BPE's ids below ``vocab``: tokens, merges that make a kept token from kept
    tokens, and added tokens; everything else in the files is left as it was."""
    path = folder / "tokenizer.json"
    data = json.loads(path.read_text())
    model = data["model"]
    model["vocab"] = {token: i for token, i in model["vocab"].items() if i < vocab}
    kept = model["vocab"]

    def parts(merge: str | list[str]) -> list[str]:
        return merge.split(" ", 1) if isinstance(merge, str) else merge

    model["merges"] = [
        m for m in model["merges"] if all(p in kept for p in parts(m)) and "".join(parts(m)) in kept
    ]
    data["added_tokens"] = [t for t in data.get("added_tokens", []) if t["id"] < vocab]
    path.write_text(json.dumps(data, ensure_ascii=False))
    config_path = folder / "tokenizer_config.json"
    if config_path.is_file():
        config = json.loads(config_path.read_text())
        decoder = config.get("added_tokens_decoder", {})
        config["added_tokens_decoder"] = {i: t for i, t in decoder.items() if int(i) < vocab}
        config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def _shard_stream(
    shape: Shape, seed: int, tokenizer_vocab: int
) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    shards = plan_shards(tensor_specs(shape))
    for k, group in enumerate(shards):
        name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        yield name, {s.name: make_tensor(s, seed, tokenizer_vocab) for s in group}


def synthesize(
    shape: Shape, out: Path, seed: int = 0, force: bool = False, progress: Progress = print
) -> Path:
    """Write ``out`` (config, tokenizer, sharded bf16 safetensors); one shard in memory at a time."""
    out = Path(out)
    if out.exists() and not force:
        raise FailedPrecondition(f"{out} already exists; pass --force to replace it")
    source = _tokenizer_source()
    vocab = min(_tokenizer_vocab(source), shape.vocab_size)
    gen = json.loads((source / "generation_config.json").read_text())
    tmp = out.parent / f".{out.name}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        cut = vocab < _tokenizer_vocab(source)
        for name in TOKENIZER_FILES:
            if (source / name).is_file() and not (cut and name in SLOW_TOKENIZER_FILES):
                shutil.copy2(source / name, tmp / name)
        if cut:
            _cut_tokenizer(tmp, vocab)
        config = config_json(shape, seed, int(gen.get("bos_token_id", 1)), int(gen.get("eos_token_id", 2)))
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        weight_map: dict[str, str] = {}
        total = 0
        for name, tensors in _shard_stream(shape, seed, vocab):
            save_file(tensors, str(tmp / name), metadata={"format": "pt"})
            for key, tensor in tensors.items():
                weight_map[key] = name
                total += tensor.numel() * tensor.element_size()
            progress(f"wrote {name} ({len(tensors)} tensors)")
            del tensors
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    progress(f"{shape.name}: {shape.num_layers} layers, {shape.params / 1e9:.2f} B parameters -> {out}")
    return out
