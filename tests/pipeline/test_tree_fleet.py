"""Draft trees through real stage processes: 2-stage INT4 fleets at ``exact``, of stateful stages
(trees as chains) and of paged ones (trees as one masked sequence, the path's cache moved), give
plain greedy's tokens with trees of prompt lookup and of the self-draft; a bad ``tree`` is
INVALID_ARGUMENT naming the field and the value."""

from __future__ import annotations

import grpc
import pytest

from pipeshard.clients.client import PipeshardClient
from pipeshard.shard.chain import LocalChain
from pipeshard.shard.prompting import Prompter

pytestmark = pytest.mark.slow

MAX_TOKENS = 128
PROMPT = "List the planets of the solar system, then list them again in reverse order."


@pytest.fixture(scope="module")
def shards(smollm2_export):
    return smollm2_export(2, "int4")


@pytest.fixture(scope="module", params=[pytest.param("stateful", marks=pytest.mark.extended), "paged"])
def client(request, shards, smollm2_draft, smollm2_heads, shared_fleet):
    # Paged is the stages' default, so the paged fleet is test_exact_fleet.py's 2-stage one, shared.
    fleet = shared_fleet(
        shards,
        2,
        precision="exact",
        extra_stage_args=() if request.param == "paged" else ("--kv", request.param),
        extra_coordinator_args=("--self-draft", str(smollm2_draft(2, 4096, "int4"))),
        final_stage_args=("--draft-heads", str(smollm2_heads)),
    )
    with PipeshardClient(fleet.coordinator, timeout_s=600) as c:
        yield c


def test_tree_fleet_is_plain_greedy(client, shards):
    prompter = Prompter.from_dir(shards)
    plain = (
        LocalChain(shards, "exact")
        .generate_greedy(prompter.encode("", [("user", PROMPT)]), MAX_TOKENS, ignore_eos=True)
        .token_ids
    )
    for source, tree in (("ngram", "3x4"), ("self", "2x3")):
        got = client.generate(PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True, speculative=source, tree=tree)
        first = next((i for i, (a, b) in enumerate(zip(got.token_ids, plain, strict=False)) if a != b), None)
        assert got.token_ids == plain, f"{source} tree={tree}: first difference at {first}"
        assert got.verify_steps > 0


@pytest.mark.parametrize("value", ["3x", "9x9", "deep"])
def test_bad_tree_is_invalid_argument_naming_it(client, value):
    with pytest.raises(grpc.RpcError) as info:
        client.generate(PROMPT, max_tokens=4, speculative="ngram", tree=value)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tree" in info.value.details() and repr(value) in info.value.details()
