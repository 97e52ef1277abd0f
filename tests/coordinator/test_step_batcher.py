"""StepBatcher (fast, fake step runner): how steps are formed from the waiting frames, and plan
frames through the wire helpers."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from pipeshard.errors import InvalidArgument, NotFound
from pipeshard.services.coordinator.step_batcher import StepBatcher
from pipeshard.services.stage.domain import ReturnMode
from pipeshard.services.stage.wire import plan_from_frames, steps_from_plan, token_frame
from pipeshard.v1 import activation_pb2


def _frame(session: str, tokens: int, step: int = 0) -> activation_pb2.ActivationFrame:
    return token_frame(session, step, list(range(1, tokens + 1)), 0, True)


def test_a_step_takes_every_decode_row_and_prefill_chunks_within_the_budget():
    seen: list[list[str]] = []

    async def run(frames):
        seen.append([f"{f.session_id}:{len(f.positions)}" for f in frames])
        return [activation_pb2.StepResult(session_id=f.session_id) for f in frames]

    async def main():
        batcher = StepBatcher(run, sessions=lambda: 5, step_tokens=300, gather_s=0.05)
        frames = [_frame("p1", 256), _frame("d1", 1), _frame("p2", 256), _frame("d2", 4), _frame("p3", 40)]
        results = await asyncio.gather(*(batcher.step(f) for f in frames))
        await batcher.close()
        return results, batcher

    results, batcher = asyncio.run(main())
    assert [r.session_id for r in results] == ["p1", "d1", "p2", "d2", "p3"]
    # Decode rows first, then chunks in arrival order while 300 tokens last; p2 waits a step.
    assert seen == [["d1:1", "d2:4", "p1:256", "p3:40"], ["p2:256"]]
    assert (batcher.steps_run, batcher.rows_run) == (2, 5)


def test_a_chunk_larger_than_the_budget_runs_alone_and_errors_reach_their_caller():
    async def run(frames):
        return [NotFound("gone") if f.session_id == "bad" else activation_pb2.StepResult() for f in frames]

    async def main():
        batcher = StepBatcher(run, sessions=lambda: 2, step_tokens=16, gather_s=0.05)
        big, bad = batcher.step(_frame("big", 64)), batcher.step(_frame("bad", 1))
        out = await asyncio.gather(big, bad, return_exceptions=True)
        await batcher.close()
        return out

    ok, error = asyncio.run(main())
    assert isinstance(ok, activation_pb2.StepResult) and isinstance(error, NotFound)


def test_plan_frames_carry_each_rows_tokens_and_return_mode():
    a, b = _frame("a", 3, step=7), token_frame("b", 2, [9], 5, False, return_last=1)
    plan = plan_from_frames([a, b])
    assert [r.tokens for r in plan.plan.rows] == [3, 1] and list(plan.positions) == [0, 1, 2, 5]
    steps = steps_from_plan(plan, "input_ids")
    assert [(s.session_id, s.step_id, s.return_mode) for s in steps] == [
        ("a", 7, ReturnMode.TOP1),
        ("b", 2, ReturnMode.LOGITS),
    ]
    np.testing.assert_array_equal(steps[1].activations, [[9]])
    np.testing.assert_array_equal(steps[1].positions, [5])
    plan.plan.rows[0].tokens = 2
    with pytest.raises(InvalidArgument, match="`plan`"):
        steps_from_plan(plan, "input_ids")
