"""`make bench-families`: the mixture-of-experts stage's decode step, sparse form over dense;
Gemma 3's KV per sequence at a 4k context with its local layers bounded by their window.

Qwen3-30B-A3B's published shape (``pipeshard model synth --like qwen3-30b-a3b``: hidden 2048,
128 experts of width 768, 8 per token) cut to BENCH_LAYERS decoder layers (default 1) as a middle
stage (no embedding, no head), seeded random fp32 weights, converted twice from the same module:
``sparse`` (the export's form: only the experts some row chose are gathered and run) and
``dense`` (every expert run, the unchosen weighted 0: the fallback). Each round times one decode
step ([B, 1, hidden] over a past of BENCH_PAST tokens) of each form at every batch in
BENCH_USERS, in shuffled order; figure: the ratio of median step times, sparse over dense, with
a 95% bootstrap interval (goal <= 0.5 at 1 user). Both forms' outputs are compared first.

Window KV: Gemma 3 270M (real weights, `pipeshard model fetch gemma3-270m`) exported at 2 stages
fp32 into shards/gemma3-270m-2s-fp32 (once), served by paged shards at f32: one sequence of
BENCH_WINDOW_CONTEXT positions (default 4096, the export's whole context) prefilled in 256-token
chunks; figure: the KV bytes it holds on both stages (every global-layer block, the local
layers' blocks still in the window) against what it would hold with every layer keeping the whole
context (its reserved blocks times the bytes of every layer's block). Bytes, so no repeats: they
do not depend on timing. BENCH_WINDOW_CONTEXT=0 skips it.

Knobs: BENCH_RUNS (rounds, default 10), BENCH_WARMUP (default 2), BENCH_LAYERS (default 1),
BENCH_USERS (default 1,8), BENCH_PAST (default 128), BENCH_THREADS (CPU inference threads,
default 0: all cores).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import numpy as np
import openvino as ov
import torch

from bench.stats import command_with_knobs, interleaved, ratio_ci, summary, write_result
from pipeshard.exporter.convert import trace_stage
from pipeshard.exporter.families import resolve_spec
from pipeshard.exporter.stage_module import StageModule
from pipeshard.model.shapes import get_shape
from pipeshard.model.synth import config_json

RUNS = int(os.environ.get("BENCH_RUNS", "10"))
WARMUP = int(os.environ.get("BENCH_WARMUP", "2"))
LAYERS = int(os.environ.get("BENCH_LAYERS", "1"))
USERS = [int(n) for n in os.environ.get("BENCH_USERS", "1,8").split(",")]
PAST = int(os.environ.get("BENCH_PAST", "128"))
THREADS = int(os.environ.get("BENCH_THREADS", "0"))
WINDOW_CONTEXT = int(os.environ.get("BENCH_WINDOW_CONTEXT", "4096"))
SHAPE = "qwen3-30b-a3b"
KNOBS = (
    "BENCH_PART",
    "BENCH_RUNS",
    "BENCH_WARMUP",
    "BENCH_LAYERS",
    "BENCH_USERS",
    "BENCH_PAST",
    "BENCH_THREADS",
    "BENCH_WINDOW_CONTEXT",
)
CHUNK = 256  # the paged fleet's prefill chunk


def _module() -> StageModule:
    """A middle stage of LAYERS MoE layers, seeded normal(0, 0.02) weights (norms 1)."""
    shape = get_shape(SHAPE)
    spec = resolve_spec(config_json(shape, 0, 1, 2))
    torch.manual_seed(0)
    module = StageModule(spec, 1, 1 + LAYERS)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02)
    return module.eval()


def _compile(module: StageModule, form: str) -> ov.CompiledModel:
    """The same module and weights traced in ``form`` (SparseMoe reads its form at trace time)."""
    for layer in module.layers:
        layer.mlp.form = form
    config = {"INFERENCE_PRECISION_HINT": "f32"}
    if THREADS:
        config["INFERENCE_NUM_THREADS"] = str(THREADS)
    return ov.Core().compile_model(trace_stage(module), "CPU", config)


def _inputs(module: StageModule, batch: int) -> list[np.ndarray]:
    s = module.spec
    rng = np.random.default_rng(batch)
    feed = [
        rng.standard_normal((batch, 1, s.hidden_size)).astype(np.float32),
        np.ones((batch, PAST + 1), np.int64),
        np.full((batch, 1), PAST, np.int64),
    ]
    for _ in module.layer_indices:
        feed += [rng.standard_normal((batch, s.num_kv_heads, PAST, s.head_dim)).astype(np.float32)] * 2
    return feed


def _step(compiled: ov.CompiledModel, feed: list[np.ndarray]) -> Callable[[], float]:
    request = compiled.create_infer_request()

    def run() -> float:
        t0 = time.perf_counter()
        request.infer(feed)
        return (time.perf_counter() - t0) * 1000.0

    return run


def window_kv(context: int) -> dict:
    """KV bytes one Gemma 3 270M sequence of ``context`` positions holds on a 2-stage paged fleet,
    local layers bounded by their window, against every layer holding the whole context."""
    from pipeshard import paths
    from pipeshard.exporter.export import export_model
    from pipeshard.model.gemma3 import ensure_gemma3
    from pipeshard.shard.paged import PagedRow, PagedShard

    out = paths.shards_dir() / "gemma3-270m-2s-fp32"
    if not (out / "manifest.json").exists():
        export_model(ensure_gemma3(), out, stages=2, weights="fp32")
    shards = [PagedShard(out, s, "f32", THREADS or None, cache_bytes=1 << 30) for s in (0, 1)]
    ids = np.random.default_rng(0).integers(3, 200_000, size=context - 1, dtype=np.int64)
    for shard in shards:
        shard.open("seq", context)
    t0 = time.perf_counter()
    for start in range(0, len(ids), CHUNK):
        hidden = shards[0].step([PagedRow("seq", ids[start : start + CHUNK])])
        shards[1].step([PagedRow("seq", hidden[0], logits=1)])
    held = sum(s.held_bytes("seq") for s in shards)
    whole = sum(s.capacity("seq") // s.block_tokens * s.block_bytes for s in shards)
    return {
        "model": "gemma3-270m (2 stages, fp32 KV)",
        "context": context,
        "window": shards[0].window,
        "kv_bytes_bounded": held,
        "kv_bytes_whole_context": whole,
        "bounded_over_whole": held / whole,
        "prefill_s": time.perf_counter() - t0,
    }


def main() -> None:
    window = window_kv(WINDOW_CONTEXT) if WINDOW_CONTEXT else None
    module = _module()
    forms = {form: _compile(module, form) for form in ("sparse", "dense")}
    feeds = {b: _inputs(module, b) for b in USERS}
    for b, feed in feeds.items():
        got, want = forms["sparse"](feed)[0], forms["dense"](feed)[0]
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4, err_msg=f"forms differ at batch {b}")
    configs = {f"{form}-{b}": _step(compiled, feeds[b]) for form, compiled in forms.items() for b in USERS}
    samples = interleaved(configs, RUNS, WARMUP)
    moe = {}
    for b in USERS:
        ratio, ci = ratio_ci(samples[f"sparse-{b}"], samples[f"dense-{b}"])
        moe[f"users_{b}"] = {
            "sparse_ms": summary(samples[f"sparse-{b}"]),
            "dense_ms": summary(samples[f"dense-{b}"]),
            "sparse_over_dense": ratio,
            "sparse_over_dense_ci95": ci,
        }
    write_result(
        "families",
        {
            "shape": SHAPE,
            "layers": LAYERS,
            "past": PAST,
            "runs": RUNS,
            "load_avg": os.getloadavg()[0],
            "moe_step": moe,
            "window_kv": window,
            "goal": "sparse step <= 0.5 of dense at 1 user",
        },
        command_with_knobs("bench-families", KNOBS),
    )


if __name__ == "__main__":
    main()
