"""The decode loop of one request: open a session on every stage, prefill, decode, release.

Each request owns its session (its own KV state on every stage), so any number run
concurrently on one ring; the ring interleaves their frames.

Decoding is speculative when the request asks for a draft source: each step sends the last
token plus K drafted tokens through the pipeline in one traversal (K = 0 is a plain step) and
keeps what the target agrees with. Rejected positions stay in every stage's cache and are
masked out by the next frame's mask update; positions are logical, so the sequence continues
as if they had never been written.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np

from pipeshard.services.coordinator.detokenizer import IncrementalDetokenizer
from pipeshard.services.coordinator.sampling import Sampler, SamplingParams
from pipeshard.services.coordinator.speculation.acceptance import accept_greedy, accept_sampled
from pipeshard.services.coordinator.speculation.drafts import Draft
from pipeshard.services.coordinator.speculation.policy import KPolicy, SourceMemory, TimingModel
from pipeshard.services.coordinator.speculation.sources import DraftSources
from pipeshard.tensor_codec import decode, encode
from pipeshard.v1 import activation_pb2, tensor_pb2


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
    speculative: str = "none"
    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0


def token_frame(
    session_id: str,
    step: int,
    ids: list[int],
    start: int,
    greedy: bool,
    *,
    fill_only: bool = False,
    return_last: int = 1,
    invalidate: list[tuple[int, int]] | None = None,
) -> activation_pb2.ActivationFrame:
    """The frame that carries token ids into stage 0 at logical positions ``start...``.

    ``fill_only``: a prefill chunk, no result; otherwise the final stage answers for the last
    ``return_last`` ids (the last token and the drafts after it). ``invalidate``: physical cache
    ranges every stage masks out before running (rejected drafts of the previous step).
    """
    if fill_only:
        mode = activation_pb2.RETURN_MODE_NONE
    else:
        mode = activation_pb2.RETURN_MODE_TOP1 if greedy else activation_pb2.RETURN_MODE_LOGITS
    return activation_pb2.ActivationFrame(
        session_id=session_id,
        step_id=step,
        positions=range(start, start + len(ids)),
        mask_update=activation_pb2.MaskUpdate(
            invalidate=[activation_pb2.CacheRange(start=s, end=e) for s, e in invalidate or ()]
        ),
        tensors=[tensor_pb2.NamedTensor(name="input_ids", tensor=encode(np.asarray([ids], dtype=np.int64)))],
        return_mode=mode,
        return_last=return_last,
        sent_unix_nanos=time.time_ns(),
    )


class _Cursor:
    """Where one session's cache stands on every stage: physical length written, logical
    length kept, and the rejected ranges the next frame must mask out."""

    def __init__(self, session_id: str, greedy: bool):
        self.session_id = session_id
        self.greedy = greedy
        self.step = 0
        self.physical = 0
        self.logical = 0
        self._rejected: list[tuple[int, int]] = []

    def frame(
        self, ids: list[int], *, fill_only: bool = False, return_last: int = 1
    ) -> activation_pb2.ActivationFrame:
        frame = token_frame(
            self.session_id,
            self.step,
            ids,
            self.logical,
            self.greedy,
            fill_only=fill_only,
            return_last=return_last,
            invalidate=self._rejected,
        )
        self._rejected = []
        self.step += 1
        self.physical += len(ids)
        self.logical += len(ids)
        return frame

    def reject(self, n: int) -> None:
        """The last ``n`` positions written hold rejected drafts."""
        if n:
            self._rejected.append((self.physical - n, self.physical))
            self.logical -= n


class Generation:
    """Runs one request over the ring, yielding Chunks and then one Summary."""

    def __init__(
        self,
        ring,
        tokenizer,
        eos_ids: set[int],
        *,
        prefill_chunk: int = 256,
        drafts: DraftSources | None = None,
        default_speculative: str = "none",
        max_k: int = 10,
    ):
        """``ring`` is anything with async ``open_session``, ``step`` and ``release_session``:
        the gRPC ``Ring`` or the in-process one."""
        self._ring = ring
        self._prefill_chunk = prefill_chunk
        self._tok = tokenizer
        self._eos = eos_ids
        self._drafts = drafts
        self.default_speculative = default_speculative
        self.max_k = max_k
        self.timing = TimingModel()  # traversal cost by positions, learned across requests
        self._sources: dict[str, SourceMemory] = {}  # acceptance by draft source, across requests
        self._releases: set[asyncio.Task] = set()

    def check_speculative(self, speculative: str, k: int) -> str:
        """The mode a request resolves to; InvalidArgument for an unknown source or K."""
        from pipeshard.errors import InvalidArgument

        mode = speculative or self.default_speculative
        if not 0 <= k <= 32:
            raise InvalidArgument("k", f"must be 0 (adaptive) or 1..32, got {k}")
        if mode != "none":
            if self._drafts is None:
                raise InvalidArgument("speculative", "this coordinator has no draft sources")
            self._drafts.validate(mode)
        return mode

    async def run(
        self, prompt_ids: list[int], params: SamplingParams, *, speculative: str = "", k: int = 0
    ) -> AsyncIterator[Chunk | Summary]:
        mode = self.check_speculative(speculative, k)
        factory = None if mode == "none" else await self._drafts.factory(mode)
        session_id = uuid.uuid4().hex
        max_context = await self._ring.open_session(session_id)
        drafter = factory() if factory else None
        memory = None if mode == "none" else self._sources.setdefault(mode, SourceMemory())
        policy = KPolicy(self.timing, fixed_k=k or None, max_k=self.max_k, memory=memory)
        cursor = _Cursor(session_id, params.greedy)
        detok = IncrementalDetokenizer(self._tok, params.stop)
        sampler = None if params.greedy else Sampler(params)
        sample = None if sampler is None else (sampler.probabilities, sampler.rng)
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self._eos)
        context = list(prompt_ids)
        generated: list[int] = []
        stats = Summary("length", len(prompt_ids), 0, 0.0, 0.0, "", generated, speculative=mode)
        started = time.perf_counter()
        first_at = started
        finish = "length"
        try:
            # Chunked prefill: every chunk but the last only fills the cache, so other sessions'
            # decode steps interleave with a long prompt. The chunk size is fixed per server, never
            # chosen by load, so a request's output cannot depend on its neighbours.
            while len(prompt_ids) - cursor.logical > self._prefill_chunk:
                chunk = prompt_ids[cursor.logical : cursor.logical + self._prefill_chunk]
                await self._ring.step(cursor.frame(chunk, fill_only=True))
            pending = prompt_ids[cursor.logical :]  # tokens the stages have not seen yet
            while True:
                draft = Draft([], None, 0.0)
                if drafter is not None and generated:
                    remaining = params.max_tokens - len(generated)
                    # Rejected drafts use cache room too: always leave room to finish plainly.
                    room = max_context - cursor.physical - remaining
                    k_step = policy.choose(min(remaining - 1, room))
                    if k_step:
                        draft = drafter.propose(context, k_step, sample)
                sent = time.perf_counter()
                frame = cursor.frame(pending + draft.tokens, return_last=len(draft.tokens) + 1)
                result = await self._ring.step(frame)
                elapsed = time.perf_counter() - sent
                if sampler is None:
                    new = accept_greedy(draft.tokens, list(result.top1.token_ids))
                else:
                    rows = decode(result.logits, field="logits")
                    new = accept_sampled(draft.tokens, draft.probs, rows, sampler.probabilities, sampler.rng)
                kept = len(new) - 1
                cursor.reject(len(draft.tokens) - kept)
                if drafter is not None and generated:
                    drafter.commit(kept)
                    policy.observe(len(draft.tokens), kept, elapsed, draft.seconds)
                    if draft.tokens:
                        stats.verify_steps += 1
                        stats.draft_tokens += len(draft.tokens)
                        stats.accepted_tokens += kept
                if not generated:
                    first_at = time.perf_counter()
                emitted = []
                for token in new:
                    generated.append(token)
                    emitted.append(token)
                    if token in stop_ids:
                        finish = "stop"
                    else:
                        detok.add(token)
                        if detok.stopped:
                            finish = "stop"
                    if finish == "stop" or len(generated) >= params.max_tokens:
                        break
                done = finish == "stop" or len(generated) >= params.max_tokens
                yield Chunk(text=detok.delta(final=done), token_ids=emitted)
                if done:
                    break
                context.extend(new)
                pending = [new[-1]]
        finally:
            if drafter is not None:
                drafter.close()
            # Free the state on every stage even when the client went away mid-stream.
            task = asyncio.ensure_future(self._ring.release_session(session_id))
            self._releases.add(task)
            task.add_done_callback(self._releases.discard)
        elapsed = time.perf_counter() - first_at
        stats.finish_reason = finish
        stats.completion_tokens = len(generated)
        stats.ttft_ms = (first_at - started) * 1000.0
        stats.tok_s = (len(generated) - 1) / elapsed if len(generated) > 1 and elapsed > 0 else 0.0
        stats.text = detok.text
        yield stats
