"""Runs one step of one session on this stage's shard (blocking; the node calls it inline on its loop)."""

from __future__ import annotations

import time

import numpy as np

from pipeshard.errors import InvalidArgument
from pipeshard.sampling import sample_step
from pipeshard.services.stage.domain import ReturnMode, Sampled, StepInput, StepOutput, top1_of
from pipeshard.services.stage.meters import StageMeters
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
        meters: StageMeters | None = None,
    ):
        self.sessions = sessions
        self.meters = meters or StageMeters(0)  # unit tests build engines without a stage index
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
        check_range("positions", step.positions, self.max_context)
        if self.is_first:
            check_range("input_ids", x, self.vocab_size)
        chains = step.tree_chains  # a draft tree's chains, each continuing the cache (runtime.py)
        check_tree(step, x.shape[1])
        check_step(
            session.past_length,
            x.shape[1] // chains,
            len(step.positions) // chains,
            step.return_last,
            max_context=self.max_context,
            is_last=self.is_last,
            positions_field="positions",
        )
        if self.is_last and step.return_mode is ReturnMode.SAMPLED:
            check_sampling(step, self.vocab_size)
        for start, end in step.invalidate:
            if not 0 <= start <= end <= session.past_length:
                raise InvalidArgument(
                    "mask_update", f"range [{start}, {end}) is outside the cache of {session.past_length}"
                )
        if step.tree_keep >= 0:
            session.keep_chain(step.tree_keep)
        for start, end in step.invalidate:
            session.invalidate(start, end)
        started = time.perf_counter_ns()
        keep = step.return_last if self.is_last else 1
        if chains > 1:
            out = session.run_chains(x, step.positions, chains, return_last=keep)
        else:
            out = session.run(x, step.positions.reshape(1, -1), return_last=keep)
        elapsed_ns = time.perf_counter_ns() - started
        step.compute_micros.append(elapsed_ns // 1000)
        self.meters.step(elapsed_ns / 1e9, x.shape[1])  # rows: every token the step computed
        if not self.is_last:
            return StepOutput(step=step, hidden_states=out)
        logits = out.reshape(-1, out.shape[-1])
        if step.return_mode is ReturnMode.TOP1:
            return StepOutput(step=step, top1=top1_of(logits))
        if step.return_mode is ReturnMode.LOGITS:
            return StepOutput(step=step, logits=np.ascontiguousarray(logits, dtype=np.float32))
        if step.return_mode is ReturnMode.SAMPLED:
            return StepOutput(step=step, sampled=sample(np.asarray(logits, dtype=np.float32), step))
        return StepOutput(step=step)


def sample(logits: np.ndarray, step: StepInput) -> Sampled:
    """The draw the coordinator would make from these logits (same rows, same generator)."""
    spec = step.sampling
    tokens, state = sample_step(logits, spec.distribution, spec.draft_tokens, spec.rng_state)
    return Sampled(tokens, state)


def check_tree(step: StepInput, tokens: int) -> None:
    """A tree step's chains split its tokens and positions evenly and return Top1 or logits."""
    chains = step.tree_chains
    if chains == 1:
        return
    if tokens % chains or len(step.positions) != tokens:
        raise InvalidArgument(
            "tree_chains", f"must divide the step's {tokens} tokens and positions evenly, got {chains}"
        )
    if step.return_mode is ReturnMode.SAMPLED:
        raise InvalidArgument("tree_chains", "tree steps return Top1 or logits, not RETURN_MODE_SAMPLED")


def check_sampling(step: StepInput, vocab_size: int) -> None:
    """Checked before the step runs, so a bad request leaves the cache as it was."""
    spec = step.sampling
    if spec is None:
        raise InvalidArgument("sampling", "is required with RETURN_MODE_SAMPLED")
    if len(spec.draft_tokens) != step.return_last - 1:
        raise InvalidArgument(
            "sampling.draft_tokens",
            f"must hold return_last - 1 = {step.return_last - 1} tokens, got {len(spec.draft_tokens)}",
        )
    check_range("sampling.draft_tokens", np.asarray(spec.draft_tokens, dtype=np.int64), vocab_size)


def check_range(field: str, values: np.ndarray, limit: int) -> None:
    if values.size and (values.min() < 0 or values.max() >= limit):
        bad = values[(values < 0) | (values >= limit)].flat[0]
        raise InvalidArgument(field, f"must lie in [0, {limit}), got {int(bad)}")
