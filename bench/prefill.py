"""`make bench-prefill`: time to first token against prompt length, paired with LLMPipeline.

Configurations, all on INT4 weights, one new token, the same prompt ids for every one:
  genai   openvino_genai.LLMPipeline (SDPA backend) on the optimum-intel export: the baseline
  1s      our 1-stage shard in-process (the coordinator's loop over a local_ring, as
          ``pipeshard generate --local`` runs it, with the coordinator's default prefill chunk)
  2s      our 2-stage shards in-process, the same way
  fleet   a 2-stage loopback fleet (stage processes + coordinator), through the Python client
TTFT is wall time from the call to the first token. Rounds interleave every configuration at
every length after warm-up rounds. Then ``cold_over_warm``: fresh fleets (started by the
launcher, so warmed up before SERVING), the first request after start against the second.

Knobs (environment): BENCH_RUNS (rounds, default 10), BENCH_WARMUP (default 1), BENCH_LENGTHS
(default 128,512,1024,2048,4000), BENCH_PRECISIONS (default: ``default`` and ``exact`` when this
build has it), BENCH_COLD_RUNS (fresh fleets, default 3), BENCH_COLD_LENGTH (default 1024).
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

from bench.reference import GenAIPipeline, optimum_export
from bench.stats import command_with_knobs, interleaved, median, ratio_ci, summary, write_result
from pipeshard import paths
from pipeshard.clients.client import PipeshardClient
from pipeshard.offline import set_offline_defaults
from pipeshard.precision import PRECISIONS
from pipeshard.services.coordinator.generation import DEFAULT_PREFILL_CHUNK, Chunk, Generation
from pipeshard.services.coordinator.in_process import local_ring
from pipeshard.services.coordinator.sampling import SamplingParams
from pipeshard.services.launcher import Fleet, start_fleet
from pipeshard.shard.prompting import Prompter
from pipeshard.shard.runtime import compile_properties

RUNS = int(os.environ.get("BENCH_RUNS", "10"))
WARMUP = int(os.environ.get("BENCH_WARMUP", "1"))
LENGTHS = [int(n) for n in os.environ.get("BENCH_LENGTHS", "128,512,1024,2048,4000").split(",")]
PRECISION_LIST = os.environ.get("BENCH_PRECISIONS", ",".join(p for p in ("fast", "exact") if p in PRECISIONS))
COLD_RUNS = int(os.environ.get("BENCH_COLD_RUNS", "3"))
COLD_LENGTH = int(os.environ.get("BENCH_COLD_LENGTH", "1024"))
PLOT = Path("docs/img/prefill_ttft.png")


def ensure_export(stages: int) -> Path:
    from pipeshard.exporter.export import export_model

    out = paths.shards_dir() / paths.export_name(paths.DEFAULT_MODEL, stages, "int4")
    if not (out / "manifest.json").exists():
        export_model(paths.default_model_dir(), out, stages=stages, weights="int4")
    return out


def prompt_of(tokenizer, length: int) -> tuple[str, list[int]]:
    """A raw prompt (no template) that encodes to exactly ``length`` ids, and those ids."""
    text = "Count" + " on" * (length - 1)
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if len(ids) != length:
        raise RuntimeError(f"prompt of {length} tokens encoded to {len(ids)}")
    return text, ids


class InProcess:
    """The coordinator's decode loop over every stage of an export in this process."""

    def __init__(self, export: Path, precision: str, loop: asyncio.AbstractEventLoop):
        self.ring = local_ring(export, precision=precision)
        self.ring.stages.warmup()
        prompter = Prompter.from_dir(export)
        self.generation = Generation(self.ring, prompter.tokenizer, prompter.eos_ids)
        self.loop = loop

    def ttft_ms(self, ids: list[int]) -> float:
        async def first() -> float:
            t0 = time.perf_counter()
            elapsed = 0.0
            async for event in self.generation.run(ids, SamplingParams(max_tokens=1, ignore_eos=True)):
                if isinstance(event, Chunk) and not elapsed:
                    elapsed = (time.perf_counter() - t0) * 1000.0
            return elapsed

        return self.loop.run_until_complete(first())


def client_ttft_ms(address: str, text: str) -> float:
    with PipeshardClient(address, timeout_s=600) as client:
        t0 = time.perf_counter()
        for response in client.responses(text, max_tokens=1, ignore_eos=True):
            if response.HasField("chunk"):
                return (time.perf_counter() - t0) * 1000.0
    raise RuntimeError("the fleet returned no token")


def run_fleet(export: Path, precision: str) -> Fleet:
    run_dir = Path(tempfile.mkdtemp(prefix="bench-prefill-fleet-"))
    # Prefill is what this measures: no prefix cache (the same prompts repeat every round).
    return start_fleet(
        export, 2, run_dir, precision=precision, extra_coordinator_args=["--prefix-cache", "off"]
    )


def cold_over_warm(export: Path, precision: str, text: str) -> dict:
    """Fresh fleets: the first request after the launcher returned against the second."""
    cold, warm = [], []
    for _ in range(COLD_RUNS):
        fleet = run_fleet(export, precision)
        try:
            cold.append(client_ttft_ms(fleet.coordinator, text))
            warm.append(client_ttft_ms(fleet.coordinator, text))
        finally:
            fleet.stop()
    ratio, ci = ratio_ci(cold, warm)
    return {"cold_ms": cold, "warm_ms": warm, "ratio": ratio, "ci": ci}


def plot(ttft: dict[str, dict[str, dict[int, float]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for precision, configs in ttft.items():
        for name, by_length in configs.items():
            lengths = sorted(by_length)
            style = "-" if precision == "fast" else "--"
            ax.plot(
                lengths,
                [by_length[n] / 1000 for n in lengths],
                style,
                marker="o",
                label=f"{name} ({precision})",
            )
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT, s (median)")
    ax.set_title("Time to first token, SmolLM2-135M INT4, 2-core CPU")
    ax.grid(alpha=0.3)
    ax.legend()
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(PLOT, dpi=110, bbox_inches="tight")


def main() -> int:
    set_offline_defaults()
    started = time.perf_counter()
    precisions = [p for p in PRECISION_LIST.split(",") if p]
    exports = {1: ensure_export(1), 2: ensure_export(2)}
    reference = optimum_export(paths.default_model_dir(), paths.shards_dir() / "optimum-int4-reference")
    tokenizer = Prompter.from_dir(exports[1]).tokenizer
    prompts = {n: prompt_of(tokenizer, n) for n in LENGTHS}
    loop = asyncio.new_event_loop()
    result: dict = {
        "runs": RUNS,
        "lengths": LENGTHS,
        "precisions": precisions,
        "prefill_chunk": DEFAULT_PREFILL_CHUNK,
        "baseline": "genai (openvino_genai.LLMPipeline, SDPA backend, on the optimum-intel int4 export)",
        "ttft_ms": {},
        "ttft_ms_range": {},
    }
    ttft: dict[str, dict[str, dict[int, float]]] = {}
    for precision in precisions:
        props = compile_properties(precision)
        genai = GenAIPipeline(reference, **{k: v for k, v in props.items() if k != "PERFORMANCE_HINT"})
        one, two = InProcess(exports[1], precision, loop), InProcess(exports[2], precision, loop)
        fleet = run_fleet(exports[2], precision)
        try:
            configs = {}
            for n, (text, ids) in prompts.items():
                configs[f"genai@{n}"] = lambda ids=ids, g=genai: g.run(ids, 1)["ttft_ms"]
                configs[f"1s@{n}"] = lambda ids=ids, r=one: r.ttft_ms(ids)
                configs[f"2s@{n}"] = lambda ids=ids, r=two: r.ttft_ms(ids)
                configs[f"fleet@{n}"] = lambda text=text, a=fleet.coordinator: client_ttft_ms(a, text)
            samples = interleaved(configs, RUNS, warmup=WARMUP)
        finally:
            fleet.stop()
        ttft[precision] = {}
        for name in ("genai", "1s", "2s", "fleet"):
            ttft[precision][name] = {n: median(samples[f"{name}@{n}"]) for n in LENGTHS}
        result["ttft_ms"][precision] = {k: median(v) for k, v in samples.items()}
        result["ttft_ms_range"][precision] = {k: summary(v) for k, v in samples.items()}
        suffix = "" if precision == "fast" else f"_{precision}"  # unsuffixed: the CPU plugin's choice
        for key, name in (("ttft_ratio_1s", "1s"), ("ttft_ratio_2s", "2s"), ("ttft_ratio_fleet", "fleet")):
            per_length = {}
            for n in LENGTHS:
                ratio, ci = ratio_ci(samples[f"{name}@{n}"], samples[f"genai@{n}"])
                per_length[str(n)] = {"ratio": ratio, "ci": ci}
            worst = max(per_length, key=lambda n: per_length[n]["ratio"])
            result[f"{key}_max{suffix}"] = per_length[worst]["ratio"]
            result[f"{key}_max{suffix}_ci"] = per_length[worst]["ci"]
            result[f"{key}_by_length{suffix}"] = per_length
    cold_text = prompt_of(tokenizer, COLD_LENGTH)[0]
    cold = cold_over_warm(exports[2], precisions[0], cold_text)
    result["cold_over_warm"] = cold["ratio"]
    result["cold_over_warm_ci"] = cold["ci"]
    result["cold"] = {"length": COLD_LENGTH, "fleets": COLD_RUNS, **cold}
    result["goals"] = {"ttft_ratio_1s_max": 1.1, "ttft_ratio_2s_max": 1.1, "ttft_ratio_fleet_max": 1.2}
    result["tok_s"] = {}  # this benchmark measures TTFT (ttft_ms); the key keeps the shared JSON shape
    result["seconds"] = round(time.perf_counter() - started, 1)
    plot(ttft)
    result["plot"] = str(PLOT)
    knobs = (
        "BENCH_RUNS",
        "BENCH_WARMUP",
        "BENCH_LENGTHS",
        "BENCH_PRECISIONS",
        "BENCH_COLD_RUNS",
        "BENCH_COLD_LENGTH",
    )
    write_result("prefill", result, command=command_with_knobs("bench-prefill", knobs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
