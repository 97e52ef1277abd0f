"""Medusa-style draft heads as a folder both sides share: ``pipeshard distil --kind medusa``
writes it, the final stage runs it (``pipeshard stage --draft-heads DIR``).

Head k (k = 1..K) reads the target's final normed hidden state h at position t (the LM head's
input, pipeshard/shard/features.py) and predicts the token at t + 1 + k of the target's greedy
continuation: a residual block ``h + SiLU(W_k h + b_k)`` scored by the target's own frozen LM
head rows for a vocabulary slice (Medusa-1). The LM head itself predicts t + 1, so the K heads
draft the K tokens after the one the target is adding: a chain of K, or a tree of their top
candidates, verified by the next step. On the final stage the heads run at one position per
step (the last one the greedy path through the row keeps): K x (H x H + H x S) multiply-adds,
the head slice shared by all K in one matmul.

Files: ``draft_heads.json`` (kind, the target's model fingerprint, sizes, how it was trained) and
``weights.npz``. Heads belong to the target's weights, not to a split: their fingerprint is the
manifest's model fingerprint, the same for every export of the same weights.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import openvino as ov
from openvino import opset13 as ops

from pipeshard.errors import InvalidArgument
from pipeshard.shard.draft_folder import WEIGHTS, DraftFolder

META = "draft_heads.json"
KIND = "medusa"
MAX_WIDTH = 8  # candidates per head the compiled heads return at most (a tree's widest)
# The arrays, with their shapes in terms of K (heads), H (hidden) and S (vocabulary slice).
ARRAYS = (
    "head_ids",  # [S] token id of each head row
    "head",  # [S, H] the target's LM head rows (fp16 on disk)
    "weight",  # [K, H, H] each head's residual block, W_k (out, in)
    "bias",  # [K, H]
)
FOLDER = DraftFolder("draft heads", "draft_heads", META, ARRAYS)


@dataclass(frozen=True)
class DraftHeadsMeta:
    kind: str
    model_fingerprint: str  # the target's (manifest ``model.fingerprint``): its config and weights
    heads: int
    hidden_size: int
    vocab_size: int
    training: dict = field(default_factory=dict)  # texts, positions, minutes, accuracy (reported)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> DraftHeadsMeta:
        if raw.get("kind") != KIND:
            raise InvalidArgument("draft_heads", f"kind must be {KIND}, got {raw.get('kind')!r}")
        return cls(
            kind=KIND,
            model_fingerprint=str(raw["model_fingerprint"]),
            heads=int(raw["heads"]),
            hidden_size=int(raw["hidden_size"]),
            vocab_size=int(raw["vocab_size"]),
            training=dict(raw.get("training", {})),
        )


def is_draft_heads(folder: Path) -> bool:
    return FOLDER.holds(folder)


def read_meta(folder: Path) -> DraftHeadsMeta:
    return DraftHeadsMeta.from_dict(FOLDER.read(folder))


def write(folder: Path, meta: DraftHeadsMeta, arrays: dict[str, np.ndarray]) -> None:
    FOLDER.write(folder, meta.to_dict(), arrays)


def check_target(meta: DraftHeadsMeta, target_export: Path, folder: Path) -> None:
    """Refused for any weights but those it was trained on, naming both fingerprints."""
    FOLDER.check_target(folder, meta.model_fingerprint, meta.hidden_size, meta.vocab_size, target_export)


@dataclass(frozen=True)
class HeadCandidates:
    """Each head's top candidates at one position: ``token_ids`` [K, W] and their probabilities
    under the head (a softmax over its vocabulary slice) [K, W], best first; ``row`` is the
    returned position of the row they were computed at (the greedy path's last)."""

    row: int
    token_ids: np.ndarray
    probabilities: np.ndarray

    @property
    def heads(self) -> int:
        return int(self.token_ids.shape[0])


class DraftHeads:
    """The heads compiled with OpenVINO: one inference from a feature [H] to each head's top
    ``MAX_WIDTH`` slice columns and their probabilities. The head rows are int8 (per-row scales)
    in the compiled model, so a step reads a quarter of their f32 bytes: about 1 ms for K = 4 at
    H = 576 and an 8192-row slice on two cores, where numpy's f32 matmul took 4-5 ms."""

    def __init__(self, folder: Path, meta: DraftHeadsMeta | None = None, num_threads: int | None = None):
        self.folder = Path(folder)
        self.meta = meta or read_meta(folder)
        with np.load(self.folder / WEIGHTS, allow_pickle=False) as z:
            w = {name: z[name] for name in ARRAYS}
        k, h = self.meta.heads, self.meta.hidden_size
        if w["weight"].shape != (k, h, h) or w["head"].shape != (len(w["head_ids"]), h):
            raise InvalidArgument("draft_heads", f"{folder}: weights do not match {META}")
        self.head_ids = w["head_ids"].astype(np.int64)
        config: dict[str, str | int] = {"INFERENCE_PRECISION_HINT": "f32", "PERFORMANCE_HINT": "LATENCY"}
        if num_threads:
            config["INFERENCE_NUM_THREADS"] = num_threads
        self._request = ov.Core().compile_model(_model(w, k, h), "CPU", config).create_infer_request()

    @property
    def heads(self) -> int:
        return self.meta.heads

    def candidates(self, feature: np.ndarray, width: int, row: int = 0) -> HeadCandidates:
        """Each head's ``width`` (at most MAX_WIDTH) likeliest tokens and their probabilities."""
        width = max(1, min(width, MAX_WIDTH))
        x = np.ascontiguousarray(np.asarray(feature, dtype=np.float32).reshape(1, -1))
        out = self._request.infer({0: x})
        probs, columns = out[0][:, :width], out[1][:, :width]
        return HeadCandidates(row, self.head_ids[columns], np.ascontiguousarray(probs, dtype=np.float32))


def _model(w: dict[str, np.ndarray], k: int, h: int) -> ov.Model:
    """feature [1, H] -> (probabilities [K, MAX_WIDTH], slice columns [K, MAX_WIDTH]), best first:
    z_k = h + SiLU(W_k h + b_k), logits_k = head z_k, top MAX_WIDTH and their softmax share."""
    axis = ops.constant(np.array([1], dtype=np.int64))
    feature = ops.parameter([1, h], np.float32, name="feature")
    weight = ops.constant(np.ascontiguousarray(w["weight"].reshape(k * h, h), dtype=np.float32))
    z = ops.add(
        ops.matmul(feature, weight, False, True), ops.constant(w["bias"].reshape(-1).astype(np.float32))
    )
    z = ops.add(ops.swish(ops.reshape(z, ops.constant(np.array([k, h], dtype=np.int64)), False)), feature)
    head = w["head"].astype(np.float32)
    scale = np.maximum(np.abs(head).max(axis=1, keepdims=True), 1e-12) / 127.0
    rows = ops.convert(ops.constant(np.round(head / scale).astype(np.int8)), np.float32)
    logits = ops.matmul(z, ops.multiply(rows, ops.constant(scale.astype(np.float32))), False, True)
    top = ops.topk(logits, ops.constant(np.int64(MAX_WIDTH)), 1, "max", "value")
    peak = ops.reduce_max(logits, axis, True)
    total = ops.reduce_sum(ops.exp(ops.subtract(logits, peak)), axis, True)
    probs = ops.divide(ops.exp(ops.subtract(top.output(0), peak)), total)
    return ov.Model(
        [probs.output(0), ops.convert(top.output(1), np.int64).output(0)], [feature], "draft_heads"
    )
