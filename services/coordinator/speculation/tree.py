"""Draft trees: several candidates per position, verified in one traversal.

A ``DraftTree`` hangs off the root, the last committed token (the step's pending token, which
is not a node). Each node holds its token, its parent, its depth (1 for the root's children)
and the probability its source gave it. The target verifies a tree in the form its KV backend
runs (docs/ARCHITECTURE.md, "Draft trees"):

* stateful stages: its root-to-leaf ``TreeChains``. Every chain is the pending token followed by
  one path, padded to the tree's depth, and runs as its own batch row continuing the session's
  cache (pipeshard/shard/runtime.py, ``run_chains``): their attention mask is per cache position,
  not per query. Row ``c * (D + 1) + j`` of the step's result is the target's distribution after
  the first j tokens of chain c's path.
* paged stages: ``TreeNodes``, one sequence of the pending tokens and every node once, each
  attending the cache and its own ancestors (PagedAttention's query-to-query mask). Row 0 of
  the result follows the root, row ``1 + i`` node i; the next step names the accepted path.

Greedy acceptance keeps the longest path whose every token is the target's argmax at its
parent, then the target's own token: exactly greedy decoding. Sampling runs recursive rejection
over siblings with point-mass proposals (every candidate here is a deterministic function of
the context: prompt lookup, the draft model's top-k): child c is kept with probability p(c) under
the current residual p; a rejected child's token is removed from p and p renormalised; when no
child is kept, the token is drawn from the residual. Each test is a rejection step whose output
has distribution p, so the tokens are distributed as the target's (SpecInfer's multi-candidate
verification with point-mass drafts).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from pipeshard.errors import InvalidArgument

ROOT = -1
MAX_WIDTH = 8
MAX_DEPTH = 32
_SHAPE = re.compile(r"([1-9][0-9]?)x([1-9][0-9]?)")


@dataclass(frozen=True)
class TreeShape:
    """Up to ``width`` candidate paths (root-to-leaf chains, so up to ``width`` children at any
    node) of up to ``depth`` levels."""

    width: int
    depth: int

    def __str__(self) -> str:
        return f"{self.width}x{self.depth}"


@dataclass(frozen=True)
class TreeChoice:
    """What a request asked for: ``auto`` (the coordinator chooses), ``off`` (chains) or a shape."""

    mode: str  # "auto" | "off" | "fixed"
    shape: TreeShape | None = None

    @classmethod
    def parse(cls, value: str) -> TreeChoice:
        """``""``/``auto``, ``off`` or ``WxD`` (1 <= W <= 8, 1 <= D <= 32); InvalidArgument names
        ``tree`` and the value otherwise."""
        text = (value or "auto").strip().lower()
        if text in ("auto", "off"):
            return cls(text)
        match = _SHAPE.fullmatch(text)
        if match:
            width, depth = int(match[1]), int(match[2])
            if width <= MAX_WIDTH and depth <= MAX_DEPTH:
                return cls("fixed", TreeShape(width, depth))
        raise InvalidArgument(
            "tree", f"must be auto, off or WxD (W in 1..{MAX_WIDTH}, D in 1..{MAX_DEPTH}), got {value!r}"
        )


TREE_OFF = TreeChoice("off")
TREE_AUTO = TreeChoice("auto")


@dataclass(frozen=True)
class TreeNode:
    token: int
    parent: int  # index of the parent node; ROOT for the root's children
    depth: int  # 1 for the root's children
    prob: float  # the probability the source gave this candidate (1.0: a deterministic lookup)


@dataclass
class DraftTree:
    """A tree of candidate tokens after the context. ``main`` lists the nodes of the drafter's
    own chain (the one a draft model fed through its cache; empty for prompt lookup)."""

    nodes: list[TreeNode] = field(default_factory=list)
    main: list[int] = field(default_factory=list)
    seconds: float = 0.0

    def add(self, parent: int, token: int, prob: float = 1.0) -> int:
        """The child of ``parent`` with ``token``, added unless it exists."""
        for i in self.children(parent):
            if self.nodes[i].token == token:
                return i
        depth = 1 if parent == ROOT else self.nodes[parent].depth + 1
        self.nodes.append(TreeNode(int(token), parent, depth, float(prob)))
        return len(self.nodes) - 1

    def add_path(self, tokens: Sequence[int], probs: Sequence[float] | None = None) -> list[int]:
        """Adds a path from the root (sharing existing prefixes); returns its node indices."""
        path, parent = [], ROOT
        for i, token in enumerate(tokens):
            parent = self.add(parent, token, 1.0 if probs is None else probs[i])
            path.append(parent)
        return path

    def children(self, parent: int) -> list[int]:
        return [i for i, n in enumerate(self.nodes) if n.parent == parent]

    def leaves(self) -> list[int]:
        parents = {n.parent for n in self.nodes}
        return [i for i in range(len(self.nodes)) if i not in parents]

    def path(self, node: int) -> list[int]:
        """Node indices from the root's child down to ``node``."""
        out = []
        while node != ROOT:
            out.append(node)
            node = self.nodes[node].parent
        return out[::-1]

    @property
    def depth(self) -> int:
        return max((n.depth for n in self.nodes), default=0)

    def path_prob(self, node: int) -> float:
        """The source's probability of the path down to ``node`` (BloomBee's candidate score)."""
        return float(np.prod([self.nodes[i].prob for i in self.path(node)]))

    def pruned(self, floor: float) -> DraftTree:
        """The tree without the nodes whose path probability is below ``floor`` (nor their
        subtrees: a path's probability only falls along it); the root's likeliest child stays,
        so a step keeps a draft."""
        if floor <= 0.0 or not self.nodes:
            return self
        keep = [self.path_prob(i) >= floor for i in range(len(self.nodes))]
        first = max(self.children(ROOT), key=lambda i: self.nodes[i].prob)
        keep[first] = True
        out = DraftTree(seconds=self.seconds)
        index: dict[int, int] = {ROOT: ROOT}
        for i, node in enumerate(self.nodes):
            if keep[i] and node.parent in index:
                index[i] = out.add(index[node.parent], node.token, node.prob)
        out.main = [index[i] for i in self.main if i in index]
        return out

    def first(self, n: int) -> DraftTree:
        """The tree of its first ``n`` nodes (a parent precedes its children, so they are a tree);
        itself when it has no more."""
        if n >= len(self.nodes):
            return self
        return DraftTree(self.nodes[: max(0, n)], [i for i in self.main if i < n], self.seconds)

    def chains(self) -> TreeChains:
        return TreeChains(self, [self.path(leaf) for leaf in self.leaves()])


@dataclass
class TreeChains:
    """A tree as the rows the stages run: one root-to-leaf path per chain, each padded to the
    tree's depth with its leaf's token (padding is never accepted: no node lies there)."""

    tree: DraftTree
    paths: list[list[int]]

    @property
    def width(self) -> int:
        return len(self.paths)

    @property
    def depth(self) -> int:
        return self.tree.depth

    def token_ids(self, pending: Sequence[int]) -> list[int]:
        """Every chain's tokens, concatenated: the tokens the stages have not seen (the root),
        the chain's path, the padding."""
        nodes, d = self.tree.nodes, self.depth
        ids: list[int] = []
        for path in self.paths:
            tokens = [nodes[i].token for i in path]
            ids += [*pending, *tokens, *[tokens[-1]] * (d - len(tokens))]
        return ids

    def chain_of(self, node: int) -> int:
        """The first chain whose path holds ``node`` (chain 0 for the root)."""
        if node == ROOT:
            return 0
        return next(c for c, path in enumerate(self.paths) if node in path)

    def row_of(self, node: int) -> int:
        """The result row holding the target's distribution after ``node``."""
        depth = 0 if node == ROOT else self.tree.nodes[node].depth
        return self.chain_of(node) * (self.depth + 1) + depth


@dataclass
class TreeNodes:
    """A tree as one masked sequence (paged stages): the pending tokens, then every node once in
    index order (a parent always precedes its children)."""

    tree: DraftTree

    @property
    def width(self) -> int:
        return len(self.tree.leaves())

    @property
    def depth(self) -> int:
        return self.tree.depth

    @property
    def rows(self) -> int:
        """Result rows: after the root, then after each node."""
        return 1 + len(self.tree.nodes)

    def token_ids(self, pending: Sequence[int]) -> list[int]:
        return [*pending, *(n.token for n in self.tree.nodes)]

    def parents(self, pending: int) -> tuple[int, ...]:
        """Each token's parent within the row: the pending tokens follow one another (the first
        the cache), a node its parent node or the last pending token."""
        root = pending - 1
        return (
            *range(-1, root),
            *(root if n.parent == ROOT else pending + n.parent for n in self.tree.nodes),
        )

    def kept(self, pending: int, path: Sequence[int]) -> tuple[int, ...]:
        """The row's tokens an accepted ``path`` keeps: the pending ones, then the path's nodes."""
        return (*range(pending), *(pending + node for node in path))

    def chain_of(self, node: int) -> int:
        return 0  # one sequence: the next step names the path, not a chain

    def row_of(self, node: int) -> int:
        return 0 if node == ROOT else 1 + node


@dataclass(frozen=True)
class TreeOutcome:
    """What one tree step keeps: the accepted nodes (a path), the chain holding them, and the
    new tokens (the accepted tokens, then the target's own)."""

    path: list[int]
    chain: int
    tokens: list[int]


TreeRows = TreeChains | TreeNodes


def accept_tree_greedy(chains: TreeRows, target_top1: Sequence[int]) -> TreeOutcome:
    """The longest path whose every token is the target's argmax at its parent."""
    tree = chains.tree
    node, path = ROOT, list[int]()
    while True:
        target = int(target_top1[chains.row_of(node)])
        child = next((c for c in tree.children(node) if tree.nodes[c].token == target), None)
        if child is None:
            tokens = [tree.nodes[i].token for i in path] + [target]
            return TreeOutcome(path, chains.chain_of(node), tokens)
        path.append(child)
        node = child


def accept_tree_sampled(
    chains: TreeRows,
    rows: np.ndarray,
    probabilities: Callable[[np.ndarray], np.ndarray],
    rng: np.random.Generator,
) -> TreeOutcome:
    """Recursive rejection over siblings (point-mass proposals): tokens distributed as the
    target's. ``rows`` (a row per ``row_of``) are the step's logits, ``probabilities`` the request's
    sampling distribution of a row."""
    tree = chains.tree
    node, path = ROOT, list[int]()
    while True:
        p = np.array(probabilities(rows[chains.row_of(node)]), dtype=np.float64)
        kept = None
        for child in tree.children(node):
            token = tree.nodes[child].token
            rest = p.sum() - p[token]
            # A candidate holding all the mass left is kept (rounding aside, it always would be).
            if rng.random() < p[token] or rest <= 0.0:
                kept = child
                break
            p[token] = 0.0
            p /= rest
        if kept is None:
            token = int(rng.choice(p.size, p=p / p.sum()))
            tokens = [tree.nodes[i].token for i in path] + [token]
            return TreeOutcome(path, chains.chain_of(node), tokens)
        path.append(kept)
        node = kept
