"""Many distinct long-context step shapes through one PagedShard, in a process of its own (oneDNN reads
its cache capacity once, when the CPU plugin first runs): prints malloc's bytes in use after each
pass as JSON. ``python -m tests.shard.shape_churn EXPORT ENTRIES [PASSES] [CONTEXT]``; ENTRIES is
``bounded_core``'s (0: the plugin's default caches).

A pass prefills one sequence to CONTEXT positions, then steps it from ever shorter lengths, one
block less each time, with a row of a different length each time: every step a shape (tokens x KV
blocks) the shard has not run, in every pass, within the sizes the first pass reached.
"""

from __future__ import annotations

import ctypes
import json
import sys

import numpy as np

from pipeshard.shard.paged import PagedRow, PagedShard
from pipeshard.shard.shape_cache import bounded_core

MALLINFO2 = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"


class MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2``: ten size_t fields."""

    _fields_ = [(name, ctypes.c_size_t) for name in MALLINFO2.split(" ")]


def bytes_in_use() -> int:
    """What malloc has handed out and not had back: its arenas' chunks in use and its mmapped ones."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def churn(export: str, entries: int, passes: int, context: int) -> list[int]:
    shard = PagedShard(export, 1, "default", 1, cache_bytes=32 << 20, core=bounded_core(entries))
    block, hidden = shard.block_tokens, shard.hidden_size
    shard.open("s", context + 3 * context // block + passes)
    used = []
    for p in range(passes):
        shard.rewind("s", 0)
        shard.step([PagedRow("s", np.zeros((context, hidden), np.float32))])
        for k, length in enumerate(range(context - block, block - 1, -block)):
            shard.rewind("s", length)
            # Rows of 3k + 1 + p tokens: no (tokens, blocks) pair comes twice, in a pass or across.
            shard.step([PagedRow("s", np.zeros((3 * k + 1 + p, hidden), np.float32))])
        used.append(bytes_in_use())
    return used


if __name__ == "__main__":
    args = sys.argv[1:]
    passes = int(args[2]) if len(args) > 2 else 3
    context = int(args[3]) if len(args) > 3 else 512
    print(json.dumps(churn(args[0], int(args[1]), passes, context)))
