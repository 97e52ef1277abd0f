"""Speculative greedy decoding is token-for-token target-only greedy decoding: FP32 shards at
``f32`` and INT4 shards (the default deployment) at ``exact``.

The whole matrix (10 prompts x 1/2/3 stages x K 1/3/5/8 x every draft source, 256 tokens; INT4
also with adaptive K) runs as ``make test-exactness``; ``make test`` runs a covering subset of
FP32 (every stage count, draft source and K appears, over rotating prompts) and of INT4 (fixed and
adaptive K of prompt lookup and the self-draft on 1 stage; the 2-stage cases are extended, as the
INT4 exact fleet test runs them through real stage processes).
"""

from __future__ import annotations

import itertools

import pytest

from pipeshard.services.coordinator.sampling import SamplingParams
from tests.speculation.conftest import KS, SOURCES, SPEC_PROMPTS, STAGE_COUNTS, TOKENS, generate

FULL = list(itertools.product(STAGE_COUNTS, SOURCES, KS))
FULL_INT4 = list(itertools.product(STAGE_COUNTS, SOURCES, (*KS, 0)))  # K 0: adaptive
# Each (source, K) pair once, stage counts and prompts rotating through all of them. `make test`
# runs one on FP32 (a draft folder's case); the INT4 subset below, the tree subset's 3-stage case
# and the extended rest cover every source, K and stage count.
SUBSET_KEPT = {(1, "dir", 3)}
SUBSET = [
    pytest.param(*case, marks=() if case[:3] in SUBSET_KEPT else pytest.mark.extended)
    for case in (
        (STAGE_COUNTS[i % len(STAGE_COUNTS)], source, k, i % len(SPEC_PROMPTS))
        for i, (source, k) in enumerate(itertools.product(SOURCES, KS))
    )
]
# The 2-stage cases repeat what the INT4 exact fleet test runs in `make test` (prompt lookup with
# adaptive K and the self-draft at K=3 on 2 stages, tests/pipeline/test_exact_fleet.py): extended.
SUBSET_INT4 = [
    (1, "ngram", 4, 0),
    (1, "self", 0, 1),
    pytest.param(2, "ngram", 0, 2, marks=pytest.mark.extended),
    pytest.param(2, "self", 3, 3, marks=pytest.mark.extended),
]


def _check(spec_generation, greedy_reference, spec_prompt_ids, stages, source, k, prompts, weights="fp32"):
    generation, mode = spec_generation(stages, source, weights)
    params = SamplingParams(max_tokens=TOKENS, ignore_eos=True)
    accepted = 0
    for p in prompts:
        out = generate(generation, spec_prompt_ids[p], params, mode, k)
        expected = greedy_reference(stages, p, weights)
        assert out.token_ids == expected, (
            f"{SPEC_PROMPTS[p][0]} prompt, {weights} {stages} stages, {source} K={k or 'auto'}: "
            "first difference at token "
            f"{next(i for i, (a, b) in enumerate(zip(out.token_ids, expected, strict=False)) if a != b)}"
            if len(out.token_ids) == len(expected)
            else f"length {len(out.token_ids)} != {len(expected)}"
        )
        if k:  # adaptive K may rightly stop drafting a source that does not pay
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


@pytest.mark.slow
@pytest.mark.parametrize(("stages", "source", "k", "prompt"), SUBSET_INT4)
def test_int4_exact_speculative_greedy_is_exact_subset(
    spec_generation, greedy_reference, spec_prompt_ids, stages, source, k, prompt
):
    _check(spec_generation, greedy_reference, spec_prompt_ids, stages, source, k, [prompt], "int4")


@pytest.mark.slow
@pytest.mark.exactness
@pytest.mark.timeout(3600)
@pytest.mark.parametrize(("stages", "source", "k"), FULL_INT4)
def test_int4_exact_speculative_greedy_is_exact_full_matrix(
    spec_generation, greedy_reference, spec_prompt_ids, stages, source, k
):
    _check(
        spec_generation,
        greedy_reference,
        spec_prompt_ids,
        stages,
        source,
        k,
        range(len(SPEC_PROMPTS)),
        "int4",
    )
