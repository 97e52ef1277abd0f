"""The decode loop of one request: open a session on every stage, prefill, decode, release.

Each request owns its session (its own KV state on every stage), so any number run
concurrently on one ring; the ring interleaves their frames.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np

from pipeshard.tensor_codec import decode, encode
from pipeshard.v1 import activation_pb2, tensor_pb2
from services.coordinator.detokenizer import IncrementalDetokenizer
from services.coordinator.ring import Ring
from services.coordinator.sampling import Sampler, SamplingParams


@dataclass
class Chunk:
    text: str
    token_ids: list[int]


@dataclass
class Summary:
    finish_reason: str  # "stop" | "length" | "cancelled" | "error"
    prompt_tokens: int
    completion_tokens: int
    ttft_ms: float
    tok_s: float
    text: str
    token_ids: list[int]
    error: str = ""


def token_frame(
    session_id: str, step: int, ids: list[int], start: int, greedy: bool, *, fill_only: bool = False
) -> activation_pb2.ActivationFrame:
    """The frame that carries token ids into stage 0 (``fill_only``: a prefill chunk, no result)."""
    if fill_only:
        mode = activation_pb2.RETURN_MODE_NONE
    else:
        mode = activation_pb2.RETURN_MODE_TOP1 if greedy else activation_pb2.RETURN_MODE_LOGITS
    return activation_pb2.ActivationFrame(
        session_id=session_id,
        step_id=step,
        positions=range(start, start + len(ids)),
        tensors=[tensor_pb2.NamedTensor(name="input_ids", tensor=encode(np.asarray([ids], dtype=np.int64)))],
        return_mode=mode,
        return_last=1,
        sent_unix_nanos=time.time_ns(),
    )


class Generation:
    """Runs one request over the ring, yielding Chunks and then one Summary."""

    def __init__(self, ring: Ring, tokenizer, eos_ids: set[int], *, prefill_chunk: int = 256):
        self._ring = ring
        self._prefill_chunk = prefill_chunk
        self._tok = tokenizer
        self._eos = eos_ids
        self._releases: set[asyncio.Task] = set()

    async def run(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[Chunk | Summary]:
        session_id = uuid.uuid4().hex
        await self._ring.open_session(session_id)
        detok = IncrementalDetokenizer(self._tok, params.stop)
        sampler = None if params.greedy else Sampler(params)
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self._eos)
        generated: list[int] = []
        started = time.perf_counter()
        first_at = started
        finish = "length"
        try:
            # Chunked prefill: every chunk but the last only fills the cache, so other sessions'
            # decode steps interleave with a long prompt. The chunk size is fixed per server, never
            # chosen by load, so a request's output cannot depend on its neighbours.
            step, position = 0, 0
            while len(prompt_ids) - position > self._prefill_chunk:
                chunk = prompt_ids[position : position + self._prefill_chunk]
                await self._ring.step(
                    token_frame(session_id, step, chunk, position, params.greedy, fill_only=True)
                )
                step, position = step + 1, position + len(chunk)
            ids = prompt_ids[position:]
            while len(generated) < params.max_tokens:
                result = await self._ring.step(token_frame(session_id, step, ids, position, params.greedy))
                step += 1
                position += len(ids)
                if sampler is None:
                    token = int(result.top1.token_ids[-1])
                else:
                    token = sampler.sample(decode(result.logits, field="logits")[-1])
                if not generated:
                    first_at = time.perf_counter()
                generated.append(token)
                if token in stop_ids:
                    finish = "stop"
                else:
                    detok.add(token)
                    if detok.stopped:
                        finish = "stop"
                done = finish == "stop" or len(generated) >= params.max_tokens
                yield Chunk(text=detok.delta(final=done), token_ids=[token])
                if done:
                    break
                ids = [token]
        finally:
            # Free the state on every stage even when the client went away mid-stream.
            task = asyncio.ensure_future(self._ring.release_session(session_id))
            self._releases.add(task)
            task.add_done_callback(self._releases.discard)
        elapsed = time.perf_counter() - first_at
        yield Summary(
            finish_reason=finish,
            prompt_tokens=len(prompt_ids),
            completion_tokens=len(generated),
            ttft_ms=(first_at - started) * 1000.0,
            tok_s=(len(generated) - 1) / elapsed if len(generated) > 1 and elapsed > 0 else 0.0,
            text=detok.text,
            token_ids=generated,
        )
