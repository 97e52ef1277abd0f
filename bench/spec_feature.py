"""`make bench-spec`, part ``feature`` (issue 31): the feature draft (``pipeshard distil --kind
eagle``) against plain greedy decoding on the eight natural prompt kinds of bench/spec.py.

Single node (every stage in this process, INT4 at ``exact``, stateful so trees run): plain,
chains at BENCH_FEATURE_KS, adaptive K, and trees at BENCH_FEATURE_TREES, interleaved rounds;
per configuration tok/s, acceptance, committed tokens per verify traversal (the target's own
included), whether every answer equals plain greedy's. WAN (``flock /tmp/wan.lock``, 3 stages at
100 ms per hop): plain against the feature draft's adaptive K and a fixed chain. Also what the
features cost on the wire (StepResult bytes with and without them) and what the draft costs per
drafted token against the target's decode step (numpy, the served forward, and torch).

Keys: ``feature_single_node_speedup``, ``feature_speedup_at_100ms``,
``feature_tokens_per_traversal_at_100ms`` (the best configuration of each), ``feature_bit_exact``,
``draft_train_minutes`` (from the draft's own record; a reused draft keeps its training time).
BENCH_FEATURE_DRAFT=<folder> uses that draft instead of training/reusing the default one;
BENCH_FEATURE_PARTS (single,wan) runs some parts; BENCH_FEATURE_KS (3,5), BENCH_FEATURE_TREES (3x4)
and BENCH_FEATURE_WAN_KS (4) set the configurations.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from bench.stats import interleaved, median, ratio_ci

KS = tuple(int(k) for k in os.environ.get("BENCH_FEATURE_KS", "3,5").split(",") if k)
TREES = tuple(t for t in os.environ.get("BENCH_FEATURE_TREES", "3x4").split(",") if t)
WAN_KS = tuple(int(k) for k in os.environ.get("BENCH_FEATURE_WAN_KS", "4").split(",") if k)
DRAFT = os.environ.get("BENCH_FEATURE_DRAFT")
FEATURE_PARTS = tuple(os.environ.get("BENCH_FEATURE_PARTS", "single,wan").split(","))
VOCAB = 8192


def feature_draft(target: Path) -> Path:
    """The trained draft for the target's weights: BENCH_FEATURE_DRAFT, or the default folder
    (trained there when missing or for other weights, as `make distil KIND=eagle` would)."""
    from pipeshard import paths
    from pipeshard.exporter.distil_cli import _report
    from pipeshard.exporter.eagle import distil_eagle

    if DRAFT:
        return Path(DRAFT)
    out = paths.shards_dir() / paths.feature_draft_name(paths.DEFAULT_MODEL, VOCAB)
    distil_eagle(paths.default_model_dir(), target, out, vocab=VOCAB, report=_report)
    return out


def configs(ks: tuple[int, ...], trees: tuple[str, ...]) -> dict[str, tuple[str, int, str]]:
    out = {"plain": ("none", 0, "off"), "feature-chain-auto": ("feature", 0, "off")}
    out |= {f"feature-k{k}": ("feature", k, "off") for k in ks}
    out |= {f"feature-tree{t}": ("feature", 0, t) for t in trees}
    return out


def single_node(loop, target: Path, draft: Path, prompts: list[list[int]], runs: int, tokens: int) -> dict:
    from bench.spec import repetition_rate, run_prompts, spec_stats
    from pipeshard.services.coordinator.generation import Generation
    from pipeshard.services.coordinator.in_process import local_ring
    from pipeshard.services.coordinator.speculation.sources import DraftSources
    from pipeshard.shard.prompting import Prompter

    prompter = Prompter.from_dir(target)
    ring = local_ring(target)
    ring.stages.warmup()
    generation = Generation(
        ring, prompter.tokenizer, prompter.eos_ids, drafts=DraftSources(target, feature=draft)
    )
    table = configs(KS, TREES)
    last: dict[str, dict] = {}

    def runner(name: str):
        mode, k, tree = table[name]

        def run() -> float:
            last[name] = run_prompts(loop, generation, prompts, tokens, mode, k, tree)
            return last[name]["tok_s"]

        return run

    samples = interleaved({n: runner(n) for n in table}, runs, warmup=1)
    plain = samples["plain"]
    rows = {}
    for name in table:
        ratio, ci = ratio_ci(samples[name], plain)
        rows[name] = {
            "tok_s": median(samples[name]),
            "speedup": ratio,
            "speedup_ci95": ci,
            "identical_to_plain": sum(
                a == b for a, b in zip(last[name]["tokens"], last["plain"]["tokens"], strict=True)
            ),
            **spec_stats(last[name]),
        }
    best = max((n for n in table if n != "plain"), key=lambda n: rows[n]["tok_s"])
    return {
        "configs": rows,
        "best": best,
        "prompts": len(prompts),
        "bit_exact": all(r["identical_to_plain"] == len(prompts) for r in rows.values()),
        "repetition_rate": repetition_rate(last["plain"]["tokens"]),
    }


def wan(draft: Path, prompts: list[str], runs: int, tokens: int) -> dict:
    """3 stages at 100 ms one way per hop (paged stages: chains), plain against the draft."""
    from bench.pipeline import ensure_export
    from bench.spec import RATE_MBIT, _fold, spec_stats
    from pipeshard.clients.client import PipeshardClient
    from pipeshard.services.wan.emulator import WanFleet

    table = {"plain": ("none", 0), "feature-auto": ("feature", 0)} | {
        f"feature-k{k}": ("feature", k) for k in WAN_KS
    }
    shards = ensure_export(3)
    extra = ["--feature-draft", str(draft), "--step-timeout-s", "120"]
    with WanFleet(
        shards, 3, 100.0, RATE_MBIT, Path("run/bench-spec-feature-wan"), extra_coordinator_args=extra
    ) as fleet:
        client = PipeshardClient(fleet.coordinator, timeout_s=600)
        last: dict[str, dict] = {}

        def runner(name: str):
            spec, k = table[name]

            def run() -> float:
                results = [
                    client.generate(p, max_tokens=tokens, ignore_eos=True, speculative=spec, k=k, tree="off")
                    for p in prompts
                ]
                last[name] = _fold(results)
                return last[name]["tok_s"]

            return run

        samples = interleaved({n: runner(n) for n in table}, runs, warmup=1)
        client.close()
        emulation = fleet.emulation
    plain = samples["plain"]
    best = max((n for n in table if n != "plain"), key=lambda n: median(samples[n]))
    return {
        "stages": 3,
        "delay_ms": 100.0,
        "emulation": emulation,
        "tok_s": {n: median(v) for n, v in samples.items()},
        "speedup": {n: ratio_ci(v, plain)[0] for n, v in samples.items() if n != "plain"},
        "speedup_ci95": {n: ratio_ci(v, plain)[1] for n, v in samples.items() if n != "plain"},
        "best": best,
        "spec": {n: spec_stats(r) for n, r in last.items() if n != "plain"},
        "tokens_match_plain": {
            n: sum(a == b for a, b in zip(r["tokens"], last["plain"]["tokens"], strict=True))
            for n, r in last.items()
        },
    }


def feature_bytes(target: Path, ks: tuple[int, ...] = (0, 4)) -> dict:
    """Bytes of a final stage's StepResult per step with and without the features (Top1 return,
    fp16 features), for a decode step and a K-draft verify."""
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
        full = StepOutput(row, top1=top1, features=features)
        with_features = result_from_output(full, [100, 100]).ByteSize()
        out[f"k{k}"] = {"without": without, "with": with_features, "extra": with_features - without}
    return out


def draft_cost(target: Path, draft: Path, reps: int = 200) -> dict:
    """Milliseconds per drafted token (one chain step) of the served numpy forward and of the same
    forward in torch, against the target's one-token decode step (every stage in this process)."""
    import torch

    from pipeshard.shard.chain import LocalChain
    from pipeshard.shard.feature_draft import FeatureDraftModel

    model = FeatureDraftModel(draft)
    f = np.random.default_rng(0).standard_normal((1, model.meta.hidden_size)).astype(np.float32)
    tok = np.array([42])

    def timed(fn, reps: int = reps) -> float:
        fn()
        times = []
        for _ in range(reps):
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
        return statistics.median(times) * 1000.0

    numpy_ms = timed(lambda: model.step(f, tok))
    weights = {
        "fc_e": torch.as_tensor(model.fc_embed_t),
        "fc_f": torch.as_tensor(model.fc_feature_t),
        "gate_up": torch.as_tensor(model.gate_up_t),
        "down": torch.as_tensor(model.down_t),
        "head": torch.as_tensor(model.head_t),
    }
    ft = torch.as_tensor(f)
    et = torch.as_tensor(model.embed[tok].astype(np.float32))

    def torch_step():
        with torch.no_grad():
            z = et @ weights["fc_e"] + ft @ weights["fc_f"]
            gate, up = (z @ weights["gate_up"]).chunk(2, dim=-1)
            h = z + (torch.nn.functional.silu(gate) * up) @ weights["down"]
            return h @ weights["head"]

    torch_ms = timed(torch_step)
    chain = LocalChain(target)
    chain.step(np.asarray([[1] * 64]))
    target_ms = timed(lambda: chain.step(np.asarray([[42]])), reps=100)
    return {
        "numpy_ms_per_token": numpy_ms,
        "torch_ms_per_token": torch_ms,
        "target_decode_ms": target_ms,
        "cost_vs_target": min(numpy_ms, torch_ms) / target_ms,
    }


def run(
    loop,
    target: Path,
    prompts: list[list[int]],
    *,
    runs: int,
    tokens: int,
    wan_prompts: list[str],
    wan_tokens: int,
) -> dict:
    """Every part above; the keys bench/spec.py adds to its result."""
    from pipeshard.shard.feature_draft import read_meta

    draft = feature_draft(target)
    meta = read_meta(draft)
    result = {
        "feature_draft": str(draft),
        "feature_training": meta.training,
        "draft_train_minutes": meta.training.get("minutes"),
        "feature_bytes": feature_bytes(target),
        "feature_draft_cost": draft_cost(target, draft),
    }
    if "single" in FEATURE_PARTS:
        single = single_node(loop, target, draft, prompts, runs, tokens)
        best = single["best"]
        result |= {
            "feature_single_node_speedup": single["configs"][best]["speedup"],
            "feature_single_node_speedup_ci95": single["configs"][best]["speedup_ci95"],
            "feature_bit_exact": single["bit_exact"],
            "feature_single_node": single,
        }
    if "wan" in FEATURE_PARTS:  # the WAN emulator is shared: run under `flock /tmp/wan.lock`
        at_100 = wan(draft, wan_prompts, runs, wan_tokens)
        best = at_100["best"]
        result |= {
            "feature_speedup_at_100ms": at_100["speedup"][best],
            "feature_tokens_per_traversal_at_100ms": at_100["spec"][best]["tokens_per_verify"],
            "feature_wan": at_100,
        }
    print(f"feature: { ({k: v for k, v in result.items() if not isinstance(v, dict)}) }", file=sys.stderr)
    return result
