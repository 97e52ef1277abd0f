"""`make bench-precision-modes`: which CPU compile settings make paged batching, prefix caching,
chunking and speculation exact, and what each costs against ``fast`` (investigations for #16 /
#19; for #34 the new default against ``fast``, paired in one run).

Every candidate is a set of CPU properties (and inference threads per stage) compiled into the
in-process paged ``batched_ring`` on the INT4 2-stage export (bench/batched.py's rings and
prompts). For each:
  isolation  8 users with different prompts, BENCH_TOKENS tokens each, in one batch, against each
             user's solo run on the same ring: users identical, the share of positions agreeing,
             and at every first divergence the teacher-forced top-2 margin of the solo logits;
             every timed 8-user round is checked against the solo runs too;
  prefix     a 2-turn chat per prompt: turn 2 on a warm Generation (restoring turn 1's kept
             blocks) against turn 2 on a cold one (paged capture reads f32 pools only, so a
             candidate with another KV precision cannot keep blocks: reported as not applicable);
  paths      the first BENCH_PREFIX_PROMPTS users' prompts prefilled 7 tokens at a time, and with
             prompt lookup at K = 3 and at adaptive K, against their solo runs;
  speed      aggregate tok/s at 1 and 8 users and the TTFT of a ~1024-token prompt, all candidates
             in shuffled interleaved rounds; ratios of medians with 95% bootstrap intervals
             against ``fast``.
Top-level keys for #34: ``invariant_default`` (every cell of ``default`` identical: the 8 users
and every timed 8-user round against solo, warm == cold, chunked and speculative == solo),
``default_over_fast_1user``, ``default_over_fast_8users``, ``ttft_default_over_fast_1024``.
``python -m bench.precision_modes rows`` times a decode step of 8 and 16 users through both
shards for the default's configuration, it with one-token rows, it with a u8 cache, and ``fast``
(bench/results/precision_rows.json): which of the default's settings costs its tok/s.
``python -m bench.precision_modes kernels`` instead runs, per candidate, the stage-0 checks that
say which kernel path moves a row (bench/results/precision_kernels.json; a minute in all): a
decode row beside another sequence's chunk of M-1 tokens (M = 1..256) and after one of k tokens,
against M = 2 / k = 0; a prompt token computed inside its 64-token chunk against the same token
decoded alone after its prefix (what a restored prefix's suffix meets), alone and in a step padded
to 8 tokens with another sequence's; a 3-token verify chunk likewise; a prompt split 5 + 59.
Knobs: BENCH_CANDIDATES=a,b (default: DEFAULT_CANDIDATES), BENCH_ROUNDS (4) after one warm-up
round, BENCH_TOKENS (128), BENCH_PREFIX_PROMPTS (3), PIPESHARD_SHARDS_DIR (an existing
``smollm2-135m-instruct-2s-int4`` export there is used, else exported). Writes
bench/results/precision_modes.json.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import openvino as ov

from bench.batched import PROMPTS, LocalUsers, top2_margins
from bench.prefix import history
from bench.stats import command_with_knobs, interleaved, ratio_ci, summary, write_result
from pipeshard import paths
from pipeshard.offline import set_offline_defaults
from pipeshard.precision import CONFIGURATIONS
from pipeshard.services.coordinator.generation import Chunk, Generation, Summary
from pipeshard.services.coordinator.prefix_cache import PrefixIndex
from pipeshard.services.coordinator.sampling import SamplingParams
from pipeshard.services.coordinator.speculation.sources import DraftSources
from pipeshard.shard.paged import PagedRow, PagedShard
from pipeshard.shard.self_check import measure

EXPORT_NAME = "smollm2-135m-instruct-2s-int4"
USERS = 8
TTFT_PROMPT_TOKENS = 1024
PREFIX_TOKENS = 48  # tokens per chat turn in the warm/cold check
SYSTEM = "You are a careful assistant who answers in plain words. " * 6
FOLLOW_UP = "Thank you. Can you say that again more briefly?"
REPORTED = (
    "INFERENCE_PRECISION_HINT",
    "KV_CACHE_PRECISION",
    "KEY_CACHE_PRECISION",
    "VALUE_CACHE_PRECISION",
    "DYNAMIC_QUANTIZATION_GROUP_SIZE",
    "INFERENCE_NUM_THREADS",
)


@dataclass(frozen=True)
class Candidate:
    """A precision name as the entry points take it, extra CPU properties on the ring's Core, and
    inference threads per stage (None: the LATENCY hint's choice, every core)."""

    precision: str
    properties: dict = field(default_factory=dict)
    threads: int | None = None
    ladder: str = ""  # at precision invariant: the configurations to try (--invariant-ladder)


BF16_DQ0 = {"INFERENCE_PRECISION_HINT": "bf16", "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0}
# The paged kernel at bf16 inference takes a u8 or a bf16 cache only: an f32 cache fails to compile
# ("expect kvcache type bf16, current: f32"; kept here so the result records it). A bf16 pool is
# asked for with KEY_/VALUE_CACHE_PRECISION (KV_CACHE_PRECISION=bf16 alone compiles to f32 and
# fails likewise); f16 asked for at bf16 inference compiles to a bf16 pool, so bf16 stands for both.
F32_DQ32 = {
    "INFERENCE_PRECISION_HINT": "f32",
    "KV_CACHE_PRECISION": "f32",
    "DYNAMIC_QUANTIZATION_GROUP_SIZE": 32,
}
BF16_KV = {"KEY_CACHE_PRECISION": "bf16", "VALUE_CACHE_PRECISION": "bf16"}
CANDIDATES: dict[str, Candidate] = {
    # The default as `make up` runs it (DEFAULT_PRECISION, the plugin's threads) and `fast` (the
    # default before issue 34, the CPU plugin's own choice), the pair every ratio compares.
    "default": Candidate("default", {}, None),
    # issue 49's invariant configurations, each alone on the ladder (threads: the plugin's)
    "bf16_kv16": Candidate("invariant", {}, None, ladder="bf16-kv16"),
    "f32_kv16": Candidate("invariant", {}, None, ladder="f32-kv16"),
    "fast": Candidate("fast", {}, None),
    "exact": Candidate("exact", {}, 1),  # what the exactness tests run
    "exact_2t": Candidate("exact", {}, 2),
    "fast_1t": Candidate("fast", {}, 1),
    # f32 inference and cache with the plugin's dynamic quantization left on (group 32): each
    # token row's activations are quantized on their own, so at one thread rows do not see each
    # other; but the int8 rounding amplifies the attention's own-chunk vs one-token differences.
    "f32_dq32_1t": Candidate("fast", F32_DQ32, 1),
    "f32_dq32_2t": Candidate("fast", F32_DQ32, 2),
    "bf16_dq0_f32kv_1t": Candidate("fast", {**BF16_DQ0, "KV_CACHE_PRECISION": "f32"}, 1),
    "bf16_dq0_bf16kv_1t": Candidate("fast", {**BF16_DQ0, **BF16_KV}, 1),
    "bf16_dq0_bf16kv_2t": Candidate("fast", {**BF16_DQ0, **BF16_KV}, 2),
    "bf16_dq0_u8kv_1t": Candidate("fast", BF16_DQ0, 1),
    "bf16_dq0_u8kv_2t": Candidate("fast", BF16_DQ0, 2),
}
DEFAULT_CANDIDATES = ("default", "fast", "exact_2t", "f32_kv16")
NAMES = os.environ.get("BENCH_CANDIDATES", ",".join(DEFAULT_CANDIDATES)).split(",")
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "4"))
TOKENS = int(os.environ.get("BENCH_TOKENS", "128"))
PREFIX_PROMPTS = int(os.environ.get("BENCH_PREFIX_PROMPTS", "3"))
TIMED_USERS = (1, 8, 16)
KNOBS = ("BENCH_CANDIDATES", "BENCH_ROUNDS", "BENCH_TOKENS", "BENCH_PREFIX_PROMPTS", "PIPESHARD_SHARDS_DIR")
# Held out: in no prompt of the bench or the tests; its teacher-forced logits against HF's f32 model.
HELD_OUT = (
    "The old harbour town woke slowly. Fishing boats rocked against the pier while gulls argued over "
    "scraps, and the baker on the corner pulled the first loaves from an oven older than anyone in "
    "the street. By eight the market square was full of voices, crates of apples and the smell of "
    "coffee drifting from the cafe whose owner had painted its shutters blue every spring for forty years."
)


def export_dir():
    out = paths.shards_dir() / EXPORT_NAME
    if not (out / "manifest.json").exists():
        from pipeshard.exporter.export import export_model

        export_model(paths.default_model_dir(), out, stages=2, weights="int4")
    return out


def core_for(candidate: Candidate) -> ov.Core:
    core = ov.Core()
    if candidate.properties:
        core.set_property("CPU", candidate.properties)
    return core


def compiled(users: LocalUsers) -> dict[str, str]:
    """What the plugin chose on stage 0 (proof the candidate's properties took effect)."""
    out = {}
    for key in REPORTED:
        with contextlib.suppress(RuntimeError):
            out[key] = str(users.ring.stages.shards[0].compiled.get_property(key))
    return out


def isolation(candidate: Candidate, users: LocalUsers, export) -> dict:
    solo = users.solo_runs(USERS)
    together = users.run(USERS).tokens
    agree = sum(a == b for s, t in zip(solo, together, strict=True) for a, b in zip(s, t, strict=True))
    diverged = []
    for i, (s, t) in enumerate(zip(solo, together, strict=True)):
        if s != t:
            at = next(k for k, (a, b) in enumerate(zip(s, t, strict=True)) if a != b)
            diverged.append((i, at))
    margins = top2_margins(
        export,
        candidate.precision,
        [(users.ids[i], solo[i], at) for i, at in diverged],
        threads=candidate.threads,
        core=core_for(candidate),
    )
    return {
        "users_identical": (USERS - len(diverged)) / USERS,
        "positions_agreeing": agree / sum(len(s) for s in solo),
        "divergences": [{"user": i, **m} for (i, _), m in zip(diverged, margins, strict=True)],
    }


def prefix_check(users: LocalUsers) -> dict:
    """Turn 2 of a chat warm (turn 1's blocks restored) against cold, per prompt."""
    ring, prompter = users.ring, users.prompter
    chunk = ring.prefill_chunk
    warm = Generation(ring, prompter.tokenizer, prompter.eos_ids, prefill_chunk=chunk, prefix=PrefixIndex())
    cold = Generation(ring, prompter.tokenizer, prompter.eos_ids, prefill_chunk=chunk)
    params = SamplingParams(max_tokens=PREFIX_TOKENS, ignore_eos=True)

    async def final(generation: Generation, ids: list[int]) -> Summary:
        return [e async for e in generation.run(ids, params)][-1]

    async def run() -> dict:
        identical, cached = [], []
        for prompt in PROMPTS[:PREFIX_PROMPTS]:
            turns = [("system", SYSTEM), ("user", prompt)]
            first = await final(warm, prompter.encode("", turns))
            turns += [("assistant", first.text), ("user", FOLLOW_UP)]
            ids = prompter.encode("", turns)
            got, want = await final(warm, ids), await final(cold, ids)
            cached.append(got.cached_tokens)
            identical.append(got.token_ids == want.token_ids)
        await warm.released()
        await cold.released()
        applicable = all(cached)
        return {
            "applicable": applicable,
            "warm_equals_cold": all(identical) if applicable else None,
            "turns_identical": identical,
            "cached_tokens": cached,
        }

    return users.loop.run_until_complete(run())


def other_paths(users: LocalUsers, export) -> dict[str, list[bool]]:
    """Per cell, whether each of the first PREFIX_PROMPTS users equals its solo run with its prompt
    prefilled 7 tokens at a time, and with prompt lookup at K = 3 and at adaptive K."""
    ring, prompter = users.ring, users.prompter
    solo = users.solo_runs(PREFIX_PROMPTS)
    chunked = Generation(ring, prompter.tokenizer, prompter.eos_ids, prefill_chunk=7)
    drafts = DraftSources(export)
    speculative = Generation(
        ring, prompter.tokenizer, prompter.eos_ids, prefill_chunk=ring.prefill_chunk, drafts=drafts
    )
    params = SamplingParams(max_tokens=users.tokens, ignore_eos=True)

    async def tokens(generation: Generation, ids: list[int], mode: str = "none", k: int = 0) -> list[int]:
        return [e async for e in generation.run(ids, params, speculative=mode, k=k)][-1].token_ids

    async def run() -> dict[str, list[bool]]:
        cells: dict[str, list[bool]] = {"chunked_7": [], "ngram_k3": [], "ngram_adaptive": []}
        for i, want in enumerate(solo):
            ids = users.ids[i]
            cells["chunked_7"].append(await tokens(chunked, ids) == want)
            cells["ngram_k3"].append(await tokens(speculative, ids, "ngram", 3) == want)
            cells["ngram_adaptive"].append(await tokens(speculative, ids, "ngram", 0) == want)
        return cells

    return users.loop.run_until_complete(run())


def invariant(r: dict) -> bool:
    """Every cell identical: batched users and timed rounds, warm == cold, chunks, speculation."""
    iso = r["isolation"]
    rounds_done, rounds = iso["timed_8_user_runs_identical"].split("/")
    return (
        iso["users_identical"] == 1.0
        and rounds_done == rounds
        and r["prefix"]["warm_equals_cold"] is True
        and all(all(cell) for cell in r["paths"].values())
    )


def timed_self_check(shard) -> float:
    """Seconds the stage's self-check takes measured afresh (a start finds it cached)."""
    t0 = time.perf_counter()
    measure(shard)
    return round(time.perf_counter() - t0, 3)


def teacher_forced(shards, prompter) -> float:
    """Max |logit delta| over every position of HELD_OUT, fed as one chunk through the candidate's
    paged stages, against HF's f32 model on the same ids (the quality cost of the configuration)."""
    import torch
    from transformers import AutoModelForCausalLM

    ids = prompter.tokenizer(HELD_OUT)["input_ids"]
    global _HF_LOGITS
    if _HF_LOGITS is None:
        model = AutoModelForCausalLM.from_pretrained(paths.default_model_dir(), dtype=torch.float32).eval()
        with torch.no_grad():
            _HF_LOGITS = model(torch.tensor([ids])).logits[0].numpy()
    x: np.ndarray = np.asarray(ids, dtype=np.int64)
    key = ("__teacher_forced__",)
    for shard in shards:
        shard.open(key, len(ids))
    try:
        for shard in shards:
            x = shard.step([PagedRow(key, x, logits=len(ids) if shard.is_last else 0)])[0]
    finally:
        for shard in shards:
            shard.free(key)
    return float(np.abs(x - _HF_LOGITS).max())


_HF_LOGITS: np.ndarray | None = None


def cpu_name() -> str:
    """The CPU's model name and the plugin's capabilities, for the result file."""
    core = ov.Core()
    name, caps = (core.get_property("CPU", k) for k in ("FULL_DEVICE_NAME", "OPTIMIZATION_CAPABILITIES"))
    return f"{name} {caps}"


def ttft_ms(users: LocalUsers, ids: list[int]) -> float:
    params = SamplingParams(max_tokens=1, ignore_eos=True)

    async def first() -> float:
        t0 = time.perf_counter()
        async for event in users.generation.run(ids, params):
            if isinstance(event, Chunk):
                return (time.perf_counter() - t0) * 1000.0
        raise RuntimeError("no chunk")

    return users.loop.run_until_complete(first())


KERNEL_CANDIDATES = (
    "exact",
    "exact_2t",
    "fast",
    "fast_1t",
    "f32_dq32_1t",
    "bf16_dq0_u8kv_1t",
    "bf16_dq0_bf16kv_1t",
    "bf16_dq0_bf16kv_2t",
)


def grid_candidates() -> dict[str, Candidate]:
    """Issue 49's search: every combination of inference precision (bf16, f32), KV cache
    precision (u8, f16, f32) and dynamic quantization of activations (0: off, d: the plugin's
    default group), at the plugin's threads (what ``make up`` runs). Named ``<inf>_kv<kv>_dq<0|d>``."""
    out = {}
    for inf in ("bf16", "f32"):
        for kv in ("u8", "f16", "f32"):
            for dq in ("0", "d"):
                props: dict = {"INFERENCE_PRECISION_HINT": inf}
                if kv == "f16" and inf == "bf16":  # f16 asked for at bf16 inference compiles to bf16
                    props |= {"KEY_CACHE_PRECISION": "bf16", "VALUE_CACHE_PRECISION": "bf16"}
                elif kv == "u8":
                    props |= {"KEY_CACHE_PRECISION": "u8", "VALUE_CACHE_PRECISION": "u8"}
                else:
                    props |= {
                        "KEY_CACHE_PRECISION": kv,
                        "VALUE_CACHE_PRECISION": kv,
                        "KV_CACHE_PRECISION": kv,
                    }
                if dq == "0":
                    props["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = 0
                out[f"{inf}_kv{kv}_dq{dq}"] = Candidate("fast", props, None)
    return out


CANDIDATES |= grid_candidates()


def kernel_checks(export, candidate: Candidate) -> dict:
    """Max |delta| of stage 0's hidden states between groupings that a row-independent kernel
    would compute alike (random token ids; the bits, not the text, matter here)."""
    shard = PagedShard(
        export,
        0,
        candidate.precision,
        candidate.threads,
        cache_bytes=128 << 20,
        core=core_for(candidate),
        verify=False,
    )
    rng = np.random.default_rng(0)
    prompt, filler = rng.integers(100, 5000, 37), rng.integers(100, 5000, 600)
    names = iter(range(10**6))

    def decode_row(before: int, after: int) -> np.ndarray:
        """The prompt's next token as a decode row between other sequences' chunks of ``before``
        and ``after`` tokens."""
        seq = next(names)
        shard.open(seq, 64)
        shard.step([PagedRow(seq, prompt)])
        rows = [PagedRow(seq, np.array([11]))]
        others = [next(names) for n in (before, after) if n]
        for other in others:
            shard.open(other, 700)
        if before:
            rows.insert(0, PagedRow(others[0], filler[:before]))
        if after:
            rows.append(PagedRow(others[-1], filler[:after]))
        out = shard.step(rows)[1 if before else 0]
        for done in (seq, *others):
            shard.free(done)
        return out

    def delta(a: np.ndarray, b: np.ndarray) -> float:
        return float(np.abs(a - b).max())

    ref = decode_row(0, 1)
    beside = {m: delta(decode_row(0, m - 1), ref) for m in (1, 2, 4, 8, 16, 64, 256)}
    after = {k: delta(decode_row(k, 0), decode_row(0, 0)) for k in (1, 7, 33, 255)}
    seq = next(names)
    shard.open(seq, 64)
    whole = shard.step([PagedRow(seq, filler[:64])])[0]

    def after_prefix(k: int, n: int, pad_to: int) -> np.ndarray:
        """Tokens k..k+n of ``filler`` after its first k, in a step padded with another sequence's
        tokens to ``pad_to`` tokens (the 8+-row kernel class when pad_to >= 8)."""
        s = next(names)
        shard.open(s, 64)
        shard.step([PagedRow(s, filler[:k])])
        rows = [PagedRow(s, filler[k : k + n])]
        pad = next(names) if n < pad_to else None
        if pad is not None:
            shard.open(pad, 64)
            rows.append(PagedRow(pad, prompt[: pad_to - n]))
        out = shard.step(rows)[0]
        for done in (s, pad) if pad is not None else (s,):
            shard.free(done)
        return out

    own = {k: delta(after_prefix(k, 1, 1)[0], whole[k]) for k in (1, 8, 31, 32, 33, 63)}
    own_padded = {k: delta(after_prefix(k, 1, 8)[0], whole[k]) for k in (1, 8, 31, 32, 33, 63)}
    verify = {pad: delta(after_prefix(20, 3, pad), whole[20:23]) for pad in (1, 8)}

    def split(at: int) -> float:
        s = next(names)
        shard.open(s, 64)
        shard.step([PagedRow(s, filler[:at])])
        out = delta(shard.step([PagedRow(s, filler[at:64])])[0], whole[at:])
        shard.free(s)
        return out

    def two_token(k: int, beside: int) -> np.ndarray:
        """Token k decoded as a two-token row (token k-1 re-fed, its slot rewritten) after its
        prefix, beside another sequence's chunk of ``beside`` tokens: every row then takes the
        multi-query attention path."""
        s = next(names)
        shard.open(s, 64)
        shard.step([PagedRow(s, filler[:k])])
        shard.rewind(s, k - 1)
        rows = [PagedRow(s, filler[k - 1 : k + 1])]
        pad = next(names) if beside else None
        if pad is not None:
            shard.open(pad, 300)
            rows.append(PagedRow(pad, prompt[:beside] if beside <= len(prompt) else filler[:beside]))
        out = shard.step(rows)[0][1]
        for done in (s, pad) if pad is not None else (s,):
            shard.free(done)
        return out

    two = {k: delta(two_token(k, 0), whole[k]) for k in (1, 8, 31, 32, 33, 63)}
    two_beside = {m: delta(two_token(20, m), whole[20]) for m in (1, 2, 6, 14, 62, 254)}
    return {
        "decode_row_beside_m_tokens_vs_m2": beside,
        "decode_row_after_k_tokens_vs_first": after,
        "chunk_token_vs_decoded_alone": own,
        "chunk_token_vs_decoded_in_8_token_step": own_padded,
        "3_token_verify_vs_chunk_alone_and_in_8_token_step": verify,
        "prompt_split_5_59_vs_whole": split(5),
        "prompt_split_at_block_vs_whole": split(shard.block_tokens),
        "two_token_decode_vs_chunk": two,
        "two_token_decode_beside_m_tokens_vs_chunk": two_beside,
        "block_tokens": shard.block_tokens,
        "compiled": {k: _prop(shard.compiled, k) for k in REPORTED},
    }


def _prop(compiled, key: str) -> str | None:
    try:
        return str(compiled.get_property(key))
    except RuntimeError:
        return None


def verdicts(r: dict) -> dict[str, float]:
    """Per way of shaping rows, the largest |delta| of the columns it relies on (0: bit-invariant):
    ``plain`` one-token decode rows; ``two_token`` decode rows fed as two tokens; ``padded_8``
    every step padded to the 8+-token class; ``two_token_aligned`` two-token rows with prompt
    chunks split at KV blocks only."""

    def worst(*cells) -> float:
        return max(max(c.values()) if isinstance(c, dict) else c for c in cells)

    beside = r["decode_row_beside_m_tokens_vs_m2"]
    verify = r["3_token_verify_vs_chunk_alone_and_in_8_token_step"]
    return {
        "plain": worst(
            beside,
            r["decode_row_after_k_tokens_vs_first"],
            r["chunk_token_vs_decoded_alone"],
            verify[1],
            r["prompt_split_5_59_vs_whole"],
        ),
        "padded_8": worst(
            {m: d for m, d in beside.items() if m >= 8},
            r["chunk_token_vs_decoded_in_8_token_step"],
            verify[8],
            r["prompt_split_5_59_vs_whole"],
        ),
        "two_token": worst(
            r["two_token_decode_vs_chunk"],
            r["two_token_decode_beside_m_tokens_vs_chunk"],
            verify[1],
            r["prompt_split_5_59_vs_whole"],
        ),
        "two_token_aligned": worst(
            r["two_token_decode_vs_chunk"],
            r["two_token_decode_beside_m_tokens_vs_chunk"],
            verify[1],
            r["prompt_split_at_block_vs_whole"],
        ),
    }


def kernels() -> None:
    names = [n for n in os.environ.get("BENCH_CANDIDATES", ",".join(KERNEL_CANDIDATES)).split(",")]
    export = export_dir()
    out = {}
    for name in names:
        try:
            out[name] = {
                "properties": CANDIDATES[name].properties,
                "threads": CANDIDATES[name].threads,
                **kernel_checks(export, CANDIDATES[name]),
            }
            out[name]["verdicts"] = verdicts(out[name])
        except RuntimeError as exc:
            out[name] = {"compile_error": str(exc).strip().splitlines()[-1]}
        print(name, out[name], file=sys.stderr, flush=True)
    write_result(
        "precision_kernels",
        {"export": str(export), "candidates": out},
        "python -m bench.precision_modes kernels",
    )


# What separates the default from `fast` at 8 and 16 users (``rows``): each setting the
# default changes, alone, on the same paged shards.
ROW_CONFIGURATIONS = {
    "default": CONFIGURATIONS["bf16-kv16"],  # bf16, bf16 KV, two-token rows
    "bf16_kv16_one_token": dataclasses.replace(CONFIGURATIONS["bf16-kv16"], two_token_rows=False),
    "bf16_kv8_two_token": CONFIGURATIONS["bf16-kv8"],
    "fast": CONFIGURATIONS["fast"],
}
ROW_CONTEXT = 128  # tokens each user holds before the timed decode steps


def rows() -> None:
    """Seconds per decode step of U users through both INT4 paged shards (U one-token rows; a
    two-token configuration re-feeds each), per configuration of ROW_CONFIGURATIONS, in
    interleaved rounds (BENCH_ROUNDS after one warm-up); ratios of fast's median over each's:
    which of the default's settings costs its tok/s (bench/results/precision_rows.json)."""
    export = export_dir()
    rng = np.random.default_rng(0)
    load_start = os.getloadavg()
    shards = {
        name: [PagedShard(export, k, "invariant", cache_bytes=256 << 20, config=c) for k in range(2)]
        for name, c in ROW_CONFIGURATIONS.items()
    }
    for pair in shards.values():
        for k, shard in enumerate(pair):
            shard.warmup()
            for users in (8, 16):
                for i in range(users):
                    shard.open((users, i), ROW_CONTEXT + 3 * (ROUNDS + 2))
                    x = (
                        rng.integers(100, 5000, ROW_CONTEXT)
                        if k == 0
                        else rng.standard_normal((ROW_CONTEXT, shard.hidden_size)).astype(np.float32)
                    )
                    shard.step([PagedRow((users, i), x, logits=1 if shard.is_last else 0)])

    def step(name: str, users: int):
        first, last = shards[name]

        def run() -> float:
            started = time.perf_counter()
            for _ in range(3):
                hidden = first.step([PagedRow((users, i), rng.integers(100, 5000, 1)) for i in range(users)])
                last.step([PagedRow((users, i), h, logits=1) for i, h in enumerate(hidden)])
            return (time.perf_counter() - started) / 3

        return run

    out: dict = {"load_start": load_start, "context": ROW_CONTEXT, "users": {}}
    for users in (8, 16):
        samples = interleaved({n: step(n, users) for n in ROW_CONFIGURATIONS}, ROUNDS, warmup=1)
        out["users"][users] = {
            name: {
                "step_ms": summary([1000 * v for v in values]),
                "tok_s_over_fast": ratio_ci(samples["fast"], values),
            }
            for name, values in samples.items()
        }
    out["load_end"] = os.getloadavg()
    print(out, file=sys.stderr, flush=True)
    write_result("precision_rows", out, f"BENCH_ROUNDS={ROUNDS} python -m bench.precision_modes rows")


def main() -> None:
    set_offline_defaults()
    if sys.argv[1:] == ["kernels"]:
        kernels()
        return
    if sys.argv[1:] == ["rows"]:
        rows()
        return
    unknown = [n for n in NAMES if n not in CANDIDATES]
    if unknown or not {"default", "fast"} <= set(NAMES):
        names = ", ".join(CANDIDATES)
        sys.exit(f"BENCH_CANDIDATES must include default and fast and name only {names}: {unknown}")
    export = export_dir()
    load_start = os.getloadavg()
    rings: dict[str, LocalUsers] = {}
    results: dict[str, dict] = {}
    failed: dict[str, dict] = {}
    long_ids: list[int] = []
    for name in NAMES:
        candidate = CANDIDATES[name]
        try:
            users = LocalUsers(
                export,
                paged=True,
                precision=candidate.precision,
                threads=candidate.threads,
                tokens=TOKENS,
                core=core_for(candidate),
                ladder=candidate.ladder,
            )
        except RuntimeError as exc:  # the plugin refuses the combination: recorded, not measured
            failed[name] = {
                "properties": candidate.properties,
                "compile_error": str(exc).strip().splitlines()[-1],
            }
            print(name, failed[name], file=sys.stderr, flush=True)
            continue
        rings[name] = users
        if not long_ids:
            long_ids = users.prompter.encode(
                "", [("user", history(users.prompter, TTFT_PROMPT_TOKENS, "ttft"))]
            )
        shards = users.ring.stages.shards
        results[name] = {
            "precision": candidate.precision,
            "properties": candidate.properties,
            "threads": candidate.threads,
            "configuration": [sh.config.name for sh in shards],
            "self_check": [
                sh.proof.check.describe() if sh.proof and sh.proof.check else None for sh in shards
            ],
            "self_check_seconds_uncached": [timed_self_check(sh) for sh in shards],
            "teacher_forced_max_logit_delta": teacher_forced(shards, users.prompter),
            "compiled": compiled(users),
            "isolation": isolation(candidate, users, export),
            "prefix": prefix_check(users),
            "paths": other_paths(users, export),
        }
        print(name, results[name], file=sys.stderr, flush=True)

    if not {"default", "fast"} <= set(rings):
        sys.exit("default or fast did not compile")
    batched_rounds_identical = {name: 0 for name in rings}

    def eight(name: str):
        def run() -> float:
            out = rings[name].run(USERS)
            batched_rounds_identical[name] += out.tokens == rings[name].solo_runs(USERS)
            return out.tok_s

        return run

    configs = {}
    for name in rings:
        configs[f"{name}/1"] = lambda n=name: rings[n].run(1).tok_s
        configs[f"{name}/8"] = eight(name)
        configs[f"{name}/16"] = lambda n=name: rings[n].run(16).tok_s
        configs[f"{name}/ttft"] = lambda n=name: ttft_ms(rings[n], long_ids)
    loads = [os.getloadavg()[0]]
    samples = interleaved(configs, ROUNDS, warmup=1)
    loads.append(os.getloadavg()[0])
    keys = {
        "1": "tok_s_1_user",
        "8": "tok_s_8_users",
        "16": "tok_s_16_users",
        "ttft": f"ttft_ms_{TTFT_PROMPT_TOKENS}",
    }
    for name in rings:
        r = results[name]
        r["isolation"]["timed_8_user_runs_identical"] = f"{batched_rounds_identical[name]}/{ROUNDS + 1}"
        for metric, key in keys.items():
            r[key] = summary(samples[f"{name}/{metric}"])
            ratio, ci = ratio_ci(samples[f"{name}/{metric}"], samples[f"fast/{metric}"])
            r[f"{key}_over_fast"] = {"ratio": ratio, "ci95": ci}
    default = results["default"]
    ttft = f"ttft_ms_{TTFT_PROMPT_TOKENS}_over_fast"
    result = {
        "invariant_default": invariant(default),
        "default_over_fast_1user": default["tok_s_1_user_over_fast"]["ratio"],
        "default_over_fast_8users": default["tok_s_8_users_over_fast"]["ratio"],
        "default_over_fast_16users": default["tok_s_16_users_over_fast"]["ratio"],
        f"ttft_default_over_fast_{TTFT_PROMPT_TOKENS}": default[ttft]["ratio"],
        "default_configuration": default["configuration"],
        "teacher_forced_max_logit_delta": {
            n: r["teacher_forced_max_logit_delta"] for n, r in results.items()
        },
        "self_check_seconds": max(default["self_check_seconds_uncached"]),
        "cpu": cpu_name(),
        "export": str(export),
        "rounds": ROUNDS,
        "warmup_rounds": 1,
        "tokens": TOKENS,
        "ttft_prompt_tokens": len(long_ids),
        "load_average": {"start": list(load_start), "timed_start_end": loads, "end": list(os.getloadavg())},
        "candidates": results,
        "not_compilable": failed,
    }
    write_result("precision_modes", result, command_with_knobs("bench-precision-modes", KNOBS))
    print(table(results), file=sys.stderr)


def table(results: dict[str, dict]) -> str:
    """The docs/BENCHMARKS.md table."""
    lines = [
        "| candidate | users identical | positions agreeing | min top-2 margin at divergence | warm == cold "
        "| chunked / ngram K=3 / adaptive == solo "
        "| 1-user tok/s (x fast) | 8-user tok/s (x fast) | 16-user tok/s (x fast) | TTFT 1024 ms (x fast) "
        "| teacher-forced max logit delta vs HF f32 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        iso, pre = r["isolation"], r["prefix"]
        margins = [d["top2_margin"] for d in iso["divergences"]]
        least = f"{min(margins):.3f}" if margins else "-"
        warm = "n/a (no f32 pool)" if not pre["applicable"] else ("yes" if pre["warm_equals_cold"] else "no")

        def cell(key: str, r: dict = r) -> str:
            x = r[f"{key}_over_fast"]
            return f"{r[key]['median']:.1f} ({x['ratio']:.2f} [{x['ci95'][0]:.2f}, {x['ci95'][1]:.2f}])"

        lines.append(
            f"| {name} | {iso['users_identical']:.0%} ({iso['timed_8_user_runs_identical']} timed) "
            f"| {iso['positions_agreeing']:.1%} | {least} | {warm} "
            f"| {' / '.join(f'{sum(c)}/{len(c)}' for c in r['paths'].values())} "
            f"| {cell('tok_s_1_user')} | {cell('tok_s_8_users')} | {cell('tok_s_16_users')} "
            f"| {cell('ttft_ms_1024')} | {r['teacher_forced_max_logit_delta']:.3f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
