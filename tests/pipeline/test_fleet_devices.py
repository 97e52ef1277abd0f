"""A fleet whose stages each name their OpenVINO device (``start_fleet(devices=...)``, as
``make up DEVICE=...`` and the topology do): every stage compiles for its own device, reports it
in GetStageInfo, and the fleet serves."""

from __future__ import annotations

import grpc
import pytest

from pipeshard.clients.client import PipeshardClient
from pipeshard.v1 import stage_pb2, stage_pb2_grpc

pytestmark = pytest.mark.slow


def test_each_stage_runs_on_the_device_it_was_given(smollm2_export, fleet_factory, prompts):
    devices = ["AUTO:CPU", "HETERO:CPU"]  # virtual devices over the one CPU this machine has
    fleet = fleet_factory(smollm2_export(2, "int4"), 2, devices=devices)
    reported = []
    for address in fleet.stages:
        with grpc.insecure_channel(address) as channel:
            stub = stage_pb2_grpc.StageServiceStub(channel)
            reported.append(stub.GetStageInfo(stage_pb2.GetStageInfoRequest(), timeout=5).device)
    assert reported == devices
    with PipeshardClient(fleet.coordinator, timeout_s=120) as client:
        assert len(client.generate(prompts[0], max_tokens=4, ignore_eos=True).token_ids) == 4
