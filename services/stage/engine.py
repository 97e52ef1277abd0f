"""Runs one step of one session on this stage's shard (blocking; called from one worker thread)."""

from __future__ import annotations

import time

import numpy as np

from pipeshard.errors import InvalidArgument
from pipeshard.services.stage.domain import ReturnMode, StepInput, StepOutput, top1_of
from pipeshard.services.stage.sessions import SessionTable


class StageEngine:
    """The stage's compute: validates a step against the shard's ports and runs it."""

    def __init__(
        self, sessions: SessionTable, *, is_first: bool, is_last: bool, hidden_size: int, max_context: int
    ):
        self.sessions = sessions
        self.is_first = is_first
        self.is_last = is_last
        self.hidden_size = hidden_size
        self.max_context = max_context

    def run(self, step: StepInput) -> StepOutput:
        session = self.sessions.get(step.session_id)
        x = self._check_activations(step)
        if len(step.positions) != x.shape[1]:
            raise InvalidArgument(
                "positions", f"has {len(step.positions)} entries for {x.shape[1]} new tokens"
            )
        if session.past_length + x.shape[1] > self.max_context:
            raise InvalidArgument(
                "positions",
                f"step would grow the cache to {session.past_length + x.shape[1]} positions, "
                f"beyond the shard's max_context {self.max_context}",
            )
        for start, end in step.invalidate:
            if not 0 <= start <= end <= session.past_length:
                raise InvalidArgument(
                    "mask_update", f"range [{start}, {end}) is outside the cache of {session.past_length}"
                )
        if self.is_last and not 1 <= step.return_last <= x.shape[1]:
            raise InvalidArgument("return_last", f"must be in [1, {x.shape[1]}], got {step.return_last}")
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

    def _check_activations(self, step: StepInput) -> np.ndarray:
        x = step.activations
        if self.is_first:
            if x.dtype != np.int64 or x.ndim != 2 or x.shape[0] != 1 or x.shape[1] == 0:
                raise InvalidArgument("input_ids", f"must be int64 [1, T>0], got {x.dtype} {list(x.shape)}")
        elif (
            x.dtype != np.float32
            or x.ndim != 3
            or x.shape[0] != 1
            or x.shape[1] == 0
            or x.shape[2] != self.hidden_size
        ):
            raise InvalidArgument(
                "hidden_states",
                f"must be float32 [1, T>0, {self.hidden_size}], got {x.dtype} {list(x.shape)}",
            )
        # Wire buffers are read-only; OpenVINO shares memory only with writeable arrays.
        return np.require(x, requirements=["C", "W"])
