"""Teacher-forced logits of one token sequence under different groupings of its rows.

Speculation, chunked prefill and batching only regroup the rows a shard computes: a K+1-row
verify instead of K+1 one-row steps, a prompt in chunks, several sequences' rows in one
inference. Greedy output can only change if a row's logits depend on that grouping. These
helpers feed a fixed sequence (teacher forcing, so every grouping sees the same tokens) and
return the logits of every position, which ``max_abs_delta`` compares against one-row decoding;
``bench/numerics.py`` measures candidate compile properties with them and tests assert on them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pipeshard.errors import InvalidArgument
from pipeshard.shard.runtime import ShardRunner


def blocks_for(total: int, prefill: int, prompt_len: int, rows: int) -> list[int]:
    """Row counts covering ``total`` positions: the first ``prompt_len`` in chunks of ``prefill``
    rows (0: the whole prompt at once), the rest in blocks of ``rows`` (1: one-row decoding,
    K+1: speculative verify)."""
    if not 0 < prompt_len <= total or rows < 1 or prefill < 0:
        raise InvalidArgument(
            "blocks", f"bad grouping of {total} positions: {prompt_len=} {prefill=} {rows=}"
        )
    chunk = prefill or prompt_len
    out = [min(chunk, prompt_len - i) for i in range(0, prompt_len, chunk)]
    out += [min(rows, total - i) for i in range(prompt_len, total, rows)]
    return out


def chain_logits(runners: Sequence[ShardRunner], ids: Sequence[int], blocks: Sequence[int]) -> np.ndarray:
    """Logits [len(ids), vocab] of every position, the stages fed ``blocks`` rows at a time from a
    fresh cache (one session per runner)."""
    if sum(blocks) != len(ids):
        raise InvalidArgument("blocks", f"cover {sum(blocks)} positions, the sequence has {len(ids)}")
    sessions = [r.new_session() for r in runners]
    seq = np.asarray(ids, dtype=np.int64).reshape(1, -1)
    out, start = [], 0
    for t in blocks:
        x = seq[:, start : start + t]
        for s in sessions:
            x = s.run(x, return_last=t)
        out.append(x[0])
        start += t
    return np.concatenate(out, axis=0)


def batch_logits(
    runner: ShardRunner, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int]
) -> list[np.ndarray]:
    """Logits of every position of several sequences sharing each inference of a 1-stage shard:
    their prompts left-padded into one prefill (masked pad positions), then one row per sequence
    per decode step. The shard's batch dimension must be dynamic; returns [len(seq_i), vocab] each."""
    if not (runner.is_first and runner.is_last):
        raise InvalidArgument("runner", "batch_logits needs a 1-stage shard")
    b = len(sequences)
    steps = {len(s) - p for s, p in zip(sequences, prompt_lens, strict=True)}
    if len(steps) != 1:
        raise InvalidArgument("sequences", "every sequence needs the same number of tokens after its prompt")
    n_decode = steps.pop()
    width = max(prompt_lens)
    ids = np.zeros((b, width), np.int64)
    mask = np.zeros((b, width), np.int64)
    pos = np.zeros((b, width), np.int64)
    for r, (seq, p) in enumerate(zip(sequences, prompt_lens, strict=True)):
        ids[r, width - p :] = seq[:p]
        mask[r, width - p :] = 1
        pos[r, width - p :] = np.arange(p)
    req = runner.compiled.create_infer_request()
    req.reset_state()

    def infer(x: np.ndarray, m: np.ndarray, p: np.ndarray) -> np.ndarray:
        inputs = {"input_ids": x, "attention_mask": m, "position_ids": p}
        inputs["logits_to_keep"] = np.array(x.shape[1], np.int64)
        if runner.has_beam_idx:
            inputs["beam_idx"] = np.arange(b, dtype=np.int32)
        req.infer(inputs)
        return req.get_tensor("logits").data.copy()

    first = infer(ids, mask, pos)
    rows = [[first[r, width - p :]] for r, p in enumerate(prompt_lens)]
    for step in range(n_decode):
        mask = np.concatenate([mask, np.ones((b, 1), np.int64)], axis=1)
        x = np.array([[seq[p + step]] for seq, p in zip(sequences, prompt_lens, strict=True)], np.int64)
        p_ids = np.array([[p + step] for p in prompt_lens], np.int64)
        out = infer(x, mask, p_ids)
        for r in range(b):
            rows[r].append(out[r])
    return [np.concatenate([np.atleast_2d(a) for a in r], axis=0) for r in rows]


@dataclass
class Delta:
    """How far a grouping's logits are from the reference's, over the compared positions."""

    max_abs: float
    argmax_changes: int  # positions whose greedy token differs from the reference's
    min_margin_at_change: float | None  # the reference's top-1 minus top-2 logit at the closest call


def max_abs_delta(logits: np.ndarray, reference: np.ndarray, start: int = 0) -> Delta:
    """Compare positions ``start..`` of two [positions, vocab] logit arrays."""
    a, ref = logits[start:].astype(np.float64), reference[start:].astype(np.float64)
    changed = np.flatnonzero(a.argmax(-1) != ref.argmax(-1))
    margin = None
    if changed.size:
        top2 = np.sort(ref[changed], axis=-1)[:, -2:]
        margin = float((top2[:, 1] - top2[:, 0]).min())
    return Delta(float(np.abs(a - ref).max()), int(changed.size), margin)
