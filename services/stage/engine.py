"""The stateful backend's engine: each session holds its own cache (pipeshard/shard/runtime.py).

A batch of one behind the step interface (step_engine.py): the rows of a step run one after
another, each on its own session, so a row's failure stays that row's. Rewind: the cache keeps
rejected drafts and masks them out (any range of the cache may be invalidated). Draft trees:
a row's tokens may be several root-to-leaf chains, each continuing the cache on its own as a
batch row gathered by beam_idx (``ShardSession.run_chains``); the next row keeps one chain.
"""

from __future__ import annotations

import time

import numpy as np

from pipeshard.errors import InvalidArgument
from pipeshard.services.stage.domain import Computed, ReturnMode, StepRow, TreeForm
from pipeshard.services.stage.meters import StageMeters
from pipeshard.services.stage.sessions import SessionTable
from pipeshard.services.stage.step_engine import Ready, RowEngine
from pipeshard.shard.runtime import ShardSession

__all__ = ["StageEngine"]


class StageEngine(RowEngine[ShardSession]):
    """The stage's compute over per-session caches (one InferRequest per session)."""

    kv_backend = "stateful"
    tree_form = TreeForm.CHAINS

    def __init__(
        self,
        sessions: SessionTable[ShardSession],
        *,
        is_first: bool,
        is_last: bool,
        hidden_size: int,
        max_context: int,
        vocab_size: int,
        meters: StageMeters | None = None,
    ):
        self.sessions = sessions
        self.meters = meters or StageMeters(0)  # unit tests build engines without a stage index
        self.is_first = is_first
        self.is_last = is_last
        self.hidden_size = hidden_size
        self.max_context = max_context
        self.vocab_size = vocab_size

    def open(self, owner: str, session_id: str, capacity: int | None = None) -> None:
        """Opens a session (each holds its own cache: ``capacity`` needs no reservation)."""
        self.sessions.open(owner, session_id)

    def reset(self, owner: str, session_id: str) -> None:
        self.sessions.get(owner, session_id).reset()

    def _rewound(self, row: StepRow, session: ShardSession) -> int:
        """Masked ranges stay in the cache: the row starts from the full length."""
        for start, end in row.invalidate:
            if not 0 <= start <= end <= session.past_length:
                raise InvalidArgument(
                    "mask_update", f"range [{start}, {end}) is outside the cache of {session.past_length}"
                )
        return session.past_length

    def _compute(self, ready: list[Ready[ShardSession]]) -> list[Computed | Exception]:
        return [self._one(r) for r in ready]

    def _one(self, ready: Ready[ShardSession]) -> Computed | Exception:
        row, session = ready.row, ready.session
        if row.tree_keep >= 0:
            session.keep_chain(row.tree_keep)
        for start, end in row.invalidate:
            session.invalidate(start, end)
        # Wire buffers are read-only; OpenVINO shares memory only with writeable arrays.
        x = np.require(row.activations, requirements=["C", "W"])
        started = time.perf_counter_ns()
        keep = row.return_last if self.is_last else 1
        try:
            if row.tree_chains > 1:
                out = session.run_chains(x, row.positions, row.tree_chains, return_last=keep)
            else:
                out = session.run(x, row.positions.reshape(1, -1), return_last=keep)
        except Exception as exc:  # this row's failure; the step's other rows still run
            return exc
        self.meters.step((time.perf_counter_ns() - started) / 1e9, x.shape[1])  # every token computed
        if not self.is_last:
            return Computed(out)
        if row.return_mode is ReturnMode.NONE:
            return Computed(out[:0])
        return Computed(
            out.reshape(-1, out.shape[-1]),
            session.features() if row.return_features or row.draft_heads else None,
        )
