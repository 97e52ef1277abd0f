"""A feature-reading draft as a folder both sides share: the exporter's ``pipeshard distil --kind
eagle`` writes it, the coordinator's ``feature`` source runs it. Two kinds: ``eagle``, this
module's model, and ``eagle-decoder``, which adds attention over the accepted positions
(pipeshard/shard/feature_decoder.py); they share the meta file and every array of this one.

The draft reads the target's final normed hidden state at position t (pipeshard/shard/
features.py) and the embedding of the token at t + 1, and predicts the target's normed state at
t + 1, which the target's own LM head (its rows of a vocabulary slice) scores into the token at
t + 2; fed its own prediction, it drafts on. The ``eagle`` kind is one fused input projection
and one gated MLP block (a decoder layer without attention, so a tree's nodes need no cache and
a level of any width is one batched matmul), in numpy: at 576 wide with an 8192-token head about
8 M multiply-adds per drafted token, 6% of SmolLM2-135M's per-token cost.

Files: ``feature_draft.json`` (kind, the target's model fingerprint, sizes, how it was trained)
and ``weights.npz``. A draft belongs to the target's weights, not to a split: its fingerprint is
the manifest's model fingerprint, the same for every export of the same weights.
"""

from __future__ import annotations

import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from pipeshard.errors import InvalidArgument
from pipeshard.shard.draft_folder import WEIGHTS, DraftFolder

META = "feature_draft.json"
# ``eagle``: one MLP block over the last feature (this module's model); ``eagle-decoder``: a
# decoder layer attending over every accepted position's (pipeshard/shard/feature_decoder.py).
KINDS = ("eagle", "eagle-decoder")
ARCHS = {"decoder": "eagle-decoder", "mlp": "eagle"}  # `pipeshard distil --arch` -> the kind it writes
# What `pipeshard distil --kind eagle`, `make distil KIND=eagle` and `make up`'s background training
# train: the better one measured at the default size (docs/EXPORTER.md "Feature drafts").
DEFAULT_ARCH = "mlp"
# The arrays of a draft, with their shapes in terms of H (hidden), I (MLP), V (vocab), S (slice).
ARRAYS = (
    "embed",  # [V, H] the target's input embedding (fp16 on disk)
    "head_ids",  # [S] token id of each head row
    "head",  # [S, H] the target's LM head rows
    "norm_embed",  # [H]
    "fc_weight",  # [H, 2H] over [normed embedding, feature]
    "fc_bias",  # [H]
    "norm_mlp",  # [H]
    "gate",  # [I, H]
    "up",  # [I, H]
    "down",  # [H, I]
    "norm_out",  # [H]
)
# The decoder kind's attention on top of those: [H, H] each (heads x 64 wide).
DECODER_ARRAYS = (*ARRAYS, "norm_attn", "q", "k", "v", "o")
FOLDER = DraftFolder("feature draft", "feature_draft", META, ARRAYS)
DECODER_FOLDER = DraftFolder("feature draft", "feature_draft", META, DECODER_ARRAYS)


def folder_of(kind: str) -> DraftFolder:
    """The arrays a draft of ``kind`` holds."""
    return DECODER_FOLDER if kind == "eagle-decoder" else FOLDER


@dataclass(frozen=True)
class FeatureDraftMeta:
    kind: str
    model_fingerprint: str  # the target's (manifest ``model.fingerprint``): its config and weights
    hidden_size: int
    vocab_size: int
    intermediate_size: int
    rms_eps: float
    training: dict = field(default_factory=dict)  # texts, positions, minutes, agreement (reported)
    heads: int = 0  # the decoder kind's attention heads
    rope_theta: float = 10000.0  # the decoder kind's rotary base (positions count from the draft's first)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> FeatureDraftMeta:
        kind = raw.get("kind")
        if kind not in KINDS:
            raise InvalidArgument("feature_draft", f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
        return cls(
            kind=kind,
            model_fingerprint=str(raw["model_fingerprint"]),
            hidden_size=int(raw["hidden_size"]),
            vocab_size=int(raw["vocab_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            rms_eps=float(raw["rms_eps"]),
            training=dict(raw.get("training", {})),
            heads=int(raw.get("heads", 0)),
            rope_theta=float(raw.get("rope_theta", 10000.0)),
        )


def is_feature_draft(folder: Path) -> bool:
    return FOLDER.holds(folder)


def read_meta(folder: Path) -> FeatureDraftMeta:
    return FeatureDraftMeta.from_dict(FOLDER.read(folder))


def write(folder: Path, meta: FeatureDraftMeta, arrays: dict[str, np.ndarray]) -> None:
    folder_of(meta.kind).write(folder, meta.to_dict(), arrays)


def check_target(meta: FeatureDraftMeta, target_export: Path, folder: Path) -> None:
    """Refused for any weights but those it was trained on, naming both fingerprints."""
    FOLDER.check_target(folder, meta.model_fingerprint, meta.hidden_size, meta.vocab_size, target_export)


def expected_shapes(meta: FeatureDraftMeta, slice_rows: int) -> dict[str, tuple[int, ...]]:
    """Every array a draft of ``meta``'s kind holds, with the shape its sizes give (the head slice's
    rows are what its ``head_ids`` say)."""
    h, i, v = meta.hidden_size, meta.intermediate_size, meta.vocab_size
    shapes: dict[str, tuple[int, ...]] = {
        "embed": (v, h),
        "head_ids": (slice_rows,),
        "head": (slice_rows, h),
        "norm_embed": (h,),
        "fc_weight": (h, 2 * h),
        "fc_bias": (h,),
        "norm_mlp": (h,),
        "gate": (i, h),
        "up": (i, h),
        "down": (h, i),
        "norm_out": (h,),
    }
    if meta.kind == "eagle-decoder":
        shapes.update(norm_attn=(h,), q=(h, h), k=(h, h), v=(h, h), o=(h, h))
    return shapes


def check_weights(folder: Path, meta: FeatureDraftMeta) -> None:
    """InvalidArgument naming ``feature_draft`` unless every array is there, of its shape, finite,
    and the head slice's ids are token ids (a truncated or foreign file fails here, not mid-request)."""
    try:
        with np.load(Path(folder) / WEIGHTS, allow_pickle=False) as z:
            arrays = {name: z[name] for name in z.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:  # truncated, damaged, not a zip
        raise InvalidArgument("feature_draft", f"{folder}: {WEIGHTS} cannot be read ({exc})") from exc
    ids = arrays.get("head_ids", np.zeros((0, 0)))
    for name, shape in expected_shapes(meta, ids.shape[0] if ids.ndim == 1 else -1).items():
        if name not in arrays:
            raise InvalidArgument("feature_draft", f"{folder}: {WEIGHTS} has no {name}")
        if arrays[name].shape != shape:
            raise InvalidArgument(
                "feature_draft", f"{folder}: {name} is {arrays[name].shape}, its meta's sizes say {shape}"
            )
        if not np.isfinite(arrays[name]).all():
            raise InvalidArgument("feature_draft", f"{folder}: {name} holds values that are not finite")
    if ids.size and (ids.min() < 0 or ids.max() >= meta.vocab_size):
        raise InvalidArgument("feature_draft", f"{folder}: head_ids reach outside the vocabulary")


def rms(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * weight


class FeatureDraftModel:
    """The draft's weights in memory and its forward pass (numpy, float32)."""

    def __init__(self, folder: Path, meta: FeatureDraftMeta | None = None):
        self.folder = Path(folder)
        self.meta = meta or read_meta(folder)
        with np.load(self.folder / WEIGHTS, allow_pickle=False) as z:
            w = {name: z[name] for name in ARRAYS}
        self.embed = w["embed"]  # fp16 rows, widened per lookup
        self.head_ids = w["head_ids"].astype(np.int64)
        f32 = {n: np.asarray(w[n], dtype=np.float32) for n in ARRAYS if n not in ("embed", "head_ids")}
        self.head_t = np.ascontiguousarray(f32["head"].T)
        h = self.meta.hidden_size
        self.fc_embed_t = np.ascontiguousarray(f32["fc_weight"][:, :h].T)
        self.fc_feature_t = np.ascontiguousarray(f32["fc_weight"][:, h:].T)
        self.fc_bias = f32["fc_bias"]
        self.norm_embed, self.norm_mlp, self.norm_out = f32["norm_embed"], f32["norm_mlp"], f32["norm_out"]
        self.gate_up_t = np.ascontiguousarray(np.concatenate([f32["gate"], f32["up"]]).T)
        self.down_t = np.ascontiguousarray(f32["down"].T)
        self.eps = self.meta.rms_eps

    def step(self, features: np.ndarray, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``features`` [B, H] at position t and the tokens [B] at t + 1: the predicted features
        at t + 1 [B, H] and their head-slice logits [B, S] (column i is token ``head_ids[i]``)."""
        e = rms(self.embed[np.asarray(tokens, dtype=np.int64)].astype(np.float32), self.norm_embed, self.eps)
        z = e @ self.fc_embed_t + np.asarray(features, dtype=np.float32) @ self.fc_feature_t + self.fc_bias
        gu = rms(z, self.norm_mlp, self.eps) @ self.gate_up_t
        gate, up = np.split(gu, 2, axis=-1)
        h = z + (gate / (1.0 + np.exp(-gate)) * up) @ self.down_t
        out = rms(h, self.norm_out, self.eps)
        return out, out @ self.head_t
