"""The engine loop's ``schedule()`` and batch queue (fast, fake requests and step runner): what one
step carries under one token budget, in which order, how many steps travel at once, and plan
frames through the wire helpers."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from pipeshard.errors import InvalidArgument, NotFound
from pipeshard.services.coordinator.engine import EngineCore, StepPlan
from pipeshard.services.coordinator.generation import Generation, Speculation
from pipeshard.services.coordinator.main import CoordinatorSettings, resolve
from pipeshard.services.coordinator.ring import Ring
from pipeshard.services.coordinator.sampling import SamplingParams
from pipeshard.services.coordinator.speculation.policy import StepLoad
from pipeshard.services.coordinator.step_batcher import BatchSteps, Grouping
from pipeshard.services.stage.domain import ReturnMode, RowKind
from pipeshard.services.stage.wire import plan_from_frames, step_from_frame, token_frame
from pipeshard.v1 import activation_pb2
from tests.coordinator.engine_fakes import PAGED_KV, FakeRequest, drive, names, plans_of

CHUNK, DECODE = False, True


def test_one_budget_counts_decode_rows_and_chunks_and_decode_rows_go_first():
    requests = [
        FakeRequest("p1", [(256, CHUNK)], fresh=False),
        FakeRequest("d1", [(1, DECODE)]),
        FakeRequest("p2", [(256, CHUNK)], fresh=False),
        FakeRequest("d2", [(4, DECODE)]),
        FakeRequest("p3", [(40, CHUNK)], fresh=False),
    ]
    # Decode rows first (5 positions), then chunks in arrival order while 300 tokens last: p3's
    # 40 would fit beside p1 alone (44 left) but not beside p1 and the decode rows (39).
    assert plans_of(requests, step_tokens=300) == [["d1:1", "d2:4", "p1:256"], ["p2:256", "p3:40"]]


def test_chunks_ride_beside_decode_rows_of_other_requests():
    requests = [FakeRequest("p", [(100, CHUNK)], fresh=False), FakeRequest("d", [(1, DECODE)])]
    assert plans_of(requests, step_tokens=512) == [["d:1", "p:100"]]


def test_speculative_positions_count_in_the_budget_and_a_row_that_does_not_fit_waits():
    """Drafts take what the step's rows leave of the budget (v's 32 wanted, 4 left beside d and
    p's chunk); a replayed row of 33 positions leaves no room for b's 10, which waits for the next
    step; the first row of a step always goes."""
    drafting = [
        FakeRequest("v", [(1, DECODE)], drafts=32),
        FakeRequest("d", [(1, DECODE)]),
        FakeRequest("p", [(34, CHUNK)], fresh=False),
    ]
    assert plans_of(drafting, step_tokens=40) == [["v:5", "d:1", "p:34"]]
    waiting = [FakeRequest("a", [(33, DECODE)]), FakeRequest("b", [(10, DECODE)])]
    assert plans_of(waiting, step_tokens=40) == [["a:33"], ["b:10"]]
    assert plans_of([FakeRequest("big", [(64, CHUNK)])], step_tokens=16) == [["big:64"]]


def test_k_is_chosen_from_the_step_being_formed():
    """Each decode row is drafted knowing the rest of its step (rows and positions, its own
    base row excepted) and the budget the rows before it left."""
    a = FakeRequest("a", [(1, DECODE)], drafts=3)
    b = FakeRequest("b", [(1, DECODE)], drafts=3)
    c = FakeRequest("c", [(20, CHUNK)], fresh=False)
    assert plans_of([a, b, c], step_tokens=30) == [["a:4", "b:4", "c:20"]]
    assert a.loads == [(StepLoad(2, 21), 8)]  # b's 1 and c's 20 beside it; 30 - 22 left
    assert b.loads == [(StepLoad(2, 24), 5)]  # a's drafts counted now
    assert c.loads == [(StepLoad(2, 8), 0)]  # chunks draft nothing


def test_schedule_returns_a_typed_plan_of_decode_rows_then_chunks():
    async def main():
        engine: EngineCore[FakeRequest] = EngineCore(steps=BatchSteps(64, 1))
        for request in (FakeRequest("c", [(40, CHUNK)], fresh=False), FakeRequest("d", [(3, DECODE)])):
            engine.add(request)
            engine.ready(request)
        plan = engine.schedule()
        await engine.close()
        return plan

    plan = asyncio.run(main())
    assert isinstance(plan, StepPlan)
    assert names(plan) == ["d:3", "c:40"] and [row.decoding for _, row in plan.rows] == [True, False]
    assert plan.tokens == 43


def test_batch_jobs_rows_are_the_lower_class_of_a_steps_budget():
    """A job's rows that arrived first still leave the budget to an interactive row."""
    job = Grouping(1)
    requests = [
        FakeRequest("j1", [(20, DECODE)], grouping=job),
        FakeRequest("j2", [(20, DECODE)], grouping=job),
        FakeRequest("i1", [(20, DECODE)]),
        FakeRequest("p", [(40, CHUNK)], fresh=False),
    ]
    # Arrival order would have given [j1, j2], then [i1], then [p].
    assert plans_of(requests, step_tokens=45) == [["i1:20", "j1:20"], ["j2:20"], ["p:40"]]


def test_rows_that_cannot_all_ride_take_turns_across_identities():
    """Six decode rows on an engine of two groups (three rows a step): the four of identity a
    arrived first, yet b's rows take turns with them."""
    requests = [FakeRequest(f"a{i}", [(1, DECODE)], identity="a") for i in range(4)]
    requests += [FakeRequest(f"b{i}", [(1, DECODE)], identity="b") for i in range(2)]
    assert plans_of(requests, inflight=2) == [["a0:1", "b0:1", "a1:1"], ["a2:1", "b1:1", "a3:1"]]
    alone = [FakeRequest(f"a{i}", [(1, DECODE)], identity="a") for i in range(6)]
    assert plans_of(alone, inflight=2) == [["a0:1", "a1:1", "a2:1"], ["a3:1", "a4:1", "a5:1"]]


def test_a_newcomers_first_chunk_goes_ahead_of_later_chunks_and_passed_over_chunks_come_next():
    seen: list[list[str]] = []

    async def run(frames):
        seen.append([f.session_id for f in frames])
        await asyncio.sleep(0.01)
        return [activation_pb2.StepResult(session_id=f.session_id) for f in frames]

    # Two long prompts in the middle of their prefill, one decoding session, and a newcomer; E
    # arrives once the first step is answered.
    requests = [
        FakeRequest("A", [(256, CHUNK)], fresh=False),
        FakeRequest("C", [(256, CHUNK)], fresh=False),
        FakeRequest("d", [(1, DECODE)]),
        FakeRequest("B", [(256, CHUNK)]),
    ]
    late = FakeRequest("E", [(256, CHUNK)])
    asyncio.run(drive(requests, run, BatchSteps(300, 1), arrive_after={1: [late]}))
    # B's first chunk rides in the first step ahead of A's and C's later chunks; those, passed over
    # once, go before the newcomer E that arrived after them: nobody waits indefinitely.
    assert seen == [["d", "B"], ["A"], ["C"], ["E"]]


def test_a_runner_that_raises_or_answers_an_error_fails_the_rows_it_concerns():
    async def run(frames):
        if len(frames) == 1:
            raise RuntimeError("stage exploded")
        return [NotFound("gone") if f.session_id == "bad" else activation_pb2.StepResult() for f in frames]

    ok, bad = FakeRequest("ok", [(1, DECODE), (1, DECODE)]), FakeRequest("bad", [(1, DECODE)])
    asyncio.run(drive([ok, bad], run, BatchSteps(16, 1)))
    assert isinstance(ok.answers[0], activation_pb2.StepResult) and isinstance(bad.answers[0], NotFound)
    assert isinstance(ok.answers[1], RuntimeError)  # alone in its step: the runner raised for it


def test_an_expedited_requests_next_row_leaves_at_once_alone():
    """A failover's resend does not wait for the step in flight; the request's later rows batch."""
    seen: list[list[str]] = []
    gate = asyncio.Event()

    async def run(frames):
        seen.append([f.session_id for f in frames])
        if frames[0].session_id == "slow":
            await gate.wait()
        return [activation_pb2.StepResult(session_id=f.session_id) for f in frames]

    async def scenario():
        done = asyncio.Event()
        engine: EngineCore[FakeRequest]

        async def answered(rows, answers, elapsed):
            for (request, _), answer in zip(rows, answers, strict=True):
                request.answers.append(answer)
                if request.at < len(request.script):
                    engine.ready(request)
                else:
                    request.status = request.status.FINISHED
                    engine.remove(request)
            if not engine.requests:
                done.set()

        engine = EngineCore(run, answered, steps=BatchSteps(512, 1))
        slow, other = FakeRequest("slow", [(1, DECODE)]), FakeRequest("other", [(1, DECODE)])
        moved = FakeRequest("moved", [(20, DECODE), (1, DECODE)])
        engine.add(slow)
        engine.ready(slow)
        while not seen:  # "slow" in flight: the batch queue (inflight 1) is full
            await asyncio.sleep(0.005)
        for request in (other, moved):
            engine.add(request)
        moved.slot.expedited = True  # what a failover's request.expedite() sets
        engine.ready(other)
        engine.ready(moved)
        while len(moved.answers) < 1:  # answered while "slow" is still in flight
            await asyncio.sleep(0.005)
        held = not slow.answers and not other.answers and not moved.slot.expedited
        gate.set()
        await asyncio.wait_for(done.wait(), 30)
        await engine.close()
        return held

    assert asyncio.run(scenario())
    assert seen == [["slow"], ["moved"], ["other", "moved"]]


def test_up_to_inflight_steps_travel_at_once_each_request_in_one_of_them():
    running: set[str] = set()
    steps_seen: list[list[str]] = []

    async def run(frames):
        names_ = [f.session_id for f in frames]
        assert not running & set(names_)  # a request is never in two steps at once
        running.update(names_)
        steps_seen.append(names_)
        await asyncio.sleep(0.01)  # the step travels the stages
        running.difference_update(names_)
        return [activation_pb2.StepResult(session_id=f.session_id, step_id=f.step_id) for f in frames]

    requests = [FakeRequest(f"s{i}", [(1, DECODE)] * 6) for i in range(6)]
    steps = BatchSteps(512, 3)
    asyncio.run(drive(requests, run, steps))
    assert [[a.step_id for a in r.answers] for r in requests] == [list(range(6))] * 6
    assert steps.max_in_flight == 3
    # The six requests split into three groups of (at most) two decode rows.
    assert max(len(s) for s in steps_seen) == 2 and steps.rows_run == 36


@pytest.mark.parametrize(("count", "job_rows"), [(1, 6), (3, 2)])
def test_a_batch_jobs_count_groups_its_own_requests_and_interactive_rows_keep_theirs(count, job_rows):
    """4 interactive requests beside 6 of a batch job on an engine of 2 groups: interactive rows go
    2 a step whatever the job's count; the job's go all 6 in one step (count 1) or 2 a step (3).
    Each request starts with a prefill chunk, as a generation does."""
    decode_rows: list[list[str]] = []

    async def run(frames):
        decode_rows.append([f.session_id for f in frames if len(f.positions) == 1])
        await asyncio.sleep(0.01)
        return [activation_pb2.StepResult(session_id=f.session_id) for f in frames]

    job = Grouping(count)
    script = [(40, CHUNK)] + [(1, DECODE)] * 4
    requests = [FakeRequest(f"i{i}", script) for i in range(4)]
    requests += [FakeRequest(f"j{i}", script, grouping=job) for i in range(6)]
    steps = BatchSteps(512, 2)
    asyncio.run(drive(requests, run, steps))
    interactive = [sum(n.startswith("i") for n in s) for s in decode_rows]
    ours = [sum(n.startswith("j") for n in s) for s in decode_rows]
    assert max(interactive) == 2 and max(ours) == job_rows
    assert sum(ours) == 24 == job.decode_rows_run  # 4 decode rows per request, chunks not counted
    assert 1 <= job.last_prefill_step < job.steps_run and job.launched_s > 0  # chunks in the first steps
    assert steps.inflight == 2 and steps.max_in_flight <= max(2, count)


def test_the_engine_times_decode_steps_by_their_positions_and_drafts_for_the_step_being_formed():
    now = [0.0]

    async def run(frames):  # a fake clock: 30 ms a step plus 4 ms a position
        now[0] += 0.030 + 0.004 * sum(len(f.positions) for f in frames)
        return [activation_pb2.StepResult(session_id=f.session_id) for f in frames]

    # a verifies 1..7 positions (its drafts) beside b and c's decode rows, after their prefill.
    a = FakeRequest("a", [(40, CHUNK)] + [(1, DECODE)] * 7)
    b, c = (FakeRequest(n, [(40, CHUNK)] + [(1, DECODE)] * 7) for n in "bc")
    row = a.next_row

    def growing(chunk, load, budget):  # a's k-th decode row carries k - 1 drafts
        a.drafts = a.at - 1 if a.at else 0
        return row(chunk, load, budget)

    a.next_row = growing  # type: ignore[method-assign]
    steps = BatchSteps(512, 1)
    asyncio.run(drive([a, b, c], run, steps, clock=lambda: now[0]))
    timed = [(s.rows, s.positions) for s in steps.timing.steps]
    assert timed == [(3, p) for p in range(3, 10)]  # the 120-token prefill step left out
    assert steps.timing.estimate(20, rows=3) == pytest.approx(0.030 + 0.004 * 20)
    assert a.loads[-1][0] == StepLoad(2, 2)  # b and c beside a's row
    assert b.loads[-1][0] == StepLoad(2, 8)  # a's 7 positions and c's 1


def test_plan_frames_carry_each_rows_tokens_and_return_mode():
    a, b = token_frame("a", 7, [1, 2, 3], 0, True), token_frame("b", 2, [9], 5, False, return_last=1)
    plan = plan_from_frames([a, b])
    assert [r.tokens for r in plan.plan.rows] == [3, 1] and list(plan.positions) == [0, 1, 2, 5]
    steps = step_from_frame(plan, "input_ids").rows
    assert [(s.session_id, s.step_id, s.return_mode, s.kind) for s in steps] == [
        ("a", 7, ReturnMode.TOP1, RowKind.PREFILL),
        ("b", 2, ReturnMode.LOGITS, RowKind.DECODE),
    ]
    np.testing.assert_array_equal(steps[1].activations, [[9]])
    np.testing.assert_array_equal(steps[1].positions, [5])
    plan.plan.rows[0].tokens = 2
    with pytest.raises(InvalidArgument, match="`plan`"):
        step_from_frame(plan, "input_ids")


def test_inflight_defaults_to_one_batch_per_stage_and_a_negative_setting_is_refused_by_name():
    stages = SimpleNamespace(num_stages=3, run=None)
    assert Ring(stages, PAGED_KV).batch_steps.inflight == 3
    assert Ring(stages, PAGED_KV, inflight=1).batch_steps.inflight == 1
    with pytest.raises(InvalidArgument, match="`inflight`"):
        resolve(CoordinatorSettings(stages=["127.0.0.1:1"], shards=Path("x"), inflight=-1))
    with pytest.raises(ValueError, match="inflight"):
        BatchSteps(inflight=0)


def test_a_generation_on_a_batching_ring_takes_its_step_cost_from_the_ring_and_its_load_from_the_step():
    async def open_session(session_id, capacity):
        return 1024

    ring = Ring(SimpleNamespace(num_stages=2, run=None, open_session=open_session), PAGED_KV)

    def request_of(generation):
        return asyncio.run(
            generation._open([1, 2, 3], SamplingParams(max_tokens=4), Speculation(), True, None, None)
        )

    aware = request_of(Generation(ring, None, set()))
    assert aware.policy.timing is ring.batch_steps.timing and not aware.policy.times_steps
    assert aware.batch_aware
    blind = request_of(Generation(ring, None, set(), batch_aware_k=False))
    assert blind.policy.timing is not ring.batch_steps.timing and blind.policy.times_steps
    assert not blind.batch_aware


@pytest.mark.parametrize(("depth", "travelling"), [(1, 1), (2, 2), (3, 3)])
def test_a_pipelining_requests_next_row_goes_while_its_row_travels(depth, travelling):
    """A request that pipelines (speculation/depth.py) is ready again as soon as its row leaves, so
    its next row is planned into the next step while the first travels, up to its depth; one that
    does not waits for its answer."""
    request = FakeRequest("a", [(1, DECODE)] * 6)
    request.depth = depth
    seen: list[int] = []

    async def run(frames):
        seen.append(request.steps_in_flight)
        await asyncio.sleep(0.005)
        return [activation_pb2.StepResult()] * len(frames)

    steps = BatchSteps(64, 4)
    asyncio.run(drive([request], run, steps))
    assert max(seen) == travelling and steps.max_in_flight == travelling
    assert request.at == 6 and len(request.answers) == 6


def _held_engine(inflight: int) -> tuple[EngineCore[FakeRequest], asyncio.Event]:
    """An engine whose steps travel until the event is set (their answers then go nowhere)."""
    release = asyncio.Event()

    async def run(frames):
        await release.wait()
        return [activation_pb2.StepResult(session_id=f.session_id) for f in frames]

    async def answered(rows, answers, elapsed):
        pass

    return EngineCore(run, answered, steps=BatchSteps(512, inflight)), release


def test_a_rows_drafts_are_chosen_knowing_the_rows_of_the_steps_in_flight():
    """The engine drafts on the coordinator's one loop, so a row is drafted knowing the rows of
    the steps already travelling (``StepLoad.waiting``), whose answers its drafting holds up: of
    4 requests split over 2 steps in flight, the second step's rows know the first's 2."""

    async def main():
        engine, release = _held_engine(inflight=2)
        requests = [FakeRequest(n, [(1, DECODE)], drafts=2) for n in "abcd"]
        for request in requests:
            engine.add(request)
            engine.ready(request)
        await asyncio.sleep(0)  # the engine task forms both steps
        release.set()
        await engine.close()
        return requests

    requests = asyncio.run(main())
    assert [r.loads[0][0] for r in requests] == [
        StepLoad(1, 1, waiting=0),
        StepLoad(1, 3, waiting=0),  # a's drafts counted
        StepLoad(1, 1, waiting=2),
        StepLoad(1, 3, waiting=2),
    ]


def test_a_request_with_nothing_in_flight_does_not_wait_behind_rows_sent_ahead():
    """The steps in flight are at the limit, and one of them carries a row sent ahead (it may be
    dropped): a request with nothing in flight goes at once, its row sure to stand. Without rows
    ahead in flight, the limit holds (plain requests batch up behind it)."""

    async def main(ahead: bool):
        engine, release = _held_engine(inflight=1)
        engine.depth = pipelining_depth = 2 if ahead else 1  # the limit: that many steps in flight
        pipelining = FakeRequest("p", [(1, DECODE)] * 4)
        pipelining.depth = pipelining_depth
        engine.add(pipelining)
        engine.ready(pipelining)
        await asyncio.sleep(0)  # p's row, then (ahead) its row sent ahead: two steps travel
        late = FakeRequest("late", [(1, DECODE)])
        engine.add(late)
        engine.ready(late)
        await asyncio.sleep(0)
        launched = engine.steps.steps_run
        release.set()
        await engine.close()
        return launched, late.at

    assert asyncio.run(main(ahead=True)) == (3, 1)  # late's row went as a third step
    assert asyncio.run(main(ahead=False)) == (1, 0)  # the limit of 1 held: late waits for p's answer
