"""`make bench-numerics`: how far regrouping rows moves the logits, per set of CPU compile properties.

Teacher-forced on the INT4 1- and 2-stage exports (a chat prompt plus a 64-token greedy
continuation, fed identically to every grouping): max |delta logit| against one-row decoding of
  verify_K   the continuation in K+1-row blocks (K = 1, 3, 7) after the same whole-prompt prefill
  chunk_C    the prompt in C-row chunks, then one-row steps, against one row at a time throughout
  batch_*    (1 stage) rows of one or two prompts of different lengths sharing every inference
with the number of positions whose greedy token changes and the smallest top-2 margin there.
BENCH_CANDIDATES=a,b runs some candidates only. Writes bench/results/numerics.json.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import openvino as ov

from bench.stats import write_result
from pipeshard.offline import set_offline_defaults
from pipeshard.shard.chain import LocalChain
from pipeshard.shard.manifest import load_manifest
from pipeshard.shard.numerics import Delta, batch_logits, blocks_for, chain_logits, max_abs_delta
from pipeshard.shard.prompting import Prompter
from pipeshard.shard.runtime import ShardRunner

F32 = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}
# name -> (precision given to ShardRunner, extra CPU properties set on the Core)
CANDIDATES: dict[str, tuple[str, dict]] = {
    "fast": ("fast", {}),  # the CPU plugin's own choice (the default before issue 34)
    "f32_hint_kv": ("fast", F32),
    "f32_dq0": ("fast", {**F32, "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0}),
    "f32_dq0_1thread": ("fast", {**F32, "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0, "INFERENCE_NUM_THREADS": 1}),
    "f32_dq0_default_kv": (
        "fast",
        {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0},
    ),
    "f32kv_dq0": ("fast", {"KV_CACHE_PRECISION": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0}),
    "accuracy_mode": ("fast", {"EXECUTION_MODE_HINT": "ACCURACY"}),
    "exact": ("exact", {}),  # what --precision exact compiles (pipeshard/shard/runtime.py)
}
KS = (1, 3, 7)
CHUNKS = (4, 16, 32)
NEW_TOKENS = 64
PROMPTS = (
    "Explain how a refrigerator keeps food cold.",
    "List five fruits that are red.",
)


def runners(export: Path, precision: str, props: dict) -> list[ShardRunner]:
    core = ov.Core()
    if props:
        core.set_property("CPU", props)
    n = load_manifest(export)["num_stages"]
    return [ShardRunner(export, i, precision, core=core, verify=False) for i in range(n)]


def sequence(export: Path, prompt: str) -> tuple[list[int], int]:
    """A chat prompt and its greedy continuation (f32 chain): the tokens every grouping is fed."""
    ids = Prompter.from_dir(export).encode("", [("user", prompt)])
    out = LocalChain(export, "f32", verify=False).generate_greedy(ids, NEW_TOKENS, ignore_eos=True)
    return ids + out.token_ids[:-1], len(ids)


def _row(d: Delta) -> dict:
    return {
        "max_abs": d.max_abs,
        "argmax_changes": d.argmax_changes,
        "min_margin_at_change": d.min_margin_at_change,
    }


def measure_chain(rs: list[ShardRunner], seq: list[int], p: int) -> dict:
    n = len(seq)
    decode_ref = chain_logits(rs, seq, blocks_for(n, 0, p, 1))
    one_row = chain_logits(rs, seq, blocks_for(n, 1, p, 1))
    out = {"prefill_whole_vs_one_row": _row(max_abs_delta(decode_ref, one_row))}
    for k in KS:
        out[f"verify_{k}"] = _row(
            max_abs_delta(chain_logits(rs, seq, blocks_for(n, 0, p, k + 1)), decode_ref, p - 1)
        )
    for c in CHUNKS:
        out[f"chunk_{c}"] = _row(max_abs_delta(chain_logits(rs, seq, blocks_for(n, c, p, 1)), one_row))
    return out


def measure_batch(runner: ShardRunner, alone_runner: ShardRunner, seqs: list[tuple[list[int], int]]) -> dict:
    """Batch rows against the same sequence alone (whole-prompt prefill, then one row a step).

    ``runner`` must be a compilation no batch-1 request has run on: the CPU plugin (2026.4.1)
    crashed on the first batch-2 inference of a compiled model after two batch-1 sessions of it."""
    alone = [chain_logits([alone_runner], s, blocks_for(len(s), 0, p, 1)) for s, p in seqs]
    out = {}
    groups = {"same_prompt_b2": [0, 0], "same_prompt_b4": [0, 0, 0, 0], "two_prompts": [0, 1]}
    for name, rows in groups.items():
        got = batch_logits(runner, [seqs[i][0] for i in rows], [seqs[i][1] for i in rows])
        deltas = [max_abs_delta(g, alone[i]) for g, i in zip(got, rows, strict=True)]
        worst = max(deltas, key=lambda d: d.max_abs)
        out[name] = _row(
            Delta(worst.max_abs, sum(d.argmax_changes for d in deltas), worst.min_margin_at_change)
        )
    return out


def measure(export_1s: Path, export_2s: Path, candidates: dict[str, tuple[str, dict]]) -> dict:
    seqs1 = [sequence(export_1s, p) for p in PROMPTS]
    seqs2 = [sequence(export_2s, p) for p in PROMPTS[:1]]
    results = {}
    for name, (precision, props) in candidates.items():
        t0 = time.perf_counter()
        r1, r2 = runners(export_1s, precision, props), runners(export_2s, precision, props)
        results[name] = {
            "precision": precision,
            "properties": {k: str(v) for k, v in props.items()},
            "1s": measure_chain(r1, *seqs1[0]),
            "2s": measure_chain(r2, *seqs2[0]),
            "batch_1s": measure_batch(
                runners(export_1s, precision, props)[0], r1[0], _same_decode_length(seqs1)
            ),
        }
        results[name]["seconds"] = time.perf_counter() - t0
        print(name, results[name], file=sys.stderr, flush=True)
    return results


def _same_decode_length(seqs: list[tuple[list[int], int]]) -> list[tuple[list[int], int]]:
    n = min(len(s) - p for s, p in seqs)
    return [(s[: p + n], p) for s, p in seqs]


def worst(result: dict, keys: tuple[str, ...]) -> float:
    return max(
        v["max_abs"]
        for part in ("1s", "2s", "batch_1s")
        for k, v in result[part].items()
        if k.startswith(keys)
    )


def measure_exact(export_1s: Path, export_2s: Path) -> dict:
    """bench-parity's keys: the worst |delta logit| at ``exact`` of verify rows, prefill chunks and
    batch rows against one-row decoding, and how many greedy tokens any of them changed."""
    result = measure(export_1s, export_2s, {"exact": ("exact", {})})["exact"]
    parts = [result[p] for p in ("1s", "2s", "batch_1s")]
    return {
        "max_abs_logit_delta_verify": worst(result, ("verify_",)),
        "max_abs_logit_delta_prefill": worst(result, ("chunk_", "prefill_")),
        "max_abs_logit_delta_batch": worst(result, ("same_prompt", "two_prompts")),
        "exact_argmax_changes": sum(v["argmax_changes"] for part in parts for v in part.values()),
        "numerics_exact": result,
    }


def main() -> int:
    set_offline_defaults()
    from bench.parity import ensure_export

    chosen = os.environ.get("BENCH_CANDIDATES")
    cands = {k: v for k, v in CANDIDATES.items() if not chosen or k in chosen.split(",")}
    results = measure(ensure_export(1), ensure_export(2), cands)
    write_result("numerics", {"new_tokens": NEW_TOKENS, "prompts": PROMPTS, "candidates": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
