"""Batch-dimension stacking against interleaving, on the 1-stage INT4 shard in this process.

B sessions each decoding one token per step as B batch-1 requests run one after another
(interleaving, what the fleet does) against one request of batch B (the same prompt in every
row, so no padding): the shard's inputs and its KV state have a dynamic batch dimension, and
stacking reads the INT4 weights once per step for all B rows. Greedy; each batch row's tokens
must equal the batch-1 tokens: at the CPU's default (bf16) precision a batched kernel that
rounds differently would be an isolation failure; the same check runs on the shard compiled at f32.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from bench.stats import interleaved, ratio_ci, summary
from pipeshard.shard.runtime import ShardRunner

BATCHES = (1, 2, 4)
STEPS = 64  # decode steps after the prompt


def decode(requests: list, batch: int, prompt: list[int], steps: int) -> tuple[list[list[int]], float]:
    """Prefill every request (``batch`` rows of ``prompt`` each), then ``steps`` greedy decode
    steps, the requests taking turns; the greedy tokens of every row and the decode seconds."""
    n = len(prompt)
    beam = np.arange(batch, dtype=np.int32)
    keep = np.ones((), dtype=np.int64)

    def infer(req, ids: np.ndarray, start: int) -> np.ndarray:
        t = ids.shape[1]
        req.infer(
            {
                "input_ids": ids,
                "attention_mask": np.ones((batch, start + t), np.int64),
                "position_ids": np.tile(np.arange(start, start + t, dtype=np.int64), (batch, 1)),
                "logits_to_keep": keep,
                "beam_idx": beam,
            }
        )
        return req.get_tensor("logits").data[:, -1].argmax(-1)

    ids = np.tile(np.asarray(prompt, np.int64), (batch, 1))
    rows = []
    for req in requests:
        req.reset_state()
        rows.append([infer(req, ids, 0)])
    t0 = time.perf_counter()
    for step in range(steps):
        for r, req in enumerate(requests):
            rows[r].append(infer(req, rows[r][-1][:, None].astype(np.int64), n + step))
    seconds = time.perf_counter() - t0
    tokens = [[int(t) for t in col] for r in rows for col in np.stack(r, axis=1)]
    return tokens, seconds


def _first_difference(tokens: list[int], reference: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(tokens, reference, strict=True)) if a != b), None)


def measure(shard: Path, prompt: list[int], runs: int) -> dict:
    """Decode tok/s of interleaving (``a_B``) and stacking (``b_B``) in shuffled rounds."""
    compiled = ShardRunner(shard, 0).compiled
    batch_shape = compiled.input("input_ids").get_partial_shape()[0]
    if not batch_shape.is_dynamic:
        return {"possible": False, "reason": f"the shard's batch dimension is static ({batch_shape})"}
    solo = decode([compiled.create_infer_request()], 1, prompt, STEPS)[0][0]
    last: dict[str, list[list[int]]] = {}

    def runner(name: str, requests: list, batch: int):
        def run() -> float:
            last[name], seconds = decode(requests, batch, prompt, STEPS)
            return len(last[name]) * STEPS / seconds

        return run

    configs = {}
    for b in BATCHES:
        configs[f"a_{b}"] = runner(f"a_{b}", [compiled.create_infer_request() for _ in range(b)], 1)
        configs[f"b_{b}"] = runner(f"b_{b}", [compiled.create_infer_request()], b)
    samples = interleaved(configs, runs, warmup=1)
    out: dict = {"possible": True, "steps": STEPS, "batches": {}}
    for b in BATCHES:
        ratio, ci = ratio_ci(samples[f"b_{b}"], samples[f"a_{b}"])
        out["batches"][b] = {
            "interleaved_tok_s": summary(samples[f"a_{b}"]),
            "stacked_tok_s": summary(samples[f"b_{b}"]),
            "stacked_over_interleaved": ratio,
            "stacked_over_interleaved_ci": ci,
            # per batch row: the index of its first token that differs from batch 1, or None
            "first_difference": [_first_difference(row, solo) for row in last[f"b_{b}"]],
        }
    out["stacking_beats_interleaving"] = {
        b: v["stacked_over_interleaved_ci"][0] > 1 for b, v in out["batches"].items()
    }
    out["isolation_ok"] = all(d is None for v in out["batches"].values() for d in v["first_difference"])
    out["f32_first_difference"] = _f32_differences(shard, prompt)
    return out


def _f32_differences(shard: Path, prompt: list[int]) -> dict[int, list[int | None]]:
    """Whether stacking keeps outputs identical when the shard is compiled at f32 precision."""
    compiled = ShardRunner(shard, 0, "f32").compiled
    solo = decode([compiled.create_infer_request()], 1, prompt, STEPS)[0][0]
    return {
        b: [
            _first_difference(row, solo)
            for row in decode([compiled.create_infer_request()], b, prompt, STEPS)[0]
        ]
        for b in BATCHES[1:]
    }
