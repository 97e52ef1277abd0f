"""Speculation inside the batch (issue #17 item 1): sessions that each draft with their own source
and K share the paged backend's steps with plain sessions' decode rows and a long prompt's prefill
chunks, rewind their rejected drafts by truncation, and still give, token for token, their solo
run with the same speculation settings, which in exact mode is plain greedy (INT4, 2 stages, one
thread per stage, in-process batched_ring)."""

from __future__ import annotations

import asyncio

import pytest

from pipeshard.services.coordinator.generation import Generation, Summary
from pipeshard.services.coordinator.in_process import batched_ring
from pipeshard.services.coordinator.sampling import SamplingParams
from pipeshard.services.coordinator.speculation.sources import DraftSources
from pipeshard.shard.prompting import Prompter
from tests.speculation.conftest import shards_root

pytestmark = pytest.mark.slow

TOKENS = 40
LONG = "Summarise this list: " + " ".join(f"box {i} holds {i * 7 % 13} apples;" for i in range(70))
# (prompt, draft source, K; 0 = adaptive): plain rows, prompt lookup at K 3 and adaptive, the
# self-draft adaptive and the Hugging Face draft folder at K 2, one prompt long enough to prefill
# in several chunks while the others decode.
SESSIONS = (
    ("Repeat after me: one two three, one two three, one two three.", "ngram", 3),
    ("Write a Python function that checks whether a string is a palindrome.", "none", 0),
    ("List ten fruits, one per line.", "self", 0),
    (LONG, "ngram", 0),
    ("Explain how a hash table handles collisions.", "dir", 2),
    ("What is the capital of Japan, and what is it known for?", "self", 3),
)


@pytest.fixture(scope="module")
def setup(smollm2_export, smollm2_draft, hf_draft_dir):
    export = smollm2_export(2, "int4")
    prompter = Prompter.from_dir(export)
    ring = batched_ring(export, "exact", 1, cache_bytes=96 << 20)
    ring.stages.warmup()
    drafts = DraftSources(
        export,
        self_draft=smollm2_draft(2, 4096, "int4"),
        named={"dir": hf_draft_dir},
        draft_cache=shards_root() / ".drafts",
    )
    generation = Generation(
        ring, prompter.tokenizer, prompter.eos_ids, prefill_chunk=ring.prefill_chunk, drafts=drafts
    )
    ids = [prompter.encode("", [("user", p)]) for p, _, _ in SESSIONS]
    return ring, generation, ids


async def _run(generation: Generation, ids: list[int], mode: str, k: int, delay: float = 0.0) -> Summary:
    await asyncio.sleep(delay)
    params = SamplingParams(max_tokens=TOKENS, ignore_eos=True)
    summary = None
    async for event in generation.run(ids, params, speculative=mode, k=k):
        if isinstance(event, Summary):
            summary = event
    return summary


def test_speculating_sessions_in_one_batch_equal_their_solo_runs(setup):
    ring, generation, ids = setup
    assert len(ids[3]) > 2 * ring.prefill_chunk  # the long prompt's chunks share steps with decode rows

    async def main():
        plain = [await _run(generation, i, "none", 0) for i in ids]
        solo = [await _run(generation, i, mode, k) for i, (_, mode, k) in zip(ids, SESSIONS, strict=True)]
        before = ring.batch_steps.steps_run
        together = await asyncio.gather(
            *(
                _run(generation, i, mode, k, delay=0.04 * n)
                for n, (i, (_, mode, k)) in enumerate(zip(ids, SESSIONS, strict=True))
            )
        )
        await generation.released()
        return plain, solo, together, ring.batch_steps.steps_run - before

    plain, solo, together, steps = asyncio.run(main())
    for n, (_, mode, k) in enumerate(SESSIONS):
        label = f"session {n} ({mode}, K={k or 'auto'})"
        assert together[n].token_ids == solo[n].token_ids, label
        assert solo[n].token_ids == plain[n].token_ids, label  # exact: speculation changes no token
    # Every fixed-K speculating session verified drafts and had some rejected (rewound) in the batch.
    for n, (_, mode, k) in enumerate(SESSIONS):
        if mode != "none" and k:
            assert together[n].verify_steps and together[n].accepted_tokens < together[n].draft_tokens, n
    # The rows shared steps: far fewer steps than the sessions' decode steps added up (each step
    # gives a session its accepted drafts plus one token).
    own_steps = sum(TOKENS - s.accepted_tokens for s in together)
    assert steps < 0.6 * own_steps
    assert all(s.usage().blocks_used == 0 for s in ring.stages.shards)
