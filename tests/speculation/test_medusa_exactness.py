"""Draft heads on the final stage keep greedy decoding exact: INT4 shards at ``exact``, 128 tokens,
one paged stage in process, a chain of the heads' best tokens and a tree of their candidates give
target-only greedy's tokens, with the heads' candidates in use on every step (2 stages as
processes: tests/pipeline/test_medusa_fleet.py)."""

from __future__ import annotations

import asyncio

import pytest

from pipeshard.services.coordinator.generation import Generation, Summary
from pipeshard.services.coordinator.in_process import batched_ring
from pipeshard.services.coordinator.sampling import SamplingParams
from pipeshard.services.coordinator.speculation.medusa import MedusaDrafter
from pipeshard.services.coordinator.speculation.sources import DraftSources
from pipeshard.shard.prompting import Prompter
from tests.speculation.conftest import SPEC_PROMPTS

TOKENS = 128


@pytest.fixture(scope="module")
def heads_generation(smollm2_export, smollm2_heads) -> Generation:
    export = smollm2_export(1, "int4")
    ring = batched_ring(export, "exact")
    heads = ring.stages.run_heads(smollm2_heads)
    prompter = Prompter.from_dir(export)
    return Generation(ring, prompter.tokenizer, prompter.eos_ids, drafts=DraftSources(export, heads=heads))


@pytest.mark.slow
@pytest.mark.parametrize(("tree", "k", "prompt"), [("off", 3, 3), ("3x3", 0, 7)])
def test_medusa_greedy_is_exact(
    heads_generation, greedy_reference, spec_prompt_ids, monkeypatch, tree, k, prompt
):
    observed = []
    keep = MedusaDrafter.observe_heads

    def observe(self, candidates):
        observed.append(candidates is not None)
        keep(self, candidates)

    monkeypatch.setattr(MedusaDrafter, "observe_heads", observe)

    async def run() -> Summary:
        params = SamplingParams(max_tokens=TOKENS, ignore_eos=True)
        events = [
            e
            async for e in heads_generation.run(
                spec_prompt_ids[prompt], params, speculative="medusa", k=k, tree=tree
            )
        ]
        return events[-1]

    out = asyncio.run(run())
    expected = greedy_reference(1, prompt, "int4")[:TOKENS]
    first = next((i for i, (a, b) in enumerate(zip(out.token_ids, expected, strict=False)) if a != b), None)
    assert out.token_ids == expected, (
        f"{SPEC_PROMPTS[prompt][0]} prompt, medusa tree={tree}: first diff at {first}"
    )
    assert out.verify_steps > 0 and out.accepted_tokens > 0
    assert observed and all(observed), "every step's result carried usable head candidates"
