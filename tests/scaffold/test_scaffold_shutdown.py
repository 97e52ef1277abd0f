"""SIGTERM drains: a real server process finishes its in-flight call, refuses new ones, exits 0."""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pipeshard.v1 import stage_pb2, stage_pb2_grpc

SERVER_SCRIPT = Path(__file__).with_name("scaffold_server.py")
GRACE_SECONDS = 8.0
INFO_DELAY = 1.5


class ServerProcess:
    """The scaffold server as a child process; stdout lines arrive on a queue."""

    def __init__(self, *args: str):
        self.proc = subprocess.Popen(
            [sys.executable, str(SERVER_SCRIPT), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def expect(self, prefix: str, timeout: float = 20) -> str:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            if line.startswith(prefix):
                return line
        pytest.fail(f"no stdout line starting {prefix!r} within {timeout}s; rc={self.proc.poll()}")


@pytest.fixture
def server_process():
    server = ServerProcess(
        "--port", "0",
        "--grace-seconds", str(GRACE_SECONDS),
        "--info-delay", str(INFO_DELAY),
    )  # fmt: skip
    try:
        yield server
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait(5)


def _new_call_fails(address: str) -> bool:
    with grpc.insecure_channel(address) as ch:
        try:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=0.5)
        except grpc.RpcError as err:
            return err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    return False


def test_sigterm_drains_in_flight_call_then_exits_zero(server_process: ServerProcess):
    address = server_process.expect("scaffold listening on ").rsplit(" ", 1)[1]
    assert address.startswith("127.0.0.1:") and not address.endswith(":0")

    with grpc.insecure_channel(address) as ch:
        watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(), timeout=30)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING

        in_flight = stage_pb2_grpc.StageServiceStub(ch).GetStageInfo.future(
            stage_pb2.GetStageInfoRequest(), timeout=GRACE_SECONDS + 5
        )
        server_process.expect("GetStageInfo started")
        server_process.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()

        # Health watchers learn NOT_SERVING, then their stream ends (it does not hold the drain open).
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert list(watch) == []

        # New calls are refused while the in-flight one is still running.
        refused = False
        while not refused and time.monotonic() - signalled < INFO_DELAY / 2:
            refused = _new_call_fails(address)
        assert refused, "a new call still succeeded after SIGTERM"
        assert not in_flight.done(), "the in-flight call ended before new calls were refused"

        reply = in_flight.result()
        assert (reply.num_stages, reply.layer_end) == (2, 15)

    rc = server_process.proc.wait(timeout=GRACE_SECONDS)
    assert rc == 0
    assert time.monotonic() - signalled < GRACE_SECONDS  # exited once drained, not at the grace deadline
    assert server_process.proc.stderr is not None
    events = [
        json.loads(line) for line in server_process.proc.stderr.read().splitlines() if line.startswith("{")
    ]
    assert any(e["event"] == "signal received, draining" and e["signal"] == "SIGTERM" for e in events)
    assert any(e["event"] == "grpc server stopped" for e in events)
