"""Draft sources: they propose the next K tokens, or a tree of candidates (``propose_tree``,
speculation/tree.py); the target verifies them in one traversal.

``NgramDrafter`` (prompt lookup) copies what followed the latest earlier occurrence of the
context's last few tokens: free to run, strong on code, lists and quoting. ``ModelDrafter`` runs
a small stateful shard on the coordinator (the self-draft the exporter builds from the target's
first layers, or any same-tokenizer model folder). Its cache is realigned the way the stages'
caches are: rejected drafts are masked out, never trimmed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pipeshard.services.coordinator.speculation.tree import DraftTree, TreeShape
from pipeshard.shard.draft_heads import HeadCandidates
from pipeshard.shard.runtime import ShardRunner, ShardSession

Probabilities = Callable[[np.ndarray], np.ndarray]


@dataclass
class Draft:
    tokens: list[int]
    # For sampling: the distribution each token was drawn from (None: deterministic proposals).
    probs: list[np.ndarray] | None
    seconds: float
    # What the proposal rests on (``Drafter.part``): adaptive K keeps an acceptance per part.
    part: str = ""


class Drafter(Protocol):
    # How many candidate paths ``tree=auto`` asks of this source (1: chains only).
    auto_tree_width: int
    # Whether it reads the target's final hidden state (speculation/feature.py): steps then ask
    # the final stage for it and hand the drafter the kept position's through ``observe``.
    reads_features: bool
    # Candidates per head it asks of the final stage's draft heads (speculation/medusa.py; 0:
    # none): greedy steps then ask for them and hand the drafter each result's through
    # ``observe_heads``.
    head_candidates: int
    # Whether it can continue from its own unconfirmed proposal (``propose``'s ``guessed``), so a
    # request's next step can go while this one travels (speculation/depth.py): prompt lookup
    # reads the context alone; a feature draft chains over the guesses on its own predicted
    # features. A draft model's cache holds what it fed, committed step by step: it cannot.
    pipelines: bool

    def propose(
        self,
        context: Sequence[int],
        k: int,
        sample: tuple[Probabilities, np.random.Generator] | None,
        guessed: int = 0,
    ) -> Draft:
        """Up to ``k`` tokens to follow ``context``; ``sample`` draws instead of taking argmax.
        ``guessed``: how many of the context's last tokens are guesses in flight, which the target
        has not answered yet (only for sources that ``pipelines``)."""

    def propose_tree(self, context: Sequence[int], shape: TreeShape) -> DraftTree:
        """Deterministic candidates after ``context``: up to ``shape.width`` paths of up to
        ``shape.depth`` tokens."""

    def part(self, context: Sequence[int]) -> str:
        """What a proposal after ``context`` would rest on, before it is drafted (K is chosen for
        it): one name for a source with one kind of evidence (""), prompt lookup's the length of
        the context match it found (``lookup3``...), whose drafts are kept at very different rates."""

    def commit(self, kept: int) -> None:
        """The target kept the first ``kept`` tokens of the last proposal (of a tree: of its
        ``main`` chain)."""

    def observe(self, feature: np.ndarray | None) -> None:
        """The target's features [n, H] at the positions a step kept, in order, the last being the
        row before the target's own token (steps send them only when ``reads_features``; None:
        the step returned none)."""

    def observe_heads(self, candidates: HeadCandidates | None) -> None:
        """The final stage's head candidates after a step (only when ``head_candidates``; None:
        none usable this step)."""

    def close(self) -> None:
        """Give back what the drafter holds."""


class NgramDrafter:
    """Prompt-lookup drafting: no model, no state."""

    auto_tree_width = 3  # alternative continuations cost nothing to find
    reads_features = False
    head_candidates = 0
    pipelines = True

    def __init__(self, max_ngram: int = 3):
        self.max_ngram = max_ngram

    def propose(self, context, k, sample, guessed: int = 0) -> Draft:
        started = time.perf_counter()  # (guesses read as any context: lookup has no state)
        ctx = np.asarray(context, dtype=np.int64)
        n, start = self._match(ctx)
        tokens = ctx[start : start + k].tolist() if n else []
        return Draft(tokens, None, time.perf_counter() - started, lookup_part(n))

    def part(self, context) -> str:
        return lookup_part(self.match_length(context))

    def match_length(self, context) -> int:
        """How many of the context's last tokens occurred before (0: none, nothing to draft)."""
        return self._match(np.asarray(context, dtype=np.int64))[0]

    def _match(self, ctx: np.ndarray) -> tuple[int, int]:
        """The longest n-gram (up to ``max_ngram``) ending the context that occurred before, and
        where its latest occurrence's successor starts ((0, 0): none)."""
        for n in range(min(self.max_ngram, len(ctx) - 1), 0, -1):
            windows = sliding_window_view(ctx[:-1], n)  # every n-gram that has a successor
            hits = np.flatnonzero((windows == ctx[-n:]).all(axis=1))
            if hits.size:
                return n, int(hits[-1]) + n
        return 0, 0

    def propose_tree(self, context, shape: TreeShape) -> DraftTree:
        """Alternative continuations: what followed every earlier occurrence of the context's
        last n tokens (longest n first, latest first), as up to ``shape.width`` distinct paths.
        A node's probability is the share of the occurrences through its parent that continued
        with it (the longest matching n-gram's occurrences: the candidate score pruning reads)."""
        started = time.perf_counter()
        ctx = np.asarray(context, dtype=np.int64)
        paths: list[tuple[int, ...]] = []
        seen: list[tuple[int, ...]] = []  # the continuations of the longest n-gram that occurs
        for n in range(min(self.max_ngram, len(ctx) - 1), 0, -1):
            windows = sliding_window_view(ctx[:-1], n)
            longest = not seen
            for hit in np.flatnonzero((windows == ctx[-n:]).all(axis=1))[::-1][:_MAX_HITS]:
                start = int(hit) + n
                continuation = tuple(ctx[start : start + shape.depth].tolist())
                _add_distinct(paths, continuation, shape.width)
                if longest:
                    seen.append(continuation)
        tree = DraftTree()
        for path in paths:
            tree.add_path(path, _shares(path, seen))
        tree.seconds = time.perf_counter() - started
        return tree

    def commit(self, kept: int) -> None:
        pass

    def observe(self, feature: np.ndarray | None) -> None:
        pass  # reads no features (``reads_features`` is False)

    def observe_heads(self, candidates: HeadCandidates | None) -> None:
        pass  # asks for no head candidates

    def close(self) -> None:
        pass


# Earlier occurrences of a suffix a tree looks at per n-gram length (the latest ones).
_MAX_HITS = 64


def lookup_part(n: int) -> str:
    """Prompt lookup's part for a context match of ``n`` tokens ("lookup": none, nothing drafted)."""
    return f"lookup{n}" if n else "lookup"


def _add_distinct(paths: list[tuple[int, ...]], path: tuple[int, ...], width: int) -> None:
    """Adds ``path`` unless a kept path starts with it; one it extends is replaced by it; a
    new branch only while fewer than ``width`` paths are kept (so no path prefixes another)."""
    if not path or any(p[: len(path)] == path for p in paths):
        return
    for i, p in enumerate(paths):
        if path[: len(p)] == p:
            paths[i] = path
            return
    if len(paths) < width:
        paths.append(path)


def _shares(path: tuple[int, ...], seen: list[tuple[int, ...]]) -> list[float]:
    """Per token of ``path``: the share of the continuations in ``seen`` through its parent that
    go on with it (1.0 where none of them reaches that far)."""
    out = []
    for depth in range(1, len(path) + 1):
        through = [c for c in seen if c[: depth - 1] == path[: depth - 1] and len(c) >= depth]
        on = sum(c[:depth] == path[:depth] for c in through)
        out.append(on / len(through) if through else 1.0)
    return out


class ModelDrafter:
    """A draft model's session. Tracks how much of the committed context its cache holds."""

    auto_tree_width = 1
    reads_features = False
    head_candidates = 0
    pipelines = False  # its cache holds what it fed, committed step by step

    def __init__(
        self,
        session: ShardSession,
        vocab_ids: np.ndarray | None,
        vocab_size: int,
        release: Callable[[ShardSession], None],
    ):
        self._session = session
        self._vocab_ids = vocab_ids  # sliced head: row index -> token id
        self._vocab_size = vocab_size
        self._release = release
        self._cached = 0  # committed context tokens held (valid) in the draft cache
        self._proposed = 0  # tokens of the last proposal
        self._spec_start = 0  # physical index of the first draft token fed back

    def propose(self, context, k, sample, guessed: int = 0) -> Draft:
        started = time.perf_counter()  # (``guessed`` is always 0: it does not pipeline)
        session = self._session
        room = session.runner.max_context - session.past_length - (len(context) - self._cached)
        k = min(k, max(0, room))
        if k == 0:
            self._proposed = 0
            return Draft(tokens=[], probs=None, seconds=time.perf_counter() - started)
        row = session.run(np.asarray([context[self._cached :]], dtype=np.int64), copy=False)[0, -1]
        self._cached = len(context)
        self._spec_start = session.past_length
        tokens: list[int] = []
        probs: list[np.ndarray] | None = [] if sample else None
        step = np.zeros((1, 1), dtype=np.int64)
        for i in range(k):
            token = self._pick(row, sample, probs)
            tokens.append(token)
            if i < k - 1:
                step[0, 0] = token
                row = session.run(step, copy=False)[0, -1]
        self._proposed = k
        return Draft(tokens=tokens, probs=probs, seconds=time.perf_counter() - started)

    def propose_tree(self, context, shape: TreeShape) -> DraftTree:
        """The draft's greedy chain of ``shape.depth`` tokens (fed through its cache, the tree's
        ``main``), plus the ``shape.width - 1`` likeliest alternatives at any of its levels, each a
        leaf: an alternative's score is its draft probability times its parent path's."""
        started = time.perf_counter()
        session = self._session
        room = session.runner.max_context - session.past_length - (len(context) - self._cached)
        depth = min(shape.depth, max(0, room))
        tree = DraftTree()
        if depth == 0:
            self._proposed = 0
            return tree
        row = session.run(np.asarray([context[self._cached :]], dtype=np.int64), copy=False)[0, -1]
        self._cached = len(context)
        self._spec_start = session.past_length
        step = np.zeros((1, 1), dtype=np.int64)
        parent, path_prob, options = -1, 1.0, []
        for level in range(depth):
            q = _softmax(row)
            ranked = np.argsort(q)[::-1][: shape.width]
            for rank in ranked[1:]:
                options.append((path_prob * float(q[rank]), parent, self._token(int(rank)), float(q[rank])))
            best = int(ranked[0])
            parent = tree.add(parent, self._token(best), float(q[best]))
            tree.main.append(parent)
            path_prob *= float(q[best])
            if level < depth - 1:
                step[0, 0] = self._token(best)
                row = session.run(step, copy=False)[0, -1]
        for _, at, token, prob in sorted(options, reverse=True)[: shape.width - 1]:
            tree.add(at, token, prob)
        self._proposed = depth
        tree.seconds = time.perf_counter() - started
        return tree

    def _token(self, index: int) -> int:
        return index if self._vocab_ids is None else int(self._vocab_ids[index])

    def _pick(self, row: np.ndarray, sample, probs: list[np.ndarray] | None) -> int:
        """The next token from ``row``: its argmax, or drawn by ``sample`` (its distribution kept in
        ``probs``, which a drawing proposal always passes)."""
        if sample is None or probs is None:
            index = int(np.argmax(row))
            return index if self._vocab_ids is None else int(self._vocab_ids[index])
        probabilities, rng = sample
        sliced = probabilities(row)
        index = int(rng.choice(sliced.size, p=sliced))
        if self._vocab_ids is None:
            probs.append(sliced)
            return index
        full = np.zeros(self._vocab_size, dtype=sliced.dtype)
        full[self._vocab_ids] = sliced
        probs.append(full)
        return int(self._vocab_ids[index])

    def commit(self, kept: int) -> None:
        # Drafts 1..k-1 were fed back (the last one never was); keep the accepted ones valid.
        fed = max(0, self._proposed - 1)
        keep = min(kept, fed)
        if fed > keep:
            self._session.invalidate(self._spec_start + keep, self._spec_start + fed)
        self._cached += keep
        self._proposed = 0

    def part(self, context) -> str:
        return ""  # one draft model

    def observe(self, feature: np.ndarray | None) -> None:
        pass  # reads no features (``reads_features`` is False)

    def observe_heads(self, candidates: HeadCandidates | None) -> None:
        pass  # asks for no head candidates

    def close(self) -> None:
        self._release(self._session)


def _softmax(row: np.ndarray) -> np.ndarray:
    z = np.asarray(row, dtype=np.float64)
    e = np.exp(z - z.max())
    return e / e.sum()


class DraftModel:
    """A compiled draft shard and a pool of its sessions (one per running request)."""

    def __init__(self, runner: ShardRunner, vocab_ids: np.ndarray | None, vocab_size: int):
        self.runner = runner
        self.vocab_ids = vocab_ids
        self.vocab_size = vocab_size
        self._free: list[ShardSession] = []

    def drafter(self) -> ModelDrafter:
        session = self._free.pop() if self._free else self.runner.new_session()
        return ModelDrafter(session, self.vocab_ids, self.vocab_size, self._give_back)

    def _give_back(self, session: ShardSession) -> None:
        session.reset()
        self._free.append(session)
