"""Failover without processes: a standby copy restores the session and only its tail rides with
the resent step; a copy a stage refuses is given up for a full replay in a fresh session (rows
the engine plans); a broken replica moves only its stage's part of the session (the real kills
run in tests/pipeline/test_failover_fleet.py and test_per_hop_fleet.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np

from pipeshard.errors import Unavailable
from pipeshard.services.coordinator.engine import RequestStatus
from pipeshard.services.coordinator.failover import Failover
from pipeshard.services.coordinator.generation import _Cursor, _Request
from pipeshard.services.coordinator.kv_standby import KvStandby, StandbyCopy
from pipeshard.services.coordinator.ring import StageFailed
from pipeshard.services.coordinator.step_batcher import StepSlot
from pipeshard.shard.kvblob import KvBlob, KvSource, SnapshotBytes, snapshot_chunks, to_proto
from pipeshard.v1 import activation_pb2

SOURCE = KvSource("f", "e", 0, 0, 1, ("k",), kv_heads=1, head_dim=1)
CONTEXT = list(range(1000, 1070))  # a 40-token prompt and 30 generated tokens


class _Lanes:
    lanes = ("lane 0", "lane 1")
    num_stages = 2
    healthy = True

    def __init__(self, refuse: bool = False, broken: list[int] | None = None, move_fails: bool = False):
        self.refuse = refuse
        self.restored: list[str] = []
        self.restored_stages: list[list[int] | None] = []
        self._broken = broken or []
        self.move_fails = move_fails
        self.moved: list[tuple[str, list[int]]] = []
        self.rerouted: list[tuple[str, list[int], int]] = []

    def lane_of(self, session_id: str) -> int:
        return 1

    def route_of(self, session_id: str) -> list[int]:
        return [0, 1]

    def broken(self, session_id: str) -> list[int]:
        return self._broken

    async def move_stages(self, session_id: str, stages: list[int], reason: str) -> None:
        if self.move_fails:
            raise Unavailable("no other replica of stage 1 can take its sessions")
        self.moved.append((session_id, stages))

    async def reroute(self, session_id: str, moved: list[int], keep_positions: int) -> None:
        self.rerouted.append((session_id, moved, keep_positions))

    async def capture_part(self, session_id: str, token_ids: list[int], start: int) -> list[SnapshotBytes]:
        values = np.zeros((1, len(token_ids) - start, 1), np.float32)
        blob = KvBlob.build(SOURCE, [values], tuple(token_ids[start:]), start=start)
        return [SnapshotBytes(tuple(snapshot_chunks(to_proto(blob))[1]), blob.positions)] * 2

    async def restore_parts(
        self,
        session_id: str,
        parts: list[list[SnapshotBytes]],
        timeout_s: float,
        stages: list[int] | None = None,
    ) -> None:
        if self.refuse:
            raise StageFailed(activation_pb2.StageError(stage_index=1, code="INVALID_ARGUMENT", message="no"))
        self.restored.append(session_id)
        self.restored_stages.append(stages)


class _Ring:
    def __init__(self):
        self.opened: list[str] = []
        self.aborted: list[str] = []
        self.steps: list[activation_pb2.ActivationFrame] = []

    async def open_session(self, session_id: str, capacity: int | None = None, admission=None) -> int:
        self.opened.append(session_id)
        return 2048

    async def abort_session(self, session_id: str, reason: str) -> None:
        self.aborted.append(session_id)

    async def step(self, frame):
        self.steps.append(frame)


class _Generating:
    """The parts of a generation's request a failover touches, with the real move and replay."""

    move_to = _Request.move_to
    replay = _Request.replay
    resumed = _Request.resumed
    expedite = _Request.expedite

    def __init__(self):
        self.session_id = "old"
        self.prompt_ids, self.generated = CONTEXT[:40], CONTEXT[40:]
        self.context, self.pending = list(CONTEXT), CONTEXT[-1:]
        self.params = SimpleNamespace(greedy=True, logprobs=False)
        self.cursor = _Cursor("old", True, truncates=True)
        self.top1 = True  # a greedy request with nothing chosen on the coordinator
        self.slot = StepSlot()  # its place in the engine's batching, kept across the move
        self.standby = StandbyCopy()  # its KV captured ahead
        self.admission = None  # the scheduler's (none here: the ring charges nothing)


def _failover(
    refuse: bool, computed: int = 69, lanes: _Lanes | None = None
) -> tuple[_Generating, _Ring, _Lanes, KvStandby]:
    async def main():
        ring, request = _Ring(), _Generating()
        request.cursor.step = 9  # the steps it ran before the failure
        if computed < 69:  # the request is earlier on: its last token pending, the rest computed
            request.context, request.generated = CONTEXT[: computed + 1], CONTEXT[40 : computed + 1]
            request.pending = CONTEXT[computed : computed + 1]
        standby = KvStandby(moving, block_tokens=32, max_bytes=1 << 20)
        standby.computed(request.standby, "old", CONTEXT[:computed])  # all but the pending token
        for _ in range(5):
            await asyncio.sleep(0)
        failover = Failover(moving, standby)
        error = Unavailable("stage 1 at x is unreachable")
        await failover.resume(ring, request, error, capacity=2048, prefill_chunk=32)
        return request, ring, moving, standby

    moving = lanes or _Lanes(refuse)
    return asyncio.run(main())


def test_the_standby_copy_is_restored_and_the_tail_rides_with_the_resent_step():
    request, ring, lanes, standby = _failover(refuse=False)
    assert ring.aborted == ["old"] and ring.opened == [request.session_id] == lanes.restored
    assert request.cursor.logical == 64 and ring.steps == []  # two whole blocks; no fill step
    assert request.pending == CONTEXT[64:]  # the 5 tokens past the copy, then the lost step's
    assert request.standby.attached and request.standby.positions == 64  # it follows the new session
    assert standby.nbytes == request.standby.nbytes > 0  # still counted: the request's
    assert request.slot.expedited  # the resent step goes at once


def test_a_refused_copy_is_given_up_for_a_replay_in_a_fresh_session():
    request, ring, _, standby = _failover(refuse=True)
    first, second = ring.opened
    assert ring.aborted == ["old", first] and request.session_id == second
    # 64 to replay in chunks of 32: the engine's rows (REPLAYING), none sent by the failover
    assert ring.steps == [] and request.replaying == [CONTEXT[:32], CONTEXT[32:64]]
    assert request.status is RequestStatus.REPLAYING and request.cursor.logical == 0
    assert request.pending == CONTEXT[64:] and standby.nbytes == 0
    assert request.standby.attached and request.standby.positions == 0  # the new session's own copy
    assert request.slot.expedited and request.session_id == second


def test_a_copy_of_every_computed_position_keeps_all_but_the_last_so_the_first_row_is_two_tokens():
    """The copy holds all 64 positions computed: the resent step alone would be a one-token row
    right after the restore (the single-query path a two-token stage never takes undisturbed), so
    the session keeps 63 and the resent step carries the 64th again, dropped first (invalidated)."""
    request, ring, lanes, _ = _failover(refuse=False, computed=64)
    assert lanes.restored == [request.session_id] and ring.steps == []
    assert request.cursor.logical == 63 and request.pending == CONTEXT[63:65]
    frame = request.cursor.frame(request.pending)
    assert list(frame.positions) == [63, 64]
    assert [(r.start, r.end) for r in frame.plan.rows[0].mask_update.invalidate] == [(63, 64)]


def test_a_broken_replica_moves_only_its_stage_and_the_session_stays_with_its_step_count():
    """Stage 1's replica is down: its part moves (the others are cut back to the copy's 64
    positions and re-pointed, not reopened), only stage 1's parts of the copy are restored, and the
    session keeps its id and step count (a late answer of a lost step cannot pass for a new one)."""
    request, ring, lanes, standby = _failover(refuse=False, lanes=_Lanes(broken=[1]))
    assert request.session_id == "old" and ring.opened == [] and ring.aborted == []
    assert lanes.moved == [("old", [1])] and lanes.rerouted == [("old", [1], 64)]
    assert lanes.restored == ["old"] and lanes.restored_stages == [[1]]
    assert request.cursor.logical == 64 and request.cursor.step == 9 and ring.steps == []
    assert request.pending == CONTEXT[64:]  # the tail past the copy rides with the resent step
    assert request.standby.attached and request.standby.positions == 64 and standby.nbytes > 0
    assert request.slot.expedited


def test_a_per_hop_move_that_finds_no_replica_falls_back_to_moving_the_whole_session():
    request, ring, lanes, _ = _failover(refuse=False, lanes=_Lanes(broken=[1], move_fails=True))
    assert ring.aborted == ["old"] and ring.opened == [request.session_id] != "old"
    assert lanes.restored_stages == [None]  # every stage's parts, on the new session
    assert request.cursor.logical == 64 and request.cursor.step == 0
