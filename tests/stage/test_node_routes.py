"""Per-hop routing on one stage: each row goes to the next hop its session is routed to (one
frame per hop when a step's rows part ways), a route names a next hop by its index (one it does
not know is refused naming it), and a re-pointed session's next frames take the new hop."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from pipeshard.errors import InvalidArgument, NotFound
from pipeshard.services.stage.domain import ReturnMode, RowKind, Step, StepOutput, StepRow
from pipeshard.services.stage.node import StageNode
from pipeshard.services.stage.sessions import SessionTable
from pipeshard.services.stage.wire import frame_from_step
from pipeshard.tensor_codec import decode

HIDDEN = 8


class _NoKv:
    past_length = 0

    def reset(self) -> None:
        pass


class _MiddleEngine:
    """A non-final stage's engine reduced to what StageNode asks: each row's hidden states, its
    input plus one (so a test sees which row went where)."""

    is_first = False
    is_last = False
    hidden_size = HIDDEN

    def __init__(self):
        self.sessions = SessionTable(_NoKv, max_sessions=8, idle_timeout_s=60.0)
        self.kept: list[tuple[str, int]] = []

    def open(self, owner: str, session_id: str, capacity: int | None = None) -> None:
        self.sessions.open(owner, session_id)

    def keep_positions(self, owner: str, session_id: str, positions: int) -> None:
        self.kept.append((session_id, positions))

    def run_step(self, step):
        return [StepOutput(row=row, hidden_states=row.activations + 1) for row in step.rows]


class _Hop:
    """A next hop that records the frames sent to it."""

    def __init__(self, address: str):
        self.address = address
        self.link = None
        self.sent: list = []

    async def send(self, frame) -> None:
        self.sent.append(frame)

    async def close(self) -> None:
        pass


def _row(session: str, value: float) -> StepRow:
    return StepRow(
        session_id=session,
        step_id=1,
        kind=RowKind.DECODE,
        positions=np.arange(1),
        activations=np.full((1, 1, HIDDEN), value, np.float32),
        return_mode=ReturnMode.TOP1,
    )


def _node() -> tuple[StageNode, list[_Hop]]:
    hops = [_Hop("b0:1"), _Hop("b1:1")]
    return StageNode(_MiddleEngine(), 0, next_hops=hops), hops  # type: ignore[arg-type]


def _sessions(frame) -> list[str]:
    return [row.session_id for row in frame.plan.rows]


def _hidden(frame) -> list[float]:
    """Each position's hidden state as its one value (the fake engine's input plus one)."""
    return [float(v) for v in decode(frame.tensors[0].tensor)[0, :, 0]]


def test_a_steps_rows_go_each_to_its_sessions_next_hop():
    async def run():
        node, (own, other) = _node()
        node.open_session("me", "a", None, "")  # unset: the first, its own lane's
        node.open_session("me", "b", None, "", next_hop=1)
        node.open_session("me", "c", None, "", next_hop=0)
        await node.handle(frame_from_step(Step([_row("a", 1), _row("b", 2), _row("c", 3)], "me")))
        assert [_sessions(f) for f in own.sent] == [["a", "c"]]
        assert [_sessions(f) for f in other.sent] == [["b"]]
        assert _hidden(own.sent[0]) == [2.0, 4.0] and _hidden(other.sent[0]) == [3.0]  # each row's own
        # One step whose rows all go one way leaves as it came: one frame, every row.
        await node.handle(frame_from_step(Step([_row("a", 1), _row("c", 3)], "me")))
        assert _sessions(own.sent[-1]) == ["a", "c"] and len(other.sent) == 1
        # Re-pointed (and cut back): its next frames take the new hop.
        assert node.route_session("me", "a", 1, 0) == 0
        assert node.engine.kept == [("a", 0)]
        await node.handle(frame_from_step(Step([_row("a", 1)], "me")))
        assert _sessions(other.sent[-1]) == ["a"]

    asyncio.run(run())


def test_a_next_hop_the_stage_does_not_have_is_refused_naming_it_and_opens_nothing():
    node, _ = _node()
    with pytest.raises(InvalidArgument) as info:
        node.open_session("me", "a", None, "", next_hop=2)
    assert "next_hop" in str(info.value) and "2" in str(info.value) and "b1:1" in str(info.value)
    assert not node.engine.sessions.has("me", "a")
    node.open_session("me", "a", None, "")
    with pytest.raises(InvalidArgument, match="next_hop"):
        node.route_session("me", "a", 7, None)
    with pytest.raises(NotFound):  # another owner's session: as unknown as none
        node.route_session("stranger", "a", 0, None)
    assert node.engine.sessions.hop("me", "a") == 0
