"""Concurrent users on the in-process rings, for bench-mbatch's ``local`` series.

Each user generates BENCH_TOKENS tokens (eos ignored) from its own chat prompt through one
``Generation`` over a ring that holds every stage in this process: the paged ``BatchedRing``
(sessions share each inference) or the stateful ``LocalRing`` (sessions take turns). A round of
c users gives aggregate tok/s (all tokens / wall time), and keeps each user's TTFT and gaps
between chunks; isolation compares every user's tokens with its solo run on the same ring.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import numpy as np

from pipeshard.services.coordinator.batched_ring import BatchedRing
from pipeshard.services.coordinator.generation import DEFAULT_PREFILL_CHUNK, Chunk, Generation, Summary
from pipeshard.services.coordinator.local_ring import LocalRing
from pipeshard.services.coordinator.sampling import SamplingParams
from pipeshard.shard.prompting import Prompter

# Different prompts, one per user (greedy answers of different lengths and kinds).
PROMPTS = (
    "Explain in a few paragraphs how a bicycle works.",
    "Write a short story about a lighthouse keeper.",
    "Describe how bread is made, step by step.",
    "What are the main causes of the seasons on Earth?",
    "Give advice to someone learning to play the guitar.",
    "Explain how a refrigerator keeps food cold.",
    "Compare trains and planes for travel in Europe.",
    "Why do cats purr? Explain what is known.",
)


@dataclass
class Round:
    tok_s: float
    tokens: list[list[int]]
    ttft_ms: list[float] = field(default_factory=list)
    gaps_ms: list[float] = field(default_factory=list)


class LocalUsers:
    """One ring and its generation; ``run(c)`` serves users 0..c-1 at once."""

    def __init__(self, export, *, paged: bool, precision: str, threads: int | None, tokens: int):
        self.prompter = Prompter.from_dir(export)
        if paged:
            self.ring = BatchedRing(export, precision, threads, cache_bytes=128 << 20)
            chunk = self.ring.prefill_chunk
        else:
            self.ring = LocalRing(export, precision, threads)
            chunk = DEFAULT_PREFILL_CHUNK
        self.ring.warmup()
        self.generation = Generation(
            self.ring, self.prompter.tokenizer, self.prompter.eos_ids, prefill_chunk=chunk
        )
        self.ids = [self.prompter.encode("", [("user", p)]) for p in PROMPTS]
        self.tokens = tokens
        self.loop = asyncio.new_event_loop()
        self.solo: list[list[int]] = []

    async def _user(self, i: int, out: Round) -> list[int]:
        t0 = time.perf_counter()
        arrivals = []
        summary = None
        params = SamplingParams(max_tokens=self.tokens, ignore_eos=True)
        async for event in self.generation.run(self.ids[i % len(self.ids)], params):
            if isinstance(event, Chunk):
                arrivals.append(time.perf_counter())
            elif isinstance(event, Summary):
                summary = event
        out.ttft_ms.append((arrivals[0] - t0) * 1000)
        out.gaps_ms.extend(np.diff(arrivals) * 1000)
        return summary.token_ids

    def run(self, c: int) -> Round:
        out = Round(0.0, [])

        async def users():
            return await asyncio.gather(*(self._user(i, out) for i in range(c)))

        start = time.perf_counter()
        out.tokens = self.loop.run_until_complete(users())
        out.tok_s = sum(len(t) for t in out.tokens) / (time.perf_counter() - start)
        return out

    def solo_runs(self, c: int) -> list[list[int]]:
        """Each of the first ``c`` users alone (cached)."""
        while len(self.solo) < c:
            self.solo.append(self.run_one(len(self.solo)))
        return self.solo[:c]

    def run_one(self, i: int) -> list[int]:
        return self.loop.run_until_complete(self._user(i, Round(0.0, [])))


def latency(rounds: list[Round]) -> dict:
    """Per-user TTFT and inter-chunk p50/p95 over the given rounds."""
    ttft = [t for r in rounds for t in r.ttft_ms]
    gaps = [g for r in rounds for g in r.gaps_ms]
    return {
        "ttft_ms": {"p50": float(np.percentile(ttft, 50)), "p95": float(np.percentile(ttft, 95))},
        "inter_token_ms": {"p50": float(np.percentile(gaps, 50)), "p95": float(np.percentile(gaps, 95))},
    }
