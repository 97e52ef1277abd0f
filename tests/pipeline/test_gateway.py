"""The OpenAI gateway in front of a real fleet, driven by the official `openai` client and curl:
outputs identical to the gRPC path, errors in OpenAI's shape, queue-full 429, disconnect cancels;
in plaintext invented tokens are one identity, and streams whose reader never reads are cancelled."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx
import openai
import pytest

from pipeshard.cli import main as pipeshard
from pipeshard.clients.client import PipeshardClient, build_request
from pipeshard.topology import Endpoint, Topology
from pipeshard.v1 import coordinator_pb2_grpc
from tests.pipeline.stage_probe import sessions_after_release

pytestmark = pytest.mark.slow

TOKENS = 48
MODEL = "smollm2-135m-instruct"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def fleet(smollm2_export, fleet_factory, tmp_path_factory):
    metrics = {name: _free_port() for name in ("stage0", "stage1", "coordinator", "gateway")}
    # A stalled reader's writes count as not draining after 4 KiB unsent, for 2 s (issue #37).
    drain = ["--drain-timeout-s", "2", "--write-buffer-bytes", "4096"]
    # Identities by name in /metrics (the operator's opt-in; by default only their kind shows).
    names = ["--metrics-identity-labels", "names"]
    # The page's fleet view reads the topology at its first request: written once the ports are known.
    topology = tmp_path_factory.mktemp("gateway-topology") / "topology.yaml"
    shards = smollm2_export(2, "int4")
    started = fleet_factory(
        shards,
        2,
        gateway_port=0,
        metrics_ports=metrics,
        extra_gateway_args=[*drain, "--topology", str(topology)],
        extra_coordinator_args=names,
    )
    Topology(
        shards=str(shards),
        coordinator=_endpoint(started.coordinator, metrics["coordinator"]),
        exporter=_endpoint("127.0.0.1:1"),
        stages=[_endpoint(a, metrics[f"stage{k}"]) for k, a in enumerate(started.stages)],
    ).save(topology)
    started.metrics_ports = metrics
    return started


@pytest.fixture(scope="module")
def api(fleet):
    with openai.OpenAI(base_url=f"http://{fleet.gateway}/v1", api_key="unused", max_retries=0) as client:
        yield client


def grpc_generate(fleet, prompt: str, **kwargs):
    with PipeshardClient(fleet.coordinator, timeout_s=300) as client:
        return client.generate(prompt, max_tokens=TOKENS, **kwargs)


def raw_grpc_text(fleet, prompt: str, **kwargs) -> str:
    """The gRPC path for a raw (no chat template) prompt, as /v1/completions sends it."""
    import grpc

    request = build_request(messages=[], max_tokens=TOKENS, **kwargs)
    request.prompt = prompt
    with grpc.insecure_channel(fleet.coordinator) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        return next(r.summary.text for r in stub.Generate(request, timeout=300) if r.HasField("summary"))


@pytest.mark.parametrize("index", [0, 2])
def test_greedy_chat_matches_grpc_streaming_and_not(fleet, api, prompts, index):
    expected = grpc_generate(fleet, prompts[index])
    messages = [{"role": "user", "content": prompts[index]}]
    whole = api.chat.completions.create(model="any", messages=messages, max_tokens=TOKENS, temperature=0)
    assert whole.choices[0].message.content == expected.text
    assert whole.choices[0].finish_reason == expected.finish_reason
    assert whole.usage.completion_tokens == len(expected.token_ids)
    assert whole.usage.prompt_tokens == expected.prompt_tokens

    stream = api.chat.completions.create(
        model="any",
        messages=messages,
        max_completion_tokens=TOKENS,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.finish_reason
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_completions_send_the_raw_prompt(fleet, api):
    prompt = "The three primary colours are"
    expected = raw_grpc_text(fleet, prompt)
    whole = api.completions.create(model=MODEL, prompt=prompt, max_tokens=TOKENS, temperature=0)
    assert whole.choices[0].text == expected
    streamed = api.completions.create(model=MODEL, prompt=prompt, max_tokens=TOKENS, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == expected


def test_seeded_sampling_and_stop_match_grpc(fleet, api, prompts):
    sampled = dict(temperature=0.9, top_p=0.95, seed=1234)
    expected = grpc_generate(fleet, prompts[4], **sampled)
    messages = [{"role": "user", "content": prompts[4]}]
    got = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=TOKENS, **sampled)
    assert got.choices[0].message.content == expected.text

    stopped = grpc_generate(fleet, prompts[0], stop=["Paris"])
    got = api.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompts[0]}], max_tokens=TOKENS, stop="Paris"
    )
    assert got.choices[0].message.content == stopped.text
    assert got.choices[0].finish_reason == stopped.finish_reason == "stop"


def test_logprobs_of_the_chosen_tokens_match_grpc(fleet, api, prompts):
    expected = grpc_generate(fleet, prompts[2], logprobs=True)
    assert len(expected.logprobs) == len(expected.token_ids) and all(lp <= 0 for lp in expected.logprobs)
    messages = [{"role": "user", "content": prompts[2]}]
    whole = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=TOKENS, logprobs=True)
    content = whole.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx(expected.logprobs, abs=1e-6)
    assert all(c.top_logprobs == [] and bytes(c.bytes) == c.token.encode() for c in content)
    stream = api.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=TOKENS, logprobs=True, stream=True
    )
    streamed = [
        c
        for chunk in stream
        if chunk.choices and chunk.choices[0].logprobs
        for c in chunk.choices[0].logprobs.content
    ]
    assert [c.logprob for c in streamed] == [c.logprob for c in content]

    prompt = "The three primary colours are"
    raw = api.completions.create(model=MODEL, prompt=prompt, max_tokens=TOKENS, logprobs=0)
    logprobs = raw.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == raw.usage.completion_tokens
    assert all(lp <= 0 for lp in logprobs.token_logprobs)
    with pytest.raises(openai.BadRequestError) as refused:
        api.chat.completions.create(model=MODEL, messages=messages, logprobs=True, top_logprobs=21)
    assert refused.value.param == "top_logprobs"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"n": 9}, "n"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools[0].function.parameters"),
        ({"temperature": -1}, "temperature"),
        ({"max_tokens": 100_000}, "max_tokens"),  # refused by the coordinator (INVALID_ARGUMENT)
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),  # OpenAI's rule: at most 4
        ({"stop": "x" * 1000}, "stop"),
    ],
)
def test_bad_requests_are_400_naming_the_parameter(api, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], **extra)
    assert info.value.status_code == 400
    assert info.value.param == param and param in info.value.message


def test_models_and_health(fleet, api):
    assert [m.id for m in api.models.list()] == [MODEL]
    health = httpx.get(f"http://{fleet.gateway}/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_streams_server_sent_events(fleet, prompts):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompts[0]}],
        "max_tokens": TOKENS,
        "stream": True,
    }
    out = subprocess.run(
        [
            "curl",
            "-sN",
            f"http://{fleet.gateway}/v1/chat/completions",
            "-H",
            "Content-Type: application/json",
            "-d",
            json.dumps(body),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    events = [line.removeprefix("data: ") for line in out.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1])
    assert text == grpc_generate(fleet, prompts[0]).text


def test_full_queue_is_429_and_a_disconnect_frees_the_slot(smollm2_export, fleet_factory):
    """One slot, no queue: a second request is refused with 429 while a long stream holds the slot;
    dropping that stream cancels the generation on the stage, and the next request is served."""
    small = fleet_factory(
        smollm2_export(1, "int4"),
        1,
        gateway_port=0,
        extra_coordinator_args=["--max-running", "1", "--max-queue", "0"],
    )
    url = f"http://{small.gateway}/v1"
    hi = [{"role": "user", "content": "Hi"}]
    with (
        openai.OpenAI(base_url=url, api_key="unused", max_retries=0) as holder,
        openai.OpenAI(base_url=url, api_key="unused", max_retries=0) as api,
    ):
        held = holder.completions.create(
            model=MODEL, prompt="1, 2, 3, 4, 5, 6, 7,", max_tokens=3000, stream=True
        )
        with held:
            next(iter(held))  # the generation is running and holds the only slot
            with pytest.raises(openai.RateLimitError) as info:
                api.chat.completions.create(model=MODEL, messages=hi)
            assert info.value.status_code == 429 and info.value.code == "resource_exhausted"
        # The client hung up 3000 tokens early: the stage must drop the session well before that.
        assert sessions_after_release(small.stages, timeout_s=20) == [0]
        assert api.chat.completions.create(model=MODEL, messages=hi, max_tokens=8).choices[0].message.content


def _endpoint(address: str, metrics_port: int = 0) -> Endpoint:
    host, port = address.rsplit(":", 1)
    return Endpoint(host=host, port=int(port), metrics_port=metrics_port)


def test_every_service_serves_metrics_and_top_shows_the_fleet(fleet, api, tmp_path, capsys):
    api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    for name, port in fleet.metrics_ports.items():
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert "pipeshard_" in text, name
    gateway_metrics = httpx.get(f"http://127.0.0.1:{fleet.metrics_ports['gateway']}/metrics").text
    assert 'pipeshard_gateway_requests_total{path="/v1/chat/completions",status="200"}' in gateway_metrics

    topo = Topology(
        shards="unused",
        coordinator=_endpoint(fleet.coordinator, fleet.metrics_ports["coordinator"]),
        exporter=_endpoint("127.0.0.1:1"),
        stages=[_endpoint(address) for address in fleet.stages],
    )
    topo.save(tmp_path / "topology.yaml")
    capsys.readouterr()
    assert (
        pipeshard(
            [
                "top",
                "--once",
                "--topology",
                str(tmp_path / "topology.yaml"),
                "--gateway",
                f"http://{fleet.gateway}",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    for address in (*fleet.stages, fleet.coordinator, fleet.gateway):
        assert address in out
    assert out.count("serving") == 4 and "0-14" in out and "15-29" in out
    assert "OK " in out  # the coordinator's finished Generate calls, from its /metrics


def test_the_fleet_view_shows_every_stage_with_its_layers_precision_and_cache(fleet, api):
    api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    view = httpx.get(f"http://{fleet.gateway}/fleet").json()
    assert view["model"] == {
        "name": MODEL,
        "family": "llama",
        "layers": 30,
        "weights": "int4",
        "max_context": view["model"]["max_context"],
        "split": [15, 15],
    }
    assert [(s["label"], s["address"], s["layers"], s["health"]) for s in view["stages"]] == [
        ("0", fleet.stages[0], "0-14", "serving"),
        ("1", fleet.stages[1], "15-29", "serving"),
    ]
    for stage in view["stages"]:
        assert stage["precision"].endswith("(invariant)") and stage["cache"].endswith("MiB"), stage
        assert stage["step_ms"] not in ("-", "idle"), stage  # its /metrics answered
    (coordinator,) = view["coordinators"]
    assert coordinator["health"] == "serving" and coordinator["generate_calls"]["OK"] >= 1


def test_n_choices_come_from_one_prefill(fleet, api):
    """n=4 computes the prompt once and holds its KV once: the stages' computed rows, the choices'
    restored positions and the paged stages' shared blocks say so; each choice's tokens are those
    of a request of its own with its seed (seed + index)."""
    stage0, coordinator = fleet.metrics_ports["stage0"], fleet.metrics_ports["coordinator"]
    stages = [fleet.metrics_ports[f"stage{k}"] for k in (0, 1)]
    prompt = "Tell me about the sea. " + " ".join(f"Fact {i}: water is wet." for i in range(40))
    params = {"max_tokens": 8, "temperature": 0.8, "messages": [{"role": "user", "content": prompt}]}

    def rows() -> float:
        return metric(stage0, "pipeshard_stage_step_rows_sum", stage="0")

    def restored(how: str) -> list[float]:
        name = "pipeshard_stage_kv_restored_blocks_total"
        return [metric(port, name, stage=str(k), how=how) for k, port in enumerate(stages)]

    before_rows, before_cached = (
        rows(),
        metric(coordinator, "pipeshard_coordinator_identity_cached_tokens_total"),
    )
    before_shared, before_copied = restored("shared"), restored("copied")
    reply = api.chat.completions.create(model=MODEL, n=4, seed=5, **params)
    computed = rows() - before_rows
    cached = metric(coordinator, "pipeshard_coordinator_identity_cached_tokens_total") - before_cached
    shared = [a - b for a, b in zip(restored("shared"), before_shared, strict=True)]
    copied = [a - b for a, b in zip(restored("copied"), before_copied, strict=True)]
    prompt_tokens = reply.usage.prompt_tokens
    assert prompt_tokens > 200 and [c.index for c in reply.choices] == [0, 1, 2, 3]
    # Each choice restores the whole prompt but its last block at most; four prefills would compute 4x.
    assert cached >= 4 * (prompt_tokens - 32), (cached, prompt_tokens)
    assert computed < prompt_tokens + 4 * (32 + 8), (computed, prompt_tokens)
    # Each choice references the prompt's full blocks (pinned by the one prefill) and copies at
    # most the partial last one: the prompt's KV is held once, not four times.
    positions = cached // 4
    assert shared == [4 * (positions // 32)] * 2, (shared, positions)
    assert copied == [4 * (-(-positions // 32) - positions // 32)] * 2, (copied, positions)
    texts = [c.message.content for c in reply.choices]
    assert len(set(texts)) > 1  # each choice samples its own stream (seed + i)
    alone = [api.chat.completions.create(model=MODEL, seed=5 + i, **params) for i in range(4)]
    assert [a.choices[0].message.content for a in alone] == texts


def test_streamed_n_choices_equal_the_whole_answer(fleet, api):
    """n=3 streamed: chunks per choice index, each choice its own finish_reason, the usage of all
    three at the end; the texts equal the same request answered whole."""
    params = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Name a colour. " * 30}],
        "max_tokens": 12,
        "n": 3,
        "seed": 21,
        "temperature": 0.9,
    }
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    usage = None
    for chunk in api.chat.completions.create(**params, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            assert not chunk.choices
            usage = chunk.usage
        for choice in chunk.choices:
            assert choice.index not in finishes, "a chunk after its choice finished"
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason is not None:
                finishes[choice.index] = choice.finish_reason
    whole = api.chat.completions.create(**params)
    assert sorted(texts) == sorted(finishes) == [0, 1, 2]
    assert [texts[i] for i in range(3)] == [c.message.content for c in whole.choices]
    assert [finishes[i] for i in range(3)] == [c.finish_reason for c in whole.choices]
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


def metric(port: int, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples with these labels on the /metrics at ``port``."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


def identities(port: int) -> set[str]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    return {
        sample.labels["identity"]
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "pipeshard_coordinator_identity_requests_total"
    }


def test_invented_tokens_are_one_identity_in_plaintext(fleet):
    """The forged-token flood: on an open fleet a bearer token proves nothing, so 40 made-up
    tokens are the caller's host, one identity, and cannot multiply its share."""
    import grpc

    port = fleet.metrics_ports["coordinator"]
    served_before = metric(port, "pipeshard_coordinator_identity_requests_total", identity="peer:127.0.0.1")

    def one(i: int) -> str:
        with PipeshardClient(fleet.coordinator, timeout_s=300, token=f"made-up-{i}") as client:
            try:
                client.generate("Hi", max_tokens=1)
            except grpc.RpcError as exc:
                return exc.code().name
            return "served"

    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(one, range(40)))
    assert set(outcomes) <= {"served", "RESOURCE_EXHAUSTED"}
    assert identities(port) == {"peer:127.0.0.1"}
    served = metric(port, "pipeshard_coordinator_identity_requests_total", identity="peer:127.0.0.1")
    assert served - served_before == outcomes.count("served") > 0


def _stalled_stream(address: str, small_buffer: bool = True) -> socket.socket:
    """A streaming completion whose reader never reads (and keeps its receive buffer small)."""
    host, port = address.rsplit(":", 1)
    sock = socket.socket()
    if small_buffer:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    sock.connect((host, int(port)))
    body = json.dumps(
        {"model": MODEL, "prompt": "1, 2, 3,", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    ).encode()
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    sock.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return sock


def test_a_stop_list_flood_is_refused_by_name_and_the_coordinator_serves_on(fleet, api):
    """A million stop strings, matched after every token on the coordinator's event loop, would
    stall every user: refused before the request is tokenized, over gRPC and over HTTP."""
    import grpc

    request = build_request(messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    request.params.stop.extend(f"s{i}" for i in range(1_000_000))
    with grpc.insecure_channel(fleet.coordinator, options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(request, timeout=120))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "`stop`" in info.value.details() and "at most 4" in info.value.details()
    with pytest.raises(openai.BadRequestError) as refused:
        api.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], stop=[f"s{i}" for i in range(10_000)]
        )
    assert refused.value.param == "stop"
    assert grpc_generate(fleet, "Say hi.").completion_tokens > 0


def test_streams_whose_reader_never_reads_are_cancelled_and_free_their_slots(fleet, api):
    """The idle-stream flood: 30 SSE streams nobody reads. Each is aborted once its writes have not
    drained for 2 s, which cancels its generation; the fleet empties and serves a normal request
    (without the rule the 2000-token streams would hold every slot for minutes)."""
    coordinator, gateway = fleet.metrics_ports["coordinator"], fleet.metrics_ports["gateway"]
    stalled = "pipeshard_gateway_connections_closed_total"
    before = metric(gateway, stalled, reason="stalled_write")
    streams = [_stalled_stream(fleet.gateway) for _ in range(30)]
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            time.sleep(1)
            busy = metric(coordinator, "pipeshard_coordinator_running_requests") + metric(
                coordinator, "pipeshard_coordinator_queued_requests"
            )
            if busy == 0 and metric(gateway, stalled, reason="stalled_write") > before:
                break
        # Every admitted stream's (--max-streams-per-identity: the others were 429 at once).
        assert metric(gateway, stalled, reason="stalled_write") - before >= 4
        assert busy == 0
        reply = api.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
        assert reply.choices[0].message.content
    finally:
        for sock in streams:
            sock.close()


def test_never_read_streams_leave_a_normal_request_answered(fleet):
    """30 never-read 2000-token streams from default client sockets (their bytes fit in the
    buffers for minutes, so no drain timeout cuts them): a normal request is still answered, from
    the same host, because one caller holds at most --max-streams-per-identity streams and the
    gateway's streams leave the coordinator a reserve of slots."""
    streams = [_stalled_stream(fleet.gateway, small_buffer=False) for _ in range(30)]
    try:
        time.sleep(2)  # every stream is admitted or refused by now
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        reply = httpx.post(f"http://{fleet.gateway}/v1/chat/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"]
        one_more = {"model": MODEL, "prompt": "1,", "max_tokens": 4, "stream": True}
        refused = httpx.post(f"http://{fleet.gateway}/v1/completions", json=one_more, timeout=60)
        assert refused.status_code == 429 and "max-streams-per-identity" in refused.text
    finally:
        for sock in streams:
            sock.close()
