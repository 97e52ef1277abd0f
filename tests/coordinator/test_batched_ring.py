"""The batched in-process ring (`batched_ring`, services/coordinator/in_process.py): twelve
concurrent generations with different prompts and lengths, staggered arrivals and a cancellation,
on INT4 2-stage shards in exact mode, each token for token equal to its solo run, with two steps
in flight (the stages pipelined on their own threads); the steps really were shared."""

from __future__ import annotations

import asyncio

import pytest

from pipeshard.errors import ResourceExhausted
from pipeshard.services.coordinator.generation import Generation, Summary
from pipeshard.services.coordinator.in_process import batched_ring, local_ring
from pipeshard.services.coordinator.sampling import SamplingParams
from pipeshard.services.coordinator.speculation.sources import DraftSources
from pipeshard.shard.prompting import Prompter

pytestmark = pytest.mark.slow

# A long prompt spans several prefill chunks, so its chunks share steps with others' decode rows.
LONG = "Summarise this: " + " ".join(
    f"item {i} is a {('red', 'blue', 'green')[i % 3]} box;" for i in range(90)
)
EXTRA = ("Name three planets.", "What is 12 times 12?", LONG, "Tell me a joke about cats.")


@pytest.fixture(scope="module")
def setup(smollm2_export, prompts):
    export = smollm2_export(2, "int4")
    prompter = Prompter.from_dir(export)
    ring = batched_ring(export, "exact", 1, cache_bytes=96 << 20, inflight=2)  # stages pipelined
    ring.stages.warmup()
    ids = [prompter.encode("", [("user", p)]) for p in (*prompts, *EXTRA)]
    return export, prompter, ring, ids


async def _generate(generation: Generation, ids: list[int], n: int, delay: float = 0.0) -> list[int]:
    await asyncio.sleep(delay)
    summary = None
    async for event in generation.run(ids, SamplingParams(max_tokens=n, ignore_eos=True)):
        if isinstance(event, Summary):
            summary = event
    return summary.token_ids


def test_twelve_staggered_sessions_equal_their_solo_runs(setup):
    _, prompter, ring, ids = setup
    assert len(ids) == 12 and len(ids[10]) > 2 * ring.prefill_chunk
    lengths = [12 + 3 * (i % 5) for i in range(12)]
    cancelled = 5

    async def main():
        generation = Generation(ring, prompter.tokenizer, prompter.eos_ids, prefill_chunk=ring.prefill_chunk)
        solo = [await _generate(generation, i, n) for i, n in zip(ids, lengths, strict=True)]
        solo_steps = ring.batch_steps.steps_run
        tasks = [
            asyncio.create_task(_generate(generation, i, n, delay=0.03 * k))
            for k, (i, n) in enumerate(zip(ids, lengths, strict=True))
        ]
        await asyncio.sleep(0.25)
        tasks[cancelled].cancel()
        together = await asyncio.gather(*tasks, return_exceptions=True)
        await generation.released()
        return solo, solo_steps, together

    solo, solo_steps, together = asyncio.run(main())
    assert isinstance(together[cancelled], asyncio.CancelledError)
    for k in range(12):
        if k != cancelled:
            assert together[k] == solo[k], k
    # Shared steps: far fewer inferences than the rows they carried.
    batched_steps = ring.batch_steps.steps_run - solo_steps
    assert batched_steps < 0.6 * solo_steps
    # The cancelled session's blocks (and everyone's) are back on every stage.
    assert all(s.usage().blocks_used == 0 for s in ring.stages.shards)


def test_paged_solo_runs_equal_the_stateful_backend(setup):
    export, prompter, ring, ids = setup

    async def run(r, chunk):
        generation = Generation(r, prompter.tokenizer, prompter.eos_ids, prefill_chunk=chunk)
        return [await _generate(generation, i, 16) for i in ids[:4]]

    paged = asyncio.run(run(ring, ring.prefill_chunk))
    stateful = asyncio.run(run(local_ring(export, "exact", 1), 4096))
    assert paged == stateful


def test_admission_names_the_budget(setup):
    export, prompter, _, ids = setup
    small = batched_ring(export, "exact", 1, cache_bytes=8 * 737280)  # 8 blocks: 256 tokens a stage

    async def main():
        generation = Generation(
            small, prompter.tokenizer, prompter.eos_ids, prefill_chunk=small.prefill_chunk
        )
        first = await _generate(generation, ids[0], 8)
        with pytest.raises(ResourceExhausted, match="KV cache budget"):
            await _generate(generation, ids[10], 8)
        await generation.released()
        return first

    assert len(asyncio.run(main())) == 8
    assert all(s.usage().blocks_used == 0 for s in small.stages.shards)


def test_speculation_rewinds_by_truncation_and_keeps_the_plain_tokens(setup):
    export, prompter, ring, _ = setup
    ids = prompter.encode("", [("user", "Repeat after me: one two three, one two three, one two three.")])

    async def main():
        generation = Generation(
            ring,
            prompter.tokenizer,
            prompter.eos_ids,
            prefill_chunk=ring.prefill_chunk,
            drafts=DraftSources(export),
        )
        params = SamplingParams(max_tokens=40, ignore_eos=True)
        runs = {}
        for mode in ("none", "ngram"):
            async for event in generation.run(ids, params, speculative=mode, k=4):
                if isinstance(event, Summary):
                    runs[mode] = event
        await generation.released()
        return runs

    runs = asyncio.run(main())
    spec = runs["ngram"]
    assert spec.token_ids == runs["none"].token_ids
    assert spec.verify_steps and spec.accepted_tokens < spec.draft_tokens  # some drafts were rewound
    assert all(s.usage().blocks_used == 0 for s in ring.stages.shards)
