"""The ``medusa`` draft source: the final stage's draft heads (pipeshard/shard/draft_heads.py)
propose the next step's candidates, so nothing drafts on the coordinator and no round trip is
added.

Steps that use it ask the final stage for head candidates (``PlanRow.draft_heads``); the stage
follows the greedy path through the row itself, runs its K heads at the last position that path
keeps and returns each head's top candidates with the verify result. The generation hands them
to the drafter when its own acceptance ended at that position (it always should: both are
greedy), and the next step's draft is built from them: the root is the token the target just
added, level k holds head k's candidates; a chain takes each head's best, a tree keeps the best
nodes by the product of their heads' probabilities (up to ``width`` paths of up to ``depth``
levels, best first). Without candidates (sampled requests, whose path the stage cannot follow;
a result that carried none) it drafts by prompt lookup, as ``ngram`` does.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Sequence

import numpy as np

from pipeshard.services.coordinator.speculation.drafts import Draft, NgramDrafter
from pipeshard.services.coordinator.speculation.tree import ROOT, DraftTree, TreeShape
from pipeshard.shard.draft_heads import HeadCandidates

CANDIDATES = 4  # candidates per head each step asks for: the widest tree=auto tries, and a margin


class MedusaDrafter:
    """One request's use of the final stage's heads: the last step's candidates, nothing else."""

    auto_tree_width = 3
    reads_features = False
    pipelines = False  # it drafts from the last step's head candidates

    def __init__(self, levels: int, candidates: int = CANDIDATES):
        self.levels = levels  # the fleet's heads: the deepest draft they make
        self.head_candidates = candidates
        self._candidates: HeadCandidates | None = None
        self._lookup = NgramDrafter()

    def observe_heads(self, candidates: HeadCandidates | None) -> None:
        """The heads' candidates after the last step (None: none usable this time)."""
        self._candidates = candidates

    def propose(self, context: Sequence[int], k: int, sample, guessed: int = 0) -> Draft:
        c = self._candidates  # (``guessed`` is always 0: it does not pipeline)
        if c is None or sample is not None:
            return self._lookup.propose(context, k, sample)
        started = time.perf_counter()
        tokens = [int(t) for t in c.token_ids[: max(0, k), 0]]
        return Draft(tokens, None, time.perf_counter() - started)

    def part(self, context: Sequence[int]) -> str:
        return "" if self._candidates is not None else self._lookup.part(context)

    def propose_tree(self, context: Sequence[int], shape: TreeShape) -> DraftTree:
        """The best nodes by the product of their heads' probabilities, added best first while
        the tree keeps at most ``shape.width`` paths of at most ``shape.depth`` levels; the chain
        of each head's best candidate, as far as it was kept, is the tree's ``main``."""
        c = self._candidates
        if c is None:
            return self._lookup.propose_tree(context, shape)
        started = time.perf_counter()
        tree = DraftTree()
        depth = min(shape.depth, c.heads)
        if depth < 1:
            return tree
        probs = c.probabilities.astype(float)
        width = c.token_ids.shape[1]
        # (-path probability, tie order, level, candidate, parent node)
        frontier = [(-probs[0, i], i, 0, i, ROOT) for i in range(width)]
        heapq.heapify(frontier)
        order, leaves, has_children = width, 0, set()
        while frontier and len(tree.nodes) < shape.width * depth:
            score, _, level, i, parent = heapq.heappop(frontier)
            if parent == ROOT or parent in has_children:  # a new path, not a longer one
                if leaves >= shape.width:
                    continue
                leaves += 1
            node = tree.add(parent, int(c.token_ids[level, i]), float(probs[level, i]))
            has_children.add(parent)
            if level + 1 < depth:
                for j in range(width):
                    heapq.heappush(frontier, (score * probs[level + 1, j], order, level + 1, j, node))
                    order += 1
        main, parent = [], ROOT
        for level in range(depth):
            child = next(
                (n for n in tree.children(parent) if tree.nodes[n].token == int(c.token_ids[level, 0])), None
            )
            if child is None:
                break
            main.append(child)
            parent = child
        tree.main = main
        tree.seconds = time.perf_counter() - started
        return tree

    def commit(self, kept: int) -> None:
        """Nothing to realign: the next step's candidates replace these."""

    def observe(self, feature: np.ndarray | None) -> None:
        pass  # reads no features (``reads_features`` is False)

    def close(self) -> None:
        self._candidates = None
