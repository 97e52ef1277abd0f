"""Draft heads through real stage processes: a 2-stage INT4 fleet at ``exact`` whose final stage
runs them (``--draft-heads``) gives plain greedy's 128 tokens with a chain and a tree of the heads'
candidates (the fleet is test_exact_fleet.py's, shared); a fleet without heads answers a request
for ``medusa`` with INVALID_ARGUMENT naming it; a stage other than the final one refuses the flag
at start, naming it."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest

from pipeshard.clients.client import PipeshardClient
from pipeshard.shard.chain import LocalChain
from pipeshard.shard.prompting import Prompter

pytestmark = pytest.mark.slow

MAX_TOKENS = 128
PROMPT = "Explain how a refrigerator keeps food cold."


def test_medusa_fleet_is_plain_greedy(smollm2_export, smollm2_draft, smollm2_heads, shared_fleet):
    shards = smollm2_export(2, "int4")
    prompter = Prompter.from_dir(shards)
    plain = (
        LocalChain(shards, "exact")
        .generate_greedy(prompter.encode("", [("user", PROMPT)]), MAX_TOKENS, ignore_eos=True)
        .token_ids
    )
    fleet = shared_fleet(
        shards,
        2,
        precision="exact",
        extra_coordinator_args=("--self-draft", str(smollm2_draft(2, 4096, "int4"))),
        final_stage_args=("--draft-heads", str(smollm2_heads)),
    )
    with PipeshardClient(fleet.coordinator, timeout_s=600) as client:
        for tree, k in (("off", 3), ("3x3", 0)):
            got = client.generate(
                PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True, speculative="medusa", tree=tree, k=k
            )
            first = next(
                (i for i, (a, b) in enumerate(zip(got.token_ids, plain, strict=False)) if a != b), None
            )
            assert got.token_ids == plain, f"medusa tree={tree}: first difference at {first}"
            assert got.verify_steps > 0 and got.accepted_tokens > 0


def test_medusa_without_heads_is_invalid_argument_naming_it(default_fleet):
    with (
        PipeshardClient(default_fleet.coordinator, timeout_s=60) as client,
        pytest.raises(grpc.RpcError) as info,
    ):
        client.generate(PROMPT, max_tokens=4, speculative="medusa")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "medusa" in info.value.details() and "--draft-heads" in info.value.details()


def test_a_stage_other_than_the_final_refuses_draft_heads(smollm2_export, smollm2_heads):
    shards = smollm2_export(2, "int4")
    args = ["stage", "--stage", "0", "--shards", str(shards), "--next-hop", "127.0.0.1:9", "--port", "0"]
    done = subprocess.run(
        [sys.executable, "-m", "pipeshard.cli", *args, "--draft-heads", str(smollm2_heads)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "draft_heads" in done.stderr and "final stage" in done.stderr
