"""Runs one step of one session on this stage's shard (blocking; the node calls it inline on its loop)."""

from __future__ import annotations

import time

import numpy as np

from pipeshard.errors import InvalidArgument
from pipeshard.services.stage.domain import ReturnMode, StepInput, StepOutput, top1_of
from pipeshard.services.stage.sessions import SessionTable
from pipeshard.shard.runtime import check_activations, check_step


class StageEngine:
    """The stage's compute: validates a step against the shard's ports and runs it."""

    def __init__(
        self,
        sessions: SessionTable,
        *,
        is_first: bool,
        is_last: bool,
        hidden_size: int,
        max_context: int,
        vocab_size: int,
    ):
        self.sessions = sessions
        self.is_first = is_first
        self.is_last = is_last
        self.hidden_size = hidden_size
        self.max_context = max_context
        self.vocab_size = vocab_size

    kv_backend = "stateful"

    def open(self, owner: str, session_id: str, capacity: int | None = None) -> None:
        """Opens a session (each holds its own cache: ``capacity`` needs no reservation)."""
        self.sessions.open(owner, session_id)

    def reset(self, owner: str, session_id: str) -> None:
        self.sessions.get(owner, session_id).reset()

    def run(self, step: StepInput) -> StepOutput:
        session = self.sessions.get(step.owner, step.session_id)
        check_activations(step.activations, is_first=self.is_first, hidden_size=self.hidden_size)
        # Wire buffers are read-only; OpenVINO shares memory only with writeable arrays.
        x = np.require(step.activations, requirements=["C", "W"])
        # Out-of-range ids or positions would index the embedding or rotary tables out of bounds.
        _check_range("positions", step.positions, self.max_context)
        if self.is_first:
            _check_range("input_ids", x, self.vocab_size)
        check_step(
            session.past_length,
            x.shape[1],
            len(step.positions),
            step.return_last,
            max_context=self.max_context,
            is_last=self.is_last,
            positions_field="positions",
        )
        for start, end in step.invalidate:
            if not 0 <= start <= end <= session.past_length:
                raise InvalidArgument(
                    "mask_update", f"range [{start}, {end}) is outside the cache of {session.past_length}"
                )
        for start, end in step.invalidate:
            session.invalidate(start, end)
        started = time.perf_counter_ns()
        out = session.run(
            x, step.positions.reshape(1, -1), return_last=step.return_last if self.is_last else 1
        )
        step.compute_micros.append((time.perf_counter_ns() - started) // 1000)
        if not self.is_last:
            return StepOutput(step=step, hidden_states=out)
        logits = out.reshape(-1, out.shape[-1])
        if step.return_mode is ReturnMode.TOP1:
            return StepOutput(step=step, top1=top1_of(logits))
        if step.return_mode is ReturnMode.LOGITS:
            return StepOutput(step=step, logits=np.ascontiguousarray(logits, dtype=np.float32))
        return StepOutput(step=step)


def _check_range(field: str, values: np.ndarray, limit: int) -> None:
    if values.size and (values.min() < 0 or values.max() >= limit):
        bad = values[(values < 0) | (values >= limit)].flat[0]
        raise InvalidArgument(field, f"must lie in [0, {limit}), got {int(bad)}")
