"""Train an EAGLE-style feature draft (``pipeshard distil --kind eagle``) on the target's own
features: its greedy answers to its own questions (none of them a benchmark prompt), generated
in batches on the paged backend, reading the final normed hidden state and the argmax at every
position on the way (pipeshard/shard/features.py).

The draft (pipeshard/shard/feature_draft.py) learns, from the target's feature at t and the
token at t + 1, the feature at t + 1 (regression) and the target's argmax there (cross-entropy
through the target's frozen head rows). Training unrolls ``UNROLL`` steps, each fed the draft's
own predicted feature, because that is how a chain or tree is drafted. Torch on CPU.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeshard.errors import InvalidArgument
from pipeshard.exporter.draft import plan_draft
from pipeshard.exporter.target_texts import (
    PROMPTS,
    TEXT_KINDS,
    TEXTS,
    FeatureTexts,
    Report,
    target_texts,
    token_counts,
)
from pipeshard.shard import feature_draft
from pipeshard.shard.manifest import load_manifest

UNROLL = 3  # draft steps trained per sample, each on the previous step's predicted feature
# Training stops at this budget: with the texts (PROMPTS answers, about 11-15 minutes to generate on
# 2 quiet cores), a draft is ready within 45 minutes.
TRAIN_MINUTES = 25.0
INTERMEDIATE = 1536  # the MLP block's width (SmolLM2-135M's own layers use 1536)
# The share of the token loss taken from the target's top-k probabilities (soft targets) where the
# texts hold them; the rest is cross-entropy on its argmax.
SOFT_WEIGHT = 0.5


class EagleDraft:
    """The draft as a torch module mirroring ``FeatureDraftModel.step``."""

    def __init__(self, embed, head, head_ids, eps: float, intermediate: int = INTERMEDIATE):
        import torch
        from torch import nn

        h = embed.shape[1]
        self.torch = torch
        self.eps = eps
        self.embed = embed  # frozen [V, H]
        self.head = head  # frozen [S, H]
        self.head_ids = head_ids  # [S]
        self.column = torch.full((embed.shape[0],), -100, dtype=torch.long)
        self.column[head_ids] = torch.arange(len(head_ids))
        self.norm_embed = nn.Parameter(torch.ones(h))
        self.fc = nn.Linear(2 * h, h)
        with torch.no_grad():  # start as "the feature passes through"
            self.fc.weight.zero_()
            self.fc.weight[:, h:] = torch.eye(h)
            self.fc.bias.zero_()
        self.norm_mlp = nn.Parameter(torch.ones(h))
        self.gate = nn.Linear(h, intermediate, bias=False)
        self.up = nn.Linear(h, intermediate, bias=False)
        self.down = nn.Linear(intermediate, h, bias=False)
        with torch.no_grad():
            self.down.weight.mul_(0.1)
        self.norm_out = nn.Parameter(torch.ones(h))
        self.modules = [self.fc, self.gate, self.up, self.down]

    def parameters(self) -> list:
        params = [self.norm_embed, self.norm_mlp, self.norm_out]
        for m in self.modules:
            params += list(m.parameters())
        return params

    def _rms(self, x, weight):
        return x * self.torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * weight

    def step(self, features, tokens):
        """Predicted features [B, H] and head-slice logits [B, S]."""
        f = self.torch.nn.functional
        e = self._rms(self.embed[tokens], self.norm_embed)
        z = self.fc(self.torch.cat([e, features], dim=-1))
        zn = self._rms(z, self.norm_mlp)
        h = z + self.down(f.silu(self.gate(zn)) * self.up(zn))
        out = self._rms(h, self.norm_out)
        return out, out @ self.head.T

    def arrays(self) -> dict[str, np.ndarray]:
        def a(t):
            return t.detach().cpu().numpy().astype(np.float32)

        return {
            "embed": self.embed.numpy().astype(np.float16),
            "head_ids": self.head_ids.numpy().astype(np.int64),
            "head": a(self.head),
            "norm_embed": a(self.norm_embed),
            "fc_weight": a(self.fc.weight),
            "fc_bias": a(self.fc.bias),
            "norm_mlp": a(self.norm_mlp),
            "gate": a(self.gate.weight),
            "up": a(self.up.weight),
            "down": a(self.down.weight),
            "norm_out": a(self.norm_out),
        }


def soft_loss(draft: EagleDraft, logits, soft_ids, soft_probs):
    """Cross-entropy of the head-slice ``logits`` [N, S] against the target's top-k distribution
    (``soft_ids`` [N, k], ``soft_probs`` [N, k]), renormalised over the ids the slice scores."""
    torch = draft.torch
    cols = draft.column[soft_ids.long()]
    keep = cols >= 0
    q = soft_probs.float() * keep
    q = q / q.sum(-1, keepdim=True).clamp_min(1e-6)
    logp = torch.log_softmax(logits, -1).gather(-1, cols.clamp_min(0))
    return -(q * logp).sum(-1).mean()


def token_loss(draft: EagleDraft, logits, label, soft_ids=None, soft_probs=None, soft: float = 0.0):
    """The token loss: cross-entropy on the target's argmax, ``soft`` of it from its top-k."""
    hard = draft.torch.nn.functional.cross_entropy(logits, label, ignore_index=-100)
    if not soft or soft_ids is None:
        return hard
    return (1.0 - soft) * hard + soft * soft_loss(draft, logits, soft_ids, soft_probs)


def _samples(data: FeatureTexts) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Flat ids, features, argmax and the start indices t with UNROLL steps inside one text's
    answer (where serving drafts: the prompts' own positions are another distribution, and
    their template is the same in every text)."""
    ids = np.concatenate(data.ids)
    feats = np.concatenate(data.features)
    top = np.concatenate(data.argmax)
    starts, offset = [], 0
    for i, text in enumerate(data.ids):
        n = len(text)
        starts.extend(range(offset + data.answer_start(i), offset + n - UNROLL))
        offset += n
    return ids, feats, top, np.asarray(starts, dtype=np.int64)


def agreement(draft: EagleDraft, data: FeatureTexts, chunk: int = 4096) -> tuple[float, float]:
    """(first-step agreement with the target's argmax, mean accepted chain length of UNROLL
    steps) over ``data``: what a chain draft would keep on the target's own text."""
    torch = draft.torch
    ids, feats, top, starts = _samples(data)
    if not len(starts):
        return 0.0, 0.0
    first, kept = 0.0, 0.0
    with torch.no_grad():
        for at in range(0, len(starts), chunk):  # [chunk, S] logits at a time, not [positions, S]
            part = starts[at : at + chunk]
            f = torch.as_tensor(feats[part], dtype=torch.float32)
            alive = torch.ones(len(part), dtype=torch.bool)
            for j in range(UNROLL):
                f, logits = draft.step(f, torch.as_tensor(ids[part + j + 1]))
                hit = draft.head_ids[logits.argmax(-1)] == torch.as_tensor(top[part + j + 1])
                if j == 0:
                    first += float(hit.float().sum())
                alive &= hit
                kept += float(alive.float().sum())
    return first / len(starts), kept / len(starts)


WARMUP = 0.05  # share of the schedule the learning rate rises over


def schedule(progress: float) -> float:
    """The learning rate's share of its peak at ``progress`` (0..1) of training: a linear warm-up,
    then a cosine down to 0 (one cycle)."""
    if progress < WARMUP:
        return max(progress / WARMUP, 0.01)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (progress - WARMUP) / (1.0 - WARMUP))))


def train(
    draft: EagleDraft,
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
    """Trains ``epochs`` passes (each a fresh shuffle of the samples), or until ``minutes`` have
    passed (``optimise``); ``soft``: the share of the token loss on the target's top-k
    probabilities (where ``data`` holds them). Returns the steps taken."""
    torch = draft.torch
    torch.manual_seed(seed)
    ids, feats, top, starts = _samples(data)
    ids_t, top_t = torch.as_tensor(ids), torch.as_tensor(top)
    soft_ids = soft_probs = None
    if soft and data.soft_ids is not None and data.soft_probs is not None:
        soft_ids = torch.as_tensor(np.concatenate(data.soft_ids))
        soft_probs = torch.as_tensor(np.concatenate(data.soft_probs))
    feats_t = torch.as_tensor(feats, dtype=torch.float32)
    scale = float(feats_t.pow(2).mean())  # the regression in units of the features' own power
    batch = min(batch, len(starts))
    picks = shuffled(starts, batch, seed)

    def loss():
        pick = torch.as_tensor(next(picks))
        f, total = feats_t[pick], 0.0
        for j in range(UNROLL):
            f, logits = draft.step(f, ids_t[pick + j + 1])
            at = pick + j + 1
            label = draft.column[top_t[at]]
            total = total + torch.nn.functional.smooth_l1_loss(f, feats_t[at]) / scale
            if soft_ids is None:
                total = total + token_loss(draft, logits, label)
            else:
                total = total + token_loss(draft, logits, label, soft_ids[at], soft_probs[at], soft)
        return total

    steps = max(1, round(epochs * len(starts) / batch))
    return optimise(draft, loss, steps, epochs=epochs, lr=lr, report=report, minutes=minutes, clock=clock)


def shuffled(items: np.ndarray, batch: int, seed: int) -> Iterator[np.ndarray]:
    """Endless batches of ``items``, each pass a fresh seeded shuffle."""
    rng = np.random.default_rng(seed)
    order = np.empty(0, dtype=items.dtype)
    while True:
        if len(order) < batch:
            order = np.concatenate([order, rng.permutation(items)])
        pick, order = order[:batch], order[batch:]
        yield pick


def optimise(
    draft: EagleDraft,
    loss: Callable[[], Any],
    steps: int,
    *,
    epochs: float,
    lr: float,
    report: Report,
    minutes: float | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> int:
    """AdamW on ``loss()`` (a fresh batch's) for ``steps`` steps or until ``minutes`` have passed:
    the schedule follows whichever is further along, steps or time, so a step that slows down as
    training goes on (or a machine that gets busier) shortens training rather than overrunning the
    budget, and the learning rate still ends annealed. Returns the steps taken."""
    budget = None if minutes is None else minutes * 60.0
    opt = draft.torch.optim.AdamW(draft.parameters(), lr=lr * schedule(0.0), weight_decay=0.0)
    started, step, progress = clock(), 0, 0.0
    while progress < 1.0:
        total = loss()
        opt.zero_grad()
        total.backward()
        opt.step()
        step += 1
        progress = step / steps if budget is None else max(step / steps, (clock() - started) / budget)
        for group in opt.param_groups:
            group["lr"] = lr * schedule(progress)
        report(
            "train",
            min(1.0, progress),
            f"step {step} ({step / steps:.0%} of {epochs:g} epochs) loss {total.item():.3f}",
        )
    return step


BATCH = {"decoder": 16, "mlp": 256}  # sequences a step, positions a step


def _draft_kind(arch: str, embed, head, head_ids, eps: float):
    """(the untrained draft, its held-out measure, its training loop) for ``arch``."""
    if arch == "mlp":
        return EagleDraft(embed, head, head_ids, eps), agreement, train
    from pipeshard.exporter.eagle_decoder import DecoderDraft, Sequences, chain_kept, train_decoder

    def measure(draft, data):
        return chain_kept(draft, Sequences(data), UNROLL)

    return DecoderDraft(embed, head, head_ids, eps, INTERMEDIATE), measure, train_decoder


@dataclass(frozen=True)
class EagleResult:
    folder: Path
    reused: bool
    meta: feature_draft.FeatureDraftMeta


def distil_eagle(
    model_dir: Path | str,
    target_export: Path | str,
    out_dir: Path | str,
    *,
    vocab: int | None = 8192,
    prompts: int = PROMPTS,
    max_tokens: int = 128,
    epochs: float = 2.0,
    lr: float = 2e-3,
    batch: int | None = None,
    held_out: float = 0.1,
    seed: int = 0,
    force: bool = False,
    texts: Path | None = None,
    train_minutes: float | None = TRAIN_MINUTES,
    report: Report | None = None,
    arch: str = feature_draft.DEFAULT_ARCH,
    soft: float = SOFT_WEIGHT,
) -> EagleResult:
    """Train (or reuse) an eagle draft of ``target_export`` into ``out_dir``: a trained draft there
    whose fingerprint matches the target's is reused unless ``force``. The target's texts are kept
    in ``texts`` (default ``out_dir/texts.npz``) and reused from there when they match; training
    stops short of ``epochs`` where ``train_minutes`` would not hold them. ``arch``: ``mlp``
    (kind ``eagle``: the last position's feature only) or ``decoder`` (kind ``eagle-decoder``:
    attention over the accepted positions, exporter/eagle_decoder.py). ``soft``: the share of the
    token loss on the target's top-k probabilities."""
    import torch
    from transformers import AutoModelForCausalLM

    report = report or (lambda phase, fraction, message: None)
    model_dir, target_export, out_dir = Path(model_dir), Path(target_export), Path(out_dir)
    target = load_manifest(target_export).model
    if feature_draft.is_feature_draft(out_dir) and not force:
        meta = feature_draft.read_meta(out_dir)
        if meta.model_fingerprint == target.fingerprint and meta.kind == feature_draft.ARCHS[arch]:
            report("reuse", 1.0, f"{out_dir} already holds a draft for {target.fingerprint}")
            return EagleResult(out_dir, True, meta)
    if not 0 < held_out < 1:
        raise InvalidArgument("held_out", f"must be in (0, 1), got {held_out}")
    if not 0 <= soft <= 1:
        raise InvalidArgument("soft", f"must be in [0, 1], got {soft}")
    if arch not in feature_draft.ARCHS:
        raise InvalidArgument("arch", f"must be one of {', '.join(feature_draft.ARCHS)}, got {arch!r}")
    plan_draft(model_dir, 1, vocab)  # refuses a bad slice before the texts are generated
    batch = batch or BATCH[arch]
    started = time.perf_counter()
    data, reused_texts = target_texts(
        target_export,
        texts or out_dir / TEXTS,
        prompts=prompts,
        max_tokens=max_tokens,
        seed=seed,
        report=report,
    )
    plan = plan_draft(model_dir, 1, vocab, counts=token_counts(data, target.vocab_size))
    evaluation, training = data.split(held_out, seed)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    embed = hf.get_input_embeddings().weight.detach().clone()
    head_all = hf.get_output_embeddings().weight.detach()
    head_ids = torch.as_tensor(
        plan.vocab_ids if plan.vocab_ids is not None else range(embed.shape[0]), dtype=torch.long
    )
    eps = float(hf.config.rms_norm_eps)
    draft, measure, fit = _draft_kind(arch, embed, head_all[head_ids].clone(), head_ids, eps)
    del hf
    before = measure(draft, evaluation)
    report("train", 0.0, f"held-out agreement before {before[0]:.3f} (chain of {UNROLL}: {before[1]:.2f})")
    steps = fit(
        draft,
        training,
        epochs=epochs,
        lr=lr,
        batch=batch,
        seed=seed,
        report=report,
        minutes=train_minutes,
        soft=soft if data.soft else 0.0,
    )
    after = measure(draft, evaluation)
    minutes = (time.perf_counter() - started) / 60.0
    parts = {k: evaluation.of_kind(k) for k in TEXT_KINDS}
    by_kind = {k: round(measure(draft, part)[1], 3) for k, part in parts.items() if part.ids}
    report("train", 1.0, f"held-out agreement after {after[0]:.3f} (chain of {UNROLL}: {after[1]:.2f})")
    meta = feature_draft.FeatureDraftMeta(
        kind=feature_draft.ARCHS[arch],
        model_fingerprint=target.fingerprint,
        hidden_size=int(embed.shape[1]),
        vocab_size=int(embed.shape[0]),
        intermediate_size=INTERMEDIATE,
        rms_eps=draft.eps,
        training={
            "target_export": str(target_export),
            "texts": len(data.ids),
            "positions": data.positions,
            "train_positions": training.positions,
            "max_tokens": max_tokens,
            "epochs": epochs,
            "steps": steps,
            "soft_weight": soft if data.soft else 0.0,
            "batch": batch,
            "minutes": round(minutes, 2),  # this run's: without generating when the texts were reused
            "texts_reused": reused_texts,
            "texts_minutes": round(data.minutes, 2),  # generating the texts, whenever that was
            "total_minutes": round(minutes + (data.minutes if reused_texts else 0.0), 2),
            "held_out_agreement_before": round(before[0], 4),
            "held_out_agreement": round(after[0], 4),
            "held_out_chain_of_3": round(after[1], 3),
            "held_out_chain_of_3_by_kind": by_kind,
            # a chain of 3 drafts: the tokens a traversal keeps, its target token included
            "held_out_tokens_per_traversal": round(1.0 + after[1], 3),
        },
        heads=getattr(draft, "heads", 0),
    )
    feature_draft.write(out_dir, meta, draft.arrays())
    return EagleResult(out_dir, False, meta)
