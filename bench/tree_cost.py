"""`python -m bench.tree_cost`: what a draft-tree step costs on a stateful stage.

A tree runs as its root-to-leaf chains, each a batch row gathered by ``beam_idx``
(pipeshard/shard/runtime.py, ``run_chains``). Against a chain of the same depth and one row of
the same positions (what a per-query mask input would cost at most: a tree with shared prefixes
has fewer nodes), and the one-token step after a tree step, which gathers the kept row back,
against a plain one. 1-stage INT4 export at ``exact``, a 300-token cache, median of BENCH_RUNS (15)
per shape. BENCH_SHARDS names the export (default: the 1-stage INT4 export under shards/).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from bench.pipeline import ensure_export
from bench.stats import write_result
from pipeshard.shard.runtime import ShardRunner, ShardSession

RUNS = int(os.environ.get("BENCH_RUNS", "15"))
SHAPES = ((3, 5), (2, 4), (4, 3))  # chains x positions per chain (the pending token + D levels)
CACHE = 300


def _median_ms(runner: ShardRunner, step: Callable[[ShardSession], float]) -> float:
    """Median of ``step``'s own timing, each run on a fresh session with a CACHE-token cache."""
    prompt = (np.arange(CACHE, dtype=np.int64) % 1000 + 100)[None]
    times = []
    for _ in range(RUNS):
        session = runner.new_session()
        session.run(prompt)
        times.append(step(session))
    return statistics.median(times) * 1000.0


def _timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main() -> int:
    shards = Path(os.environ.get("BENCH_SHARDS") or ensure_export(1))
    runner = ShardRunner(shards, 0, "exact")
    result: dict = {"runs": RUNS, "cache_tokens": CACHE, "shards": str(shards)}
    for chains, t in SHAPES:
        ids = np.arange(chains * t, dtype=np.int64)[None] + 500
        positions = np.tile(np.arange(CACHE, CACHE + t), chains)
        result[f"chain_{t}_ms"] = _median_ms(
            runner, lambda s, i=ids[:, :t], t=t: _timed(lambda: s.run(i, return_last=t))
        )
        result[f"rows_{chains}x{t}_ms"] = _median_ms(
            runner,
            lambda s, i=ids, p=positions, c=chains, t=t: _timed(lambda: s.run_chains(i, p, c, return_last=t)),
        )
        result[f"one_row_{chains * t}_ms"] = _median_ms(
            runner, lambda s, i=ids, n=chains * t: _timed(lambda: s.run(i, return_last=n))
        )
    one = np.array([[7]], dtype=np.int64)
    result["decode_ms"] = _median_ms(runner, lambda s: _timed(lambda: s.run(one)))

    def after_tree(session: ShardSession) -> float:
        chains, t = SHAPES[0]
        ids = np.arange(chains * t, dtype=np.int64)[None] + 500
        session.run_chains(ids, np.tile(np.arange(CACHE, CACHE + t), chains), chains, return_last=t)
        session.keep_chain(1)
        return _timed(lambda: session.run(one))

    result["decode_after_tree_ms"] = _median_ms(runner, after_tree)
    write_result("tree-cost", result, "python -m bench.tree_cost")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
