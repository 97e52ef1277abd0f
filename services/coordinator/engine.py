"""The coordinator's engine core: every running request under one id, and the one loop that
decides every step.

A request is state, not a coroutine that steps itself. Its caller (``Generation.generate``, the
servicer's path) opens it (sessions, prefix restore: per-request async work stays in the
caller's coroutine), hands it to the engine as ready (:meth:`EngineCore.ready`) and from then on
only reads its output queue; when the engine says it ended, the caller keeps and releases it.

One engine task (:meth:`EngineCore.run`) per coordinator; each time requests become ready (a
step's answer came back, a request arrived, a failover finished) it:

1. forms steps (:meth:`EngineCore.schedule`) from the ready requests under one token budget:
   decode and verify rows up to each group's share, ceil(open / inflight), so about ``inflight``
   steps keep the pipeline full; then prefill chunks (rows of prefilling requests) while the
   budget lasts; a request's first row and a chunk passed over once go first; identities take
   turns (fair share); batch jobs' rows
   are the lower class, split by their job's micro-batches; a failover's replay (a REPLAYING
   request's chunks) is planned as urgent chunks, and its resend of the lost step goes at once,
   alone. Drafting happens here, per planned row, with the load of the step being formed and the
   budget it leaves (batch-aware K, speculation/policy.py), so a request that does not fit waits;
2. launches each step (the rows' frames, built by ``wire.token_row``, as one plan frame through
   the ring): up to ``inflight`` steps travel at once (a batch queue as deep as the pipeline, and
   at least as deep as a request's in-flight depth); a request whose row was just launched is
   ready again at once when it pipelines (its next speculative row, built on this one's draft
   accepted whole, may travel beside it: speculation/depth.py); while rows sent ahead hold
   slots, a request with nothing in flight goes beyond the limit (its row stands for sure);
3. as a step's answer comes back, hands each row's answer to the request's update (acceptance,
   emission into its non-blocking output queue, stop checks): the requests of one answered step
   become ready together (no step forms until all of its rows are updated) and form the next
   step at once; a finished request leaves; an
   Unavailable answer marks it MOVING while its failover (abort, open, restore) runs as a task of
   its own, which puts it back ready under the same id, REPLAYING: its replay's rows are planned
   here like any prompt's chunks (an Unavailable among them moves it again).

A ring that does not batch (stateful stages) sends each ready request's row alone, at once.

A request's sessions on the stages change (a prefix restore that fails opens a fresh one, a
failover opens one on another lane); its :class:`RequestId` does not, so what the coordinator
knows of a request is found by that id, and its sessions are a field of the request. The table
(``EngineCore.requests``) holds each request from the moment its sessions open until they are
released or aborted, whatever way it ends, and each request's :class:`RequestStatus` says where
it is in its life.
"""

from __future__ import annotations

import asyncio
import contextvars
import enum
import itertools
import logging
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Generic, NewType, Protocol, TypeVar

import structlog

from pipeshard import trace
from pipeshard.services.coordinator.speculation.drafts import Draft
from pipeshard.services.coordinator.speculation.policy import StepLoad
from pipeshard.services.coordinator.speculation.tree import TreeChains, TreeNodes
from pipeshard.services.coordinator.step_batcher import BatchSteps, Grouping, StepSlot
from pipeshard.v1 import activation_pb2

log = structlog.get_logger(__name__)

# Draft positions a row may add on a ring that sends each row alone (no step budget to share).
ALONE_BUDGET = 1 << 20

RequestId = NewType("RequestId", str)


def new_request_id() -> RequestId:
    """A fresh id, unique across coordinators (a uuid4)."""
    return RequestId(uuid.uuid4().hex)


class RequestStatus(enum.Enum):
    PREFILLING = "prefilling"  # its prompt is going through the stages
    DECODING = "decoding"  # producing tokens
    MOVING = "moving"  # its lane failed: its failover reopens and restores it on another
    REPLAYING = "replaying"  # moved: its rows bring the new session up to what it had seen
    FINISHED = "finished"  # ended (stop, length, error or cancelled); its sessions are let go


class Tracked(Protocol):
    """What the engine's table needs of a request."""

    @property
    def id(self) -> RequestId: ...

    @property
    def status(self) -> RequestStatus: ...


@dataclass(frozen=True)
class Upcoming:
    """A ready request's next row before it is built: its positions without drafts, whether it is
    a decode or verify row (else a prompt's chunk) and whether it is the request's first row."""

    tokens: int
    decoding: bool
    first: bool


@dataclass(frozen=True)
class Row:
    """One planned row: its frame, whether it decodes (else a prompt's chunk), and what the
    request's update needs back with its answer (the draft or tree it carries; None: a chunk
    that only fills the cache)."""

    frame: activation_pb2.ActivationFrame
    decoding: bool
    draft: Draft | TreeChains | TreeNodes | None = None

    @property
    def tokens(self) -> int:
        return len(self.frame.positions)


class Steppable(Tracked, Protocol):
    """What the engine loop needs of a request: its place in the batching, its next row, and
    where it counts its steps in flight (``landed`` is set while none is)."""

    slot: StepSlot
    steps_in_flight: int
    landed: asyncio.Event

    def upcoming(self, chunk: int) -> Upcoming: ...

    def next_row(self, chunk: int, load: StepLoad, budget: int) -> Row:
        """Its next row, drafted for a step carrying ``load`` besides it, with at most ``budget``
        positions for drafts."""
        ...

    def pipelines(self) -> bool:
        """Whether another row of it may be planned while the rows just launched travel (its
        in-flight depth, speculation/depth.py, is not used up)."""
        ...


S = TypeVar("S", bound=Steppable)

# Runs one step's frames; answers each with its StepResult or the exception for it.
StepRunner = Callable[[list[activation_pb2.ActivationFrame]], Awaitable[list]]
# Takes a step's answers: each planned row with its StepResult or exception, and the step's time.
Answered = Callable[[Sequence[tuple[S, Row]], list, float], Awaitable[None]]
# Ends a request whose next row could not be built (the error is its end).
Failed = Callable[[S, Exception], None]


@dataclass(frozen=True)
class StepPlan(Generic[S]):
    """What one step carries, as :meth:`EngineCore.schedule` decided it: its decode and verify
    rows, then its prefill chunks (within the step's token budget, unless its first row alone
    exceeds it)."""

    rows: tuple[tuple[S, Row], ...]

    @property
    def tokens(self) -> int:
        return sum(row.tokens for _, row in self.rows)


def _debugging() -> bool:
    """Whether the per-step debug line is logged (``--log-level debug``: what a step carried,
    how long it took and its planning, for a benchmark's trace)."""
    return logging.getLogger(__name__).isEnabledFor(logging.DEBUG)


def _expedited(request: Steppable) -> bool:
    """Whether its next row leaves at once, alone: a failover's lost step, once replayed (its
    replay's chunks are planned as urgent chunks beside other rows)."""
    return request.slot.expedited and request.status is not RequestStatus.REPLAYING


class EngineCore(Generic[S]):
    """The requests running on this coordinator, by their id, and the loop that steps them.

    ``run``: carries one step's frames to the stages; ``answered``: takes a step's answers (the
    requests' updates); ``failed``: ends a request whose row could not be built; ``steps``: a
    batching ring's settings and counters (None: each row goes alone); ``prefill_chunk``: prompt
    tokens per chunk row."""

    def __init__(
        self,
        run: StepRunner | None = None,
        answered: Answered | None = None,
        failed: Failed | None = None,
        *,
        steps: BatchSteps | None = None,
        prefill_chunk: int = 1,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.requests: dict[RequestId, S] = {}
        self.steps = steps
        self.depth = 1  # the most steps of one request in flight (its owner sets it as it is chosen)
        self.prefill_chunk = prefill_chunk
        self._run = run
        self._answered = answered
        self._failed = failed
        self._clock = clock
        self._ready: dict[RequestId, S] = {}  # by arrival order
        self._arrival: dict[RequestId, int] = {}
        self._arrivals = itertools.count()
        self._in_flight: set[asyncio.Task] = set()
        self._rows_in_flight = 0  # rows of the steps in flight (drafts are priced against them too)
        self._ahead_in_flight = 0  # of them, rows sent ahead of another row of their request
        self._answering = 0  # steps of several rows whose answers are being taken (no step forms)
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    # The table.

    def add(self, request: S) -> None:
        """Tracks a request whose sessions just opened; its id must be new."""
        if request.id in self.requests:
            raise ValueError(f"request {request.id} is already running")
        self.requests[request.id] = request

    def remove(self, request: S) -> None:
        """The request has ended (every exit path comes here once its sessions are let go)."""
        if request.status is not RequestStatus.FINISHED:
            raise ValueError(f"request {request.id} is {request.status.value}, not finished")
        self.requests.pop(request.id, None)
        self.withdraw(request)
        if not self.requests:
            self._wake.set()  # the engine task ends once its steps are in (run)

    def with_status(self, status: RequestStatus) -> list[S]:
        return [r for r in self.requests.values() if r.status is status]

    # The loop.

    def ready(self, request: S) -> None:
        """The request's next row may be planned (it was answered, arrived or moved)."""
        if request.id in self._ready or request.status is RequestStatus.FINISHED:
            return
        self._ready[request.id] = request
        self._arrival[request.id] = next(self._arrivals)
        if self._task is None or self._task.done():  # first request, or a new event loop
            self._wake = asyncio.Event()
            self._in_flight = set()
            self._rows_in_flight = self._ahead_in_flight = 0
            self._answering = 0
            # Its own empty context, not that of the request that woke it (its request id, its
            # batch job's session codec): a request's own work runs in the request's context.
            self._task = asyncio.create_task(self.run(), name="engine-core", context=contextvars.Context())
        self._wake.set()

    def withdraw(self, request: S) -> None:
        """The request is not to be planned (it ended, or waits on its reader)."""
        self._ready.pop(request.id, None)
        self._arrival.pop(request.id, None)

    async def run(self) -> None:
        """The engine task: forms and launches steps whenever requests become ready; it ends
        once no request runs (the next one starts it again), so none is left pending when its
        event loop closes."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            self.pump()
            if not (self.requests or self._ready or self._in_flight):
                return

    async def close(self, error: Exception | None = None) -> None:
        """Stops the engine task and the steps in flight, and ends each request still running
        with ``error`` (through ``failed``: its reader gets that error, it does not wait). The
        engine's owner calls this before its event loop ends, so no task of it is left pending."""
        tasks = [t for t in (self._task, *self._in_flight) if t is not None and not t.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._task = None
        self._in_flight = set()
        self._rows_in_flight = self._ahead_in_flight = 0
        self._answering = 0
        if error is not None and self._failed is not None:
            for request in list(self.requests.values()):
                if request.status is not RequestStatus.FINISHED:
                    self._failed(request, error)

    def pump(self) -> int:
        """Launches steps while requests are ready and the batch queue has room; how many. None
        while a step's rows are still being updated: they become ready together and form the
        next step (one whose update waits on a worker thread is not left behind by the others)."""
        if self._answering:
            return 0
        launched = 0
        while self._ready:
            expedited = any(_expedited(r) for r in self._ready.values())
            full = self.steps is not None and len(self._in_flight) >= self._limit()
            if full and not expedited and not self._passes_rows_ahead():
                break
            started = self._clock()
            plan = self.schedule()
            self._launch(plan, self._clock() - started)
            launched += 1
        return launched

    def schedule(self) -> StepPlan[S]:
        """The next step from the ready requests (module docstring): decode and verify rows up to
        each grouping's share, then prefill chunks, interactive rows before batch jobs' and urgent
        ones (first rows, chunks passed over before) first, each in arrival order, all while the
        step's token budget lasts (its first row always goes); drafts are chosen per decode row
        with this step's load and the budget its rows leave."""
        ready = list(self._ready.values())
        first = next((r for r in ready if _expedited(r)), None)
        if first is not None or self.steps is None:
            request = first or ready[0]
            request.slot.expedited = False
            self.withdraw(request)
            budget = self.steps.step_tokens if self.steps is not None else ALONE_BUDGET
            row = self._row(request, StepLoad(), budget)
            return StepPlan(() if row is None else ((request, row),))
        upcoming = {r.id: r.upcoming(self.prefill_chunk) for r in ready}
        # Fair share: each identity's rows take turns with the others' (its first ready row, then
        # its second, ...), so one client's many rows do not fill a step before another's one.
        seen: Counter[str] = Counter()
        turn: dict[RequestId, int] = {}
        for r in sorted(ready, key=lambda r: self._arrival[r.id]):
            turn[r.id] = seen[r.slot.identity]
            seen[r.slot.identity] += 1
        ready.sort(
            key=lambda r: (
                r.slot.grouping is not None,
                not (upcoming[r.id].first or r.slot.passed_over or r.status is RequestStatus.REPLAYING),
                turn[r.id],
                self._arrival[r.id],
            )
        )
        room = self._shares()
        budget = self.steps.step_tokens
        decode: list[S] = []
        for r in ready:
            up, group = upcoming[r.id], r.slot.grouping
            if up.decoding and (up.tokens <= budget or not decode) and room.get(group, 1) > 0:
                decode.append(r)
                room[group] = room.get(group, 1) - 1
                budget -= up.tokens
        chunks: list[S] = []
        for r in ready:
            up = upcoming[r.id]
            if not up.decoding and (up.tokens <= budget or not (decode or chunks)):
                chunks.append(r)
                budget -= up.tokens
        taken = {r.id for r in (*decode, *chunks)}
        for r in ready:
            if r.id not in taken and not upcoming[r.id].decoding:
                r.slot.passed_over = True  # ahead of everything that becomes ready later
        for r in (*decode, *chunks):
            self.withdraw(r)
            r.slot.passed_over = False
        rows_total = len(taken)
        tokens_total = sum(upcoming[i].tokens for i in taken)
        planned: list[tuple[S, Row]] = []
        for r in (*decode, *chunks):
            base = upcoming[r.id].tokens
            load = StepLoad(rows_total - 1, tokens_total - base, self._rows_in_flight)
            row = self._row(r, load, max(0, budget) if upcoming[r.id].decoding else 0)
            if row is not None:
                budget -= row.tokens - base
                tokens_total += row.tokens - base
                planned.append((r, row))
        return StepPlan(tuple(planned))

    def _row(self, request: S, load: StepLoad, budget: int) -> Row | None:
        """The request's next row, or None when it cannot be built (the request ends with it)."""
        try:
            return request.next_row(self.prefill_chunk, load, budget)
        except Exception as exc:
            if self._failed is None:
                raise
            self._failed(request, exc)
            return None

    def _passes_rows_ahead(self) -> bool:
        """Whether a step may go beyond the limit: the steps in flight hold rows sent ahead
        (speculative, each may be dropped) and a ready request has nothing in flight, so its row
        stands whatever comes back; waiting for a slot the rows ahead took would only delay it (8
        users at 100 ms: the users the draft does not guess finished 11% after plain's)."""
        return self._ahead_in_flight > 0 and any(r.steps_in_flight == 0 for r in self._ready.values())

    def _groupings(self) -> list[Grouping]:
        """The groupings of the batch jobs' requests running (one entry per request)."""
        return [r.slot.grouping for r in self.requests.values() if r.slot.grouping is not None]

    def _limit(self) -> int:
        """The most steps in flight: ``inflight``, or more while a batch job's count or a request's
        in-flight depth is higher."""
        assert self.steps is not None
        return max([self.steps.inflight, self.depth, *(g.count for g in self._groupings())])

    def _shares(self) -> dict[Grouping | None, int]:
        """Decode rows of each grouping one step may take: its requests split over its groups."""
        assert self.steps is not None
        groups = self._groupings()
        open_: dict[Grouping | None, int] = {None: max(0, len(self.requests) - len(groups))}
        open_.update(Counter(groups))
        inflight = self.steps.inflight
        return {g: max(1, -(-n // (inflight if g is None else g.count))) for g, n in open_.items()}

    def _launch(self, plan: StepPlan[S], planned_s: float = 0.0) -> None:
        """Sends the step; ``planned_s``: the time its planning (the rows' drafting) took."""
        if not plan.rows:
            return
        steps = self.steps
        if steps is not None:
            steps.steps_run += 1
            steps.rows_run += len(plan.rows)
            steps.last_step_rows = len(plan.rows)
            steps.last_step_tokens = plan.tokens
        now = self._clock()
        groupings = {r.slot.grouping for r, _ in plan.rows if r.slot.grouping is not None}
        for grouping in groupings:
            grouping.steps_run += 1
            grouping.launched_s = now
        self._rows_in_flight += len(plan.rows)
        ahead = sum(request.steps_in_flight > 0 for request, _ in plan.rows)
        self._ahead_in_flight += ahead
        for request, row in plan.rows:
            request.steps_in_flight += 1
            request.landed.clear()
            trace.mark("batched", row.frame.session_id, row.frame.step_id)
            job = request.slot.grouping
            if job is not None:
                job.decode_rows_run += row.decoding
                if not row.decoding:
                    job.last_prefill_step = job.steps_run
        step = self._step(plan, planned_s, len(self._in_flight), ahead)
        task = asyncio.create_task(step, name="engine-step")
        for request, row in plan.rows:
            # Its next step may go while this one travels (built on this one's draft accepted whole).
            if row.decoding and request.pipelines():
                self.ready(request)
        self._in_flight.add(task)
        if steps is not None:
            steps.max_in_flight = max(steps.max_in_flight, len(self._in_flight))

    async def _step(
        self, plan: StepPlan[S], planned_s: float = 0.0, travelling: int = 0, ahead: int = 0
    ) -> None:
        """One step through the ring, then its answers to the requests' updates (``planned_s``: its
        planning time and ``travelling``: the steps in flight when it left, for the debug log;
        ``ahead``: its rows sent ahead of another of their request's rows)."""
        assert self._run is not None and self._answered is not None
        sent = self._clock()
        try:
            try:
                answers = await self._run([row.frame for _, row in plan.rows])
            except Exception as exc:  # a runner that raises fails every row of its step
                answers = [exc] * len(plan.rows)
            elapsed = self._clock() - sent
            timed = all(row.decoding for _, row in plan.rows)
            if self.steps is not None and timed and not any(isinstance(a, BaseException) for a in answers):
                self.steps.timing.observe(plan.tokens, elapsed, rows=len(plan.rows))
            if _debugging():
                first = answers[0] if answers else None
                compute = first.stage_compute_micros if isinstance(first, activation_pb2.StepResult) else ()
                log.debug(
                    "engine_step",
                    rows=len(plan.rows),
                    positions=plan.tokens,
                    decoding=sum(row.decoding for _, row in plan.rows),
                    ahead=ahead,
                    travelling=travelling,
                    step_ms=round(elapsed * 1000, 2),
                    plan_ms=round(planned_s * 1000, 2),
                    compute_ms=[round(micros / 1000, 2) for micros in compute],
                    sessions=[row.frame.session_id[:8] for _, row in plan.rows],
                )
        finally:
            self._in_flight.discard(asyncio.current_task())
            self._rows_in_flight -= len(plan.rows)
            self._ahead_in_flight -= ahead
            for request, _ in plan.rows:
                request.steps_in_flight -= 1
                if not request.steps_in_flight:
                    request.landed.set()
        held = len(plan.rows) > 1
        self._answering += held
        try:
            await self._answered(plan.rows, answers, elapsed)
        except Exception:  # a bug in an update: logged, and the loop goes on
            log.exception("step_answers_failed", rows=len(plan.rows))
        finally:
            self._answering -= held
        self.pump()
        if not (self.requests or self._in_flight):
            self._wake.set()  # nothing left: the engine task ends (run)
