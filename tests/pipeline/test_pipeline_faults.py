"""A stage that goes down fails Generate with UNAVAILABLE naming it, within a deadline; it recovers."""

from __future__ import annotations

import os
import signal
import socket
import time

import grpc
import pytest

from pipeshard.clients.client import PipeshardClient
from pipeshard.services.launcher import spawn

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_stage_down_is_named_and_the_fleet_recovers(smollm2_export, fleet_factory):
    shards = smollm2_export(2, "int4")
    ports = [_free_port(), _free_port()]
    fleet = fleet_factory(shards, 2, stage_ports=ports, extra_coordinator_args=["--step-timeout-s", "5"])
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
        finally:
            stage1.popen.send_signal(signal.SIGCONT)
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
