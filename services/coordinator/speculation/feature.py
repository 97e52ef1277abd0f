"""The ``feature`` draft source: an EAGLE-style draft that reads the target's own final hidden
state (pipeshard/shard/feature_draft.py), so it drafts what this target would say.

Steps that use it ask the final stage for its features (``PlanRow.return_features``); after each
step the generation hands the drafter the feature at the last position the target kept
(``observe``), and the next proposal starts from it and the token the target added there. The
draft keeps no cache: a chain feeds each predicted feature to the next level, and a tree is a
beam over levels (one batched numpy step per level), so a wider tree costs the coordinator a
wider matmul, not more round trips.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from pipeshard.services.coordinator.speculation.drafts import Draft
from pipeshard.services.coordinator.speculation.tree import DraftTree, TreeShape
from pipeshard.shard.feature_draft import FeatureDraftModel


class FeatureDrafter:
    """One request's use of a feature draft: the target's latest feature, nothing else."""

    auto_tree_width = 1  # trees need stateful stages; a chain is what every backend verifies
    reads_features = True
    head_candidates = 0

    def __init__(self, model: FeatureDraftModel):
        self._model = model
        self._feature: np.ndarray | None = None  # the target's, at the last position it kept

    def observe(self, feature: np.ndarray) -> None:
        """The target's final normed hidden state at the last position it kept (the position of
        the token before the one it just added)."""
        self._feature = np.asarray(feature, dtype=np.float32).reshape(1, -1)

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
            if sample is None:
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
        """A beam of ``shape.width`` paths over ``shape.depth`` levels, each path scored by the
        product of the draft's probabilities along it; the best path is the tree's ``main``."""
        started = time.perf_counter()
        tree = DraftTree()
        if self._feature is None:
            return tree
        model, width = self._model, shape.width
        beams = [((), 1.0)]  # (tokens, path probability)
        features = self._feature
        tokens = np.asarray([context[-1]], dtype=np.int64)
        for _ in range(shape.depth):
            out, logits = model.step(features, tokens)
            q = _softmax(logits)
            options = []
            for b, (path, score) in enumerate(beams):
                for column in np.argsort(q[b])[::-1][:width]:
                    options.append((score * float(q[b, column]), b, int(model.head_ids[column]), path))
            options.sort(key=lambda o: o[0], reverse=True)
            kept = options[:width]
            beams = [((*path, token), score) for score, _, token, path in kept]
            features = out[[b for _, b, _, _ in kept]]
            tokens = np.asarray([token for _, _, token, _ in kept], dtype=np.int64)
        for i, (path, _) in enumerate(beams):
            nodes = tree.add_path(path)
            if i == 0:
                tree.main = nodes
        tree.seconds = time.perf_counter() - started
        return tree

    def commit(self, kept: int) -> None:
        """Nothing to realign: the next ``observe`` replaces the feature."""

    def close(self) -> None:
        self._feature = None


def _softmax(logits: np.ndarray) -> np.ndarray:
    z = np.asarray(logits, dtype=np.float64)
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)
