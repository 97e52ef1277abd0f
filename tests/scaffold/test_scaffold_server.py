"""The scaffold server in-process: health, error mapping for every handler kind, request ids, metrics."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY
from scaffold_harness import ThreadedServer
from scaffold_servicer import ScaffoldStage

from pipeshard.grpc_server import GrpcServer
from pipeshard.logs import configure_logging
from pipeshard.metrics import start_metrics_server
from pipeshard.v1 import activation_pb2, stage_pb2, stage_pb2_grpc

STAGE_SERVICE = "pipeshard.v1.StageService"
TIMEOUT = 5


def _rpc_count(method: str, code: str) -> float:
    labels = {"service": STAGE_SERVICE, "method": method, "code": code}
    return REGISTRY.get_sample_value("pipeshard_rpc_requests_total", labels) or 0.0


def _wait_count(method: str, code: str, expected: float) -> float:
    """The counter once it reaches ``expected`` (a servicer's own abort() sends the status before the
    interceptor records it, so the client can be a moment ahead), else its value after 2 s."""
    deadline = time.monotonic() + 2
    while (value := _rpc_count(method, code)) < expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return value


def _assert_still_serving(stage) -> None:
    info = stage.GetStageInfo(stage_pb2.GetStageInfoRequest(), timeout=TIMEOUT)
    assert (info.num_stages, info.layer_end) == (2, 15)


def _forward(stage, session_ids, metadata=()):
    frames = (
        stage_pb2.ForwardRequest(frame=activation_pb2.ActivationFrame(session_id=sid, step_id=i))
        for i, sid in enumerate(session_ids)
    )
    return stage.Forward(frames, timeout=TIMEOUT, metadata=metadata)


# ---------------------------------------------------------------- health and registration


def test_health_reports_serving_for_server_and_each_service(scaffold_server: GrpcServer, channel):
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", STAGE_SERVICE):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
    with pytest.raises(grpc.RpcError) as err:
        health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=TIMEOUT)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_port_in_use_fails_loudly(scaffold_server: GrpcServer):
    clash = ThreadedServer(
        [(stage_pb2_grpc.add_StageServiceServicer_to_server, ScaffoldStage())], port=scaffold_server.port
    )
    try:
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{scaffold_server.port}"):
            clash.start()
    finally:
        clash.stop()


def test_port_zero_binds_an_ephemeral_port_and_names_are_derived(scaffold_server: GrpcServer):
    assert scaffold_server.port > 0
    assert scaffold_server.address == f"127.0.0.1:{scaffold_server.port}"
    assert scaffold_server.service_names == [STAGE_SERVICE]


# ---------------------------------------------------------------- unary errors


@pytest.mark.parametrize(
    ("session_id", "code", "message"),
    [
        ("", grpc.StatusCode.INVALID_ARGUMENT, "`session_id` must not be empty"),
        ("missing", grpc.StatusCode.NOT_FOUND, "session 'missing' not found"),
        ("boom", grpc.StatusCode.INTERNAL, "internal error: RuntimeError"),
        ("slow", grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded"),
        ("abort", grpc.StatusCode.FAILED_PRECONDITION, "aborted by the servicer"),
    ],
)
def test_unary_errors_map_to_codes(stage, session_id, code, message):
    before = _rpc_count("OpenSession", code.name)
    with pytest.raises(grpc.RpcError) as err:
        stage.OpenSession(stage_pb2.OpenSessionRequest(session_id=session_id), timeout=TIMEOUT)
    assert err.value.code() == code
    assert message in err.value.details()
    assert _wait_count("OpenSession", code.name, before + 1) == before + 1
    _assert_still_serving(stage)


def test_internal_error_hides_the_exception_text(stage):
    with pytest.raises(grpc.RpcError) as err:
        stage.OpenSession(stage_pb2.OpenSessionRequest(session_id="boom"), timeout=TIMEOUT)
    assert err.value.details() == "internal error: RuntimeError"
    assert "secret" not in err.value.details() and "Traceback" not in err.value.details()


def test_unary_success_is_counted_ok(stage):
    before = _rpc_count("OpenSession", "OK")
    reply = stage.OpenSession(stage_pb2.OpenSessionRequest(session_id="s1"), timeout=TIMEOUT)
    assert reply.max_context == 2048
    assert _rpc_count("OpenSession", "OK") == before + 1
    labels = {"service": STAGE_SERVICE, "method": "OpenSession"}
    assert (REGISTRY.get_sample_value("pipeshard_rpc_duration_seconds_count", labels) or 0) >= 1


# ---------------------------------------------------------------- streaming errors


STREAM_CASES = [
    ("", grpc.StatusCode.INVALID_ARGUMENT, "`subscriber_id` must not be empty"),
    ("missing", grpc.StatusCode.NOT_FOUND, "not found"),
    ("boom", grpc.StatusCode.INTERNAL, "internal error: RuntimeError"),
]


@pytest.mark.parametrize("style", ["", "write-"])
@pytest.mark.parametrize(("subscriber", "code", "message"), STREAM_CASES)
def test_server_streaming_error_after_first_message(stage, style, subscriber, code, message):
    stream = stage.Results(stage_pb2.ResultsRequest(subscriber_id=style + subscriber), timeout=TIMEOUT)
    first = next(stream)
    assert first.result.step_id == 1
    with pytest.raises(grpc.RpcError) as err:
        next(stream)
    assert err.value.code() == code
    assert message in err.value.details()
    _assert_still_serving(stage)


@pytest.mark.parametrize("style", ["", "write-"])
def test_server_streaming_success(stage, style):
    before = _rpc_count("Results", "OK")
    steps = [r.result.step_id for r in stage.Results(stage_pb2.ResultsRequest(subscriber_id=style + "ok"))]
    assert steps == [1, 2]
    assert _rpc_count("Results", "OK") == before + 1


def test_client_cancel_closes_the_servicer_stream(stage, scaffold_servicer):
    before = _rpc_count("Results", "CANCELLED")
    stream = stage.Results(stage_pb2.ResultsRequest(subscriber_id="hang"), timeout=TIMEOUT)
    assert next(stream).result.step_id == 1
    stream.cancel()
    assert _wait_count("Results", "CANCELLED", before + 1) == before + 1
    assert "hang" in scaffold_servicer.closed_streams  # its finally block ran: cleanup is not skipped
    _assert_still_serving(stage)


@pytest.mark.parametrize(
    ("bad", "code", "message"),
    [
        ("", grpc.StatusCode.INVALID_ARGUMENT, "`frame.session_id` must not be empty"),
        ("missing", grpc.StatusCode.NOT_FOUND, "not found"),
        ("boom", grpc.StatusCode.INTERNAL, "internal error: RuntimeError"),
    ],
)
def test_bidi_stream_error_after_first_frame(stage, bad, code, message):
    before = _rpc_count("Forward", code.name)
    replies = _forward(stage, ["s1", bad, "never-sent"])
    assert next(replies).session_id == "s1"
    with pytest.raises(grpc.RpcError) as err:
        next(replies)
    assert err.value.code() == code
    assert message in err.value.details()
    assert _rpc_count("Forward", code.name) == before + 1
    assert [r.step_id for r in _forward(stage, ["a", "b"])] == [0, 1]


# ---------------------------------------------------------------- an extra (auth-like) interceptor


def test_inner_interceptor_refusal_is_mapped(stage):
    deny = (("x-deny", "1"),)
    with pytest.raises(grpc.RpcError) as err:
        stage.GetStageInfo(stage_pb2.GetStageInfoRequest(), timeout=TIMEOUT, metadata=deny)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "`authorization`" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        list(_forward(stage, ["s1"], metadata=deny))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    _assert_still_serving(stage)


# ---------------------------------------------------------------- request ids in logs


def test_request_id_from_metadata_is_bound_in_servicer_logs(stage, restore_logging):
    out = io.StringIO()
    configure_logging("json", "info", service="scaffold-test", stream=out)
    try:
        stage.OpenSession(
            stage_pb2.OpenSessionRequest(session_id="s-logged"),
            timeout=TIMEOUT,
            metadata=(("x-request-id", "req-123"),),
        )
        with pytest.raises(grpc.RpcError):
            stage.OpenSession(stage_pb2.OpenSessionRequest(session_id=""), timeout=TIMEOUT)
    finally:
        configure_logging("json", "warning", stream=io.StringIO())  # stop writing to `out` at once
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    opened = [line for line in lines if line["event"] == "session opened"]
    assert len(opened) == 1
    assert opened[0]["request_id"] == "req-123"
    assert opened[0]["session_id"] == "s-logged"
    assert opened[0]["rpc"] == f"{STAGE_SERVICE}/OpenSession"
    assert opened[0]["service"] == "scaffold-test"
    errors = [line for line in lines if line["event"] == "rpc error"]
    assert len(errors) == 1 and errors[0]["code"] == "INVALID_ARGUMENT"
    assert len(errors[0]["request_id"]) == 32  # generated (uuid4 hex) when the caller sent none


# ---------------------------------------------------------------- metrics endpoint


def test_metrics_server_serves_rpc_metrics_and_zero_disables(stage):
    assert start_metrics_server(0) is None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    metrics = start_metrics_server(port)
    assert metrics is not None
    try:
        _assert_still_serving(stage)
        body = urllib.request.urlopen(f"http://127.0.0.1:{metrics.port}/metrics", timeout=5).read().decode()
    finally:
        metrics.close()
    assert (
        'pipeshard_rpc_requests_total{code="OK",method="GetStageInfo",service="pipeshard.v1.StageService"}'
        in body
    )
    assert "pipeshard_rpc_duration_seconds_bucket" in body


# ---------------------------------------------------------------- requests that do not parse


def _bad_utf8(message) -> bytes:
    """``message`` serialized with its last string byte replaced by an invalid UTF-8 byte."""
    data = bytearray(message.SerializeToString())
    data[-1] = 0xFF
    return bytes(data)


def test_invalid_utf8_is_invalid_argument_for_unary_and_streaming_calls(scaffold_server, channel, stage):
    unary = channel.unary_unary(f"/{STAGE_SERVICE}/OpenSession")
    with pytest.raises(grpc.RpcError) as err:
        unary(_bad_utf8(stage_pb2.OpenSessionRequest(session_id="s")), timeout=TIMEOUT)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "`request` cannot be parsed" in err.value.details() and "UTF-8" in err.value.details()
    streaming = channel.stream_stream(f"/{STAGE_SERVICE}/Forward")
    bad_frame = stage_pb2.ForwardRequest(frame=activation_pb2.ActivationFrame(session_id="s"))
    with pytest.raises(grpc.RpcError) as err:
        list(streaming(iter([_bad_utf8(bad_frame)]), timeout=TIMEOUT))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    _assert_still_serving(stage)


def test_the_container_healthcheck_probes_grpc_health(scaffold_server):
    script = Path(__file__).resolve().parents[2] / "docker" / "healthcheck.py"

    def probe(port: int) -> subprocess.CompletedProcess:
        env = {**os.environ, "PIPESHARD_PORT": str(port)}
        return subprocess.run(
            [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=30
        )

    up = probe(scaffold_server.port)
    assert up.returncode == 0 and "SERVING" in up.stdout
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    down = probe(free)
    assert down.returncode == 1 and "UNAVAILABLE" in down.stderr
