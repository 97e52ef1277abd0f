"""Tool calls (OpenAI's ``tools`` and ``tool_choice``): the tools rendered into the prompt, the
grammar that holds a required or named call to its function's schema, and the answer parsed
back into ``tool_calls``.

The default model's chat template has no tool syntax, so the tools are described in a system
message of a fixed, documented form (docs/CLIENTS.md); a call is the answer
``{"name": ..., "arguments": {...}}``. ``required`` and a named function are enforced by the
grammar engine (the arguments always validate against the function's parameters); ``auto`` lets
the model choose, and an answer that is such an object naming a tool is a call.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pipeshard.services.gateway.errors import GatewayError

INSTRUCTIONS = (
    "You can call functions. To call one, answer with only a JSON object "
    '{"name": <function name>, "arguments": <its arguments>} and nothing else. Functions:'
)


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionSpec


class NamedChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    class Name(BaseModel):
        name: str

    type: Literal["function"]
    function: Name


ToolChoice = Literal["none", "auto", "required"] | NamedChoice


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI's
    id: str

    def body(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class ToolPlan:
    """What one request does with its tools: ``mode`` none, auto, required or a function's name."""

    tools: tuple[Tool, ...]
    mode: str

    @classmethod
    def of(cls, tools: list[Tool] | None, choice: ToolChoice | None) -> ToolPlan | None:
        if not tools:
            if choice not in (None, "none"):
                raise GatewayError(400, "`tool_choice` needs `tools`", param="tool_choice")
            return None
        for i, tool in enumerate(tools):
            if tool.function.parameters is None:
                raise GatewayError(
                    400,
                    f"`tools[{i}].function.parameters`: a JSON schema of the arguments is required",
                    param=f"tools[{i}].function.parameters",
                )
        names = [t.function.name for t in tools]
        if len(set(names)) != len(names):
            raise GatewayError(400, "`tools`: function names must be unique", param="tools")
        if isinstance(choice, NamedChoice):
            if choice.function.name not in names:
                raise GatewayError(
                    400, f"`tool_choice`: no tool is named {choice.function.name!r}", param="tool_choice"
                )
            return cls(tuple(tools), choice.function.name)
        return cls(tuple(tools), choice or "auto")

    @property
    def calls(self) -> bool:
        """The answer may be a call (parsed, and held back while streaming)."""
        return self.mode != "none"

    def system_message(self) -> dict[str, str]:
        lines = [INSTRUCTIONS]
        for tool in self.tools:
            f = tool.function
            about = f" {f.description}" if f.description else ""
            lines.append(f"- {f.name}:{about} Arguments: {json.dumps(f.parameters, separators=(',', ':'))}")
        return {"role": "system", "content": "\n".join(lines)}

    def schema(self) -> dict | None:
        """The JSON schema a required or named call's answer follows (None: free answer)."""
        if self.mode in ("none", "auto"):
            return None
        chosen = [t for t in self.tools if self.mode == "required" or t.function.name == self.mode]
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": t.function.name}, "arguments": t.function.parameters},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for t in chosen
        ]
        return calls[0] if len(calls) == 1 else {"anyOf": calls}

    def parse(self, text: str) -> ToolCall | None:
        """The call the answer makes, or None when it is plain text."""
        if not self.calls:
            return None
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return None
        names = {t.function.name for t in self.tools}
        if (
            not isinstance(value, dict)
            or set(value) != {"name", "arguments"}
            or value["name"] not in names
            or not isinstance(value["arguments"], dict)
        ):
            return None
        return ToolCall(value["name"], json.dumps(value["arguments"]), f"call_{uuid.uuid4().hex[:24]}")


def call_text(tool_calls: list[dict[str, Any]], i: int) -> str:
    """An earlier assistant turn's calls as the text the model would have written."""
    out = []
    for j, call in enumerate(tool_calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise GatewayError(
                400,
                f"`messages[{i}].tool_calls[{j}].function.name` is required",
                param=f"messages[{i}].tool_calls[{j}]",
            )
        try:
            arguments = json.loads(function.get("arguments") or "{}")
        except json.JSONDecodeError:
            raise GatewayError(
                400,
                f"`messages[{i}].tool_calls[{j}].function.arguments` is not JSON",
                param=f"messages[{i}].tool_calls[{j}].function.arguments",
            ) from None
        out.append(json.dumps({"name": function["name"], "arguments": arguments}))
    return "\n".join(out)
