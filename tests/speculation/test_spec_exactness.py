"""Speculative greedy decoding is token-for-token target-only greedy decoding (f32 shards).

The whole matrix (10 prompts x 1/2/3 stages x K 1/3/5/8 x every draft source, 256 tokens) runs
as ``make test-exactness``; ``make test`` runs a covering subset: every stage count, draft
source and K appears, over rotating prompts.
"""

from __future__ import annotations

import itertools

import pytest

from pipeshard.services.coordinator.sampling import SamplingParams
from tests.speculation.conftest import KS, SOURCES, SPEC_PROMPTS, STAGE_COUNTS, TOKENS, generate

FULL = list(itertools.product(STAGE_COUNTS, SOURCES, KS))
# Each (source, K) pair once, stage counts and prompts rotating through all of them.
SUBSET = [
    (STAGE_COUNTS[i % len(STAGE_COUNTS)], source, k, i % len(SPEC_PROMPTS))
    for i, (source, k) in enumerate(itertools.product(SOURCES, KS))
]


def _check(spec_generation, greedy_reference, spec_prompt_ids, stages, source, k, prompts):
    generation, mode = spec_generation(stages, source)
    params = SamplingParams(max_tokens=TOKENS, ignore_eos=True)
    accepted = 0
    for p in prompts:
        out = generate(generation, spec_prompt_ids[p], params, mode, k)
        expected = greedy_reference(stages, p)
        assert out.token_ids == expected, (
            f"{SPEC_PROMPTS[p][0]} prompt, {stages} stages, {source} K={k}: first difference at token "
            f"{next(i for i, (a, b) in enumerate(zip(out.token_ids, expected, strict=False)) if a != b)}"
            if len(out.token_ids) == len(expected)
            else f"length {len(out.token_ids)} != {len(expected)}"
        )
        assert out.verify_steps > 0 and out.draft_tokens >= out.verify_steps
        accepted += out.accepted_tokens
    return accepted


@pytest.mark.slow
@pytest.mark.parametrize(("stages", "source", "k", "prompt"), SUBSET)
def test_speculative_greedy_is_exact_subset(
    spec_generation, greedy_reference, spec_prompt_ids, stages, source, k, prompt
):
    _check(spec_generation, greedy_reference, spec_prompt_ids, stages, source, k, [prompt])


@pytest.mark.slow
@pytest.mark.exactness
@pytest.mark.timeout(3600)  # 10 prompts x 256 tokens; a loaded machine can pass 15 minutes
@pytest.mark.parametrize(("stages", "source", "k"), FULL)
def test_speculative_greedy_is_exact_full_matrix(
    spec_generation, greedy_reference, spec_prompt_ids, stages, source, k
):
    _check(spec_generation, greedy_reference, spec_prompt_ids, stages, source, k, range(len(SPEC_PROMPTS)))
