"""The ``eagle-decoder`` feature draft in torch and its training (``pipeshard distil --kind eagle
--arch decoder``): EAGLE's decoder layer with attention over the accepted positions'
features, mirroring pipeshard/shard/feature_decoder.py.

A text trains as one sequence from its answer's start (where serving's draft cache starts: the
prompt's last position). Training unrolls ``UNROLL`` passes the way a chain is drafted (EAGLE-3's
training-time test): pass j at position t reads pass j - 1's predicted feature at t - 1 and
attends to the first pass's keys up to t - j (the cache the target's features filled) plus its
own path's keys of passes 1..j, so every pass sees what the drafter's j-th level sees.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import numpy as np

from pipeshard.exporter.eagle import UNROLL, EagleDraft, optimise, shuffled, token_loss
from pipeshard.exporter.target_texts import FeatureTexts, Report
from pipeshard.shard.feature_decoder import HEAD_DIM

ROPE_THETA = 10000.0


class DecoderDraft(EagleDraft):
    """The MLP draft's input projection and block with an attention sublayer before the MLP."""

    kind = "eagle-decoder"

    def __init__(self, embed, head, head_ids, eps: float, intermediate: int, heads: int | None = None):
        import torch
        from torch import nn

        super().__init__(embed, head, head_ids, eps, intermediate)
        h = embed.shape[1]
        self.heads = heads or max(1, h // HEAD_DIM)
        self.norm_attn = nn.Parameter(torch.ones(h))
        self.q = nn.Linear(h, h, bias=False)
        self.k = nn.Linear(h, h, bias=False)
        self.v = nn.Linear(h, h, bias=False)
        self.o = nn.Linear(h, h, bias=False)
        with torch.no_grad():
            self.o.weight.mul_(0.1)  # starts close to the MLP draft
        self.modules += [self.q, self.k, self.v, self.o]

    def parameters(self) -> list:
        return [*super().parameters(), self.norm_attn]

    def _rotate(self, x, positions):
        """Rotary embedding of x [B, T, heads, d] at positions [T] (feature_decoder.rotate)."""
        torch = self.torch
        d = x.shape[-1]
        inv = ROPE_THETA ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
        angle = positions.to(torch.float64)[:, None] * inv[None, :]
        cos = torch.cos(angle).float()[None, :, None, :]
        sin = torch.sin(angle).float()[None, :, None, :]
        a, b = x[..., : d // 2], x[..., d // 2 :]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)

    def _inputs(self, features, tokens):
        e = self._rms(self.embed[tokens], self.norm_embed)
        return self.fc(self.torch.cat([e, features], dim=-1))

    def _qkv(self, z, positions):
        b, t, _ = z.shape
        zn = self._rms(z, self.norm_attn)
        q, k, v = (m(zn).view(b, t, self.heads, -1) for m in (self.q, self.k, self.v))
        return self._rotate(q, positions), self._rotate(k, positions), v

    def _finish(self, z, attended):
        f = self.torch.nn.functional
        h = z + self.o(attended.reshape(*z.shape))
        hn = self._rms(h, self.norm_mlp)
        h = h + self.down(f.silu(self.gate(hn)) * self.up(hn))
        out = self._rms(h, self.norm_out)
        return out, out @ self.head.T

    def passes(self, features, tokens, lengths, depth: int):
        """Teacher-forced drafting of ``depth`` levels over padded sequences: ``features`` [B, T, H]
        (the target's at t), ``tokens`` [B, T] (the ids at t + 1), ``lengths`` [B]. Returns per pass
        j the predicted features [B, T, H] and logits [B, T, S] at t (predicting t + 1 from level j
        of a draft rooted at t - j) and the mask [B, T] of positions where that root exists."""
        torch = self.torch
        t = features.shape[1]
        positions = torch.arange(t)
        valid = positions[None, :] < lengths[:, None]
        z0 = self._inputs(features, tokens)
        q0, k0, v0 = self._qkv(z0, positions)
        scale = 1.0 / math.sqrt(q0.shape[-1])
        keys = [k0]
        values = [v0]
        results = []
        q, z, feed = q0, z0, None
        for j in range(depth):
            if j:
                # Level j at t reads level j - 1's prediction made at t - 1.
                shifted = torch.cat([torch.zeros_like(feed[:, :1]), feed[:, :-1]], dim=1)
                z = self._inputs(shifted, tokens)
                q, k, v = self._qkv(z, positions)
                keys.append(k)
                values.append(v)
            # The cache: first-pass keys at or before t - j.
            scores = torch.einsum("bthd,bshd->bhts", q, k0) * scale
            cached = positions[None, :] <= positions[:, None] - j
            scores = scores.masked_fill(~cached[None, None], float("-inf"))
            # The path: pass i's key at t - j + i, for i = 1..j.
            path_scores, path_values = [], []
            for i in range(1, j + 1):
                shift = j - i
                k_i = torch.roll(keys[i], shift, dims=1)
                path_scores.append(torch.einsum("bthd,bthd->bht", q, k_i)[..., None] * scale)
                path_values.append(torch.roll(values[i], shift, dims=1))
            weights = torch.softmax(torch.cat([scores, *path_scores], dim=-1), dim=-1)
            attended = torch.einsum("bhts,bshd->bthd", weights[..., :t], v0)
            for i, v_i in enumerate(path_values):
                attended = attended + weights[..., t + i].permute(0, 2, 1)[..., None] * v_i
            out, logits = self._finish(z, attended)
            results.append((out, logits, valid & (positions[None, :] >= j)))
            feed = out
        return results

    def arrays(self) -> dict[str, np.ndarray]:
        def a(x):
            return x.detach().cpu().numpy().astype(np.float32)

        return {
            **super().arrays(),
            "norm_attn": a(self.norm_attn),
            "q": a(self.q.weight),
            "k": a(self.k.weight),
            "v": a(self.v.weight),
            "o": a(self.o.weight),
        }


class Sequences:
    """Every text's answer as one sequence: inputs (the feature at t, the id at t + 1) and labels
    (the feature, the target's argmax and, with ``soft``, its top-k probabilities at t + 1), from
    its answer's start on."""

    def __init__(self, data: FeatureTexts, soft: bool = False):
        self.features, self.tokens, self.next_features, self.next_top = [], [], [], []
        self.soft = soft and data.soft_ids is not None and data.soft_probs is not None
        self.soft_ids: list[np.ndarray] = []
        self.soft_probs: list[np.ndarray] = []
        for i, ids in enumerate(data.ids):
            s = data.answer_start(i)
            if len(ids) - s < 2:
                continue
            self.features.append(data.features[i][s:-1])
            self.tokens.append(ids[s + 1 :])
            self.next_features.append(data.features[i][s + 1 :])
            self.next_top.append(data.argmax[i][s + 1 :])
            if self.soft:
                self.soft_ids.append(data.soft_ids[i][s + 1 :])  # type: ignore[index]
                self.soft_probs.append(data.soft_probs[i][s + 1 :])  # type: ignore[index]
        self.lengths = np.asarray([len(t) for t in self.tokens], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.tokens)

    def batch(self, draft: DecoderDraft, pick: np.ndarray):
        """Padded tensors of the sequences ``pick``: features, tokens, lengths, next features, the
        next argmax's head column (-100 where padded or out of the slice), and with soft targets
        the next top-k ids and probabilities (None without)."""
        torch = draft.torch
        t = int(self.lengths[pick].max())
        h = self.features[0].shape[1]
        feats = np.zeros((len(pick), t, h), dtype=np.float32)
        nxt = np.zeros((len(pick), t, h), dtype=np.float32)
        tokens = np.zeros((len(pick), t), dtype=np.int64)
        top = np.full((len(pick), t), -1, dtype=np.int64)
        k = self.soft_ids[0].shape[1] if self.soft else 0
        soft_ids = np.zeros((len(pick), t, k), dtype=np.int64)
        soft_probs = np.zeros((len(pick), t, k), dtype=np.float32)
        for row, i in enumerate(pick):
            n = self.lengths[i]
            feats[row, :n], nxt[row, :n] = self.features[i], self.next_features[i]
            tokens[row, :n], top[row, :n] = self.tokens[i], self.next_top[i]
            if self.soft:
                soft_ids[row, :n], soft_probs[row, :n] = self.soft_ids[i], self.soft_probs[i]
        label = torch.full(top.shape, -100, dtype=torch.long)
        known = torch.as_tensor(top >= 0)
        label[known] = draft.column[torch.as_tensor(top)[known]]
        return (
            torch.as_tensor(feats),
            torch.as_tensor(tokens),
            torch.as_tensor(self.lengths[pick]),
            torch.as_tensor(nxt),
            label,
            (torch.as_tensor(soft_ids), torch.as_tensor(soft_probs)) if self.soft else None,
        )


def loss(draft: DecoderDraft, batch, scale: float, soft: float = 0.0):
    """Every pass's feature regression (in units of the features' power) and token loss
    (eagle.token_loss: ``soft`` of it on the target's top-k), over the positions where that
    pass's root exists."""
    torch = draft.torch
    feats, tokens, lengths, nxt, label, targets = batch
    total = 0.0
    for out, logits, mask in draft.passes(feats, tokens, lengths, UNROLL):
        reg = torch.nn.functional.smooth_l1_loss(out[mask], nxt[mask]) / scale
        if targets is None:
            ce = token_loss(draft, logits[mask], label[mask])
        else:
            ce = token_loss(draft, logits[mask], label[mask], targets[0][mask], targets[1][mask], soft)
        total = total + reg + ce
    return total


def chain_kept(draft: DecoderDraft, seqs: Sequences, depth: int, batch: int = 32) -> tuple[float, float]:
    """(first-level agreement with the target's argmax, mean tokens a chain of ``depth`` drafts
    keeps) over every root position of ``seqs``: what greedy chain drafting keeps on the target's
    own text (a kept draft equals the teacher's token, so teacher forcing is exact here)."""
    torch = draft.torch
    first = kept = roots = 0.0
    with torch.no_grad():
        for at in range(0, len(seqs), batch):
            pick = np.arange(at, min(at + batch, len(seqs)))
            feats, tokens, lengths, _, label, _ = seqs.batch(draft, pick)
            t = feats.shape[1]
            positions = torch.arange(t)
            # Roots whose whole chain lies inside the text (as eagle.agreement counts them).
            alive = positions[None, :] <= lengths[:, None] - depth
            roots += float(alive.sum())
            for j, (_, logits, _) in enumerate(draft.passes(feats, tokens, lengths, depth)):
                hit = logits.argmax(-1) == label  # -100: padding, or the target's token is off the slice
                # Root r's level j is pass j's position r + j.
                shifted = torch.zeros_like(hit)
                shifted[:, : t - j] = hit[:, j:]
                alive = alive & shifted
                if j == 0:
                    first += float(alive.sum())
                kept += float(alive.sum())
    return first / max(roots, 1.0), kept / max(roots, 1.0)


def train_decoder(
    draft: DecoderDraft,
    data: FeatureTexts,
    *,
    epochs: float,
    lr: float,
    batch: int,
    seed: int,
    report: Report,
    minutes: float | None = None,
    clock: Callable[[], float] = time.perf_counter,
    soft: float = 0.0,
) -> int:
    """Trains ``epochs`` passes over the texts, ``batch`` sequences a step, or until ``minutes``
    have passed (eagle.optimise); ``soft`` as in eagle.train. Returns the steps taken."""
    draft.torch.manual_seed(seed)
    seqs = Sequences(data, soft=bool(soft))
    scale = float(np.mean([np.mean(np.square(f, dtype=np.float32)) for f in seqs.next_features]))
    batch = min(batch, len(seqs))
    picks = shuffled(np.arange(len(seqs)), batch, seed)
    steps = max(1, round(epochs * len(seqs) / batch))

    def step_loss():
        return loss(draft, seqs.batch(draft, next(picks)), scale, soft)

    return optimise(
        draft, step_loss, steps, epochs=epochs, lr=lr, report=report, minutes=minutes, clock=clock
    )
