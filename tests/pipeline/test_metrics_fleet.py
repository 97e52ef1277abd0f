"""Every service of a real loopback fleet serves Prometheus metrics, and they move with the work:
tokens counted as streamed, one TTFT and n-1 inter-token observations per request, per-stage
steps and rows, live sessions and cache use while a request runs, speculative drafted/accepted."""

from __future__ import annotations

import socket

import pytest

from pipeshard.clients.client import GenerateResult, PipeshardClient, fold
from pipeshard.services.fleet_status import Scrape, scrape
from tests.pipeline.stage_probe import sessions_after_release

pytestmark = pytest.mark.slow

TOKENS = 48  # long enough that the mid-stream scrapes below land while it runs, even under load
NAMES = ("exporter", "stage0", "stage1", "coordinator", "gateway")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def fleet(smollm2_export, fleet_factory):
    ports = {name: _free_port() for name in NAMES}
    started = fleet_factory(
        smollm2_export(2, "int4"), 2, exporter_port=0, gateway_port=0, metrics_ports=ports
    )
    started.metrics_ports = ports
    return started


def metrics(fleet, name: str) -> Scrape:
    page = scrape("127.0.0.1", fleet.metrics_ports[name])
    assert page is not None, f"{name} serves no /metrics"
    return page


def delta(after: Scrape, before: Scrape, name: str, **labels: str) -> float:
    return after.value(name, **labels) - before.value(name, **labels)


def test_every_service_serves_pipeshard_metrics(fleet):
    for name in NAMES:
        assert any(n.startswith("pipeshard_") for n, _ in metrics(fleet, name).samples), name


def test_a_generation_moves_the_token_step_and_cache_metrics(fleet, prompts):
    coordinator0 = metrics(fleet, "coordinator")
    stages0 = [metrics(fleet, f"stage{k}") for k in range(2)]
    result = GenerateResult()
    with PipeshardClient(fleet.coordinator, timeout_s=300) as client:
        stream = client.responses(prompts[1], max_tokens=TOKENS, ignore_eos=True)
        fold(result, next(stream))  # the first chunk: the session is open on every stage
        page = metrics(fleet, "coordinator")  # first: the coordinator counts it running until its last step
        during = [metrics(fleet, f"stage{k}") for k in range(2)]
        users = page.value("pipeshard_coordinator_running_requests")
        # a plaintext loopback caller without a token is recognised by its host, labelled by its
        # kind alone (no host, no key name) unless --metrics-identity-labels names
        identity_users = page.value("pipeshard_coordinator_running_requests_by_identity", identity="peer")
        for response in stream:
            fold(result, response)
    assert result.completion_tokens == len(result.token_ids) == TOKENS
    assert users == identity_users == 1
    for k, page in enumerate(during):
        label = {"stage": str(k)}
        assert page.value("pipeshard_stage_sessions", **label) == 1
        positions = page.value("pipeshard_stage_cache_positions", **label)
        assert positions >= result.prompt_tokens
        # 15 layers x K and V x 3 KV heads x 64 x the KV element size (1 to 4 bytes) per position;
        # a paged u8 cache also stores scales and zero points: 8 key rows per 32-token block and
        # 8 value columns per token, 15 x 3 x (64 x 40 / 32 + 72) bytes.
        per_position = page.value("pipeshard_stage_cache_bytes", **label) / positions
        assert per_position in {30 * 3 * 64 * size for size in (1, 2, 4)} | {15 * 3 * (80 + 72)}

    coordinator = metrics(fleet, "coordinator")
    assert delta(coordinator, coordinator0, "pipeshard_generated_tokens_total") == TOKENS
    assert delta(coordinator, coordinator0, "pipeshard_time_to_first_token_seconds_count") == 1
    assert delta(coordinator, coordinator0, "pipeshard_inter_token_seconds_count") == TOKENS - 1
    ttft = delta(coordinator, coordinator0, "pipeshard_time_to_first_token_seconds_sum")
    assert ttft == pytest.approx(result.ttft_ms / 1000, rel=1e-6)
    assert coordinator.value("pipeshard_coordinator_queued_requests") == 0

    assert sessions_after_release(fleet.stages) == [0, 0]
    for k, before in enumerate(stages0):
        after, label = metrics(fleet, f"stage{k}"), {"stage": str(k)}
        # One prefill step, then one step per further token; rows: the prompt, then one each.
        assert delta(after, before, "pipeshard_stage_step_seconds_count", **label) == TOKENS
        assert delta(after, before, "pipeshard_stage_step_seconds_sum", **label) > 0
        assert delta(after, before, "pipeshard_stage_step_rows_sum", **label) == (
            result.prompt_tokens + TOKENS - 1
        )
        assert after.value("pipeshard_stage_sessions", **label) == 0
        assert after.value("pipeshard_stage_cache_positions", **label) == 0


def test_speculative_drafted_and_accepted_match_the_summary(fleet):
    before = metrics(fleet, "coordinator")
    with PipeshardClient(fleet.coordinator, timeout_s=300) as client:
        # Repetitive text, so prompt lookup finds drafts.
        result = client.generate(
            "Repeat exactly: one two three four one two three four one two three four",
            max_tokens=24,
            ignore_eos=True,
            speculative="ngram",
            k=3,
        )
    after = metrics(fleet, "coordinator")
    drafted = delta(after, before, "pipeshard_speculative_draft_tokens_total", source="ngram")
    accepted = delta(after, before, "pipeshard_speculative_accepted_tokens_total", source="ngram")
    assert drafted == result.draft_tokens > 0
    assert accepted == result.accepted_tokens
    # Per traversal: every decode step's kept tokens, the summary's histogram and the metric's.
    kept = result.kept_per_traversal
    assert len(kept) > 1 and kept[1:] != [0] * (len(kept) - 1), kept  # some traversal kept drafts
    assert sum(i * n for i, n in enumerate(kept)) == result.accepted_tokens
    assert sum((i + 1) * n for i, n in enumerate(kept)) == result.completion_tokens - 1
    traversals = "pipeshard_tokens_per_traversal"
    assert delta(after, before, f"{traversals}_count", source="ngram") == sum(kept)
    assert delta(after, before, f"{traversals}_sum", source="ngram") == result.completion_tokens - 1


def test_top_shows_step_time_cache_users_and_tokens(fleet, tmp_path, capsys):
    from pipeshard.cli import main as pipeshard
    from pipeshard.topology import Endpoint, Topology

    def endpoint(address: str, name: str) -> Endpoint:
        host, port = address.rsplit(":", 1)
        return Endpoint(host=host, port=int(port), metrics_port=fleet.metrics_ports[name])

    Topology(
        shards="unused",
        coordinator=endpoint(fleet.coordinator, "coordinator"),
        exporter=endpoint(fleet.process("exporter").address, "exporter"),
        stages=[endpoint(a, f"stage{k}") for k, a in enumerate(fleet.stages)],
    ).save(tmp_path / "topology.yaml")
    capsys.readouterr()
    args = [
        "top",
        "--once",
        "--interval",
        "0.2",
        "--topology",
        str(tmp_path / "topology.yaml"),
        "--gateway",
        "",
    ]
    assert pipeshard(args) == 0
    out = capsys.readouterr().out
    for column in ("step ms", "rows/step", "cache", "users", "queue", "tok/s", "precision"):
        assert column in out
    assert out.count("invariant ") == 2 and out.count(" (invariant)") == 2  # the default, both stages
    assert out.count(" pos, ") == 2 and "MiB" in out  # cache use of both stages
    assert "OK " in out


def stage_configuration(address: str) -> str:
    import grpc

    from pipeshard.v1 import stage_pb2, stage_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = stage_pb2_grpc.StageServiceStub(channel)
        return stub.GetStageInfo(stage_pb2.GetStageInfoRequest(), timeout=10).configuration


def test_gateway_answers_carry_the_fleets_system_fingerprint(fleet, smollm2_export):
    """The fingerprint comes from the stages' promise and the export (fleet_promise.py): the same
    on every answer, whole or streamed (from the finish chunk on), and what the coordinator says."""
    import json
    import urllib.request

    from pipeshard.services.coordinator.fleet_promise import FleetPromise
    from pipeshard.shard.manifest import load_manifest

    model = load_manifest(smollm2_export(2, "int4")).model.fingerprint
    configurations = tuple(stage_configuration(a) for a in fleet.stages)  # what each stage proved
    want = FleetPromise(model, "invariant", True, configurations).system_fingerprint
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}

    def post(extra: dict) -> bytes:
        request = urllib.request.Request(
            f"http://{fleet.gateway}/v1/chat/completions",
            data=json.dumps({**body, **extra}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=300) as reply:
            return reply.read()

    assert json.loads(post({}))["system_fingerprint"] == want
    lines = post({"stream": True}).decode().splitlines()
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: {")]
    assert chunks[0]["system_fingerprint"] is None and chunks[-1]["system_fingerprint"] == want
