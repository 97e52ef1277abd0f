"""Train Medusa-style draft heads (``pipeshard distil --kind medusa``) on the target's own
features: its greedy answers to its own questions (none of them a benchmark prompt) with the
final normed hidden state and the argmax at every position (exporter/target_texts.py).

Head k at position t learns the token at t + 1 + k of the target's greedy continuation from t,
which is the target's own argmax at t + k wherever the text's tokens t + 1 .. t + k are the
target's greedy choices; prompt positions are left out (serving runs the heads from the prompt's
last position on, and a chat template's predictable tokens would flatter the accuracy). The
heads (pipeshard/shard/draft_heads.py) start as the identity (W = 0: every head predicts what the
LM head does) and train with cross-entropy through the target's frozen head rows of a vocabulary
slice, head k weighted 0.8^(k-1) as Medusa does. Torch on CPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeshard.errors import InvalidArgument
from pipeshard.exporter.draft import plan_draft
from pipeshard.exporter.target_texts import (
    PROMPTS,
    TEXTS,
    FeatureTexts,
    Report,
    target_texts,
    token_counts,
)
from pipeshard.shard import draft_heads
from pipeshard.shard.manifest import load_manifest

HEADS = 4
TOP = (1, 3)  # the held-out accuracies reported per head: top-1 and top-3
HEAD_DECAY = 0.8  # head k's loss weight is HEAD_DECAY ** (k - 1)


@dataclass(frozen=True)
class Labels:
    """Every trainable position of a set of texts: its feature and, per head, the slice column
    of the token that head should predict (-100 where the continuation is not the target's)."""

    features: np.ndarray  # float32 [N, H]
    columns: np.ndarray  # int64 [N, K]
    tokens: np.ndarray  # int64 [N, K] the token ids (-1 where none)

    def __len__(self) -> int:
        return len(self.features)


def labels(data: FeatureTexts, heads: int, column: np.ndarray) -> Labels:
    """The answer's positions t (the texts' prompts are the part before the last token the target
    did not choose), with each head's label: the target's argmax at t + k while the tokens
    t + 1 .. t + k follow it greedily."""
    feats, tokens = [], []
    for i, (ids, features, top) in enumerate(zip(data.ids, data.features, data.argmax, strict=True)):
        n = len(ids)
        greedy = np.zeros(n, dtype=bool)  # greedy[j]: the token at j is the target's argmax at j - 1
        greedy[1:] = ids[1:] == top[:-1]
        out = np.full((n, heads), -1, dtype=np.int64)
        alive = np.ones(n, dtype=bool)
        for k in range(1, heads + 1):
            t = np.arange(n - k)  # positions whose t + k exists
            ok = np.zeros(n, dtype=bool)
            ok[: n - k] = greedy[t + k]
            alive &= ok
            out[: n - k, k - 1] = np.where(alive[: n - k], top[t + k], -1)
        keep = (out[:, 0] >= 0) & (np.arange(n) >= data.answer_start(i))  # where serving runs the heads
        feats.append(features[keep])
        tokens.append(out[keep])
    token_ids = np.concatenate(tokens) if tokens else np.zeros((0, heads), dtype=np.int64)
    cols = np.where(token_ids >= 0, column[np.maximum(token_ids, 0)], -100)
    return Labels(np.concatenate(feats).astype(np.float32), cols, token_ids)


class MedusaHeads:
    """The heads as torch parameters over the frozen head rows (mirrors ``DraftHeads.logits``)."""

    def __init__(self, head, head_ids, heads: int):
        import torch

        h = head.shape[1]
        self.torch = torch
        self.head = head  # frozen [S, H]
        self.head_ids = head_ids  # [S]
        self.weight = torch.nn.Parameter(torch.zeros(heads, h, h))  # W_k (out, in): starts as identity
        self.bias = torch.nn.Parameter(torch.zeros(heads, h))

    def parameters(self) -> list:
        return [self.weight, self.bias]

    def logits(self, features):
        """[B, K, S] from features [B, H]."""
        z = self.torch.einsum("bi,koi->bko", features, self.weight) + self.bias
        z = features[:, None, :] + self.torch.nn.functional.silu(z)
        return z @ self.head.T

    def arrays(self) -> dict[str, np.ndarray]:
        return {
            "head_ids": self.head_ids.numpy().astype(np.int64),
            "head": self.head.numpy().astype(np.float16),
            "weight": self.weight.detach().numpy().astype(np.float32),
            "bias": self.bias.detach().numpy().astype(np.float32),
        }


def accuracy(model: MedusaHeads, data: Labels, batch: int = 512) -> tuple[list[dict[str, float]], float]:
    """Per head, the share of ``data``'s labelled positions whose token is among its top 1 and
    top 3 (a token outside the slice counts as a miss); and the tokens per verify traversal a
    chain of every head's best token would give there (1 + the heads agreeing in a row)."""
    torch = model.torch
    k = data.columns.shape[1]
    hits = np.zeros((k, len(TOP)))
    counts = (data.tokens >= 0).sum(axis=0)
    chained = 0.0
    with torch.no_grad():
        for start in range(0, len(data), batch):
            logits = model.logits(torch.as_tensor(data.features[start : start + batch]))
            best = logits.topk(max(TOP), dim=-1).indices.numpy()  # [B, K, 3]
            cols = data.columns[start : start + batch]
            for j, top in enumerate(TOP):
                hits[:, j] += ((best[:, :, :top] == cols[:, :, None]).any(-1) & (cols >= 0)).sum(axis=0)
            chained += np.cumprod((best[:, :, 0] == cols) & (cols >= 0), axis=1).sum()
    per_head = [
        {f"top{top}": round(float(hits[i, j] / max(1, counts[i])), 4) for j, top in enumerate(TOP)}
        | {"positions": int(counts[i])}
        for i in range(k)
    ]
    return per_head, 1.0 + chained / max(1, len(data))


def train(
    model: MedusaHeads, data: Labels, *, epochs: float, lr: float, batch: int, seed: int, report: Report
) -> None:
    torch = model.torch
    torch.manual_seed(seed)
    feats, cols = torch.as_tensor(data.features), torch.as_tensor(data.columns)
    k = cols.shape[1]
    weights = torch.tensor([HEAD_DECAY**i for i in range(k)])
    steps = max(1, round(epochs * len(data) / batch))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.05)
    rng = np.random.default_rng(seed)
    for step in range(steps):
        pick = torch.as_tensor(rng.choice(len(data), size=min(batch, len(data)), replace=False))
        logits = model.logits(feats[pick])  # [B, K, S]
        per_head = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), cols[pick].reshape(-1), ignore_index=-100, reduction="none"
        ).reshape(-1, k)
        valid = (cols[pick] >= 0).float()
        loss = ((per_head * valid).sum(0) / valid.sum(0).clamp(min=1.0) * weights).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        report("train", (step + 1) / steps, f"step {step + 1}/{steps} loss {loss.item():.3f}")


@dataclass(frozen=True)
class MedusaResult:
    folder: Path
    reused: bool
    meta: draft_heads.DraftHeadsMeta


def distil_medusa(
    model_dir: Path | str,
    target_export: Path | str,
    out_dir: Path | str,
    *,
    heads: int = HEADS,
    vocab: int | None = 8192,
    texts: Path | None = None,
    prompts: int = PROMPTS,
    max_tokens: int = 128,
    epochs: float = 2.0,
    lr: float = 1e-3,
    batch: int = 256,
    held_out: float = 0.1,
    seed: int = 0,
    force: bool = False,
    report: Report | None = None,
) -> MedusaResult:
    """Train (or reuse) ``heads`` Medusa heads of ``target_export`` into ``out_dir``: heads there
    for the same fingerprint, count and slice are reused unless ``force``. ``texts``: a texts file
    keeping the target's answers with their features (default ``out_dir/texts.npz``), reused when
    they match, else generated there (exporter/target_texts.py)."""
    import torch
    from transformers import AutoModelForCausalLM

    report = report or (lambda phase, fraction, message: None)
    model_dir, target_export, out_dir = Path(model_dir), Path(target_export), Path(out_dir)
    target = load_manifest(target_export).model
    plan = plan_draft(model_dir, 1, vocab)  # refuses a bad slice before the texts are generated
    slice_size = len(plan.vocab_ids) if plan.vocab_ids is not None else target.vocab_size
    if draft_heads.is_draft_heads(out_dir) and not force:
        meta = draft_heads.read_meta(out_dir)
        same = meta.heads == heads and meta.training.get("vocab_slice") == slice_size
        if meta.model_fingerprint == target.fingerprint and same:
            report("reuse", 1.0, f"{out_dir} already holds {heads} heads for {target.fingerprint}")
            return MedusaResult(out_dir, True, meta)
    if not 1 <= heads <= 8:
        raise InvalidArgument("heads", f"must be in 1..8, got {heads}")
    if not 0 < held_out < 1:
        raise InvalidArgument("held_out", f"must be in (0, 1), got {held_out}")
    started = time.perf_counter()
    texts = Path(texts) if texts is not None else out_dir / TEXTS
    data, reused_texts = target_texts(
        target_export, texts, prompts=prompts, max_tokens=max_tokens, seed=seed, report=report
    )
    plan = plan_draft(model_dir, 1, vocab, counts=token_counts(data, target.vocab_size))
    held_texts, train_texts = data.split(held_out, seed)

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    head_all = hf.get_output_embeddings().weight.detach()
    vocab_size = int(head_all.shape[0])
    del hf
    head_ids = torch.as_tensor(
        plan.vocab_ids if plan.vocab_ids is not None else range(vocab_size), dtype=torch.long
    )
    column = np.full(vocab_size, -100, dtype=np.int64)
    column[head_ids.numpy()] = np.arange(len(head_ids))
    evaluation = labels(held_texts, heads, column)
    training = labels(train_texts, heads, column)
    model = MedusaHeads(head_all[head_ids].clone(), head_ids, heads)
    train(model, training, epochs=epochs, lr=lr, batch=batch, seed=seed, report=report)
    held, chain = accuracy(model, evaluation)
    minutes = (time.perf_counter() - started) / 60.0
    summary = ", ".join(f"head {i + 1} {a['top1']:.3f}/{a['top3']:.3f}" for i, a in enumerate(held))
    report("train", 1.0, f"held-out top-1/top-3: {summary}; a chain of {heads}: {chain:.2f} tokens/traversal")
    meta = draft_heads.DraftHeadsMeta(
        kind=draft_heads.KIND,
        model_fingerprint=target.fingerprint,
        heads=heads,
        hidden_size=int(head_all.shape[1]),
        vocab_size=vocab_size,
        training={
            "target_export": str(target_export),
            "texts_file": str(texts),
            "texts_reused": reused_texts,
            "texts": len(data.ids),
            "positions": data.positions,
            "train_positions": len(training),
            "vocab_slice": slice_size,
            "epochs": epochs,
            "minutes": round(minutes, 2),  # this run's: without generating when the texts were read
            "texts_minutes": round(data.minutes, 2),  # generating the texts, whenever that was
            "total_minutes": round(minutes + (data.minutes if reused_texts else 0.0), 2),
            "held_out": held,
            "held_out_chain_tokens_per_traversal": round(chain, 3),
        },
    )
    draft_heads.write(out_dir, meta, model.arrays())
    return MedusaResult(out_dir, False, meta)
