"""Every stage of an export in this process on the paged backend, stepping all sessions together.

Behind the ring's interface, like ``LocalRing``: each ``Generation`` sends its frames and awaits
its result as if it were alone. Underneath, one scheduler forms each step from every frame
waiting: every session's decode row (its last token, plus drafts when it speculates), then
prefill chunks in arrival order while the step's token budget lasts (a step never runs empty:
its first frame always goes). The budget only picks which chunks run; their size is the
generation's fixed prefill chunk, so a session's chunks never depend on its neighbours. In
exact mode at one thread a row's result does not depend on the rows beside it
(tests/coordinator/test_batched_ring.py), so every session gets its solo run's tokens.

The step runs on a worker thread (the event loop meanwhile takes the next frames); after it the
scheduler waits up to ``gather_s`` for the sessions just answered to send their next frames, so
they ride in the same next step instead of trickling into separate ones.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from pathlib import Path

import openvino as ov

from pipeshard.errors import PipeshardError
from pipeshard.precision import DEFAULT_PRECISION
from pipeshard.services.coordinator.local_ring import LOCAL_OWNER
from pipeshard.services.coordinator.ring import StageFailed
from pipeshard.services.stage.domain import StepInput, StepOutput
from pipeshard.services.stage.paged_engine import PagedEngine
from pipeshard.services.stage.wire import result_from_output, stage_error, step_from_frame
from pipeshard.shard.manifest import input_port, load_manifest
from pipeshard.shard.paged import DEFAULT_CACHE_BYTES, PagedShard
from pipeshard.v1 import activation_pb2

# Tokens one step may carry beyond the decode rows; prefill chunks wait for a step with room.
DEFAULT_STEP_TOKENS = 512
# Prompt tokens per prefill frame on the paged backend: its attention kernel takes chunks of a
# prompt on a filled cache at full speed (unlike the stateful one, generation.py), so a long
# prompt shares steps with the others' decode rows instead of stalling them.
PAGED_PREFILL_CHUNK = 256
# A frame of at most this many tokens is a decode row (the last token plus up to 32 drafts).
DECODE_ROW_TOKENS = 33


@dataclass
class _Waiting:
    frame: activation_pb2.ActivationFrame
    tokens: int
    answer: asyncio.Future


class BatchedRing:
    """All stages in-process over paged KV caches; concurrent sessions share each inference."""

    # Rewinds shorten a session (no mask): the generation's cursor keeps physical == logical.
    truncates_on_rewind = True
    prefill_chunk = PAGED_PREFILL_CHUNK

    def __init__(
        self,
        export_dir: Path | str,
        precision: str = DEFAULT_PRECISION,
        num_threads: int | None = None,
        *,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        max_sessions: int = 64,
        step_tokens: int = DEFAULT_STEP_TOKENS,
        gather_s: float = 0.002,
    ):
        self.export_dir = Path(export_dir)
        manifest = load_manifest(self.export_dir)
        core = ov.Core()
        self.shards = [
            PagedShard(self.export_dir, i, precision, num_threads, cache_bytes=cache_bytes, core=core)
            for i in range(manifest.num_stages)
        ]
        self._engines = [PagedEngine(s, max_sessions, idle_timeout_s=float("inf")) for s in self.shards]
        self.max_context = manifest.max_context
        self.vocab_size = manifest.model.vocab_size
        self.step_tokens = step_tokens
        self.gather_s = gather_s
        self.steps_run = 0  # inferences per stage so far (the batching benchmark reads it)
        self.rows_run = 0
        self._queue: list[_Waiting] = []
        self._open: set[str] = set()
        self._arrived: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None

    @property
    def num_stages(self) -> int:
        return len(self._engines)

    def warmup(self) -> None:
        for shard in self.shards:
            shard.warmup()

    async def open_session(self, session_id: str, capacity: int | None = None) -> int:
        opened = []
        try:
            for engine in self._engines:
                engine.open(LOCAL_OWNER, session_id, capacity)
                opened.append(engine)
        except PipeshardError:
            for engine in opened:
                engine.sessions.release(LOCAL_OWNER, session_id)
            raise
        self._open.add(session_id)
        return self.max_context

    async def release_session(self, session_id: str) -> None:
        """Frees the session's blocks on every stage at once; a queued frame of it fails."""
        self._open.discard(session_id)
        for engine in self._engines:
            engine.sessions.release(LOCAL_OWNER, session_id)

    async def abort_session(self, session_id: str, reason: str) -> None:
        await self.release_session(session_id)

    async def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task

    async def step(self, frame: activation_pb2.ActivationFrame) -> activation_pb2.StepResult:
        if self._loop_task is None or self._loop_task.done():  # first step, or a new event loop
            self._arrived = asyncio.Event()
            self._queue = []
            self._loop_task = asyncio.create_task(self._schedule(), name="batched-ring")
        frame.owner = LOCAL_OWNER
        waiting = _Waiting(frame, len(frame.positions), asyncio.get_running_loop().create_future())
        self._queue.append(waiting)
        self._arrived.set()
        return await waiting.answer

    # -- the scheduler ----------------------------------------------------------------------
    async def _schedule(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._arrived.wait()
            deadline = loop.time() + self.gather_s
            while len(self._queue) < len(self._open) and loop.time() < deadline:
                self._arrived.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._arrived.wait(), deadline - loop.time())
            self._arrived.clear()
            batch = self._pick()
            if not batch:
                continue
            try:
                answers = await asyncio.to_thread(self._run, [w.frame for w in batch])
            except Exception as exc:  # an inference failure fails every row of the step
                answers = [StageFailed(stage_error(0, exc))] * len(batch)
            for waiting, answer in zip(batch, answers, strict=True):
                if waiting.answer.done():
                    continue
                if isinstance(answer, BaseException):
                    waiting.answer.set_exception(answer)
                else:
                    waiting.answer.set_result(answer)
            if self._queue:
                self._arrived.set()

    def _pick(self) -> list[_Waiting]:
        """The next step: every decode row, then prefill frames in order while the budget lasts."""
        queue = [w for w in self._queue if not w.answer.done()]  # a cancelled caller's frame drops
        step = [w for w in queue if w.tokens <= DECODE_ROW_TOKENS]
        budget = self.step_tokens
        for w in queue:
            if w.tokens > DECODE_ROW_TOKENS and (w.tokens <= budget or not step):
                step.append(w)
                budget -= w.tokens
        taken = {id(w) for w in step}
        self._queue = [w for w in queue if id(w) not in taken]
        return step

    def _run(self, frames: list[activation_pb2.ActivationFrame]) -> list:
        """Every stage over the step's frames; a frame failing on a stage answers with its error."""
        answers: list = [None] * len(frames)
        live: list[tuple[int, StepInput]] = []
        for i, frame in enumerate(frames):
            try:
                live.append((i, step_from_frame(frame, input_port(True))))
            except PipeshardError as exc:
                answers[i] = StageFailed(stage_error(0, exc))
        for index, engine in enumerate(self._engines):
            if not live:
                break
            outs = engine.run([s for _, s in live])
            nxt = []
            for (i, step), out in zip(live, outs, strict=True):
                if isinstance(out, PipeshardError):
                    answers[i] = StageFailed(stage_error(index, out))
                elif engine.is_last:
                    answers[i] = result_from_output(out)
                else:
                    nxt.append((i, _next_input(step, out)))
            live = nxt
        self.steps_run += 1
        self.rows_run += len(frames)
        return answers


def _next_input(step: StepInput, out: StepOutput) -> StepInput:
    """The next stage's input in-process: the same step carrying this stage's hidden states."""
    step.activations = out.hidden_states
    return step
