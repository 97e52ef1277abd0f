"""A fleet whose stages cannot prove a configuration invariant falls back (issue 49): stages
forced to try ``bf16-kv8`` first (bf16 with ``fast``'s u8 cache and two-token rows, which a split
prompt tells apart from a whole one) fail its self-check and serve the next configuration,
``exact``; GetStageInfo, the coordinator's start log and ``pipeshard top``'s precision cell say
so, and the fleet answers. Stateful stages do the same on their own ladder (rows as they come),
and static stages prove the configuration they serve, keeping a user's tokens under load."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from pipeshard.clients.client import PipeshardClient
from pipeshard.precision import SINGLE_ROW_LADDER
from pipeshard.services.fleet_status import stage_row
from pipeshard.v1 import stage_pb2, stage_pb2_grpc

pytestmark = pytest.mark.slow


def stage_info(address: str) -> stage_pb2.GetStageInfoResponse:
    with grpc.insecure_channel(address) as channel:
        return stage_pb2_grpc.StageServiceStub(channel).GetStageInfo(
            stage_pb2.GetStageInfoRequest(), timeout=10
        )


def test_stages_that_fail_their_self_check_fall_back_and_say_so(smollm2_export, fleet_factory):
    fleet = fleet_factory(
        smollm2_export(2, "int4"),
        2,
        precision="invariant",
        extra_stage_args=["--invariant-ladder", "bf16-kv8,exact"],
    )
    for address in fleet.stages:
        info = stage_info(address)
        assert info.precision == "invariant" and info.configuration == "exact" and info.invariant
        assert info.invariant_fallback.startswith("bf16-kv8: self-check FAILED"), info.invariant_fallback
        assert info.self_check.startswith("self-check passed") and info.self_check_seconds > 0
        assert "fell back: bf16-kv8 failed the self-check" in stage_row(address).precision
    log = fleet.process("coordinator").log.read_text()
    assert "invariant_fallback" in log and "stage 1 serves exact: bf16-kv8" in log
    with PipeshardClient(fleet.coordinator, timeout_s=300) as client:
        answer = client.generate("Name a colour.", max_tokens=6, ignore_eos=True)
    assert len(answer.token_ids) == 6


def test_stateful_stages_fall_back_on_their_own_ladder_and_say_so(smollm2_export, fleet_factory):
    """bf16 rows fed as they come differ between a split prompt and a whole one on a stateful
    stage of this CPU: forced first, it fails, and each stage serves ``exact``, proven."""
    fleet = fleet_factory(
        smollm2_export(2, "int4"),
        2,
        precision="invariant",
        extra_stage_args=["--kv", "stateful", "--invariant-ladder", "bf16-kv16-single,exact"],
        timeout_s=600,  # two compiles and checks per stage, the stages one after another
    )
    for address in fleet.stages:
        info = stage_info(address)
        assert info.kv_backend == "stateful" and info.configuration == "exact" and info.invariant
        assert info.invariant_fallback.startswith("bf16-kv16-single: self-check FAILED")
        assert info.self_check.startswith("self-check passed") and "prompt split" in info.self_check
        assert "fell back: bf16-kv16-single failed the self-check" in stage_row(address).precision
    log = fleet.process("coordinator").log.read_text()
    assert "stage 1 serves exact: bf16-kv16-single" in log
    with PipeshardClient(fleet.coordinator, timeout_s=300) as client:
        answer = client.generate("Name a colour.", max_tokens=6, ignore_eos=True)
    assert len(answer.token_ids) == 6


def test_static_stages_prove_their_configuration_and_keep_each_users_tokens(
    smollm2_static_export, fleet_factory, prompts
):
    """At the default precision a static stage walks the single-row ladder and reports what it
    proved; when that is a bit-identity promise (on this CPU: bf16 rows as they come), three users
    sharing every step get the tokens each gets alone."""
    fleet = fleet_factory(smollm2_static_export(2), 2, extra_stage_args=["--num-threads", "1"], timeout_s=600)
    infos = [stage_info(address) for address in fleet.stages]
    for info in infos:
        assert info.kv_backend == "static" and info.precision == "invariant" and info.invariant
        assert info.configuration in SINGLE_ROW_LADDER and info.self_check.startswith("self-check passed")
    chosen = list(prompts[:3])

    def generate(prompt: str) -> list[int]:
        with PipeshardClient(fleet.coordinator, timeout_s=600) as client:
            return client.generate(prompt, max_tokens=12, ignore_eos=True).token_ids

    alone = [generate(p) for p in chosen]
    with ThreadPoolExecutor(len(chosen)) as pool:
        together = list(pool.map(generate, chosen))
    assert together == alone
