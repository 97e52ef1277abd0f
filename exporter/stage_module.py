"""A torch module for one layer range, written from the family spec, with explicit past K/V.

Ports, in this order (the names are set on the OpenVINO model after conversion):

- ``input_ids`` int64 [B, T] (the stage holding layer 0) or ``hidden_states`` f32 [B, T, H];
- ``attention_mask`` int64 [B, past + T]: 1 = a valid cache position, 0 = masked out. Masked
  positions may sit anywhere in the cache: the speculative rewind masks rejected tokens
  instead of cutting the KV state;
- ``position_ids`` int64 [B, T]: logical positions, which after a rewind differ from the
  physical cache indices;
- ``logits_to_keep`` int64 [] (last stage only): logits are computed for the last n positions
  only, so prefill does not pay for a [T, vocab] matmul and speculative verify can ask for k+1;
- ``past_key_values.{layer}.key`` / ``.value`` f32 [B, kv_heads, past, head_dim] per layer
  (``layer`` is the global layer index); these become graph state in ``convert.py``.

Outputs: ``hidden_states`` f32 [B, T, H] or ``logits`` f32 [B, n, vocab] (last stage), then
``present.{layer}.key`` / ``.value`` per layer.

The additive attention mask is built in-graph: query i (physical index past + i) may see
cache index j iff j <= past + i and attention_mask[j] == 1.

Rotary cos/sin are computed in-graph from ``position_ids`` and a constant ``inv_freq``. The
runtime and the speculative rewind then feed only logical positions; no cos/sin ports travel
between processes and no caller needs to know the rotary base.

Local (sliding-window) layers (Gemma 3) get a second mask and rotary table: a query at logical
position p sees the valid cache entries of logical positions p - window + 1 .. p, where a cache
entry's logical position is the count of valid entries before it (``cumsum(attention_mask) - 1``,
so masked-out rewinds leave no gap in the window). On the paged backend the PagedAttention pass
drops this mask; pipeshard.shard.paged gives those layers' PagedAttention the window instead.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from pipeshard.exporter import rope
from pipeshard.exporter.families import ModelSpec
from pipeshard.shard.manifest import input_port


class RMSNorm(nn.Module):
    """``(offset + weight) * x / rms(x)``: offset 0 for Llama-style weights, 1 for Gemma's."""

    def __init__(self, size: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        scale = self.weight + self.offset if self.offset else self.weight
        return scale * (x * torch.rsqrt(variance + self.eps))


def _norm(spec: ModelSpec, size: int) -> RMSNorm:
    return RMSNorm(size, spec.rms_eps, spec.family.norm_offset)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        h, d = spec.hidden_size, spec.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, d
        self.groups = spec.kv_groups
        self.q_proj = nn.Linear(h, spec.num_heads * d, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(h, spec.num_kv_heads * d, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(h, spec.num_kv_heads * d, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(spec.num_heads * d, h, bias=spec.o_bias)
        # QK-norm (Qwen3): each head's query and key RMS-normed over head_dim, before rotary.
        self.q_norm = _norm(spec, d) if spec.family.qk_norm else None
        self.k_norm = _norm(spec, d) if spec.family.qk_norm else None
        self.scale = (spec.query_scale or d) ** -0.5

    def _repeat_kv(self, x: torch.Tensor) -> torch.Tensor:
        # The Unsqueeze/Broadcast/Reshape GQA pattern the CPU plugin's SDPA fusion recognises.
        if self.groups == 1:
            return x
        b, kvh, length, d = x.shape
        return (
            x[:, :, None, :, :]
            .expand(b, kvh, self.groups, length, d)
            .reshape(b, kvh * self.groups, length, d)
        )

    def forward(self, x, cos, sin, mask, past_k, past_v):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k = torch.cat([past_k, k], dim=2)
        v = torch.cat([past_v, v], dim=2)
        out = F.scaled_dot_product_attention(
            q, self._repeat_kv(k), self._repeat_kv(v), attn_mask=mask, scale=self.scale
        )
        out = out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim)
        return self.o_proj(out), k, v


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        h, i = spec.hidden_size, spec.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)
        self.gelu = spec.activation == "gelu_tanh"

    def forward(self, x):
        gate = self.gate_proj(x)
        gate = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(gate * self.up_proj(x))


def _experts_sparse(x, weights, chosen, gate_up, down, inter: int):
    """The experts some row chose, gathered: [rows, hidden] -> [rows, hidden]."""
    rows, h = x.shape[0], x.shape[1]
    hit = torch.zeros_like(weights).scatter(1, chosen, torch.ones_like(weights)).sum(0) > 0
    used = torch.nonzero(hit).squeeze(-1)  # [U]
    gu = (x @ gate_up.index_select(0, used).reshape(-1, h).t()).view(rows, -1, 2 * inter)  # [rows, U, 2i]
    act = F.silu(gu[..., :inter]) * gu[..., inter:] * weights.index_select(1, used)[..., None]
    return act.reshape(rows, -1) @ down.index_select(1, used).reshape(h, -1).t()


def _experts_dense(x, weights, gate_up, down, inter: int):
    """Every expert, the unchosen weighted 0: [rows, hidden] -> [rows, hidden]."""
    rows, h = x.shape[0], x.shape[1]
    gu = (x @ gate_up.reshape(-1, h).t()).view(rows, -1, 2 * inter)  # [rows, E, 2 * inter]
    act = F.silu(gu[..., :inter]) * gu[..., inter:] * weights[..., None]
    return act.reshape(rows, -1) @ down.reshape(h, -1).t()


def _experts_by_rows(x, weights, chosen, gate_up, down, inter: int, sparse_rows: int):
    """Sparse while the step has at most ``sparse_rows`` rows, dense above: scripted, so the
    branch is an If in the graph and each step runs one form."""
    if x.shape[0] <= sparse_rows:
        return _experts_sparse(x, weights, chosen, gate_up, down, inter)
    return _experts_dense(x, weights, gate_up, down, inter)


@functools.cache
def _by_rows():
    """``_experts_by_rows`` scripted, on first use: only an export of a MoE stage pays for it."""
    return torch.jit.script(_experts_by_rows)


class SparseMoe(nn.Module):
    """Routed experts (Qwen3-MoE): softmax router, top-k per token, optionally renormalised.

    Experts are stacked in the checkpoint's [out, in] orientation so both forms multiply by the
    same bytes (each weight transposed, as a Linear's): ``gate_up`` [E, 2 * inter, hidden] (gate
    rows first) and ``down`` [hidden, E, inter]. The sparse
    form Gathers the experts any row of the step chose (NonZero over the routing mask) and
    multiplies by those only: a decode step of one row reads top_k experts of num_experts. The
    dense form is two plain matrix products over every expert, each row's unchosen experts
    weighted 0. ``by_rows`` (MoeSpec.form) picks one of them per step by its row count.
    """

    def __init__(self, spec: ModelSpec):
        super().__init__()
        moe = spec.moe
        assert moe is not None
        h, i, e = spec.hidden_size, moe.intermediate_size, moe.num_experts
        self.top_k, self.inter, self.sparse_rows = moe.top_k, i, moe.sparse_rows
        self.norm_topk_prob, self.form = moe.norm_topk_prob, moe.form
        self.router = nn.Linear(h, e, bias=False)
        self.gate_up = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down = nn.Parameter(torch.empty(h, e, i))

    def forward(self, x):
        b, t, h = x.shape
        x = x.reshape(b * t, h)
        probs = F.softmax(self.router(x), dim=-1)
        top, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        weights = torch.zeros_like(probs).scatter(1, chosen, top)  # [rows, E], 0 where unchosen
        if self.form == "dense":
            out = _experts_dense(x, weights, self.gate_up, self.down, self.inter)
        elif self.form == "sparse":
            out = _experts_sparse(x, weights, chosen, self.gate_up, self.down, self.inter)
        else:
            out = _by_rows()(x, weights, chosen, self.gate_up, self.down, self.inter, self.sparse_rows)
        return out.view(b, t, h)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, local: bool = False, moe: bool = False):
        super().__init__()
        h = spec.hidden_size
        self.local = local  # a sliding-window layer: the local mask and rotary table
        self.input_layernorm = _norm(spec, h)
        self.self_attn = Attention(spec)
        self.post_attention_layernorm = _norm(spec, h)
        self.mlp: nn.Module = SparseMoe(spec) if moe else MLP(spec)
        four = spec.family.pre_mlp_norm is not None
        self.pre_feedforward_layernorm = _norm(spec, h) if four else None
        self.post_feedforward_layernorm = _norm(spec, h) if four else None

    def forward(self, x, cos, sin, mask, past_k, past_v):
        attn, k, v = self.self_attn(self.input_layernorm(x), cos, sin, mask, past_k, past_v)
        if self.pre_feedforward_layernorm is None or self.post_feedforward_layernorm is None:
            x = x + attn
            return x + self.mlp(self.post_attention_layernorm(x)), k, v
        x = x + self.post_attention_layernorm(attn)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))), k, v


class StageModule(nn.Module):
    """Layers [layer_start, layer_end) of a model; embeddings if it starts at 0, head if it ends last.

    ``head_size`` < vocab_size is a draft's vocabulary slice: the LM head holds only those rows.
    """

    def __init__(self, spec: ModelSpec, layer_start: int, layer_end: int, head_size: int | None = None):
        super().__init__()
        self.spec = spec
        self.layer_start, self.layer_end = layer_start, layer_end
        self.is_first = layer_start == 0
        self.is_last = layer_end == spec.num_layers
        if self.is_first:
            self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(spec, i in spec.local_layers, spec.is_moe(i)) for i in range(layer_start, layer_end)
        )
        if self.is_last:
            self.norm = _norm(spec, spec.hidden_size)
            self.lm_head = nn.Linear(spec.hidden_size, head_size or spec.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope.inv_freq(spec), persistent=False)
        self.register_buffer("local_inv_freq", rope.inv_freq(spec, local=True), persistent=False)

    # -- port names -------------------------------------------------------------------------
    @property
    def layer_indices(self) -> range:
        return range(self.layer_start, self.layer_end)

    def input_names(self) -> list[str]:
        names = [input_port(self.is_first), "attention_mask", "position_ids"]
        if self.is_last:
            names.append("logits_to_keep")
        for i in self.layer_indices:
            names += [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
        return names

    def output_names(self) -> list[str]:
        names = ["logits" if self.is_last else "hidden_states"]
        for i in self.layer_indices:
            names += [f"present.{i}.key", f"present.{i}.value"]
        return names

    # -- forward ----------------------------------------------------------------------------
    def forward(self, x, attention_mask, position_ids, *rest):
        if self.is_last:
            logits_to_keep, past = rest[0], rest[1:]
        else:
            logits_to_keep, past = None, rest
        h = self.embed_tokens(x) if self.is_first else x
        if self.is_first and self.spec.family.embed_scaled:
            h = h * torch.tensor(self.spec.hidden_size**0.5, dtype=torch.float32)
        t = h.shape[1]
        total = attention_mask.shape[1]
        cos, sin = self._rotary(position_ids, self.inv_freq)

        # Additive mask [B, 1, T, past + T]: causal over physical indices AND valid in attention_mask.
        q_pos = torch.arange(t, dtype=torch.int64) + (total - t)
        k_pos = torch.arange(total, dtype=torch.int64)
        allowed = (k_pos[None, :] <= q_pos[:, None])[None, None] & (attention_mask[:, None, None, :] > 0)
        mask = _additive(allowed)
        if any(layer.local for layer in self.layers):
            local_cos, local_sin = self._rotary(position_ids, self.local_inv_freq)
            k_logical = torch.cumsum(attention_mask, dim=1) - 1  # [B, past + T]
            within = position_ids[:, None, :, None] - k_logical[:, None, None, :] < self.spec.sliding_window
            local_mask = _additive(allowed & within)

        presents = []
        for n, layer in enumerate(self.layers):
            if layer.local:
                h, k, v = layer(h, local_cos, local_sin, local_mask, past[2 * n], past[2 * n + 1])
            else:
                h, k, v = layer(h, cos, sin, mask, past[2 * n], past[2 * n + 1])
            presents += [k, v]
        if self.is_last:
            h = self.norm(h)
            # Slice before the LM head: only the last `logits_to_keep` positions get logits.
            idx = torch.arange(t - logits_to_keep, t, dtype=torch.int64)
            h = torch.index_select(h, 1, idx)
            h = self.lm_head(h)
        return (h, *presents)

    @staticmethod
    def _rotary(position_ids: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary tables from logical positions: cos, sin [B, 1, T, head_dim]."""
        freqs = position_ids[:, :, None].to(torch.float32) * inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos()[:, None], emb.sin()[:, None]

    # -- example inputs for tracing --------------------------------------------------------
    def example_inputs(self, batch: int = 2, seq: int = 3, past: int = 4) -> tuple[torch.Tensor, ...]:
        s = self.spec
        if self.is_first:
            x = torch.randint(0, s.vocab_size, (batch, seq), dtype=torch.int64)
        else:
            x = torch.randn(batch, seq, s.hidden_size)
        mask = torch.ones(batch, past + seq, dtype=torch.int64)
        pos = torch.arange(past, past + seq, dtype=torch.int64)[None].expand(batch, seq).contiguous()
        inputs: list[torch.Tensor] = [x, mask, pos]
        if self.is_last:
            inputs.append(torch.tensor(2, dtype=torch.int64))
        for _ in self.layer_indices:
            inputs += [torch.randn(batch, s.num_kv_heads, past, s.head_dim) for _ in range(2)]
        return tuple(inputs)


def _additive(allowed: torch.Tensor) -> torch.Tensor:
    return torch.where(
        allowed, torch.tensor(0.0, dtype=torch.float32), torch.tensor(torch.finfo(torch.float32).min)
    )


def build_stage_module(
    spec: ModelSpec, layer_start: int, layer_end: int, weights: dict[str, torch.Tensor]
) -> StageModule:
    """A StageModule with ``weights`` (stage-module state-dict keys) assigned, in eval mode; the LM
    head is as wide as its weight (a draft's vocabulary slice has fewer rows than the vocabulary)."""
    head = weights.get("lm_head.weight")
    with torch.device("meta"):
        module = StageModule(spec, layer_start, layer_end, None if head is None else head.shape[0])
    module.load_state_dict(weights, strict=True, assign=True)
    module.inv_freq = rope.inv_freq(spec)
    module.local_inv_freq = rope.inv_freq(spec, local=True)
    return module.eval()
