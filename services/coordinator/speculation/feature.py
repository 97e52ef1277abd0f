"""The ``feature`` draft source: an EAGLE-style draft that reads the target's own final hidden
state (pipeshard/shard/feature_draft.py), so it drafts what this target would say.

Steps that use it ask the final stage for its features (``PlanRow.return_features``); after each
step the generation hands the drafter the feature at the last position the target kept
(``observe``), and the next proposal starts from it and the token the target added there. The
draft keeps no cache: a chain feeds each predicted feature to the next level, and a tree scores
the children of a level's likeliest nodes in one batched numpy step and keeps the likeliest
nodes overall (EAGLE-2), so a wider tree costs the coordinator a wider matmul, not more round
trips. Both KV backends return the features of tree rows (paged stages: the masked sequence's).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from pipeshard.services.coordinator.speculation.drafts import Draft
from pipeshard.services.coordinator.speculation.tree import ROOT, DraftTree, TreeShape
from pipeshard.shard.draft_heads import HeadCandidates
from pipeshard.shard.feature_draft import FeatureDraftModel


class FeatureDrafter:
    """One request's use of a feature draft: the target's latest feature, nothing else."""

    auto_tree_width = 3  # a level of any width is one batched draft step; the policy prices it
    reads_features = True
    head_candidates = 0

    def __init__(self, model: FeatureDraftModel):
        self._model = model
        self._feature: np.ndarray | None = None  # the target's, at the last position it kept

    def observe(self, feature: np.ndarray | None) -> None:
        """The target's final normed hidden state at the last position it kept (the position of
        the token before the one it just added); None: the step returned none (idle until one)."""
        self._feature = None if feature is None else np.asarray(feature, dtype=np.float32).reshape(1, -1)

    def propose(self, context: Sequence[int], k: int, sample) -> Draft:
        started = time.perf_counter()
        if self._feature is None or k < 1:
            return Draft([], None, time.perf_counter() - started)
        model = self._model
        feature, token = self._feature, np.asarray([context[-1]], dtype=np.int64)
        tokens: list[int] = []
        probs: list[np.ndarray] | None = [] if sample else None
        for _ in range(k):
            feature, logits = model.step(feature, token)
            if sample is None or probs is None:  # probs: a list whenever it draws
                column = int(np.argmax(logits[0]))
            else:
                probabilities, rng = sample
                sliced = probabilities(logits[0])
                column = int(rng.choice(sliced.size, p=sliced))
                full = np.zeros(model.meta.vocab_size, dtype=sliced.dtype)
                full[model.head_ids] = sliced
                probs.append(full)
            token = model.head_ids[[column]]
            tokens.append(int(token[0]))
        return Draft(tokens, probs, time.perf_counter() - started)

    def propose_tree(self, context: Sequence[int], shape: TreeShape) -> DraftTree:
        """The ``shape.width * shape.depth`` likeliest nodes (EAGLE-2's reranked tree): level by
        level the draft scores the children of the ``width`` likeliest nodes of the level above
        (one batched step), and of every node it scored the tree keeps those whose path
        probability (the product of the draft's probabilities along it) is highest, so it grows
        deep where the draft is sure and wide where it is not. ``main`` is the draft's greedy
        chain as far as the tree holds it."""
        started = time.perf_counter()
        tree = DraftTree()
        if self._feature is None:
            return tree
        model, width = self._model, shape.width
        # Scored candidates: (path probability, parent candidate or -1, token, own probability).
        scored: list[tuple[float, int, int, float]] = []
        frontier = [-1]  # candidates whose children the next level scores (-1: the root)
        features = self._feature
        tokens = np.asarray([context[-1]], dtype=np.int64)
        for level in range(shape.depth):
            out, logits = model.step(features, tokens)
            q = _softmax(logits)
            top = np.argpartition(-q, width - 1, axis=-1)[:, :width] if q.shape[1] > width else None
            children = []
            for b, parent in enumerate(frontier):
                base = 1.0 if parent < 0 else scored[parent][0]
                columns = range(q.shape[1]) if top is None else top[b]
                for column in columns:
                    p = float(q[b, column])
                    scored.append((base * p, parent, int(model.head_ids[column]), p))
                    children.append((len(scored) - 1, b))
            if level == shape.depth - 1:
                break
            children.sort(key=lambda c: scored[c[0]][0], reverse=True)
            kept = children[:width]
            frontier = [c for c, _ in kept]
            features = out[[b for _, b in kept]]
            tokens = np.asarray([scored[c][2] for c in frontier], dtype=np.int64)
        best = sorted(range(len(scored)), key=lambda i: scored[i][0], reverse=True)
        chosen = set(best[: width * shape.depth])
        index = {-1: ROOT}
        for i, (_, parent, token, p) in enumerate(scored):  # parents come before their children
            if i in chosen and parent in index:
                index[i] = tree.add(index[parent], token, p)
        node = ROOT
        while True:
            options = tree.children(node)
            if not options:
                break
            node = max(options, key=lambda c: tree.nodes[c].prob)
            tree.main.append(node)
        tree.seconds = time.perf_counter() - started
        return tree

    def commit(self, kept: int) -> None:
        """Nothing to realign: the next ``observe`` replaces the feature."""

    def observe_heads(self, candidates: HeadCandidates | None) -> None:
        pass  # asks for no head candidates

    def close(self) -> None:
        self._feature = None


def _softmax(logits: np.ndarray) -> np.ndarray:
    z = np.asarray(logits, dtype=np.float64)
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)
