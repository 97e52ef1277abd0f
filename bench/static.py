"""`make bench-static`: static stateless shards (``export --static``) against the paged backend on CPU.

Both backends run in this process through the ring ``generate --local`` uses (batched_ring: the
paged ring, or the static one for a static export), exact mode, the same INT4 weights and stage
split. Interleaved rounds, ratios of medians with bootstrap intervals:

  static_over_paged_1user      decode tok/s of one session, static over paged
  static_over_paged_full       decode tok/s summed over S sessions at once (S = the export's slots)
  static_ttft_over_paged_128   TTFT of a 128-token prompt, static over paged (lower is better)
  static_ttft_over_paged_1024  the same at 1,024 tokens
  static_exact                 greedy tokens of BENCH_EXACT_PROMPTS prompts (at once) over
                               BENCH_EXACT_TOKENS tokens equal the paged backend's (alone); the
                               tests check 128 tokens on 1, 2 and 3 stages
  cached_start_over_cold       a static stage process's start to SERVING with its compiled-model
                               cache over without (bench/compile_cache.py's measure)

Also: the teacher-forced logit difference between the backends over the paged tokens
(``logit_diff``: max and median |static - paged| per position, and the smallest top-1 margin
seen), compile seconds per stage (both backends), the KV bytes each backend holds per stage, the
stage's time writing new K/V rows into its buffers and per decode and chunk step, the
first inference over the next (``step_costs``), and the process's peak RSS.

Knobs (environment): BENCH_RUNS (default 3), BENCH_WARMUP (1), BENCH_TOKENS (decode tokens, 32),
BENCH_THREADS (inference threads per stage, 1; 0: the plugin's choice), BENCH_SLOTS / BENCH_CHUNK /
BENCH_CONTEXT (the static export's shapes, 4 / 16 / 1280), BENCH_STATIC_SHARDS and BENCH_SHARDS
(the static and the paged 2-stage exports; exported under the shards dir when missing),
BENCH_EXACT_PROMPTS (2), BENCH_EXACT_TOKENS (128), BENCH_START_RUNS (compile-cache rounds, 3).
"""

from __future__ import annotations

import asyncio
import os
import resource
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.compile_cache import start_stage
from bench.stats import command_with_knobs, interleaved, ratio_ci, summary, write_result
from pipeshard import paths
from pipeshard.offline import set_offline_defaults
from pipeshard.services.coordinator.generation import Generation, Summary
from pipeshard.services.coordinator.in_process import batched_ring
from pipeshard.services.coordinator.sampling import SamplingParams
from pipeshard.shard.manifest import StaticLayout
from pipeshard.shard.paged import PagedRow, PagedShard
from pipeshard.shard.prompting import Prompter
from pipeshard.shard.static import StaticRow, StaticShard

RUNS = int(os.environ.get("BENCH_RUNS", "3"))
WARMUP = int(os.environ.get("BENCH_WARMUP", "1"))
TOKENS = int(os.environ.get("BENCH_TOKENS", "32"))
THREADS = int(os.environ.get("BENCH_THREADS", "1")) or None
SLOTS = int(os.environ.get("BENCH_SLOTS", "4"))
CHUNK = int(os.environ.get("BENCH_CHUNK", "16"))
CONTEXT = int(os.environ.get("BENCH_CONTEXT", "1280"))
EXACT_PROMPTS = int(os.environ.get("BENCH_EXACT_PROMPTS", "2"))
START_RUNS = int(os.environ.get("BENCH_START_RUNS", "3"))
EXACT_TOKENS = int(os.environ.get("BENCH_EXACT_TOKENS", "128"))
KNOBS = (
    "BENCH_EXACT_TOKENS",
    "BENCH_RUNS",
    "BENCH_WARMUP",
    "BENCH_TOKENS",
    "BENCH_THREADS",
    "BENCH_SLOTS",
    "BENCH_CHUNK",
    "BENCH_CONTEXT",
    "BENCH_STATIC_SHARDS",
    "BENCH_SHARDS",
    "BENCH_EXACT_PROMPTS",
    "BENCH_START_RUNS",
)
PROMPTS = (
    "What is the capital of France?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "List five fruits that are red.",
    "Write a short poem about the sea.",
)


def exports() -> tuple[Path, Path]:
    """The static and the paged 2-stage INT4 exports (made when missing)."""
    from pipeshard.exporter.export import export_model

    model = paths.default_model_dir()
    paged = Path(
        os.environ.get("BENCH_SHARDS")
        or paths.shards_dir() / paths.export_name(paths.DEFAULT_MODEL, 2, "int4")
    )
    static = Path(
        os.environ.get("BENCH_STATIC_SHARDS")
        or paths.shards_dir()
        / f"{paths.export_name(paths.DEFAULT_MODEL, 2, 'int4')}-static{SLOTS}x{CHUNK}-{CONTEXT}"
    )
    if not (paged / "manifest.json").exists():
        export_model(model, paged, stages=2, weights="int4")
    if not (static / "manifest.json").exists():
        export_model(model, static, stages=2, max_context=CONTEXT, static=StaticLayout(SLOTS, CHUNK))
    return static, paged


def prompt_of(prompter: Prompter, tokens: int) -> list[int]:
    """A chat prompt of exactly ``tokens`` ids (a counting text, cut)."""
    text = "Repeat these numbers: " + " ".join(str(n) for n in range(tokens))
    return prompter.encode("", [("user", text)])[:tokens]


class Backend:
    """One backend's ring and generation, run to completion per call."""

    def __init__(self, export: Path, prompter: Prompter):
        self.ring = batched_ring(export, "exact", THREADS)
        self.ring.stages.warmup()
        self.generation = Generation(
            self.ring, prompter.tokenizer, prompter.eos_ids, prefill_chunk=self.ring.prefill_chunk
        )

    def run(self, prompts: list[list[int]], tokens: int) -> list[Summary]:
        params = SamplingParams(max_tokens=tokens, ignore_eos=True)

        async def one(ids: list[int]) -> Summary:
            return [e async for e in self.generation.run(list(ids), params)][-1]

        async def all_at_once() -> list[Summary]:
            return list(await asyncio.gather(*(one(ids) for ids in prompts)))

        return asyncio.run(all_at_once())


def decode_tok_s(backend: Backend, prompts: list[list[int]]) -> float:
    """Tokens per second summed over the sessions (each session's own decode rate)."""
    return sum(s.tok_s for s in backend.run(prompts, TOKENS))


def ttft_ms(backend: Backend, prompt: list[int]) -> float:
    return backend.run([prompt], 1)[0].ttft_ms


def teacher_forced(s_shards: list[StaticShard], p_shards: list[PagedShard], ids: list[int]) -> dict:
    """Logits of every position of ``ids`` from both backends' stage chains (static in its
    chunks, paged in one row), compared: max and median |difference|, the smallest top-1 margin,
    and the positions whose greedy pick differs."""
    n, x = len(ids), np.asarray(ids, np.int64)
    for shard in p_shards:
        shard.open("tf", n)
    hidden = p_shards[0].step([PagedRow("tf", x, np.arange(n))])[0]
    paged_logits = p_shards[1].step([PagedRow("tf", hidden, np.arange(n), logits=n)])[0]
    slots = [shard.acquire() for shard in s_shards]
    static_logits = []
    for start in range(0, n, CHUNK):
        pos = np.arange(start, min(n, start + CHUNK))
        h = s_shards[0].step([StaticRow(slots[0], start, x[pos], pos)])[0]
        static_logits.append(s_shards[1].step([StaticRow(slots[1], start, h, pos, logits=len(pos))])[0])
    for shard, slot in zip(s_shards, slots, strict=True):
        shard.release(slot)
    for shard in p_shards:
        shard.free("tf")
    static_all = np.concatenate(static_logits)
    diff = np.abs(static_all - paged_logits).max(axis=-1)
    top2 = np.sort(paged_logits, axis=-1)[:, -2:]
    flips = np.nonzero(static_all.argmax(-1) != paged_logits.argmax(-1))[0]
    return {
        "positions": n,
        "max_abs": float(diff.max()),
        "median_abs": float(np.median(diff)),
        "min_top1_margin": float((top2[:, 1] - top2[:, 0]).min()),
        "argmax_flips": [int(i) for i in flips],
    }


def step_costs(export: Path, reps: int = 50) -> dict:
    """On a freshly compiled stage 0: what a step spends writing a decode row's and a full chunk's
    new K/V into the buffers (the copy the bound output buffers leave), beside whole inferences:
    a decode step (the [S, 1] twin when the export has one), a chunk step, and the compiled
    model's first inference over the next (static shapes leave no kernel preparation to a first
    inference, so the stage skips warm-up)."""
    shard = StaticShard(export, 0, num_threads=THREADS)
    caches, news = list(shard._cache.values()), list(shard._chunked.new.values())

    def write(t: int) -> float:
        started = time.perf_counter_ns()
        for _ in range(reps):
            for buf, new in zip(caches, news, strict=True):
                buf[0, :, 100 : 100 + t] = new[0, :, :t]
        return (time.perf_counter_ns() - started) / reps / 1000

    def timed(t: int, start: int) -> float:
        pos = np.arange(start, start + t)
        x = pos if shard.is_first else np.zeros((t, shard.hidden_size), np.float32)
        started = time.perf_counter_ns()
        shard.step([StaticRow(slot, start, x, pos, logits=1 if shard.is_last else 0)])
        return (time.perf_counter_ns() - started) / 1000

    slot = shard.acquire()
    try:
        first, chunk = timed(CHUNK, 0), timed(CHUNK, CHUNK)
        decode = sorted(timed(1, 2 * CHUNK + i) for i in range(5))[2]
    finally:
        shard.release(slot)
    return {
        "decode_row_write_us": round(write(1), 1),
        "chunk_write_us": round(write(CHUNK), 1),
        "decode_step_us": round(decode, 1),
        "chunk_step_us": round(chunk, 1),
        "first_inference_over_next": round(first / chunk, 3),
        "decode_twin": bool(shard.entry.decode_model),
    }


def start_ratio(static: Path) -> dict:
    """bench/compile_cache.py's measure on a static export's last stage."""
    with tempfile.TemporaryDirectory(prefix="bench-static-start-") as tmp:
        run_dir, cache = Path(tmp) / "run", Path(tmp) / "cache"
        run_dir.mkdir()
        extra = {"cold": ["--compile-cache-dir", "off"], "cached": ["--compile-cache-dir", str(cache)]}
        compiles: dict[str, list[float]] = {"cold": [], "cached": []}
        start_stage(static, run_dir, extra["cached"], [])  # fills the cache
        samples = interleaved(
            {n: (lambda n=n: start_stage(static, run_dir, extra[n], compiles[n])) for n in extra},
            START_RUNS,
            0,
        )
    ratio, ci = ratio_ci(samples["cached"], samples["cold"])
    return {
        "start_s": {n: summary(v) for n, v in samples.items()},
        "compile_s": {n: summary(v) for n, v in compiles.items()},
        "cached_start_over_cold": round(ratio, 3),
        "cached_start_over_cold_ci": [round(x, 3) for x in ci],
    }


def main() -> None:
    set_offline_defaults()
    static_dir, paged_dir = exports()
    prompter = Prompter.from_dir(static_dir)
    chats = [prompter.encode("", [("user", p)]) for p in PROMPTS]
    backends = {"static": Backend(static_dir, prompter), "paged": Backend(paged_dir, prompter)}

    exact = {
        "static": [s.token_ids for s in backends["static"].run(chats[:EXACT_PROMPTS], EXACT_TOKENS)],
        "paged": [backends["paged"].run([ids], EXACT_TOKENS)[0].token_ids for ids in chats[:EXACT_PROMPTS]],
    }
    static_exact = exact["static"] == exact["paged"]
    first_divergence = [
        next((i for i, (a, b) in enumerate(zip(s, p, strict=True)) if a != b), None)
        for s, p in zip(exact["static"], exact["paged"], strict=True)
    ]
    s_shards, p_shards = backends["static"].ring.stages.shards, backends["paged"].ring.stages.shards
    logit_diff = teacher_forced(s_shards, p_shards, chats[0] + exact["paged"][0])
    memory = {
        "static_kv_bytes_per_stage": [s.cache_bytes for s in s_shards],
        "static_kv_positions_per_stage": SLOTS * CONTEXT,
        "paged_kv_bytes_per_stage": [s.cache_bytes for s in p_shards],
        "compile_s_per_stage": {
            "static": [s.compile_seconds for s in s_shards],
            "paged": [s.compile_seconds for s in p_shards],
        },
        "step_costs": step_costs(static_dir),
    }

    long_prompts = {n: prompt_of(prompter, n) for n in (128, 1024)}
    configs = {}
    for name, backend in backends.items():
        configs[f"{name}_1user"] = lambda b=backend: decode_tok_s(b, chats[:1])
        configs[f"{name}_full"] = lambda b=backend: decode_tok_s(b, (chats * SLOTS)[:SLOTS])
        for n, ids in long_prompts.items():
            configs[f"{name}_ttft_{n}"] = lambda b=backend, ids=ids: ttft_ms(b, ids)
    samples = interleaved(configs, RUNS, WARMUP)
    result: dict = {
        "runs": RUNS,
        "tokens": TOKENS,
        "threads": THREADS,
        "slots": SLOTS,
        "chunk": CHUNK,
        "context": CONTEXT,
        "exact_tokens": EXACT_TOKENS,
        "exact_prompts": EXACT_PROMPTS,
    }
    for key, num, den in (
        ("static_over_paged_1user", "static_1user", "paged_1user"),
        ("static_over_paged_full", "static_full", "paged_full"),
        ("static_ttft_over_paged_128", "static_ttft_128", "paged_ttft_128"),
        ("static_ttft_over_paged_1024", "static_ttft_1024", "paged_ttft_1024"),
    ):
        ratio, ci = ratio_ci(samples[num], samples[den])
        result[key], result[f"{key}_ci"] = round(ratio, 3), [round(x, 3) for x in ci]
    del backends
    result |= {
        "static_exact": static_exact,
        "first_divergence": first_divergence,
        "logit_diff": logit_diff,
        "memory_and_compile": memory,
        **start_ratio(static_dir),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "measured": {name: summary(values) for name, values in samples.items()},
        "samples": samples,
        "shards": {"static": str(static_dir), "paged": str(paged_dir)},
    }
    write_result("static", result, command_with_knobs("bench-static", KNOBS))


if __name__ == "__main__":
    main()
