"""Structured outputs, penalties, logit_bias and top_logprobs through the OpenAI gateway on a real
fleet, with the official `openai` client: JSON schemas of different shapes answered with JSON that
validates, streamed and not; json_object, guided_regex and guided_grammar; max_tokens inside the JSON says
"length"; an uncompilable schema is a 400 naming response_format; a constrained row leaves its
batch neighbours' tokens as they are alone; and with speculation (prompt lookup) the constrained
tokens equal plain ones."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest

from pipeshard.clients.client import build_request
from pipeshard.v1 import coordinator_pb2, coordinator_pb2_grpc
from tests.pipeline.schema_check import violations

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
TOKENS = 160  # room for every schema's longest answer (strings and arrays are bounded)

NAME = {"type": "string", "minLength": 1, "maxLength": 12}
SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "city": NAME,
            "location": {
                "type": "object",
                "properties": {
                    "lat": {"type": "number", "minimum": -90, "maximum": 90},
                    "lon": {"type": "number", "minimum": -180, "maximum": 180},
                },
                "required": ["lat", "lon"],
                "additionalProperties": False,
            },
        },
        "required": ["city", "location"],
        "additionalProperties": False,
    },
    "array_of_enums": {
        "type": "object",
        "properties": {
            "colors": {
                "type": "array",
                "items": {"type": "string", "enum": ["red", "green", "blue"]},
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["colors"],
        "additionalProperties": False,
    },
    "bool_and_enum": {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "level": {"enum": ["low", "mid", "high"]}},
        "required": ["ok", "level"],
        "additionalProperties": False,
    },
}
EXTENDED = {
    "integer_bounds": {
        "type": "object",
        "properties": {"score": {"type": "integer", "minimum": 1, "maximum": 10}},
        "required": ["score"],
        "additionalProperties": False,
    },
    "number_bounds": {
        "type": "object",
        "properties": {"price": {"type": "number", "minimum": 0, "maximum": 1000, "multipleOf": 0.01}},
        "required": ["price"],
        "additionalProperties": False,
    },
    "array_of_objects": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"name": NAME, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                    "required": ["name", "qty"],
                    "additionalProperties": False,
                },
                "minItems": 1,
                "maxItems": 2,
            }
        },
        "required": ["items"],
        "additionalProperties": False,
    },
    "top_level_array": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
    "top_level_enum": {"enum": ["yes", "no", "maybe"]},
    "const": {
        "type": "object",
        "properties": {"kind": {"const": "event"}, "title": NAME},
        "required": ["kind", "title"],
        "additionalProperties": False,
    },
    "nullable": {
        "type": "object",
        "properties": {"note": {"type": ["string", "null"], "maxLength": 10}},
        "required": ["note"],
        "additionalProperties": False,
    },
    "any_of": {
        "type": "object",
        "properties": {"id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, NAME]}},
        "required": ["id"],
        "additionalProperties": False,
    },
    "deep": {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {
                    "b": {
                        "type": "object",
                        "properties": {"c": {"type": "integer", "minimum": 0, "maximum": 5}},
                        "required": ["c"],
                        "additionalProperties": False,
                    }
                },
                "required": ["b"],
                "additionalProperties": False,
            }
        },
        "required": ["a"],
        "additionalProperties": False,
    },
    "tags": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}},
        "required": ["tags"],
        "additionalProperties": False,
    },
    "optional_field": {
        "type": "object",
        "properties": {"title": NAME, "year": {"type": "integer", "minimum": 1900, "maximum": 2100}},
        "required": ["title"],
        "additionalProperties": False,
    },
    "matrix": {
        "type": "object",
        "properties": {
            "rows": {
                "type": "array",
                "items": {"type": "array", "items": {"type": "integer", "maximum": 9}, "maxItems": 2},
                "minItems": 1,
                "maxItems": 2,
            }
        },
        "required": ["rows"],
        "additionalProperties": False,
    },
    "weather": {
        "type": "object",
        "properties": {
            "city": NAME,
            "unit": {"enum": ["C", "F"]},
            "temp": {"type": "number", "minimum": -60, "maximum": 60},
        },
        "required": ["city", "unit", "temp"],
        "additionalProperties": False,
    },
    "short_string": {"type": "string", "minLength": 2, "maxLength": 8},
    "two_enums": {
        "type": "object",
        "properties": {"size": {"enum": ["S", "M", "L"]}, "fit": {"enum": ["slim", "loose"]}},
        "required": ["size", "fit"],
        "additionalProperties": False,
    },
    "boolean_array": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
}
PROMPT = "Answer in JSON. Describe a fictional {name} briefly."


@pytest.fixture(scope="module")
def fleet(smollm2_export, fleet_factory):
    """At the default precision (`invariant`): the grammar bounds a number's digits, so every
    schema's greedy answer ends."""
    return fleet_factory(smollm2_export(2, "int4"), 2, gateway_port=0)


@pytest.fixture(scope="module")
def exact_fleet(smollm2_export, fleet_factory):
    return fleet_factory(smollm2_export(2, "int4"), 2, precision="exact")


@pytest.fixture(scope="module")
def api(fleet):
    with openai.OpenAI(base_url=f"http://{fleet.gateway}/v1", api_key="unused", max_retries=0) as client:
        yield client


def _schema_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def _answers(api, name: str, schema: dict) -> tuple[str, str, str]:
    """(non-streamed text, streamed text, the streamed finish reason) for one schema."""
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPT.format(name=name.replace("_", " "))}],
        max_tokens=TOKENS,
        response_format=_schema_format(name, schema),
    )
    whole = api.chat.completions.create(**kwargs)
    assert whole.choices[0].finish_reason == "stop", whole.choices[0].message.content
    parts, finish = [], None
    for chunk in api.chat.completions.create(stream=True, **kwargs):
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    return whole.choices[0].message.content, "".join(parts), finish


def _check_schemas(api, schemas: dict) -> None:
    """Every schema answered, and every answer checked before the test fails (it names them all)."""
    failed = {}
    for name, schema in schemas.items():
        try:
            whole, streamed, finish = _answers(api, name, schema)
            assert streamed == whole and finish == "stop", "streamed"  # greedy: the same answer
            problems = violations(json.loads(whole), schema)
            assert not problems, problems
        except (AssertionError, json.JSONDecodeError) as exc:
            failed[name] = str(exc)[:300]
    assert not failed, failed


def test_json_schemas_are_answered_with_valid_json_streamed_and_not(api):
    _check_schemas(api, SCHEMAS)


@pytest.mark.extended
def test_twenty_json_schemas_are_answered_with_valid_json(api):
    _check_schemas(api, SCHEMAS | EXTENDED)


def test_json_object_completions_guided_regex_and_guided_grammar(api):
    text = api.completions.create(
        model=MODEL,
        prompt='Cats as JSON:\n{"name": "Tom", "age": 3}\n{"name": "Kit", "age": 5}\n',
        max_tokens=TOKENS,
        extra_body={"response_format": {"type": "json_object"}},
    ).choices[0]
    assert isinstance(json.loads(text.text), dict) and text.finish_reason == "stop", text.text
    pattern = r"(yes|no), [a-z]{2,6}\."
    grammar = 'start: answer ", " colour "."\nanswer: "yes" | "no"\ncolour: /[a-z]{2,6}/'
    for guide in ({"guided_regex": pattern}, {"guided_grammar": grammar}):  # the same language
        answer = api.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Is the sky blue?"}],
            max_tokens=32,
            extra_body=guide,
        ).choices[0]
        assert re.fullmatch(pattern, answer.message.content) and answer.finish_reason == "stop", answer
    with pytest.raises(openai.BadRequestError) as info:
        api.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            extra_body={"guided_grammar": "start: missing_rule"},
        )
    assert info.value.param == "guided_grammar", info.value.message


def test_max_tokens_inside_the_json_is_length(api):
    choice = api.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe a person."}],
        max_tokens=5,
        response_format=_schema_format("person", SCHEMAS["person"]),
    ).choices[0]
    assert choice.finish_reason == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(choice.message.content)


@pytest.mark.parametrize(
    ("response_format", "param"),
    [
        (_schema_format("bad", {"type": "frobnicate"}), "response_format"),
        (_schema_format("remote", {"$ref": "http://example.invalid/schema.json"}), "response_format"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        ({"type": "yaml"}, "response_format.type"),
    ],
)
def test_a_schema_the_engine_cannot_compile_is_a_400_naming_response_format(api, response_format, param):
    with pytest.raises(openai.BadRequestError) as info:
        api.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], response_format=response_format
        )
    assert info.value.status_code == 400 and info.value.param == param, info.value.message
    # the fleet keeps serving
    ok = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert ok.choices[0].message.content


# Each bad input of the OpenAI surface and the parameter its 400 names.
BAD_INPUT = [
    ({"response_format": _schema_format("uniq", {"type": "array", "uniqueItems": True})}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools[0].function.parameters"),
    ({"n": 9}, "n"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logit_bias": {"49152": 5}}, "logit_bias"),
]


def test_bad_input_is_a_400_naming_it_while_a_stream_runs_on(api):
    """Every bad input is refused by name while another user's stream is open, and that stream's
    text is its text alone."""
    messages = [{"role": "user", "content": "Name three rivers of Europe."}]
    alone = _chat(api, messages[0]["content"]).message.content
    stream = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=48, stream=True)
    chunks = iter(stream)
    parts = [next(chunks).choices[0].delta.content or ""]  # the stream is running
    for extra, param in BAD_INPUT:
        with pytest.raises(openai.BadRequestError) as info:
            api.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, **extra)
        assert info.value.status_code == 400 and info.value.param == param, (extra, info.value.message)
    parts.extend(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "".join(parts) == alone


def _grpc_tokens(fleet, schema: dict, prompt: str, **kwargs) -> list[int]:
    request = build_request(prompt, max_tokens=TOKENS, **kwargs)
    request.params.grammar.CopyFrom(coordinator_pb2.Grammar(json_schema=json.dumps(schema)))
    with grpc.insecure_channel(fleet.coordinator) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        ids: list[int] = []
        summary = None
        for response in stub.Generate(request, timeout=300):
            if response.HasField("chunk"):
                ids.extend(response.chunk.token_ids)
            else:
                summary = response.summary
    assert summary.finish_reason == coordinator_pb2.FINISH_REASON_STOP, summary
    return ids, summary


@pytest.mark.parametrize("precision", ["exact", "default"])
def test_speculative_structured_output_equals_plain(request, precision):
    """Prompt-lookup drafts copy the prompt's own JSON-ish text, much of which leaves the grammar:
    each draft is cut where the masked target disagrees, and the tokens equal plain decoding."""
    fleet = request.getfixturevalue("exact_fleet" if precision == "exact" else "fleet")
    schema = SCHEMAS["nested"]
    prompt = 'Fill {"city": "...", "location": {"lat": 0, "lon": 0}} for Paris: {"city": "Paris"}'
    plain, _ = _grpc_tokens(fleet, schema, prompt, speculative="none")
    drafted, summary = _grpc_tokens(fleet, schema, prompt, speculative="ngram", k=4)
    assert summary.draft_tokens > 0  # drafts were proposed and verified
    assert drafted == plain


def _chat(api, content: str, **kwargs):
    return api.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        max_tokens=kwargs.pop("max_tokens", 48),
        **kwargs,
    ).choices[0]


def test_a_constrained_row_leaves_its_batch_neighbours_untouched(api):
    prompt = "Name three rivers of Europe."
    alone = _chat(api, prompt).message.content
    with ThreadPoolExecutor(3) as pool:
        constrained = [
            pool.submit(
                _chat, api, PROMPT.format(name=n), max_tokens=TOKENS, response_format=_schema_format(n, s)
            )
            for n, s in list(SCHEMAS.items())[:2]
        ]
        beside = pool.submit(_chat, api, prompt)
        assert beside.result().message.content == alone
        for future in constrained:
            json.loads(future.result().message.content)


def test_penalties_and_logit_bias_change_the_tokens(api):
    prompt = "Repeat the word hello ten times."
    plain = _chat(api, prompt, logprobs=True).logprobs.content
    penalised = _chat(api, prompt, frequency_penalty=2.0, logprobs=True).logprobs.content

    def repeats(content) -> int:
        tokens = [c.token for c in content]
        return len(tokens) - len(set(tokens))

    assert repeats(penalised) < repeats(plain)
    first = plain[0].token
    banned = _chat(api, prompt, logit_bias={str(_token_id(api, first)): -100}).message.content
    assert not banned.startswith(first)


def _token_id(api, text: str) -> int:
    """The id of a one-token text, from the top alternatives of a forced answer."""
    from transformers import AutoTokenizer

    from tests.conftest import REPO_ROOT

    tokenizer = AutoTokenizer.from_pretrained(REPO_ROOT / "models" / MODEL)
    (token,) = tokenizer.encode(text, add_special_tokens=False)
    return token


def test_top_logprobs_come_from_the_chosen_position(api):
    prompt = "What is the capital of France?"
    plain = _chat(api, prompt).message.content
    answer = _chat(api, prompt, logprobs=True, top_logprobs=5)
    assert answer.message.content == plain  # chosen from the logits here: the same greedy tokens
    for entry in answer.logprobs.content:
        tops = entry.top_logprobs
        assert len(tops) == 5 and [t.logprob for t in tops] == sorted((t.logprob for t in tops), reverse=True)
        assert tops[0].token == entry.token and abs(tops[0].logprob - entry.logprob) < 1e-4
    with pytest.raises(openai.BadRequestError) as info:
        _chat(api, prompt, logprobs=True, top_logprobs=21)
    assert info.value.param == "top_logprobs"


@pytest.mark.parametrize("constrained", [False, True])
def test_a_seed_reproduces_its_tokens_alone_and_among_eight_users(api, constrained):
    """Sampled with a seed (drawn on the final stage, or here from shaped logits when a schema is
    set): the same tokens alone and in a batch of eight different requests."""
    fmt = {"response_format": _schema_format("person", SCHEMAS["person"])} if constrained else {}
    seeded = dict(temperature=0.9, seed=1234, max_tokens=TOKENS if constrained else 24, **fmt)
    prompt = PROMPT.format(name="person")
    alone = _chat(api, prompt, **seeded).message.content
    others = [
        dict(temperature=0.7, seed=i) if i % 2 else dict(frequency_penalty=0.5 * (i % 3)) for i in range(7)
    ]
    with ThreadPoolExecutor(8) as pool:
        load = [pool.submit(_chat, api, f"Tell me about the number {i}.", **o) for i, o in enumerate(others)]
        crowded = pool.submit(_chat, api, prompt, **seeded)
        assert crowded.result().message.content == alone
        assert all(f.result().message.content for f in load)
    if constrained:
        assert not violations(json.loads(alone), SCHEMAS["person"])


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": NAME, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_calls_round_trip_streamed_and_not(api, choice):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    kwargs = dict(
        model=MODEL, messages=messages, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=TOKENS
    )
    answer = api.chat.completions.create(**kwargs).choices[0]
    assert answer.finish_reason == "tool_calls" and answer.message.content is None
    (call,) = answer.message.tool_calls
    arguments = json.loads(call.function.arguments)
    if isinstance(choice, dict):
        assert call.function.name == "get_weather"
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}[call.function.name]
    assert not violations(arguments, schema), arguments
    streamed, finish = [], None
    for chunk in api.chat.completions.create(stream=True, **kwargs):
        if chunk.choices:
            streamed.extend(chunk.choices[0].delta.tool_calls or [])
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and [c.function.name for c in streamed] == [call.function.name]
    assert json.loads(streamed[0].function.arguments) == arguments
    follow = [
        *messages,
        {"role": "assistant", "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})},
    ]
    final = api.chat.completions.create(
        model=MODEL, messages=follow, tools=[WEATHER, TIME], tool_choice="none", max_tokens=32
    ).choices[0]
    assert (
        final.message.content and not final.message.tool_calls and final.finish_reason in ("stop", "length")
    )


def _weather_call(i: int, city: str) -> dict:
    arguments = json.dumps({"city": city, "unit": "C"})
    return {
        "id": f"call_{i}",
        "type": "function",
        "function": {"name": "get_weather", "arguments": arguments},
    }


def _asked_before(cities: list[str]) -> list[dict]:
    """Earlier turns in which the assistant answered each weather question with a call."""
    out: list[dict] = []
    for i, city in enumerate(cities):
        out.append({"role": "user", "content": f"What is the weather in {city}?"})
        out.append({"role": "assistant", "tool_calls": [_weather_call(i, city)]})
        out.append(
            {"role": "tool", "tool_call_id": f"call_{i}", "content": json.dumps({"temperature": 10 + i})}
        )
    return out


def _streamed(api, **kwargs) -> tuple[str, list, str | None]:
    """(text, tool call deltas, finish) of one streamed answer."""
    text, calls, finish = [], [], None
    for chunk in api.chat.completions.create(stream=True, **kwargs):
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            calls.extend(chunk.choices[0].delta.tool_calls or [])
            finish = chunk.choices[0].finish_reason or finish
    return "".join(text), calls, finish


def test_auto_tool_choice_round_trip(api):
    """`tool_choice: auto` with no grammar: SmolLM2-135M never calls on a first question (asked
    plainly, or even told the call to write), but after three turns answered by calls it answers
    the fourth question with one: parsed into tool_calls, streamed as a delta; the tool's result
    is accepted on the next turn, which answers in text."""
    messages = [
        *_asked_before(["Rome", "Oslo", "Lima"]),
        {"role": "user", "content": "What is the weather in Paris?"},
    ]
    kwargs = dict(model=MODEL, messages=messages, tools=[WEATHER, TIME], tool_choice="auto", max_tokens=64)
    answer = api.chat.completions.create(**kwargs).choices[0]
    assert answer.finish_reason == "tool_calls" and answer.message.content is None, answer
    (call,) = answer.message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and arguments["city"] == "Paris", call
    assert not violations(arguments, WEATHER["function"]["parameters"]), arguments
    text, calls, finish = _streamed(api, **kwargs)
    assert finish == "tool_calls" and not text and [c.function.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].function.arguments) == arguments
    follow = [
        *messages,
        {"role": "assistant", "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})},
    ]
    # `none` for the final answer: under `auto` the model, three calls into the pattern, calls again
    final = api.chat.completions.create(**{**kwargs, "messages": follow, "tool_choice": "none"}).choices[0]
    assert final.message.content and not final.message.tool_calls, final
    assert final.finish_reason in ("stop", "length")


def test_auto_tool_choice_answers_text_when_the_model_writes_text(api):
    """A first question under `auto`: the model's real answer is text, held back while streaming
    (it might have been a call) and then sent as the same text."""
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER, TIME],
        tool_choice="auto",
        max_tokens=48,
    )
    answer = api.chat.completions.create(**kwargs).choices[0]
    assert answer.message.content and answer.message.tool_calls is None
    assert answer.finish_reason in ("stop", "length")
    text, calls, finish = _streamed(api, **kwargs)
    assert (text, calls, finish) == (answer.message.content, [], answer.finish_reason)
