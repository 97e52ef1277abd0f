"""A fleet of paged stages (``--kv paged``) with a batching coordinator: concurrent sessions share
each step through plan frames and still give their solo tokens (exact mode, INT4, 1 thread per
stage; the coordinator's default keeps one batch in flight per stage, so two plan frames travel
the stages at once) and the tokens of ``generate --local --kv paged``; GetStageInfo reports the cache budget;
a cancelled stream's blocks are freed on every stage; a request the budget cannot hold is refused."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from pipeshard.clients.client import PipeshardClient
from pipeshard.services.coordinator.generation import Generation
from pipeshard.services.coordinator.in_process import batched_ring
from pipeshard.services.coordinator.sampling import SamplingParams
from pipeshard.services.coordinator.speculation.sources import DraftSources
from pipeshard.shard.prompting import Prompter
from pipeshard.v1 import stage_pb2, stage_pb2_grpc

pytestmark = pytest.mark.slow

TOKENS = 32
BUDGET = 64 << 20  # 91 blocks of 32 tokens per stage


@pytest.fixture(scope="module")
def export(smollm2_export):
    return smollm2_export(2, "int4")


@pytest.fixture(scope="module")
def fleet(export, fleet_factory):
    return fleet_factory(
        export,
        2,
        precision="exact",
        extra_stage_args=["--kv", "paged", "--num-threads", "1", "--kv-cache-bytes", str(BUDGET)],
        extra_coordinator_args=["--kv", "paged", "--max-running", "8", "--inflight", "0"],
    )


def _generate(address: str, prompt: str, tokens: int = TOKENS) -> list[int]:
    with PipeshardClient(address, timeout_s=300) as client:
        return client.generate(prompt, max_tokens=tokens, ignore_eos=True).token_ids


def _info(address: str) -> stage_pb2.GetStageInfoResponse:
    with grpc.insecure_channel(address) as channel:
        return stage_pb2_grpc.StageServiceStub(channel).GetStageInfo(
            stage_pb2.GetStageInfoRequest(), timeout=5
        )


def _used_after_release(addresses: list[str], timeout_s: float = 30) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(_info(a).kv_cache_used_bytes for a in addresses):
        time.sleep(0.2)
    return [_info(a).kv_cache_used_bytes for a in addresses]


def test_concurrent_sessions_share_steps_and_keep_their_solo_tokens(
    fleet, export, greedy_in_process, prompts
):
    chosen = list(prompts[:6])
    solo = [_generate(fleet.coordinator, p) for p in chosen]
    with ThreadPoolExecutor(len(chosen)) as pool:
        together = list(pool.map(lambda p: _generate(fleet.coordinator, p), chosen))
    assert together == solo
    # `generate --local --kv paged` (the in-process batched ring) gives the fleet's tokens.
    prompter = Prompter.from_dir(export)
    ids = [prompter.encode("", [("user", prompt)]) for prompt in chosen[:2]]
    assert greedy_in_process(export, ids, TOKENS, "exact", 1, cache_bytes=BUDGET) == solo[:2]


def test_stage_info_reports_the_budget_and_a_cancel_frees_every_stage(fleet, prompts):
    for i, address in enumerate(fleet.stages):
        info = _info(address)
        assert (info.kv_backend, info.kv_cache_budget_bytes, info.kv_block_tokens) == ("paged", BUDGET, 32), i
        assert info.device == "CPU", i
    with PipeshardClient(fleet.coordinator, timeout_s=300) as client:
        call = client.responses(prompts[2], max_tokens=200, ignore_eos=True)
        for n, _ in enumerate(call):
            if n == 3:
                held = [_info(a).kv_cache_used_bytes for a in fleet.stages]
                call.cancel()
                break
    assert all(h > 0 for h in held)
    assert _used_after_release(fleet.stages) == [0, 0]


def test_a_burst_beyond_the_callers_kv_share_waits_in_the_queue_instead_of_being_refused(fleet):
    """Each stage lets this coordinator hold 45 of its 91 blocks; eight ~530-token prompts need
    ~18 blocks each, so only two fit at once although --max-running is 8. The scheduler keeps the
    rest queued (a stage refused six of them before it mirrored the budget); all complete."""
    for address in fleet.stages:
        info = _info(address)
        assert (info.kv_cache_blocks, info.kv_owner_share_blocks, info.max_sessions_per_owner) == (91, 45, 32)
    prompts = [
        f"Request {i}. Repeat these numbers: " + " ".join(str(n) for n in range(150)) for i in range(8)
    ]

    def run(prompt: str) -> tuple[int, int]:
        with PipeshardClient(fleet.coordinator, timeout_s=300) as client:
            result = client.generate(prompt, max_tokens=8, ignore_eos=True)
            return result.prompt_tokens, result.completion_tokens

    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(run, prompts))
    assert all(500 < prompt_tokens < 560 and done == 8 for prompt_tokens, done in results), results
    assert _used_after_release(fleet.stages) == [0, 0]


def test_a_request_beyond_the_budget_is_refused_naming_it(fleet, prompts):
    with pytest.raises(grpc.RpcError) as err:
        _generate(fleet.coordinator, prompts[0], tokens=3500)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "KV cache budget" in err.value.details()
    assert _generate(fleet.coordinator, prompts[0], tokens=4) == _generate(fleet.coordinator, prompts[0])[:4]


def test_speculating_and_sampled_sessions_share_steps_and_keep_their_solo_tokens(fleet, export, prompts):
    """Verify rows (prompt lookup, fixed and adaptive K) and rows the paged final stage samples
    (RETURN_MODE_SAMPLED per plan row) ride in shared steps: each session gives its solo tokens,
    and a seed draws on the stage what the coordinator draws from logits."""
    # (prompt, temperature, seed, draft source, K)
    plans = [
        (prompts[1], 0.0, None, "ngram", 3),
        (prompts[2], 0.0, None, "ngram", 0),
        (prompts[4], 0.8, 3, "ngram", 2),
        (prompts[7], 0.8, 4, "none", 0),
    ]

    def generate(i: int) -> list[int]:
        prompt, temperature, seed, mode, k = plans[i]
        with PipeshardClient(fleet.coordinator, timeout_s=300) as client:
            return client.generate(
                prompt,
                max_tokens=TOKENS,
                temperature=temperature,
                seed=seed,
                ignore_eos=True,
                speculative=mode,
                k=k,
            ).token_ids

    solo = [generate(i) for i in range(len(plans))]
    with ThreadPoolExecutor(len(plans)) as pool:
        together = list(pool.map(generate, range(len(plans))))
    assert together == solo
    # The sampled sessions drawn at the coordinator from logits (in-process, same backend).
    prompter = Prompter.from_dir(export)
    ring = batched_ring(export, "exact", 1, cache_bytes=BUDGET)

    async def local(i: int) -> list[int]:
        prompt, temperature, seed, mode, k = plans[i]
        generation = Generation(
            ring,
            prompter.tokenizer,
            prompter.eos_ids,
            prefill_chunk=ring.prefill_chunk,
            drafts=DraftSources(export),
            final_stage_sampling=False,
        )
        params = SamplingParams(max_tokens=TOKENS, temperature=temperature, seed=seed, ignore_eos=True)
        ids = prompter.encode("", [("user", prompt)])
        events = [e async for e in generation.run(ids, params, speculative=mode, k=k)]
        return events[-1].token_ids

    assert [asyncio.run(local(i)) for i in (2, 3)] == solo[2:]
