"""The ``feature`` draft source: an EAGLE-style draft that reads the target's own final hidden
state (pipeshard/shard/feature_draft.py), so it drafts what this target would say.

Steps that use it ask the final stage for its features (``PlanRow.return_features``); after each
step the generation hands the drafter the feature at the last position the target kept
(``observe``), and the next proposal starts from it and the token the target added there. The
draft keeps no cache: a chain feeds each predicted feature to the next level, and a tree scores
the children of a level's likeliest nodes in one batched numpy step and keeps the likeliest
nodes overall (EAGLE-2), so a wider tree costs the coordinator a wider matmul, not more round
trips. Both KV backends return the features of tree rows (paged stages: the masked sequence's).

With traversals in flight (speculation/depth.py) a request drafts its next step before the one
travelling is answered: the proposal starts from the last answered position and chains over the
guesses in flight on its own predicted features, as EAGLE chains over its own drafts; when the
answer comes, ``observe`` brings the real features and later proposals start from them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pipeshard.services.coordinator.speculation.drafts import Draft
from pipeshard.services.coordinator.speculation.tree import ROOT, DraftTree, TreeShape
from pipeshard.shard.draft_heads import HeadCandidates
from pipeshard.shard.feature_decoder import FeatureDecoderModel, attend
from pipeshard.shard.feature_draft import FeatureDraftModel


class _FeatureDrafting:
    """Chains and trees of a feature draft, built from two steps each kind defines: the root's
    (the prediction after the last position the target kept) and a level's (drafted nodes)."""

    auto_tree_width = 3  # a level of any width is one batched draft step; the policy prices it
    reads_features = True
    head_candidates = 0
    pipelines = True  # over guesses in flight it chains on its own predicted features

    def __init__(self, vocab_size: int, head_ids: np.ndarray):
        self._vocab_size = vocab_size
        self._head_ids = head_ids  # the token id of each logits column
        self._memo: _Chain | None = None  # the chain proposals since the last observe went along

    def _root(self, context: Sequence[int]) -> tuple[np.ndarray, np.ndarray] | None:
        """The predicted feature [1, H] and logits [1, S] after the last kept position (None: idle)."""
        raise NotImplementedError

    def _level(
        self, parents: list[int], features: np.ndarray, tokens: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """Drafted nodes' predictions from their parents' predicted features and their tokens,
        and the nodes' ids (a later level's ``parents``; -1 is the root)."""
        raise NotImplementedError

    def follow(self, context: Sequence[int], tokens: Sequence[int]) -> list[int]:
        """The draft's greedy guess at each level of a chain fed ``tokens`` (teacher forcing:
        guess l is for ``tokens[l]``, which level l + 1 is fed): a chain keeps its drafts up to
        the first guess that differs from the target's token."""
        self._forget()
        root = self._root(context)
        if root is None:
            return []
        out, logits = root
        node, guesses = -1, []
        for level, token in enumerate(tokens):
            guesses.append(int(self._head_ids[int(np.argmax(logits[0]))]))
            if level == len(tokens) - 1:
                break
            out, logits, nodes = self._level([node], out, np.asarray([token], dtype=np.int64))
            node = nodes[0]
        return guesses

    def propose(self, context: Sequence[int], k: int, sample, guessed: int = 0) -> Draft:
        """Up to ``k`` tokens after ``context``. Its last ``guessed`` tokens are guesses in flight
        (a pipelined request's rows not answered yet): the root is the last answered position and
        the chain runs over the guesses on its own predicted features (as it runs over its own
        drafts), so a step can be drafted while the one before it travels; the next ``observe``
        brings the target's real features and later proposals start from them. Levels computed
        since the last ``observe`` are reused (a row built on the rows in flight drafts only its
        own levels)."""
        started = time.perf_counter()
        chain = self._chain(context[: len(context) - guessed]) if k >= 1 else None
        if chain is None:
            return Draft([], None, time.perf_counter() - started)
        for depth, guess in enumerate(context[len(context) - guessed :]):  # over the guesses
            chain.advance(self, depth, int(guess))
        tokens: list[int] = []
        probs: list[np.ndarray] | None = [] if sample else None
        for level in range(k):
            if level:
                chain.advance(self, guessed + level - 1, tokens[-1])
            logits = chain.states[guessed + level][1]
            if sample is None or probs is None:  # probs: a list whenever it draws
                column = int(np.argmax(logits[0]))
            else:
                probabilities, rng = sample
                sliced = probabilities(logits[0])
                column = int(rng.choice(sliced.size, p=sliced))
                full = np.zeros(self._vocab_size, dtype=sliced.dtype)
                full[self._head_ids] = sliced
                probs.append(full)
            tokens.append(int(self._head_ids[column]))
        return Draft(tokens, probs, time.perf_counter() - started)

    def _chain(self, answered: Sequence[int]) -> _Chain | None:
        """The chain from the last answered position (``answered``: the context up to it), kept
        until the next ``observe`` (None: idle)."""
        base = (len(answered), int(answered[-1]))
        if self._memo is None or self._memo.base != base:
            root = self._root(answered)
            if root is None:
                return None
            self._memo = _Chain(base, [], [(root[0], root[1], -1)])
        return self._memo

    def _forget(self) -> None:
        """New features (or none): the kept chain started from an older position."""
        self._memo = None

    def propose_tree(self, context: Sequence[int], shape: TreeShape) -> DraftTree:
        """The ``shape.width * shape.depth`` likeliest nodes (EAGLE-2's reranked tree): level by
        level the draft scores the children of the ``width`` likeliest nodes of the level above
        (one batched step), and of every node it scored the tree keeps those whose path
        probability (the product of the draft's probabilities along it) is highest, so it grows
        deep where the draft is sure and wide where it is not. ``main`` is the draft's greedy
        chain as far as the tree holds it."""
        started = time.perf_counter()
        tree = DraftTree()
        self._forget()  # (the decoder kind's root drops the drafted nodes the chain refers to)
        root = self._root(context)
        if root is None:
            return tree
        width = shape.width
        # Scored candidates: (path probability, parent candidate or -1, token, own probability).
        scored: list[tuple[float, int, int, float]] = []
        frontier = [-1]  # candidates whose children the next level scores (-1: the root)
        nodes = [-1]  # the draft's node of each frontier row (-1: the root)
        out, logits = root
        for level in range(shape.depth):
            q = _softmax(logits)
            top = np.argpartition(-q, width - 1, axis=-1)[:, :width] if q.shape[1] > width else None
            children = []
            for b, parent in enumerate(frontier):
                base = 1.0 if parent < 0 else scored[parent][0]
                columns = range(q.shape[1]) if top is None else top[b]
                for column in columns:
                    p = float(q[b, column])
                    scored.append((base * p, parent, int(self._head_ids[column]), p))
                    children.append((len(scored) - 1, b))
            if level == shape.depth - 1:
                break
            children.sort(key=lambda c: scored[c[0]][0], reverse=True)
            kept = children[:width]
            frontier = [c for c, _ in kept]
            tokens = np.asarray([scored[c][2] for c in frontier], dtype=np.int64)
            out, logits, nodes = self._level([nodes[b] for _, b in kept], out[[b for _, b in kept]], tokens)
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

    def part(self, context: Sequence[int]) -> str:
        return ""  # one draft

    def commit(self, kept: int) -> None:
        """Nothing to realign: the next ``observe`` brings the kept positions' features."""

    def observe_heads(self, candidates: HeadCandidates | None) -> None:
        pass  # asks for no head candidates


class FeatureDrafter(_FeatureDrafting):
    """One request's use of a feature draft of kind ``eagle``: the target's latest feature,
    nothing else."""

    def __init__(self, model: FeatureDraftModel):
        super().__init__(model.meta.vocab_size, model.head_ids)
        self._model = model
        self._feature: np.ndarray | None = None  # the target's, at the last position it kept

    def observe(self, feature: np.ndarray | None) -> None:
        """The target's final normed hidden states at the positions the last step kept, in order
        [n, H]; None: the step returned none (idle until one). This kind reads the last."""
        self._forget()
        if feature is None:
            self._feature = None
            return
        self._feature = np.asarray(feature, dtype=np.float32).reshape(-1, self._model.meta.hidden_size)[-1:]

    def _root(self, context: Sequence[int]) -> tuple[np.ndarray, np.ndarray] | None:
        if self._feature is None:
            return None
        return self._model.step(self._feature, np.asarray([context[-1]], dtype=np.int64))

    def _level(
        self, parents: list[int], features: np.ndarray, tokens: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, list[int]]:
        out, logits = self._model.step(features, tokens)
        return out, logits, [-1] * len(parents)

    def close(self) -> None:
        self._forget()
        self._feature = None


class DecoderFeatureDrafter(_FeatureDrafting):
    """A feature draft of kind ``eagle-decoder``: its attention reads every position the target
    kept since the request's first step, from a cache of their keys and values held here (one
    request's: a few KB a position). A proposal first runs the positions observed since the
    last one (the root's row is the last of them); drafted nodes attend to the cache plus their
    own ancestors (a tree mask) and are dropped when the next proposal starts."""

    def __init__(self, model: FeatureDecoderModel):
        super().__init__(model.meta.vocab_size, model.head_ids)
        self._decoder = model
        self._unfed: list[np.ndarray] = []  # observed features whose positions are not cached yet
        h = model.meta.hidden_size
        self._keys = np.zeros((0, model.heads, h // model.heads), dtype=np.float32)
        self._values = self._keys
        self._last: tuple[np.ndarray, np.ndarray] | None = None  # the root's prediction
        # This proposal's drafted nodes: keys, values, parent node (-1: the root), depth.
        self._node_keys: list[np.ndarray] = []
        self._node_values: list[np.ndarray] = []
        self._node_parent: list[int] = []
        self._node_depth: list[int] = []

    def observe(self, feature: np.ndarray | None) -> None:
        self._forget()
        if feature is None:  # a gap in the positions: start over from the next features
            self.close()
            return
        self._unfed.append(np.asarray(feature, dtype=np.float32).reshape(-1, self._decoder.meta.hidden_size))

    def _root(self, context: Sequence[int]) -> tuple[np.ndarray, np.ndarray] | None:
        self._node_keys, self._node_values, self._node_parent, self._node_depth = [], [], [], []
        if self._unfed:
            model = self._decoder
            features = np.concatenate(self._unfed)
            self._unfed = []
            m, n = len(features), len(self._keys)
            z = model.inputs(features, np.asarray(context[-m:], dtype=np.int64))
            q, k, v = model.qkv(z, np.arange(n, n + m))
            self._keys = np.concatenate([self._keys, k])
            self._values = np.concatenate([self._values, v])
            mask = np.arange(n + m)[None, :] <= np.arange(n, n + m)[:, None]  # causal
            out, logits = model.finish(z, attend(q, self._keys, self._values, mask))
            self._last = out[-1:], logits[-1:]
        return self._last

    def _level(
        self, parents: list[int], features: np.ndarray, tokens: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, list[int]]:
        model = self._decoder
        depth = [1 if p < 0 else self._node_depth[p] + 1 for p in parents]
        root = len(self._keys) - 1
        z = model.inputs(features, tokens)
        q, k, v = model.qkv(z, root + np.asarray(depth))
        first = len(self._node_parent)
        ids = list(range(first, first + len(parents)))
        self._node_keys.extend(k)
        self._node_values.extend(v)
        self._node_parent.extend(parents)
        self._node_depth.extend(depth)
        # Each row sees the cache, its ancestors and itself.
        mask = np.zeros((len(ids), len(self._keys) + len(self._node_parent)), dtype=bool)
        mask[:, : len(self._keys)] = True
        for row, node in enumerate(ids):
            while node >= 0:
                mask[row, len(self._keys) + node] = True
                node = self._node_parent[node]
        keys = np.concatenate([self._keys, np.stack(self._node_keys)])
        values = np.concatenate([self._values, np.stack(self._node_values)])
        out, logits = model.finish(z, attend(q, keys, values, mask))
        return out, logits, ids

    def close(self) -> None:
        self._forget()
        self._unfed, self._last = [], None
        self._keys = self._values = self._keys[:0]
        self._node_keys, self._node_values, self._node_parent, self._node_depth = [], [], [], []


@dataclass
class _Chain:
    """A feature draft's chain from the last answered position along one path of tokens (the
    guesses in flight, then its own drafts): each level's predicted feature, logits and node."""

    base: tuple[int, int]  # the answered context it starts from: its length and last token
    path: list[int]
    states: list[tuple[np.ndarray, np.ndarray, int]]  # [i]: after the root and path[:i]

    def advance(self, drafting: _FeatureDrafting, depth: int, token: int) -> None:
        """Makes ``states[depth + 1]`` the level fed ``token`` after ``path[:depth]``: kept when
        the path goes on with it, else computed (the path cut there)."""
        if len(self.path) > depth and self.path[depth] == token:
            return
        del self.path[depth:], self.states[depth + 1 :]
        feature, _, node = self.states[depth]
        out, logits, nodes = drafting._level([node], feature, np.asarray([token], dtype=np.int64))
        self.path.append(token)
        self.states.append((out, logits, nodes[0]))


def _softmax(logits: np.ndarray) -> np.ndarray:
    z = np.asarray(logits, dtype=np.float64)
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)
