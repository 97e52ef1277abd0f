"""OpenAI request bodies and their validation: what the fleet supports, and a 400 naming anything else.

Unknown fields are kept (``extra="allow"``) so they can be refused by name instead of being
silently ignored; known-but-unsupported fields are accepted only at their neutral value.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pipeshard.sampling import MAX_STOP, MAX_STOP_CHARS
from pipeshard.services.gateway.errors import GatewayError
from pipeshard.services.gateway.tools import Tool, ToolChoice, ToolPlan, call_text
from pipeshard.v1 import coordinator_pb2

# The coordinator's int32 fields (max_tokens, top_k): larger values are a 400 naming the field.
INT32_MAX = 2**31 - 1
# Choices per request (``n``): each is its own generation.
MAX_CHOICES = 8


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: the schema the answer validates against. ``strict`` is
    accepted either way: the grammar engine always holds the answer to the whole schema."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class OpenAIRequest(BaseModel):
    """Fields shared by chat and completions; ranges as in OpenAI's API reference."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    # top_k and ignore_eos: vLLM extensions the coordinator supports
    top_k: int | None = Field(None, ge=0, le=INT32_MAX)
    ignore_eos: bool = False
    # pipeshard's extension: draft trees for speculative decoding (auto, off or WxD; the
    # coordinator validates it and names it in its error)
    tree: str | None = Field(None, max_length=16)
    seed: int | None = Field(None, ge=0, lt=2**64)
    stop: str | list[str] | None = None
    n: int | None = Field(None, ge=1, le=INT32_MAX)
    user: str | None = None  # an end-user id for abuse tracking; nothing to do with generation
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    # token id (as a string, as OpenAI's) -> bias in [-100, 100]; the coordinator checks the ids
    logit_bias: dict[str, float] | None = Field(None, max_length=1024)
    response_format: ResponseFormat | None = None
    # vLLM's extension: the whole answer matches this regular expression
    guided_regex: str | None = Field(None, min_length=1, max_length=4096)
    # vLLM's extension: the whole answer matches this context-free grammar (llguidance's Lark
    # syntax, whose rule `start` is the answer)
    guided_grammar: str | None = Field(None, min_length=1, max_length=65536)

    def tool_plan(self) -> ToolPlan | None:
        return None

    def grammar(self) -> coordinator_pb2.Grammar | None:
        """The coordinator's grammar for a required or named tool call, ``response_format``,
        ``guided_regex`` or ``guided_grammar`` (None: free text)."""
        plan = self.tool_plan()
        fmt = self.response_format
        formats = [
            name
            for name, value in (
                ("response_format", fmt is not None and fmt.type != "text"),
                ("guided_regex", self.guided_regex is not None),
                ("guided_grammar", self.guided_grammar is not None),
            )
            if value
        ]
        if plan is not None and plan.schema() is not None:
            if formats:
                raise GatewayError(
                    400, f"`tool_choice` required or named excludes {formats[0]}", param="tool_choice"
                )
            return coordinator_pb2.Grammar(json_schema=json.dumps(plan.schema()))
        if len(formats) > 1:
            raise GatewayError(
                400, f"`{formats[1]}` and `{formats[0]}` are exclusive: set one", param=formats[1]
            )
        if self.guided_regex is not None:
            return coordinator_pb2.Grammar(regex=self.guided_regex)
        if self.guided_grammar is not None:
            return coordinator_pb2.Grammar(lark=self.guided_grammar)
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return coordinator_pb2.Grammar(json_object=True)
        if fmt.json_schema is None:
            raise GatewayError(
                400,
                "`response_format.json_schema` is required when response_format.type is json_schema",
                param="response_format.json_schema",
            )
        return coordinator_pb2.Grammar(json_schema=json.dumps(fmt.json_schema.schema_))

    def token_biases(self) -> dict[int, float]:
        """``logit_bias`` by token id; a key that is not an integer is a 400 naming it."""
        out = {}
        for key, bias in (self.logit_bias or {}).items():
            try:
                out[int(key)] = bias
            except ValueError:
                raise GatewayError(
                    400, f"`logit_bias`: {key!r} is not a token id", param="logit_bias"
                ) from None
        return out

    @property
    def grammar_param(self) -> str:
        """The parameter a grammar the coordinator refuses came from."""
        if self.guided_regex is not None:
            return "guided_regex"
        return "guided_grammar" if self.guided_grammar is not None else "response_format"

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOP:
            raise ValueError(f"may hold at most {MAX_STOP} sequences, got {len(stops)}")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"sequences may be at most {MAX_STOP_CHARS} characters")
        return stop

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def _unsupported(self) -> list[str]:
        """Fields this fleet cannot honour (null and empty values are fine); ``n`` above its limit
        or streamed is refused here."""
        names = [k for k, v in (self.model_extra or {}).items() if v not in (None, [], {})]
        if (self.n or 1) > MAX_CHOICES:
            raise GatewayError(400, f"`n` must be at most {MAX_CHOICES}, got {self.n}", param="n")
        if self.stream_options is not None and not self.stream:
            names.append("stream_options")
        return names

    def check(self) -> None:
        names = self._unsupported()
        if names:
            raise GatewayError(
                400,
                f"unsupported parameter{'s' if len(names) > 1 else ''}: {', '.join(sorted(names))} "
                "(this fleet does not implement them)",
                param=sorted(names)[0],
                code="unsupported_parameter",
            )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def wants_logprobs(self) -> bool:
        """Whether each generated token's logprob is asked for."""
        return False

    @property
    def alternatives(self) -> int:
        """How many of the most likely tokens to return per position (OpenAI's top_logprobs)."""
        return 0


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers
    name: str | None = None


class ChatCompletionRequest(OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None  # one call per answer either way

    def tool_plan(self) -> ToolPlan | None:
        return ToolPlan.of(self.tools, self.tool_choice)

    @property
    def wants_logprobs(self) -> bool:
        return bool(self.logprobs)

    @property
    def alternatives(self) -> int:
        """How many of the most likely tokens to return per position (with ``logprobs``)."""
        return self.top_logprobs or 0 if self.logprobs else 0

    def limit(self) -> int | None:
        """``max_completion_tokens`` replaces the deprecated ``max_tokens``; either is honoured."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def chat(self) -> list[dict[str, str]]:
        """role/content pairs for the coordinator's chat template; text parts only."""
        plan = self.tool_plan()
        out = [plan.system_message()] if plan is not None and plan.calls else []
        calls: dict[str, str] = {}  # call id -> function name, for the tool turns that answer them
        for i, message in enumerate(self.messages):
            role = "system" if message.role == "developer" else message.role
            if role not in ("system", "user", "assistant", "tool"):
                raise GatewayError(
                    400,
                    f"messages[{i}].role must be system, developer, user, assistant or tool, "
                    f"got {message.role!r}",
                    param=f"messages[{i}].role",
                )
            if role == "assistant" and message.tool_calls:
                calls.update(
                    {c.get("id", ""): c.get("function", {}).get("name", "") for c in message.tool_calls}
                )
                text = _text(message.content, i)
                out.append(
                    {
                        "role": role,
                        "content": "\n".join(t for t in (text, call_text(message.tool_calls, i)) if t),
                    }
                )
                continue
            if role == "tool":
                # The default template has no tool role: a tool's answer is a user turn saying so.
                name = message.name or calls.get(message.tool_call_id or "", "") or "the function"
                out.append({"role": "user", "content": f"Result of {name}: {_text(message.content, i)}"})
                continue
            extras = sorted(k for k, v in (message.model_extra or {}).items() if v is not None)
            if extras:
                raise GatewayError(
                    400,
                    f"unsupported parameter: messages[{i}].{extras[0]}",
                    param=f"messages[{i}].{extras[0]}",
                    code="unsupported_parameter",
                )
            out.append({"role": role, "content": _text(message.content, i)})
        return out


def _text(content: str | list[dict[str, Any]] | None, i: int) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise GatewayError(
                400,
                f"messages[{i}].content: only text parts are supported, got type {part.get('type')!r}",
                param=f"messages[{i}].content",
            )
        parts.append(part["text"])
    return "".join(parts)


class CompletionRequest(OpenAIRequest):
    prompt: str | list[str]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def _unsupported(self) -> list[str]:
        names = super()._unsupported()
        if self.echo:
            names.append("echo")
        if self.best_of not in (None, 1):
            names.append("best_of")
        if self.suffix:
            names.append("suffix")
        if isinstance(self.prompt, list) and len(self.prompt) != 1:
            names.append("prompt")  # a batch of prompts means n > 1 choices
        return names

    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    @property
    def alternatives(self) -> int:
        return self.logprobs or 0

    def limit(self) -> int | None:
        return self.max_tokens


def invalid_body(error: Mapping[str, Any]) -> GatewayError:
    """The 400 for a body's first validation error (pydantic's error dict), naming the field."""
    loc = [str(part) for part in error["loc"] if part != "body"]
    # The union types of `stop`/`content` add the tried type to the location; keep the field.
    param = ".".join(p for p in loc if not p.startswith(("str", "list[", "dict[", "int", "function")))
    return GatewayError(400, f"`{param or 'body'}`: {error['msg']}", param=param or None)
