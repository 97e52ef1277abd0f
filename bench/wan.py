"""`make bench-wan` (interactive part): decoding across the WAN emulator, per link setting.
``BENCH_PART=batch`` runs the offline batch part instead (bench/wan_batch.py).

For each point (tbf rate in Mbit/s x one-way delay per hop in ms) ONE 2-stage INT4 fleet runs in
network namespaces (services/wan), and this process holds a ring over its doors, as a coordinator
does. The codec is chosen per session (OpenSession's ``codec``: ``none``, ``lane_blocks_zstd`` or
``auto``, the per-link choice, on the stage hop and on the results link), so the three codecs are
interleaved request by request in shuffled rounds and the machine's drift hits each alike. Greedy
at every point; at the 20 Mbit/s points also temperature 0.8 with sampling on the final stage and
with logits shipped to this process (codecs ``none`` and ``auto``: raw logits are the issue's
baseline, auto may compress them). Each decode step is also timed here (ring step wall time, the
stages' own compute time, bytes of the result) to break a token down.

Keys: ``auto_vs_best_min`` = min over points (and the modes measured with every codec) of the ratio
of medians tok/s(auto) / tok/s(the faster of none and lane_blocks_zstd), with its 95% interval.
``final_stage_sampling_speedup_20mbit`` = tok/s with sampling on the final stage / tok/s with
logits shipped raw (session codec none), at the worse of the 20 Mbit/s points run
(``..._auto``: both with session codec auto, where the results link may compress the logits).
Plots: docs/img/bench-wan.png (``python -m bench.wan --plot-only [--partial]`` re-derives the keys
and redraws it from the JSON).

Env: WAN_POINTS (default the grid "500:0,500:25,100:0,100:25,20:0,20:25"), BENCH_RUNS (10),
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
from dataclasses import replace
from pathlib import Path

from bench.stats import RESULTS_DIR, interleaved, median, ratio_ci, write_result
from pipeshard.identity import Identity
from pipeshard.offline import set_offline_defaults
from pipeshard.services.coordinator.fleet_kv import AUTO, FleetKv
from pipeshard.services.coordinator.generation import Generation, Summary
from pipeshard.services.coordinator.remote_stages import RemoteStages
from pipeshard.services.coordinator.ring import Ring
from pipeshard.services.coordinator.sampling import SamplingParams
from pipeshard.services.coordinator.scheduler import Scheduler
from pipeshard.services.wan.emulator import CONTROL_PORT, WanFleet
from pipeshard.shard.prompting import Prompter

CODECS = ("none", "lane_blocks_zstd", "auto")
MODES = ("greedy", "sampled_on_stage", "sampled_logits")
SAMPLED_CODECS = ("none", "auto")  # sampled modes at 20 Mbit/s: raw logits and auto's choice
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
        stages = RemoteStages([f"{link.root_ip}:{CONTROL_PORT}" for link in wan.links], step_timeout_s=120)
        self.ring = self.loop.run_until_complete(self._start(stages))
        prompter = Prompter.from_dir(shards)
        self.ids = prompter.encode("", [("user", PROMPT)])
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

    @staticmethod
    async def _start(stages: RemoteStages) -> Ring[RemoteStages]:
        """The ring over the stages, each row sent alone (not batched, whatever the stages'
        backend), so every step goes through ``ring.step`` and is timed."""
        await stages.start()
        await stages.wait_ready(120)
        kv = FleetKv.agreed(AUTO, await stages.stage_infos())
        return Ring(stages, replace(kv, batches_steps=False, truncates_on_rewind=False))

    def runner(self, codec: str, mode: str) -> Callable[[], float]:
        """One generation in ``mode`` whose session asks every stage for ``codec``."""
        temperature = 0.0 if mode == "greedy" else 0.8
        params = SamplingParams(max_tokens=TOKENS, temperature=temperature, seed=1, ignore_eos=True)
        gen = self.gens[mode != "sampled_logits"]

        async def go() -> Summary:
            # The codec rides on the request's admission (what its sessions ask every stage for).
            async with Scheduler(1, 0).admit(Identity(""), 0, codec=codec) as admission:
                plain = gen.check_speculative("", 0)
                events = [e async for e in gen.generate(self.ids, params, plain, admission=admission)]
            return events[-1]

        def run() -> float:
            self._mode = f"{codec}/{mode}"
            self.steps.setdefault(self._mode, []).append([])
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


def point_configs(rate: float) -> list[tuple[str, str]]:
    """(codec, mode) pairs measured at a point: greedy with every codec; at 20 Mbit/s also the
    sampled modes with raw logits and with auto."""
    configs = [(codec, "greedy") for codec in CODECS]
    if rate <= 20:
        configs += [(codec, mode) for codec in SAMPLED_CODECS for mode in MODES[1:]]
    return configs


def measure_point(shards: Path, rate: float, delay: float, run_dir: Path) -> dict:
    t0 = time.perf_counter()
    with WanFleet(
        shards, 2, delay, rate, run_dir / f"{rate:g}-{delay:g}", extra_stage_args=["--codec", "auto"]
    ) as wan:
        print(f"fleet {rate:g} Mbit/s {delay:g} ms up in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        driver = Driver(wan, shards)
        try:
            configs = {f"{c}/{m}": driver.runner(c, m) for c, m in point_configs(rate)}
            samples = interleaved(configs, RUNS, warmup=1)
        finally:
            driver.close()
        out: dict[str, dict] = {}
        for key, values in samples.items():
            codec, mode = key.split("/")
            out.setdefault(codec, {})[mode] = {
                "tok_s": median(values),
                "samples": values,
                "step": _breakdown(driver.steps[key][1:]),
            }
        out["stage0_link"] = _link_lines(wan.run_dir / "stage0.log")
        out["results_link"] = _link_lines(wan.run_dir / "stage1.log")
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
    ][-12:]


def summarise(results: dict[str, dict]) -> dict:
    """The result's keys from the points measured so far (codecs interleaved in each fleet)."""
    auto_vs_best: dict[str, tuple[float, list[float]]] = {}
    speedup_20: dict[str, tuple[float, list[float]]] = {}  # session codec -> worse 20 Mbit/s point
    for name, point in results.items():
        point["auto_vs_best"], point["auto_vs_best_ci"] = {}, {}
        for mode in MODES:
            if not all(mode in point.get(c, {}) for c in CODECS):
                continue
            best = max(("none", "lane_blocks_zstd"), key=lambda c: point[c][mode]["tok_s"])
            ratio, ci = ratio_ci(point["auto"][mode]["samples"], point[best][mode]["samples"])
            auto_vs_best[f"{name}/{mode}"] = (ratio, ci)
            point["auto_vs_best"][mode], point["auto_vs_best_ci"][mode] = ratio, ci
        for codec in SAMPLED_CODECS:
            modes = point.get(codec, {})
            if "sampled_on_stage" not in modes or "sampled_logits" not in modes:
                continue
            ratio, ci = ratio_ci(modes["sampled_on_stage"]["samples"], modes["sampled_logits"]["samples"])
            modes["final_stage_sampling_speedup"] = ratio
            modes["final_stage_sampling_speedup_ci"] = ci
            if name.startswith("20mbit") and (codec not in speedup_20 or ratio < speedup_20[codec][0]):
                speedup_20[codec] = (ratio, ci)
    worst = min(auto_vs_best, key=lambda k: auto_vs_best[k][0]) if auto_vs_best else None
    same_compute = {}
    for name, point in results.items():
        point["auto_vs_best_same_compute"] = _same_compute(point)
        same_compute |= {f"{name}/{m}": r for m, r in point["auto_vs_best_same_compute"].items()}
    none_20, auto_20 = speedup_20.get("none"), speedup_20.get("auto")
    return {
        "runs": RUNS,
        "tokens": TOKENS,
        "points": results,
        "tok_s": {
            f"{n}/{c}/{m}": v[c][m]["tok_s"]
            for n, v in results.items()
            for c in CODECS
            for m in MODES
            if m in v.get(c, {})
        },
        "auto_vs_best_min": auto_vs_best[worst][0] if worst else None,
        "auto_vs_best_min_ci": auto_vs_best[worst][1] if worst else None,
        "auto_vs_best_min_at": worst,
        # The codec's own effect: decode step time with the stages' compute set equal across the
        # codecs (their common median), so only the rest (wire, encode/decode, delays) differs.
        "auto_vs_best_same_compute_min": min(same_compute.values()) if same_compute else None,
        # Against logits shipped raw (the baseline: session codec none), and against
        # logits the results link's auto codec compresses (session codec auto).
        "final_stage_sampling_speedup_20mbit": none_20[0] if none_20 else None,
        "final_stage_sampling_speedup_20mbit_ci": none_20[1] if none_20 else None,
        "final_stage_sampling_speedup_20mbit_auto": auto_20[0] if auto_20 else None,
        "final_stage_sampling_speedup_20mbit_auto_ci": auto_20[1] if auto_20 else None,
        "baselines": {
            "auto_vs_best_min": "the faster of session codec none and lane_blocks_zstd, same fleet and mode",
            "final_stage_sampling_speedup_20mbit": "logits shipped raw (no final-stage sampling), codec none",
            "final_stage_sampling_speedup_20mbit_auto": "logits shipped, session codec auto",
        },
        "emulation": "wan-emulator: netns + veth tbf + user-space delay forwarder; 2 stages, INT4; "
        "codecs interleaved per request in one fleet per point",
    }


def _same_compute(point: dict) -> dict[str, float]:
    """Per mode measured with every codec: best fixed codec's step time / auto's, each step being
    the codecs' common compute (median of their median compute) plus the codec's own rest."""
    out = {}
    for mode in MODES:
        if not all(mode in point.get(c, {}) and point[c][mode]["step"] for c in CODECS):
            continue
        steps = {c: point[c][mode]["step"] for c in CODECS}
        compute = median([s["compute_ms"] for s in steps.values()])
        best = min(compute + steps[c]["rest_ms"] for c in ("none", "lane_blocks_zstd"))
        out[mode] = best / (compute + steps["auto"]["rest_ms"])
    return out


def plot(result: dict, out: Path = PLOT) -> Path:
    """Greedy tok/s per point and session codec; auto / best with its interval; final-stage sampling
    against shipped logits at 20 Mbit/s; and the raw-logits decode step split into compute and rest."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = result["points"]
    names = list(pts)
    labels = [p.replace("mbit_", " Mbit/s\n") for p in names]
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.8))
    ax, width = axes[0], 0.27
    for i, codec in enumerate(CODECS):
        values = [pts[p][codec]["greedy"]["tok_s"] for p in names]
        samples = [pts[p][codec]["greedy"]["samples"] for p in names]
        err = [
            [max(0.0, v - min(s)) for v, s in zip(values, samples, strict=True)],
            [max(0.0, max(s) - v) for v, s in zip(values, samples, strict=True)],
        ]
        xs = [x + (i - 1) * width for x in range(len(names))]
        ax.bar(xs, values, width, yerr=err, capsize=2, label=f"session codec {codec}")
    ax.set_xticks(range(len(names)), labels, fontsize=8)
    ax.set_ylabel("tok/s (median, min-max)")
    ax.set_title("greedy, codecs interleaved in one fleet")
    ax.legend(fontsize=7)
    ax = axes[1]
    ratios = [pts[p]["auto_vs_best"].get("greedy", float("nan")) for p in names]
    cis = [pts[p]["auto_vs_best_ci"].get("greedy", [float("nan")] * 2) for p in names]
    ax.errorbar(
        range(len(names)),
        ratios,
        yerr=[
            [r - c[0] for r, c in zip(ratios, cis, strict=True)],
            [c[1] - r for r, c in zip(ratios, cis, strict=True)],
        ],
        fmt="o",
        capsize=3,
    )
    ax.axhline(0.95, color="red", linestyle="--", label="goal 0.95")
    ax.axhline(1.0, color="grey", linewidth=0.5)
    ax.set_xticks(range(len(names)), labels, fontsize=8)
    ax.set_ylabel("auto / best fixed (ratio of medians, 95% CI)")
    ax.set_title("greedy: auto against the faster fixed codec")
    ax.legend(fontsize=7)
    sampled = [p for p in names if "sampled_logits" in pts[p].get("none", {})]
    ax = axes[2]
    for i, (codec, mode) in enumerate(
        [
            ("none", "sampled_on_stage"),
            ("none", "sampled_logits"),
            ("auto", "sampled_on_stage"),
            ("auto", "sampled_logits"),
        ]
    ):
        values = [pts[p][codec][mode]["tok_s"] for p in sampled]
        ax.bar([x + (i - 1.5) * 0.2 for x in range(len(sampled))], values, 0.2, label=f"{codec}: {mode}")
    ax.set_xticks(range(len(sampled)), [p.replace("mbit_", " Mbit/s\n") for p in sampled], fontsize=8)
    ax.set_ylabel("tok/s (median)")
    ax.set_title("T=0.8: final-stage sampling vs logits shipped")
    ax.legend(fontsize=7)
    ax = axes[3]
    bars, compute, rest = [], [], []
    for p in sampled:
        for mode, short in (("sampled_on_stage", "stage"), ("sampled_logits", "logits")):
            step = pts[p]["none"][mode]["step"]
            bars.append(f"{p.replace('mbit_', 'M ')}\n{short}")
            compute.append(step.get("compute_ms", 0.0))
            rest.append(step.get("rest_ms", 0.0))
    ax.bar(range(len(bars)), compute, label="stages' compute")
    ax.bar(range(len(bars)), rest, bottom=compute, label="rest: wire, delays, forwarder, Python")
    ax.set_xticks(range(len(bars)), bars, fontsize=7)
    ax.set_ylabel("median decode step (ms)")
    ax.set_title("a T=0.8 token, session codec none (raw logits)")
    ax.legend(fontsize=7)
    fig.suptitle(
        f"bench-wan ({result.get('date', '')[:10]}, 2-stage INT4, WAN emulator, {result['tokens']} tokens)"
    )
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out


def main() -> int:
    if os.environ.get("BENCH_PART") == "batch":  # the offline batch part (bench/wan_batch.py)
        from bench.wan_batch import main as batch_main

        set_offline_defaults()
        return batch_main()
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
        print(name, {k: v for k, v in summary["tok_s"].items() if k.startswith(name)}, file=sys.stderr)
        # Written after every point: a run cut short keeps what it measured.
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        (RESULTS_DIR / "wan.partial.json").write_text(json.dumps(summary, indent=2))
    path = write_result("wan", summary)
    plot(json.loads(path.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
