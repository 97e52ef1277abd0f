"""The OpenAI gateway against a scripted in-process coordinator: request translation, SSE shape,
error mapping and token forwarding (the real fleet: tests/pipeline/test_gateway.py)."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from pipeshard.keys import add_key
from pipeshard.services.gateway.app import create_app
from pipeshard.services.gateway.errors import GatewayError
from pipeshard.services.gateway.settings import GatewaySettings


@pytest.fixture(scope="module")
def http(coordinator):
    settings = GatewaySettings(coordinator=coordinator[1], model_name="smollm2-135m-instruct")
    with TestClient(create_app(settings)) as client:
        yield client


def chat(http, content="Hi", **extra):
    body = {"model": "whatever", "messages": [{"role": "user", "content": content}], **extra}
    return http.post("/v1/chat/completions", json=body)


def test_chat_completion_translates_parameters(http, coordinator):
    reply = chat(http, max_completion_tokens=7, temperature=0.5, top_p=0.9, seed=3, stop="\n", n=1, user="u")
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["object"] == "chat.completion" and body["model"] == "whatever"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hello world", "refusal": None}
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 2,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 3},
    }
    sent = coordinator[0].requests[-1]
    assert [(m.role, m.content) for m in sent.messages] == [("user", "Hi")]
    p = sent.params
    assert (p.max_tokens, p.top_p, p.seed, list(p.stop)) == (7, pytest.approx(0.9), 3, ["\n"])
    assert p.temperature == pytest.approx(0.5)


def test_completion_sends_raw_prompt(http, coordinator):
    body = {"model": "m", "prompt": "Once upon", "max_tokens": 4, "ignore_eos": True}
    reply = http.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == "Hello world"
    sent = coordinator[0].requests[-1]
    assert sent.prompt == "Once upon" and not sent.messages and sent.params.max_tokens == 4
    assert sent.params.ignore_eos


def _events(reply) -> list:
    lines = [line for line in reply.text.split("\n\n") if line]
    assert all(line.startswith("data: ") for line in lines), lines
    return [line.removeprefix("data: ") for line in lines]


def test_chat_stream_is_sse_with_usage_and_done(http):
    reply = chat(http, stream=True, stream_options={"include_usage": True})
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
    events = _events(reply)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]) == "Hello world"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 7
    assert all(c["usage"] is None for c in chunks[:-1])


def test_completion_stream(http):
    reply = http.post("/v1/completions", json={"prompt": "x", "stream": True})
    chunks = [json.loads(e) for e in _events(reply)[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Hello world"
    assert "usage" not in chunks[-1]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_unsupported_parameters_are_refused_by_name(http, coordinator, extra, param):
    before = len(coordinator[0].requests)
    reply = chat(http, **extra)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == param and param in error["message"]
    assert error["type"] == "invalid_request_error" and error["code"] == "unsupported_parameter"
    assert len(coordinator[0].requests) == before  # refused before any generation


_TOOL = {
    "type": "function",
    "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}},
}


def test_tools_are_rendered_and_required_calls_get_a_grammar(http, coordinator):
    messages = [
        {"role": "user", "content": "Call f"},
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    reply = http.post(
        "/v1/chat/completions", json={"messages": messages, "tools": [_TOOL], "tool_choice": "required"}
    )
    assert reply.status_code == 200, reply.text
    sent = coordinator[0].requests[-1]
    assert sent.messages[0].role == "system" and '"name": <function name>' in sent.messages[0].content
    assert [m.role for m in sent.messages[1:]] == ["user", "assistant", "user"]
    assert json.loads(sent.messages[2].content) == {"name": "f", "arguments": {"x": 1}}
    assert sent.messages[3].content == "Result of f: 42"
    schema = json.loads(sent.params.grammar.json_schema)
    assert schema["properties"]["name"] == {"const": "f"}
    # the scripted answer is not a call: plain text, finish as the coordinator said
    assert reply.json()["choices"][0]["message"]["content"] == "Hello world"
    chat(http, tools=[_TOOL], tool_choice="none")
    sent = coordinator[0].requests[-1]
    assert not sent.params.HasField("grammar") and sent.messages[0].role == "user"


def test_n_choices_are_one_prefill_then_n_generations_with_derived_seeds(http, coordinator):
    before = len(coordinator[0].requests)
    reply = chat(http, n=3, seed=10, temperature=0.5, logprobs=True)
    assert reply.status_code == 200, reply.text
    prefill, *sent = coordinator[0].requests[before:]
    # The prompt once, one greedy token, nothing the choices' own sampling needs.
    assert prefill.params.max_tokens == 1 and prefill.messages == sent[0].messages
    assert not prefill.params.HasField("seed") and not prefill.params.logprobs
    base = prefill.request_id.removesuffix("-prefill")
    assert sorted(r.request_id for r in sent) == [f"{base}-{i}" for i in range(3)]
    assert sorted(r.params.seed for r in sent) == [10, 11, 12]
    body = reply.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert all(c["message"]["content"] == "Hello world" for c in body["choices"])
    assert body["usage"]["completion_tokens"] == 6 and body["usage"]["prompt_tokens"] == 5
    for extra in ({"n": 9}, {"n": 9, "stream": True}):
        refused = chat(http, **extra)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "n"


def test_streamed_n_choices_each_carry_their_index_and_finish(http, coordinator):
    before = len(coordinator[0].requests)
    reply = chat(http, n=3, seed=4, stream=True, stream_options={"include_usage": True})
    assert reply.status_code == 200, reply.text
    prefill, *sent = coordinator[0].requests[before:]
    assert prefill.params.max_tokens == 1 and sorted(r.params.seed for r in sent) == [4, 5, 6]
    events = _events(reply)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    *choice_chunks, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6
    assert last["usage"]["prompt_tokens"] == 5
    assert all(len(c["choices"]) == 1 and c["usage"] is None for c in choice_chunks)
    for i in range(3):
        own = [c["choices"][0] for c in choice_chunks if c["choices"][0]["index"] == i]
        assert own[0]["delta"]["role"] == "assistant"
        assert "".join(c["delta"].get("content", "") for c in own) == "Hello world"
        assert own[-1]["finish_reason"] == "length"  # as the scripted coordinator says
        assert all(c["finish_reason"] is None for c in own[:-1])


def test_formats_penalties_and_biases_reach_the_coordinator(http, coordinator):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}
    extra = {"presence_penalty": 0.5, "frequency_penalty": -1, "logit_bias": {"7": -100}}
    assert chat(http, response_format=fmt, **extra).status_code == 200
    params = coordinator[0].requests[-1].params
    assert json.loads(params.grammar.json_schema) == schema
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -1.0)
    assert dict(params.logit_bias) == {7: -100.0}
    assert chat(http, response_format={"type": "json_object"}).status_code == 200
    assert coordinator[0].requests[-1].params.grammar.json_object
    assert chat(http, guided_regex="[a-z]+").status_code == 200
    assert coordinator[0].requests[-1].params.grammar.regex == "[a-z]+"
    assert chat(http, guided_grammar='start: "a"+').status_code == 200
    assert coordinator[0].requests[-1].params.grammar.lark == 'start: "a"+'
    assert chat(http, response_format={"type": "text"}).status_code == 200
    assert not coordinator[0].requests[-1].params.HasField("grammar")


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"guided_regex": "a", "guided_grammar": 'start: "a"'}, "guided_grammar"),
        ({"guided_grammar": ""}, "guided_grammar"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools[0].function.parameters"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [_TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ],
)
def test_bad_formats_and_penalties_are_400_naming_them(http, coordinator, extra, param):
    before = len(coordinator[0].requests)
    reply = chat(http, **extra)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param
    assert len(coordinator[0].requests) == before


def test_top_logprobs_are_asked_for_and_shaped(http, coordinator):
    reply = http.post("/v1/completions", json={"prompt": "x", "logprobs": 2})
    assert reply.status_code == 200 and coordinator[0].requests[-1].params.top_logprobs == 2
    tops = reply.json()["choices"][0]["logprobs"]["top_logprobs"]
    assert tops == [{"Hello": -0.5, "Hi": -1.5}, {" world": -0.25, " you": -2.0}]
    content = chat(http, logprobs=True, top_logprobs=2).json()["choices"][0]["logprobs"]["content"]
    assert coordinator[0].requests[-1].params.top_logprobs == 2
    assert [[t["token"] for t in c["top_logprobs"]] for c in content] == [["Hello", "Hi"], [" world", " you"]]
    assert chat(http, top_logprobs=2).status_code == 200  # without logprobs: none asked for
    assert coordinator[0].requests[-1].params.top_logprobs == 0
    for body in (
        {"prompt": "x", "logprobs": 6},
        {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
    ):
        route = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
        refused = http.post(route, json=body)
        assert refused.status_code == 400 and refused.json()["error"]["param"] in ("logprobs", "top_logprobs")


def test_chat_logprobs_carry_the_chosen_tokens(http, coordinator):
    plain = chat(http).json()["choices"][0]
    assert plain["logprobs"] is None and not coordinator[0].requests[-1].params.logprobs
    whole = chat(http, logprobs=True, top_logprobs=0).json()["choices"][0]["logprobs"]
    assert coordinator[0].requests[-1].params.logprobs
    assert whole == {
        "content": [
            {"token": "Hello", "logprob": -0.5, "bytes": list(b"Hello"), "top_logprobs": []},
            {"token": " world", "logprob": -0.25, "bytes": list(b" world"), "top_logprobs": []},
        ],
        "refusal": None,
    }
    chunks = [json.loads(e) for e in _events(chat(http, logprobs=True, stream=True))[:-1]]
    streamed = [c["choices"][0]["logprobs"] for c in chunks]
    assert streamed[0] is None and streamed[-1] is None  # the role chunk and the finish chunk
    assert [entry for lp in streamed[1:-1] for entry in lp["content"]] == whole["content"]


def test_completion_logprobs_zero_gives_token_logprobs(http):
    body = {"prompt": "x", "logprobs": 0}
    whole = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    expected = {"tokens": ["Hello", " world"], "token_logprobs": [-0.5, -0.25], "top_logprobs": None}
    assert whole == {**expected, "text_offset": [0, 5]}
    stream = http.post("/v1/completions", json={**body, "stream": True})
    chunks = [json.loads(e) for e in _events(stream)[:-1]]
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    assert [lp["token_logprobs"][0] for lp in streamed] == [-0.5, -0.25]
    assert [lp["text_offset"][0] for lp in streamed] == [0, 5]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"temperature": -1}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2**31}, "max_tokens"),
        ({"max_completion_tokens": 2**31}, "max_completion_tokens"),
        ({"top_k": 2**31}, "top_k"),
        ({"seed": -1}, "seed"),
        ({"messages": []}, "messages"),
    ],
)
def test_out_of_range_values_are_400_naming_the_parameter(http, extra, param):
    reply = chat(http, **extra)
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == param


def test_unknown_roles_and_image_parts_are_refused(http):
    tool = http.post("/v1/chat/completions", json={"messages": [{"role": "robot", "content": "x"}]})
    assert tool.status_code == 400 and tool.json()["error"]["param"] == "messages[0].role"
    image = chat(http, content=[{"type": "image_url", "image_url": {"url": "x"}}])
    assert image.status_code == 400 and image.json()["error"]["param"] == "messages[0].content"


@pytest.mark.parametrize(
    ("code", "status"),
    [("INVALID_ARGUMENT", 400), ("UNAUTHENTICATED", 401), ("RESOURCE_EXHAUSTED", 429), ("UNAVAILABLE", 503)],
)
@pytest.mark.parametrize("stream", [False, True])
def test_coordinator_status_codes_map_to_http(http, code, status, stream):
    reply = chat(http, content=code, stream=stream)
    assert reply.status_code == status
    error = reply.json()["error"]
    assert error["code"] == code.lower() and f"scripted {code}" in error["message"]
    assert error["param"] == "max_tokens"


def test_bearer_token_is_forwarded_as_grpc_metadata(http, coordinator):
    http.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}]},
        headers={"Authorization": "Bearer s3cret"},
    )
    assert coordinator[0].metadata[-1]["authorization"] == "Bearer s3cret"
    http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
    assert "authorization" not in coordinator[0].metadata[-1]


def test_models_and_health(http):
    models = http.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["smollm2-135m-instruct"]
    assert http.get("/v1/models/smollm2-135m-instruct").status_code == 200
    assert http.get("/v1/models/gpt-4").status_code == 404
    assert http.get("/health").json()["status"] == "ok"


def test_health_is_503_without_a_coordinator():
    settings = GatewaySettings(coordinator="127.0.0.1:1")
    with TestClient(create_app(settings)) as client:
        health = client.get("/health")
        assert health.status_code == 503 and "unreachable" in health.json()["error"]["message"]
        reply = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert reply.status_code == 503 and reply.json()["error"]["code"] == "unavailable"


def test_error_body_has_openai_shape():
    body = GatewayError(429, "full", code="resource_exhausted").body()
    assert body == {
        "error": {
            "message": "full",
            "type": "rate_limit_exceeded",
            "param": None,
            "code": "resource_exhausted",
        }
    }


def test_a_keyed_gateway_refuses_unlisted_keys_before_the_body_and_forwards_listed_ones(
    coordinator, tmp_path
):
    keys = tmp_path / "api-keys"
    key = add_key(keys, "alice")
    settings = GatewaySettings(coordinator=coordinator[1], api_keys=keys, max_body_bytes=4096)
    with TestClient(create_app(settings)) as client:
        body = {"messages": [{"role": "user", "content": "Hi"}]}
        for headers in ({}, {"Authorization": "Bearer invented"}, {"Authorization": f"Basic {key}"}):
            refused = client.post("/v1/chat/completions", json=body, headers=headers)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        served = client.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
        assert served.status_code == 200
        assert coordinator[0].metadata[-1]["authorization"] == f"Bearer {key}"
        large = {"messages": [{"role": "user", "content": "x" * 5000}]}
        too_large = client.post(
            "/v1/chat/completions", json=large, headers={"Authorization": f"Bearer {key}"}
        )
        assert too_large.status_code == 413 and too_large.json()["error"]["code"] == "request_too_large"


def test_invalid_json_and_unknown_routes_answer_in_openai_shape(http):
    broken = http.post(
        "/v1/chat/completions", content=b'{"messages": [', headers={"content-type": "application/json"}
    )
    assert broken.status_code == 400
    assert broken.json()["error"]["code"] == "invalid_json" and broken.json()["error"]["param"] is None
    for path, method, status in (("/v1/nowhere", "GET", 404), ("/v1/completions", "GET", 405)):
        reply = http.request(method, path)
        assert reply.status_code == status and set(reply.json()["error"]) == {
            "message",
            "type",
            "param",
            "code",
        }


def test_the_page_is_open_and_the_root_leads_to_it(http):
    root = http.get("/", follow_redirects=False)
    assert root.status_code == 307 and root.headers["location"] == "/ui"
    page = http.get("/ui")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    # The page streams chat completions and polls the fleet view, sending the key it was given.
    for needle in ('fetch("/v1/chat/completions"', 'fetch("/fleet"', "Authorization", 'id="stages"'):
        assert needle in page.text, needle


def test_the_fleet_view_needs_a_topology(http):
    reply = http.get("/fleet")
    assert reply.status_code == 404 and reply.json()["error"]["param"] == "topology"


def test_the_fleet_view_reads_the_topology_and_shows_what_answers_every_coordinator_too(
    coordinator, tmp_path
):
    from pipeshard.topology import Endpoint, StageEndpoint, Topology

    host, port = coordinator[1].rsplit(":", 1)
    dead = [StageEndpoint("127.0.0.1", 1, 0, node="node-a"), StageEndpoint("127.0.0.1", 2, 0)]
    Topology(
        shards=str(tmp_path / "no-export"),
        coordinator=Endpoint(host, int(port), 0),
        exporter=Endpoint("127.0.0.1", 3, 0),
        stages=dead,
        replicas=[[StageEndpoint("127.0.0.1", 4, 0), StageEndpoint("127.0.0.1", 5, 0)]],
        group=[Endpoint("127.0.0.1", 6, 0)],  # a second coordinator of the group, not answering
    ).save(tmp_path / "topology.yaml")
    settings = GatewaySettings(
        coordinator=coordinator[1], model_name="m", topology=tmp_path / "topology.yaml"
    )
    with TestClient(create_app(settings)) as client:
        fleet = client.get("/fleet").json()
    assert fleet["model"]["name"] == "m" and fleet["lanes"] == 2
    assert [s["label"] for s in fleet["stages"]] == ["0", "1", "0.r1", "1.r1"]
    assert fleet["stages"][0]["node"] == "node-a" and fleet["stages"][0]["address"] == "127.0.0.1:1"
    assert all(s["health"].startswith("down") for s in fleet["stages"])
    assert [(c["index"], c["address"]) for c in fleet["coordinators"]] == [
        (0, coordinator[1]),
        (1, "127.0.0.1:6"),
    ]
    assert fleet["coordinators"][0]["health"] == "serving"
    assert fleet["coordinators"][1]["health"].startswith("down")


def test_a_keyed_gateway_serves_the_page_but_not_the_fleet_without_a_key(coordinator, tmp_path):
    keys = tmp_path / "api-keys"
    key = add_key(keys, "alice")
    settings = GatewaySettings(coordinator=coordinator[1], api_keys=keys)
    with TestClient(create_app(settings)) as client:
        assert client.get("/ui").status_code == 200
        assert client.get("/fleet").status_code == 401
        assert client.get("/fleet", headers={"Authorization": f"Bearer {key}"}).status_code == 404
