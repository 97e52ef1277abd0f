"""Real fleets: prompt size limits, long prompts, bad ids on the wire, graceful coordinator shutdown."""

from __future__ import annotations

import signal
import threading
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pipeshard.clients.client import PipeshardClient, build_request
from pipeshard.ownership import new_secret, owner_key, owner_metadata
from pipeshard.shard.prompting import Prompter
from pipeshard.tensor_codec import encode
from pipeshard.v1 import (
    activation_pb2,
    coordinator_pb2,
    coordinator_pb2_grpc,
    stage_pb2,
    stage_pb2_grpc,
    tensor_pb2,
)
from tests.pipeline.stage_probe import sessions_after_release

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fleet(default_fleet):
    return default_fleet


def test_an_oversized_prompt_is_refused_before_tokenizing(fleet):
    with PipeshardClient(fleet.coordinator, timeout_s=60) as client:
        with pytest.raises(grpc.RpcError) as info:
            client.generate("x" * (2 * 1024 * 1024), max_tokens=4)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (
            "`messages` is 2097" in info.value.details() and "limit of 262144 bytes" in info.value.details()
        )
        assert client.generate("Say hi.", max_tokens=4).completion_tokens == 4


def test_a_4000_token_prompt_is_served(fleet, smollm2_export):
    tokenizer = Prompter.from_dir(smollm2_export(2, "int4")).tokenizer
    text = " ".join(f"item{i % 97}" for i in range(1400))
    prompt_tokens = len(tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True))
    assert 3900 <= prompt_tokens <= 4080, prompt_tokens
    with PipeshardClient(fleet.coordinator, timeout_s=300) as client:
        result = client.generate(text, max_tokens=4)
    assert result.completion_tokens == 4 and result.prompt_tokens > 3900


@pytest.mark.parametrize(
    ("ids", "positions", "field"),
    [
        ([10**9], [0], "input_ids"),
        ([-5], [0], "input_ids"),
        ([1], [10**15], "positions"),
        ([1], [-100], "positions"),
    ],
)
def test_out_of_range_ids_and_positions_are_invalid_argument(fleet, ids, positions, field):
    with grpc.insecure_channel(fleet.stages[0]) as channel:
        stub = stage_pb2_grpc.StageServiceStub(channel)
        secret = new_secret()  # stages serve only the owner of a session (issue #14)
        owner = owner_metadata(secret)
        stub.OpenSession(stage_pb2.OpenSessionRequest(session_id="range"), timeout=10, metadata=owner)
        try:
            frame = activation_pb2.ActivationFrame(
                session_id="range",
                owner=owner_key(secret),
                positions=positions,
                plan=activation_pb2.PlanFrame(
                    rows=[
                        activation_pb2.PlanRow(
                            session_id="range", step_id=0, tokens=1, kind=activation_pb2.ROW_KIND_PREFILL
                        )
                    ]
                ),
                tensors=[
                    tensor_pb2.NamedTensor(name="input_ids", tensor=encode(np.asarray([ids], dtype=np.int64)))
                ],
            )
            (response,) = list(
                stub.Forward(iter([stage_pb2.ForwardRequest(frame=frame)]), timeout=10, metadata=owner)
            )
        finally:
            stub.ReleaseSession(
                stage_pb2.ReleaseSessionRequest(session_id="range"), timeout=10, metadata=owner
            )
    assert response.error.code == "INVALID_ARGUMENT"
    assert response.error.message.startswith(f"`{field}` must lie in [0, ")


def test_sigterm_drains_then_ends_the_rest_with_a_cancelled_summary(smollm2_export, fleet_factory):
    grace = 5
    fleet = fleet_factory(
        smollm2_export(2, "int4"), 2, extra_coordinator_args=["--grace-seconds", str(grace)]
    )
    finals: dict[str, coordinator_pb2.GenerateResponse] = {}
    streaming = threading.Barrier(3)

    def run(name: str, max_tokens: int) -> None:
        with grpc.insecure_channel(fleet.coordinator) as channel:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
            request = build_request("Tell me a long story.", max_tokens=max_tokens, ignore_eos=True)
            responses = stub.Generate(request, timeout=120)
            next(responses)
            streaming.wait()
            for response in responses:
                finals[name] = response

    threads = [
        threading.Thread(target=run, args=("short", 6)),
        threading.Thread(target=run, args=("long", 3000)),
    ]
    for t in threads:
        t.start()
    streaming.wait(timeout=120)
    coordinator = fleet.process("coordinator")
    coordinator.popen.send_signal(signal.SIGTERM)
    assert _until(lambda: _health(fleet.coordinator) == health_pb2.HealthCheckResponse.NOT_SERVING)
    with PipeshardClient(fleet.coordinator, timeout_s=30) as client, pytest.raises(grpc.RpcError) as info:
        client.generate("Say hi.", max_tokens=4)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    for t in threads:
        t.join(timeout=60)
    short, long = finals["short"].summary, finals["long"].summary
    assert short.finish_reason == coordinator_pb2.FINISH_REASON_LENGTH and short.completion_tokens == 6
    assert long.finish_reason == coordinator_pb2.FINISH_REASON_CANCELLED
    assert f"after its {grace} s grace" in long.error and 0 < long.completion_tokens < 3000
    assert coordinator.popen.wait(timeout=30) == 0
    assert sessions_after_release(fleet.stages, timeout_s=10) == [0, 0]


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status


def _until(condition, timeout_s: float = 30) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
