"""Warm-up before SERVING: every stage runs inferences and the coordinator a whole generation
before its server starts (so before grpc.health reports SERVING and before the launcher returns).
Checked from each process's own log order, not from timings."""

from __future__ import annotations

import json

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fleet(default_fleet):
    return default_fleet


def _events(log_path) -> list[dict]:
    events = []
    for line in log_path.read_text().splitlines():
        if line.startswith("{"):
            events.append(json.loads(line))
    return events


def _first(events: list[dict], name: str) -> int:
    return next(i for i, e in enumerate(events) if e.get("event") == name)


def test_every_service_reports_serving_once_the_launcher_returns(fleet):
    for proc in fleet.processes:
        with grpc.insecure_channel(proc.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, proc.name


def test_stages_run_warmup_inferences_before_their_server_starts(fleet):
    stages = [p for p in fleet.processes if p.name.startswith("stage")]
    assert len(stages) == 2
    for proc in stages:
        events = _events(proc.log)
        warm = _first(events, "warmup done")
        assert events[warm]["inferences"] >= 3  # a prefill, a multi-row step on a filled cache, decode
        assert warm < _first(events, "grpc server started"), proc.name


def test_coordinator_generates_through_the_ring_before_its_server_starts(fleet):
    (coordinator,) = [p for p in fleet.processes if p.name == "coordinator"]
    events = _events(coordinator.log)
    warm = _first(events, "warmup done")
    assert events[warm]["tokens"] == 2 and events[warm]["prompt_tokens"] > 0
    assert warm < _first(events, "grpc server started")
