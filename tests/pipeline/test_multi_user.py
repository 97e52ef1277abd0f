"""Many users at once on the stateful backend (`--kv stateful`): every session has its own state,
so each session's output is its solo output even at `fast` (pinned here); admission control at
capacity. The default paged backend batches sessions into one inference, exact at `exact` only:
tests/pipeline/test_paged_fleet.py."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from pipeshard.clients.client import PipeshardClient

pytestmark = pytest.mark.slow

TOKENS = 128


@pytest.fixture(scope="module")
def fleet(smollm2_export, fleet_factory):
    # A small prefill chunk so every prompt is prefilled in several chunks while others decode.
    return fleet_factory(
        smollm2_export(2, "int4"),
        2,
        precision="fast",
        extra_stage_args=["--kv", "stateful"],
        extra_coordinator_args=["--prefill-chunk", "16", "--max-running", "4"],
    )


def _generate(address: str, prompt: str, speculative: str = "none", k: int = 0) -> list[int]:
    with PipeshardClient(address, timeout_s=300) as client:
        return client.generate(
            prompt, max_tokens=TOKENS, ignore_eos=True, speculative=speculative, k=k
        ).token_ids


def test_concurrent_sessions_match_their_solo_runs(fleet, prompts):
    chosen = [prompts[0], prompts[0], prompts[0], prompts[1], prompts[4], prompts[6]]
    solo = {p: _generate(fleet.coordinator, p) for p in dict.fromkeys(chosen)}
    with ThreadPoolExecutor(len(chosen)) as pool:
        together = list(pool.map(lambda p: _generate(fleet.coordinator, p), chosen))
    for prompt, tokens in zip(chosen, together, strict=True):
        assert tokens == solo[prompt], f"{prompt!r} changed when run beside others"


@pytest.mark.extended
def test_concurrent_speculative_sessions_match_their_solo_runs(fleet, prompts):
    """Each session runs its own speculative loop at a fixed K: neighbours, speculative or not,
    cannot change its output (at `fast` too: every session has its own state)."""
    jobs = [
        (prompts[2], "ngram", 3),
        (prompts[2], "ngram", 3),
        (prompts[3], "ngram", 5),
        (prompts[3], "none", 0),
        (prompts[5], "ngram", 1),
    ]
    solo = {job: _generate(fleet.coordinator, *job) for job in dict.fromkeys(jobs)}
    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(lambda job: _generate(fleet.coordinator, *job), jobs))
    for job, tokens in zip(jobs, together, strict=True):
        assert tokens == solo[job], f"{job} changed when run beside others"


def test_full_coordinator_refuses_and_queued_deadline_is_honoured(smollm2_export, fleet_factory):
    fleet = fleet_factory(
        smollm2_export(2, "int4"), 2, extra_coordinator_args=["--max-running", "1", "--max-queue", "1"]
    )
    with PipeshardClient(fleet.coordinator, timeout_s=120) as client:
        running = client.responses("Write a long story.", max_tokens=400, ignore_eos=True)
        next(running)
        with ThreadPoolExecutor(1) as pool:
            queued = pool.submit(lambda: client.generate("Say hi.", max_tokens=4))
            time.sleep(1.0)
            with pytest.raises(grpc.RpcError) as info:
                client.generate("Say hi.", max_tokens=4)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_queue 1" in info.value.details()
            running.cancel()
            assert queued.result(timeout=120).completion_tokens == 4
        running = client.responses("Write a long story.", max_tokens=400, ignore_eos=True)
        next(running)
        with (
            PipeshardClient(fleet.coordinator, timeout_s=1.0) as impatient,
            pytest.raises(grpc.RpcError) as info,
        ):
            impatient.generate("Say hi.", max_tokens=4)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        running.cancel()
