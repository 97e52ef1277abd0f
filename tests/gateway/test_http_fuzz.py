"""Hypothesis fuzzing of the gateway's request bodies, against a real `pipeshard serve-openai`
process before the scripted coordinator: random JSON (and random bytes) to /v1/chat/completions
and /v1/completions is answered 200 or a 4xx in OpenAI's error shape naming the parameter at
fault (or the body), never a 5xx, and the gateway answers a normal request after every example.
PIPESHARD_FUZZ_EXAMPLES sets the examples per route (`make test-fuzz` runs the long profile)."""

from __future__ import annotations

import json
import os

import httpx2 as httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("PIPESHARD_FUZZ_EXAMPLES", "25"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    database=None,
)
FIELDS = (
    "model", "stream", "stream_options", "max_tokens", "max_completion_tokens", "temperature",
    "top_p", "top_k", "ignore_eos", "speculative", "k", "tree", "seed", "stop", "n", "user",
    "presence_penalty", "frequency_penalty", "logit_bias", "response_format", "guided_regex",
    "guided_grammar", "logprobs", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls", "echo",
    "best_of", "suffix", "prompt", "messages", "unknown_field",
)  # fmt: skip
ROUTES = {
    "/v1/chat/completions": {"model": "m", "messages": [{"role": "user", "content": "Hi"}]},
    "/v1/completions": {"model": "m", "prompt": "Hi"},
}

leaves = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=24)
    | st.sampled_from(["json_object", "json_schema", "text", "function", "auto", "none", "required"])
)
values = st.recursive(
    leaves,
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.dictionaries(
            st.sampled_from(["type", "role", "content", "name", "function", "json_schema"])
            | st.text(max_size=8),
            inner,
            max_size=4,
        )
    ),
    max_leaves=12,
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "tool", "developer", "x"]) | values},
        optional={"content": values, "name": values, "tool_calls": values, "tool_call_id": values},
    ),
    max_size=4,
)


def bodies(route: str):
    """A valid base with random fields set over it, a random object, or random bytes."""
    base = ROUTES[route]
    mutated = st.builds(
        lambda changes: json.dumps({**base, **changes}).encode(),
        st.dictionaries(st.sampled_from(FIELDS), values, max_size=5),
    )
    chats = st.builds(lambda m: json.dumps({"model": "m", "messages": m}).encode(), messages)
    return mutated | chats | st.builds(lambda v: json.dumps(v).encode(), values) | st.binary(max_size=64)


def check(reply: httpx.Response) -> None:
    assert reply.status_code == 200 or 400 <= reply.status_code < 500, (reply.status_code, reply.text)
    if reply.status_code == 200:
        return
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    if reply.status_code == 400:
        assert error["param"] or error["code"] == "invalid_json" or error["message"].startswith("`body`"), (
            error
        )


@pytest.fixture(scope="module")
def client(gateways):
    with httpx.Client(base_url=f"http://{gateways()}", timeout=30) as c:
        yield c


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_random_bodies_are_200_or_a_4xx_naming_the_parameter(client, route):
    @FUZZ
    @given(body=bodies(route))
    def one(body: bytes) -> None:
        check(client.post(route, content=body, headers={"content-type": "application/json"}))
        normal = client.post(route, json=ROUTES[route])
        assert normal.status_code == 200, normal.text

    one()
