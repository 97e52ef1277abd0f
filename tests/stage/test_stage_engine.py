"""The stage's step logic against a fake shard session: validation, mask updates, results, reaping."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from pipeshard.errors import InvalidArgument, NotFound, ResourceExhausted
from pipeshard.services.stage.domain import ReturnMode, RowKind, StepRow, top1_of
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


OWNER = "owner-a"


def engine(last=True, first=True, max_context=16):
    return StageEngine(
        SessionTable(FakeSession, 2, 60.0),
        is_first=first,
        is_last=last,
        hidden_size=HIDDEN,
        max_context=max_context,
        vocab_size=VOCAB,
    )


def step(ids, positions, **kw):
    kind = RowKind.VERIFY if kw.get("return_last", 1) > 1 else RowKind.PREFILL
    return StepRow(
        session_id="s",
        owner=OWNER,
        step_id=0,
        kind=kind,
        positions=np.asarray(positions, np.int64),
        activations=np.asarray([ids], np.int64),
        **kw,
    )


def run(e, row):
    """One row through the step interface; its error raised."""
    (out,) = e.run([row])
    if isinstance(out, Exception):
        raise out
    return out


def test_top1_returns_argmax_and_probability():
    top = top1_of(np.log(np.array([[0.1, 0.7, 0.2]], np.float32)))
    assert top.token_ids.tolist() == [1]
    assert top.probabilities[0] == pytest.approx(0.7, rel=1e-5)


def test_step_applies_mask_update_before_running_and_returns_last_positions():
    e = engine()
    e.sessions.open(OWNER, "s")
    run(e, step([1, 2, 3, 4], [0, 1, 2, 3]))
    out = run(e, step([5, 6, 7], [2, 3, 4], invalidate=((2, 4),), return_last=3))
    session = e.sessions.get(OWNER, "s")
    assert session.invalidated == [(2, 4)]
    assert out.top1.token_ids.tolist() == [5, 6, 7]
    logits = run(e, step([8], [5], return_mode=ReturnMode.LOGITS)).logits
    assert logits.shape == (1, VOCAB) and logits.argmax() == 8


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"ids": [1, 2], "positions": [0]}, "`positions`"),
        ({"ids": [1], "positions": [0], "invalidate": ((0, 5),)}, "`mask_update`"),
        ({"ids": [1], "positions": [0], "return_last": 2}, "`return_last`"),
        ({"ids": [VOCAB], "positions": [0]}, r"`input_ids` must lie in \[0, 11\), got 11"),
        ({"ids": [-5], "positions": [0]}, "`input_ids`.*got -5"),
        ({"ids": [1], "positions": [16]}, r"`positions` must lie in \[0, 16\), got 16"),
        ({"ids": [1], "positions": [-100]}, "`positions`.*got -100"),
    ],
)
def test_bad_steps_name_the_field(kwargs, field):
    e = engine()
    e.sessions.open(OWNER, "s")
    ids, positions = kwargs.pop("ids"), kwargs.pop("positions")
    with pytest.raises(InvalidArgument, match=field):
        run(e, step(ids, positions, **kwargs))
    assert e.sessions.get(OWNER, "s").calls == []


def test_a_step_beyond_max_context_is_resource_exhausted_like_in_the_runtime():
    """One check, one code for a cache overflow (issue #11: it was INVALID_ARGUMENT here)."""
    e = engine()
    e.sessions.open(OWNER, "s")
    with pytest.raises(ResourceExhausted, match="max_context 16"):
        run(e, step([1] * 17, [0] * 17))  # positions in range, but 17 rows do not fit the cache
    assert e.sessions.get(OWNER, "s").calls == []


def test_wrong_activation_dtype_and_shape_are_rejected():
    e = engine(first=False)
    e.sessions.open(OWNER, "s")
    bad = StepRow(
        session_id="s",
        owner=OWNER,
        step_id=0,
        kind=RowKind.DECODE,
        positions=np.zeros(1, np.int64),
        activations=np.zeros((1, 1, HIDDEN + 1), np.float32),
    )
    with pytest.raises(InvalidArgument, match=r"`hidden_states` must be float32 \[1, T>0, 4\]"):
        run(e, bad)
    with pytest.raises(InvalidArgument, match="float16"):
        run(e, bad.carrying(np.zeros((1, 1, HIDDEN), np.float16)))


def test_sessions_are_bounded_unique_and_reaped_when_idle():
    table = SessionTable(FakeSession, 2, idle_timeout_s=10.0)
    table.open(OWNER, "a")
    with pytest.raises(InvalidArgument, match="already open"):
        table.open(OWNER, "a")
    table.open(OWNER, "b")
    with pytest.raises(ResourceExhausted):
        table.open(OWNER, "c")
    with pytest.raises(NotFound):
        table.get(OWNER, "zz")
    with pytest.raises(InvalidArgument, match="`session_id`"):
        table.open(OWNER, "")
    import time

    now = time.monotonic()
    table.get(OWNER, "b")
    assert table.reap_idle(now + 5) == []
    assert sorted(table.reap_idle(now + 11)) == ["a", "b"]
    assert len(table) == 0 and table.release(OWNER, "a") is False


def test_released_sessions_are_reset_and_reused():
    table = SessionTable(FakeSession, 2, idle_timeout_s=10.0)
    first = table.open(OWNER, "a")
    first.past_length = 7
    table.release(OWNER, "a")
    assert first.past_length == 0
    assert table.open(OWNER, "b") is first
    assert table.open(OWNER, "c") is not first


def test_sessions_belong_to_their_owner_and_ids_do_not_collide_across_owners():
    table = SessionTable(FakeSession, 8, idle_timeout_s=10.0, max_per_owner=2)
    mine = table.open(OWNER, "s")
    theirs = table.open("owner-b", "s")  # same id, another owner: no collision, no hint
    assert mine is not theirs
    with pytest.raises(NotFound, match="unknown session 's'"):
        table.get("owner-c", "s")
    assert table.release("owner-c", "s") is False
    assert table.get(OWNER, "s") is mine
    table.open(OWNER, "t")
    with pytest.raises(ResourceExhausted, match="max_sessions_per_owner"):
        table.open(OWNER, "u")
    table.open("owner-b", "u")  # another owner still gets sessions
    assert sorted(table.release_owner(OWNER)) == ["s", "t"]
    assert sorted(table.owners()) == ["owner-b"] and len(table) == 2


def test_a_frame_for_another_owners_session_fails_like_an_unknown_session():
    e = engine()
    e.sessions.open(OWNER, "s")
    intruder = replace(step([1], [0]), owner="someone-else")
    with pytest.raises(NotFound, match="unknown session 's'"):
        run(e, intruder)
    assert e.sessions.get(OWNER, "s").calls == []
