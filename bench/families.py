"""`make bench-families`: the mixture-of-experts stage's decode step in each form over the dense
one; Gemma 3's KV per sequence at a 4k context with its local layers bounded by their window.

Qwen3-30B-A3B's published shape (``pipeshard model synth --like qwen3-30b-a3b``: hidden 2048,
128 experts of width 768, 8 per token) cut to BENCH_LAYERS decoder layers (default 1) as a middle
stage (no embedding, no head), seeded random weights, converted from the same module in each form
of BENCH_FORMS: ``sparse`` (only the experts some row chose are gathered and run), ``dense``
(every expert run, the unchosen weighted 0) and ``by_rows`` (both in one graph, picked per step:
sparse up to MoeSpec.sparse_rows rows, the fp16/fp32 export's form). BENCH_MOE_WEIGHTS=int4
compresses each form as an int4 export does (by_rows is then left out: int4 exports take dense).
Each round times one decode step ([B, 1, hidden] over a past of BENCH_PAST tokens) of each form
at every batch in BENCH_USERS, in shuffled order; figure: the ratio of median step times, each
form over dense, with a 95% bootstrap interval (goal <= 0.5). The forms' outputs are compared
first. Per form, also: its compile time, its IR's weight file, and the peak RSS of a fresh
process that reads, compiles and runs it at every batch (what a second form costs).

Window KV: Gemma 3 270M (real weights, `pipeshard model fetch gemma3-270m`) exported at 2 stages
fp32 into shards/gemma3-270m-2s-fp32 (once), served by paged shards at f32: one sequence of
BENCH_WINDOW_CONTEXT positions (default 4096, the export's whole context) prefilled in 256-token
chunks; figure: the KV bytes it holds on both stages (every global-layer block, the local
layers' blocks still in the window) against what it would hold with every layer keeping the whole
context (its reserved blocks times the bytes of every layer's block). Bytes, so no repeats: they
do not depend on timing. BENCH_WINDOW_CONTEXT=0 skips it.

Knobs: BENCH_RUNS (rounds, default 10), BENCH_WARMUP (default 2), BENCH_LAYERS (default 1),
BENCH_USERS (default 1,8), BENCH_PAST (default 128), BENCH_THREADS (CPU inference threads,
default 0: all cores), BENCH_FORMS (default sparse,dense,by_rows), BENCH_MOE_WEIGHTS (fp32 or
int4, default fp32).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import openvino as ov
import torch

from bench.stats import command_with_knobs, interleaved, ratio_ci, summary, write_result
from pipeshard.exporter.convert import trace_stage
from pipeshard.exporter.families import ModelSpec, resolve_spec
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
MOE_WEIGHTS = os.environ.get("BENCH_MOE_WEIGHTS", "fp32")
FORMS = [f for f in os.environ.get("BENCH_FORMS", "sparse,dense,by_rows").split(",") if f]
if MOE_WEIGHTS == "int4":
    FORMS = [f for f in FORMS if f != "by_rows"]
if "dense" not in FORMS:
    FORMS.append("dense")  # the reference every ratio is over
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
    "BENCH_FORMS",
    "BENCH_MOE_WEIGHTS",
)
CHUNK = 256  # the paged fleet's prefill chunk


def _spec() -> ModelSpec:
    return resolve_spec(config_json(get_shape(SHAPE), 0, 1, 2))


def _module() -> StageModule:
    """A middle stage of LAYERS MoE layers, seeded normal(0, 0.02) weights (norms 1)."""
    torch.manual_seed(0)
    module = StageModule(_spec(), 1, 1 + LAYERS)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02)
    return module.eval()


def _config() -> dict[str, str]:
    config = {"INFERENCE_PRECISION_HINT": "f32"}
    if THREADS:
        config["INFERENCE_NUM_THREADS"] = str(THREADS)
    return config


def _save(module: StageModule, form: str, folder: Path) -> Path:
    """The module traced in ``form`` (SparseMoe reads its form at trace time), compressed as an
    export at BENCH_MOE_WEIGHTS would be, saved as IR."""
    from pipeshard.exporter.compress import compress_stage, make_plan

    for layer in module.layers:
        layer.mlp.form = form
    model = compress_stage(trace_stage(module), make_plan(module.spec, MOE_WEIGHTS))
    path = folder / f"{form}.xml"
    ov.save_model(model, path, compress_to_fp16=False)
    return path


def _peak_rss_mb(path: Path) -> float:
    """Peak RSS of a fresh process that reads, compiles and runs ``path`` at every batch."""
    out = subprocess.run(
        [sys.executable, "-m", "bench.families", "--rss", str(path)],
        check=True,
        capture_output=True,
        text=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


def _rss_probe(path: str) -> None:
    compiled = ov.Core().compile_model(path, "CPU", _config())
    for b in USERS:
        compiled(_inputs(_spec(), b))
    # VmHWM, not ru_maxrss: ru_maxrss keeps the parent's RSS at the fork across exec
    status = Path("/proc/self/status").read_text()
    print(int(status.split("VmHWM:")[1].split()[0]) / 1024)


def _inputs(s: ModelSpec, batch: int) -> list[np.ndarray]:
    rng = np.random.default_rng(batch)
    feed = [
        rng.standard_normal((batch, 1, s.hidden_size)).astype(np.float32),
        np.ones((batch, PAST + 1), np.int64),
        np.full((batch, 1), PAST, np.int64),
    ]
    for _ in range(LAYERS):
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
    spec = _spec()
    forms: dict[str, ov.CompiledModel] = {}
    cost: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:  # the compiled forms read their weights from here
        module = _module()
        paths = {form: _save(module, form, Path(tmp)) for form in FORMS}
        del module
        for form, path in paths.items():
            t0 = time.perf_counter()
            forms[form] = ov.Core().compile_model(path, "CPU", _config())
            cost[form] = {
                "compile_s": time.perf_counter() - t0,
                "ir_weights_mb": path.with_suffix(".bin").stat().st_size / 2**20,
                "peak_rss_mb": _peak_rss_mb(path),
            }
        feeds = {b: _inputs(spec, b) for b in USERS}
        tol = {"rtol": 1e-3, "atol": 1e-4} if MOE_WEIGHTS == "fp32" else {"rtol": 0.1, "atol": 0.1}
        for b, feed in feeds.items():
            want = forms["dense"](feed)[0]
            for form, compiled in forms.items():
                got = compiled(feed)[0]
                np.testing.assert_allclose(
                    got, want, **tol, err_msg=f"{form} differs from dense at batch {b}"
                )
        configs = {
            f"{form}-{b}": _step(compiled, feeds[b]) for form, compiled in forms.items() for b in USERS
        }
        samples = interleaved(configs, RUNS, WARMUP)
        moe: dict[str, dict] = {}
        for b in USERS:
            row: dict[str, dict] = {"dense_ms": summary(samples[f"dense-{b}"])}
            for form in forms:
                if form != "dense":
                    ratio, ci = ratio_ci(samples[f"{form}-{b}"], samples[f"dense-{b}"])
                    row[form] = {
                        "ms": summary(samples[f"{form}-{b}"]),
                        "over_dense": ratio,
                        "over_dense_ci95": ci,
                    }
            moe[f"users_{b}"] = row
    write_result(
        "families" if MOE_WEIGHTS == "fp32" else f"families-{MOE_WEIGHTS}",
        {
            "shape": SHAPE,
            "layers": LAYERS,
            "past": PAST,
            "runs": RUNS,
            "weights": MOE_WEIGHTS,
            "load_avg": os.getloadavg()[0],
            "moe_step": moe,
            "moe_form_cost": cost,
            "window_kv": window,
            "goal": "MoE step <= 0.5 of dense",
        },
        command_with_knobs("bench-families", KNOBS),
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rss"]:
        _rss_probe(sys.argv[2])
    else:
        main()
