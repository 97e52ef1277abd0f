"""Runs the rows of up to S sessions in one inference on a static shard (pipeshard/shard/static.py).

The static backend behind the step interface (step_engine.py). A session holds one of the
shard's S slots from open to release (continuous batching up to S: the S+1st open is refused with
RESOURCE_EXHAUSTED naming the shard's slots); a step packs each ready row into its session's
slot. What the fixed shapes allow and what they refuse, each by name:

- a row of at most C tokens (the export's chunk): prefill runs in C-token chunks, a verify row
  (speculation) is its last token and drafts within C; a longer row is INVALID_ARGUMENT ``tokens``;
- ``slot_id`` (plan rows): -1 lets the stage use the session's slot; another value must be that
  slot (out of range, or another session's slot, is INVALID_ARGUMENT ``slot_id``); the stage
  writes its slot into the rows it passes on;
- ``prefix_reuse_length``: the row continues after that many of its slot's cached positions (a
  prefix kept from the slot's earlier rows); more than the slot holds is INVALID_ARGUMENT;
- rewind: like the paged cache, the tail only (the slot's length shortens);
- draft trees and rows with their own attention mask: refused, naming the backend.
"""

from __future__ import annotations

import time
from dataclasses import replace

from pipeshard.errors import InvalidArgument
from pipeshard.services.stage.domain import Computed, ReturnMode, StepRow
from pipeshard.services.stage.meters import StageMeters
from pipeshard.services.stage.sessions import SessionTable
from pipeshard.services.stage.step_engine import Ready, RowEngine, tail_rewound
from pipeshard.shard.static import StaticRow, StaticShard
from pipeshard.v1 import stage_pb2


class StaticSession:
    """A session's handle on a static shard: the slot it holds while open."""

    def __init__(self, shard: StaticShard):
        self.shard = shard
        self.slot = -1

    @property
    def past_length(self) -> int:
        return self.shard.length(self.slot) if self.slot >= 0 else 0

    valid_length = past_length

    def reserve(self) -> None:
        if self.slot < 0:
            self.slot = self.shard.acquire()

    def reset(self) -> None:
        """Gives the slot back (the table calls it on release and reaping)."""
        if self.slot >= 0:
            self.shard.release(self.slot)
            self.slot = -1


class StaticEngine(RowEngine[StaticSession]):
    """The stage's compute over a static shard: a slot per session, one inference per step."""

    kv_backend = "static"

    def __init__(
        self,
        shard: StaticShard,
        max_sessions: int,
        idle_timeout_s: float,
        max_per_owner: int | None = None,
        *,
        meters: StageMeters | None = None,
    ):
        self.shard = shard
        self.meters = meters or StageMeters(shard.stage_index)
        self.sessions = SessionTable(
            lambda: StaticSession(shard), max_sessions, idle_timeout_s, max_per_owner
        )
        self.is_first = shard.is_first
        self.is_last = shard.is_last
        self.hidden_size = shard.hidden_size
        self.max_context = shard.max_context
        self.vocab_size = shard.vocab_size

    def describe(self, info: stage_pb2.GetStageInfoResponse, owner: str | None) -> None:
        """The slots open sessions hold."""
        info.static_slots_used = self.shard.slots_used

    def open(self, owner: str, session_id: str, capacity: int | None = None) -> None:
        """Opens a session on a free slot (every slot holds the export's whole context, so
        ``capacity`` needs no reservation); refuses with RESOURCE_EXHAUSTED when all are taken."""
        session = self.sessions.open(owner, session_id)
        try:
            session.reserve()
        except Exception:
            self.sessions.release(owner, session_id)
            raise

    def reset(self, owner: str, session_id: str) -> None:
        """Forgets the session's tokens; it keeps its slot."""
        session = self.sessions.get(owner, session_id)
        session.reserve()
        self.shard.rewind(session.slot, 0)

    def _rewound(self, row: StepRow, session: StaticSession) -> int:
        length = tail_rewound(row, session.past_length, "a static slot")
        if row.prefix_reuse_length:
            if not 0 < row.prefix_reuse_length <= length:
                raise InvalidArgument(
                    "prefix_reuse_length",
                    f"must be in [0, {length}] (the positions slot {session.slot} holds), "
                    f"got {row.prefix_reuse_length}",
                )
            length = row.prefix_reuse_length
        return length

    def _check_room(self, row: StepRow, session: StaticSession, start: int) -> None:
        if row.slot_id not in (-1, session.slot):
            if not 0 <= row.slot_id < self.shard.slots:
                raise InvalidArgument(
                    "slot_id",
                    f"must be -1 or in [0, {self.shard.slots}) on the {self.shard.name}, got {row.slot_id}",
                )
            raise InvalidArgument(
                "slot_id", f"session {row.session_id!r} holds slot {session.slot}, not {row.slot_id}"
            )
        self.shard.check(self._static_row(row, session, start))

    def _static_row(self, row: StepRow, session: StaticSession, start: int) -> StaticRow:
        want = row.return_last if self.is_last and row.return_mode is not ReturnMode.NONE else 0
        return StaticRow(session.slot, start, row.activations[0], row.positions, logits=want)

    def _compute(self, ready: list[Ready[StaticSession]]) -> list[Computed]:
        """One inference for every ready row (a failure raises: it fails them all). Static exports
        have no features output: a row that asks for them gets none (its draft stays idle)."""
        if not ready:
            return []
        rows = [self._static_row(r.row, r.session, r.start) for r in ready]
        started = time.perf_counter_ns()
        outs = self.shard.step(rows)
        self.meters.step((time.perf_counter_ns() - started) / 1e9, sum(len(row.positions) for row in rows))
        return [Computed(out if self.is_last else out[None]) for out in outs]

    def _answer(self, row: StepRow, computed: Computed):
        """The base answer, with the row's slot written in for the next stage's plan frame."""
        slot = self.sessions.get(row.owner, row.session_id).slot
        return super()._answer(replace(row, slot_id=slot), computed)
