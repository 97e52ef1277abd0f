"""The ``mix`` draft source: prompt lookup where the context repeats itself, the feature draft
where lookup has nothing.

Prompt lookup is free and, where it matches (code, lists, quoting), keeps long runs; the feature
draft reads the target's own features and keeps more on natural text, where lookup finds no
earlier occurrence. Each step takes lookup's proposal when it has one and the feature draft's
otherwise; the feature draft sees every step's features either way (``observe``), so it is ready
whenever lookup runs dry. Both continue from their own unconfirmed proposals, so the mix
pipelines too (speculation/depth.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipeshard.services.coordinator.speculation.drafts import Draft, NgramDrafter, lookup_part
from pipeshard.services.coordinator.speculation.feature import DecoderFeatureDrafter, FeatureDrafter
from pipeshard.services.coordinator.speculation.tree import DraftTree, TreeShape
from pipeshard.shard.draft_heads import HeadCandidates


class MixedDrafter:
    """One request's lookup and feature draft, lookup first."""

    auto_tree_width = 3
    reads_features = True
    head_candidates = 0
    pipelines = True

    def __init__(self, feature: FeatureDrafter | DecoderFeatureDrafter):
        self._lookup = NgramDrafter()
        self._feature = feature

    def propose(self, context: Sequence[int], k: int, sample, guessed: int = 0) -> Draft:
        found = self._lookup.propose(context, k, sample)
        if found.tokens:
            return found
        drafted = self._feature.propose(context, k, sample, guessed)
        drafted.seconds += found.seconds
        return drafted

    def part(self, context: Sequence[int]) -> str:
        """Lookup's match where it has one (its long matches are kept far more often than the
        feature draft's proposals), else the feature draft's."""
        matched = self._lookup.match_length(context)
        return lookup_part(matched) if matched else self._feature.part(context)

    def propose_tree(self, context: Sequence[int], shape: TreeShape) -> DraftTree:
        tree = self._lookup.propose_tree(context, shape)
        return tree if tree.nodes else self._feature.propose_tree(context, shape)

    def commit(self, kept: int) -> None:
        self._feature.commit(kept)

    def observe(self, feature: np.ndarray | None) -> None:
        self._feature.observe(feature)

    def observe_heads(self, candidates: HeadCandidates | None) -> None:
        pass  # asks for no head candidates

    def close(self) -> None:
        self._feature.close()
