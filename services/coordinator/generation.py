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
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Protocol

import structlog

from pipeshard.errors import InvalidArgument, PipeshardError, Unavailable
from pipeshard.services.coordinator.detokenizer import IncrementalDetokenizer
from pipeshard.services.coordinator.sampling import Sampler, SamplingParams
from pipeshard.services.coordinator.speculation.acceptance import accept_greedy, accept_sampled
from pipeshard.services.coordinator.speculation.drafts import Draft, Drafter
from pipeshard.services.coordinator.speculation.policy import KPolicy, SourceMemory, TimingModel
from pipeshard.services.coordinator.speculation.sources import DraftSources
from pipeshard.services.stage.wire import token_frame
from pipeshard.tensor_codec import decode
from pipeshard.v1 import activation_pb2

log = structlog.get_logger(__name__)


class RingLike(Protocol):
    """What a generation needs of the stages: the gRPC ``Ring`` or the in-process ``LocalRing``."""

    async def open_session(self, session_id: str, capacity: int | None = None) -> int: ...

    async def step(self, frame: activation_pb2.ActivationFrame) -> activation_pb2.StepResult: ...

    async def release_session(self, session_id: str) -> None: ...

    async def abort_session(self, session_id: str, reason: str) -> None: ...


# Prompt tokens per prefill step: the whole context, so a prompt is prefilled in one pass. Measured
# (docs/BENCHMARKS.md, bench-prefill): with the KV cache as graph state, the CPU plugin runs every
# multi-row step on a non-empty cache through its one-token attention kernel (scaled_attn.cpp:
# ``use_one_token = L1 == 1 || (fuse_concat && L0 > 0)``), so a 1024-token prompt in 256-token
# chunks cost 5x the CPU time of one pass; only the first chunk takes the multi-row kernel.
DEFAULT_PREFILL_CHUNK = 4096


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


class _Cursor:
    """Where one session's cache stands on every stage: physical length written, logical
    length kept, and the rejected ranges the next frame must mask out."""

    def __init__(self, session_id: str, greedy: bool, *, truncates: bool = False):
        self.session_id = session_id
        self.greedy = greedy
        self.truncates = truncates  # the ring rewinds by shortening the cache (paged): no holes
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
            if self.truncates:
                self.physical -= n


def _take(
    new: list[int], generated: list[int], detok: IncrementalDetokenizer, stop_ids: set[int], max_tokens: int
) -> tuple[list[int], str, str]:
    """Appends accepted tokens up to a stop or the limit: (tokens emitted, finish, text delta)."""
    emitted: list[int] = []
    finish = "length"
    for token in new:
        generated.append(token)
        emitted.append(token)
        if token in stop_ids:
            finish = "stop"
        else:
            detok.add(token)
            if detok.stopped:
                finish = "stop"
        if finish == "stop" or len(generated) >= max_tokens:
            break
    done = finish == "stop" or len(generated) >= max_tokens
    return emitted, finish, detok.delta(final=done)


class _Request:
    """One request's state across its steps, so each phase of ``Generation.run`` is a small method."""

    def __init__(
        self,
        session_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        mode: str,
        max_context: int,
        drafter: Drafter | None,
        policy: KPolicy,
        detok: IncrementalDetokenizer,
        stop_ids: set[int],
        truncates: bool = False,
    ):
        self.session_id = session_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.max_context = max_context
        self.drafter = drafter
        self.policy = policy
        self.cursor = _Cursor(session_id, params.greedy, truncates=truncates)
        self.detok = detok
        self.sampler = None if params.greedy else Sampler(params)
        self.sample = None if self.sampler is None else (self.sampler.probabilities, self.sampler.rng)
        self.stop_ids = stop_ids
        self.context = list(prompt_ids)
        self.generated: list[int] = []
        self.stats = Summary("length", len(prompt_ids), 0, 0.0, 0.0, "", self.generated, speculative=mode)
        self.started = time.perf_counter()
        self.first_at = self.started
        self.finish = "length"
        self.pending: list[int] = []  # tokens the stages have not seen yet

    def prefill_frames(self, chunk: int) -> Iterator[activation_pb2.ActivationFrame]:
        """Fill-only frames for all of the prompt but its last chunk, so other sessions' decode
        steps interleave with a long prompt. The chunk size is fixed per server, never chosen by
        load, so a request's output cannot depend on its neighbours."""
        while len(self.prompt_ids) - self.cursor.logical > chunk:
            yield self.cursor.frame(
                self.prompt_ids[self.cursor.logical : self.cursor.logical + chunk], fill_only=True
            )
        self.pending = self.prompt_ids[self.cursor.logical :]

    def draft(self) -> Draft:
        """Chooses K and drafts that many tokens (none on the first step or without a drafter)."""
        if self.drafter is None or not self.generated:
            return Draft([], None, 0.0)
        remaining = self.params.max_tokens - len(self.generated)
        # Rejected drafts use cache room too: always leave room to finish plainly.
        room = self.max_context - self.cursor.physical - remaining
        k_step = self.policy.choose(min(remaining - 1, room))
        if not k_step:
            return Draft([], None, 0.0)
        return self.drafter.propose(self.context, k_step, self.sample)

    def frame(self, draft: Draft) -> activation_pb2.ActivationFrame:
        """The step's frame: the pending tokens plus the draft, returning a row per draft token + 1."""
        return self.cursor.frame(self.pending + draft.tokens, return_last=len(draft.tokens) + 1)

    def accept(self, draft: Draft, result: activation_pb2.StepResult) -> list[int]:
        """The tokens this step keeps: the agreed draft prefix plus the target's next token."""
        if self.sampler is None:
            return accept_greedy(draft.tokens, list(result.top1.token_ids))
        rows = decode(result.logits, field="logits")
        return accept_sampled(draft.tokens, draft.probs, rows, self.sampler.probabilities, self.sampler.rng)

    def record(self, draft: Draft, new: list[int], elapsed: float) -> None:
        """Masks rejected drafts out of the cache and feeds the K policy and the summary counters."""
        kept = len(new) - 1
        self.cursor.reject(len(draft.tokens) - kept)
        if self.drafter is not None and self.generated:
            self.drafter.commit(kept)
            self.policy.observe(len(draft.tokens), kept, elapsed, draft.seconds)
            if draft.tokens:
                self.stats.verify_steps += 1
                self.stats.draft_tokens += len(draft.tokens)
                self.stats.accepted_tokens += kept
        if not self.generated:
            self.first_at = time.perf_counter()

    async def emit(self, new: list[int]) -> tuple[Chunk, bool]:
        """The chunk for the accepted tokens and whether the request is done (stop or length)."""
        # Detokenization runs on a worker thread: a slow decode must not stall other streams.
        emitted, self.finish, text = await asyncio.to_thread(
            _take, new, self.generated, self.detok, self.stop_ids, self.params.max_tokens
        )
        done = self.finish == "stop" or len(self.generated) >= self.params.max_tokens
        if not done:
            self.context.extend(new)
            self.pending = [new[-1]]
        return Chunk(text=text, token_ids=emitted), done

    def summary(self) -> Summary:
        """The final Summary: finish reason, counts and timings."""
        stats = self.stats
        elapsed = time.perf_counter() - self.first_at
        stats.finish_reason = self.finish
        stats.completion_tokens = len(self.generated)
        stats.ttft_ms = (self.first_at - self.started) * 1000.0
        n = len(self.generated)
        stats.tok_s = (n - 1) / elapsed if n > 1 and elapsed > 0 else 0.0
        stats.text = self.detok.text
        return stats


class Generation:
    """Runs one request over the ring, yielding Chunks and then one Summary."""

    def __init__(
        self,
        ring: RingLike,
        tokenizer,
        eos_ids: set[int],
        *,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        drafts: DraftSources | None = None,
        default_speculative: str = "none",
        max_k: int = 10,
    ):
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

    async def released(self) -> None:
        """Waits for the session releases still under way (before the ring closes)."""
        await asyncio.gather(*self._releases, return_exceptions=True)

    def check_speculative(self, speculative: str, k: int) -> str:
        """The mode a request resolves to; InvalidArgument for an unknown source or K."""
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
        """Streams Chunks then one Summary; raises if nothing was streamed or a stage is
        unreachable, and otherwise ends a failed generation with an "error" Summary."""
        request = await self._open(prompt_ids, params, speculative, k)
        failure = ""  # why the generation failed on the ring, if it did
        try:
            for frame in request.prefill_frames(self._prefill_chunk):
                await self._ring.step(frame)
            done = False
            while not done:
                chunk, done = await self._step(request)
                yield chunk
        except PipeshardError as exc:
            failure = str(exc) or type(exc).__name__
            if not request.generated or isinstance(exc, Unavailable):
                # Nothing streamed yet, or a stage is unreachable (a fault a client may retry, and
                # a drain's end): the call ends with that status code, naming the stage.
                raise
            # Output already streamed: end it with a summary that says what failed.
            log.warning("generation_failed", session_id=request.session_id, code=exc.code, error=failure)
            request.finish, request.stats.error = "error", failure
        finally:
            self._close(request, failure)
        yield request.summary()

    async def _open(
        self, prompt_ids: list[int], params: SamplingParams, speculative: str, k: int
    ) -> _Request:
        """Validates the request, opens its session on every stage and sets up its drafter and K policy."""
        mode = self.check_speculative(speculative, k)
        factory = None if mode == "none" else await self._drafts.factory(mode)
        session_id = uuid.uuid4().hex
        # The cache room the request can use: its prompt, its tokens and one verify step's drafts.
        capacity = len(prompt_ids) + params.max_tokens + self.max_k + 1
        max_context = await self._ring.open_session(session_id, capacity)
        drafter = factory() if factory else None
        memory = None if mode == "none" else self._sources.setdefault(mode, SourceMemory())
        return _Request(
            session_id,
            prompt_ids,
            params,
            mode=mode,
            max_context=max_context,
            drafter=drafter,
            policy=KPolicy(self.timing, fixed_k=k or None, max_k=self.max_k, memory=memory),
            detok=IncrementalDetokenizer(self._tok, params.stop),
            stop_ids=set(params.stop_token_ids) | (set() if params.ignore_eos else self._eos),
            truncates=getattr(self._ring, "truncates_on_rewind", False),
        )

    async def _step(self, request: _Request) -> tuple[Chunk, bool]:
        """One traversal: the last token plus any drafts through every stage, then acceptance."""
        draft = request.draft()
        sent = time.perf_counter()
        result = await self._ring.step(request.frame(draft))
        elapsed = time.perf_counter() - sent
        new = request.accept(draft, result)
        request.record(draft, new, elapsed)
        return await request.emit(new)

    def _close(self, request: _Request, failure: str) -> None:
        """Frees the session on every stage in the background, even when the client went away
        mid-stream; a failed generation aborts (each stage logs why) instead of releasing."""
        if request.drafter is not None:
            request.drafter.close()
        ending = (
            self._ring.abort_session(request.session_id, failure)
            if failure
            else self._ring.release_session(request.session_id)
        )
        task = asyncio.ensure_future(ending)
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)
