"""`make bench-spec`: speculative decoding against plain decoding on natural text, single node and
over the WAN emulator, for every draft source, chains and trees (issues 30 and 31).

Prompts: the paper's eight kinds (KINDS), kept only where plain greedy's answer over the measured
length is natural text (no 4-gram more than 3 times); ``repetition_rate`` is the share dropped.
Every speedup is the mean over the kept kinds of each kind's ratio of medians to plain over
interleaved rounds (its ``_ci95`` a bootstrap over rounds).

Sources: ``ngram`` (prompt lookup), ``self`` (the 4-layer self-draft, or BENCH_SELF_DRAFT, e.g. a
distilled one from `make distil`), ``hf`` (a same-tokenizer Hugging Face folder) and ``feature``
(the trained feature draft, `make distil KIND=eagle`; BENCH_FEATURE_DRAFT=<folder> or the default
folder, trained there when missing; BENCH_FEATURE_DRAFT=off leaves it out) and ``medusa`` (the final
stage's draft heads, `make distil KIND=medusa`; BENCH_DRAFT_HEADS=<folder> or the default folder
when it holds heads for these weights, never trained here; every part, the WAN fleets' final
stage started with ``--draft-heads``). Per source: chains at
each K, adaptive K with ``tree=off`` (``-chain-auto``) and trees at BENCH_TREES where the stages
verify trees, adaptive K with ``tree=auto`` (``-auto``, the default; on stages that verify no
trees it drafts chains, so ``-chain-auto`` would be the same requests measured twice).

Parts (BENCH_PARTS, default single,exact,wan; a subset names the JSON bench/results/spec-<parts>.json):
- single: every stage in this process (INT4 at the default precision, ``exact``) on paged stages
  as `make up` runs them, a tree one masked sequence (BENCH_SINGLE_KV=stateful: the stateful
  backend, where a tree runs as one chain per path, every path's row copying the session's cache);
  tok/s, acceptance, tokens per traversal per kind; the draft costs against the target.
- exact: the same configurations on 2- and 3-stage INT4 rings at ``exact``, tokens against plain.
- wan: 2 and 3 stage processes in network namespaces at 0, 10, 50, 100 ms one way per hop
  (``flock /tmp/wan.lock``: the emulator is shared), plain against the best single-node token
  source's and the feature draft's configurations in one fleet per point.

Keys (#30): ``speedup_at_100ms`` (the best token-draft configuration at 3 stages, 100 ms),
``tokens_per_traversal_at_100ms`` (its committed tokens per verify traversal, the target's own
included), ``single_node_speedup`` (the best token-draft configuration), ``adaptive_vs_best_fixed_min``
and ``adaptive_over_plain_min`` (``-auto`` of the WAN source against its best fixed shape and
plain, minimum over every WAN point), ``bit_exact`` (every speculative sequence of every part equals
plain greedy's, INT4 at ``exact``), ``repetition_rate``; (#31) ``feature_speedup_at_100ms``,
``feature_single_node_speedup``, ``feature_tokens_per_traversal_at_100ms``, ``draft_train_minutes``,
``feature_teacher_forced`` (per kind, the draft's agreement with the target on its own answers);
``medusa_single_node_speedup``, ``medusa_tokens_per_traversal``, ``draft_heads_cost``, and from the WAN
sweep ``medusa_speedup_at_100ms``, ``medusa_tokens_per_traversal_at_100ms``.
(#48, the coordinator choosing each request's traversals in flight: ``--spec-depth`` auto, D > 1 for
prompt lookup's and the feature draft's chains over slow hops) ``pipelined_speedup_at_100ms`` (the
best configuration of any source at 3 stages, 100 ms, against plain; ``pipelined_source_at_100ms`` names it),
``dropped_steps_share`` (of that configuration's steps sent, those dropped after a rejection),
``pipelined_speedup_at_25ms`` (the same at 25 ms), ``best_tokens_per_traversal_at_100ms`` (the most
tokens per traversal any source's best configuration kept there), ``best_single_node_speedup`` (any
source, ``mix`` among them; ``mix_single_node_speedup`` its own best),
``batch8_spec_over_plain_at_100ms`` (BATCH_USERS users at once, each its own kind's prompt,
every one speculating with the fleet's best source under adaptive K against every one plain: ratio
of median aggregate tok/s over interleaved rounds, at 3 stages and 100 ms; the slowest user sets a
round's wall time), ``batch8_steady_spec_over_plain_at_100ms`` (the same rounds' tokens per second
while all the users are still generating: up to the first one's finish), and ``by_kind_at_100ms``
(per prompt kind: that configuration's speedup and tokens per traversal, each source's best).
(#48, the default: the WAN fleets run ``--speculative auto`` and the ``default`` configuration sends
requests that do not choose, shuffled among the rest) ``default_speedup_at_<delay>`` (against plain, 3
stages), ``default_over_best_source_at_<delay>`` (against the best configuration of any single
source there, named by ``best_source_at_<delay>``) and ``default_sources_at_<delay>`` (the sources
its answers name).

BENCH_QUICK=1: 2 rounds single node, 1 WAN round, each after a few tokens per configuration, 24
tokens, K 5, tree 3x4, sources ngram and feature (and self when BENCH_SELF_DRAFT is given), the
WAN sweep at 3 stages, 0, 25 and 100 ms, the exact part on 2 and 3 stages. Runtime on 2 quiet cores
(2026-12-02): 10 minutes with prompt lookup alone, 25-27 with the eagle draft and the heads
too (their training not included: `make distil KIND=eagle|medusa`). The full size is about a day on
2 cores (estimate from the quick run's per-answer times: the WAN sweep's 10 rounds of about 11
configurations x the kept kinds x 128 tokens are 4-6 hours at 3 stages and 100 ms alone); one WAN
point at full length: BENCH_QUICK=1 BENCH_TOKENS=128 BENCH_WAN_DELAYS=100 (about 20 minutes a round).
Sizes: BENCH_RUNS, BENCH_TOKENS (128; quick 24), BENCH_WAN_TOKENS (same), BENCH_KS (1,3,5,8,10; empty:
adaptive only), BENCH_TREES (3x4,2x3), BENCH_WAN_STAGES (2,3), BENCH_WAN_DELAYS (0,10,25,50,100),
BENCH_WAN_KS (5,10), BENCH_WAN_SOURCE (ngram|self|hf; default the best single-node token source),
BENCH_PROMPTS (single and exact) and BENCH_WAN_PROMPTS: the first N kept kinds (default every one).
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections import Counter
from collections.abc import Callable
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path

import grpc

from bench.pipeline import ensure_export
from bench.spec_costs import (
    draft_heads_cost,
    feature_agreement,
    feature_bytes,
    feature_draft_cost,
    token_draft_costs,
    trim_cost,
)
from bench.stats import RESULTS_DIR, interleaved, mean_ratio_ci, median, ratio_ci, write_result
from pipeshard import paths
from pipeshard.clients.client import AsyncPipeshardClient, GenerateResult, PipeshardClient, fold
from pipeshard.offline import set_offline_defaults
from pipeshard.services.coordinator.generation import Generation, Summary
from pipeshard.services.coordinator.in_process import batched_ring, local_ring
from pipeshard.services.coordinator.sampling import SamplingParams
from pipeshard.services.coordinator.speculation.sources import DraftSources
from pipeshard.shard.prompting import Prompter
from pipeshard.v1 import stage_pb2, stage_pb2_grpc

QUICK = os.environ.get("BENCH_QUICK") == "1"
RUNS = int(os.environ.get("BENCH_RUNS", "2" if QUICK else "10"))
WAN_RUNS = int(os.environ.get("BENCH_WAN_RUNS", "1" if QUICK else str(RUNS)))
TOKENS = int(os.environ.get("BENCH_TOKENS", "24" if QUICK else "128"))
WAN_TOKENS = int(os.environ.get("BENCH_WAN_TOKENS", str(TOKENS)))
PROMPTS = int(os.environ["BENCH_PROMPTS"]) if os.environ.get("BENCH_PROMPTS") else None
WAN_PROMPTS = int(os.environ["BENCH_WAN_PROMPTS"]) if os.environ.get("BENCH_WAN_PROMPTS") else None
KS = tuple(int(k) for k in os.environ.get("BENCH_KS", "5" if QUICK else "1,3,5,8,10").split(",") if k)
TREES = tuple(t for t in os.environ.get("BENCH_TREES", "3x4" if QUICK else "3x4,2x3").split(",") if t)
ALL_PARTS = ("single", "exact", "wan")
PARTS = tuple(p for p in ALL_PARTS if p in os.environ.get("BENCH_PARTS", ",".join(ALL_PARTS)).split(","))
WAN_KS = tuple(int(k) for k in os.environ.get("BENCH_WAN_KS", "5" if QUICK else "5,10").split(","))
EXACT_KS = (5,) if QUICK else (1, 5, 10)
EXACT_STAGES = (2, 3)
DELAYS_MS = tuple(
    float(d) for d in os.environ.get("BENCH_WAN_DELAYS", "0,25,100" if QUICK else "0,10,25,50,100").split(",")
)
WAN_STAGES = tuple(int(n) for n in os.environ.get("BENCH_WAN_STAGES", "3" if QUICK else "2,3").split(","))
WAN_SOURCE = os.environ.get("BENCH_WAN_SOURCE")  # default: the best single-node token source
RATE_MBIT = 100.0
SELF_DRAFT = {"layers": 4, "vocab": 8192}
SELF_DRAFT_EXPORT = os.environ.get("BENCH_SELF_DRAFT")
HF_DRAFT_LAYERS = 2
FEATURE_DRAFT = os.environ.get("BENCH_FEATURE_DRAFT")  # a folder, "off", or unset: the default one
FEATURE_VOCAB = 8192
SINGLE_KV = os.environ.get("BENCH_SINGLE_KV", "paged")  # paged | stateful
DRAFT_HEADS = os.environ.get("BENCH_DRAFT_HEADS")  # a folder, "off", or unset: the default one if trained
MAX_REPEATS = 3  # an answer with a 4-gram more often than this loops: not natural text
BATCH_USERS = 8  # users at once for batch8_spec_over_plain_at_100ms
QUICK_WARMUP_TOKENS = 4
KNOBS = (
    "BENCH_QUICK",
    "BENCH_PARTS",
    "BENCH_RUNS",
    "BENCH_WAN_RUNS",
    "BENCH_TOKENS",
    "BENCH_WAN_TOKENS",
    "BENCH_KS",
    "BENCH_TREES",
    "BENCH_SELF_DRAFT",
    "BENCH_FEATURE_DRAFT",
    "BENCH_DRAFT_HEADS",
    "BENCH_WAN_STAGES",
    "BENCH_WAN_DELAYS",
    "BENCH_WAN_KS",
    "BENCH_WAN_SOURCE",
    "BENCH_PROMPTS",
    "BENCH_WAN_PROMPTS",
    "BENCH_SINGLE_KV",
)

# The paper's eight kinds, one prompt each, as one user chat message.
KINDS: tuple[tuple[str, str], ...] = (
    ("short factual", "What is the capital of Italy?"),
    ("reasoning", "A train leaves at 3 pm and travels 120 km at 60 km/h. When does it arrive? Explain."),
    (
        "code completion",
        "Complete this Python function:\ndef is_prime(n):\n    if n < 2:\n        return False\n",
    ),
    ("list", "List the seven days of the week."),
    ("creative", "Write a short story about a robot who learns to paint."),
    ("technical explanation", "Explain how HTTPS keeps a connection secure."),
    ("chat", "Hi! I'm planning a trip to the mountains this weekend. Any tips?"),
    ("translation", "Translate into Spanish: 'Good morning, how are you today? I would like a coffee.'"),
)

Config = tuple[str, int, str]  # draft source, K (0: adaptive), tree
Generate = Callable[[object, int, str, int, str], object]  # (prompt, tokens, source, k, tree) -> summary


def token_sources() -> tuple[str, ...]:
    """The token drafts measured: the quick run skips the untrained self-draft and the HF folder."""
    if QUICK:
        return ("ngram", "self") if SELF_DRAFT_EXPORT else ("ngram",)
    return ("ngram", "self", "hf")


def self_draft_export() -> Path:
    """BENCH_SELF_DRAFT, or the 4-layer self-draft (exported once under shards/)."""
    from pipeshard.exporter.draft import export_draft

    if SELF_DRAFT_EXPORT:
        folder = Path(SELF_DRAFT_EXPORT)
        if not (folder / "manifest.json").is_file():
            raise SystemExit(f"BENCH_SELF_DRAFT={folder} is not an export (no manifest.json)")
        return folder
    folder = paths.shards_dir() / paths.draft_export_name(
        paths.DEFAULT_MODEL, SELF_DRAFT["layers"], SELF_DRAFT["vocab"], "int4"
    )
    if not (folder / "manifest.json").exists():
        export_draft(
            paths.default_model_dir(), folder, layers=SELF_DRAFT["layers"], vocab=SELF_DRAFT["vocab"]
        )
    return folder


def hf_draft_folder() -> Path:
    """The model's first layers as a Hugging Face folder (built once under shards/)."""
    from pipeshard.exporter.truncate import truncate_model

    folder = paths.shards_dir() / f"{paths.DEFAULT_MODEL}-first{HF_DRAFT_LAYERS}-hf"
    if not (folder / "config.json").exists():
        truncate_model(paths.default_model_dir(), folder, layers=HF_DRAFT_LAYERS)
    return folder


def feature_draft(target: Path) -> Path | None:
    """The trained feature draft for the target's weights: BENCH_FEATURE_DRAFT, or the default
    folder (trained there when missing or for other weights, as `make distil KIND=eagle` would)."""
    from pipeshard.exporter.eagle import distil_eagle

    if FEATURE_DRAFT == "off":
        return None
    if FEATURE_DRAFT:
        return Path(FEATURE_DRAFT)
    out = paths.shards_dir() / paths.feature_draft_name(paths.DEFAULT_MODEL, FEATURE_VOCAB)

    def report(phase: str, fraction: float, message: str) -> None:
        if fraction in (0.0, 1.0):
            print(f"feature draft: {phase} {message}", file=sys.stderr, flush=True)

    distil_eagle(paths.default_model_dir(), target, out, vocab=FEATURE_VOCAB, report=report)
    return out


def draft_heads_folder(target: Path) -> Path | None:
    """The final stage's draft heads (`make distil KIND=medusa`): BENCH_DRAFT_HEADS, or the default
    folder when it holds heads trained for the target's weights (never trained here)."""
    from pipeshard.exporter.medusa import HEADS
    from pipeshard.shard.draft_heads import is_draft_heads, read_meta
    from pipeshard.shard.manifest import load_manifest

    if DRAFT_HEADS == "off":
        return None
    if DRAFT_HEADS:
        return Path(DRAFT_HEADS)
    folder = paths.shards_dir() / paths.draft_heads_name(paths.DEFAULT_MODEL, HEADS, FEATURE_VOCAB)
    fingerprint = load_manifest(target).model.fingerprint
    return folder if is_draft_heads(folder) and read_meta(folder).model_fingerprint == fingerprint else None


def loops(tokens: list[int]) -> bool:
    """Whether some 4-gram occurs more than MAX_REPEATS times (looping, not natural, text)."""
    grams = Counter(tuple(tokens[i : i + 4]) for i in range(len(tokens) - 3))
    return any(n > MAX_REPEATS for n in grams.values())


def repetition_rate(answers: list[list[int]]) -> float:
    """The share of answers that loop (their speculative figures would flatter prompt lookup)."""
    return sum(loops(a) for a in answers) / len(answers) if answers else 0.0


def natural_kinds(
    loop, target: Path, prompts: list[list[int]], tokens: int
) -> tuple[list[int], list[list[int]]]:
    """The indices of the prompts whose plain greedy answer over ``tokens`` does not loop, and
    every prompt's answer, on the backend the single part measures (paged stages at the default
    precision, as `make up` runs them): the stateful chain's default falls back to ``exact``,
    whose answers differ from the paged stages' bf16 rows, so it would judge other texts."""
    prompter = Prompter.from_dir(target)
    drafts = DraftSources(target)
    generation = Generation(single_ring(target), prompter.tokenizer, prompter.eos_ids, drafts=drafts)
    generate = in_process_generate(loop, generation)
    answers = [list(generate(ids, tokens, "none", 0, "off").token_ids) for ids in prompts]
    loop.run_until_complete(generation.close())
    return [i for i, a in enumerate(answers) if not loops(a)], answers


def single_ring(target: Path):
    """The single part's ring: every stage in this process on BENCH_SINGLE_KV's backend."""
    return batched_ring(target) if SINGLE_KV == "paged" else local_ring(target)


def spec_configs(sources: tuple[str, ...], ks: tuple[int, ...], trees: bool = True) -> dict[str, Config]:
    """name -> (draft source, K (0: adaptive), tree): plain, each source's chains at every K,
    adaptive K with ``tree=auto``, and where the stages verify trees (``trees``) its trees at every
    BENCH_TREES shape and adaptive K with ``tree=off`` (elsewhere ``tree=auto`` drafts chains)."""
    configs: dict[str, Config] = {"plain": ("none", 0, "off")}
    for source in sources:
        for k in ks:
            configs[f"{source}-k{k}"] = (source, k, "off")
        if trees:
            configs[f"{source}-chain-auto"] = (source, 0, "off")
            for shape in TREES:
                configs[f"{source}-tree{shape}"] = (source, 0, shape)
        configs[f"{source}-auto"] = (source, 0, "auto")
    return configs


def verifies_trees(stage: str) -> bool:
    """Whether a fleet's stages verify draft trees (GetStageInfo's ``draft_tree_form``): paged
    stages at the default precision promise bit-identical rows and verify none."""
    with grpc.insecure_channel(stage) as channel:
        stub = stage_pb2_grpc.StageServiceStub(channel)
        info = stub.GetStageInfo(stage_pb2.GetStageInfoRequest(), timeout=30)
    return info.draft_tree_form != stage_pb2.DRAFT_TREE_FORM_UNSPECIFIED


def is_fixed(config: Config) -> bool:
    """A fixed shape: a chain at a given K or a tree at a given shape, not an adaptive policy."""
    _, k, tree = config
    return k > 0 or tree not in ("off", "auto")


def _fold(summaries: list) -> dict:
    decode_s = sum((s.completion_tokens - 1) / s.tok_s for s in summaries if s.tok_s > 0)
    produced = sum(s.completion_tokens - 1 for s in summaries)
    return {
        "tok_s": produced / decode_s,
        "per_prompt_tok_s": [s.tok_s for s in summaries],
        "tokens": [list(s.token_ids) for s in summaries],
        "verify_steps": sum(s.verify_steps for s in summaries),
        "draft_tokens": sum(s.draft_tokens for s in summaries),
        "accepted_tokens": sum(s.accepted_tokens for s in summaries),
        "per_prompt_acceptance": [
            s.accepted_tokens / s.draft_tokens if s.draft_tokens else None for s in summaries
        ],
        "per_prompt_tokens_per_traversal": [
            (s.accepted_tokens + s.verify_steps) / s.verify_steps if s.verify_steps else None
            for s in summaries
        ],
        # decode traversals whose answers were used, and those sent while an earlier one travelled
        # and dropped after it rejected a draft they were built on (in-flight depth > 1)
        "traversals": sum(sum(s.kept_per_traversal) for s in summaries),
        "dropped_steps": sum(s.dropped_steps for s in summaries),
        # the source each answer names (``default``: what auto chose per request)
        "speculative": dict(Counter(s.speculative for s in summaries)),
    }


def spec_stats(last: dict) -> dict:
    verify, drafted, kept = last["verify_steps"], last["draft_tokens"], last["accepted_tokens"]
    sent = last["traversals"] + last["dropped_steps"]
    return {
        "acceptance": kept / drafted if drafted else None,
        "tokens_per_verify": (kept + verify) / verify if verify else None,
        "dropped_steps_share": last["dropped_steps"] / sent if sent else None,
    }


def measure(
    configs: dict[str, Config], generate: Generate, prompts: list, tokens: int, runs: int, warmup: int
) -> tuple[dict[str, list[float]], dict[str, list[list[float]]], dict[str, dict]]:
    """Interleaved rounds of every configuration over every prompt: total tok/s per round,
    per-prompt tok/s per round, and each configuration's last round. Without warm-up rounds each
    configuration first runs a few tokens of the first prompt (compiles, first-use costs)."""
    last: dict[str, dict] = {}
    per_prompt: dict[str, list[list[float]]] = {n: [] for n in configs}
    if not warmup:
        for source, k, tree in configs.values():
            generate(prompts[0], QUICK_WARMUP_TOKENS, source, k, tree)

    def runner(name: str):
        source, k, tree = configs[name]

        def run() -> float:
            last[name] = _fold([generate(p, tokens, source, k, tree) for p in prompts])
            per_prompt[name].append(last[name]["per_prompt_tok_s"])
            return last[name]["tok_s"]

        return run

    samples = interleaved({n: runner(n) for n in configs}, runs, warmup=warmup)
    return samples, {n: v[-runs:] for n, v in per_prompt.items()}, last


def table(
    configs: dict[str, Config],
    samples: dict[str, list[float]],
    per_prompt: dict[str, list[list[float]]],
    last: dict[str, dict],
    kinds: list[str],
) -> dict[str, dict]:
    """Per configuration: tok/s, the speedup (mean over kinds), per-kind figures, acceptance,
    tokens per traversal and how many answers equal plain greedy's."""
    plain = last["plain"]["tokens"]
    rows = {}
    for name in configs:
        ratio, ci = mean_ratio_ci(per_prompt[name], per_prompt["plain"])
        result = last[name]
        rows[name] = {
            "tok_s": median(samples[name]),
            "speedup": ratio,
            "speedup_ci95": ci,
            "tok_s_by_kind": {kind: median([r[i] for r in per_prompt[name]]) for i, kind in enumerate(kinds)},
            "acceptance_by_kind": dict(zip(kinds, result["per_prompt_acceptance"], strict=True)),
            "tokens_per_traversal_by_kind": dict(
                zip(kinds, result["per_prompt_tokens_per_traversal"], strict=True)
            ),
            "identical_to_plain": sum(a == b for a, b in zip(result["tokens"], plain, strict=True)),
            "sources_used": result["speculative"],
            **spec_stats(result),
        }
    return rows


def best_of(rows: dict[str, dict], configs: dict[str, Config], sources: tuple[str, ...]) -> str | None:
    """The configuration of ``sources`` with the highest speedup (None when none was run)."""
    names = [n for n in rows if configs[n][0] in sources]
    return max(names, key=lambda n: rows[n]["speedup"]) if names else None


def in_process_generate(loop, generation: Generation) -> Generate:
    def generate(ids, tokens: int, source: str, k: int, tree: str) -> Summary:
        async def one():
            params = SamplingParams(max_tokens=tokens, ignore_eos=True)
            # closed here, not left to the loop's end ("Task was destroyed but it is pending!")
            async with aclosing(generation.run(ids, params, speculative=source, k=k, tree=tree)) as events:
                async for event in events:
                    if isinstance(event, Summary):
                        return event

        return loop.run_until_complete(one())

    return generate


def single_node(
    loop,
    target: Path,
    drafts: DraftSources,
    sources: tuple[str, ...],
    prompts: list,
    kinds: list[str],
    heads: Path | None = None,
) -> dict:
    """Every stage in this process; every source's configurations against plain (the final stage
    running ``heads`` for the ``medusa`` source)."""
    prompter = Prompter.from_dir(target)
    ring = single_ring(target)
    if heads is not None:
        ring.stages.run_heads(heads)
    ring.stages.warmup()
    generation = Generation(ring, prompter.tokenizer, prompter.eos_ids, drafts=drafts)
    configs = spec_configs(sources, KS, trees=ring.verifies_trees)
    samples, per_prompt, last = measure(
        configs, in_process_generate(loop, generation), prompts, TOKENS, RUNS, warmup=0 if QUICK else 1
    )
    rows = table(configs, samples, per_prompt, last, kinds)
    return {
        "configs": rows,
        "best": best_of(rows, configs, tuple(s for s in sources if s not in ("feature", "mix", "medusa"))),
        "feature_best": best_of(rows, configs, ("feature",)),
        "mix_best": best_of(rows, configs, ("mix",)),
        "medusa_best": best_of(rows, configs, ("medusa",)),
        "plain_tokens": last["plain"]["tokens"],
        "sequences_compared": len(prompts) * (len(configs) - 1),
        "sequences_identical": sum(r["identical_to_plain"] for n, r in rows.items() if n != "plain"),
    }


def exactness(
    loop,
    drafts_for: Callable[[Path], DraftSources],
    sources: tuple[str, ...],
    prompts: list,
    heads: Path | None = None,
) -> dict:
    """Every source's configurations at EXACT_KS on 2- and 3-stage INT4 rings at ``exact``, token
    for token against plain greedy on the same ring."""
    configs = spec_configs(sources, EXACT_KS)
    identical = {}
    for stages in EXACT_STAGES:
        target = ensure_export(stages)
        prompter = Prompter.from_dir(target)
        ring = local_ring(target, "exact")
        if heads is not None:
            ring.stages.run_heads(heads)
        generation = Generation(ring, prompter.tokenizer, prompter.eos_ids, drafts=drafts_for(target))
        generate = in_process_generate(loop, generation)
        results = {n: [generate(p, TOKENS, *c).token_ids for p in prompts] for n, c in configs.items()}
        for name in configs:
            if name != "plain":
                identical[f"{stages}s-{name}"] = sum(
                    list(a) == list(b) for a, b in zip(results[name], results["plain"], strict=True)
                )
        print(f"exactness {stages} stages: {identical}", file=sys.stderr)
    return {"sequences_per_config": len(prompts), "identical": identical}


def wan_sweep(
    extra: list[str],
    sources: tuple[str, ...],
    prompts: list[str],
    kinds: list[str],
    heads: Path | None = None,
) -> dict:
    """Plain against each source's configurations over the WAN emulator, one fleet per point (its
    final stage running ``heads`` for the ``medusa`` source)."""
    from pipeshard.services.wan.emulator import WanFleet

    out: dict[str, dict] = {}
    for stages in WAN_STAGES:
        shards = ensure_export(stages)
        for delay in DELAYS_MS:
            run_dir = Path(f"run/bench-spec-wan-{stages}s-{delay:g}ms")
            final = ["--draft-heads", str(heads)] if heads is not None else []
            fleet_args = {"extra_coordinator_args": extra, "final_stage_args": final}
            with WanFleet(shards, stages, delay, RATE_MBIT, run_dir, **fleet_args) as fleet:
                client = PipeshardClient(fleet.coordinator, timeout_s=600)
                trees = verifies_trees(fleet.fleet.lanes[0][0])
                configs: dict[str, Config] = {}
                for source in sources:
                    configs |= spec_configs((source,), WAN_KS, trees=trees)
                # what a request that does not choose gets (the fleet runs ``--speculative auto``),
                # in the shuffled rounds beside the rest: auto chooses from what this fleet measured
                # so far, the other configurations' adaptive requests included
                configs["default"] = ("", 0, "auto")

                def generate(prompt, tokens, source, k, tree, client=client):
                    return client.generate(
                        prompt, max_tokens=tokens, ignore_eos=True, speculative=source, k=k, tree=tree
                    )

                samples, per_prompt, last = measure(
                    configs, generate, prompts, WAN_TOKENS, WAN_RUNS, warmup=0 if QUICK else 1
                )
                client.close()
                batch = None
                if stages == 3 and delay == 100:
                    batch = batch_users(
                        fleet.coordinator, prompts, "feature" if "feature" in sources else sources[0]
                    )
                emulation = fleet.emulation
            rows = table(configs, samples, per_prompt, last, kinds)
            point: dict = {"stages": stages, "delay_ms": delay, "emulation": emulation, "configs": rows}
            if batch is not None:
                point["batch"] = batch
            for source in sources:
                names = [n for n in configs if configs[n][0] == source]
                best_fixed = max((n for n in names if is_fixed(configs[n])), key=lambda n: rows[n]["speedup"])
                auto = rows[f"{source}-auto"]["speedup"]
                point[source] = {
                    "best": max(names, key=lambda n: rows[n]["speedup"]),
                    "best_fixed": best_fixed,
                    "adaptive_over_best_fixed": auto / rows[best_fixed]["speedup"],
                    "adaptive_over_plain": auto,
                }
            key = f"{stages}s-{delay:g}ms"
            out[key] = point
            print(f"wan {key}: { ({n: round(r['tok_s'], 2) for n, r in rows.items()}) }", file=sys.stderr)
    return out


@dataclass
class UserRound:
    """One user's request in a batch round: when each streamed chunk came (seconds from the
    round's start, with its token count) and the answer's speculation counts."""

    arrivals: list[tuple[float, int]]
    result: GenerateResult

    @property
    def finished_s(self) -> float:
        return self.arrivals[-1][0] if self.arrivals else 0.0

    def tokens_by(self, t: float) -> int:
        return sum(n for at, n in self.arrivals if at <= t)


def steady_tok_s(users: list[UserRound]) -> float:
    """Tokens per second while every user is still generating: all users' tokens streamed until
    the first one finished, over that time (the round's wall time is set by the slowest user;
    this is what the fleet serves while its batch is full)."""
    first = min(u.finished_s for u in users)
    return sum(u.tokens_by(first) for u in users) / first if first > 0 else 0.0


def batch_users(coordinator: str, prompts: list[str], source: str, users: int = BATCH_USERS) -> dict:
    """``users`` requests at once (user i asks prompt i modulo their count), all plain against all
    speculating with ``source`` (adaptive K, tree auto), in interleaved rounds: aggregate tok/s
    (every user's tokens over the round's wall time) and steady-state tok/s (:func:`steady_tok_s`),
    each a ratio of medians with its 95% interval; per user (of the last round) the finish time,
    tokens per traversal and dropped steps; and whether every speculative answer equals its plain one."""
    import time

    asked = [prompts[i % len(prompts)] for i in range(users)]
    rounds: dict[str, list[UserRound]] = {}
    steady: dict[str, list[float]] = {"plain": [], "spec": []}

    def runner(name: str, speculative: str):
        request = {"max_tokens": WAN_TOKENS, "ignore_eos": True, "speculative": speculative, "k": 0}

        def run() -> float:
            async def one(client: AsyncPipeshardClient, prompt: str, started: float) -> UserRound:
                user = UserRound([], GenerateResult())
                async for response in client.responses(prompt, tree="auto", **request):
                    fold(user.result, response)
                    if response.HasField("chunk") and response.chunk.token_ids:
                        user.arrivals.append((time.perf_counter() - started, len(response.chunk.token_ids)))
                return user

            async def every_user():
                async with AsyncPipeshardClient(coordinator, timeout_s=600) as client:
                    started = time.perf_counter()
                    return await asyncio.gather(*(one(client, p, started) for p in asked)), started

            results, started = asyncio.run(every_user())
            wall = time.perf_counter() - started
            rounds[name] = results
            steady[name].append(steady_tok_s(results))
            return sum(u.result.completion_tokens for u in results) / wall

        return run

    samples = interleaved(
        {"plain": runner("plain", "none"), "spec": runner("spec", source)}, WAN_RUNS, warmup=0 if QUICK else 1
    )
    runs = len(samples["plain"])
    steady = {name: values[-runs:] for name, values in steady.items()}  # the warm-up rounds left out
    ratio, ci = ratio_ci(samples["spec"], samples["plain"])
    steady_ratio, steady_ci = ratio_ci(steady["spec"], steady["plain"])
    answers = {name: [u.result.token_ids for u in results] for name, results in rounds.items()}

    def per_user(results: list[UserRound]) -> list[dict]:
        return [
            {
                "finished_s": u.finished_s,
                "tokens": u.result.completion_tokens,
                "traversals": sum(u.result.kept_per_traversal),
                "tokens_per_traversal": u.result.completion_tokens / max(1, sum(u.result.kept_per_traversal)),
                "dropped_steps": u.result.dropped_steps,
            }
            for u in results
        ]

    return {
        "users": users,
        "source": source,
        "plain_tok_s": median(samples["plain"]),
        "spec_tok_s": median(samples["spec"]),
        "spec_over_plain": ratio,
        "spec_over_plain_ci95": ci,
        "plain_steady_tok_s": median(steady["plain"]),
        "spec_steady_tok_s": median(steady["spec"]),
        "steady_spec_over_plain": steady_ratio,
        "steady_spec_over_plain_ci95": steady_ci,
        "per_user_last_round": {name: per_user(results) for name, results in rounds.items()},
        "identical_to_plain": sum(a == b for a, b in zip(answers["spec"], answers["plain"], strict=True)),
    }


def pipelined_keys(wan: dict, sources: tuple[str, ...]) -> dict:
    """#48's keys at 3 stages and 100 ms per hop, the coordinator choosing each request's
    traversals in flight (``--spec-depth`` auto; prompt lookup's and the feature draft's chains go
    several at once, the heads one at a time): the best configuration of any source against plain
    and its share of dropped steps, the same at 25 ms, the most tokens per traversal, 8 users
    speculating against plain, and per prompt kind each source's best."""
    at_100 = wan.get("3s-100ms")
    if at_100 is None:
        return {}
    rows = at_100["configs"]
    best = max((at_100[s]["best"] for s in sources), key=lambda n: rows[n]["speedup"])
    out: dict = {
        "pipelined_speedup_at_100ms": rows[best]["speedup"],
        "pipelined_speedup_at_100ms_ci95": rows[best]["speedup_ci95"],
        "pipelined_source_at_100ms": best,
        "dropped_steps_share": rows[best].get("dropped_steps_share"),
        "best_tokens_per_traversal_at_100ms": max(
            rows[at_100[s]["best"]]["tokens_per_verify"] or 0.0 for s in sources
        ),
        "by_kind_at_100ms": {
            s: {
                "config": at_100[s]["best"],
                "speedup": {
                    kind: tok_s / rows["plain"]["tok_s_by_kind"][kind]
                    for kind, tok_s in rows[at_100[s]["best"]]["tok_s_by_kind"].items()
                },
                "tokens_per_traversal": rows[at_100[s]["best"]]["tokens_per_traversal_by_kind"],
            }
            for s in sources
        },
    }
    at_25 = wan.get("3s-25ms")
    if at_25 is not None:
        best_25 = max((at_25[s]["best"] for s in sources), key=lambda n: at_25["configs"][n]["speedup"])
        out["pipelined_speedup_at_25ms"] = at_25["configs"][best_25]["speedup"]
        out["pipelined_speedup_at_25ms_ci95"] = at_25["configs"][best_25]["speedup_ci95"]
        out["pipelined_source_at_25ms"] = best_25
    if "batch" in at_100:
        out["batch8_spec_over_plain_at_100ms"] = at_100["batch"]["spec_over_plain"]
        out["batch8_spec_over_plain_at_100ms_ci95"] = at_100["batch"]["spec_over_plain_ci95"]
        out["batch8_source_at_100ms"] = at_100["batch"]["source"]
        out["batch8_steady_spec_over_plain_at_100ms"] = at_100["batch"]["steady_spec_over_plain"]
        out["batch8_steady_spec_over_plain_at_100ms_ci95"] = at_100["batch"]["steady_spec_over_plain_ci95"]
    return out


def default_keys(wan: dict, sources: tuple[str, ...]) -> dict:
    """The fleet's default (``auto``, speculation/choice.py) at 3 stages at each delay: its speedup
    over plain, over the best single source's configuration there, and which sources it used."""
    out: dict = {}
    for point in wan.values():
        rows = point["configs"]
        if point["stages"] != 3 or "default" not in rows:
            continue
        delay = f"{point['delay_ms']:g}ms"
        best = max((point[s]["best"] for s in sources), key=lambda n: rows[n]["speedup"])
        out[f"default_speedup_at_{delay}"] = rows["default"]["speedup"]
        out[f"default_speedup_at_{delay}_ci95"] = rows["default"]["speedup_ci95"]
        out[f"default_over_best_source_at_{delay}"] = rows["default"]["speedup"] / rows[best]["speedup"]
        out[f"best_source_at_{delay}"] = best
        out[f"default_sources_at_{delay}"] = rows["default"]["sources_used"]
    return out


def plot(wan: dict, path: Path) -> None:
    """tok/s against the one-way delay per hop, a line per configuration, a panel per stage count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        1, len(WAN_STAGES), figsize=(6 * len(WAN_STAGES), 4.5), sharey=True, squeeze=False
    )
    for ax, stages in zip(axes[0], WAN_STAGES, strict=True):
        points = sorted((v for v in wan.values() if v["stages"] == stages), key=lambda v: v["delay_ms"])
        delays = [p["delay_ms"] for p in points]
        for name in points[0]["configs"]:
            ax.plot(delays, [p["configs"][name]["tok_s"] for p in points], marker="o", label=name)
        ax.set_title(f"{stages} stages (WAN emulator, {RATE_MBIT:g} Mbit/s)")
        ax.set_xlabel("one-way latency per hop (ms)")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("tok/s (greedy, median)")
    axes[0][-1].legend(fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def wan_keys(wan: dict, token_source: str, feature_sources: tuple[str, ...]) -> dict:
    """The sweep's keys: the best configuration of the token source (and of each feature-reading
    source: ``feature_`` for the eagle draft, ``medusa_`` for the heads) at 3 stages and 100 ms per
    hop; the adaptive policy's worst point."""
    sources = (token_source, *feature_sources)
    out: dict = {
        "adaptive_vs_best_fixed_min": min(
            p[s]["adaptive_over_best_fixed"] for p in wan.values() for s in sources
        ),
        "adaptive_over_plain_min": min(p[s]["adaptive_over_plain"] for p in wan.values() for s in sources),
    }
    at_100 = wan.get("3s-100ms")
    if at_100 is None:
        return out
    for source in sources:
        prefix = "" if source == token_source else f"{source}_"
        best = at_100["configs"][at_100[source]["best"]]
        out[f"{prefix}speedup_at_100ms"] = best["speedup"]
        out[f"{prefix}speedup_at_100ms_ci95"] = best["speedup_ci95"]
        out[f"{prefix}tokens_per_traversal_at_100ms"] = best["tokens_per_verify"]
    return out


def main() -> int:
    set_offline_defaults()
    target = ensure_export(1)
    sources = token_sources()
    self_draft = self_draft_export() if "self" in sources else None
    hf = hf_draft_folder() if "hf" in sources else None
    feature = feature_draft(target)
    heads = draft_heads_folder(target)
    # mix: prompt lookup where it matches, else the feature draft (what ``auto`` most often picks)
    mixed = ("feature", "mix") if feature else ()
    all_sources = sources + mixed + (("medusa",) if heads else ())
    head_count = 0
    if heads is not None:
        from pipeshard.shard.draft_heads import read_meta as read_heads

        head_count = read_heads(heads).heads

    def drafts_for(export: Path) -> DraftSources:
        return DraftSources(
            export,
            self_draft=self_draft,
            feature=feature,
            heads=head_count,
            named={"hf": hf} if hf else None,
        )

    prompter = Prompter.from_dir(target)
    every_prompt = [prompter.encode("", [("user", text)]) for _, text in KINDS]
    measured = max(TOKENS, WAN_TOKENS if "wan" in PARTS else 0)
    loop = asyncio.new_event_loop()
    kept, answers = natural_kinds(loop, target, every_prompt, measured)
    if not kept:
        raise SystemExit(f"every prompt's plain answer loops within {measured} tokens")
    kinds = [KINDS[i][0] for i in kept]
    prompts = [every_prompt[i] for i in kept][:PROMPTS]
    result: dict = {
        "runs": RUNS,
        "parts": list(PARTS),
        "single_kv": SINGLE_KV,
        "tokens": TOKENS,
        "sources": list(all_sources),
        "kinds": kinds,
        "dropped_kinds": [KINDS[i][0] for i in range(len(KINDS)) if i not in kept],
        "repetition_rate": repetition_rate(answers),
        "self_draft": SELF_DRAFT_EXPORT or (SELF_DRAFT if self_draft else None),
    }
    if feature:
        from pipeshard.shard.feature_draft import read_meta

        training = read_meta(feature).training
        result |= {
            "feature_draft": str(feature),
            "feature_training": training,
            # texts and training: what making the draft took on this machine
            "draft_train_minutes": training.get("total_minutes", training.get("minutes")),
            "feature_bytes": feature_bytes(target),
            "feature_draft_cost": feature_draft_cost(target, feature),
            "feature_teacher_forced": feature_agreement(
                target, feature, [every_prompt[i] for i in kept], kinds, measured
            ),
        }
    if heads is not None:
        result |= {
            "draft_heads": str(heads),
            "draft_heads_training": read_heads(heads).training,
            "draft_heads_cost": draft_heads_cost(target, heads),
        }
    exact: list[bool] = []
    single = None
    if "single" in PARTS:
        single = single_node(
            loop, target, drafts_for(target), all_sources, prompts, kinds[: len(prompts)], heads
        )
        chain_answers = [answers[i][:TOKENS] for i in kept][: len(prompts)]
        if single.pop("plain_tokens") != chain_answers:
            raise RuntimeError("two rings of the same shards answered plain greedy differently")
        configs = single["configs"]
        exact.append(single["sequences_identical"] == single["sequences_compared"])
        result |= {
            "tok_s": {n: r["tok_s"] for n, r in configs.items()},
            "single_node_speedup": configs[single["best"]]["speedup"],
            "single_node_speedup_ci95": configs[single["best"]]["speedup_ci95"],
            "single_node": single,
        }
        best_any = best_of(configs, spec_configs(all_sources, KS), all_sources)
        if best_any is not None:
            result["best_single_node_speedup"] = configs[best_any]["speedup"]
            result["best_single_node_config"] = best_any
        if single["feature_best"]:
            result["feature_single_node_speedup"] = configs[single["feature_best"]]["speedup"]
            result["feature_single_node_speedup_ci95"] = configs[single["feature_best"]]["speedup_ci95"]
        if single["mix_best"]:
            result["mix_single_node_speedup"] = configs[single["mix_best"]]["speedup"]
            result["mix_single_node_speedup_ci95"] = configs[single["mix_best"]]["speedup_ci95"]
        if single["medusa_best"]:
            result["medusa_single_node_speedup"] = configs[single["medusa_best"]]["speedup"]
            result["medusa_single_node_speedup_ci95"] = configs[single["medusa_best"]]["speedup_ci95"]
            result["medusa_tokens_per_traversal"] = configs[single["medusa_best"]]["tokens_per_verify"]
        if not QUICK:
            result["physical_trim_ms_per_call"] = trim_cost(target, prompts[0]) * 1000.0
            from pipeshard.exporter.draft import ensure_draft_export

            named = {"self": self_draft} if self_draft else {}
            if hf:
                named["hf"] = ensure_draft_export(hf, drafts_for(target).draft_cache)
            result["draft_cost"] = token_draft_costs(target, named)
    if "exact" in PARTS:
        checked = exactness(loop, drafts_for, all_sources, prompts, heads)
        exact.append(all(v == checked["sequences_per_config"] for v in checked["identical"].values()))
        result["exactness"] = checked
    loop.close()
    if "wan" in PARTS:
        token_source = WAN_SOURCE or "ngram"
        if WAN_SOURCE is None and single is not None:
            rows = single["configs"]
            token_source = max(
                sources,
                key=lambda s: max(rows[n]["tokens_per_verify"] or 0 for n in rows if n.startswith(f"{s}-")),
            )
        wan_sources = (token_source, *mixed) + (("medusa",) if heads else ())
        extra = ["--step-timeout-s", "120", "--speculative", "auto"]
        extra += ["--self-draft", str(self_draft)] if self_draft else []
        extra += ["--draft", f"hf={hf}"] if hf else []
        extra += ["--feature-draft", str(feature)] if feature else []
        texts = [KINDS[i][1] for i in kept][:WAN_PROMPTS]
        wan = wan_sweep(extra, wan_sources, texts, kinds[: len(texts)], heads)
        for point in wan.values():
            plain = len(texts)
            exact.append(all(r["identical_to_plain"] == plain for r in point["configs"].values()))
            if "batch" in point:
                exact.append(point["batch"]["identical_to_plain"] == point["batch"]["users"])
        if len(DELAYS_MS) > 1:  # the docs' plot from the whole sweep only
            full = WAN_STAGES == (2, 3) and DELAYS_MS == (0, 10, 25, 50, 100)
            plot_path = Path("docs/img/bench-spec-wan.png") if full else RESULTS_DIR / "spec-wan.png"
            plot(wan, plot_path)
            result["plot"] = str(plot_path)
        result |= {
            "wan_tokens": WAN_TOKENS,
            "wan_runs": WAN_RUNS,
            "wan_kinds": kinds[: len(texts)],
            "wan_source": token_source,
            **wan_keys(wan, token_source, wan_sources[1:]),
            **pipelined_keys(wan, wan_sources),
            **default_keys(wan, wan_sources),
            "wan": wan,
        }
    result["bit_exact"] = all(exact) if exact else None
    name = "spec" if PARTS == ALL_PARTS else "spec-" + "-".join(PARTS)
    knobs = " ".join(f"{k}={os.environ[k]}" for k in KNOBS if k in os.environ)
    write_result(name, result, f"{knobs} make bench-spec".strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
