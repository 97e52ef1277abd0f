"""INT4 fleets at ``--precision exact``: speculative greedy through real stage processes is plain
greedy, token for token, on 1 and 2 stages, and adaptive K gives one answer on every run.

At `fast` these fail on INT4 shards (issue 12: prompt lookup K=4 and adaptive K
changed 128-token answers), so they check what ``exact`` promises where users deploy."""

from __future__ import annotations

import pytest

from pipeshard.clients.client import PipeshardClient
from pipeshard.shard.chain import LocalChain
from pipeshard.shard.prompting import Prompter

pytestmark = pytest.mark.slow

MAX_TOKENS = 128
PROMPTS = ("Explain how a refrigerator keeps food cold.", "Write a short poem about the sea.")


def _first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


@pytest.mark.parametrize(
    ("stages", "runs"),
    [
        pytest.param(1, [("ngram", 4), ("self", 0)], marks=pytest.mark.extended),
        (2, [("ngram", 0), ("self", 3)]),
    ],
)
def test_int4_exact_fleet_speculation_equals_plain_greedy(
    stages, runs, smollm2_export, smollm2_draft, smollm2_heads, shared_fleet
):
    shards = smollm2_export(stages, "int4")
    self_draft = smollm2_draft(2, 4096, "int4")
    chain = LocalChain(shards, "exact")
    prompter = Prompter.from_dir(shards)
    plain = [
        chain.generate_greedy(prompter.encode("", [("user", p)]), MAX_TOKENS, ignore_eos=True).token_ids
        for p in PROMPTS
    ]
    del chain
    # The 2-stage fleet is test_tree_fleet.py's and test_medusa_fleet.py's paged fleet too: one
    # start for the three modules (its final stage runs draft heads).
    draft = ("--self-draft", str(self_draft))
    heads = ("--draft-heads", str(smollm2_heads))
    fleet = shared_fleet(
        shards, stages, precision="exact", extra_coordinator_args=draft, final_stage_args=heads
    )
    with PipeshardClient(fleet.coordinator, timeout_s=600) as client:
        for i, prompt in enumerate(PROMPTS):
            got = client.generate(prompt, max_tokens=MAX_TOKENS, ignore_eos=True, speculative="none")
            assert got.token_ids == plain[i], (
                f"plain, prompt {i}: differs at {_first_diff(got.token_ids, plain[i])}"
            )
            for source, k in runs:
                for attempt in range(2 if k == 0 else 1):  # adaptive K: the same answer every run
                    got = client.generate(
                        prompt, max_tokens=MAX_TOKENS, ignore_eos=True, speculative=source, k=k
                    )
                    assert got.token_ids == plain[i], (
                        f"{source} K={k or 'auto'} run {attempt}, prompt {i}: "
                        f"differs at {_first_diff(got.token_ids, plain[i])}"
                    )
