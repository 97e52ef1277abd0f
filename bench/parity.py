"""`make bench-parity`: our shards against the unsplit model, all in this process.

Configurations (128 new tokens, eos ignored, the same chat-templated prompt, default CPU precision):
  A    openvino_genai.LLMPipeline on the optimum-intel export (int4 sym, group 64, ratio 1.0;
       embeddings and tied LM head INT8 asymmetric, as our shards' --head-precision int8)
  A'   the same optimum export driven by a minimal Python loop
  B    our 1-stage shard;  B0  the same without the beam_idx Gather
  C2   our 2-stage shards chained in-process;  C3  3 stages
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from bench.reference import GenAIPipeline, OwnLoop, optimum_export
from bench.stats import interleaved_generations, median, ratio_ci, summary, write_result
from pipeshard import paths
from pipeshard.offline import set_offline_defaults
from pipeshard.shard.chain import LocalChain
from pipeshard.shard.prompting import Prompter

NEW_TOKENS = 128
PROMPT = "Explain in a few paragraphs how a bicycle works."
RUNS = int(os.environ.get("BENCH_RUNS", "10"))


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


def main() -> int:
    set_offline_defaults()
    exports = {
        "B": ensure_export(1),
        "B0": ensure_export(1, beam_idx=False),
        "C2": ensure_export(2),
        "C3": ensure_export(3),
    }
    reference = optimum_export(paths.default_model_dir(), paths.shards_dir() / "optimum-int4-reference")
    ids = Prompter.from_dir(exports["B"]).encode("", [("user", PROMPT)])
    genai, own = GenAIPipeline(reference), OwnLoop(reference)
    runners = {"A": lambda: genai.run(ids, NEW_TOKENS), "A_prime": lambda: own.run(ids, NEW_TOKENS)}
    chains = {}
    for name, folder in exports.items():
        chains[name] = LocalChain(folder)
        chains[name].warmup()
        runners[name] = chain_runner(chains[name], ids)
    samples, last = interleaved_generations(runners, RUNS, warmup=2)
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
    import json

    manifests = {n: json.loads((f / "manifest.json").read_text()) for n, f in exports.items()}
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
                        "stage": s["index"],
                        "seconds": s["export"]["seconds"],
                        "peak_rss_mb": s["export"]["peak_rss_bytes"] / 2**20,
                    }
                    for s in m["stages"]
                ]
                for n, m in manifests.items()
            },
            "compiled": chains["B"].runners[0].compiled_properties(),
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
