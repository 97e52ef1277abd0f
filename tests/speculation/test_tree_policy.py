"""The draft-tree shape policy (speculation/policy.py ``choose_shape``, ``prune_floor``) and
pruning (``DraftTree.pruned``), over step costs of a slow and a fast link: a wide deep tree
where round trips dominate, plain steps where compute does and the drafts are poor, a chain
once the tree's own acceptance proves no better, and a pruning floor that rises as the link
gets faster."""

from __future__ import annotations

import pytest

from pipeshard.services.coordinator.speculation.drafts import NgramDrafter
from pipeshard.services.coordinator.speculation.policy import KPolicy, TimingModel
from pipeshard.services.coordinator.speculation.tree import ROOT, DraftTree, TreeShape


def _timing(fixed: float, per_position: float, verify: float) -> TimingModel:
    """Steps timed exactly on that cost line: plain steps and verify steps of 2..20 positions."""
    timing = TimingModel()
    for positions in [1, 1, 1, *range(2, 21)]:
        timing.observe(positions, fixed + per_position * positions + verify * (positions > 1))
    return timing


SLOW = dict(fixed=0.3, per_position=0.0025, verify=0.014)  # 3 hops of 100 ms
FAST = dict(fixed=0.017, per_position=0.0025, verify=0.014)  # loopback: compute decides


def _policy(link: dict, chain_acceptance: float) -> KPolicy:
    policy = KPolicy(_timing(**link), fixed_k=None, times_steps=False)
    for _ in range(40):  # chain steps of 10 drafts, each kept with about that share
        policy.observe(10, round(10 * chain_acceptance), 0.0, 0.0)
    return policy


def test_a_slow_link_takes_a_wide_deep_tree():
    paths, depth = _policy(SLOW, 0.5).choose_shape(32, 3)
    assert paths == 3 and depth >= 6


@pytest.mark.parametrize("acceptance", [0.5, 0.7, 0.9])
def test_the_same_drafts_go_wide_over_a_slow_link_and_as_a_chain_on_one_node(acceptance):
    """Tree width by latency: a tree's extra positions cost little against 100 ms hops, and on
    one node they cost about what the tree's extra tokens bring."""
    slow, fast = _policy(SLOW, acceptance), _policy(FAST, acceptance)
    assert slow.choose_shape(32, 3)[0] == 3
    paths, depth = fast.choose_shape(32, 3)
    assert paths == 1 and depth > 0


def test_a_fast_link_with_poor_drafts_decodes_plainly():
    policy = _policy(FAST, 0.1)
    assert policy.choose_shape(32, 3)[1] == 0


def test_a_tree_that_keeps_no_more_than_a_chain_gives_way_to_the_chain():
    policy = _policy(SLOW, 0.5)
    for _ in range(40):  # 3-path trees of 8 levels (about 20 positions) keeping 2 levels
        policy.observe(8, 2, 0.0, 0.0, positions=21, width=3)
    paths, depth = policy.choose_shape(32, 3)
    assert paths == 1 and depth > 0


def test_a_fixed_k_and_a_source_without_width_keep_chains():
    assert KPolicy(_timing(**SLOW), fixed_k=5).choose_shape(32, 3) == (1, 5)
    assert _policy(SLOW, 0.5).choose_shape(32, 1)[0] == 1
    assert _policy(SLOW, 0.5).choose_shape(2, 3)[1] <= 2  # the limit holds


def test_the_pruning_floor_rises_as_the_link_gets_faster():
    slow, fast = _policy(SLOW, 0.5), _policy(FAST, 0.5)
    assert 0.0 < slow.prune_floor(3, 6) < 0.05 < fast.prune_floor(3, 6)
    assert KPolicy(TimingModel(), fixed_k=None).prune_floor(3, 6) == 0.0  # nothing measured yet


def _scored_tree() -> DraftTree:
    """Root -> 5 (0.9) -> {6 (0.5) -> 7 (0.5), 8 (0.1)}; root -> 9 (0.1)."""
    tree = DraftTree()
    tree.add_path([5, 6, 7], [0.9, 0.5, 0.5])
    tree.add_path([5, 8], [0.9, 0.1])
    tree.add_path([9], [0.1])
    tree.main = [0, 1, 2]
    return tree


def test_pruning_drops_unlikely_paths_with_their_subtrees():
    tree = _scored_tree()
    assert tree.pruned(0.0) is tree
    kept = tree.pruned(0.2)  # path probabilities: 5 .9, 6 .45, 7 .225, 8 .09, 9 .1
    assert [n.token for n in kept.nodes] == [5, 6, 7] and kept.main == [0, 1, 2]
    kept = tree.pruned(0.3)
    assert [n.token for n in kept.nodes] == [5, 6] and [n.parent for n in kept.nodes] == [ROOT, 0]
    # the root's likeliest child stays even under a floor above every path
    assert [n.token for n in tree.pruned(0.95).nodes] == [5]


def test_prompt_lookup_scores_each_candidate_by_its_share_of_the_occurrences():
    # "0 1 2" was followed by 3 4 twice and by 7 8 once
    context = [0, 1, 2, 3, 4, 0, 1, 2, 7, 8, 0, 1, 2, 3, 4, 0, 1, 2]
    tree = NgramDrafter().propose_tree(context, TreeShape(width=3, depth=2))
    probs = {
        tuple(tree.nodes[i].token for i in tree.path(leaf)): tree.path_prob(leaf) for leaf in tree.leaves()
    }
    assert probs == {(3, 4): pytest.approx(2 / 3), (7, 8): pytest.approx(1 / 3)}
