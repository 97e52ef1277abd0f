"""``tool_choice: auto`` (services/gateway/tools.py): the tools described, no grammar imposed, and
an answer is a call only when it is exactly such an object naming one of the tools."""

from __future__ import annotations

import json

from pipeshard.services.gateway.schema import ChatCompletionRequest

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def _body(**extra) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": [WEATHER], **extra}
    )


def test_auto_describes_the_tools_imposes_no_grammar_and_parses_a_call():
    for body in (_body(), _body(tool_choice="auto")):
        plan = body.tool_plan()
        assert plan is not None and plan.mode == "auto" and plan.calls
        assert body.grammar() is None  # the model chooses between a call and text
        system = body.chat()[0]
        assert system["role"] == "system" and "get_weather" in system["content"]
        call = plan.parse('{"name": "get_weather", "arguments": {"city": "Oslo"}}')
        assert call is not None and call.name == "get_weather"
        assert json.loads(call.arguments) == {"city": "Oslo"}
        for text in (
            "It is sunny.",
            '{"name": "get_time", "arguments": {}}',  # not one of the tools
            '{"name": "get_weather", "arguments": {}, "extra": 1}',
            '{"name": "get_weather", "arguments": "Oslo"}',
        ):
            assert plan.parse(text) is None, text
    none = _body(tool_choice="none")
    call = '{"name": "get_weather", "arguments": {}}'
    assert none.grammar() is None and none.tool_plan().parse(call) is None
