"""`make bench-parity`: our shards against the unsplit model, all in this process.

Configurations (128 new tokens, eos ignored, the same chat-templated prompt, default CPU precision):
  A    openvino_genai.LLMPipeline on the optimum-intel export (int4 sym, group 64, ratio 1.0;
       embeddings and tied LM head INT8 asymmetric, as our shards' --head-precision int8)
  A'   the same optimum export driven by a minimal Python loop
  B    our 1-stage shard;  B0  the same without the beam_idx Gather
  C2   our 2-stage shards chained in-process;  C3  3 stages
Exact rows (pipeshard/precision.py): B and C2 again at ``--precision exact`` (B_exact, C2_exact),
interleaved with the rest; TTFT of a 1024-token prompt on the 1-stage shard at both precisions in
their own interleaved rounds; max |delta logit| of verify rows, prefill chunks and batch rows
against one-row decoding at ``exact`` (bench/numerics.py). BENCH_PARITY=exact runs only these
(B, C2, B_exact, C2_exact; writes bench/results/parity_exact.json).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from bench.stats import interleaved, interleaved_generations, median, ratio_ci, summary, write_result
from pipeshard import paths
from pipeshard.offline import set_offline_defaults
from pipeshard.precision import DEFAULT_PRECISION as DEFAULT
from pipeshard.shard.chain import LocalChain
from pipeshard.shard.prompting import Prompter

NEW_TOKENS = 128
PROMPT = "Explain in a few paragraphs how a bicycle works."
RUNS = int(os.environ.get("BENCH_RUNS", "10"))
LONG_PROMPT_TOKENS = 1024
# exact is compared with the CPU plugin's own precision ("fast"), whatever the project default is
CPU_DEFAULT_ROWS = {"B": "B", "C2": "C2"} if DEFAULT == "fast" else {"B": "B_cpu", "C2": "C2_cpu"}


def ensure_export(stages: int, beam_idx: bool = True) -> Path:
    from pipeshard.exporter.export import export_model

    name = paths.export_name(paths.DEFAULT_MODEL, stages, "int4") + ("" if beam_idx else "-nobeam")
    out = paths.shards_dir() / name
    if not (out / "manifest.json").exists():
        export_model(paths.default_model_dir(), out, stages=stages, weights="int4", beam_idx=beam_idx)
    return out


def chain_runner(chain: LocalChain, ids: list[int]):
    def run() -> dict:
        out = chain.generate_greedy(ids, NEW_TOKENS, ignore_eos=True)
        return {"tokens": out.token_ids, "ttft_ms": out.ttft_s * 1000, "tok_s": out.tok_s}

    return run


def long_prompt(export: Path) -> list[int]:
    """LONG_PROMPT_TOKENS ids of ordinary text (a chat prompt asking about a repeated passage)."""
    text = " ".join(
        f"Paragraph {i}: {PROMPT} Describe the gears, the chain and the brakes." for i in range(200)
    )
    ids = Prompter.from_dir(export).encode("", [("user", text)])
    return ids[:LONG_PROMPT_TOKENS]


def exact_rows(exports: dict[str, Path], samples: dict[str, list[float]]) -> dict:
    """The exact-mode keys: decode ratios from the shared rounds, TTFT at 1024 tokens, logit deltas."""
    from bench.numerics import measure_exact

    out = {}
    for key, (num, den) in {
        "exact_over_default_1s": ("B_exact", CPU_DEFAULT_ROWS["B"]),
        "exact_over_default_2s": ("C2_exact", CPU_DEFAULT_ROWS["C2"]),
    }.items():
        out[key], out[f"{key}_ci"] = ratio_ci(samples[num], samples[den])
    ids = long_prompt(exports["B"])
    chains = {p: LocalChain(exports["B"], p) for p in ("fast", "exact")}
    for chain in chains.values():
        chain.warmup(prefill=len(ids))

    def ttft(chain: LocalChain):
        return lambda: chain.generate_greedy(ids, 1, ignore_eos=True).ttft_s * 1000

    ttft_ms = interleaved({p: ttft(c) for p, c in chains.items()}, RUNS, warmup=1)
    out["ttft_1024_ms"] = {p: summary(v) for p, v in ttft_ms.items()}
    out["exact_ttft_over_default_1024"], out["exact_ttft_over_default_1024_ci"] = ratio_ci(
        ttft_ms["exact"], ttft_ms["fast"]
    )
    out.update(measure_exact(exports["B"], exports["C2"]))
    return out


def main() -> int:
    set_offline_defaults()
    only_exact = os.environ.get("BENCH_PARITY") == "exact"
    exports = {"B": ensure_export(1), "C2": ensure_export(2)}
    if not only_exact:
        exports |= {"B0": ensure_export(1, beam_idx=False), "C3": ensure_export(3)}
    ids = Prompter.from_dir(exports["B"]).encode("", [("user", PROMPT)])
    runners = {}
    if not only_exact:
        from bench.reference import GenAIPipeline, OwnLoop, optimum_export

        reference = optimum_export(paths.default_model_dir(), paths.shards_dir() / "optimum-int4-reference")
        genai, own = GenAIPipeline(reference), OwnLoop(reference)
        runners = {"A": lambda: genai.run(ids, NEW_TOKENS), "A_prime": lambda: own.run(ids, NEW_TOKENS)}
    chains = {}
    configs = {name: (folder, DEFAULT) for name, folder in exports.items()}
    configs |= {"B_exact": (exports["B"], "exact"), "C2_exact": (exports["C2"], "exact")}
    configs |= {row: (exports[name], "fast") for name, row in CPU_DEFAULT_ROWS.items() if row != name}
    for name, (folder, precision) in configs.items():
        chains[name] = LocalChain(folder, precision)
        chains[name].warmup()
        runners[name] = chain_runner(chains[name], ids)
    samples, last = interleaved_generations(runners, RUNS, warmup=2)
    exact = exact_rows(exports, samples)
    if only_exact:
        write_result(
            "parity_exact",
            {
                "runs": RUNS,
                "precision_default": DEFAULT,
                "tok_s": {n: median(v) for n, v in samples.items()},
                "tok_s_range": {n: summary(v) for n, v in samples.items()},
                "tokens_identical": {
                    "B_exact_vs_B": last["B_exact"]["tokens"] == last["B"]["tokens"],
                    "C2_exact_vs_B_exact": last["C2_exact"]["tokens"] == last["B_exact"]["tokens"],
                },
                **exact,
            },
            command="BENCH_PARITY=exact make bench-parity",
        )
        return 0
    ttft = {n: median([runners[n]()["ttft_ms"] for _ in range(3)]) for n in runners}
    ratios = {}
    for key, (num, den) in {
        "B_over_A": ("B", "A"),
        "C2_over_A": ("C2", "A"),
        "C3_over_A": ("C3", "A"),
        "B_over_B0": ("B", "B0"),
        "A_prime_over_A": ("A_prime", "A"),
        "B_over_A_prime": ("B", "A_prime"),
    }.items():
        ratios[key], ratios[f"{key}_ci"] = ratio_ci(samples[num], samples[den])
    from pipeshard.shard.manifest import load_manifest

    manifests = {n: load_manifest(f) for n, f in exports.items()}
    write_result(
        "parity",
        {
            "runs": RUNS,
            "baseline": "A (openvino_genai.LLMPipeline on the optimum-intel int4 export)",
            "tok_s": {n: median(v) for n, v in samples.items()},
            "tok_s_range": {n: summary(v) for n, v in samples.items()},
            **ratios,
            "goals": {"B_over_A": 0.98, "C2_over_A": 0.90, "C3_over_A": 0.88},
            "ttft_ms": ttft,
            "tokens_identical_to_B": {n: last[n]["tokens"] == last["B"]["tokens"] for n in runners},
            "export": {
                n: [
                    {
                        "stage": s.index,
                        "seconds": s.export.seconds,
                        "peak_rss_mb": s.export.peak_rss_bytes / 2**20,
                    }
                    for s in m.stages
                ]
                for n, m in manifests.items()
            },
            "compiled": chains["B"].runners[0].compiled_properties(),
            "compiled_exact": chains["B_exact"].runners[0].compiled_properties(),
            **exact,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
