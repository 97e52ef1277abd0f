"""Draft trees on their own: the request field, the tree and its chains, proposals, greedy
acceptance, and recursive rejection sampling's output distribution (a chi-square test)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from pipeshard.errors import InvalidArgument
from pipeshard.services.coordinator.generation import Generation
from pipeshard.services.coordinator.speculation.drafts import NgramDrafter
from pipeshard.services.coordinator.speculation.tree import (
    ROOT,
    DraftTree,
    TreeChoice,
    TreeNodes,
    TreeShape,
    accept_tree_greedy,
    accept_tree_sampled,
)


@pytest.mark.parametrize(
    ("value", "mode", "shape"),
    [("", "auto", None), ("auto", "auto", None), ("off", "off", None), ("3x4", "fixed", TreeShape(3, 4))],
)
def test_tree_values_parse(value, mode, shape):
    choice = TreeChoice.parse(value)
    assert (choice.mode, choice.shape) == (mode, shape)


@pytest.mark.parametrize("value", ["3", "0x4", "9x2", "2x33", "wide", "3x4x5", "-1x2"])
def test_bad_tree_values_name_the_field_and_value(value):
    with pytest.raises(InvalidArgument) as err:
        TreeChoice.parse(value)
    assert "tree" in str(err.value) and repr(value) in str(err.value)


def _tree() -> DraftTree:
    """Root -> 5 -> {6 -> 7, 8}; root -> 9."""
    tree = DraftTree()
    tree.add_path([5, 6, 7])
    tree.add_path([5, 8])
    tree.add_path([9])
    return tree


def test_tree_shares_prefixes_and_lists_paths():
    tree = _tree()
    assert [n.token for n in tree.nodes] == [5, 6, 7, 8, 9]
    assert [n.depth for n in tree.nodes] == [1, 2, 3, 2, 1]
    assert tree.children(ROOT) == [0, 4] and tree.children(0) == [1, 3]
    assert tree.leaves() == [2, 3, 4]
    assert tree.path(2) == [0, 1, 2]


def test_chains_pad_paths_and_map_nodes_to_result_rows():
    chains = _tree().chains()
    assert (chains.width, chains.depth) == (3, 3)
    # each chain: the pending token, its path, padded with its leaf to the tree's depth
    assert chains.token_ids([1]) == [1, 5, 6, 7, 1, 5, 8, 8, 1, 9, 9, 9]
    assert chains.row_of(ROOT) == 0
    assert chains.row_of(1) == 2  # node 6: chain 0, depth 2
    assert chains.row_of(3) == 4 + 2  # node 8: chain 1, depth 2
    assert chains.row_of(4) == 8 + 1  # node 9: chain 2, depth 1


def test_nodes_are_one_sequence_with_parents_and_map_nodes_to_result_rows():
    nodes = TreeNodes(_tree())
    assert (nodes.width, nodes.depth, nodes.rows) == (3, 3, 6)
    # two pending tokens, then every node once: 5 -> {6 -> 7, 8}, 9 beside 5
    assert nodes.token_ids([1, 2]) == [1, 2, 5, 6, 7, 8, 9]
    assert nodes.parents(2) == (-1, 0, 1, 2, 3, 2, 1)
    assert nodes.row_of(ROOT) == 0 and nodes.row_of(3) == 4
    # the accepted path 5 -> 8 (nodes 0, 3) keeps the pending tokens and those two
    assert nodes.kept(2, [0, 3]) == (0, 1, 2, 5)


def _top1(chains, after: dict[int, int]) -> list[int]:
    """A target whose argmax after node n is after[n] (after[ROOT] at the root), 0 elsewhere."""
    rows = [0] * (chains.rows if isinstance(chains, TreeNodes) else chains.width * (chains.depth + 1))
    for node, token in after.items():
        rows[chains.row_of(node)] = token
    return rows


def test_greedy_keeps_the_longest_agreeing_path_and_the_targets_token():
    chains = _tree().chains()
    # root -> 5 (node 0) -> 8 (node 3), then the target says 42
    outcome = accept_tree_greedy(chains, _top1(chains, {ROOT: 5, 0: 8, 3: 42}))
    assert outcome.path == [0, 3] and outcome.tokens == [5, 8, 42] and outcome.chain == 1
    # a sibling at the root: 9 (node 4) then 3
    outcome = accept_tree_greedy(chains, _top1(chains, {ROOT: 9, 4: 3}))
    assert outcome.tokens == [9, 3] and outcome.chain == 2
    # nothing agrees: the target's own token only, chain 0 kept
    outcome = accept_tree_greedy(chains, _top1(chains, {ROOT: 77}))
    assert outcome.path == [] and outcome.tokens == [77] and outcome.chain == 0


def test_a_tree_cut_to_its_first_nodes_stays_a_tree():
    tree = _tree()
    assert tree.first(10) is tree
    cut = tree.first(3)  # 5 -> 6 -> 7: the room a paged session has left holds three nodes
    assert [n.token for n in cut.nodes] == [5, 6, 7] and cut.leaves() == [2]
    assert tree.first(0).nodes == []


def test_greedy_over_nodes_keeps_the_same_path():
    nodes = TreeNodes(_tree())
    outcome = accept_tree_greedy(nodes, _top1(nodes, {ROOT: 5, 0: 8, 3: 42}))
    assert outcome.path == [0, 3] and outcome.tokens == [5, 8, 42]
    outcome = accept_tree_greedy(nodes, _top1(nodes, {ROOT: 77}))
    assert outcome.path == [] and outcome.tokens == [77]


def test_tree_sampling_draws_the_targets_distribution():
    """First and second tokens drawn through the tree, against the target's own distributions:
    a chi-square test that fails if rejection over siblings biased the draw."""
    vocab = 10
    chains = _tree().chains()
    rng = np.random.default_rng(7)
    target = rng.dirichlet(np.ones(vocab), size=chains.width * (chains.depth + 1))
    logits = np.log(target)

    def probabilities(row: np.ndarray) -> np.ndarray:
        e = np.exp(row - row.max())
        return e / e.sum()

    n = 20000
    first = np.zeros(vocab)
    second_after_5 = np.zeros(vocab)
    for _ in range(n):
        tokens = accept_tree_sampled(chains, logits, probabilities, rng).tokens
        first[tokens[0]] += 1
        if tokens[0] == 5:
            second_after_5[tokens[1]] += 1
    p_first = stats.chisquare(first, n * target[chains.row_of(ROOT)]).pvalue
    expected_second = second_after_5.sum() * target[chains.row_of(0)]
    p_second = stats.chisquare(second_after_5, expected_second).pvalue
    assert p_first > 1e-3, (first / n, target[0])
    assert p_second > 1e-3, (second_after_5, expected_second)


def test_prompt_lookup_tree_holds_every_earlier_continuation():
    # "1 2" was followed by 3 4, by 7 8 and by 3 9: two branches after 3, one after 7
    context = [1, 2, 3, 4, 0, 1, 2, 7, 8, 0, 1, 2, 3, 9, 0, 1, 2]
    tree = NgramDrafter().propose_tree(context, TreeShape(width=3, depth=2))
    paths = sorted(tuple(tree.nodes[i].token for i in tree.path(leaf)) for leaf in tree.leaves())
    assert paths == [(3, 4), (3, 9), (7, 8)]
    narrow = NgramDrafter().propose_tree(context, TreeShape(width=1, depth=2))
    assert len(narrow.leaves()) == 1


class _PagedRing:
    truncates_on_rewind = True
    verifies_trees = True
    batch_steps = None


def test_paged_stages_take_every_tree_value():
    generation = Generation(_PagedRing(), tokenizer=None, eos_ids=set())
    for value in ("auto", "off", "2x3"):
        assert generation.check_speculative("none", 0, value).mode == "none"
    with pytest.raises(InvalidArgument) as err:
        generation.check_speculative("none", 0, "2x")
    assert "tree" in str(err.value) and "'2x'" in str(err.value)


class _ChainsOnlyRing(_PagedRing):
    verifies_trees = False  # paged stages at a bit-identity precision (PagedBackend.tree_form)


def test_stages_that_verify_no_trees_refuse_a_tree_shape_by_name_and_take_auto_and_off():
    generation = Generation(_ChainsOnlyRing(), tokenizer=None, eos_ids=set())
    for value in ("auto", "off", ""):
        assert generation.check_speculative("none", 0, value).mode == "none"
    with pytest.raises(InvalidArgument) as err:
        generation.check_speculative("none", 0, "2x3")
    assert (
        err.value.field == "tree" and "'2x3'" in str(err.value) and "verify no draft trees" in str(err.value)
    )


def test_a_tree_step_is_timed_by_the_positions_it_computed():
    from pipeshard.services.coordinator.speculation.policy import KPolicy, TimingModel

    policy = KPolicy(TimingModel(), fixed_k=None)
    policy.observe(4, 2, 0.05, 0.0)  # a chain of 4 drafts: 5 positions
    policy.observe(4, 2, 0.09, 0.0, positions=15)  # a tree of 3 chains of 4: 15
    assert [s.positions for s in policy.timing.steps] == [5, 15]
