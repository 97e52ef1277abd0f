"""`make bench-wan` (interactive part): decoding across the WAN emulator, per link setting.

For each point (tbf rate in Mbit/s x one-way delay per hop in ms) a 2-stage INT4 fleet runs in
network namespaces (services/wan) once per stage codec: ``none``, ``lane_blocks_zstd`` and
``auto`` (the per-link choice). This process holds a ring over the fleet's doors, as a
coordinator does, and decodes greedily; on the ``auto`` fleet it also decodes at temperature 0.8
with sampling on the final stage and with logits shipped to the coordinator, interleaved.

Keys: ``auto_vs_best_min`` = min over points of tok/s(auto) / max(tok/s(none),
tok/s(lane_blocks_zstd)), greedy; codec fleets cannot run side by side (one WAN emulator per
machine), so those medians come from consecutive fleets, not interleaved rounds.
``final_stage_sampling_speedup_20mbit`` = tok/s with sampling on the final stage / tok/s with
logits shipped, interleaved in one fleet, at the worse of the 20 Mbit/s points run.

Env: WAN_POINTS (default the full grid "500:0,500:25,100:0,100:25,20:0,20:25"), BENCH_RUNS (10),
WAN_TOKENS (32), BENCH_SHARDS (a 2-stage export; default the INT4 one). Needs root (namespaces, tbf).
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.stats import interleaved, median, ratio_ci, write_result
from pipeshard.offline import set_offline_defaults
from pipeshard.services.coordinator.generation import Generation, Summary
from pipeshard.services.coordinator.ring import Ring
from pipeshard.services.coordinator.sampling import SamplingParams
from pipeshard.services.wan.emulator import CONTROL_PORT, WanFleet
from pipeshard.shard.prompting import Prompter

CODECS = ("none", "lane_blocks_zstd", "auto")
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

    async def _start(self) -> None:
        await self.ring.start()
        await self.ring.wait_ready(120)

    def runner(self, temperature: float, on_stage: bool = True) -> Callable[[], float]:
        params = SamplingParams(max_tokens=TOKENS, temperature=temperature, seed=1, ignore_eos=True)
        gen = self.gens[on_stage]

        async def go() -> Summary:
            events = [e async for e in gen.run(self.ids, params)]
            return events[-1]

        def run() -> float:
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
                configs = {"greedy": driver.runner(0.0)}
                if codec == "auto":
                    configs["sampled_on_stage"] = driver.runner(0.8, on_stage=True)
                    configs["sampled_logits"] = driver.runner(0.8, on_stage=False)
                samples = interleaved(configs, RUNS, warmup=1)
            finally:
                driver.close()
            out[codec] = {name: {"tok_s": median(v), "samples": v} for name, v in samples.items()}
            out[codec]["stage0_link"] = _link_lines(wan.run_dir / "stage0.log")
    return out


def _link_lines(log: Path) -> list[str]:
    """The stage 0 hop's measurement and codec choices, as logged."""
    if not log.exists():
        return []
    return [
        line for line in log.read_text().splitlines() if '"link_measured"' in line or '"link_codec"' in line
    ][-4:]


def main() -> int:
    set_offline_defaults()
    from bench.parity import ensure_export

    shards = Path(os.environ["BENCH_SHARDS"]) if os.environ.get("BENCH_SHARDS") else ensure_export(2)
    results: dict[str, dict] = {}
    auto_vs_best = []
    speedup_20 = None
    run_dir = Path(tempfile.mkdtemp(prefix="bench-wan-"))
    for rate, delay in points():
        name = f"{rate:g}mbit_{delay:g}ms"
        point = measure_point(shards, rate, delay, run_dir)
        best = max(point[c]["greedy"]["tok_s"] for c in ("none", "lane_blocks_zstd"))
        point["auto_vs_best"] = point["auto"]["greedy"]["tok_s"] / best
        auto_vs_best.append(point["auto_vs_best"])
        ratio, ci = ratio_ci(
            point["auto"]["sampled_on_stage"]["samples"], point["auto"]["sampled_logits"]["samples"]
        )
        point["final_stage_sampling_speedup"], point["final_stage_sampling_speedup_ci"] = ratio, ci
        if rate == 20 and (speedup_20 is None or ratio < speedup_20[0]):  # the worse 20 Mbit/s point
            speedup_20 = (ratio, ci)
        results[name] = point
        print(
            name, {c: point[c]["greedy"]["tok_s"] for c in CODECS}, f"sampling x{ratio:.2f}", file=sys.stderr
        )
    write_result(
        "wan",
        {
            "runs": RUNS,
            "tokens": TOKENS,
            "points": results,
            "tok_s": {
                f"{n}/{c}/{k}": v[c][k]["tok_s"]
                for n, v in results.items()
                for c in CODECS
                for k in v[c]
                if k != "stage0_link"
            },
            "auto_vs_best_min": min(auto_vs_best) if auto_vs_best else None,
            "final_stage_sampling_speedup_20mbit": speedup_20[0] if speedup_20 else None,
            "final_stage_sampling_speedup_20mbit_ci": speedup_20[1] if speedup_20 else None,
            "baselines": {
                "auto_vs_best_min": "the faster of --codec none and --codec lane_blocks_zstd (greedy)",
                "final_stage_sampling_speedup_20mbit": "--no-final-stage-sampling (logits shipped)",
            },
            "emulation": "wan-emulator: netns + veth tbf + user-space delay forwarder; 2 stages, INT4",
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
