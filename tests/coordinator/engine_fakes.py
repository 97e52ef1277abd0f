"""Fakes for the engine loop's unit tests: requests that each play a script of rows, record the load
and budget the engine drafted their rows for, and take as many drafts as the step leaves room for;
and a batching ring over a toy target whose lanes die on cue (failover as engine events)."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass
from types import SimpleNamespace

from pipeshard.errors import Unavailable
from pipeshard.services.coordinator.engine import EngineCore, RequestId, RequestStatus, Row, Upcoming
from pipeshard.services.coordinator.fleet_kv import FleetKv
from pipeshard.services.coordinator.speculation.policy import StepLoad
from pipeshard.services.coordinator.step_batcher import BatchSteps, Grouping, StepSlot
from pipeshard.services.stage.backends import AnyBackend, PagedBackend, StatefulBackend
from pipeshard.services.stage.domain import ReturnMode
from pipeshard.services.stage.wire import step_from_frame, token_frame
from pipeshard.v1 import activation_pb2, stage_pb2


def reported(backend: AnyBackend) -> FleetKv:
    """What stages of ``backend`` report of it in GetStageInfo, as the coordinator reads it."""
    info = stage_pb2.GetStageInfoResponse()
    backend.describe(SimpleNamespace(slots=4, chunk=16, proof=None, moves_slots=True), info)
    return FleetKv.of(info)


PAGED_KV, STATEFUL_KV = reported(PagedBackend()), reported(StatefulBackend())


class FakeRequest:
    """``script``: its rows in order, each (positions, decoding: else a prompt's chunk);
    ``drafts``: positions each decode row adds when the step's budget leaves them; ``fresh``: its
    first row is its first ever (a newcomer's, which goes first)."""

    def __init__(
        self,
        name: str,
        script: list[tuple[int, bool]],
        *,
        drafts: int = 0,
        grouping: Grouping | None = None,
        fresh: bool = True,
        identity: str = "",
    ):
        self.id = RequestId(name)
        self.status = RequestStatus.DECODING
        self.slot = StepSlot(grouping, identity=identity)
        self.steps_in_flight = 0
        self.landed = asyncio.Event()
        self.landed.set()
        self.script = list(script)
        self.drafts = drafts
        self.fresh = fresh
        self.at = 0  # rows planned so far
        self.loads: list[tuple[StepLoad, int]] = []  # what each row was drafted for
        self.answers: list = []
        self.depth = 1  # its rows in flight at once (more: the engine plans it again as one leaves)

    def pipelines(self) -> bool:
        return self.steps_in_flight < self.depth and self.at < len(self.script)

    def upcoming(self, chunk: int) -> Upcoming:
        tokens, decoding = self.script[self.at]
        return Upcoming(tokens, decoding, self.fresh and self.at == 0)

    def next_row(self, chunk: int, load: StepLoad, budget: int) -> Row:
        tokens, decoding = self.script[self.at]
        self.loads.append((load, budget))
        if decoding:
            tokens += min(self.drafts, budget)
            frame = token_frame(self.id, self.at, [7] * tokens, 0, True, return_last=tokens)
        else:
            frame = token_frame(self.id, self.at, [7] * tokens, 0, True, fill_only=True)
        self.at += 1
        return Row(frame, decoding)


def names(plan) -> list[str]:
    """A plan's rows as ``name:positions``."""
    return [f"{request.id}:{row.tokens}" for request, row in plan.rows]


def plans_of(requests: list[FakeRequest], step_tokens: int = 512, inflight: int = 1) -> list[list[str]]:
    """The steps ``schedule()`` forms from ``requests`` all ready at once, one row each (no step
    is run: each plan is taken as it comes)."""

    async def main():
        engine: EngineCore[FakeRequest] = EngineCore(steps=BatchSteps(step_tokens, inflight))
        for request in requests:
            engine.add(request)
            engine.ready(request)
        plans = []
        while True:
            plan = engine.schedule()
            if not plan.rows:
                break
            plans.append(names(plan))
        await engine.close()
        return plans

    return asyncio.run(main())


async def drive(
    requests: list[FakeRequest],
    run,
    steps: BatchSteps | None,
    *,
    clock=None,
    arrive_after: dict[int, list[FakeRequest]] | None = None,
) -> EngineCore[FakeRequest]:
    """Runs the engine loop over ``requests`` until each has played its script (or failed):
    ``run`` carries each step; ``arrive_after``: requests made ready once that many steps were
    answered."""
    done = asyncio.Event()
    answered_steps = [0]
    later = dict(arrive_after or {})

    async def answered(rows, answers, elapsed):
        for (request, _), answer in zip(rows, answers, strict=True):
            request.answers.append(answer)
            if isinstance(answer, BaseException) or request.at == len(request.script):
                request.status = RequestStatus.FINISHED
                engine.remove(request)
            else:
                engine.ready(request)
        answered_steps[0] += 1
        for request in later.pop(answered_steps[0], []):
            engine.add(request)
            engine.ready(request)
        if not engine.requests and not later:
            done.set()

    kw = {} if clock is None else {"clock": clock}
    engine: EngineCore[FakeRequest] = EngineCore(run, answered, steps=steps, **kw)
    for request in requests:
        engine.add(request)
        engine.ready(request)
    await asyncio.wait_for(done.wait(), 30)
    await engine.close()
    return engine


VOCAB = 13


def target(context: list[int]) -> int:
    """The toy target's greedy next token."""
    return (context[-1] * 7 + context[-2] * 3 + 1) % VOCAB


def greedy(prompt: list[int], tokens: int) -> list[int]:
    context = list(prompt)
    for _ in range(tokens):
        context.append(target(context))
    return context[len(prompt) :]


def answer_on_cache(
    cache: list[list], row, compute_micros: tuple[int, ...] = ()
) -> activation_pb2.StepResult:
    """One row on a session's cache of (token, valid) slots: its invalidate ranges masked, its
    tokens appended at the next logical position, the toy target's answers for the positions it
    returns."""
    for start, end in row.invalidate:
        assert 0 <= start <= end <= len(cache), (start, end, len(cache))
        for slot in cache[start:end]:
            slot[1] = False
    valid = [token for token, ok in cache if ok]
    # Positions are logical: a row continues the valid sequence, wherever its slots are.
    assert int(row.positions[0]) == len(valid), (row.positions.tolist(), len(valid))
    tokens = row.activations[0].tolist()
    answers = []
    for i, token in enumerate(tokens):
        cache.append([token, True])
        valid.append(token)
        if row.return_mode is not ReturnMode.NONE and i >= len(tokens) - row.return_last:
            answers.append(target(valid))
    return activation_pb2.StepResult(
        session_id=row.session_id,
        step_id=row.step_id,
        top1=activation_pb2.Top1(token_ids=answers, probabilities=[1.0] * len(answers)),
        stage_compute_micros=list(compute_micros),
    )


@dataclass(frozen=True)
class SeenRow:
    """One row of a step the toy fleet ran: whose (the request's id and status as the engine's
    table had them), its positions, and whether it only filled the cache."""

    request: RequestId
    status: RequestStatus
    tokens: int
    fill_only: bool


class ToyFleet:
    """A batching ring of one stage holding the toy target: each session's cache by slot (token,
    valid), masked by the rows' invalidate ranges. The ``n``-th session opened answers Unavailable
    (its lane died) to every row after its first ``dies_after[n]``, and from step ``lane_dies_at``
    (counted from 1) on every session opened before it does; each step's rows are recorded with the
    request each belongs to (``engine``: the generation's, set by the test)."""

    truncates_on_rewind, verifies_trees, num_stages = False, True, 1

    def __init__(
        self,
        dies_after: dict[int, int] | None = None,
        *,
        lane_dies_at: int = 0,
        step_tokens: int = 512,
        inflight: int = 1,
    ):
        self.batch_steps = BatchSteps(step_tokens, inflight)
        self.dies_after = dies_after or {}
        self.lane_dies_at = lane_dies_at
        self.dead: set[str] = set()
        self.caches: dict[str, list[list]] = {}
        self.opened: list[str] = []
        self.aborted: list[str] = []
        self.rows_of: Counter[str] = Counter()
        self.steps: list[list[SeenRow]] = []
        self.engine: EngineCore | None = None

    async def open_session(self, session_id, capacity=None, admission=None) -> int:
        self.opened.append(session_id)
        self.caches[session_id] = []
        return 4096

    async def run(self, frames: list[activation_pb2.ActivationFrame]) -> list:
        assert self.engine is not None
        owners = {r.session_id: (r.id, r.status) for r in self.engine.requests.values()}
        await asyncio.sleep(0)  # the step travels
        if len(self.steps) + 1 == self.lane_dies_at:
            self.dead.update(self.opened)
        seen, answers = [], []
        for frame in frames:
            (row,) = step_from_frame(frame, "input_ids").rows
            owner, status = owners[row.session_id]
            fill = row.return_mode is ReturnMode.NONE
            seen.append(SeenRow(owner, status, len(row.positions), fill))
            self.rows_of[row.session_id] += 1
            limit = self.dies_after.get(self.opened.index(row.session_id))
            if row.session_id in self.dead or (limit is not None and self.rows_of[row.session_id] > limit):
                answers.append(Unavailable(f"stage 0 serving {row.session_id} is unreachable"))
            else:
                answers.append(self._run(row))
        self.steps.append(seen)
        return answers

    def _run(self, row) -> activation_pb2.StepResult:
        return answer_on_cache(self.caches[row.session_id], row)

    async def release_session(self, session_id) -> None:
        self.caches.pop(session_id, None)

    async def abort_session(self, session_id, reason="") -> None:
        self.aborted.append(session_id)
        self.caches.pop(session_id, None)


class TwoLanes:
    """What a failover reads of the replica lanes: two, both healthy, no per-hop parts."""

    lanes = ("lane 0", "lane 1")
    healthy = True
    num_stages = 1

    def lane_of(self, session_id: str) -> int:
        return 0

    def broken(self, session_id: str) -> list[int]:
        return []
