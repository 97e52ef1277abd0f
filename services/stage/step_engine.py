"""The one step interface of every KV backend: ``run(rows) -> results``.

Each row is checked on its own against its stage and its session (one set of checks for every
backend), so a bad row is answered with its error in place while the others run; what a row
carries on its own was checked once, where it was decoded (rows.py, with the checks below).
A backend supplies where a row's cache starts after its rewind, any room check of its own and
the compute over the checked rows (the stateful engine one row after another, the paged one in
one inference); the final stage's answer for each row (top-1, logits, drawn tokens or nothing) is formed here.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeAlias

import numpy as np

from pipeshard.errors import Internal, InvalidArgument, PipeshardError, Unimplemented
from pipeshard.sampling import sample_step
from pipeshard.services.stage.domain import (
    Computed,
    ReturnMode,
    RowKind,
    Sampled,
    Step,
    StepOutput,
    StepRow,
    TreeForm,
    top1_of,
)
from pipeshard.services.stage.meters import StageMeters
from pipeshard.services.stage.sessions import S, SessionTable
from pipeshard.shard.draft_heads import MAX_WIDTH, DraftHeads
from pipeshard.shard.runtime import check_activations, check_step
from pipeshard.v1 import stage_pb2

Answer: TypeAlias = StepOutput | Exception  # a row's error: a PipeshardError, or an internal failure


@dataclass
class Ready(Generic[S]):
    """A row that passed its checks: its session and the cache length it starts from."""

    index: int
    row: StepRow
    session: S
    start: int


class RowEngine(Generic[S]):
    """What both backends share: the row checks, the run loop and the final stage's answers."""

    kv_backend = ""  # the backend's name, for messages (services/stage/backends.py chooses it)
    tree_form = TreeForm.NONE
    sessions: SessionTable[S]
    meters: StageMeters
    is_first: bool
    is_last: bool
    hidden_size: int
    max_context: int
    vocab_size: int
    heads: DraftHeads | None = None  # the final stage's draft heads (--draft-heads), if it runs any

    def run(self, rows: Sequence[StepRow]) -> list[Answer]:
        """Every row that passes its checks runs; a failed check or a failed row answers with
        its error in place. An exception raised here failed the whole inference."""
        answers: list[Answer | None] = [None] * len(rows)
        ready: list[Ready[S]] = []
        seen: set[int] = set()
        for i, row in enumerate(rows):
            try:
                session = self.sessions.get(row.owner, row.session_id)
                if id(session) in seen:
                    raise InvalidArgument("session_id", f"{row.session_id!r} has two rows in one step")
                ready.append(Ready(i, row, session, self._check(row, session)))
                seen.add(id(session))
            except PipeshardError as exc:
                answers[i] = exc
        for r, out in zip(ready, self._compute(ready), strict=True):
            answers[r.index] = out if isinstance(out, Exception) else self._answer(r.row, out)
        if any(answer is None for answer in answers):
            raise Internal("a row of the step got no answer")
        return [answer for answer in answers if answer is not None]

    def run_step(self, step: Step) -> list[Answer]:
        """``run`` over a step's rows, adding this stage's compute time to the step."""
        started = time.perf_counter_ns()
        answers = self.run(step.rows)
        step.compute_micros.append((time.perf_counter_ns() - started) // 1000)
        return answers

    def _no_trees(self) -> str:
        """Why this stage takes no draft tree at all ("" when it takes one form)."""
        if self.tree_form is not TreeForm.NONE:
            return ""
        return (
            f"this {self.kv_backend} stage verifies no draft trees (a static shard, u8 KV pools, or a "
            "configuration that promises bit-identical rows): send chains"
        )

    def _check(self, row: StepRow, session: S) -> int:
        """The one set of row checks, before anything touches the cache; returns the length the
        row's cache starts from after its rewind."""
        if (row.tree_chains > 1 or row.tree_keep >= 0) and self.tree_form is not TreeForm.CHAINS:
            raise InvalidArgument(
                "tree_chains",
                self._no_trees()
                or f"draft trees as chains need stateful stages (--kv stateful); {self.kv_backend} "
                "stages take a tree as tree_parents",
            )
        if (row.tree_parents or row.tree_kept) and self.tree_form is not TreeForm.PARENTS:
            raise InvalidArgument(
                "tree_parents",
                self._no_trees()
                or f"draft trees as one masked sequence need paged stages (--kv paged); {self.kv_backend} "
                "stages take a tree as tree_chains",
            )
        check_activations(row.activations, is_first=self.is_first, hidden_size=self.hidden_size)
        # Out-of-range ids or positions would index the embedding or rotary tables out of bounds.
        check_range("positions", row.positions, self.max_context)
        if self.is_first:
            check_range("input_ids", row.activations, self.vocab_size)
        if self.is_last and row.return_mode is ReturnMode.SAMPLED:
            check_sampling(row, self.vocab_size)
        start = self._rewound(row, session)
        check_step(
            start,
            row.activations.shape[1] // row.tree_chains,
            len(row.positions) // row.tree_chains,
            row.return_last,
            max_context=self.max_context,
            is_last=self.is_last,
            positions_field="positions",
        )
        self._check_room(row, session, start)
        return start

    def open(self, owner: str, session_id: str, capacity: int | None = None) -> None:
        """Opens the session (a backend with a capacity reserves it here or refuses)."""
        raise NotImplementedError

    def keep_positions(self, owner: str, session_id: str, positions: int) -> None:
        """Cuts the session's cache to its first ``positions`` positions (RouteSession: a per-hop
        failover gave another stage's part of the session back fewer). Only a cache that rewinds
        by shortening can; the others refuse."""
        raise Unimplemented(
            f"keep_positions needs a paged stage (--kv paged); this stage runs {self.kv_backend}"
        )

    def describe(self, info: stage_pb2.GetStageInfoResponse, owner: str | None) -> None:
        """Fills the backend's live use into GetStageInfo (``owner``: the caller's, if it
        presented one); nothing beyond the session count by default."""

    def _rewound(self, row: StepRow, session: S) -> int:
        """The cache length the row starts from once its ``invalidate`` ranges apply (raises on a
        range the backend cannot drop)."""
        raise NotImplementedError

    def _check_room(self, row: StepRow, session: S, start: int) -> None:
        """A backend's own room check beyond max_context (none by default)."""

    def _compute(self, ready: list[Ready[S]]) -> Sequence[Computed | Exception]:
        """Per ready row: hidden states [1, T, H] (non-final stage), logits [return_last, vocab]
        and the features the row asked for (final stage), or the row's own error."""
        raise NotImplementedError

    def _answer(self, row: StepRow, computed: Computed) -> StepOutput:
        out = computed.out
        if not self.is_last:
            return StepOutput(row=row, hidden_states=out)
        features = computed.features if row.return_features else None
        if row.return_mode is ReturnMode.TOP1:
            if row.allowed_tokens:
                out = allowed_only(out, row.allowed_tokens)
            top1 = top1_of(out, probabilities=not row.top1_ids_only)
            candidates = self._head_candidates(row, top1.token_ids, computed.features)
            return StepOutput(row=row, top1=top1, features=features, head_candidates=candidates)
        if row.return_mode is ReturnMode.LOGITS:
            return StepOutput(row=row, logits=np.ascontiguousarray(out, dtype=np.float32), features=features)
        if row.return_mode is ReturnMode.SAMPLED:  # each row draws with its own generator
            return StepOutput(
                row=row, sampled=sample(np.asarray(out, dtype=np.float32), row), features=features
            )
        return StepOutput(row=row)

    def _head_candidates(self, row: StepRow, top1: np.ndarray, features: np.ndarray | None):
        """The draft heads' candidates at the last position of the greedy path through the row
        (None without heads, without features (static stages) or for a tree as chains)."""
        if not row.draft_heads or self.heads is None or features is None or row.tree_chains > 1:
            return None
        started = time.perf_counter_ns()
        end = greedy_path_end(row, top1)
        out = self.heads.candidates(features[end], row.draft_heads, end)
        self.meters.heads((time.perf_counter_ns() - started) / 1e9)
        return out


def allowed_only(logits: np.ndarray, mask: bytes) -> np.ndarray:
    """``logits`` [n, vocab] with every token the grammar's bitmask does not allow at -inf."""
    bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")
    allowed = np.zeros(logits.shape[-1], dtype=bool)
    n = min(allowed.size, bits.size)
    allowed[:n] = bits[:n]
    if not allowed.any():
        raise InvalidArgument("allowed_tokens", "allows no token of the vocabulary")
    return np.where(allowed, logits, np.float32(-np.inf))


def greedy_path_end(row: StepRow, top1: np.ndarray) -> int:
    """The returned position where greedy acceptance of the row's drafts stops: from the first
    returned position, step to a child whose token is the top-1 there (a chain's next position;
    a tree row's first such child down ``tree_parents``) until none is; what the coordinator's
    acceptance keeps, so its heads read the feature before the target's own next token."""
    tokens = row.head_path_tokens
    offset = row.tokens - len(tokens)
    if row.tree_parents:
        parents = [p - offset for p in row.tree_parents[offset:]]
    else:
        parents = list(range(-1, len(tokens) - 1))
    node = 0
    while True:
        want = int(top1[node])
        child = next(
            (i for i in range(node + 1, len(tokens)) if parents[i] == node and tokens[i] == want), None
        )
        if child is None:
            return node
        node = child


def check_heads(row: StepRow) -> None:
    """A row asking for draft heads is greedy, names its returned tokens and asks a sane width."""
    if not 0 < row.draft_heads <= MAX_WIDTH:
        raise InvalidArgument(
            "draft_heads", f"must be 0 or in 1..{MAX_WIDTH} candidates, got {row.draft_heads}"
        )
    if row.return_mode is not ReturnMode.TOP1:
        raise InvalidArgument("draft_heads", "heads follow the greedy path: the row must return Top1")
    if len(row.head_path_tokens) != row.return_last:
        raise InvalidArgument(
            "head_path_tokens",
            f"must hold the row's {row.return_last} returned token ids, got {len(row.head_path_tokens)}",
        )


def tail_rewound(row: StepRow, length: int, cache: str) -> int:
    """The cache length after the row's rewinds, for caches that rewind only their tail (paged
    blocks, static slots): each range must end where the cache does."""
    for start, end in sorted(row.invalidate, reverse=True):
        if not 0 <= start <= end == length:
            raise InvalidArgument(
                "mask_update",
                f"range [{start}, {end}) is not the tail of the cache of {length} "
                f"({cache} rewinds only its tail)",
            )
        length = start
    return length


def check_kind(row: StepRow) -> None:
    """A row's kind agrees with what it asks back: a decode row returns one position, a verify
    row one per drafted token and the last token, a prefill chunk nothing or its last."""
    answers = row.return_mode is not ReturnMode.NONE
    if row.kind is RowKind.PREFILL:
        ok = not answers or row.return_last == 1
    elif row.kind is RowKind.DECODE:
        ok = answers and row.return_last == 1
    else:
        ok = answers and row.return_last >= 2
    if not ok:
        raise InvalidArgument(
            "kind",
            f"a {row.kind.value} row cannot return {row.return_last} position(s) "
            f"with return mode {row.return_mode.value}",
        )


def check_tree(row: StepRow) -> None:
    """A tree row's chains split its tokens and positions evenly, or its parents precede their
    children one position before them; either returns Top1 or logits."""
    if row.tree_parents or row.tree_kept:
        check_tree_parents(row)
        return
    chains = row.tree_chains
    if chains == 1:
        return
    tokens = row.activations.shape[1]
    if chains < 1 or tokens % chains or len(row.positions) != tokens:
        raise InvalidArgument(
            "tree_chains", f"must divide the row's {tokens} tokens and positions evenly, got {chains}"
        )
    if row.return_mode is ReturnMode.SAMPLED:
        raise InvalidArgument("tree_chains", "tree rows return Top1 or logits, not RETURN_MODE_SAMPLED")


def check_tree_parents(row: StepRow) -> None:
    parents, tokens = row.tree_parents, row.tokens
    if parents:
        if len(parents) != tokens:
            raise InvalidArgument(
                "tree_parents", f"must hold one entry per token ({tokens}), got {len(parents)}"
            )
        for i, parent in enumerate(parents):
            # The range first: a parent beyond the row would index its positions out of bounds.
            ok = -1 <= parent < i
            if not ok or row.positions[i] != (row.positions[0] if parent < 0 else row.positions[parent] + 1):
                raise InvalidArgument(
                    "tree_parents",
                    f"entry {i} must name an earlier token (or -1) one position before it, got {parent}",
                )
        if row.return_mode is ReturnMode.SAMPLED:
            raise InvalidArgument("tree_parents", "tree rows return Top1 or logits, not RETURN_MODE_SAMPLED")
    kept = row.tree_kept
    if kept and (min(kept) < 0 or any(b <= a for a, b in itertools.pairwise(kept))):
        raise InvalidArgument("tree_kept", f"must be ascending token indices, got {list(kept)}")


def sample(logits: np.ndarray, row: StepRow) -> Sampled:
    """The draw the coordinator would make from these logits (same rows, same generator)."""
    spec = row.sampling
    if spec is None:  # check_sampling refused such a row before it ran
        raise InvalidArgument("sampling", "is required with RETURN_MODE_SAMPLED")
    tokens, state = sample_step(logits, spec.distribution, spec.draft_tokens, spec.rng_state)
    return Sampled(tokens, state)


def check_sampling(row: StepRow, vocab_size: int) -> None:
    """Checked before the row runs, so a bad request leaves the cache as it was."""
    spec = row.sampling
    if spec is None:
        raise InvalidArgument("sampling", "is required with RETURN_MODE_SAMPLED")
    if len(spec.draft_tokens) != row.return_last - 1:
        raise InvalidArgument(
            "sampling.draft_tokens",
            f"must hold return_last - 1 = {row.return_last - 1} tokens, got {len(spec.draft_tokens)}",
        )
    check_range("sampling.draft_tokens", np.asarray(spec.draft_tokens, dtype=np.int64), vocab_size)


def check_range(field: str, values: np.ndarray, limit: int) -> None:
    if values.size and (values.min() < 0 or values.max() >= limit):
        bad = values[(values < 0) | (values >= limit)].flat[0]
        raise InvalidArgument(field, f"must lie in [0, {limit}), got {int(bad)}")
