"""The ``eagle-decoder`` feature draft's forward pass (numpy): EAGLE's own draft shape, a decoder
layer whose attention reads the positions the target already accepted, where the ``eagle`` kind
(pipeshard/shard/feature_draft.py) sees one position only.

Per position t it takes the target's feature at t and the token at t + 1 (normed, concatenated,
projected to H, as the ``eagle`` kind), then one pre-norm decoder layer: rotary multi-head
attention over the draft's own cache of earlier positions, a gated MLP, a final norm: the
predicted feature at t + 1, scored by the target's head rows. The cache holds only positions
computed from the target's own features (a request's, on the coordinator); drafted positions
attend to it plus their own ancestors (a tree's nodes each see their path, not their siblings)
and are dropped after the step.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeshard.shard import feature_draft
from pipeshard.shard.draft_folder import WEIGHTS
from pipeshard.shard.feature_draft import FeatureDraftMeta, rms

HEAD_DIM = 64  # the attention's head width (SmolLM2-135M's own)


def rotate(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """Rotary embedding (the two-halves form) of ``x`` [T, heads, d] at ``positions`` [T]."""
    d = x.shape[-1]
    inv = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    angle = np.asarray(positions, dtype=np.float64)[:, None] * inv[None, :]
    cos = np.cos(angle).astype(np.float32)[:, None, :]
    sin = np.sin(angle).astype(np.float32)[:, None, :]
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


class FeatureDecoderModel:
    """The draft's weights and the pieces of its forward pass the drafter composes (float32)."""

    def __init__(self, folder: Path, meta: FeatureDraftMeta | None = None):
        self.folder = Path(folder)
        self.meta = meta or feature_draft.read_meta(folder)
        arrays = feature_draft.folder_of(self.meta.kind).arrays
        with np.load(self.folder / WEIGHTS, allow_pickle=False) as z:
            w = {name: z[name] for name in arrays}
        self.embed = w["embed"]  # fp16 rows, widened per lookup
        self.head_ids = w["head_ids"].astype(np.int64)
        f32 = {n: np.asarray(w[n], dtype=np.float32) for n in arrays if n not in ("embed", "head_ids")}
        h = self.meta.hidden_size
        self.head_t = np.ascontiguousarray(f32["head"].T)
        self.fc_embed_t = np.ascontiguousarray(f32["fc_weight"][:, :h].T)
        self.fc_feature_t = np.ascontiguousarray(f32["fc_weight"][:, h:].T)
        self.fc_bias = f32["fc_bias"]
        self.norm_embed, self.norm_attn = f32["norm_embed"], f32["norm_attn"]
        self.norm_mlp, self.norm_out = f32["norm_mlp"], f32["norm_out"]
        self.qkv_t = np.ascontiguousarray(np.concatenate([f32["q"], f32["k"], f32["v"]]).T)
        self.o_t = np.ascontiguousarray(f32["o"].T)
        self.gate_up_t = np.ascontiguousarray(np.concatenate([f32["gate"], f32["up"]]).T)
        self.down_t = np.ascontiguousarray(f32["down"].T)
        self.heads = self.meta.heads
        self.eps = self.meta.rms_eps

    def inputs(self, features: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """The layer's input [T, H] from the features at t [T, H] and the tokens at t + 1 [T]."""
        e = rms(self.embed[np.asarray(tokens, dtype=np.int64)].astype(np.float32), self.norm_embed, self.eps)
        return e @ self.fc_embed_t + np.asarray(features, dtype=np.float32) @ self.fc_feature_t + self.fc_bias

    def qkv(self, z: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rotated queries and keys and the values [T, heads, d] of the layer inputs ``z``."""
        t = z.shape[0]
        q, k, v = np.split(rms(z, self.norm_attn, self.eps) @ self.qkv_t, 3, axis=-1)
        shape = (t, self.heads, -1)
        theta = self.meta.rope_theta
        return (
            rotate(q.reshape(shape), positions, theta),
            rotate(k.reshape(shape), positions, theta),
            v.reshape(shape),
        )

    def finish(self, z: np.ndarray, attended: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The predicted features [T, H] and head-slice logits [T, S] from the layer inputs and
        the attention's output [T, heads, d]."""
        h = z + attended.reshape(z.shape[0], -1) @ self.o_t
        gate, up = np.split(rms(h, self.norm_mlp, self.eps) @ self.gate_up_t, 2, axis=-1)
        h = h + (gate / (1.0 + np.exp(-gate)) * up) @ self.down_t
        out = rms(h, self.norm_out, self.eps)
        return out, out @ self.head_t


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Softmax attention of queries [T, heads, d] over keys and values [S, heads, d], query i
    seeing key j where ``mask`` [T, S] is true (every row sees at least itself)."""
    scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(q.shape[-1])
    scores = np.where(mask[None], scores, -np.inf)
    scores = np.exp(scores - scores.max(-1, keepdims=True))
    scores /= scores.sum(-1, keepdims=True)
    return np.einsum("hts,shd->thd", scores, v)
