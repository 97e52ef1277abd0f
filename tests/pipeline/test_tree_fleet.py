"""Draft trees through real stage processes: 2-stage INT4 fleets at ``exact``, of stateful stages
(trees as chains) and of paged ones (trees as one masked sequence, the path's cache moved), give
plain greedy's tokens with trees of prompt lookup and of the self-draft; a bad ``tree`` is
INVALID_ARGUMENT naming the field and the value. At the default precision paged stages verify
no trees: a tree shape is refused by name and ``tree=auto`` drafts chains."""

from __future__ import annotations

import grpc
import pytest

from pipeshard.clients.client import PipeshardClient
from pipeshard.shard.chain import LocalChain
from pipeshard.shard.prompting import Prompter
from pipeshard.v1 import stage_pb2, stage_pb2_grpc

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


# The prompt whose 41st greedy token a 2x3 prompt-lookup tree changed on bf16 paged stages.
RENAME = (
    "Rename the variable x to total in this code and show the whole function:\n"
    "def add(values):\n    x = 0\n    for v in values:\n        x += v\n    return x\n"
)


def test_paged_stages_at_the_default_precision_verify_no_trees_and_say_so(shards, shared_fleet):
    """At the default precision a paged stage promises bit-identical rows, which a tree row's
    masked keys break (a path's logits came 0.74 off the same tokens decoded as a chain, and
    RENAME's 41st token changed): the stages report no tree form, a tree shape is refused naming
    ``tree``, and ``tree=auto`` drafts chains, plain greedy token for token. (The 2-stage paged
    fleet of test_pipelined_speculation.py, shared.)"""
    fleet = shared_fleet(
        shards, 2, extra_stage_args=("--kv", "paged"), extra_coordinator_args=("--spec-depth", "2")
    )
    for address in fleet.lanes[0]:
        with grpc.insecure_channel(address) as channel:
            info = stage_pb2_grpc.StageServiceStub(channel).GetStageInfo(
                stage_pb2.GetStageInfoRequest(), timeout=30
            )
        assert info.draft_tree_form == stage_pb2.DRAFT_TREE_FORM_UNSPECIFIED, address
    with PipeshardClient(fleet.coordinator, timeout_s=600) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.generate(RENAME, max_tokens=8, speculative="ngram", tree="2x3")
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "`tree`" in err.value.details() and "verify no draft trees" in err.value.details()
        plain = client.generate(RENAME, max_tokens=MAX_TOKENS, ignore_eos=True, speculative="none")
        auto = client.generate(
            RENAME, max_tokens=MAX_TOKENS, ignore_eos=True, speculative="ngram", tree="auto"
        )
        assert auto.token_ids == plain.token_ids
        assert auto.verify_steps > 0  # it speculated, in chains
