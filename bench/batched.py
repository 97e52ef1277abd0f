"""Concurrent users on the in-process rings, for bench-mbatch's ``local`` series.

Each user generates BENCH_TOKENS tokens (eos ignored) from its own chat prompt through one
``Generation`` over a ring that holds every stage in this process: the paged ``batched_ring``
(sessions share each inference) or the stateful ``local_ring`` (sessions take turns). A round of
c users gives aggregate tok/s (all tokens / wall time), and keeps each user's TTFT and gaps
between chunks; isolation compares every user's tokens with its solo run on the same ring.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import openvino as ov

from pipeshard.services.coordinator.generation import DEFAULT_PREFILL_CHUNK, Chunk, Generation, Summary
from pipeshard.services.coordinator.in_process import batched_ring, local_ring
from pipeshard.services.coordinator.sampling import SamplingParams
from pipeshard.services.stage.wire import token_frame
from pipeshard.shard.prompting import Prompter
from pipeshard.tensor_codec import decode

# Different natural prompts, one per user. Each was checked not to loop within 128 greedy tokens
# at the default precision (no 4-gram more than 3 times; the bicycle prompt of earlier runs falls
# into "that is a bicycle that is a bicycle ..."); bench-mbatch reports the set's repetition rate.
PROMPTS = (
    "Write a short story about a lighthouse keeper.",
    "Describe how bread is made, step by step.",
    "What are the main causes of the seasons on Earth?",
    "Give advice to someone learning to play the guitar.",
    "Explain how a refrigerator keeps food cold.",
    "Compare trains and planes for travel in Europe.",
    "Write a letter to a friend describing your last holiday by the sea.",
    "How does a vaccine train the immune system?",
    "Explain the water cycle to a ten-year-old.",
    "What are the benefits and risks of working from home?",
    "How do bees make honey?",
    "Describe the life of a medieval blacksmith.",
    "Why is the sky blue? Explain in simple terms.",
    "What makes a good team leader at work?",
    "Describe your ideal weekend in the countryside.",
    "What did people eat in ancient Rome?",
)
# A 4-gram more often than this in an answer: the answer loops (speculation would predict it).
MAX_4GRAM_REPEATS = 3


def max_4gram_repeats(tokens: list[int]) -> int:
    """How often the most frequent 4-gram of ``tokens`` occurs."""
    counts = Counter(tuple(tokens[i : i + 4]) for i in range(len(tokens) - 3))
    return max(counts.values(), default=0)


def repetition(answers: list[list[int]]) -> dict:
    """The prompt set's repetition rate: the share of answers with a looping 4-gram."""
    repeats = [max_4gram_repeats(a) for a in answers]
    looping = sum(r > MAX_4GRAM_REPEATS for r in repeats)
    return {"rate": looping / max(1, len(answers)), "max_4gram_repeats": repeats}


@dataclass
class Round:
    tok_s: float
    tokens: list[list[int]]
    ttft_ms: list[float] = field(default_factory=list)
    gaps_ms: list[float] = field(default_factory=list)


class LocalUsers:
    """One ring and its generation; ``run(c)`` serves users 0..c-1 at once."""

    def __init__(
        self,
        export,
        *,
        paged: bool,
        precision: str,
        threads: int | None,
        tokens: int,
        core: ov.Core | None = None,
        ladder: str = "",
    ):
        """``core`` (paged only): a Core with extra CPU properties, for bench.precision_modes;
        ``ladder``: at precision ``invariant``, the configurations its stages try."""
        self.prompter = Prompter.from_dir(export)
        if paged:
            self.ring = batched_ring(
                export, precision, threads, cache_bytes=128 << 20, core=core, invariant_ladder=ladder
            )
            chunk = self.ring.prefill_chunk
        else:
            self.ring = local_ring(export, precision, threads)
            chunk = DEFAULT_PREFILL_CHUNK
        self.ring.stages.warmup()
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


def top2_margins(
    export,
    precision: str,
    cases: list[tuple[list[int], list[int], int]],
    *,
    threads: int | None = None,
    core: ov.Core | None = None,
) -> list[dict]:
    """Teacher-forced top-2 logit margins on the paged backend in this process: for each (prompt ids,
    solo tokens, position), the prompt and the solo tokens before the position go in and the logits
    there come out; also whether their argmax is the solo token (the same kernels as the fleet's).
    ``threads`` and ``core`` (extra CPU properties) as the measured ring had them."""
    ring = batched_ring(export, precision, threads, cache_bytes=64 << 20, core=core)
    chunk = ring.prefill_chunk

    async def one(ids: list[int], solo: list[int], at: int) -> dict:
        session, seq = uuid.uuid4().hex, ids + solo[:at]
        await ring.open_session(session, len(seq) + 1)
        try:
            start = step = 0
            while len(seq) - start > chunk:
                await ring.step(
                    token_frame(session, step, seq[start : start + chunk], start, True, fill_only=True)
                )
                start, step = start + chunk, step + 1
            result = await ring.step(token_frame(session, step, seq[start:], start, False))
        finally:
            await ring.release_session(session)
        logits = decode(result.logits, field="logits").reshape(-1, ring.stages.vocab_size)[-1]
        second, first = np.sort(logits)[-2:]
        return {
            "position": at,
            "top2_margin": float(first - second),
            "argmax_is_solo": int(np.argmax(logits)) == solo[at],
        }

    async def all_cases() -> list[dict]:
        out = [await one(*case) for case in cases]
        await ring.close()
        return out

    return asyncio.run(all_cases())
