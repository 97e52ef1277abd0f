"""What speculation's parts cost, for `make bench-spec`: the physical KV trim the mask-based
rewind replaces, a draft model's step against the target's, and the bytes a feature draft adds
to the final stage's return link."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np

from bench.stats import median


def _timed_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return median(times) * 1000.0


def trim_cost(target: Path, prompt: list[int]) -> float:
    """Seconds per physical trim of a 300-token stateful cache."""
    from pipeshard.shard.runtime import ShardRunner, time_trim

    session = ShardRunner(target, 0).new_session()
    session.run([(prompt * 8)[:300]])
    return time_trim(session, reps=50)


def token_draft_costs(target: Path, drafts: dict[str, Path]) -> dict:
    """Milliseconds of a one-token step: the target (1-stage export) against each draft export."""
    from pipeshard.shard.runtime import ShardRunner

    def per_token(runner: ShardRunner) -> float:
        session = runner.new_session()
        session.run(np.zeros((1, 32), dtype=np.int64))
        return _timed_ms(lambda: session.run(np.zeros((1, 1), dtype=np.int64), copy=False), 100)

    target_ms = per_token(ShardRunner(target, 0))
    out = {"target_ms": target_ms}
    for name, export in drafts.items():
        draft_ms = per_token(ShardRunner(export, 0))
        out[f"{name}_ms"] = draft_ms
        out[f"{name}_over_target"] = draft_ms / target_ms
    return out


def feature_bytes(target: Path, ks: tuple[int, ...] = (0, 4, 10)) -> dict:
    """Bytes of a final stage's StepResult (Top1 return) with and without the fp16 features, for
    a decode step and K-draft verifies."""
    from pipeshard.services.stage.domain import RowKind, StepOutput, StepRow, top1_of
    from pipeshard.services.stage.wire import result_from_output
    from pipeshard.shard.manifest import load_manifest

    hidden = load_manifest(target).model.hidden_size
    rng = np.random.default_rng(0)
    out = {}
    for k in ks:
        row = StepRow("s" * 32, 7, RowKind.DECODE, np.arange(k + 1), np.zeros((1, k + 1), dtype=np.int64))
        top1 = top1_of(rng.standard_normal((k + 1, 64)).astype(np.float32))
        without = result_from_output(StepOutput(row, top1=top1), [100, 100]).ByteSize()
        features = rng.standard_normal((k + 1, hidden)).astype(np.float32)
        with_features = result_from_output(
            StepOutput(row, top1=top1, features=features), [100, 100]
        ).ByteSize()
        out[f"k{k}"] = {"without": without, "with": with_features, "extra": with_features - without}
    return out


def feature_draft_cost(target: Path, draft: Path, reps: int = 200) -> dict:
    """Milliseconds per drafted token (a step's feature observed, then a 5-token chain, after 128
    kept positions) of the served numpy drafter, against the target's one-token decode step
    (every stage in this process): #31 bounds it at a quarter."""
    from pipeshard.services.coordinator.speculation.sources import DraftSources
    from pipeshard.shard.chain import LocalChain
    from pipeshard.shard.manifest import load_manifest

    drafter = asyncio.run(DraftSources(target, feature=draft).factory("feature"))()
    hidden = load_manifest(target).model.hidden_size
    rng = np.random.default_rng(0)
    drafter.observe(rng.standard_normal((128, hidden)).astype(np.float32))
    context = [42] * 129
    kept = rng.standard_normal((1, hidden)).astype(np.float32)

    def step() -> None:
        # a step's own feature first: the drafter reuses its levels until the next observe, so
        # proposing twice after one observe would time a lookup
        drafter.observe(kept)
        drafter.propose(context, 5, None)

    numpy_ms = _timed_ms(step, reps) / 5
    chain = LocalChain(target)
    chain.step(np.asarray([[1] * 64]))
    target_ms = _timed_ms(lambda: chain.step(np.asarray([[42]])), 100)
    return {
        "draft_ms_per_token": numpy_ms,
        "target_decode_ms": target_ms,
        "cost_vs_target": numpy_ms / target_ms,
    }


def draft_heads_cost(target: Path, heads: Path, reps: int = 200) -> dict:
    """Milliseconds the final stage's draft heads add to a step (K heads at one position, their
    top candidates), against the target's one-token decode step (every stage in this process)."""
    from pipeshard.shard.chain import LocalChain
    from pipeshard.shard.draft_heads import DraftHeads

    model = DraftHeads(heads)
    f = np.random.default_rng(0).standard_normal(model.meta.hidden_size).astype(np.float32)
    heads_ms = _timed_ms(lambda: model.candidates(f, 4), reps)
    chain = LocalChain(target)
    chain.step(np.asarray([[1] * 64]))
    target_ms = _timed_ms(lambda: chain.step(np.asarray([[42]])), 100)
    return {
        "heads": model.heads,
        "heads_ms_per_step": heads_ms,
        "target_decode_ms": target_ms,
        "cost_vs_target": heads_ms / target_ms,
    }


def feature_agreement(
    target: Path, draft: Path, prompts: list[list[int]], kinds: list[str], tokens: int
) -> dict:
    """Teacher-forced on the target's own greedy answers (``exact``) to the measured prompts, per
    kind: how often the served draft's first token is the target's argmax (``first``), the mean
    length a 3-token chain keeps (``chain3``), and the share of the target's answer tokens outside
    the draft's head slice (``outside_slice``, which no draft can be right on). It separates what
    a draft predicts from what serving does with it."""
    from pipeshard.exporter.target_texts import generate_features
    from pipeshard.services.coordinator.speculation.sources import DraftSources
    from pipeshard.shard.draft_folder import WEIGHTS
    from pipeshard.shard.feature_draft import read_meta

    make = asyncio.run(DraftSources(target, feature=draft).factory("feature"))
    meta = read_meta(draft)
    data = generate_features(target, prompts, tokens, lambda *a: None, batch=len(prompts))
    sliced = np.zeros(meta.vocab_size, dtype=bool)
    with np.load(draft / WEIGHTS) as weights:
        sliced[weights["head_ids"]] = True
    out: dict = {}
    for i, kind in enumerate(kinds):
        ids, top, features = data.ids[i], data.argmax[i], data.features[i].astype(np.float32)
        start = data.answer_start(i)
        starts = np.arange(start, len(ids) - 3)
        if not len(starts):
            continue
        hits = np.zeros(3)
        for r in starts:  # the served drafter, its cache holding the answer's kept positions to r
            drafter = make()
            drafter.observe(features[start : r + 1])
            guesses = drafter.follow(ids[: r + 2], ids[r + 2 : r + 5])
            agree = np.cumprod([g == t for g, t in zip(guesses, top[r + 1 : r + 4], strict=False)])
            hits[: len(agree)] += agree
        out[kind] = {
            "positions": len(starts),
            "first": float(hits[0] / len(starts)),
            "chain3": float(hits.sum() / len(starts)),
            "outside_slice": float((~sliced[top[starts + 1]]).mean()),
        }
    out["mean_first"] = float(np.mean([v["first"] for v in out.values()]))
    return out
