"""Forms each step of continuous batching from the frames of every running session.

Each ``Generation`` sends its frame and awaits its result as if it were alone; the batcher
queues the frames and one scheduler task forms each step from them: every decode row (the last
token, plus drafts when the session speculates), then prefill chunks in arrival order while the
step's token budget lasts (a step never runs empty: its first frame always goes). The budget
only picks which chunks run; their size is the generation's fixed prefill chunk, so a session's
chunks never depend on its neighbours.

After a step the scheduler waits up to ``gather_s`` for the sessions just answered to send their
next frames, so they ride in the same next step instead of trickling into separate ones.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from pipeshard.v1 import activation_pb2

# Tokens one step may carry beyond the decode rows; prefill chunks wait for a step with room.
DEFAULT_STEP_TOKENS = 512
# Prompt tokens per prefill frame on the paged backend: its attention kernel takes chunks of a
# prompt on a filled cache at full speed (unlike the stateful one, generation.py), so a long
# prompt shares steps with the others' decode rows instead of stalling them.
PAGED_PREFILL_CHUNK = 256
# A frame of at most this many tokens is a decode row (the last token plus up to 32 drafts).
DECODE_ROW_TOKENS = 33

# Runs one step's frames; answers each with its StepResult or the exception to raise.
StepRunner = Callable[[list[activation_pb2.ActivationFrame]], Awaitable[list]]


@dataclass
class _Waiting:
    frame: activation_pb2.ActivationFrame
    tokens: int
    answer: asyncio.Future


class StepBatcher:
    def __init__(
        self,
        run: StepRunner,
        sessions: Callable[[], int],
        step_tokens: int = DEFAULT_STEP_TOKENS,
        gather_s: float = 0.002,
    ):
        self._run = run
        self._sessions = sessions  # how many sessions are open (the most frames a step can wait for)
        self.step_tokens = step_tokens
        self.gather_s = gather_s
        self.steps_run = 0  # steps formed so far (benchmarks and tests read it)
        self.rows_run = 0
        self._queue: list[_Waiting] = []
        self._arrived: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    async def step(self, frame: activation_pb2.ActivationFrame) -> activation_pb2.StepResult:
        if self._task is None or self._task.done():  # first step, or a new event loop
            self._arrived = asyncio.Event()
            self._queue = []
            self._task = asyncio.create_task(self._schedule(), name="step-batcher")
        waiting = _Waiting(frame, len(frame.positions), asyncio.get_running_loop().create_future())
        self._queue.append(waiting)
        self._arrived.set()
        return await waiting.answer

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _schedule(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._arrived.wait()
            deadline = loop.time() + self.gather_s
            while len(self._queue) < self._sessions() and loop.time() < deadline:
                self._arrived.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._arrived.wait(), deadline - loop.time())
            self._arrived.clear()
            batch = self._pick()
            if not batch:
                continue
            self.steps_run += 1
            self.rows_run += len(batch)
            answers = await self._run([w.frame for w in batch])
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
