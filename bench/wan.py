"""`make bench-wan` (interactive part): decoding across the WAN emulator, per link setting.

For each point (tbf rate in Mbit/s x one-way delay per hop in ms) a 2-stage INT4 fleet runs in
network namespaces (services/wan) once per stage codec: ``none``, ``lane_blocks_zstd`` and
``auto`` (the per-link choice, on the stage hop and on the results link). This process holds a
ring over the fleet's doors, as a coordinator does, and decodes, interleaved in every fleet:
greedy; temperature 0.8 with sampling on the final stage; temperature 0.8 with logits shipped to
the coordinator (where the results link's codec matters). Each decode step is also timed here
(ring step wall time, the stages' own compute time, bytes of the result) to break a token down.

Keys: ``auto_vs_best_min`` = min over points and modes of tok/s(auto) / max(tok/s(none),
tok/s(lane_blocks_zstd)); codec fleets cannot run side by side (one WAN emulator per machine), so
those medians come from consecutive fleets, not interleaved rounds.
``final_stage_sampling_speedup_20mbit`` = tok/s with sampling on the final stage / tok/s with
logits shipped raw, interleaved in the ``none`` fleet, at the worse of the 20 Mbit/s points run
(``..._auto``: the same in the ``auto`` fleet, where the results link may compress the logits).
Plots: docs/img/bench-wan.png (``python -m bench.wan --plot-only [--partial]`` re-derives the keys
and redraws it from the JSON).

Env: WAN_POINTS (default the full grid "500:0,500:25,100:0,100:25,20:0,20:25"), BENCH_RUNS (10),
WAN_TOKENS (32), BENCH_SHARDS (a 2-stage export; default the INT4 one). Needs root (namespaces, tbf).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.stats import RESULTS_DIR, interleaved, median, ratio_ci, write_result
from pipeshard.offline import set_offline_defaults
from pipeshard.services.coordinator.generation import Generation, Summary
from pipeshard.services.coordinator.ring import Ring
from pipeshard.services.coordinator.sampling import SamplingParams
from pipeshard.services.wan.emulator import CONTROL_PORT, WanFleet
from pipeshard.shard.prompting import Prompter

CODECS = ("none", "lane_blocks_zstd", "auto")
MODES = ("greedy", "sampled_on_stage", "sampled_logits")
PLOT = Path("docs/img/bench-wan.png")
PROMPT = "Explain how a refrigerator keeps food cold."
RUNS = int(os.environ.get("BENCH_RUNS", "10"))
TOKENS = int(os.environ.get("WAN_TOKENS", "32"))
POINTS = os.environ.get("WAN_POINTS", "500:0,500:25,100:0,100:25,20:0,20:25")


def points() -> list[tuple[float, float]]:
    return [(float(r), float(d)) for r, d in (p.split(":") for p in POINTS.split(","))]


class Driver:
    """A ring over a WAN fleet's doors, in this process's own event loop."""

    def __init__(self, wan: WanFleet, shards: Path):
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)  # grpc.aio binds channels to the current loop
        self.ring = Ring([f"{link.root_ip}:{CONTROL_PORT}" for link in wan.links], step_timeout_s=120)
        prompter = Prompter.from_dir(shards)
        self.ids = prompter.encode("", [("user", PROMPT)])
        self.loop.run_until_complete(self._start())
        self.gens = {
            on: Generation(self.ring, prompter.tokenizer, prompter.eos_ids, final_stage_sampling=on)
            for on in (True, False)
        }
        self.steps: dict[str, list[list[tuple[float, float, int]]]] = {}  # mode -> runs -> steps
        self._mode = ""
        step = self.ring.step

        async def timed_step(frame):
            """Per step: wall seconds here, the stages' compute seconds, result bytes on the wire."""
            t0 = time.perf_counter()
            result = await step(frame)
            wall = time.perf_counter() - t0
            self.steps[self._mode][-1].append(
                (wall, sum(result.stage_compute_micros) / 1e6, result.ByteSize())
            )
            return result

        self.ring.step = timed_step

    async def _start(self) -> None:
        await self.ring.start()
        await self.ring.wait_ready(120)

    def runner(self, mode: str, temperature: float, on_stage: bool = True) -> Callable[[], float]:
        params = SamplingParams(max_tokens=TOKENS, temperature=temperature, seed=1, ignore_eos=True)
        gen = self.gens[on_stage]

        async def go() -> Summary:
            events = [e async for e in gen.run(self.ids, params)]
            return events[-1]

        def run() -> float:
            self._mode = mode
            self.steps.setdefault(mode, []).append([])
            summary = self.loop.run_until_complete(go())
            if summary.completion_tokens != TOKENS:
                raise RuntimeError(f"generation ended early: {summary.finish_reason} {summary.error}")
            return summary.tok_s

        return run

    def close(self) -> None:
        for gen in self.gens.values():
            self.loop.run_until_complete(gen.released())
        self.loop.run_until_complete(self.ring.close())
        # The loop stays open: grpc.aio's poller may still call into it after the ring closed.


def measure_point(shards: Path, rate: float, delay: float, run_dir: Path) -> dict:
    out: dict[str, dict] = {}
    for codec in CODECS:
        t0 = time.perf_counter()
        with WanFleet(
            shards,
            2,
            delay,
            rate,
            run_dir / f"{rate:g}-{delay:g}-{codec}",
            extra_stage_args=["--codec", codec],
        ) as wan:
            print(
                f"fleet {rate:g} Mbit/s {delay:g} ms {codec} up in {time.perf_counter() - t0:.0f} s",
                file=sys.stderr,
            )
            driver = Driver(wan, shards)
            try:
                configs = {
                    "greedy": driver.runner("greedy", 0.0),
                    "sampled_on_stage": driver.runner("sampled_on_stage", 0.8, on_stage=True),
                    "sampled_logits": driver.runner("sampled_logits", 0.8, on_stage=False),
                }
                samples = interleaved(configs, RUNS, warmup=1)
            finally:
                driver.close()
            out[codec] = {
                name: {"tok_s": median(v), "samples": v, "step": _breakdown(driver.steps[name][1:])}
                for name, v in samples.items()
            }
            out[codec]["stage0_link"] = _link_lines(wan.run_dir / "stage0.log")
            out[codec]["results_link"] = _link_lines(wan.run_dir / "stage1.log")
    return out


def _breakdown(runs: list[list[tuple[float, float, int]]]) -> dict[str, float]:
    """Median decode step (the prefill step of each run left out): wall ms seen here, the stages'
    compute ms, the rest (wire, delays, forwarder, both ends' Python) and result bytes."""
    steps = [s for run in runs for s in run[1:]]
    if not steps:
        return {}
    wall, compute = median([s[0] for s in steps]) * 1e3, median([s[1] for s in steps]) * 1e3
    return {
        "wall_ms": wall,
        "compute_ms": compute,
        "rest_ms": wall - compute,
        "result_bytes": median([float(s[2]) for s in steps]),
    }


def _link_lines(log: Path) -> list[str]:
    """The stage 0 hop's measurement and codec choices, as logged."""
    if not log.exists():
        return []
    return [
        line for line in log.read_text().splitlines() if '"link_measured"' in line or '"link_codec"' in line
    ][-6:]


def summarise(results: dict[str, dict]) -> dict:
    """The result's keys from the points measured so far."""
    auto_vs_best = {}
    speedup_20: dict[str, tuple[float, list[float]]] = {}  # fleet codec -> worse 20 Mbit/s point
    for name, point in results.items():
        for mode in MODES:
            best = max(point[c][mode]["tok_s"] for c in ("none", "lane_blocks_zstd"))
            auto_vs_best[f"{name}/{mode}"] = point["auto"][mode]["tok_s"] / best
        point["auto_vs_best"] = {m: auto_vs_best[f"{name}/{m}"] for m in MODES}
        for codec in CODECS:
            ratio, ci = ratio_ci(
                point[codec]["sampled_on_stage"]["samples"], point[codec]["sampled_logits"]["samples"]
            )
            point[codec]["final_stage_sampling_speedup"] = ratio
            point[codec]["final_stage_sampling_speedup_ci"] = ci
            if name.startswith("20mbit") and (codec not in speedup_20 or ratio < speedup_20[codec][0]):
                speedup_20[codec] = (ratio, ci)
    worst = min(auto_vs_best, key=auto_vs_best.__getitem__) if auto_vs_best else None
    return {
        "runs": RUNS,
        "tokens": TOKENS,
        "points": results,
        "tok_s": {
            f"{n}/{c}/{m}": v[c][m]["tok_s"] for n, v in results.items() for c in CODECS for m in MODES
        },
        "auto_vs_best_min": auto_vs_best[worst] if worst else None,
        "auto_vs_best_min_at": worst,
        # Against logits shipped raw (the baseline: the --codec none fleet), and against
        # logits the results link's auto codec compresses (the --codec auto fleet).
        "final_stage_sampling_speedup_20mbit": speedup_20["none"][0] if speedup_20 else None,
        "final_stage_sampling_speedup_20mbit_ci": speedup_20["none"][1] if speedup_20 else None,
        "final_stage_sampling_speedup_20mbit_auto": speedup_20["auto"][0] if speedup_20 else None,
        "final_stage_sampling_speedup_20mbit_auto_ci": speedup_20["auto"][1] if speedup_20 else None,
        "baselines": {
            "auto_vs_best_min": "the faster of --codec none and --codec lane_blocks_zstd, same mode",
            "final_stage_sampling_speedup_20mbit": "logits shipped raw (no final-stage sampling), codec none",
            "final_stage_sampling_speedup_20mbit_auto": "logits shipped, --codec auto on the results link",
        },
        "emulation": "wan-emulator: netns + veth tbf + user-space delay forwarder; 2 stages, INT4",
    }


def plot(result: dict, out: Path = PLOT) -> Path:
    """tok/s per point, codec and mode; and the median decode step split into the stages' compute
    and the rest, with and without raw logits shipped (the codec-none fleet)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = list(result["points"])
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.8))
    width = 0.27
    for ax, mode in zip(axes[:3], MODES, strict=True):
        for i, codec in enumerate(CODECS):
            values = [result["points"][p][codec][mode]["tok_s"] for p in points]
            lows = [
                max(0.0, v - min(result["points"][p][codec][mode]["samples"]))
                for p, v in zip(points, values, strict=True)
            ]
            highs = [
                max(0.0, max(result["points"][p][codec][mode]["samples"]) - v)
                for p, v in zip(points, values, strict=True)
            ]
            xs = [x + (i - 1) * width for x in range(len(points))]
            ax.bar(xs, values, width, yerr=[lows, highs], capsize=2, label=f"--codec {codec}")
        ax.set_xticks(range(len(points)), [p.replace("mbit_", " Mbit/s\n") for p in points], fontsize=8)
        ax.set_title(
            {
                "greedy": "greedy",
                "sampled_on_stage": "T=0.8, final-stage sampling",
                "sampled_logits": "T=0.8, logits shipped",
            }[mode]
        )
        ax.set_ylabel("tok/s (median, min-max)")
        ax.legend(fontsize=7)
    ax = axes[3]
    labels, compute, rest = [], [], []
    for p in points:
        for mode, short in (("sampled_on_stage", "stage"), ("sampled_logits", "logits")):
            step = result["points"][p]["none"][mode]["step"]
            labels.append(f"{p.replace('mbit_', 'M ')}\n{short}")
            compute.append(step.get("compute_ms", 0.0))
            rest.append(step.get("rest_ms", 0.0))
    ax.bar(range(len(labels)), compute, label="stages' compute")
    ax.bar(range(len(labels)), rest, bottom=compute, label="rest: wire, delays, forwarder, Python")
    ax.set_xticks(range(len(labels)), labels, fontsize=6)
    ax.set_ylabel("median decode step (ms)")
    ax.set_title("a T=0.8 token, --codec none (raw logits)")
    ax.legend(fontsize=7)
    fig.suptitle(
        f"bench-wan ({result.get('date', '')[:10]}, 2-stage INT4, WAN emulator, {result['tokens']} tokens)"
    )
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out


def main() -> int:
    if "--plot-only" in sys.argv:  # re-derive the keys and redraw from the points a run wrote
        name = "wan.partial.json" if "--partial" in sys.argv else "wan.json"
        old = json.loads((RESULTS_DIR / name).read_text())
        result = {**old, **summarise(old["points"]), "runs": old["runs"], "tokens": old["tokens"]}
        (RESULTS_DIR / name).write_text(json.dumps(result, indent=2))
        print(plot(result))
        return 0
    set_offline_defaults()
    from bench.parity import ensure_export

    shards = Path(os.environ["BENCH_SHARDS"]) if os.environ.get("BENCH_SHARDS") else ensure_export(2)
    results: dict[str, dict] = {}
    run_dir = Path(tempfile.mkdtemp(prefix="bench-wan-"))
    started = time.perf_counter()
    for rate, delay in points():
        name = f"{rate:g}mbit_{delay:g}ms"
        results[name] = measure_point(shards, rate, delay, run_dir)
        summary = summarise(results)
        summary["elapsed_s"] = time.perf_counter() - started
        print(name, {c: {m: results[name][c][m]["tok_s"] for m in MODES} for c in CODECS}, file=sys.stderr)
        # Written after every point: a run cut short keeps what it measured.
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        (RESULTS_DIR / "wan.partial.json").write_text(json.dumps(summary, indent=2))
    path = write_result("wan", summary)
    plot(json.loads(path.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
