"""`pipeshard profile` on a tiny real model: probe stages exported and timed, a node description
that `pipeshard plan` reads, and the link to a real gRPC health server."""

from __future__ import annotations

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2_grpc

from pipeshard.cli import main
from pipeshard.errors import InvalidArgument
from pipeshard.planning.nodes import parse_node
from pipeshard.planning.profile import measure_link

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny6(tmp_path_factory):
    """A random 6-layer Llama (profiling cuts a model to 5 layers)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    folder = tmp_path_factory.mktemp("tiny6")
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture
def health_server():
    server = grpc.server(__import__("concurrent.futures").futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0)


def test_profile_writes_a_node_description(tiny6, tmp_path, health_server):
    # 2 threads: OpenVINO 2026.4.1 dies of SIGFPE compiling this tiny model's first probe at 1
    # thread (SmolLM2's stages compile at 1 thread)
    out = tmp_path / "node.yaml"
    argv = ["profile", "--model", str(tiny6), "--weights", "fp32", "--threads", "2", "--name", "box"]
    argv += [
        "--rows",
        "1,2",
        "--contexts",
        "16,64",
        "--prefill",
        "16",
        "--peer",
        health_server,
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    raw = yaml.safe_load(out.read_text())
    node = parse_node(raw, "node")  # a profile is a valid node entry as it stands
    assert node.name == "box" and node.memory_bytes > 0 and node.device == raw["device"] == "CPU"
    assert sorted(raw["per_layer_ms"]) == [1, 2] and all(v >= 0 for v in raw["per_layer_ms"].values())
    measured = raw["measured"]
    assert measured["threads"] == 2 and measured["weights"] == "fp32"
    assert [(d["rows"], d["context"]) for d in measured["decode"]] == [(1, 16), (1, 64), (2, 16), (2, 64)]
    assert [p["tokens"] for p in measured["prefill"]] == [16]
    # fp32 weights: a layer is its parameter count x 4 bytes, give or take the norms' few bytes
    params = 64 * (64 + 32 + 32 + 64) + 3 * 64 * 128
    assert params * 4 <= measured["layer_bytes"] <= params * 4 + 1024
    assert measured["embed_bytes"] == pytest.approx(
        256 * 64 * 4, rel=0.01
    )  # the probes differ in small constants too
    assert raw["link_to_next"]["rtt_ms"] > 0 and raw["link_to_next"]["mbit"] > 0


def test_link_to_nothing_is_a_clear_error():
    with pytest.raises(InvalidArgument, match="nothing answers") as info:
        measure_link("127.0.0.1:1", reps=1, connect_timeout_s=1.0)
    assert info.value.field == "peer"
