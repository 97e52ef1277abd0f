"""Coordinator responses as OpenAI objects: whole completions and streamed chunks (chat and text)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from pipeshard.v1 import coordinator_pb2

FINISH = {
    coordinator_pb2.FINISH_REASON_STOP: "stop",
    coordinator_pb2.FINISH_REASON_LENGTH: "length",
}


def usage(summary: coordinator_pb2.GenerateSummary) -> dict:
    return {
        "prompt_tokens": summary.prompt_tokens,
        "completion_tokens": summary.completion_tokens,
        "total_tokens": summary.prompt_tokens + summary.completion_tokens,
    }


@dataclass
class Shaper:
    """Builds the objects of one response; ``chat`` picks chat.completion vs text_completion."""

    id: str
    model: str
    chat: bool
    created: int = 0

    def __post_init__(self) -> None:
        self.created = self.created or int(time.time())

    def _envelope(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _choice(self, text: str | None, finish: str | None, *, delta: bool, role: bool = False) -> dict:
        if not self.chat:
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        if delta:
            body = {"role": "assistant", "content": text or ""} if role else {}
            if text and not role:
                body["content"] = text
            return {"index": 0, "delta": body, "logprobs": None, "finish_reason": finish}
        return {
            "index": 0,
            "message": {"role": "assistant", "content": text, "refusal": None},
            "logprobs": None,
            "finish_reason": finish,
        }

    def completion(self, summary: coordinator_pb2.GenerateSummary) -> dict:
        finish = FINISH.get(summary.finish_reason, "stop")
        return {
            **self._envelope(chunk=False),
            "choices": [self._choice(summary.text, finish, delta=False)],
            "usage": usage(summary),
        }

    def chunk(
        self, text: str | None, finish: str | None = None, *, role: bool = False, with_usage: bool = False
    ) -> dict:
        """One streamed chunk; with ``include_usage`` every chunk carries ``"usage": null``."""
        out = {**self._envelope(chunk=True), "choices": [self._choice(text, finish, delta=True, role=role)]}
        if with_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, summary: coordinator_pb2.GenerateSummary) -> dict:
        """The extra last chunk ``stream_options.include_usage`` asks for: no choices, the usage."""
        return {**self._envelope(chunk=True), "choices": [], "usage": usage(summary)}
