"""A fleet whose stages cannot prove a configuration invariant falls back (issue 49): stages
forced to try ``bf16-kv8`` first (bf16 with ``fast``'s u8 cache and two-token rows, which a split
prompt tells apart from a whole one) fail its self-check and serve the next configuration,
``exact``; GetStageInfo, the coordinator's start log and ``pipeshard top``'s precision cell say
so, and the fleet answers."""

from __future__ import annotations

import grpc
import pytest

from pipeshard.clients.client import PipeshardClient
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
