"""The ``mix`` draft source: prompt lookup where the context repeats itself, the feature draft
where lookup has nothing; the feature draft sees every step's features either way."""

from __future__ import annotations

import numpy as np

from pipeshard.services.coordinator.speculation.drafts import NgramDrafter
from pipeshard.services.coordinator.speculation.feature import FeatureDrafter
from pipeshard.services.coordinator.speculation.mixed import MixedDrafter
from pipeshard.services.coordinator.speculation.tree import TreeShape
from pipeshard.shard import feature_draft
from tests.speculation.test_feature import H, _random_draft


def _pair(folder) -> tuple[MixedDrafter, FeatureDrafter]:
    _random_draft(folder)
    model = feature_draft.FeatureDraftModel(folder)
    return MixedDrafter(FeatureDrafter(model)), FeatureDrafter(model)


def test_lookup_where_it_matches_else_the_feature_draft(tmp_path):
    mixed, alone = _pair(tmp_path)
    feature = np.linspace(-1, 1, H, dtype=np.float32)
    mixed.observe(feature)  # handed on whatever drafted the step
    alone.observe(feature)
    repeats = [3, 4, 5, 6, 7, 3, 4]
    lookup = NgramDrafter().propose(repeats, 3, None).tokens
    assert mixed.propose(repeats, 3, None).tokens == lookup == [5, 6, 7]
    fresh = [1, 2, 9]  # no earlier occurrence of its suffix
    assert not NgramDrafter().propose(fresh, 3, None).tokens
    assert mixed.propose(fresh, 3, None).tokens == alone.propose(fresh, 3, None).tokens
    assert len(mixed.propose(fresh, 3, None).tokens) == 3
    # In flight: over guesses the feature draft chains from the last answered position.
    guesses = alone.propose(fresh, 2, None).tokens
    continued = mixed.propose(fresh + guesses, 2, None, guessed=2).tokens
    assert continued == alone.propose(fresh, 4, None).tokens[2:]
    assert mixed.propose_tree(fresh, TreeShape(2, 3)).nodes  # the feature draft's tree
    assert [n.token for n in mixed.propose_tree(repeats, TreeShape(2, 3)).nodes][:3] == [5, 6, 7]
    # What each proposal rests on (adaptive K keeps an acceptance per part): lookup's match, else
    # the feature draft
    assert mixed.part(repeats) == mixed.propose(repeats, 3, None).part == "lookup2"
    assert mixed.part(fresh) == mixed.propose(fresh, 3, None).part == alone.part(fresh) == ""
    mixed.observe(None)  # a step without features: only lookup drafts
    assert mixed.propose(fresh, 3, None).tokens == []
    assert mixed.propose(repeats, 3, None).tokens == [5, 6, 7]
