"""`make bench-compile-cache`: a stage's start to SERVING with the compiled-model cache over without.

Each round starts the final stage of a 2-stage INT4 export as a process (``pipeshard stage``,
through the launcher, which returns at the stage's ``listening on`` line: the stage listens only
once it has verified its shard, compiled and warmed up) and stops it again, in shuffled order:
  cold        ``--kv stateful --compile-cache-dir off``: compiles every start
  cached      ``--kv stateful --compile-cache-dir DIR``: DIR filled by a warm-up start, so the
              stage imports its compiled blob
  paged_cold  the default paged backend, which does not cache (pipeshard/shard/paged.py says why)
Key ``cached_start_over_cold`` (goal <= 0.5): the median cached start over the median cold one,
paired by round, with its bootstrap interval; ``cached_compile_over_cold`` the same for the
stage's own compile time (the ``compiled`` log line), the part the cache can shorten.

Knobs (environment): BENCH_RUNS (rounds, default 10), BENCH_WARMUP (default 1), BENCH_SHARDS (a
2-stage export; default the INT4 export under the shards dir, exported when missing),
BENCH_THREADS (the stage's --num-threads, default 0: the plugin's choice).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

from bench.stats import command_with_knobs, interleaved, ratio_ci, summary, write_result
from pipeshard import paths
from pipeshard.offline import set_offline_defaults
from pipeshard.services.launcher import Fleet, fleet_env, spawn

RUNS = int(os.environ.get("BENCH_RUNS", "10"))
WARMUP = int(os.environ.get("BENCH_WARMUP", "1"))
THREADS = os.environ.get("BENCH_THREADS", "0")
KNOBS = ("BENCH_RUNS", "BENCH_WARMUP", "BENCH_SHARDS", "BENCH_THREADS")


def export_dir() -> Path:
    if os.environ.get("BENCH_SHARDS"):
        return Path(os.environ["BENCH_SHARDS"])
    from pipeshard.exporter.export import export_model

    out = paths.shards_dir() / paths.export_name(paths.DEFAULT_MODEL, 2, "int4")
    if not (out / "manifest.json").exists():
        export_model(paths.default_model_dir(), out, stages=2, weights="int4")
    return out


def compile_seconds(log: Path) -> float:
    """The stage's own compile time, from its ``compiled`` log line."""
    for line in log.read_text().splitlines():
        if line.startswith("{") and '"compiled"' in line:
            return float(json.loads(line)["seconds"])
    raise RuntimeError(f"no `compiled` line in {log}")


def start_stage(shards: Path, run_dir: Path, extra: list[str], compiles: list[float]) -> float:
    """Seconds from spawning stage 1 to its listening line; the process is stopped after."""
    args = ["stage", "--stage", "1", "--shards", str(shards), "--port", "0", "--log-format", "json"]
    args += ["--num-threads", THREADS, "--prefix-cache-bytes", "0", *extra]
    started = time.perf_counter()
    proc = spawn("stage1", args, run_dir, fleet_env(), timeout_s=300)
    seconds = time.perf_counter() - started
    Fleet(run_dir, [proc]).stop()
    compiles.append(compile_seconds(proc.log))
    return seconds


def main() -> None:
    set_offline_defaults()
    shards = export_dir()
    with tempfile.TemporaryDirectory(prefix="bench-compile-cache-") as tmp:
        run_dir, cache = Path(tmp) / "run", Path(tmp) / "cache"
        run_dir.mkdir()
        compiles: dict[str, list[float]] = {"cold": [], "cached": [], "paged_cold": []}
        extra = {
            "cold": ["--kv", "stateful", "--compile-cache-dir", "off"],
            "cached": ["--kv", "stateful", "--compile-cache-dir", str(cache)],
            "paged_cold": ["--kv", "paged"],
        }
        start_stage(shards, run_dir, extra["cached"], [])  # fills the cache
        blobs = sorted(p.name for p in cache.rglob("*.blob"))
        samples = interleaved(
            {name: (lambda n=name: start_stage(shards, run_dir, extra[n], compiles[n])) for name in extra},
            RUNS,
            WARMUP,
        )
    for name in compiles:
        compiles[name] = compiles[name][-RUNS:]  # the timed rounds' compiles (interleaved keeps the last)
    ratio, ci = ratio_ci(samples["cached"], samples["cold"])
    compile_ratio, compile_ci = ratio_ci(compiles["cached"], compiles["cold"])
    write_result(
        "compile_cache",
        {
            "runs": RUNS,
            "shards": str(shards),
            "blobs": blobs,
            "start_s": {name: summary(values) for name, values in samples.items()},
            "compile_s": {name: summary(values) for name, values in compiles.items()},
            "cached_start_over_cold": round(ratio, 3),
            "cached_start_over_cold_ci": [round(x, 3) for x in ci],
            "cached_compile_over_cold": round(compile_ratio, 3),
            "cached_compile_over_cold_ci": [round(x, 3) for x in compile_ci],
            "samples": samples,
        },
        command_with_knobs("bench-compile-cache", KNOBS),
    )


if __name__ == "__main__":
    main()
