"""A fleet of real stage processes decodes exactly what the unsplit model decodes."""

from __future__ import annotations

import pytest

from pipeshard.clients.client import PipeshardClient

pytestmark = pytest.mark.slow

MAX_TOKENS = 128


def _decode_all(address: str, prompts, chat_prompt_ids) -> list[list[int]]:
    """Greedy 128-token continuations through the coordinator, eos ignored."""
    out = []
    with PipeshardClient(address, timeout_s=300) as client:
        for prompt, ids in zip(prompts, chat_prompt_ids, strict=True):
            result = client.generate(prompt, max_tokens=MAX_TOKENS, ignore_eos=True)
            assert result.finish_reason == "length"
            assert result.prompt_tokens == len(ids)
            assert result.completion_tokens == MAX_TOKENS
            out.append(result.token_ids)
    return out


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


@pytest.mark.extended
@pytest.mark.parametrize("stages", [2, 3])
def test_fp32_fleet_matches_hf_greedy(
    stages, smollm2_export, fleet_factory, prompts, chat_prompt_ids, hf_greedy_128
):
    fleet = fleet_factory(smollm2_export(stages, "fp32"), stages, precision="f32")
    got = _decode_all(fleet.coordinator, prompts, chat_prompt_ids)
    for i, (want, have) in enumerate(zip(hf_greedy_128, got, strict=True)):
        assert have == want, f"prompt {i}: first difference at token {_first_diff(want, have)}"


@pytest.mark.parametrize("half", [0, pytest.param(1, marks=pytest.mark.extended)])
def test_int4_fleet_matches_in_process_ring(
    half, smollm2_export, default_fleet, greedy_in_process, prompts, chat_prompt_ids
):
    """The default deployment (paged stages, default precision) gives what ``generate --local`` gives:
    four of the eight prompts in `make test`, the other four in `make test-extended`."""
    chosen = slice(4 * half, 4 * half + 4)
    prompts, chat_prompt_ids = prompts[chosen], chat_prompt_ids[chosen]
    local = greedy_in_process(smollm2_export(2, "int4"), chat_prompt_ids, MAX_TOKENS)
    got = _decode_all(default_fleet.coordinator, prompts, chat_prompt_ids)
    for i, (want, have) in enumerate(zip(local, got, strict=True), start=chosen.start):
        assert have == want, f"prompt {i}: first difference at token {_first_diff(want, have)}"


@pytest.mark.extended
def test_int4_stateful_fleet_matches_in_process_chain(
    smollm2_export, fleet_factory, prompts, chat_prompt_ids
):
    from pipeshard.shard.chain import LocalChain

    shards = smollm2_export(2, "int4")
    chain = LocalChain(shards)
    local = [chain.generate_greedy(ids, MAX_TOKENS, ignore_eos=True).token_ids for ids in chat_prompt_ids]
    del chain
    fleet = fleet_factory(shards, 2, extra_stage_args=["--kv", "stateful"])
    got = _decode_all(fleet.coordinator, prompts, chat_prompt_ids)
    for i, (want, have) in enumerate(zip(local, got, strict=True)):
        assert have == want, f"prompt {i}: first difference at token {_first_diff(want, have)}"
