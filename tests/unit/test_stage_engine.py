"""The stage's step logic against a fake shard session: validation, mask updates, results, reaping."""

from __future__ import annotations

import numpy as np
import pytest

from pipeshard.errors import InvalidArgument, NotFound, ResourceExhausted
from pipeshard.services.stage.domain import ReturnMode, StepInput, top1_of
from pipeshard.services.stage.engine import StageEngine
from pipeshard.services.stage.sessions import SessionTable

VOCAB, HIDDEN = 11, 4


class FakeSession:
    """Records calls; 'logits' favour token (last position + 3) % VOCAB."""

    def __init__(self):
        self.past_length = 0
        self.invalidated: list[tuple[int, int]] = []
        self.calls: list[tuple[np.ndarray, int]] = []

    def run(self, x, position_ids, return_last=1):
        self.calls.append((position_ids.copy(), return_last))
        self.past_length += x.shape[1]
        logits = np.zeros((1, return_last, VOCAB), np.float32)
        for i, p in enumerate(position_ids[0, -return_last:]):
            logits[0, i, (p + 3) % VOCAB] = 5.0
        return logits

    def invalidate(self, start, end):
        self.invalidated.append((start, end))

    def reset(self):
        self.past_length = 0


def engine(last=True, first=True, max_context=16):
    return StageEngine(
        SessionTable(FakeSession, 2, 60.0),
        is_first=first,
        is_last=last,
        hidden_size=HIDDEN,
        max_context=max_context,
    )


def step(ids, positions, **kw):
    return StepInput(
        session_id="s",
        step_id=0,
        positions=np.asarray(positions, np.int64),
        activations=np.asarray([ids], np.int64),
        **kw,
    )


def test_top1_returns_argmax_and_probability():
    top = top1_of(np.log(np.array([[0.1, 0.7, 0.2]], np.float32)))
    assert top.token_ids.tolist() == [1]
    assert top.probabilities[0] == pytest.approx(0.7, rel=1e-5)


def test_step_applies_mask_update_before_running_and_returns_last_positions():
    e = engine()
    e.sessions.open("s")
    e.run(step([1, 2, 3, 4], [0, 1, 2, 3]))
    out = e.run(step([5, 6, 7], [2, 3, 4], invalidate=[(2, 4)], return_last=3))
    session = e.sessions.get("s")
    assert session.invalidated == [(2, 4)]
    assert out.top1.token_ids.tolist() == [5, 6, 7]
    assert out.step.compute_micros and len(out.step.compute_micros) == 1
    logits = e.run(step([8], [5], return_mode=ReturnMode.LOGITS)).logits
    assert logits.shape == (1, VOCAB) and logits.argmax() == 8


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"ids": [1, 2], "positions": [0]}, "`positions`"),
        ({"ids": [1], "positions": [0], "invalidate": [(0, 5)]}, "`mask_update`"),
        ({"ids": [1], "positions": [0], "return_last": 2}, "`return_last`"),
        ({"ids": list(range(17)), "positions": list(range(17))}, "max_context"),
    ],
)
def test_bad_steps_name_the_field(kwargs, field):
    e = engine()
    e.sessions.open("s")
    ids, positions = kwargs.pop("ids"), kwargs.pop("positions")
    with pytest.raises(InvalidArgument, match=field):
        e.run(step(ids, positions, **kwargs))
    assert e.sessions.get("s").calls == []


def test_wrong_activation_dtype_and_shape_are_rejected():
    e = engine(first=False)
    e.sessions.open("s")
    bad = StepInput(
        session_id="s",
        step_id=0,
        positions=np.zeros(1, np.int64),
        activations=np.zeros((1, 1, HIDDEN + 1), np.float32),
    )
    with pytest.raises(InvalidArgument, match=r"`hidden_states` must be float32 \[1, T>0, 4\]"):
        e.run(bad)
    bad.activations = np.zeros((1, 1, HIDDEN), np.float16)
    with pytest.raises(InvalidArgument, match="float16"):
        e.run(bad)


def test_sessions_are_bounded_unique_and_reaped_when_idle():
    table = SessionTable(FakeSession, 2, idle_timeout_s=10.0)
    table.open("a")
    with pytest.raises(InvalidArgument, match="already open"):
        table.open("a")
    table.open("b")
    with pytest.raises(ResourceExhausted):
        table.open("c")
    with pytest.raises(NotFound):
        table.get("zz")
    with pytest.raises(InvalidArgument, match="`session_id`"):
        table.open("")
    import time

    now = time.monotonic()
    table.get("b")
    assert table.reap_idle(now + 5) == []
    assert sorted(table.reap_idle(now + 11)) == ["a", "b"]
    assert len(table) == 0 and table.release("a") is False


def test_released_sessions_are_reset_and_reused():
    table = SessionTable(FakeSession, 2, idle_timeout_s=10.0)
    first = table.open("a")
    first.past_length = 7
    table.release("a")
    assert first.past_length == 0
    assert table.open("b") is first
    assert table.open("c") is not first
