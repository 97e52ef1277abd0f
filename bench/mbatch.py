"""`make bench-mbatch`: many concurrent streams interleaved across the stages of one fleet.

Per configuration, c clients each stream BENCH_TOKENS (128) tokens (eos ignored, the same chat
prompt) at the same time through the coordinator: 2- and 3-stage loopback fleets with plain
decoding, the 2-stage fleet with every stream speculating (prompt lookup, fixed K), and a 2-stage
fleet on the WAN emulator at 50 ms one-way per hop, plain and speculative. Reported per
configuration: aggregate tok/s (all generated tokens / wall time of the batch), per-stream decode
tok/s, p50/p95 gap between streamed chunks (a speculative chunk carries every token one verify
kept), TTFT under load, and acceptance for the speculative ones. Every configuration, the
reference (LLMPipeline, one user) included, runs once per shuffled round, BENCH_RUNS (10) rounds
after a warm-up round. Isolation: every stream of every round must give the tokens of a solo
stream of the same decoding on the same shards (speculative against speculative with the same K:
at the CPU's default bf16 precision a K+1-row verify may round differently from a plain step).
Fleets run with the default OpenVINO threads (2 per stage process on this 2-core machine), and
one 2-stage fleet with one thread per stage: the two-stream ratio's baseline is whichever of the
two is faster with one stream.

Then, in this process: batch-dimension stacking against interleaving (bench/stacking.py).

The ``local_*`` series (continuous batching, issue #16) serve 1-8 users with different prompts
(bench/batched.py) through every stage in this process: the paged ``BatchedRing`` (all users'
rows in each inference) in exact mode at 1 thread and at the default precision with the plugin's
threads, and the stateful ``LocalRing`` with one user as the single-user baselines. Their keys:
``four_users_over_one`` / ``eight_users_over_one`` (paged exact, over its own single user),
``four_users_over_best_single`` (the best 4-user configuration over the best single-user one of
any backend, precision and thread setting), ``full_stack_over_mono`` (the best up to 8 users
over LLMPipeline), per-user TTFT and inter-token p50/p95, and isolation against solo runs.
The ``2s_paged`` / ``2s_paged_exact`` series run the 2-stage fleet with ``--kv paged`` on stages and
coordinator (plan frames: every user's row in each inference), at the default precision and in
exact mode with 1 thread per stage; when present, they give ``four_users_over_one`` and
``eight_users_over_one`` (exact) and their ``_default`` twins instead of the local series.

Knobs: BENCH_SERIES (comma-separated series names, default all; a subset skips stacking, the plot
and the ratios whose inputs it lacks), BENCH_DRAFT=<draft export> speculates with that draft
(`self`, for example a distilled one) instead of prompt lookup, BENCH_SPEC_K (3) and
BENCH_SPEC_K_WAN (8) set the fixed K of the speculative series.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

from bench import stacking
from bench.batched import LocalUsers, latency
from bench.pipeline import ensure_export
from bench.reference import GenAIPipeline, optimum_export
from bench.spec import spec_stats
from bench.stats import interleaved, median, ratio_ci, summary, write_result
from pipeshard import paths
from pipeshard.clients.client import AsyncPipeshardClient, GenerateResult, fold
from pipeshard.offline import set_offline_defaults
from pipeshard.services.launcher import start_fleet
from pipeshard.services.wan.emulator import WanFleet
from pipeshard.shard.prompting import Prompter

TOKENS = int(os.environ.get("BENCH_TOKENS", "128"))
PROMPT = "Explain in a few paragraphs how a bicycle works."
RUNS = int(os.environ.get("BENCH_RUNS", "10"))
# bench-spec: prompt lookup did best at small K on one node, larger K at high latency per hop.
SPEC_K = int(os.environ.get("BENCH_SPEC_K", "3"))
SPEC_K_WAN = int(os.environ.get("BENCH_SPEC_K_WAN", "8"))
DRAFT = os.environ.get("BENCH_DRAFT")
SPEC_SOURCE = "self" if DRAFT else "ngram"
WAN_DELAY_MS = 50.0
WAN_RATE_MBIT = 100.0
COORDINATOR_ARGS = ["--max-running", "8", "--step-timeout-s", "120"] + (
    ["--self-draft", DRAFT] if DRAFT else []
)


class Series(NamedTuple):
    label: str
    stages: int
    k: int  # fixed draft length of prompt-lookup speculation; 0: plain decoding
    wan: bool
    levels: tuple[int, ...]
    threads: int = 0  # OpenVINO inference threads per stage; 0: the plugin's choice (2 here)
    kv: str = "stateful"  # paged: stages and coordinator batch every session per step (#16)
    precision: str = "default"

    @property
    def fleet(self) -> tuple[int, int, bool, str, str]:
        return self.stages, self.threads, self.wan, self.kv, self.precision

    @property
    def loopback(self) -> tuple[int, int, bool, str, str]:
        return self.stages, self.threads, False, self.kv, self.precision


ALL_SERIES = {
    "2s": Series("2 stages", 2, 0, False, (1, 2, 3, 4, 8)),
    "2s_1t": Series("2 stages, 1 thread per stage", 2, 0, False, (1, 2), threads=1),
    "3s": Series("3 stages", 3, 0, False, (1, 3)),
    "2s_paged": Series("2 stages, paged, batched", 2, 0, False, (1, 2, 4, 8), kv="paged"),
    "2s_paged_exact": Series(
        "2 stages, paged, batched, exact, 1 thread",
        2,
        0,
        False,
        (1, 4, 8),
        threads=1,
        kv="paged",
        precision="exact",
    ),
    "2s_spec": Series(f"2 stages, {SPEC_SOURCE} K={SPEC_K}", 2, SPEC_K, False, (1, 2, 4)),
    "wan50": Series("2 stages, WAN 50 ms/hop", 2, 0, True, (1, 4, 8)),
    "wan50_spec": Series(
        f"2 stages, WAN 50 ms/hop, {SPEC_SOURCE} K={SPEC_K_WAN}", 2, SPEC_K_WAN, True, (4, 8)
    ),
}


class LocalSeries(NamedTuple):
    label: str
    paged: bool
    precision: str
    threads: int | None
    levels: tuple[int, ...]


ALL_LOCAL = {
    "local_exact": LocalSeries("in-process paged, exact, 1 thread", True, "exact", 1, (1, 2, 4, 8)),
    "local_default": LocalSeries("in-process paged, default precision", True, "default", None, (1, 2, 4, 8)),
    "local_stateful_exact": LocalSeries("in-process stateful, exact, 1 thread", False, "exact", 1, (1,)),
    "local_stateful_default": LocalSeries(
        "in-process stateful, default precision", False, "default", None, (1,)
    ),
}
_WANTED = os.environ.get("BENCH_SERIES", ",".join([*ALL_SERIES, *ALL_LOCAL])).split(",")
SERIES = {n: s for n, s in ALL_SERIES.items() if n in _WANTED}
LOCAL = {n: s for n, s in ALL_LOCAL.items() if n in _WANTED}
COMPLETE = SERIES == ALL_SERIES and LOCAL == ALL_LOCAL


async def _stream(address: str, k: int) -> dict:
    async with AsyncPipeshardClient(address, timeout_s=600) as client:
        t0 = time.perf_counter()
        arrivals, result = [], GenerateResult()
        responses = client.responses(
            PROMPT, max_tokens=TOKENS, ignore_eos=True, speculative=SPEC_SOURCE if k else "", k=k
        )
        async for response in responses:
            if response.HasField("chunk"):
                arrivals.append((time.perf_counter(), len(response.chunk.token_ids)))
            fold(result, response)
        return {"t0": t0, "arrivals": arrivals, "result": result}


def run_batch(loop: asyncio.AbstractEventLoop, address: str, c: int, k: int, record: dict) -> float:
    """One round of c concurrent streams; keeps them in ``record`` and ANDs their isolation."""

    async def batch():
        return await asyncio.gather(*(_stream(address, k) for _ in range(c)))

    start = time.perf_counter()
    streams = loop.run_until_complete(batch())
    wall = time.perf_counter() - start
    record["streams"] = streams
    record["isolated"] = record.get("isolated", True) and all(
        s["result"].token_ids == record["solo"] for s in streams
    )
    return sum(len(s["result"].token_ids) for s in streams) / wall


def stream_stats(streams: list[dict]) -> dict:
    """The last round's streams; speculation counts summed over them."""
    gaps = np.concatenate([np.diff([t for t, _ in s["arrivals"]]) for s in streams]) * 1000
    per_stream = []
    for s in streams:
        (first, _), (last, _) = s["arrivals"][0], s["arrivals"][-1]
        per_stream.append(sum(n for _, n in s["arrivals"][1:]) / (last - first))
    counts = {
        key: sum(getattr(s["result"], key) for s in streams)
        for key in ("verify_steps", "draft_tokens", "accepted_tokens")
    }
    return {
        "per_stream_tok_s": median(per_stream),
        "inter_chunk_ms": {"p50": float(np.percentile(gaps, 50)), "p95": float(np.percentile(gaps, 95))},
        "ttft_ms_under_load": median([(s["arrivals"][0][0] - s["t0"]) * 1000 for s in streams]),
        "spec": {**counts, **spec_stats(counts)},
    }


def best(samples: dict[str, list[float]], names: list[str], over: str) -> dict:
    """The fastest of ``names`` by median, as a ratio over ``over`` with its interval."""
    name = max(names, key=lambda n: median(samples[n]))
    ratio, ci = ratio_ci(samples[name], samples[over])
    return {"ratio": ratio, "ci": ci, "config": name}


def plot(samples: dict[str, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for prefix, series in [*SERIES.items(), *LOCAL.items()]:
        points = [summary(samples[f"{prefix}_x{c}"]) for c in series.levels]
        mid = [p["median"] for p in points]
        err = [
            [m - p["min"] for m, p in zip(mid, points, strict=True)],
            [p["max"] - m for m, p in zip(mid, points, strict=True)],
        ]
        ax.errorbar(series.levels, mid, yerr=err, marker="o", capsize=3, label=series.label)
    ax.axhline(median(samples["A"]), color="black", linestyle="--", label="LLMPipeline, 1 user")
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel(f"aggregate tok/s (median, min-max; {TOKENS} tokens each)")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(ScalarFormatter())
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _local_round(users: LocalUsers, c: int, rounds: list, record: dict) -> float:
    """One round of c in-process users; keeps its latencies and ANDs its isolation."""
    out = users.run(c)
    rounds.append(out)
    record["isolated"] = record["isolated"] and out.tokens == record["solo"]
    return out.tok_s


def main() -> int:
    set_offline_defaults()
    run_dir = Path("run/bench-mbatch")
    reference = optimum_export(paths.default_model_dir(), paths.shards_dir() / "optimum-int4-reference")
    stage_counts = {s.stages for s in SERIES.values()} | {2} | ({1} if COMPLETE else set())
    shards = {n: ensure_export(n) for n in sorted(stage_counts)}
    ids = Prompter.from_dir(shards[2]).encode("", [("user", PROMPT)])
    genai = GenAIPipeline(reference)
    loop = asyncio.new_event_loop()
    fleets: dict = {}
    records: dict[str, dict] = {}
    configs = {"A": lambda: genai.run(ids, TOKENS)["tok_s"]}
    for prefix, series in SERIES.items():
        for c in series.levels:
            name = f"{prefix}_x{c}"
            records[name] = {}
            configs[name] = lambda s=series, c=c, name=name: run_batch(
                loop, fleets[s.fleet].coordinator, c, s.k, records[name]
            )
    users = {
        n: LocalUsers(shards[2], paged=s.paged, precision=s.precision, threads=s.threads, tokens=TOKENS)
        for n, s in LOCAL.items()
    }
    rounds: dict[str, list] = {}
    for prefix, series in LOCAL.items():
        for c in series.levels:
            name = f"{prefix}_x{c}"
            rounds[name] = []
            records[name] = {"solo": users[prefix].solo_runs(c), "isolated": True}
            configs[name] = lambda u=users[prefix], c=c, name=name: _local_round(
                u, c, rounds[name], records[name]
            )
    try:
        # Every series' fleet, and its loopback twin for the solo references.
        wanted = {f for s in SERIES.values() for f in (s.fleet, s.loopback)}
        for key in sorted(wanted):
            if key in fleets:
                continue
            stages, threads, wan, kv, precision = key
            name = f"{stages}s-{threads or 'default'}t-{kv}-{precision}" + ("-wan" if wan else "")
            stage_args = ["--num-threads", str(threads)] if threads else []
            coordinator_args = list(COORDINATOR_ARGS)
            if kv == "paged":
                stage_args += ["--kv", "paged"]
                coordinator_args += ["--kv", "paged"]
            if wan:
                fleets[key] = WanFleet(
                    shards[stages],
                    stages,
                    WAN_DELAY_MS,
                    WAN_RATE_MBIT,
                    run_dir / name,
                    precision=precision,
                    extra_stage_args=stage_args,
                    extra_coordinator_args=coordinator_args,
                )
            else:
                fleets[key] = start_fleet(
                    shards[stages],
                    stages,
                    run_dir / name,
                    precision=precision,
                    extra_stage_args=stage_args,
                    extra_coordinator_args=coordinator_args,
                )
        # Solo references on loopback: the same shards, precision and threads give the same tokens at
        # any delay (the thread count may change the kernels' rounding, so it is part of the key).
        solos = {}
        for prefix, series in SERIES.items():
            key = (series.loopback, series.k)
            if key not in solos:
                loopback = fleets[series.loopback]
                solos[key] = loop.run_until_complete(_stream(loopback.coordinator, series.k))
            for c in series.levels:
                records[f"{prefix}_x{c}"]["solo"] = solos[key]["result"].token_ids
        samples = interleaved(configs, RUNS, warmup=1)
        emulation = next((f.emulation for f in fleets.values() if isinstance(f, WanFleet)), None)
    finally:
        for fleet in fleets.values():
            fleet.stop()
    result: dict = {
        "runs": RUNS,
        "tokens": TOKENS,
        "series": list(SERIES),
        "spec_source": DRAFT or SPEC_SOURCE,
        "spec_k": SPEC_K,
        "spec_k_wan": SPEC_K_WAN,
        "emulation": emulation,
        "tok_s": {k: median(v) for k, v in samples.items()},
        "tok_s_range": {k: summary(v) for k, v in samples.items()},
        "streams": {name: stream_stats(r["streams"]) for name, r in records.items() if "streams" in r},
        "local_latency": {name: latency(r) for name, r in rounds.items()},
        "local_series": {n: s.label for n, s in LOCAL.items()},
    }
    # The baseline: the thread count per stage that maximises single-stream speed.
    singles = [p for p in ("2s", "2s_1t") if f"{p}_x1" in samples and f"{p}_x2" in samples]
    if singles:
        single = max(singles, key=lambda p: median(samples[f"{p}_x1"]))
        two, two_ci = ratio_ci(samples[f"{single}_x2"], samples[f"{single}_x1"])
        result |= {
            "two_stream_over_single": two,
            "two_stream_over_single_ci": two_ci,
            "two_stream_over_single_config": f"{single}_x2 over {single}_x1 ({SERIES[single].label}: the "
            "faster thread setting with one stream)",
        }
    ratios = {
        "full_stack_over_mono": (
            [f"2s_x{c}" for c in (1, 2, 3, 4)]
            + [f"2s_spec_x{c}" for c in (1, 2, 4)]
            + [
                f"{p}_x{c}"
                for p, s in [*SERIES.items(), *LOCAL.items()]
                if "paged" in p or p in LOCAL
                for c in s.levels
            ],
            "A",
        ),
        "full_stack_over_plain_at_50ms": (["wan50_x1", "wan50_x4", "wan50_spec_x4"], "wan50_x1"),
        "best_at_50ms_any_concurrency": ([n for n in samples if n.startswith("wan50")], "wan50_x1"),
    }
    # The ratios on the paged 2-stage fleet in exact mode, else on the in-process paged ring.
    for key, users in (("four_users_over_one", 4), ("eight_users_over_one", 8)):
        for prefix in ("2s_paged_exact", "local_exact"):
            if f"{prefix}_x{users}" in samples and f"{prefix}_x1" in samples:
                ratios[key] = ([f"{prefix}_x{users}"], f"{prefix}_x1")
                break
        for prefix in ("2s_paged", "local_default"):
            if f"{prefix}_x{users}" in samples and f"{prefix}_x1" in samples:
                ratios[f"{key}_default"] = ([f"{prefix}_x{users}"], f"{prefix}_x1")
                break
    singles = [n for n in samples if n.endswith("_x1") and n != "A"]
    if singles:
        ratios["four_users_over_best_single"] = (
            [n for n in samples if n.endswith("_x4")],
            max(singles, key=lambda n: median(samples[n])),
        )
    for key, (names, over) in ratios.items():
        present = [n for n in names if n in samples]
        if present and over in samples:
            top = best(samples, present, over)
            result |= {
                key: top["ratio"],
                f"{key}_ci": top["ci"],
                f"{key}_config": f"{top['config']} over {over}",
            }
    isolation = {name: record["isolated"] for name, record in records.items()}
    result |= {"isolation": isolation, "isolation_ok": all(isolation.values())}
    if COMPLETE:
        result["stacking"] = stacking.measure(shards[1], ids, RUNS)
        plot_path = Path("docs/img/bench-mbatch.png")
        plot(samples, plot_path)
        result["plot"] = str(plot_path)
    elif LOCAL:
        plot_path = Path("docs/img/bench-mbatch-subset.png")
        plot(samples, plot_path)
        result["plot"] = str(plot_path)
    knobs = ("BENCH_SERIES", "BENCH_DRAFT", "BENCH_SPEC_K", "BENCH_SPEC_K_WAN", "BENCH_RUNS", "BENCH_TOKENS")
    command = " ".join(f"{k}={os.environ[k]}" for k in knobs if k in os.environ)
    write_result("mbatch" if COMPLETE else "mbatch-subset", result, f"{command} make bench-mbatch".strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
