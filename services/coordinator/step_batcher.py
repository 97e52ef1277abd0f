"""Forms each step of continuous batching from the frames of every running request.

Each ``Generation`` sends its frame (a plan of one row) and awaits its result; the batcher
queues the frames and :meth:`StepBatcher.schedule` decides what the next step carries, as one
typed :class:`StepPlan`, under one token budget (``step_tokens``) that counts every position the
step computes: decode rows (one token), verify rows (the token plus its drafts or tree nodes)
and prefill chunks (a prompt's first rows). Decode and verify rows go first, up to a share
(below) and while the budget lasts; then prefill chunks while it lasts. A step never runs
empty: its first row always goes. The chunk size is the generation's fixed prefill chunk, so a
request's chunks never depend on its neighbours.

When a step leaves is decided from the requests' states, not from a clock: each request's
:class:`StepSlot` says whether it is *thinking* (answered, and about to send its next frame:
accepting, emitting, drafting) or not (in flight, parked, ended). A step leaves once no thinking
request could still join it: every grouping with a thinking request already has its share of
rows queued. A request that stops stepping for a while (it finished, waits on its client, moves
to another lane) says so (:meth:`StepBatcher.idle`, :meth:`StepBatcher.leave`), so nobody waits
on it. A caller that passes no slot is never waited for.

Fair latency: a request's first frame and any chunk already passed over once go ahead of the
other chunks (in arrival order among them), so a newcomer's first chunk gets into the next step
however many long prompts are being prefilled, and a passed-over chunk goes before any frame
that arrived after it: nothing waits more than a few steps.

No pipeline bubble: up to ``inflight`` steps travel at once (on a fleet of N stages, N: each
stage works on a different step). Each request has at most one step in flight (its generation
awaits the result before sending on), so the running requests split into about ``inflight``
groups: a step takes at most its share, ceil(open sessions / inflight), of the decode rows.

A failover's resend leaves at once (``expedite``): the moved request has waited through a restore
already, and behind the steps in flight it would wait up to two such steps more.

Batch jobs' rows are the lower class within a step too: interactive rows take the budget first.
Micro-batches of a batch job (batch_jobs.py): a job's requests step under its :class:`Grouping`
(their :class:`StepSlot`'s), so a step takes at most ceil(the job's sessions / its ``count``) of
their decode rows, and up to that many steps travel at once; the other requests keep their share
of ``inflight`` groups, so a job's count never regroups interactive rows.

Batch-aware K (speculation/policy.py): the batcher times each step of decode rows from send to
result and fits its cost by rows and positions once for all requests (``timing``), and tells a
request what else rode in its last step (its slot's ``load``): the step its next frame will join.
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
    at once, alone, ``thinking`` it was answered and its next frame is on its way (the next step
    waits for it), and ``closed`` once the request ended (its grouping no longer counts it)."""

    grouping: Grouping | None = None
    load: StepLoad | None = None
    expedited: bool = False
    thinking: bool = False
    closed: bool = False


@dataclass(frozen=True)
class StepPlan:
    """What one step carries, as :meth:`StepBatcher.schedule` decided it: its decode and verify
    rows (a request's next token, with any drafts or draft tree), then its prefill chunks, and
    the positions of all of them (within the step's token budget, unless its first row alone
    exceeds it)."""

    decode: tuple[_Waiting, ...]
    chunks: tuple[_Waiting, ...]

    @property
    def rows(self) -> tuple[_Waiting, ...]:
        return self.decode + self.chunks

    @property
    def tokens(self) -> int:
        return sum(w.tokens for w in self.rows)


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
        inflight: int = 1,
        clock: Callable[[], float] = time.perf_counter,
    ):
        if inflight < 1:
            raise ValueError(f"inflight must be at least 1, got {inflight}")
        self._run = run
        self._sessions = sessions  # how many sessions are open (what the decode rows split over)
        self.step_tokens = step_tokens
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
        self._slots: set[StepSlot] = set()  # the running requests that stepped (not ended)
        self._steps: set[asyncio.Task] = set()
        self._changed = asyncio.Event()  # made anew on the first step in each event loop
        self._task: asyncio.Task | None = None
        self._arrivals = itertools.count()

    async def step(
        self, frame: activation_pb2.ActivationFrame, slot: StepSlot | None = None
    ) -> activation_pb2.StepResult:
        """The frame's result once a step carried it; ``slot``: its request's place (None: a
        caller that keeps none, stepping as an interactive request that is never waited for)."""
        if self._task is None or self._task.done():  # first step, or a new event loop
            self._changed = asyncio.Event()
            self._queue = []
            self._steps = set()
            self._rows_in_flight = Counter()
            self._task = asyncio.create_task(self._schedule(), name="step-batcher")
        if slot is not None and not slot.closed:
            self._slots.add(slot)
        slot = slot or StepSlot(closed=True)
        slot.thinking = False
        waiting = _Waiting(
            frame,
            len(frame.positions),
            frame.plan.rows[0].kind != activation_pb2.ROW_KIND_PREFILL,
            asyncio.get_running_loop().create_future(),
            next(self._arrivals),
            urgent=frame.step_id == 0,
            slot=slot,
        )
        if slot.expedited:
            slot.expedited = False
            alone = (waiting,)
            self._launch(StepPlan(alone, ()) if waiting.decoding else StepPlan((), alone))
            return await waiting.answer
        self._queue.append(waiting)
        if len(self._steps) < self._limit() and self._complete():
            # No request the next step could wait for is still thinking (a lone session's never
            # is): it leaves now, not one event-loop turn later from the scheduler task.
            self._launch(self.schedule())
        if self._queue:
            self._changed.set()
        return await waiting.answer

    def idle(self, slot: StepSlot) -> None:
        """The request will not send a frame for a while (it finished stepping, waits on its
        client or on a restore): the next step does not wait for it."""
        if slot.thinking:
            slot.thinking = False
            self._changed.set()

    def leave(self, slot: StepSlot) -> None:
        """The request ended: it is no longer counted nor waited for."""
        slot.closed = True
        self._slots.discard(slot)
        self.idle(slot)
        self._changed.set()

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
        return [slot.grouping for slot in self._slots if slot.grouping is not None]

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
        """No thinking request could still join the next step: each grouping with one has its
        share of rows queued already."""
        thinking = Counter(s.grouping for s in self._slots if s.thinking)
        if not thinking:
            return True
        queued = Counter(w.grouping for w in self._queue)
        shares = self._shares(self._open())
        return all(queued[g] >= shares.get(g, 1) for g in thinking)

    async def _schedule(self) -> None:
        while True:
            await self._changed.wait()
            self._changed.clear()
            if len(self._steps) >= self._limit() or not self._queue or not self._complete():
                continue  # a step's result, a frame, or a request going idle sets it again
            plan = self.schedule()
            if plan.rows:
                self._launch(plan)
            if self._queue:
                self._changed.set()

    def _launch(self, plan: StepPlan) -> None:
        batch = plan.rows
        self.steps_run += 1
        self.rows_run += len(batch)
        self.last_step_rows = len(batch)
        self.last_step_tokens = plan.tokens
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
        task = asyncio.create_task(self._run_step(list(batch)), name="batch-step")
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
                # Its request accepts and sends its next frame: the next step waits for it.
                waiting.slot.thinking = waiting.slot in self._slots
                waiting.answer.set_result(answer)

    def schedule(self) -> StepPlan:
        """The next step: decode and verify rows up to each grouping's share, then prefill chunks,
        interactive rows before batch jobs' and urgent ones (first frames, chunks passed over
        before) first, each in arrival order, all while the step's token budget lasts (its first
        row always goes)."""
        queue = [w for w in self._queue if not w.answer.done()]  # a cancelled caller's frame drops
        # Batch jobs' rows are the lower class: they take what budget interactive rows leave.
        queue.sort(key=lambda w: (w.grouping is not None, not w.urgent, w.arrival))
        room = self._shares(self._open())
        budget = self.step_tokens
        decode: list[_Waiting] = []
        for w in queue:
            fits = w.tokens <= budget or not decode
            if w.decoding and fits and room.get(w.grouping, 1) > 0:
                decode.append(w)
                room[w.grouping] = room.get(w.grouping, 1) - 1
                budget -= w.tokens
        chunks: list[_Waiting] = []
        for w in queue:
            if not w.decoding and (w.tokens <= budget or not (decode or chunks)):
                chunks.append(w)
                budget -= w.tokens
        taken = {id(w) for w in (*decode, *chunks)}
        self._queue = [w for w in queue if id(w) not in taken]
        for w in self._queue:
            if not w.decoding:
                w.urgent = True  # passed over once: ahead of everything that arrives later
        self._queue.sort(key=lambda w: w.arrival)
        return StepPlan(tuple(decode), tuple(chunks))
