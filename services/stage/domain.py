"""Plain data the stage works on: what one step of one session brings and what it produces."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from pipeshard.sampling import Distribution


class ReturnMode(Enum):
    """What the final stage returns for a step."""

    TOP1 = "top1"
    LOGITS = "logits"
    NONE = "none"
    SAMPLED = "sampled"  # the final stage draws the tokens (pipeshard/sampling.py)


@dataclass
class StepInput:
    """One step of one session as it enters a stage."""

    session_id: str
    step_id: int
    positions: np.ndarray  # int64 [T], logical positions of the new tokens
    activations: np.ndarray  # input_ids int64 [1, T] (first stage) or hidden_states f32 [1, T, H]
    invalidate: list[tuple[int, int]] = field(default_factory=list)  # physical [start, end) ranges
    return_mode: ReturnMode = ReturnMode.TOP1
    return_last: int = 1
    compute_micros: list[int] = field(default_factory=list)  # per stage already passed
    sent_unix_nanos: int = 0
    owner: str = ""  # owner key of the session (pipeshard.ownership)
    sampling: SamplingStep | None = None  # with ReturnMode.SAMPLED
    tree_chains: int = 1  # >1: the tokens are that many chains of a draft tree (stateful stages)
    tree_keep: int = -1  # after a tree step: the chain whose cache the session keeps


@dataclass
class SamplingStep:
    """How the final stage draws a step: the distribution, the request's generator state and
    the step's point-mass drafts (return_last - 1 of them)."""

    distribution: Distribution
    rng_state: bytes
    draft_tokens: list[int] = field(default_factory=list)


@dataclass
class Sampled:
    token_ids: list[int]  # kept drafts, then the next token
    rng_state: bytes  # the generator state after the draw


@dataclass
class Top1:
    token_ids: np.ndarray  # int64 [n]
    probabilities: np.ndarray  # float32 [n]


@dataclass
class StepOutput:
    """What a stage produces: hidden states for the next hop, or the final result."""

    step: StepInput  # the input, with this stage's compute time appended
    hidden_states: np.ndarray | None = None
    top1: Top1 | None = None
    logits: np.ndarray | None = None  # float32 [n, vocab]
    sampled: Sampled | None = None


def top1_of(logits: np.ndarray) -> Top1:
    """Greedy pick and its softmax probability for each row of ``logits`` [n, vocab]."""
    ids = logits.argmax(axis=-1)
    best = np.take_along_axis(logits, ids[:, None], axis=-1)[:, 0]
    denom = np.exp(logits - best[:, None], dtype=np.float64).sum(axis=-1)
    return Top1(token_ids=ids.astype(np.int64), probabilities=(1.0 / denom).astype(np.float32))
