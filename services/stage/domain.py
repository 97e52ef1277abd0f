"""Plain data the stage works on: the rows of a step and what each produces."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum

import numpy as np

from pipeshard.errors import Internal
from pipeshard.sampling import Distribution
from pipeshard.shard.draft_heads import HeadCandidates


class ReturnMode(Enum):
    """What the final stage returns for a row."""

    TOP1 = "top1"
    LOGITS = "logits"
    NONE = "none"
    SAMPLED = "sampled"  # the final stage draws the tokens (pipeshard/sampling.py)


class TreeForm(Enum):
    """How a backend takes a draft tree in one row (what GetStageInfo reports as draft_tree_form)."""

    NONE = "none"  # no draft trees (static stages)
    CHAINS = "chains"  # root-to-leaf chains as batch rows (ShardSession.run_chains)
    PARENTS = "parents"  # every node once, a tree mask over one sequence (tree_parents)


class RowKind(Enum):
    """What a row is: the stages check it, the coordinator forms steps by it."""

    PREFILL = "prefill"  # a chunk of a prompt; only the last chunk returns (its last position)
    DECODE = "decode"  # the last token: one position returned
    VERIFY = "verify"  # the last token and drafts after it: a position returned for each


@dataclass
class SamplingStep:
    """How the final stage draws a row: the distribution, the request's generator state and
    the row's point-mass drafts (return_last - 1 of them)."""

    distribution: Distribution
    rng_state: bytes
    draft_tokens: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class StepRow:
    """One session's part of a step as it enters a stage (a step of one session is one row).

    A draft tree comes in one of two forms, by backend: ``tree_chains`` root-to-leaf chains as
    batch rows (stateful stages), or every node once with ``tree_parents``, each token attending
    the cache and its ancestors only (paged stages); the next row then names what the session
    keeps (``tree_keep``, ``tree_kept``).
    """

    session_id: str
    step_id: int
    kind: RowKind
    positions: np.ndarray  # int64 [T], logical positions of the new tokens
    activations: np.ndarray  # input_ids int64 [1, T] (first stage) or hidden_states f32 [1, T, H]
    owner: str = ""  # owner key of the session (pipeshard.ownership)
    invalidate: tuple[tuple[int, int], ...] = ()  # physical [start, end) ranges: the rewind
    return_mode: ReturnMode = ReturnMode.TOP1
    return_last: int = 1
    sampling: SamplingStep | None = None  # with ReturnMode.SAMPLED
    tree_chains: int = 1  # >1: the tokens are that many chains of a draft tree (stateful stages)
    tree_keep: int = -1  # after a tree step: the chain whose cache the session keeps
    tree_parents: tuple[int, ...] = ()  # per token, its parent's index in the row (-1: the cache)
    tree_kept: tuple[int, ...] = ()  # after a tree_parents row: its token indices the session keeps
    top1_ids_only: bool = False  # ReturnMode.TOP1 without probabilities (no softmax)
    slot_id: int = -1  # static stages: the slot the session holds (-1: the stage finds it)
    prefix_reuse_length: int = 0  # static stages: continue after this many cached positions (0: all)
    return_features: bool = False  # the final stage also returns its final normed hidden state
    draft_heads: int = 0  # >0: the final stage's heads return that many candidates each (greedy rows)
    head_path_tokens: tuple[int, ...] = ()  # with draft_heads: the ids at the returned positions
    allowed_tokens: bytes = b""  # a grammar's bitmask over the vocabulary for the Top1 (b"": all)

    @property
    def tokens(self) -> int:
        return len(self.positions)

    def carrying(self, activations: np.ndarray) -> StepRow:
        """The same row with the next stage's input (in-process rings pass rows on)."""
        return replace(self, activations=activations)


@dataclass
class Step:
    """One step as it travels the ring: its rows and the bookkeeping they share."""

    rows: list[StepRow]
    owner: str = ""
    compute_micros: list[int] = field(default_factory=list)  # per stage already passed
    sent_unix_nanos: int = 0


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
    """What a stage produces for a row: hidden states for the next hop, or the final result."""

    row: StepRow
    hidden_states: np.ndarray | None = None  # f32 [1, T, H]
    top1: Top1 | None = None
    logits: np.ndarray | None = None  # float32 [n, vocab]
    sampled: Sampled | None = None
    features: np.ndarray | None = None  # float32 [n, hidden]: the final normed hidden state
    head_candidates: HeadCandidates | None = None  # the draft heads' proposals for the next step

    @property
    def hidden(self) -> np.ndarray:
        """The hidden states for the next hop, which a stage before the last always produces."""
        if self.hidden_states is None:
            raise Internal("a stage before the last produced no hidden states")
        return self.hidden_states

    @property
    def top1_answer(self) -> Top1:
        """The final stage's Top1 answer, for a row that asked for one."""
        if self.top1 is None:
            raise Internal("the final stage produced no Top1 answer for this row")
        return self.top1


@dataclass
class Computed:
    """A backend's output for one row: hidden states [1, T, H] for the next hop, or on the final
    stage logits [n, vocab] and, when the row asked, its final normed hidden state [n, H]."""

    out: np.ndarray
    features: np.ndarray | None = None


def top1_of(logits: np.ndarray, probabilities: bool = True) -> Top1:
    """Greedy pick and its softmax probability for each row of ``logits`` [n, vocab];
    ``probabilities`` False leaves them out (the softmax is most of the cost: 0.6 ms a row)."""
    ids = logits.argmax(axis=-1)
    if not probabilities:
        return Top1(token_ids=ids.astype(np.int64), probabilities=np.empty(0, dtype=np.float32))
    best = np.take_along_axis(logits, ids[:, None], axis=-1)[:, 0]
    denom = np.exp(logits - best[:, None], dtype=np.float64).sum(axis=-1)
    return Top1(token_ids=ids.astype(np.int64), probabilities=(1.0 / denom).astype(np.float32))
