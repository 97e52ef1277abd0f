"""StepBatcher (fast, fake step runner): how steps are formed from the waiting frames, and plan
frames through the wire helpers."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from pipeshard.errors import InvalidArgument, NotFound
from pipeshard.services.coordinator.generation import Generation, Speculation
from pipeshard.services.coordinator.main import CoordinatorSettings, resolve
from pipeshard.services.coordinator.ring import Ring
from pipeshard.services.coordinator.sampling import SamplingParams
from pipeshard.services.coordinator.speculation.policy import StepLoad
from pipeshard.services.coordinator.step_batcher import Grouping, StepBatcher, StepPlan, StepSlot
from pipeshard.services.stage.domain import ReturnMode, RowKind
from pipeshard.services.stage.wire import plan_from_frames, step_from_frame, token_frame
from pipeshard.v1 import activation_pb2


def _frame(session: str, tokens: int, step: int = 0) -> activation_pb2.ActivationFrame:
    """A decode or verify row of up to 33 tokens (the last token and its drafts), else a prefill chunk."""
    ids = list(range(1, tokens + 1))
    if tokens <= 33:
        return token_frame(session, step, ids, 0, True, return_last=tokens)
    return token_frame(session, step, ids, 0, True, fill_only=True)


async def behind_a_held_step(batcher: StepBatcher, gate: asyncio.Event, sessions: list) -> list:
    """Runs the ``sessions`` coroutines with their first frames queued behind a step in flight
    (session "hold", whose runner waits for ``gate``), as the frames of requests that arrive
    during a step: the next step forms from all of them. Returns each session's result."""
    hold = asyncio.ensure_future(batcher.step(_frame("hold", 40)))
    await asyncio.sleep(0.01)
    tasks = [asyncio.ensure_future(s) for s in sessions]
    await asyncio.sleep(0.01)  # every first frame queued
    gate.set()
    await hold
    return await asyncio.gather(*tasks)


def _recorder(seen: list[list[str]], gate: asyncio.Event | None = None, delay: float = 0.0):
    """A fake step runner that records each step's rows as ``session:positions`` (the held
    session "hold" waits for ``gate``)."""

    async def run(frames):
        seen.append([f"{f.session_id}:{len(f.positions)}" for f in frames])
        if gate is not None and frames[0].session_id == "hold":
            await gate.wait()
        await asyncio.sleep(delay)
        return [activation_pb2.StepResult(session_id=f.session_id) for f in frames]

    return run


def test_one_budget_counts_decode_rows_and_chunks_and_decode_rows_go_first():
    seen: list[list[str]] = []

    async def main():
        gate = asyncio.Event()
        batcher = StepBatcher(_recorder(seen, gate), sessions=lambda: 6, step_tokens=300)
        frames = [_frame("p1", 256), _frame("d1", 1), _frame("p2", 256), _frame("d2", 4), _frame("p3", 40)]
        results = await behind_a_held_step(batcher, gate, [batcher.step(f) for f in frames])
        await batcher.close()
        return results, batcher

    results, batcher = asyncio.run(main())
    assert [r.session_id for r in results] == ["p1", "d1", "p2", "d2", "p3"]
    # Decode rows first (5 positions), then chunks in arrival order while 300 tokens last: p3's
    # 40 would fit beside p1 alone (44 left) but not beside p1 and the decode rows (39).
    assert seen[1:] == [["d1:1", "d2:4", "p1:256"], ["p2:256", "p3:40"]]
    assert (batcher.steps_run, batcher.rows_run) == (3, 6)


def test_speculative_positions_count_in_the_budget_and_a_row_that_does_not_fit_waits():
    """A verify row of 32 drafts takes 33 positions of the budget: the next verify row and a
    chunk that no longer fit wait for the next step; the first row of a step always goes."""
    seen: list[list[str]] = []

    async def main():
        gate = asyncio.Event()
        batcher = StepBatcher(_recorder(seen, gate), sessions=lambda: 6, step_tokens=40)
        frames = [_frame("v1", 33), _frame("d", 1), _frame("v2", 10), _frame("p", 34), _frame("big", 33)]
        await behind_a_held_step(batcher, gate, [batcher.step(f) for f in frames])
        await batcher.close()

    asyncio.run(main())
    assert seen[1:] == [["v1:33", "d:1"], ["v2:10"], ["big:33"], ["p:34"]]


def test_schedule_returns_a_typed_plan_of_decode_rows_then_chunks():
    async def main():
        gate = asyncio.Event()
        plans = []
        batcher = StepBatcher(_recorder([], gate), sessions=lambda: 3, step_tokens=64)
        launch = batcher._launch

        def record(plan):
            plans.append(plan)
            launch(plan)

        batcher._launch = record
        await behind_a_held_step(batcher, gate, [batcher.step(_frame("c", 40)), batcher.step(_frame("d", 3))])
        await batcher.close()
        return plans

    plans = asyncio.run(main())
    plan = plans[1]
    assert isinstance(plan, StepPlan)
    assert [w.frame.session_id for w in plan.decode] == ["d"]
    assert [w.frame.session_id for w in plan.chunks] == ["c"]
    assert plan.tokens == 43 and len(plan.rows) == 2


def test_batch_jobs_rows_are_the_lower_class_of_a_steps_budget():
    """A job's rows that arrived first still leave the budget to an interactive row."""
    seen: list[list[str]] = []

    async def main():
        gate = asyncio.Event()
        batcher = StepBatcher(_recorder(seen, gate), sessions=lambda: 6, step_tokens=45)
        job = Grouping(1)

        async def once(name, tokens, grouping):
            slot = StepSlot(grouping)
            await batcher.step(_frame(name, tokens), slot)
            batcher.leave(slot)  # as its generation ends

        rows = [("j1", 20, job), ("j2", 20, job), ("i1", 20, None), ("p", 40, None)]
        await behind_a_held_step(batcher, gate, [once(*row) for row in rows])
        await batcher.close()

    asyncio.run(main())
    # Arrival order would have given [j1, j2], then [i1], then [p].
    assert seen[1:] == [["i1:20", "j1:20"], ["j2:20"], ["p:40"]]


def test_a_step_waits_for_a_thinking_request_and_never_for_an_idle_or_ended_one():
    """No clock decides when a step leaves: it waits exactly for the requests that were answered
    and have not sent again, and for none that said they will not send for a while."""
    seen: list[list[str]] = []

    async def main():
        gate = asyncio.Event()
        batcher = StepBatcher(_recorder(seen, gate), sessions=lambda: 3)
        a, b, c = StepSlot(), StepSlot(), StepSlot()
        await behind_a_held_step(
            batcher, gate, [batcher.step(_frame(n, 1), s) for n, s in (("a", a), ("b", b))]
        )
        assert a.thinking and b.thinking  # answered: their next frames are awaited
        first = seen[1:]
        waiting = asyncio.ensure_future(batcher.step(_frame("a", 1, 1), a))
        await asyncio.sleep(0.05)
        held = not waiting.done()  # b is thinking: a's frame waits for b's
        batcher.idle(b)  # b waits on something else (its client): the step goes without it
        await asyncio.wait_for(waiting, 30)
        again = asyncio.ensure_future(batcher.step(_frame("c", 1), c))
        await asyncio.sleep(0.05)
        held_by_a = not again.done()  # a is thinking again
        batcher.leave(a)  # a ended
        await asyncio.wait_for(again, 30)
        await batcher.close()
        return first, held, held_by_a, a, c

    first, held, held_by_a, a, c = asyncio.run(main())
    assert held and held_by_a
    assert first == [["a:1", "b:1"]]
    assert seen[-2:] == [["a:1"], ["c:1"]] and a.closed and not a.thinking and c.thinking


def test_a_chunk_larger_than_the_budget_runs_alone_and_errors_reach_their_caller():
    async def run(frames):
        return [NotFound("gone") if f.session_id == "bad" else activation_pb2.StepResult() for f in frames]

    async def main():
        batcher = StepBatcher(run, sessions=lambda: 2, step_tokens=16)
        big, bad = batcher.step(_frame("big", 64)), batcher.step(_frame("bad", 1))
        out = await asyncio.gather(big, bad, return_exceptions=True)
        await batcher.close()
        return out

    ok, error = asyncio.run(main())
    assert isinstance(ok, activation_pb2.StepResult) and isinstance(error, NotFound)


def test_an_expedited_session_s_next_frame_leaves_at_once_alone():
    """A failover's resend does not wait for a step in flight; the session's later frames batch."""
    seen: list[list[str]] = []

    async def main():
        gate = asyncio.Event()

        async def run(frames):
            seen.append([f.session_id for f in frames])
            if frames[0].session_id == "slow":
                await gate.wait()
            return [activation_pb2.StepResult(session_id=f.session_id) for f in frames]

        batcher = StepBatcher(run, sessions=lambda: 3, inflight=1)
        slow = asyncio.ensure_future(batcher.step(_frame("slow", 1)))
        while not seen:  # "slow" in flight
            await asyncio.sleep(0.005)
        waiting = asyncio.ensure_future(batcher.step(_frame("other", 1)))
        slot = StepSlot(expedited=True)  # what a failover's request.expedite() sets
        # answered while "slow" is still in flight (without expedite it would wait for ever)
        moved = await asyncio.wait_for(batcher.step(_frame("moved", 20), slot), 30)
        assert not slow.done() and not waiting.done() and not slot.expedited
        batcher.idle(slot)  # it waits on the others before its next frame: not waited for
        gate.set()
        await asyncio.gather(slow, waiting)
        again = await batcher.step(_frame("moved", 1, step=1), slot)
        await batcher.close()
        return moved, again

    moved, again = asyncio.run(main())
    assert moved.session_id == again.session_id == "moved"
    assert seen == [["slow"], ["moved"], ["other"], ["moved"]]


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


def test_up_to_inflight_steps_travel_at_once_each_session_in_one_of_them():
    running: set[str] = set()
    steps: list[list[str]] = []

    async def run(frames):
        names = [f.session_id for f in frames]
        assert not running & set(names)  # a session is never in two steps at once
        running.update(names)
        steps.append(names)
        await asyncio.sleep(0.01)  # the step travels the stages
        running.difference_update(names)
        return [activation_pb2.StepResult(session_id=f.session_id, step_id=f.step_id) for f in frames]

    async def session(batcher, name):
        got, slot = [], StepSlot()
        for step in range(6):
            result = await batcher.step(_frame(name, 1, step), slot)
            got.append((result.session_id, result.step_id))
        batcher.leave(slot)  # as a generation ends
        return got

    async def main():
        batcher = StepBatcher(run, sessions=lambda: 6, inflight=3)
        out = await asyncio.gather(*(session(batcher, f"s{i}") for i in range(6)))
        await batcher.close()
        return out, batcher

    out, batcher = asyncio.run(main())
    assert out == [[(f"s{i}", k) for k in range(6)] for i in range(6)]
    assert batcher.max_in_flight == 3
    # The six sessions split into three groups of (at most) two decode rows.
    assert max(len(s) for s in steps) == 2 and batcher.rows_run == 36


@pytest.mark.parametrize(("count", "job_rows"), [(1, 6), (3, 2)])
def test_a_batch_jobs_count_groups_its_own_sessions_and_interactive_rows_keep_theirs(count, job_rows):
    """4 interactive sessions beside 6 of a batch job on a batcher of 2 groups: interactive rows go
    2 a step whatever the job's count; the job's go all 6 in one step (count 1) or 2 a step (3).
    Each session starts with a prefill chunk, as a generation does (its first frame makes it known
    as the job's)."""
    steps: list[list[str]] = []

    async def run(frames):
        steps.append([f.session_id for f in frames if len(f.positions) == 1])  # decode rows
        await asyncio.sleep(0.01)
        return [activation_pb2.StepResult(session_id=f.session_id) for f in frames]

    async def session(batcher, name, grouping):
        slot = StepSlot(grouping)  # as a job's item's request holds it
        for step in range(5):
            await batcher.step(_frame(name, 40 if step == 0 else 1, step), slot)
        batcher.leave(slot)

    async def main():
        batcher = StepBatcher(run, sessions=lambda: 10, inflight=2)
        job = Grouping(count)
        await asyncio.gather(
            *(session(batcher, f"i{i}", None) for i in range(4)),
            *(session(batcher, f"j{i}", job) for i in range(6)),
        )
        await batcher.close()
        return batcher, job

    batcher, job = asyncio.run(main())
    interactive = [sum(n.startswith("i") for n in s) for s in steps]
    ours = [sum(n.startswith("j") for n in s) for s in steps]
    assert max(interactive) == 2 and max(ours) == job_rows
    assert sum(ours) == 24 == job.decode_rows_run  # 4 decode rows per session, chunks not counted
    assert 1 <= job.last_prefill_step < job.steps_run and job.launched_s > 0  # chunks in the first steps
    assert batcher.inflight == 2 and batcher.max_in_flight <= max(2, count)


def test_a_newcomers_first_chunk_goes_ahead_of_later_chunks_and_passed_over_chunks_come_next():
    seen: list[list[str]] = []

    async def main():
        gate = asyncio.Event()
        batcher = StepBatcher(_recorder(seen, gate, delay=0.01), sessions=lambda: 4, step_tokens=300)
        # Two long prompts in the middle of their prefill, one decoding session, and a newcomer.
        first = [_frame("A", 256, 3), _frame("C", 256, 3), _frame("d", 1, 9), _frame("B", 256, 0)]

        async def late():  # arrives during the step after the held one
            while len(seen) < 2:
                await asyncio.sleep(0.001)
            await batcher.step(_frame("E", 256, 0))

        await behind_a_held_step(batcher, gate, [*(batcher.step(f) for f in first), late()])
        await batcher.close()

    asyncio.run(main())
    # B's first chunk rides in the next step ahead of A's and C's later chunks; those, passed over
    # once, go before the newcomer E that arrived after them: nobody waits indefinitely.
    assert [[r.split(":")[0] for r in step] for step in seen[1:]] == [["d", "B"], ["A"], ["C"], ["E"]]


def test_a_runner_that_raises_fails_the_rows_of_its_step():
    async def run(frames):
        raise RuntimeError("stage exploded")

    async def main():
        batcher = StepBatcher(run, sessions=lambda: 1, inflight=2)
        with pytest.raises(RuntimeError, match="exploded"):
            await batcher.step(_frame("a", 1))
        await batcher.close()

    asyncio.run(main())


def test_inflight_defaults_to_one_batch_per_stage_and_a_negative_setting_is_refused_by_name():
    stages = SimpleNamespace(num_stages=3, run=None)
    assert Ring(stages, paged=True, sessions=lambda: 1).batch_steps.inflight == 3
    assert Ring(stages, paged=True, sessions=lambda: 1, inflight=1).batch_steps.inflight == 1
    with pytest.raises(InvalidArgument, match="`inflight`"):
        resolve(CoordinatorSettings(stages=["127.0.0.1:1"], shards=Path("x"), inflight=-1))
    with pytest.raises(ValueError, match="inflight"):
        StepBatcher(lambda frames: None, sessions=lambda: 1, inflight=0)


def test_the_batcher_times_decode_steps_by_their_positions_and_tells_each_session_its_load():
    now = [0.0]

    gate = asyncio.Event()

    async def run(frames):  # a fake clock: 30 ms a step plus 4 ms a position
        if frames[0].session_id == "hold":  # a prefill chunk: not timed either
            await gate.wait()
        now[0] += 0.030 + 0.004 * sum(len(f.positions) for f in frames)
        return [activation_pb2.StepResult(session_id=f.session_id) for f in frames]

    async def session(batcher, name, slot):
        await batcher.step(_frame(name, 40), slot)  # prefill: not timed
        for step in range(1, 8):  # a verifies 1..7 positions beside b and c's decode rows
            await batcher.step(_frame(name, step if name == "a" else 1, step), slot)
        batcher.idle(slot)

    async def main():
        slots = {s: StepSlot() for s in "abc"}
        batcher = StepBatcher(run, sessions=lambda: 3, clock=lambda: now[0])
        await behind_a_held_step(batcher, gate, [session(batcher, s, slots[s]) for s in "abc"])
        loads = batcher.load(slots["a"]), batcher.load(slots["b"])
        await batcher.close()
        return batcher, loads, batcher.load(StepSlot())

    batcher, (load_a, load_b), forgotten = asyncio.run(main())
    timed = [(s.rows, s.positions) for s in batcher.timing.steps]
    assert timed == [(3, p) for p in range(3, 10)]  # 120-token prefill step left out
    assert batcher.timing.estimate(20, rows=3) == pytest.approx(0.030 + 0.004 * 20)
    assert (load_a.rows, load_a.tokens) == (2, 2)  # b and c beside a's 7 positions
    assert (load_b.rows, load_b.tokens) == (2, 8)
    assert (forgotten.rows, forgotten.tokens) == (3, 9)  # a request not stepped yet: the latest step's


def test_a_generation_on_a_batching_ring_takes_its_step_cost_and_load_from_the_batcher():
    async def open_session(session_id, capacity):
        return 1024

    ring = Ring(
        SimpleNamespace(num_stages=2, run=None, open_session=open_session), paged=True, sessions=lambda: 1
    )

    def policy(generation):
        request = asyncio.run(
            generation._open([1, 2, 3], SamplingParams(max_tokens=4), Speculation(), True, None, None)
        )
        request.slot.load = StepLoad(7, 9)  # the rest of its last step
        return request.policy

    aware = policy(Generation(ring, None, set()))
    assert aware.timing is ring.batch_steps.timing and not aware.times_steps
    assert aware.load() == StepLoad(7, 9)
    blind = policy(Generation(ring, None, set(), batch_aware_k=False))
    assert blind.timing is not ring.batch_steps.timing and blind.times_steps
    assert blind.load() == StepLoad()
