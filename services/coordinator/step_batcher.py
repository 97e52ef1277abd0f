"""Forms each step of continuous batching from the frames of every running session.

Each ``Generation`` sends its frame (a plan of one row) and awaits its result as if it were
alone; the batcher queues the frames and one scheduler task forms each step from them by what
each row is (its ``RowKind``): decode and verify rows (the last token, plus drafts when the
session speculates), then prefill chunks (a prompt's first rows) while the step's token
budget lasts (a step never runs empty: its first frame always goes). The budget only picks
which chunks run; their size is the generation's fixed prefill chunk, so a session's chunks
never depend on its neighbours.

Fair latency: a session's first frame and any chunk already passed over once go ahead of the
other chunks (in arrival order among them), so a newcomer's first chunk gets into the next step
however many long prompts are being prefilled, and a passed-over chunk goes before any frame
that arrived after it: nothing waits more than a few steps.

No pipeline bubble: up to ``inflight`` steps travel at once (on a fleet of N stages, N: each
stage works on a different step). Each session has at most one step in flight (its generation
awaits the result before sending on), so the running sessions split into about ``inflight``
groups: a step takes at most its share, ceil(open sessions / inflight), of the decode rows.

A failover's resend leaves at once (``expedite``): the moved session has waited through a restore
already, and behind the steps in flight (after a failover often the other moved sessions' resends,
each carrying the replay tail its copy lacked) it waited up to two such steps more.

Micro-batches of a batch job (batch_jobs.py): a job's sessions step under its :class:`Grouping`
(their :class:`StepSlot`'s), so a step takes at most ceil(the job's sessions / its ``count``) of
their decode rows, and up to that many steps travel at once; the
other sessions keep their share of ``inflight`` groups, so a job's count never regroups
interactive rows.

After a step the scheduler waits up to ``gather_s`` for the sessions just answered to send their
next frames, so they ride in the same next step instead of trickling into separate ones. A frame
that completes the queue (a lone session's always does) launches its step at once, with no
scheduler turn between.

Batch-aware K (speculation/policy.py): the batcher times each step of decode rows
from send to result and fits its cost by rows and positions once for all sessions (``timing``), and
tells a request what else rode in its last step (its slot's ``load``): the step its next frame
will join.

What the batcher knows of a request between its steps lives on the request's :class:`StepSlot`
(its grouping, its last step's load, whether its next frame is expedited), not in maps keyed by
session id: a failover gives the request a new session and keeps its slot.
Steps carrying prefill chunks are not timed: a chunk's positions cost less each than a verify
row's (the multi-row attention kernel), and K is chosen for decode steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from pipeshard import trace
from pipeshard.services.coordinator.speculation.policy import StepLoad, TimingModel
from pipeshard.v1 import activation_pb2

# Tokens one step may carry beyond the decode rows; prefill chunks wait for a step with room.
DEFAULT_STEP_TOKENS = 512
# Prompt tokens per prefill step: the whole context, so a prompt is prefilled in one pass. Measured
# (docs/BENCHMARKS.md, bench-prefill): with the KV cache as graph state, the CPU plugin runs every
# multi-row step on a non-empty cache through its one-token attention kernel (scaled_attn.cpp:
# ``use_one_token = L1 == 1 || (fuse_concat && L0 > 0)``), so a 1024-token prompt in 256-token
# chunks cost 5x the CPU time of one pass; only the first chunk takes the multi-row kernel.
DEFAULT_PREFILL_CHUNK = 4096
# Prompt tokens per prefill frame on the paged backend: its attention kernel takes chunks of a
# prompt on a filled cache at full speed (unlike the stateful one, above), so a long
# prompt shares steps with the others' decode rows instead of stalling them.
PAGED_PREFILL_CHUNK = 256

# Runs one step's frames; answers each with its StepResult or the exception to raise.
StepRunner = Callable[[list[activation_pb2.ActivationFrame]], Awaitable[list]]


@dataclass(eq=False)
class Grouping:
    """A batch job's micro-batches: its sessions' decode rows go in ``count`` groups, each a step,
    up to ``count`` of them travelling at once. What its auto probe measures: ``steps_run`` counts
    the steps that carried its rows, ``decode_rows_run`` its decode rows among them (its tokens;
    a prefill chunk is other work), ``last_prefill_step`` the latest of those steps that carried a
    prefill chunk of the job's, and ``launched_s`` when the latest left (the batcher's clock)."""

    count: int = 1
    steps_run: int = 0
    decode_rows_run: int = 0
    last_prefill_step: int = 0
    launched_s: float = 0.0


@dataclass(eq=False)
class StepSlot:
    """One request's place in the batcher for its whole life (across failovers): ``grouping`` its
    batch job's micro-batches (None: the batcher's own groups), ``load`` what else rode in its
    last step (batch-aware K's probe; None before its first), ``expedited`` its next frame leaves
    at once, alone, and ``closed`` once the request ended (its grouping no longer counts it)."""

    grouping: Grouping | None = None
    load: StepLoad | None = None
    expedited: bool = False
    closed: bool = False


@dataclass
class _Waiting:
    frame: activation_pb2.ActivationFrame
    tokens: int
    decoding: bool  # a decode or verify row (a session's next token); else a prefill chunk
    answer: asyncio.Future
    arrival: int  # order of arrival (ties between equally urgent frames go to the earlier)
    urgent: bool  # a session's first frame, or a chunk passed over once: goes before other chunks
    slot: StepSlot  # its request's place in the batcher

    @property
    def grouping(self) -> Grouping | None:
        """Its batch job's micro-batches; None: the batcher's own groups."""
        return self.slot.grouping


class StepBatcher:
    def __init__(
        self,
        run: StepRunner,
        sessions: Callable[[], int],
        step_tokens: int = DEFAULT_STEP_TOKENS,
        gather_s: float = 0.002,
        inflight: int = 1,
        clock: Callable[[], float] = time.perf_counter,
    ):
        if inflight < 1:
            raise ValueError(f"inflight must be at least 1, got {inflight}")
        self._run = run
        self._sessions = sessions  # how many sessions are open (the most frames a step can wait for)
        self.step_tokens = step_tokens
        self.gather_s = gather_s
        self.inflight = inflight  # the most steps travelling at once
        self.steps_run = 0  # steps formed so far (benchmarks and tests read it)
        self.rows_run = 0
        self.max_in_flight = 0  # the most steps that were in flight at once
        self.last_step_rows = 0  # rows and tokens of the latest step (how full steps run)
        self.last_step_tokens = 0
        self.timing = TimingModel()  # decode steps' cost by rows and positions, send to result
        self._clock = clock
        self._queue: list[_Waiting] = []
        self._rows_in_flight: Counter[Grouping | None] = Counter()  # by grouping
        self._grouped: set[StepSlot] = set()  # batch jobs' requests that stepped (the rest: interactive)
        self._steps: set[asyncio.Task] = set()
        self._changed = asyncio.Event()  # made anew on the first step in each event loop
        self._task: asyncio.Task | None = None
        self._arrivals = itertools.count()

    async def step(
        self, frame: activation_pb2.ActivationFrame, slot: StepSlot | None = None
    ) -> activation_pb2.StepResult:
        """The frame's result once a step carried it; ``slot``: its request's place (None: a
        caller that keeps none, stepping as an interactive request with no memory)."""
        if self._task is None or self._task.done():  # first step, or a new event loop
            self._changed = asyncio.Event()
            self._queue = []
            self._steps = set()
            self._rows_in_flight = Counter()
            self._task = asyncio.create_task(self._schedule(), name="step-batcher")
        slot = slot or StepSlot()
        waiting = _Waiting(
            frame,
            len(frame.positions),
            frame.plan.rows[0].kind != activation_pb2.ROW_KIND_PREFILL,
            asyncio.get_running_loop().create_future(),
            next(self._arrivals),
            urgent=frame.step_id == 0,
            slot=slot,
        )
        if slot.grouping is not None:
            self._grouped.add(slot)
        if slot.expedited:
            slot.expedited = False
            self._launch([waiting])
            return await waiting.answer
        self._queue.append(waiting)
        if len(self._steps) < self._limit() and self._complete():
            # Every frame the next step could wait for is here (a lone session's always is): it
            # leaves now, not one event-loop turn later from the scheduler task.
            self._launch(self._pick())
        if self._queue:
            self._changed.set()
        return await waiting.answer

    async def close(self) -> None:
        tasks = [t for t in (self._task, *self._steps) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def load(self, slot: StepSlot) -> StepLoad:
        """The other rows and tokens of the request's last step (what its next frame will ride
        with); the latest step's for a request that has not stepped yet."""
        return slot.load or StepLoad(self.last_step_rows, self.last_step_tokens)

    def _groups(self) -> list[Grouping]:
        """The groupings of the batch jobs' requests still open (one entry per request)."""
        self._grouped = {slot for slot in self._grouped if not slot.closed}
        return [slot.grouping for slot in self._grouped if slot.grouping is not None]

    def _limit(self) -> int:
        """The most steps in flight: ``inflight``, or more while a batch job's count is higher."""
        return max([self.inflight, *(g.count for g in self._groups())])

    def _open(self) -> dict[Grouping | None, int]:
        """Open sessions by grouping (None: those of no batch job)."""
        groups = self._groups()
        open_: Counter[Grouping | None] = Counter(groups)
        return {None: max(0, self._sessions() - len(groups)), **open_}

    def _shares(self, open_: dict[Grouping | None, int]) -> dict[Grouping | None, int]:
        """Decode rows of each grouping one step may take: its sessions split over its groups."""
        return {g: max(1, -(-n // (self.inflight if g is None else g.count))) for g, n in open_.items()}

    def _complete(self) -> bool:
        """The queue holds every frame the next step would wait for (up to a share of each grouping)."""
        open_ = self._open()
        queued = Counter(w.grouping for w in self._queue)
        return all(
            queued[g] >= min(share, open_[g] - self._rows_in_flight[g])
            for g, share in self._shares(open_).items()
        )

    async def _schedule(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._changed.wait()
            self._changed.clear()
            if len(self._steps) >= self._limit() or not self._queue:
                continue
            # Wait a little for the sessions not in flight to send their frames (up to a share).
            deadline = loop.time() + self.gather_s
            while not self._complete() and loop.time() < deadline:
                self._changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), deadline - loop.time())
            batch = self._pick()
            if batch:
                self._launch(batch)
            if self._queue:
                self._changed.set()

    def _launch(self, batch: list[_Waiting]) -> None:
        self.steps_run += 1
        self.rows_run += len(batch)
        self.last_step_rows = len(batch)
        self.last_step_tokens = sum(w.tokens for w in batch)
        for w in batch:
            w.slot.load = StepLoad(len(batch) - 1, self.last_step_tokens - w.tokens)
            trace.mark("batched", w.frame.session_id, w.frame.step_id)
        self._rows_in_flight += Counter(w.grouping for w in batch)
        now = self._clock()
        for grouping in {w.grouping for w in batch if w.grouping is not None}:
            grouping.steps_run += 1
            grouping.launched_s = now
        for w in batch:
            if w.grouping is not None:
                w.grouping.decode_rows_run += w.decoding
                if not w.decoding:
                    w.grouping.last_prefill_step = w.grouping.steps_run
        task = asyncio.create_task(self._run_step(batch), name="batch-step")
        self._steps.add(task)
        self.max_in_flight = max(self.max_in_flight, len(self._steps))

    async def _run_step(self, batch: list[_Waiting]) -> None:
        sent = self._clock()
        try:
            answers = await self._run([w.frame for w in batch])
            if all(w.decoding for w in batch):
                self.timing.observe(sum(w.tokens for w in batch), self._clock() - sent, rows=len(batch))
        except Exception as exc:  # a runner that raises fails every row of its step
            answers = [exc] * len(batch)
        finally:
            self._rows_in_flight -= Counter(w.grouping for w in batch)
            self._steps.discard(asyncio.current_task())
            self._changed.set()
        for waiting, answer in zip(batch, answers, strict=True):
            if waiting.answer.done():
                continue
            if isinstance(answer, BaseException):
                waiting.answer.set_exception(answer)
            else:
                waiting.answer.set_result(answer)

    def _pick(self) -> list[_Waiting]:
        """The next step: decode rows up to a share, then prefill frames while the budget lasts,
        urgent ones (first frames, chunks passed over before) first, each group in arrival order."""
        queue = [w for w in self._queue if not w.answer.done()]  # a cancelled caller's frame drops
        queue.sort(key=lambda w: (not w.urgent, w.arrival))
        room = self._shares(self._open())
        step = []
        for w in queue:
            if w.decoding and room.get(w.grouping, 1) > 0:
                step.append(w)
                room[w.grouping] = room.get(w.grouping, 1) - 1
        budget = self.step_tokens
        for w in queue:
            if not w.decoding and (w.tokens <= budget or not step):
                step.append(w)
                budget -= w.tokens
        taken = {id(w) for w in step}
        self._queue = [w for w in queue if id(w) not in taken]
        for w in self._queue:
            if not w.decoding:
                w.urgent = True  # passed over once: ahead of everything that arrives later
        self._queue.sort(key=lambda w: w.arrival)
        return step
