"""The Generate call an OpenAI body asks for, and the failures its summary may report.

One place for both routes of the gateway and for batch files (batch_file.py), so a batch line
is validated and answered exactly as the same body posted to the gateway.
"""

from __future__ import annotations

import uuid

from pipeshard.clients.client import build_request
from pipeshard.services.gateway.errors import GatewayError
from pipeshard.services.gateway.responses import Shaper
from pipeshard.services.gateway.schema import ChatCompletionRequest, CompletionRequest
from pipeshard.v1 import coordinator_pb2


def generate_call(
    body: ChatCompletionRequest | CompletionRequest, model_name: str
) -> tuple[coordinator_pb2.GenerateRequest, Shaper]:
    """The checked body's Generate request and the shaper of its answer (GatewayError if refused)."""
    body.check()
    chat = isinstance(body, ChatCompletionRequest)
    rpc = build_request(
        messages=body.chat() if isinstance(body, ChatCompletionRequest) else [],
        max_tokens=body.limit(),
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=body.seed,
        stop=body.stop_list(),
        ignore_eos=body.ignore_eos,
        tree=body.tree or "",
        request_id=uuid.uuid4().hex[:24],
        logprobs=body.wants_logprobs,
    )
    rpc.params.top_logprobs = body.alternatives
    rpc.params.presence_penalty = body.presence_penalty or 0.0
    rpc.params.frequency_penalty = body.frequency_penalty or 0.0
    rpc.params.logit_bias.update(body.token_biases())
    grammar = body.grammar()
    if grammar is not None:
        rpc.params.grammar.CopyFrom(grammar)
    if isinstance(body, CompletionRequest):
        rpc.prompt = body.text()  # raw text, no chat template (build_request wraps a prompt as a message)
    kind = "chatcmpl" if chat else "cmpl"
    shaper = Shaper(
        f"{kind}-{rpc.request_id}",
        body.model or model_name,
        chat=chat,
        logprobs=body.wants_logprobs,
        tools=body.tool_plan(),
    )
    return rpc, shaper


def failed(summary: coordinator_pb2.GenerateSummary) -> GatewayError | None:
    """The error a finished generation's summary reports, if any."""
    if summary.finish_reason == coordinator_pb2.FINISH_REASON_ERROR:
        return GatewayError(503, summary.error or "the generation failed", code="generation_failed")
    if summary.finish_reason == coordinator_pb2.FINISH_REASON_CANCELLED:
        return GatewayError(499, "the generation was cancelled", code="cancelled")
    return None
