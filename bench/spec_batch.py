"""`python -m bench.spec_batch`: speculation inside the batch (issue #17 item 1) on the in-process
paged ``batched_ring``, INT4 2-stage shards in exact mode at one thread per stage.

At 1, 4 and 8 concurrent users (each its own prompt, BENCH_TOKENS tokens, eos ignored), plain
decoding against every user speculating with the best draft source (adaptive, batch-aware K), and
at 4 and 8 users the same draft with K chosen as if alone (``batch_aware_k`` off). The best source
is the faster of prompt lookup and the self-draft at 1 user in a short pre-pass (BENCH_SOURCES).
Configurations run once per shuffled round, BENCH_RUNS rounds after a warm-up round; a ratio is
the ratio of median aggregate tok/s (all users' tokens / the round's wall time) with its 95%
bootstrap interval.

Natural text only: each prompt's greedy answer (the plain rounds' tokens) must hold no 4-gram more
than 3 times within BENCH_TOKENS, else the prompt is dropped before the measured rounds (a loop is
what prompt lookup predicts perfectly); the kept set's repetition rate (repeated 4-grams / all
4-grams) is reported with every speculative figure. Exactness: every speculative user's tokens
must equal its plain greedy answer (``exact_ok``).

Batch-aware K times T from the ring's own steps (the step batcher, send to result, once for all
sessions, over rows and positions); the JSON reports the terms it ended with
(``batcher_step_line_ms``).

First, the cost model of batch-aware K (services/coordinator/speculation/policy.py): one step of
the two paged stages against its rows and tokens (decode rows of 1 token, verify rows of 4-16),
configurations interleaved, median process CPU time and wall time per step (CPU time, because the
machine is shared: wall time there measures the neighbours), and a least-squares line
``cpu_ms = a + b * tokens + c * rows``.

Knobs: BENCH_RUNS (10), BENCH_TOKENS (128), BENCH_USERS (1,4,8), BENCH_SOURCES (ngram,self),
BENCH_SELF_DRAFT (a draft export; default the 4-layer, 8192-token self-draft of bench-spec).
"""

from __future__ import annotations

import asyncio
import collections
import os
import statistics
import sys
import time

import numpy as np

from bench.pipeline import ensure_export
from bench.spec import SELF_DRAFT
from bench.stats import command_with_knobs, interleaved, median, ratio_ci, write_result
from pipeshard import paths
from pipeshard.offline import set_offline_defaults
from pipeshard.services.coordinator.generation import Generation, Summary
from pipeshard.services.coordinator.in_process import batched_ring
from pipeshard.services.coordinator.ring import Ring
from pipeshard.services.coordinator.sampling import SamplingParams
from pipeshard.services.coordinator.speculation.sources import DraftSources
from pipeshard.shard.paged import PagedRow
from pipeshard.shard.prompting import Prompter

RUNS = int(os.environ.get("BENCH_RUNS", "10"))
TOKENS = int(os.environ.get("BENCH_TOKENS", "128"))
USERS = tuple(int(u) for u in os.environ.get("BENCH_USERS", "1,4,8").split(","))
SOURCES = tuple(os.environ.get("BENCH_SOURCES", "ngram,self").split(","))
KNOBS = ("BENCH_RUNS", "BENCH_TOKENS", "BENCH_USERS", "BENCH_SOURCES", "BENCH_SELF_DRAFT")
MAX_REPEAT = 3  # a 4-gram seen more often than this in a greedy answer marks a loop

# Candidate prompts, more than the largest user count: those whose answers loop are dropped.
PROMPTS = (
    "Write a short story about a lighthouse keeper.",
    "Describe how bread is made, step by step.",
    "What are the main causes of the seasons on Earth?",
    "Give advice to someone learning to play the guitar.",
    "Compare trains and planes for travel in Europe.",
    "Why do cats purr? Explain what is known.",
    "Write a Python function that merges two sorted lists, and explain it.",
    "Summarize the plot of Romeo and Juliet.",
    "What should I pack for a week of hiking in the Alps?",
    "Explain how vaccines train the immune system.",
    "Write a polite email asking a colleague to review my report.",
    "List the planets of the solar system with one fact about each.",
    "How does a bill become a law in the United States?",
    "Explain the difference between weather and climate.",
    "Describe a typical day in the life of a honeybee.",
    "What are some good habits for studying effectively?",
    "Explain how a credit card works and what interest is.",
    "Write a short review of a fictional Italian restaurant.",
    "How do airplanes stay in the air?",
    "Give me three ideas for a birthday party for a ten-year-old.",
    "Explain what photosynthesis is to a child.",
    "What is the history of the Eiffel Tower?",
)


# Step shapes for the cost model: name -> tokens of each row.
STEP_SHAPES = {
    "1x1": [1],
    "2x1": [1] * 2,
    "4x1": [1] * 4,
    "8x1": [1] * 8,
    "16x1": [1] * 16,
    "1x4": [4],
    "1x8": [8],
    "1x16": [16],
    "4x1+1x4": [1] * 4 + [4],
    "8x1+1x4": [1] * 8 + [4],
    "8x1+1x8": [1] * 8 + [8],
    "4x4": [4] * 4,
    "8x4": [4] * 8,
}
STEP_CONTEXT = 160  # cached tokens of every row's sequence


def step_cost(ring: Ring, rounds: int) -> dict:
    """Median CPU and wall milliseconds of one step through every stage, per STEP_SHAPES entry,
    and the fitted line cpu_ms = a + b * tokens + c * rows."""
    shards = ring.stages.shards
    keys = [("cost", i) for i in range(16)]
    for shard in shards:
        for key in keys:
            shard.open(key, STEP_CONTEXT + 32)
    for key in keys:  # fill each sequence's context through both stages
        x = np.zeros(STEP_CONTEXT, dtype=np.int64)
        for shard in shards:
            x = shard.step([PagedRow(key, x)])[0]

    def once(shape: list[int]) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        h = None
        for shard in shards:
            rows = [
                PagedRow(
                    keys[j],
                    np.ones(t, dtype=np.int64) if shard.is_first else h[j],
                    np.arange(STEP_CONTEXT, STEP_CONTEXT + t),
                    logits=t if shard.is_last else 0,
                )
                for j, t in enumerate(shape)
            ]
            h = shard.step(rows)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        for shard in shards:
            for key in keys[: len(shape)]:
                shard.rewind(key, STEP_CONTEXT)
        return wall * 1e3, cpu * 1e3

    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in STEP_SHAPES}
    for r in range(rounds + 2):  # two warm-up rounds: the plugin prepares each new shape
        for name, shape in STEP_SHAPES.items():
            value = once(shape)
            if r >= 2:
                samples[name].append(value)
    for shard in shards:
        for key in keys:
            shard.free(key)
    table = {
        name: {
            "tokens": sum(STEP_SHAPES[name]),
            "rows": len(STEP_SHAPES[name]),
            "cpu_ms": statistics.median(c for _, c in v),
            "wall_ms": statistics.median(w for w, _ in v),
        }
        for name, v in samples.items()
    }
    design = np.array([[1.0, t["tokens"], t["rows"]] for t in table.values()])
    a, b, c = np.linalg.lstsq(design, np.array([t["cpu_ms"] for t in table.values()]), rcond=None)[0]
    return {"shapes": table, "fit_cpu_ms": {"fixed": a, "per_token": b, "per_row": c}}


def batcher_line(ring: Ring) -> dict:
    """The step cost batch-aware K used at the end of the run: what the ring's step batcher
    fitted from its decode steps' wall times (ms fixed, per row, per position, per verify step)."""
    cost = ring.batch_steps.timing.cost()
    if cost is None:
        return {}
    return {
        "fixed": cost.fixed * 1e3,
        "per_row": cost.per_row * 1e3,
        "per_position": cost.per_position * 1e3,
        "verify": cost.verify * 1e3,
    }


def most_repeated(tokens: list[int], n: int = 4) -> int:
    """How often the most frequent n-gram occurs."""
    grams = collections.Counter(tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))
    return max(grams.values(), default=0)


def repetition_rate(answers: list[list[int]], n: int = 4) -> float:
    """Share of the answers' n-grams that repeat an earlier n-gram of the same answer."""
    total = repeated = 0
    for tokens in answers:
        grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
        total += len(grams)
        repeated += len(grams) - len(set(grams))
    return repeated / total if total else 0.0


class Users:
    """The ring, one Generation per K mode, and the kept prompts' ids."""

    def __init__(self, export, self_draft):
        self.prompter = Prompter.from_dir(export)
        self.ring = batched_ring(export, "exact", 1, cache_bytes=256 << 20)
        self.ring.stages.warmup()
        drafts = DraftSources(export, self_draft=self_draft)
        self.generations = {
            aware: Generation(
                self.ring,
                self.prompter.tokenizer,
                self.prompter.eos_ids,
                prefill_chunk=self.ring.prefill_chunk,
                drafts=drafts,
                batch_aware_k=aware,
            )
            for aware in (True, False)
        }
        self.ids = [self.prompter.encode("", [("user", p)]) for p in PROMPTS]
        self.loop = asyncio.new_event_loop()

    async def _one(self, i: int, mode: str, aware: bool) -> Summary:
        params = SamplingParams(max_tokens=TOKENS, ignore_eos=True)
        summary = None
        async for event in self.generations[aware].run(self.ids[i], params, speculative=mode, k=0):
            if isinstance(event, Summary):
                summary = event
        return summary

    def run(self, users: int, mode: str, aware: bool = True) -> tuple[float, list[Summary]]:
        """``users`` users at once (prompts 0..users-1): aggregate tok/s and their summaries."""

        async def all_users():
            return await asyncio.gather(*(self._one(i, mode, aware) for i in range(users)))

        start = time.perf_counter()
        out = self.loop.run_until_complete(all_users())
        return sum(s.completion_tokens for s in out) / (time.perf_counter() - start), out


def self_draft_export():
    """BENCH_SELF_DRAFT, else bench-spec's self-draft (exported once under shards/)."""
    from pathlib import Path

    from pipeshard.exporter.draft import export_draft

    if os.environ.get("BENCH_SELF_DRAFT"):
        return Path(os.environ["BENCH_SELF_DRAFT"])
    out = paths.shards_dir() / paths.draft_export_name(
        paths.DEFAULT_MODEL, SELF_DRAFT["layers"], SELF_DRAFT["vocab"], "int4"
    )
    if not (out / "manifest.json").exists():
        export_draft(paths.default_model_dir(), out, layers=SELF_DRAFT["layers"], vocab=SELF_DRAFT["vocab"])
    return out


def main() -> int:
    set_offline_defaults()
    users = Users(ensure_export(2), self_draft_export())
    try:
        return measure(users)
    finally:
        users.loop.run_until_complete(users.ring.close())


def measure(users: Users) -> int:
    cost = step_cost(users.ring, max(5, RUNS))
    print(f"step cost fit (CPU ms): {cost['fit_cpu_ms']}", file=sys.stderr)

    # Greedy answers of every candidate (one batch: exact mode gives each its solo tokens).
    _, plain = users.run(len(PROMPTS), "none")
    loops = {PROMPTS[i]: most_repeated(s.token_ids) for i, s in enumerate(plain)}
    kept = [i for i, s in enumerate(plain) if most_repeated(s.token_ids) <= MAX_REPEAT]
    if len(kept) < max(USERS):
        raise SystemExit(f"only {len(kept)} prompts answer without a loop; need {max(USERS)}: {loops}")
    answers = {i: plain[i].token_ids for i in kept}
    users.ids = [users.ids[i] for i in kept]
    greedy = [answers[i] for i in kept]
    rate = repetition_rate(greedy[: max(USERS)])
    print(f"kept {len(kept)} of {len(PROMPTS)} prompts; repetition rate {rate:.3f}", file=sys.stderr)

    # The best draft source: the fastest at one user, adaptive K (a short pre-pass).
    pre = interleaved({m: (lambda m=m: users.run(1, m)[0]) for m in SOURCES}, max(3, RUNS // 3), warmup=1)
    best = max(SOURCES, key=lambda m: median(pre[m]))
    print(f"best draft source at 1 user: {best} ({ {m: round(median(v), 1) for m, v in pre.items()} })")

    exact_ok = True
    spec_stats: dict[str, dict] = {}

    def config(n: int, mode: str, aware: bool = True):
        name = f"{'plain' if mode == 'none' else 'spec' if aware else 'spec_blind'}_{n}"

        def run() -> float:
            nonlocal exact_ok
            tok_s, out = users.run(n, mode, aware)
            exact_ok &= all(s.token_ids == greedy[i] for i, s in enumerate(out))
            if mode != "none":
                drafted, kept = sum(s.draft_tokens for s in out), sum(s.accepted_tokens for s in out)
                tokens = sum(s.completion_tokens for s in out)
                spec_stats[name] = {
                    "acceptance": kept / max(1, drafted),
                    "mean_k": drafted / max(1, sum(s.verify_steps for s in out)),
                    "tokens_per_step": tokens / max(1, tokens - kept),
                }
            return tok_s

        return name, run

    configs = dict(config(n, "none") for n in USERS)
    configs |= dict(config(n, best) for n in USERS)
    configs |= dict(config(n, best, aware=False) for n in USERS if n > 1)
    samples = interleaved(configs, RUNS, warmup=1)

    result: dict = {
        "runs": RUNS,
        "tokens": TOKENS,
        "tok_s": {name: median(v) for name, v in samples.items()},
        "best_source": best,
        "source_tok_s_1_user": {m: median(v) for m, v in pre.items()},
        "repetition_rate": rate,
        "prompts_dropped_for_loops": [PROMPTS[i] for i in range(len(PROMPTS)) if i not in kept],
        "exact_ok": exact_ok,
        "spec": spec_stats,
        "baselines": "spec_N over plain_N; spec_N over spec_blind_N (K chosen as if alone)",
        "precision": "exact, 1 thread per stage, INT4 2 stages, in-process batched_ring",
        "step_cost": cost,
        "batcher_step_line_ms": batcher_line(users.ring),
    }
    for n in USERS:
        r, ci = ratio_ci(samples[f"spec_{n}"], samples[f"plain_{n}"])
        result[f"spec_over_plain_{n}_users"], result[f"spec_over_plain_{n}_users_ci"] = r, ci
        result[f"spec_over_plain_{n}_users_repetition_rate"] = rate
        if n > 1:
            r, ci = ratio_ci(samples[f"spec_{n}"], samples[f"spec_blind_{n}"])
            result[f"batch_aware_k_gain_{n}_users"], result[f"batch_aware_k_gain_{n}_users_ci"] = r, ci
    write_result(
        "spec_batch",
        result,
        command_with_knobs("bench-spec-batch", KNOBS).replace(
            "make bench-spec-batch", "python -m bench.spec_batch"
        ),
    )
    return 0 if exact_ok else 1


if __name__ == "__main__":
    sys.exit(main())
