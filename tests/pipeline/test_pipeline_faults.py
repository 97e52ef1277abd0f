"""A stage that goes down fails Generate with UNAVAILABLE naming it, within a deadline; it recovers."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pipeshard.clients.client import PipeshardClient
from pipeshard.services.launcher import spawn
from tests.pipeline.stage_probe import live_sessions

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_stage_down_is_named_and_the_fleet_recovers(smollm2_export, fleet_factory):
    shards = smollm2_export(2, "int4")
    ports = [_free_port(), _free_port()]
    # Short step and control deadlines: the frozen stage below is named within seconds.
    args = ["--step-timeout-s", "5", "--control-timeout-s", "5"]
    fleet = fleet_factory(shards, 2, stage_ports=ports, extra_coordinator_args=args)
    with PipeshardClient(fleet.coordinator, timeout_s=60) as client:
        assert client.generate("Say hi.", max_tokens=4).completion_tokens == 4
        # A stage that stops answering (frozen, sockets still open) is named too.
        stage1 = fleet.process("stage1")
        stage1.popen.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(grpc.RpcError) as info:
                client.generate("Say hi.", max_tokens=4)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "stage 1" in info.value.details()
            # The stage that still answers has freed the session; health reports the frozen one.
            assert _until(lambda: live_sessions(fleet.stages[0]) == 0)
            assert _until(lambda: _health(fleet.coordinator) == [NOT_SERVING, NOT_SERVING])
        finally:
            stage1.popen.send_signal(signal.SIGCONT)
        # Thawed, it answers again: it is sent the release it missed and health returns.
        assert _until(lambda: live_sessions(fleet.stages[1]) == 0)
        assert _until(lambda: _health(fleet.coordinator) == [SERVING, SERVING])
        _until_served(client)
        stage1.popen.kill()
        stage1.popen.wait()
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            client.generate("Say hi.", max_tokens=4)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "stage 1" in info.value.details()
        assert time.monotonic() - started < 30
        args = ["stage", "--stage", "1", "--shards", str(shards), "--port", str(ports[1])]
        fleet.processes[fleet.processes.index(stage1)] = spawn(
            "stage1", args, fleet.run_dir, dict(os.environ), 120
        )
        _until_served(client)


def test_killed_stage_ends_every_stream_at_once(smollm2_export, fleet_factory):
    """kill -9 of a stage mid-generation: every stream ends UNAVAILABLE naming it, long before the
    30 s step timeout; the other stage frees the sessions, health follows, the fleet recovers."""
    shards = smollm2_export(2, "int4")
    ports = [_free_port(), _free_port()]
    fleet = fleet_factory(shards, 2, stage_ports=ports)  # the default 30 s step timeout
    errors: list[grpc.RpcError] = []
    started = threading.Barrier(4)

    def stream() -> None:
        with PipeshardClient(fleet.coordinator, timeout_s=120) as client:
            # three such requests fit this coordinator's share of the f32 KV pool at once (3 x 33 of
            # 182 blocks); at 2000 tokens the scheduler would queue the third until the others finish
            chunks = client.stream("Tell me a long story.", max_tokens=1000, ignore_eos=True)
            try:
                next(chunks)
                started.wait()
                for _ in chunks:
                    pass
            except grpc.RpcError as exc:
                errors.append(exc)

    threads = [threading.Thread(target=stream) for _ in range(3)]
    for t in threads:
        t.start()
    started.wait(timeout=120)
    assert live_sessions(fleet.stages[1]) == 3
    stage0 = fleet.process("stage0")
    stage0.popen.kill()
    killed = time.monotonic()
    for t in threads:
        t.join(timeout=60)
    took = time.monotonic() - killed
    assert len(errors) == 3
    for exc in errors:
        assert exc.code() == grpc.StatusCode.UNAVAILABLE
        assert f"stage 0 at 127.0.0.1:{ports[0]}" in exc.details()
    assert took < 10, f"streams ended {took:.1f} s after the kill (step timeout 30 s)"
    assert _until(lambda: live_sessions(fleet.stages[1]) == 0, timeout_s=10)
    assert _health(fleet.coordinator) == [NOT_SERVING, NOT_SERVING]
    stage0.popen.wait()
    args = ["stage", "--stage", "0", "--shards", str(shards), "--port", str(ports[0])]
    args += ["--next-hop", fleet.stages[1]]
    fleet.processes[fleet.processes.index(stage0)] = spawn(
        "stage0", args, fleet.run_dir, dict(os.environ), 120
    )
    assert _until(lambda: _health(fleet.coordinator) == [SERVING, SERVING], timeout_s=30)
    with PipeshardClient(fleet.coordinator, timeout_s=60) as client:
        assert client.generate("Say hi.", max_tokens=4).completion_tokens == 4


def _health(address: str) -> list[int]:
    """The coordinator's health for "" and its service."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return [
            stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status
            for name in ("", "pipeshard.v1.CoordinatorService")
        ]


def _until(condition, timeout_s: float = 60) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _until_served(client: PipeshardClient, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            assert client.generate("Say hi.", max_tokens=4).completion_tokens == 4
            return
        except grpc.RpcError as exc:
            if time.monotonic() > deadline:
                raise AssertionError(f"the fleet did not recover: {exc.details()}") from exc
            time.sleep(1)
