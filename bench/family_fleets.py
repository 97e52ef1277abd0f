"""`make bench-families`, second part: each family's 2-stage fleet against openvino_genai on the
unsplit optimum-intel export of the same model folder (bench/family_fleets.json).

Families (BENCH_FAMILIES, default all): ``smollm2`` (Llama, the bundled model), ``gemma3`` (Gemma 3
270M, real weights), ``qwen3``, ``phi3`` and ``qwen3_moe`` (`pipeshard model synth --like
qwen3-0.6b`, ``phi-3-mini-4k`` and ``qwen3-30b-a3b``, seeded random weights, BENCH_SYNTH_LAYERS
decoder layers, default 4; the MoE shape keeps BENCH_MOE_EXPERTS of its 128 experts, default 32,
8 per token, so it fits this machine). Our int4 export runs the MoE layers in the dense form
(exporter/families.py moe_form); optimum-intel's runs Hugging Face's per-expert loop. For each:
our INT4 export at 2 stages (shards/<name>-2s-int4) served by a real fleet (stage processes, a
coordinator, gRPC) at the default precision, and ``optimum-cli export openvino`` INT4 of the same
folder (bench/reference.py's arguments, shards/optimum-int4-<name>). The same raw-text prompts,
sent to continue (no chat template: Gemma 3 270M is a base model), the same token ids to both.

- 1 user: tok/s of one generation (first streamed token to last) on the fleet against
  openvino_genai.LLMPipeline (stateful SDPA backend) on the optimum export; goal >= 0.85.
- 8 users: aggregate tok/s of 8 concurrent generations (first request to last token) on the fleet
  against openvino_genai.ContinuousBatchingPipeline (what LLMPipeline runs with its default
  paged-attention backend) given the 8 prompts at once.
Paired, interleaved rounds (BENCH_RUNS, default 10, after BENCH_WARMUP, default 2); ratio of
medians with a 95% bootstrap interval; 128 new tokens (bench/latency.py's), eos ignored. The
result is rewritten after each family, so a cut run keeps the families it finished.
"""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from bench.latency import NEW_TOKENS, Continuous, FleetClient
from bench.reference import GenAIPipeline, optimum_export
from bench.stats import command_with_knobs, interleaved, ratio_ci, summary, write_result
from pipeshard import paths
from pipeshard.offline import set_offline_defaults
from pipeshard.precision import DEFAULT_PRECISION
from pipeshard.v1 import coordinator_pb2

FAMILIES = os.environ.get("BENCH_FAMILIES", "smollm2,gemma3,qwen3,phi3,qwen3_moe").split(",")
SYNTH_LAYERS = int(os.environ.get("BENCH_SYNTH_LAYERS", "4"))
MOE_EXPERTS = int(os.environ.get("BENCH_MOE_EXPERTS", "32"))
RUNS = int(os.environ.get("BENCH_RUNS", "10"))
WARMUP = int(os.environ.get("BENCH_WARMUP", "2"))
USERS = 8
STAGES = 2
KNOBS = (
    "BENCH_PART",
    "BENCH_FAMILIES",
    "BENCH_SYNTH_LAYERS",
    "BENCH_MOE_EXPERTS",
    "BENCH_RUNS",
    "BENCH_WARMUP",
)
SYNTH_LIKE = {"qwen3": "qwen3-0.6b", "phi3": "phi-3-mini-4k", "qwen3_moe": "qwen3-30b-a3b"}
PROMPTS = [
    "The history of the printing press begins",
    "A bicycle works by turning the pedals, which",
    "In a small village at the foot of the mountains,",
    "Water boils at 100 degrees Celsius because",
]


def model_dir(family: str) -> Path:
    """The Hugging Face folder both exports are made from (fetched or synthesized once)."""
    if family == "smollm2":
        from pipeshard.model.fetch import ensure_default_model

        return ensure_default_model()
    if family == "gemma3":
        from pipeshard.model.gemma3 import ensure_gemma3

        return ensure_gemma3()
    if family not in SYNTH_LIKE:
        known = ", ".join(["smollm2", "gemma3", *SYNTH_LIKE])
        sys.exit(f"BENCH_FAMILIES: unknown family {family!r}; choose from {known}")
    from pipeshard.model.shapes import get_shape
    from pipeshard.model.synth import synthesize

    shape = get_shape(SYNTH_LIKE[family]).with_layers(SYNTH_LAYERS)
    experts = f"-{MOE_EXPERTS}e" if shape.experts else ""
    if shape.experts:
        shape = replace(shape, experts=MOE_EXPERTS)
    out = paths.models_dir() / f"synth-{SYNTH_LIKE[family]}-{SYNTH_LAYERS}l{experts}"
    if not (out / "config.json").exists():
        synthesize(shape, out, force=True)
    return out


def our_export(family: str, source: Path) -> Path:
    from pipeshard.exporter.export import export_model

    name = paths.DEFAULT_MODEL if family == "smollm2" else source.name
    out = paths.shards_dir() / paths.export_name(name, STAGES, "int4")
    if not (out / "manifest.json").exists():
        export_model(source, out, stages=STAGES, weights="int4")
    return out


class Completions(FleetClient):
    """Raw-text generations (continued, no chat template) through a running fleet's coordinator."""

    prompts = PROMPTS

    def request(self, prompt: str, tokens: int) -> coordinator_pb2.GenerateRequest:
        return coordinator_pb2.GenerateRequest(
            prompt=prompt, params=coordinator_pb2.SamplingParams(max_tokens=tokens, ignore_eos=True)
        )


def measure(family: str, work: Path) -> dict:
    from pipeshard.services.launcher import start_fleet
    from pipeshard.shard.prompting import Prompter

    source = model_dir(family)
    shards = our_export(family, source)
    reference = optimum_export(source, paths.shards_dir() / f"optimum-int4-{source.name}")
    prompter = Prompter.from_dir(shards)
    ids = [prompter.encode(p, []) for p in PROMPTS]
    fleet = start_fleet(shards, STAGES, work / f"run-{family}")
    try:
        client, genai, cb = Completions(fleet.coordinator), GenAIPipeline(reference), Continuous(reference)
        turn = iter(range(10**9))
        last: dict[str, list[int]] = {}

        def one_fleet() -> float:
            out = client.run(PROMPTS[next(turn) % len(PROMPTS)], NEW_TOKENS)
            last["fleet"] = out["tokens"]
            return out["tok_s"]

        def one_genai() -> float:
            out = genai.run(ids[next(turn) % len(ids)], NEW_TOKENS)
            last["genai"] = out["tokens"]
            return out["tok_s"]

        one = interleaved({"fleet": one_fleet, "llm_pipeline": one_genai}, RUNS, WARMUP)
        ids8 = [ids[i % len(ids)] for i in range(USERS)]
        eight = interleaved(
            {"fleet": lambda: client.aggregate(USERS), "continuous_batching": lambda: cb.aggregate(ids8)},
            RUNS,
            WARMUP,
        )
        # the same prompt for both: does the fleet's INT4 export greedy-decode as optimum's does?
        same_prompt = client.run(PROMPTS[0], NEW_TOKENS)["tokens"] == genai.run(ids[0], NEW_TOKENS)["tokens"]
    finally:
        fleet.stop()
    r1, ci1 = ratio_ci(one["fleet"], one["llm_pipeline"])
    r8, ci8 = ratio_ci(eight["fleet"], eight["continuous_batching"])
    return {
        "model": str(source.name),
        "synthetic_layers": SYNTH_LAYERS if family in SYNTH_LIKE else None,
        "synthetic_experts": MOE_EXPERTS if family == "qwen3_moe" else None,
        "tok_s_1user": {n: summary(v) for n, v in one.items()},
        "fleet_over_llm_pipeline_1user": r1,
        "fleet_over_llm_pipeline_1user_ci95": ci1,
        "tok_s_8users": {n: summary(v) for n, v in eight.items()},
        "fleet_over_continuous_batching_8users": r8,
        "fleet_over_continuous_batching_8users_ci95": ci8,
        "greedy_tokens_equal_first_prompt": same_prompt,
        "load_avg": os.getloadavg(),
    }


def main() -> int:
    set_offline_defaults()
    os.environ.setdefault("PIPESHARD_PREFIX_CACHE", "off")
    work = Path(tempfile.mkdtemp(prefix="pipeshard-families-"))
    result: dict = {
        "stages": STAGES,
        "runs": RUNS,
        "warmup": WARMUP,
        "new_tokens": NEW_TOKENS,
        "fleet_precision": DEFAULT_PRECISION,
        "reference": "optimum-cli export openvino INT4 (bench/reference.py), openvino_genai on CPU",
        "goal": "fleet >= 0.85 of LLMPipeline at 1 user for every family",
        "families": {},
    }
    for family in FAMILIES:
        result["families"][family] = measure(family, work)
        print(family, result["families"][family], file=sys.stderr)
        write_result("family_fleets", result, command_with_knobs("bench-families", KNOBS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
