"""`make bench-spec`: speculative decoding against target-only decoding, single node and over WAN.

Part 1, single node (every stage in this process, INT4 shards at the CPU's default precision):
target-only greedy against each draft source (prompt lookup, the self-draft, a same-tokenizer
Hugging Face folder) at K in {1, 3, 5, 8, 10} and adaptive K, over prompts of eight kinds, in
shuffled rounds. Per configuration: tok/s, acceptance rate, tokens per verify; per kind and as
the mean. Also: the per-call cost of the physical KV trim the mask-based rewind replaces, and
the agreement of speculative with plain greedy output at this precision (with the top-2 margin
where they part).

Part 2, exactness at f32: every draft source at K in {1, 5, 10} on 1- and 2-stage shards, token for
token against target-only greedy.

Part 3, WAN sweep (stage processes in network namespaces, tbf bandwidth cap, user-space delay
forwarder; see docs/SERVICES.md): 2 and 3 stages at 0, 10, 50, 100 ms one-way per hop, plain
decoding against fixed K and adaptive K with the best single-node draft source.

Draft trees (issue 30): beside each source's chains, tree rows at BENCH_TREES (3x4,2x3) and
`<source>-auto` (adaptive K with ``tree=auto``) against `<source>-chain-auto` (``tree=off``); the
WAN fleets run the default paged stages (a tree as one masked sequence; the single node's
in-process ring is stateful: a tree as chains). Keys: ``single_node_speedup`` (the best
configuration), ``bit_exact`` (every single-node configuration's tokens equal plain greedy's: INT4
at the default precision, ``exact``), ``repetition_rate`` (the share of prompts whose plain greedy
answer repeats a 4-gram more than 3 times), and from the WAN sweep ``speedup_at_100ms`` (the best
configuration at 3 stages, 100 ms per hop, mean over the prompts run), ``tokens_per_traversal_at_100ms``
(its committed tokens per verify traversal, the target's own included), ``adaptive_vs_best_fixed_min``
and ``adaptive_over_plain_min`` (over every latency).

BENCH_QUICK=1: 2 rounds after a warm-up, 24 tokens, K 5 only, the WAN sweep at 3 stages, 0 and 100 ms.
Sizes: BENCH_RUNS (10), BENCH_TOKENS (24 single node), BENCH_WAN_TOKENS (24), BENCH_WAN_PROMPTS (2).
Part 4, ``feature`` (issue 31, bench/spec_feature.py): the feature draft single node and, with the
WAN part, at 3 stages and 100 ms per hop.

BENCH_PARTS (single,exact,wan,feature) runs some of the parts only (the JSON is then named after them:
bench/results/spec-single.json); BENCH_KS (1,3,5,8,10) sets the single node's fixed K (empty:
adaptive only). BENCH_SELF_DRAFT=<export> replaces the self-draft (for example a distilled one,
`make distil`). The exactness part compares K in {1, 5, 10}; `make test-exactness` runs the whole
matrix. BENCH_WAN_STAGES (2,3), BENCH_WAN_DELAYS (0,10,50,100), BENCH_WAN_KS (5,10) and
BENCH_WAN_SOURCE (ngram|self|hf) run a part of the WAN sweep (the plot needs the whole one).
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from bench.pipeline import ensure_export
from bench.stats import interleaved, median, ratio_ci, write_result
from pipeshard import paths
from pipeshard.clients.client import PipeshardClient
from pipeshard.offline import set_offline_defaults
from pipeshard.services.coordinator.generation import Generation, Summary
from pipeshard.services.coordinator.in_process import local_ring
from pipeshard.services.coordinator.sampling import SamplingParams
from pipeshard.services.coordinator.speculation.sources import DraftSources
from pipeshard.shard.chain import LocalChain
from pipeshard.shard.prompting import Prompter

QUICK = os.environ.get("BENCH_QUICK") == "1"
RUNS = int(os.environ.get("BENCH_RUNS", "2" if QUICK else "10"))
TOKENS = int(os.environ.get("BENCH_TOKENS", "24"))
WAN_TOKENS = int(os.environ.get("BENCH_WAN_TOKENS", "24"))
WAN_PROMPTS = int(os.environ.get("BENCH_WAN_PROMPTS", "2"))
KS = tuple(int(k) for k in os.environ.get("BENCH_KS", "5" if QUICK else "1,3,5,8,10").split(",") if k)
TREES = tuple(t for t in os.environ.get("BENCH_TREES", "3x4,2x3").split(",") if t)
ALL_PARTS = ("single", "exact", "wan", "feature")
PARTS = tuple(p for p in ALL_PARTS if p in os.environ.get("BENCH_PARTS", ",".join(ALL_PARTS)).split(","))
WAN_KS = tuple(int(k) for k in os.environ.get("BENCH_WAN_KS", "5" if QUICK else "5,10").split(","))
EXACT_KS = (1, 5, 10)
DELAYS_MS = tuple(
    float(d) for d in os.environ.get("BENCH_WAN_DELAYS", "0,100" if QUICK else "0,10,50,100").split(",")
)
WAN_STAGES = tuple(int(n) for n in os.environ.get("BENCH_WAN_STAGES", "3" if QUICK else "2,3").split(","))
WAN_SOURCE = os.environ.get("BENCH_WAN_SOURCE")  # default: the best single-node source at K = 10
RATE_MBIT = 100.0
SELF_DRAFT = {"layers": 4, "vocab": 8192}
SELF_DRAFT_EXPORT = os.environ.get("BENCH_SELF_DRAFT")
HF_DRAFT_LAYERS = 2

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
# WAN prompts: kinds whose single-node acceptance is near the middle, not the best ones.
WAN_KINDS = ("technical explanation", "chat", "reasoning", "creative")


def drafts_for(target: Path) -> tuple[Path, Path]:
    """The self-draft export and the Hugging Face draft folder (built once, cached under shards/)."""
    from pipeshard.exporter.draft import export_draft
    from pipeshard.exporter.truncate import truncate_model

    model_dir = paths.default_model_dir()
    if SELF_DRAFT_EXPORT:
        self_draft = Path(SELF_DRAFT_EXPORT)
        if not (self_draft / "manifest.json").is_file():
            raise SystemExit(f"BENCH_SELF_DRAFT={self_draft} is not an export (no manifest.json)")
    else:
        self_draft = paths.shards_dir() / paths.draft_export_name(
            paths.DEFAULT_MODEL, SELF_DRAFT["layers"], SELF_DRAFT["vocab"], "int4"
        )
    if not (self_draft / "manifest.json").exists():
        export_draft(model_dir, self_draft, layers=SELF_DRAFT["layers"], vocab=SELF_DRAFT["vocab"])
    hf = paths.shards_dir() / f"{paths.DEFAULT_MODEL}-first{HF_DRAFT_LAYERS}-hf"
    if not (hf / "config.json").exists():
        truncate_model(model_dir, hf, layers=HF_DRAFT_LAYERS)
    return self_draft, hf


def run_prompts(
    loop, generation: Generation, prompts: list[list[int]], tokens: int, mode: str, k: int, tree: str = "off"
) -> dict:
    """Greedy generations of every prompt; decode tok/s over all of them plus per-prompt stats."""
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    per_prompt = []

    async def one(ids):
        async for event in generation.run(ids, params, speculative=mode, k=k, tree=tree):
            if isinstance(event, Summary):
                return event

    for ids in prompts:
        per_prompt.append(loop.run_until_complete(one(ids)))
    return _fold(per_prompt)


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
    }


def spec_stats(last: dict) -> dict:
    verify, drafted, kept = last["verify_steps"], last["draft_tokens"], last["accepted_tokens"]
    return {
        "acceptance": kept / drafted if drafted else None,
        "tokens_per_verify": (kept + verify) / verify if verify else None,
    }


def single_node(loop, target: Path, self_draft: Path, hf_draft: Path, prompts: list[list[int]]) -> dict:
    prompter = Prompter.from_dir(target)
    ring = local_ring(target)
    ring.stages.warmup()
    drafts = DraftSources(target, self_draft=self_draft, named={"hf": hf_draft})
    generation = Generation(ring, prompter.tokenizer, prompter.eos_ids, drafts=drafts)
    configs = spec_configs(("ngram", "self") if QUICK else ("ngram", "self", "hf"), KS)
    last: dict[str, dict] = {}
    per_prompt: dict[str, list[list[float]]] = {n: [] for n in configs}

    def runner(name: str):
        mode, k, tree = configs[name]

        def run() -> float:
            last[name] = run_prompts(loop, generation, prompts, TOKENS, mode, k, tree)
            per_prompt[name].append(last[name]["per_prompt_tok_s"])
            return last[name]["tok_s"]

        return run

    samples = interleaved({n: runner(n) for n in configs}, RUNS, warmup=1)
    for name in configs:
        per_prompt[name] = per_prompt[name][-RUNS:]
    plain = samples["plain"]
    rows = {}
    for name in configs:
        ratio, ci = ratio_ci(samples[name], plain)
        by_kind = {kind: median([run[i] for run in per_prompt[name]]) for i, (kind, _) in enumerate(KINDS)}
        acceptance = last[name]["per_prompt_acceptance"]
        rows[name] = {
            "tok_s": median(samples[name]),
            "speedup": ratio,
            "speedup_ci95": ci,
            "tok_s_by_kind": by_kind,
            "acceptance_by_kind": {kind: acceptance[i] for i, (kind, _) in enumerate(KINDS)},
            **spec_stats(last[name]),
        }
    best = max((n for n in configs if n != "plain"), key=lambda n: rows[n]["tok_s"])
    agreement = bf16_agreement(target, prompts, last)
    out = {
        "configs": rows,
        "best": best,
        "single_node_speedup": rows[best]["speedup"],
        "single_node_speedup_ci95": rows[best]["speedup_ci95"],
        "bf16_agreement": agreement,
        "bit_exact": agreement["sequences_identical"] == agreement["sequences_compared"],
        "repetition_rate": repetition_rate(last["plain"]["tokens"]),
    }
    if not QUICK:
        out["physical_trim_ms_per_call"] = trim_cost(target, prompts[0]) * 1000.0
        out["draft_cost"] = draft_costs(target, self_draft, hf_draft, drafts)
    return out


def spec_configs(sources: tuple[str, ...], ks: tuple[int, ...]) -> dict[str, tuple[str, int, str]]:
    """name -> (draft source, K (0: adaptive), tree): plain, each source's chains at every K and
    adaptive, its trees at every BENCH_TREES shape, and adaptive K with ``tree=auto``."""
    configs: dict[str, tuple[str, int, str]] = {"plain": ("none", 0, "off")}
    for source in sources:
        for k in ks:
            configs[f"{source}-k{k}"] = (source, k, "off")
        configs[f"{source}-chain-auto"] = (source, 0, "off")
        for shape in TREES:
            configs[f"{source}-tree{shape}"] = (source, 0, shape)
        configs[f"{source}-auto"] = (source, 0, "auto")
    return configs


def repetition_rate(answers: list[list[int]]) -> float:
    """The share of answers that repeat some 4-gram more than 3 times (looping text, whose
    speculative figures would flatter prompt lookup)."""
    from collections import Counter

    def loops(tokens: list[int]) -> bool:
        grams = Counter(tuple(tokens[i : i + 4]) for i in range(len(tokens) - 3))
        return any(n > 3 for n in grams.values())

    return sum(loops(a) for a in answers) / len(answers) if answers else 0.0


def bf16_agreement(target: Path, prompts: list[list[int]], last: dict) -> dict:
    """At the CPU's default (bf16) precision a K+1-row verify may round differently from a 1-row
    step: compare each configuration's tokens with plain greedy and give the top-2 margin of the
    plain run where they first differ."""
    chain = LocalChain(target)
    plain = last["plain"]["tokens"]
    margins = []
    for ids, expected in zip(prompts, plain, strict=True):
        out = chain.generate_greedy(ids, TOKENS, ignore_eos=True, top2_margins=True)
        if out.token_ids != expected:
            raise RuntimeError("the chain's greedy differs from the ring's plain greedy on the same shards")
        margins.append(out.margins)
    compared = diverged = 0
    divergences = []
    for name, result in last.items():
        if name == "plain":
            continue
        for p, (tokens, expected) in enumerate(zip(result["tokens"], plain, strict=True)):
            compared += 1
            if tokens != expected:
                diverged += 1
                at = next(i for i, (a, b) in enumerate(zip(tokens, expected, strict=False)) if a != b)
                divergences.append(
                    {"config": name, "kind": KINDS[p][0], "token": at, "top2_margin": margins[p][at]}
                )
    return {
        "sequences_compared": compared,
        "sequences_identical": compared - diverged,
        "divergences": divergences,
        "max_margin_at_divergence": max((d["top2_margin"] for d in divergences), default=None),
    }


def trim_cost(target: Path, prompt: list[int]) -> float:
    from pipeshard.shard.runtime import ShardRunner, time_trim

    session = ShardRunner(target, 0).new_session()
    session.run([(prompt * 8)[:300]])
    return time_trim(session, reps=50)


def draft_costs(target: Path, self_draft: Path, hf_draft: Path, drafts: DraftSources) -> dict:
    """Median seconds of a one-token step: the target (all stages) against each draft model."""
    import time

    import numpy as np

    from pipeshard.shard.runtime import ShardRunner

    def per_token(runner: ShardRunner) -> float:
        session = runner.new_session()
        session.run(np.zeros((1, 32), dtype=np.int64))
        times = []
        for _ in range(100):
            t0 = time.perf_counter()
            session.run(np.zeros((1, 1), dtype=np.int64), copy=False)
            times.append(time.perf_counter() - t0)
        return median(times)

    from pipeshard.exporter.draft import ensure_draft_export

    target_s = per_token(ShardRunner(target, 0))
    out = {"target_ms": target_s * 1000.0}
    for name, export in (("self", self_draft), ("hf", ensure_draft_export(hf_draft, drafts.draft_cache))):
        draft_s = per_token(ShardRunner(export, 0))
        out[f"{name}_ms"] = draft_s * 1000.0
        out[f"{name}_over_target"] = draft_s / target_s
    return out


def exactness(loop, self_draft: Path, hf_draft: Path, prompts: list[list[int]]) -> dict:
    """Every source and K on f32 shards of 1 and 2 stages against target-only greedy."""
    from pipeshard.exporter.export import export_model

    results = {}
    for stages in (1, 2):
        target = paths.shards_dir() / paths.export_name(paths.DEFAULT_MODEL, stages, "fp32")
        if not (target / "manifest.json").exists():
            export_model(paths.default_model_dir(), target, stages=stages, weights="fp32")
        prompter = Prompter.from_dir(target)
        generation = Generation(
            local_ring(target, "f32"),
            prompter.tokenizer,
            prompter.eos_ids,
            drafts=DraftSources(target, self_draft=self_draft, named={"hf": hf_draft}),
        )
        plain = run_prompts(loop, generation, prompts, TOKENS, "none", 0)["tokens"]
        for name, mode in (("ngram", "ngram"), ("self", "self"), ("hf", "hf")):
            for k in EXACT_KS:
                got = run_prompts(loop, generation, prompts, TOKENS, mode, k)["tokens"]
                results[f"{stages}s-{name}-k{k}"] = sum(a == b for a, b in zip(got, plain, strict=True))
        print(f"exactness {stages} stages: {results}", file=sys.stderr)
    return {"sequences_per_config": len(prompts), "identical": results}


def wan_sweep(self_draft: Path, hf_draft: Path, source: str, prompts: list[str]) -> dict:
    from pipeshard.services.wan.emulator import WanFleet

    # the coordinator is started with --draft hf=<folder>: clients pick names
    configs = {n.removeprefix(f"{source}-"): c for n, c in spec_configs((source,), WAN_KS).items()}
    out: dict[str, dict] = {}
    for stages in WAN_STAGES:
        shards = ensure_export(stages)
        for delay in DELAYS_MS:
            run_dir = Path(f"run/bench-spec-wan-{stages}s-{delay:g}ms")
            extra = ["--self-draft", str(self_draft), "--draft", f"hf={hf_draft}", "--step-timeout-s", "120"]
            with WanFleet(shards, stages, delay, RATE_MBIT, run_dir, extra_coordinator_args=extra) as fleet:
                client = PipeshardClient(fleet.coordinator, timeout_s=600)
                last: dict[str, dict] = {}

                def runner(name: str, client=client, last=last):
                    spec, k, tree = configs[name]

                    def run() -> float:
                        results = [
                            client.generate(
                                p, max_tokens=WAN_TOKENS, ignore_eos=True, speculative=spec, k=k, tree=tree
                            )
                            for p in prompts
                        ]
                        last[name] = _fold(results)
                        return last[name]["tok_s"]

                    return run

                samples = interleaved({n: runner(n) for n in configs}, RUNS, warmup=1)
                client.close()
                emulation = fleet.emulation
            key = f"{stages}s-{delay:g}ms"
            plain = samples["plain"]
            fixed = [n for n in configs if n not in ("plain", "auto", "chain-auto")]
            best_fixed = max(fixed, key=lambda n: median(samples[n]))
            best = max((n for n in configs if n != "plain"), key=lambda n: median(samples[n]))
            out[key] = {
                "stages": stages,
                "delay_ms": delay,
                "emulation": emulation,
                "tok_s": {n: median(v) for n, v in samples.items()},
                "speedup": {n: ratio_ci(v, plain)[0] for n, v in samples.items() if n != "plain"},
                "speedup_ci95": {n: ratio_ci(v, plain)[1] for n, v in samples.items() if n != "plain"},
                "best_fixed": best_fixed,
                "adaptive_over_best_fixed": median(samples["auto"]) / median(samples[best_fixed]),
                "adaptive_over_plain": median(samples["auto"]) / median(plain),
                "best": best,
                "spec": {n: spec_stats(r) for n, r in last.items() if n != "plain"},
                "tokens_match_plain": {
                    n: sum(a == b for a, b in zip(r["tokens"], last["plain"]["tokens"], strict=True))
                    for n, r in last.items()
                },
            }
            print(f"wan {key}: {out[key]['tok_s']}", file=sys.stderr)
    return out


def plot(wan: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, stages in zip(axes, (2, 3), strict=True):
        points = sorted((v for v in wan.values() if v["stages"] == stages), key=lambda v: v["delay_ms"])
        delays = [p["delay_ms"] for p in points]
        for name in points[0]["tok_s"]:
            ax.plot(delays, [p["tok_s"][name] for p in points], marker="o", label=name)
        ax.set_title(f"{stages} stages (WAN emulator, {RATE_MBIT:g} Mbit/s)")
        ax.set_xlabel("one-way latency per hop (ms)")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("tok/s (greedy, median)")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    set_offline_defaults()
    target = ensure_export(1)
    self_draft, hf_draft = drafts_for(target)
    prompter = Prompter.from_dir(target)
    prompts = [prompter.encode("", [("user", text)]) for _, text in KINDS]
    loop = asyncio.new_event_loop()
    result: dict = {
        "runs": RUNS,
        "parts": list(PARTS),
        "tokens": TOKENS,
        "self_draft": SELF_DRAFT_EXPORT or SELF_DRAFT,
        "hf_draft_layers": HF_DRAFT_LAYERS,
    }
    single = None
    if "single" in PARTS:
        single = single_node(loop, target, self_draft, hf_draft, prompts)
        result["tok_s"] = {n: r["tok_s"] for n, r in single["configs"].items()}
        result["single_node_speedup"] = single["single_node_speedup"]
        result["bit_exact"] = single["bit_exact"]
        result["repetition_rate"] = single["repetition_rate"]
        result["single_node"] = single
    if "exact" in PARTS:
        exact = exactness(loop, self_draft, hf_draft, prompts)
        result["bit_exact_f32"] = all(v == exact["sequences_per_config"] for v in exact["identical"].values())
        result["exactness_f32"] = exact
    if "feature" in PARTS:  # issue 31: the feature draft (bench/spec_feature.py)
        from bench import spec_feature

        texts = dict(KINDS)
        wan_prompts = [texts[k] for k in WAN_KINDS[:WAN_PROMPTS]]
        result |= spec_feature.run(
            loop, target, prompts, runs=RUNS, tokens=TOKENS, wan_prompts=wan_prompts, wan_tokens=WAN_TOKENS
        )
    loop.close()
    if "wan" in PARTS:
        # The WAN draft source: the one that keeps the most tokens per verify at K = 10.
        source = WAN_SOURCE or "ngram"
        if WAN_SOURCE is None and single is not None and KS:
            source = max(
                ("ngram", "self") if QUICK else ("ngram", "self", "hf"),
                key=lambda s: single["configs"][f"{s}-k{max(KS)}"]["tokens_per_verify"] or 0,
            )
        texts = dict(KINDS)
        wan = wan_sweep(self_draft, hf_draft, source, [texts[k] for k in WAN_KINDS[:WAN_PROMPTS]])
        if WAN_STAGES == (2, 3) and DELAYS_MS == (0, 10, 50, 100):
            plot_path = Path("docs/img/bench-spec-wan.png")
            plot(wan, plot_path)
            result["plot"] = str(plot_path)
        at_100 = wan.get("3s-100ms")
        result |= {
            "wan_tokens": WAN_TOKENS,
            "wan_prompts": list(WAN_KINDS[:WAN_PROMPTS]),
            "wan_source": source,
            "speedup_at_100ms": at_100["speedup"][at_100["best"]] if at_100 else None,
            "tokens_per_traversal_at_100ms": at_100["spec"][at_100["best"]]["tokens_per_verify"]
            if at_100
            else None,
            "adaptive_vs_best_fixed_min": min(v["adaptive_over_best_fixed"] for v in wan.values()),
            "adaptive_over_plain_min": min(v["adaptive_over_plain"] for v in wan.values()),
            "wan": wan,
        }
    knobs = " ".join(
        f"{k}={os.environ[k]}"
        for k in (
            "BENCH_PARTS",
            "BENCH_KS",
            "BENCH_SELF_DRAFT",
            "BENCH_WAN_STAGES",
            "BENCH_WAN_DELAYS",
            "BENCH_WAN_KS",
            "BENCH_WAN_SOURCE",
            "BENCH_TREES",
            "BENCH_QUICK",
            "BENCH_RUNS",
        )
        if k in os.environ
    )
    name = "spec" if PARTS == ALL_PARTS else "spec-" + "-".join(PARTS)
    write_result(name, result, f"{knobs} make bench-spec".strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
