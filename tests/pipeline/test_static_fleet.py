"""A fleet of static stages (a ``pipeshard export --static`` shard: the stages take the backend from
the manifest, no flag) in real processes, exact mode, INT4, one thread per stage: greedy tokens over
128 tokens equal the paged backend's; GetStageInfo reports the slots and the chunk; sessions up to
the slots share steps, a fifth waits for a slot, each gives its solo tokens; prompt-lookup
speculation (verify rows within the chunk) keeps the plain tokens."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from pipeshard.clients.client import PipeshardClient
from pipeshard.shard.prompting import Prompter
from pipeshard.v1 import stage_pb2, stage_pb2_grpc

pytestmark = pytest.mark.slow

TOKENS = 128


def _generate(address: str, prompt: str, tokens: int = TOKENS, **kw) -> list[int]:
    with PipeshardClient(address, timeout_s=600) as client:
        return client.generate(prompt, max_tokens=tokens, ignore_eos=True, **kw).token_ids


def _info(address: str) -> stage_pb2.GetStageInfoResponse:
    with grpc.insecure_channel(address) as channel:
        return stage_pb2_grpc.StageServiceStub(channel).GetStageInfo(
            stage_pb2.GetStageInfoRequest(), timeout=5
        )


@pytest.mark.timeout(3600)  # every static step computes its 4 x 16 rows; a loaded machine can pass 15 minutes
@pytest.mark.parametrize("stages", [pytest.param(n, marks=pytest.mark.extended) for n in (1, 2, 3)])
def test_static_fleet_greedy_equals_the_paged_backend_over_128_tokens(
    stages, smollm2_static_export, smollm2_export, fleet_factory, greedy_in_process, prompts
):
    export = smollm2_static_export(stages)
    fleet = fleet_factory(
        export,
        stages,
        precision="exact",
        extra_stage_args=["--num-threads", "1"],
        extra_coordinator_args=["--max-running", "8"],
    )
    for address in fleet.stages:
        info = _info(address)
        assert (info.kv_backend, info.static_slots, info.static_chunk) == ("static", 4, 16)
    chosen = list(prompts[:2])
    with ThreadPoolExecutor(len(chosen)) as pool:  # both rows share every step: one inference each
        got = list(pool.map(lambda p: _generate(fleet.coordinator, p), chosen))
    ids = [Prompter.from_dir(export).encode("", [("user", p)]) for p in chosen]
    assert got == greedy_in_process(smollm2_export(stages, "int4"), ids, TOKENS, "exact", 1)
    if stages != 2:
        return
    # Five sessions at once on four slots: the fifth waits for a slot (--max-running 8 is capped
    # at the slots); each gives the first tokens of its solo run.
    with ThreadPoolExecutor(5) as pool:
        five = list(pool.map(lambda p: _generate(fleet.coordinator, p, 8), prompts[:5]))
    assert five[:2] == [g[:8] for g in got]
    paged = smollm2_export(stages, "int4")
    assert five[2:] == greedy_in_process(paged, ids_of(export, prompts[2:5]), 8, "exact", 1)
    # Verify rows of prompt lookup (K = 3, within the 16-row chunk) keep the plain tokens.
    assert _generate(fleet.coordinator, chosen[0], 24, speculative="ngram", k=3) == got[0][:24]


def ids_of(export, prompts) -> list[list[int]]:
    prompter = Prompter.from_dir(export)
    return [prompter.encode("", [("user", p)]) for p in prompts]
