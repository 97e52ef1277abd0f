"""`BENCH_PART=batch make bench-wan`: offline batch jobs across the WAN emulator.

A job of BATCH_REQUESTS greedy chat requests (BATCH_TOKENS tokens each, ignore_eos) goes through
the coordinator's RunBatch on a 3-stage INT4 fleet in network namespaces (services/wan), at each
rate in WAN_BATCH_RATES Mbit/s with WAN_BATCH_DELAY_MS per hop, one fleet per rate. Compression
is the job's own codec (RunBatchRequest.codec: ``none`` / ``lane_blocks_zstd``), so inside a
fleet every (compression, micro-batch setting) pair (``off``, fixed M = 2 and 3, ``auto``) is
interleaved job by job in shuffled rounds (BENCH_RUNS, after one warm-up round): the machine's
drift weighs on every pair alike. Every stage holds the whole job's sessions
(``--max-sessions-per-owner``). WAN_BATCH_STEP_TIMEOUT_S raises the coordinator's step deadline
(a heavily loaded machine). Runtime on 2 quiet-ish cores (load 5-7): about 18 s a 64 x 32 job,
so about 30 minutes for the default 2 rates x 8 pairs x 6 rounds.

Keys: ``compress_microbatch_speedup_20mbit`` = tok/s(compression on, the best fixed M) /
tok/s(compression off, micro-batches off) at the lowest rate, with the interval of the ratio of
medians; ``auto_microbatch_vs_best`` = min over (rate, compression) of tok/s(auto) / tok/s(the
best fixed setting, off included). Both compare jobs interleaved in one fleet. ``mismatches``:
answers differing from the fleet's first job's (every setting and codec must give the same
text at ``exact``). Per fleet also the auto probes (decode rows/s per M) and the control calls
over 1 s (``slowest_control_call_s``). Plot:
docs/img/bench-wan-batch.png (``python -m bench.wan_batch --plot-only`` redraws it from
bench/results/wan_batch.json). Needs root.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import grpc

from bench.stats import RESULTS_DIR, interleaved, median, ratio_ci, write_result
from pipeshard.services.wan.emulator import WanFleet
from pipeshard.v1 import coordinator_pb2, coordinator_pb2_grpc

STAGES = 3
REQUESTS = int(os.environ.get("BATCH_REQUESTS", "64"))
TOKENS = int(os.environ.get("BATCH_TOKENS", "32"))
RUNS = int(os.environ.get("BENCH_RUNS", "5"))
RATES = [float(r) for r in os.environ.get("WAN_BATCH_RATES", "20,100").split(",")]
DELAY_MS = float(os.environ.get("WAN_BATCH_DELAY_MS", "25"))
STEP_TIMEOUT_S = os.environ.get("WAN_BATCH_STEP_TIMEOUT_S", "")
CODECS = {"off": "none", "on": "lane_blocks_zstd"}
MICRO = ("off", "2", "3", "auto")
FIXED = ("off", "2", "3")
PLOT = Path("docs/img/bench-wan-batch.png")
TOPICS = ("the sea", "a city at night", "autumn", "a robot", "mountains", "a library", "rain", "coffee")


def job() -> coordinator_pb2.RunBatchRequest:
    items = []
    for i in range(REQUESTS):
        prompt = f"Write two sentences about {TOPICS[i % len(TOPICS)]} (note {i})."
        request = coordinator_pb2.GenerateRequest(
            messages=[coordinator_pb2.ChatMessage(role="user", content=prompt)],
            params=coordinator_pb2.SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True),
        )
        items.append(coordinator_pb2.BatchJobItem(custom_id=f"r{i}", request=request))
    return coordinator_pb2.RunBatchRequest(items=items)


def measure_rate(shards: Path, rate: float, run_dir: Path) -> dict[str, dict]:
    """One fleet: every (compression, micro-batch setting) pair interleaved; job tok/s per pair,
    keyed ``"<rate>mbit/<compression>"`` then by setting."""
    t0 = time.perf_counter()
    args = ["--max-running", str(REQUESTS), "--max-running-per-identity", str(REQUESTS)]
    if STEP_TIMEOUT_S:  # a loaded machine: a step can take longer than the default deadline
        args += ["--step-timeout-s", STEP_TIMEOUT_S]
    # Every stage holds the whole job's sessions (its default lets one coordinator hold 32).
    stage_args = ["--max-sessions-per-owner", str(REQUESTS), "--max-sessions", str(max(64, REQUESTS))]
    with WanFleet(
        shards,
        STAGES,
        DELAY_MS,
        rate,
        run_dir / f"{rate:g}",
        extra_stage_args=stage_args,
        extra_coordinator_args=args,
    ) as wan:
        print(f"fleet {rate:g} Mbit/s up in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        chosen: dict[str, list[int]] = {}
        first: dict[str, str] = {}  # custom_id -> the first job's answer: every job must repeat it
        mismatches: dict[str, int] = {}
        with grpc.insecure_channel(wan.coordinator) as channel:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
            base = job()

            def runner(compression: str, micro: str):
                key = f"{compression}/{micro}"
                chosen[key] = []
                mismatches[key] = 0

                def run() -> float:
                    request = coordinator_pb2.RunBatchRequest(
                        items=base.items, micro_batches=micro, codec=CODECS[compression]
                    )
                    start = time.perf_counter()
                    results = list(stub.RunBatch(request, timeout=1800))
                    elapsed = time.perf_counter() - start
                    failed = [r.error.message for r in results if r.HasField("error")]
                    if failed:
                        raise RuntimeError(f"{len(failed)} items failed: {failed[0]}")
                    chosen[key].append(results[-1].micro_batches)
                    for r in results:
                        mismatches[key] += first.setdefault(r.custom_id, r.summary.text) != r.summary.text
                    return sum(r.summary.completion_tokens for r in results) / elapsed

                return run

            configs = {f"{c}/{m}": runner(c, m) for c in CODECS for m in MICRO}
            samples = interleaved(configs, RUNS, warmup=1)
        probes = _log_events(wan.run_dir / "coordinator.log", "micro_batches_chosen")
        slow = _log_events(wan.run_dir / "coordinator.log", "stage_control_slow")
    out: dict[str, dict] = {}
    for key, values in samples.items():
        compression, micro = key.split("/")
        out.setdefault(f"{rate:g}mbit/{compression}", {})[micro] = {
            "tok_s": median(values),
            "samples": values,
            "micro_batches_at_end": chosen[key][1:],
            "mismatches": mismatches[key],  # answers differing from the fleet's first job's, all rounds
        }
    for compression, codec in CODECS.items():
        fleet = out[f"{rate:g}mbit/{compression}"]
        fleet["auto_probes"] = [p for p in probes if p.get("codec") == codec]
        # The fleet's control calls over 1 s (both compressions: jobs interleave): what a control
        # deadline must cover on this machine.
        fleet["slow_control_calls"] = len(slow)
        fleet["slowest_control_call_s"] = max((e["seconds"] for e in slow), default=None)
    return out


def _log_events(log: Path, event: str) -> list[dict]:
    """The coordinator's log lines of ``event``: auto probes (the M each kept and the decode rows/s
    it measured) and control calls over 1 s."""
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if f'"{event}"' in line]


def summarise(results: dict[str, dict]) -> dict:
    auto_vs_best = {}
    for name, fleet in results.items():
        best = max(FIXED, key=lambda m: fleet[m]["tok_s"])
        ratio, ci = ratio_ci(fleet["auto"]["samples"], fleet[best]["samples"])
        fleet["auto_vs_best"], fleet["auto_vs_best_ci"], fleet["best_fixed"] = ratio, ci, best
        auto_vs_best[name] = (ratio, ci)
    worst = min(auto_vs_best, key=lambda k: auto_vs_best[k][0]) if auto_vs_best else None
    low = f"{min(RATES):g}mbit"
    speedup = None
    if f"{low}/on" in results and f"{low}/off" in results:
        on, off = results[f"{low}/on"], results[f"{low}/off"]
        best = max(("2", "3"), key=lambda m: on[m]["tok_s"])
        speedup = (*ratio_ci(on[best]["samples"], off["off"]["samples"]), best)
    return {
        "requests": REQUESTS,
        "tokens": TOKENS,
        "runs": RUNS,
        "delay_ms": DELAY_MS,
        "stages": STAGES,
        "fleets": results,
        "compress_microbatch_speedup_20mbit": speedup[0] if speedup else None,
        "compress_microbatch_speedup_20mbit_ci": speedup[1] if speedup else None,
        "compress_microbatch_speedup_20mbit_m": speedup[2] if speedup else None,
        "auto_microbatch_vs_best": auto_vs_best[worst][0] if worst else None,
        "auto_microbatch_vs_best_ci": auto_vs_best[worst][1] if worst else None,
        "auto_microbatch_vs_best_at": worst,
        "mismatches": sum(f[m]["mismatches"] for f in results.values() for m in MICRO),
        "baselines": {
            "compress_microbatch_speedup_20mbit": "compression off and micro-batches off, interleaved in "
            "the same fleet (job by job)",
            "auto_microbatch_vs_best": "the fastest of off, M=2 and M=3 in the same fleet, interleaved",
        },
        "emulation": f"wan-emulator: netns + veth tbf + delay forwarder; {STAGES} stages INT4, "
        f"{DELAY_MS:g} ms per hop; stages not pinned (2-core machine shared with other work)",
    }


def plot(result: dict, out: Path = PLOT) -> Path:
    """Job tok/s per fleet and micro-batch setting (median, min-max)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fleets = result["fleets"]
    names = list(fleets)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(MICRO)
    for i, micro in enumerate(MICRO):
        values = [fleets[n][micro]["tok_s"] for n in names]
        samples = [fleets[n][micro]["samples"] for n in names]
        err = [
            [max(0.0, v - min(x)) for v, x in zip(values, samples, strict=True)],
            [max(0.0, max(x) - v) for v, x in zip(values, samples, strict=True)],
        ]
        xs = [x + (i - (len(MICRO) - 1) / 2) * width for x in range(len(names))]
        ax.bar(xs, values, width, yerr=err, capsize=2, label=f"micro-batches {micro}")
    labels = [n.replace("mbit/", " Mbit/s\ncompression ") for n in names]
    ax.set_xticks(range(len(names)), labels, fontsize=8)
    ax.set_ylabel("job tok/s (median, min-max)")
    ax.legend(fontsize=7)
    ax.set_title(
        f"offline batch job, {result['requests']} requests x {result['tokens']} tokens, "
        f"{result['stages']} stages, {result['delay_ms']:g} ms/hop ({result.get('date', '')[:10]})"
    )
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out


def main() -> int:
    if "--plot-only" in sys.argv:
        print(plot(json.loads((RESULTS_DIR / "wan_batch.json").read_text())))
        return 0
    from bench.parity import ensure_export

    shards = Path(os.environ["BENCH_SHARDS"]) if os.environ.get("BENCH_SHARDS") else ensure_export(STAGES)
    run_dir = Path(tempfile.mkdtemp(prefix="bench-wan-batch-"))
    results: dict[str, dict] = {}
    started = time.perf_counter()
    for rate in RATES:
        results |= measure_rate(shards, rate, run_dir)
        summary = summarise(results)
        summary["elapsed_s"] = time.perf_counter() - started
        for compression in CODECS:
            name = f"{rate:g}mbit/{compression}"
            print(name, {m: round(results[name][m]["tok_s"], 2) for m in MICRO}, file=sys.stderr)
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        (RESULTS_DIR / "wan_batch.partial.json").write_text(json.dumps(summary, indent=2))
    path = write_result("wan_batch", summary, command="BENCH_PART=batch make bench-wan")
    plot(json.loads(path.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
