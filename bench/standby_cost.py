"""What a standby KV copy costs a running session, in one process: capture work against decode work.

``python -m bench.standby_cost`` (BENCH_SHARDS=DIR: a 2-stage INT4 export; default the bundled
model's). The 2-stage paged shards at exact run 8 sequences of a ~1,024-token prompt; then, in
interleaved rounds (BENCH_RUNS, default 5), 32 decode steps of the 8 rows (the tokens in which
each session completes one 32-token block) and, for the same 8 sessions, what the coordinator's
standby copy does for those tokens: on each stage the part capture of that block
(``export_kv`` from its first position, the checksummed blob, the proto serialized and cut into
chunks); the coordinator only keeps those chunks. The ratio of medians (capture time / decode
time) is the share of a session's decode work its copy adds, as CPU time on the same cores (on
a fleet it runs on other threads and processes, so it slows decoding only where cores are
short). Also timed: capturing a
whole 1,024-token prompt once (the copy's first parts after a prefill).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from bench.stats import median, ratio_ci, write_result
from pipeshard import paths
from pipeshard.offline import set_offline_defaults
from pipeshard.shard.kvblob import KvBlob, snapshot_chunks, to_proto
from pipeshard.shard.paged import PagedRow, PagedShard

RUNS = int(os.environ.get("BENCH_RUNS", "5"))
USERS, PROMPT, BLOCK = 8, 1024, 32


def _shards() -> Path:
    chosen = os.environ.get("BENCH_SHARDS")
    return Path(chosen) if chosen else paths.shards_dir() / paths.export_name(paths.DEFAULT_MODEL, 2, "int4")


def _step(stages: list[PagedShard], feeds: dict[str, np.ndarray]) -> dict[str, int]:
    seqs = list(feeds)
    hidden = stages[0].step([PagedRow(s, feeds[s]) for s in seqs])
    logits = stages[1].step([PagedRow(s, h, logits=1) for s, h in zip(seqs, hidden, strict=True)])
    return {s: int(lg[-1].argmax()) for s, lg in zip(seqs, logits, strict=True)}


def _capture(stage: PagedShard, seq: str, end: int, start: int) -> int:
    """A standby part as the stage makes it (the coordinator keeps its chunks); returns its bytes."""
    arrays = stage.export_kv(seq, end, start)
    blob = KvBlob.build(stage.kv_source, arrays, tuple(range(start, end)), positions=end - start, start=start)
    return snapshot_chunks(to_proto(blob))[0]


def main() -> int:
    set_offline_defaults()
    shards = _shards()
    stages = [PagedShard(shards, k, "exact", 1, cache_bytes=512 << 20) for k in (0, 1)]
    rng = np.random.default_rng(0)
    seqs = [f"s{u}" for u in range(USERS)]
    capacity = PROMPT + BLOCK * (RUNS + 2)
    for stage in stages:
        for s in seqs:
            stage.open(s, capacity)
    last = {}
    for s in seqs:  # one at a time: the prompt's prefill is not what is measured
        last |= _step(stages, {s: rng.integers(100, 40000, PROMPT)})
    began = time.perf_counter()
    prompt_bytes = sum(_capture(stage, s, PROMPT, 0) for stage in stages for s in seqs)
    prompt_s = time.perf_counter() - began
    decode, capture = [], []
    length = PROMPT
    for _ in range(RUNS):
        began = time.perf_counter()
        for _ in range(BLOCK):
            last = _step(stages, {s: np.array([last[s]]) for s in seqs})
        length += BLOCK
        decode.append(time.perf_counter() - began)
        began = time.perf_counter()
        part_bytes = sum(_capture(stage, s, length, length - BLOCK) for stage in stages for s in seqs)
        capture.append(time.perf_counter() - began)
    ratio, ci = ratio_ci(capture, decode)
    result = {
        "users": USERS,
        "prompt_tokens": PROMPT,
        "block_tokens": BLOCK,
        "decode_32_steps_s": round(median(decode), 3),
        "capture_32_token_parts_s": round(median(capture), 4),
        "part_bytes_all_sessions": part_bytes,
        "standby_capture_share": round(ratio, 4),
        "standby_capture_share_ci": [round(x, 4) for x in ci],
        "prompt_capture_s": round(prompt_s, 3),
        "prompt_capture_bytes": prompt_bytes,
    }
    write_result("standby_cost", result, command="python -m bench.standby_cost")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
