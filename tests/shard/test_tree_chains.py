"""Draft trees on the shards: what each KV backend can run.

Stateful (``ShardSession.run_chains``): a tree's chains run as batch rows gathered by
``beam_idx``; each row equals its chain run alone, and the kept chain continues exactly.

Paged (``PagedShard`` with ``parents``): a tree's nodes run as one sequence under an ancestor
mask (PagedAttention's QQ_BIAS inputs), beside another sequence's causal row in the same step;
each node's logits equal its path run alone, the causal row's equal it run alone, and once the
accepted path's cache moved behind the cache (``move``) the sequence continues exactly."""

from __future__ import annotations

import numpy as np
import pytest

from pipeshard.errors import FailedPrecondition, InvalidArgument
from pipeshard.shard import paged
from pipeshard.shard.runtime import ShardRunner, export_kv

pytestmark = pytest.mark.slow

PROMPT = np.array([[1, 504, 3458, 282, 253, 1345, 30, 378, 314, 260]], dtype=np.int64)
TOL = 1e-3  # what ``exact`` promises across row groupings (pipeshard/runtime.py)


@pytest.fixture(scope="module")
def runner(smollm2_export) -> ShardRunner:
    return ShardRunner(smollm2_export(1, "int4"), 0, "exact")


def _alone(runner: ShardRunner, *steps: np.ndarray) -> np.ndarray:
    session = runner.new_session()
    session.run(PROMPT)
    out = None
    for ids in steps:
        out = session.run(ids[None], return_last=len(ids))[0]
    return out


def test_chains_run_as_rows_equal_each_chain_alone_and_the_kept_one_continues(runner):
    chains = np.array([[11, 12, 13], [11, 25, 26], [40, 41, 42]], dtype=np.int64)
    w, d = chains.shape
    p = PROMPT.shape[1]
    session = runner.new_session()
    session.run(PROMPT)
    positions = np.tile(np.arange(p, p + d), w)
    out = session.run_chains(chains.reshape(1, -1), positions, w, return_last=d)[0]
    assert out.shape == (w * d, runner.vocab_size)
    for c in range(w):
        want = _alone(runner, chains[c])
        got = out[c * d : (c + 1) * d]
        assert np.abs(got - want).max() < TOL
        assert (got.argmax(-1) == want.argmax(-1)).all()
    with pytest.raises(InvalidArgument, match="tree_keep"):
        session.run(np.array([[5]]))  # a step after a tree step must name the chain to keep
    session.keep_chain(1)
    session.invalidate(p + 2, p + d)  # chain 1 kept its first two tokens
    got = session.run(np.array([[77]]), np.array([[p + 2]]))[0, -1]
    want = _alone(runner, chains[1, :2], np.array([77]))[-1]
    assert np.abs(got - want).max() < TOL and got.argmax() == want.argmax()
    # the cache a prefix capture takes is the kept chain's
    blob = export_kv(session, p + 2)
    reference = runner.new_session()
    reference.run(PROMPT)
    reference.run(chains[1, :2][None])
    assert np.abs(blob.arrays[0] - export_kv(reference).arrays[0]).max() < TOL


def test_keep_chain_names_one_of_the_last_steps_chains(runner):
    session = runner.new_session()
    session.run(PROMPT)
    with pytest.raises(InvalidArgument, match="tree_keep"):
        session.keep_chain(0)  # no tree step ran
    session.run_chains(np.array([[1, 2, 3, 4]]), np.array([10, 11, 10, 11]), 2, return_last=2)
    assert export_kv(session, PROMPT.shape[1]).positions == PROMPT.shape[1]  # below the tree: shared
    with pytest.raises(FailedPrecondition):
        export_kv(session)  # the tree's positions differ by chain until one is named
    with pytest.raises(InvalidArgument, match="tree_keep"):
        session.keep_chain(2)
    with pytest.raises(InvalidArgument, match="tree_chains"):
        session.run_chains(np.array([[1, 2, 3]]), np.array([10, 11, 12]), 2)


def _paged(runner_export) -> paged.PagedShard:
    return paged.PagedShard(runner_export, 0, "exact", cache_bytes=32 << 20)


def test_paged_tree_nodes_see_their_ancestors_only_and_the_kept_path_continues(runner, smollm2_export):
    shard = _paged(smollm2_export(1, "int4"))
    p = PROMPT.shape[1]
    other = np.array([1, 504, 3458, 282, 253, 7], dtype=np.int64)
    shard.open("s", 64)
    shard.open("o", 64)
    shard.step([paged.PagedRow("s", PROMPT[0], logits=1), paged.PagedRow("o", other[:-1], logits=1)])
    # pending 11, then nodes 12 (-> 13, 14) and 40 beside it: row parents (-1, 0, 1, 1, 0)
    tokens = np.array([11, 12, 13, 14, 40])
    parents = (-1, 0, 1, 1, 0)
    positions = p + np.array([0, 1, 2, 2, 1])
    tree, causal = shard.step(
        [
            paged.PagedRow("s", tokens, positions, logits=5, parents=parents),
            paged.PagedRow("o", other[-1:], logits=1),
        ]
    )
    for row, path in ((0, [11]), (1, [11, 12]), (2, [11, 12, 13]), (3, [11, 12, 14]), (4, [11, 40])):
        want = _alone(runner, np.array(path))[-1]
        assert np.abs(tree[row] - want).max() < TOL, f"row {row} ({path}) saw a token off its path"
        assert tree[row].argmax() == want.argmax()
    alone = runner.new_session()
    want = alone.run(other[None], return_last=1)[0, -1]
    assert np.abs(causal[0] - want).max() < TOL and causal[0].argmax() == want.argmax()
    # keep pending 11, node 12, node 14 (row tokens 0, 1, 3): the cache moves, the rest is dropped
    shard.move("s", p, (0, 1, 3))
    shard.rewind("s", p + 3)
    (got,) = shard.step([paged.PagedRow("s", np.array([77]), logits=1)])
    want = _alone(runner, np.array([11, 12, 14, 77]))[-1]
    assert np.abs(got[0] - want).max() < TOL and got[0].argmax() == want.argmax()


def test_paged_tree_rows_are_checked(smollm2_export):
    shard = _paged(smollm2_export(1, "int4"))
    shard.open("s", 64)
    with pytest.raises(InvalidArgument, match="parents"):
        shard.step([paged.PagedRow("s", np.array([1, 2, 3]), parents=(-1, 0))])
    assert shard.length("s") == 0
