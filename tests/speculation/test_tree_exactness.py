"""Tree verification is token-for-token target-only greedy decoding on INT4 shards at ``exact``
over 128 tokens, on both KV backends in process: stateful stages run a tree as chains
(`local_ring`), paged stages as one masked sequence (`batched_ring`).

``make test`` runs two tree shapes on 1 stage of each backend (prompt lookup's alternative
continuations and the self-draft's top-k) and one on 3 paged stages; the stateful pair on 2
stages is extended (tests/pipeline/test_tree_fleet.py runs trees through stage processes);
``make test-exactness`` runs every prompt on 1, 2 and 3 stages of both backends with more shapes
and ``tree=auto``."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from pipeshard.services.coordinator.generation import Summary
from pipeshard.services.coordinator.sampling import SamplingParams
from tests.speculation.conftest import SPEC_PROMPTS

TREE_TOKENS = 128
SHAPES = (("ngram", "3x4"), ("self", "2x3"), ("ngram", "2x8"), ("self", "4x2"), ("ngram", "auto"))
# The 2-stage pair runs through real stage processes in tests/pipeline/test_tree_fleet.py, and the
# stateful backend's cases (not the default) are extended.
SUBSET = [
    pytest.param(1, "ngram", "3x4", 2, "stateful", marks=pytest.mark.extended),
    pytest.param(1, "self", "2x3", 4, "stateful", marks=pytest.mark.extended),
    (1, "ngram", "3x4", 2, "paged"),
    (1, "self", "2x3", 4, "paged"),
    (3, "ngram", "2x8", 6, "paged"),
    pytest.param(2, "ngram", "3x4", 6, "stateful", marks=pytest.mark.extended),
    pytest.param(2, "self", "2x3", 1, "stateful", marks=pytest.mark.extended),
]


def _tree_generate(generation, ids, mode: str, tree: str) -> Summary:
    async def run() -> Summary:
        params = SamplingParams(max_tokens=TREE_TOKENS, ignore_eos=True)
        events = [e async for e in generation.run(ids, params, speculative=mode, tree=tree)]
        return events[-1]

    return asyncio.run(run())


def _check(spec_generation, greedy_reference, spec_prompt_ids, stages, source, tree, prompt, kv):
    generation, mode = spec_generation(stages, source, "int4", kv)
    out = _tree_generate(generation, spec_prompt_ids[prompt], mode, tree)
    expected = greedy_reference(stages, prompt, "int4")[:TREE_TOKENS]
    first = next((i for i, (a, b) in enumerate(zip(out.token_ids, expected, strict=False)) if a != b), None)
    assert out.token_ids == expected, (
        f"{SPEC_PROMPTS[prompt][0]} prompt, {stages} {kv} stages, {source} tree={tree}: first diff at {first}"
    )
    if tree != "auto":  # adaptive K may rightly stop drafting where it does not pay
        assert out.verify_steps > 0 and out.draft_tokens >= out.verify_steps


@pytest.mark.slow
@pytest.mark.parametrize(("stages", "source", "tree", "prompt", "kv"), SUBSET)
def test_tree_greedy_is_exact_subset(
    spec_generation, greedy_reference, spec_prompt_ids, stages, source, tree, prompt, kv
):
    _check(spec_generation, greedy_reference, spec_prompt_ids, stages, source, tree, prompt, kv)


@pytest.mark.slow
@pytest.mark.exactness
@pytest.mark.timeout(3600)
@pytest.mark.parametrize(
    ("stages", "shape", "kv"),
    [
        pytest.param(n, shape, kv, id=f"{kv}-{n}s-{shape[0]}-{shape[1]}")
        for kv, n, shape in itertools.product(("stateful", "paged"), (1, 2, 3), SHAPES)
    ],
)
def test_tree_greedy_is_exact_full_matrix(
    spec_generation, greedy_reference, spec_prompt_ids, stages, shape, kv
):
    source, tree = shape
    for prompt in range(len(SPEC_PROMPTS)):
        _check(spec_generation, greedy_reference, spec_prompt_ids, stages, source, tree, prompt, kv)


@pytest.mark.slow
@pytest.mark.parametrize("kv", [pytest.param("stateful", marks=pytest.mark.extended), "paged"])
def test_tree_logprobs_and_sampled_trees(spec_generation, spec_prompt_ids, kv):
    """Greedy trees report plain greedy's logprobs; a sampled tree (its rows' logits come back to
    the coordinator) gives the same tokens for the same seed."""
    generation, mode = spec_generation(1, "ngram", "int4", kv)
    ids = spec_prompt_ids[2]

    async def run(tree: str, **sampling) -> Summary:
        params = SamplingParams(max_tokens=32, ignore_eos=True, logprobs=True, **sampling)
        events = [
            e async for e in generation.run(ids, params, speculative=mode if tree else "none", tree=tree)
        ]
        return events[-1]

    plain = asyncio.run(run(""))
    tree = asyncio.run(run("3x4"))
    assert tree.token_ids == plain.token_ids and tree.verify_steps > 0
    assert max(abs(a - b) for a, b in zip(tree.logprobs, plain.logprobs, strict=True)) < 1e-3
    first, again = (asyncio.run(run("3x4", temperature=0.8, seed=11)) for _ in range(2))
    assert len(first.token_ids) == 32 and first.verify_steps > 0
    assert first.token_ids == again.token_ids
