"""`python -m bench.verify_cost`: what a verify row costs on a paged stage, and in which form.

A verify row of n tokens on a filled cache (the last token and n - 1 drafts) against a decode
step, in three forms that compute the same logits (within 1e-4 at ``exact``): one sequence of
n tokens (what the stages run), a tree-mask row whose parents make it a chain (the draft-tree
path), and n one-token subsequences sharing the sequence's blocks (each with its own
``past_lens``: the CPU plugin writes every new token's K/V before attending, so the k-th sees
the k - 1 before it, and every subsequence stays on the one-token kernel). 1-stage INT4 export
at ``exact``, a 300-token cache, interleaved, median of BENCH_RUNS (9) per form.
BENCH_SHARDS names the export (default: the 1-stage INT4 export under shards/).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import openvino as ov

from bench.pipeline import ensure_export
from bench.stats import write_result
from pipeshard.shard.paged import LOGITS_INDICES, QQ_BIAS, QQ_BIAS_BEGINS, PagedRow, PagedShard

RUNS = int(os.environ.get("BENCH_RUNS", "9"))
SIZES = (2, 5, 9)
CACHE = 300
KEY = "bench"


def _fresh(shard: PagedShard) -> None:
    shard.free(KEY)
    shard.open(KEY, CACHE + 16)
    shard.step([PagedRow(KEY, (np.arange(CACHE, dtype=np.int64) % 1000) + 100, logits=1)])


def split(shard: PagedShard, ids: np.ndarray) -> np.ndarray:
    """``ids`` as one-token subsequences of the sequence, sharing its block table."""
    state = shard._seqs[KEY]
    n, length = len(ids), state.length
    past = np.arange(length, length + n, dtype=np.int32)
    used = [shard.blocks_for(int(p) + 1) for p in past]
    table = np.zeros(n + 1, np.int32)
    np.cumsum(used, out=table[1:])
    feed = {
        "input_ids": ids,
        "position_ids": past.astype(np.int64),
        "past_lens": past,
        "subsequence_begins": np.arange(n + 1, dtype=np.int32),
        "block_indices": np.concatenate([state.blocks[:u] for u in used]),
        "block_indices_begins": table,
        LOGITS_INDICES: np.arange(n, dtype=np.int64),
        QQ_BIAS: np.zeros(0, np.uint8),
        QQ_BIAS_BEGINS: np.zeros(0, np.int32),
    }
    for name, value in feed.items():
        shard._req.set_tensor(name, ov.Tensor(np.ascontiguousarray(value)))
    shard._req.set_tensor("max_context_len", ov.Tensor(np.array(length + n, np.int32)))
    shard._req.infer()
    state.length = length + n
    return shard._req.get_output_tensor(0).data.reshape(-1, shard.vocab_size)[:n].copy()


def main() -> int:
    shards = Path(os.environ.get("BENCH_SHARDS") or ensure_export(1))
    shard = PagedShard(shards, 0, "exact", cache_bytes=64 << 20)
    shard.open(KEY, 1)
    forms: dict[str, Callable[[], object]] = {
        "decode": lambda: shard.step([PagedRow(KEY, np.array([7]), logits=1)])
    }
    agree = {}
    for n in SIZES:
        ids = np.arange(n, dtype=np.int64) + 500
        chain = (-1, *range(n - 1))
        forms[f"verify{n}"] = lambda i=ids, n=n: shard.step([PagedRow(KEY, i, logits=n)])
        forms[f"tree_mask{n}"] = lambda i=ids, n=n, c=chain: shard.step(
            [PagedRow(KEY, i, logits=n, parents=c)]
        )
        forms[f"split{n}"] = lambda i=ids: split(shard, i)
        _fresh(shard)
        want = shard.step([PagedRow(KEY, ids, logits=n)])[0]
        _fresh(shard)
        got = split(shard, ids)
        agree[n] = float(np.abs(got - want).max())
    times: dict[str, list[float]] = {name: [] for name in forms}
    for _ in range(RUNS):
        for name, run in forms.items():
            _fresh(shard)
            started = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - started)
    ms = {name: statistics.median(t) * 1000.0 for name, t in times.items()}
    result = {
        "runs": RUNS,
        "cache_tokens": CACHE,
        "shards": str(shards),
        "ms": ms,
        "verify_jump_ms": {n: ms[f"verify{n}"] - ms["decode"] for n in SIZES},
        "split_jump_ms": {n: ms[f"split{n}"] - ms["decode"] for n in SIZES},
        "tree_mask_over_verify": {n: ms[f"tree_mask{n}"] / ms[f"verify{n}"] for n in SIZES},
        "split_max_abs_diff": agree,
    }
    write_result("verify-cost", result, "python -m bench.verify_cost")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
