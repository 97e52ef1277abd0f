"""CoordinatorService over gRPC: GenerateRequest in, Generation run, GenerateResponse stream out."""

from __future__ import annotations

import structlog

from pipeshard.services.coordinator.admission import Admission
from pipeshard.services.coordinator.generation import Chunk, Generation
from pipeshard.services.coordinator.sampling import SamplingParams
from pipeshard.shard.prompting import Prompter
from pipeshard.v1 import coordinator_pb2, coordinator_pb2_grpc

log = structlog.get_logger(__name__)

_FINISH = {
    "stop": coordinator_pb2.FINISH_REASON_STOP,
    "length": coordinator_pb2.FINISH_REASON_LENGTH,
    "cancelled": coordinator_pb2.FINISH_REASON_CANCELLED,
    "error": coordinator_pb2.FINISH_REASON_ERROR,
}


def params_from_proto(p: coordinator_pb2.SamplingParams, default_max_tokens: int) -> SamplingParams:
    return SamplingParams(
        max_tokens=p.max_tokens if p.HasField("max_tokens") else default_max_tokens,
        temperature=p.temperature,
        top_p=p.top_p if p.HasField("top_p") else 1.0,
        top_k=p.top_k,
        seed=p.seed if p.HasField("seed") else None,
        stop=tuple(p.stop),
        stop_token_ids=tuple(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
    )


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServiceServicer):
    def __init__(
        self,
        generation: Generation,
        prompter: Prompter,
        *,
        max_context: int,
        vocab_size: int,
        default_max_tokens: int,
        admission: Admission,
    ):
        self._admission = admission
        self._generation = generation
        self._prompter = prompter
        self._max_context = max_context
        self._vocab_size = vocab_size
        self._default_max_tokens = default_max_tokens

    async def Generate(self, request, context):
        messages = [(m.role, m.content) for m in request.messages]
        prompt_ids = self._prompter.encode(request.prompt, messages)
        params = params_from_proto(request.params, self._default_max_tokens)
        params.validate(
            prompt_tokens=len(prompt_ids), max_context=self._max_context, vocab_size=self._vocab_size
        )
        self._generation.check_speculative(request.speculative, request.k)
        async with self._admission.slot(context.time_remaining() if context else None):
            async for response in self._stream(prompt_ids, params, request.speculative, request.k):
                yield response

    async def _stream(self, prompt_ids: list[int], params: SamplingParams, speculative: str, k: int):
        async for event in self._generation.run(prompt_ids, params, speculative=speculative, k=k):
            if isinstance(event, Chunk):
                yield coordinator_pb2.GenerateResponse(
                    chunk=coordinator_pb2.TokenChunk(text=event.text, token_ids=event.token_ids)
                )
            else:
                yield coordinator_pb2.GenerateResponse(
                    summary=coordinator_pb2.GenerateSummary(
                        finish_reason=_FINISH[event.finish_reason],
                        prompt_tokens=event.prompt_tokens,
                        completion_tokens=event.completion_tokens,
                        ttft_ms=event.ttft_ms,
                        tok_s=event.tok_s,
                        text=event.text,
                        error=event.error,
                        speculative=event.speculative,
                        verify_steps=event.verify_steps,
                        draft_tokens=event.draft_tokens,
                        accepted_tokens=event.accepted_tokens,
                    )
                )
