"""Coordinator responses as OpenAI objects: whole completions and streamed chunks (chat and text)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from pipeshard.services.gateway.tools import ToolCall, ToolPlan
from pipeshard.v1 import coordinator_pb2

FINISH = {
    coordinator_pb2.FINISH_REASON_STOP: "stop",
    coordinator_pb2.FINISH_REASON_LENGTH: "length",
}


def usage(summaries: Sequence[coordinator_pb2.GenerateSummary]) -> dict:
    """The usage of one generation, or of n choices of one prompt: the prompt counted once (as
    the first choice saw it), every choice's tokens."""
    first = summaries[0]
    completion = sum(s.completion_tokens for s in summaries)
    return {
        "prompt_tokens": first.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": first.prompt_tokens + completion,
        # prompt tokens this caller's prefix cache restored (OpenAI's field of the same name)
        "prompt_tokens_details": {"cached_tokens": first.cached_tokens},
    }


@dataclass
class Shaper:
    """Builds the objects of one response; ``chat`` picks chat.completion vs text_completion;
    ``logprobs`` adds each token's logprob object to the choices. ``system_fingerprint`` is the
    fleet's (GenerateSummary): objects built before the summary arrives carry null, as OpenAI's
    may."""

    id: str
    model: str
    chat: bool
    created: int = 0
    logprobs: bool = False
    tools: ToolPlan | None = None  # the request's tools: an answer may be a call
    system_fingerprint: str | None = None
    _offset: int = 0  # characters of generated text before the next token (completions' text_offset)

    def __post_init__(self) -> None:
        self.created = self.created or int(time.time())

    def _envelope(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.system_fingerprint,
        }

    def summarized(self, summary: coordinator_pb2.GenerateSummary) -> None:
        """Takes the fleet's system_fingerprint from the final summary for the objects after it."""
        self.system_fingerprint = summary.system_fingerprint or None

    def token_logprobs(
        self,
        tokens: Sequence[str],
        logprobs: Sequence[float],
        tops: Sequence[coordinator_pb2.TopLogprobs] = (),
    ) -> dict | None:
        """OpenAI's logprobs object for these tokens (chat: ``content``; completions: parallel
        lists), with each position's most likely tokens when they were asked for (``tops``)."""
        if not self.logprobs:
            return None
        alternatives = [list(zip(t.tokens, t.logprobs, strict=True)) for t in tops] or [[] for _ in tokens]
        if self.chat:
            content = [
                {
                    "token": t,
                    "logprob": lp,
                    "bytes": list(t.encode()),
                    "top_logprobs": [{"token": a, "logprob": b, "bytes": list(a.encode())} for a, b in alt],
                }
                for t, lp, alt in zip(tokens, logprobs, alternatives, strict=True)
            ]
            return {"content": content, "refusal": None}
        offsets = []
        for t in tokens:
            offsets.append(self._offset)
            self._offset += len(t)
        return {
            "tokens": list(tokens),
            "token_logprobs": list(logprobs),
            "top_logprobs": [dict(alt) for alt in alternatives] if tops else None,
            "text_offset": offsets,
        }

    def _choice(
        self,
        text: str | None,
        finish: str | None,
        *,
        delta: bool,
        role: bool = False,
        logprobs: dict | None = None,
    ) -> dict:
        if not self.chat:
            return {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        if delta:
            body = {"role": "assistant", "content": text or ""} if role else {}
            if text and not role:
                body["content"] = text
            return {"index": 0, "delta": body, "logprobs": logprobs, "finish_reason": finish}
        return {
            "index": 0,
            "message": {"role": "assistant", "content": text, "refusal": None},
            "logprobs": logprobs,
            "finish_reason": finish,
        }

    def completion(
        self,
        summary: coordinator_pb2.GenerateSummary,
        tokens: Sequence[str] = (),
        logprobs: Sequence[float] = (),
        tops: Sequence[coordinator_pb2.TopLogprobs] = (),
    ) -> dict:
        self.summarized(summary)
        finish = FINISH.get(summary.finish_reason, "stop")
        choice = self._choice(
            summary.text, finish, delta=False, logprobs=self.token_logprobs(tokens, logprobs, tops)
        )
        call = self.tool_call(summary.text) if finish == "stop" else None
        if call is not None:
            choice["message"].update(content=None, tool_calls=[call.body()])
            choice["finish_reason"] = "tool_calls"
        return {**self._envelope(chunk=False), "choices": [choice], "usage": usage([summary])}

    def completions(self, results: Sequence[tuple]) -> dict:
        """One object of several choices, each from one generation's (summary, tokens, logprobs,
        tops); usage counts the prompt once and every choice's tokens."""
        answers = [self.completion(*result) for result in results]
        out = answers[0]
        out["choices"] = [{**a["choices"][0], "index": i} for i, a in enumerate(answers)]
        out["usage"] = usage([result[0] for result in results])
        return out

    def chunk(
        self,
        text: str | None,
        finish: str | None = None,
        *,
        role: bool = False,
        with_usage: bool = False,
        logprobs: dict | None = None,
        index: int = 0,
    ) -> dict:
        """One streamed chunk of choice ``index``; with ``include_usage`` every chunk carries
        ``"usage": null``."""
        choice = {**self._choice(text, finish, delta=True, role=role, logprobs=logprobs), "index": index}
        out = {**self._envelope(chunk=True), "choices": [choice]}
        if with_usage:
            out["usage"] = None
        return out

    @property
    def holds_text(self) -> bool:
        """A streamed answer that may be a tool call is held back until it ends."""
        return self.chat and self.tools is not None and self.tools.calls

    def tool_call(self, text: str) -> ToolCall | None:
        return None if self.tools is None else self.tools.parse(text)

    def tool_call_chunk(self, call: ToolCall, with_usage: bool, index: int = 0) -> dict:
        """The streamed delta of a whole call (OpenAI's ``delta.tool_calls`` with its index)."""
        out = self.chunk(None, with_usage=with_usage, index=index)
        out["choices"][0]["delta"] = {"tool_calls": [{"index": 0, **call.body()}]}
        return out

    def usage_chunk(self, summaries: Sequence[coordinator_pb2.GenerateSummary]) -> dict:
        """The extra last chunk ``stream_options.include_usage`` asks for: no choices, the usage
        (of every choice)."""
        self.summarized(summaries[0])
        return {**self._envelope(chunk=True), "choices": [], "usage": usage(summaries)}
