"""Draft trees on the shards: what each KV backend can run.

Stateful (``ShardSession.run_chains``): a tree's chains run as batch rows gathered by
``beam_idx``; each row equals its chain run alone, and the kept chain continues exactly.

Paged: OpenVINO's PagedAttention op has query-to-query mask inputs (QQ_BIAS, QQ_BIAS_BEGINS, the
op's inputs 26 and 27) that ``paged_attention_transformation`` leaves as empty constants; made
parameters, the CPU plugin honours them as an ancestor mask among a step's new tokens. This is
the evidence docs/ARCHITECTURE.md's "Draft trees" cites for a paged tree path (not wired up yet):
if OpenVINO drops or changes those inputs, it fails."""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset13 as ops
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


_PREPARE = paged._prepare_model


def _with_query_mask(model: ov.Model, is_first: bool, is_last: bool) -> ov.Model:
    """The paged graph with each PagedAttention's QQ_BIAS (26) and QQ_BIAS_BEGINS (27) as inputs."""
    model = _PREPARE(model, is_first, is_last)
    bias = ops.parameter([-1], ov.Type.u8, name="qq_bias")
    begins = ops.parameter([-1], ov.Type.i32, name="qq_bias_begins")
    for p in (bias, begins):
        p.get_output_tensor(0).set_names({p.get_friendly_name()})
    attention = [n for n in model.get_ordered_ops() if n.get_type_name() == "PagedAttentionExtension"]
    assert attention and all(n.get_input_size() == 28 for n in attention)
    for node in attention:
        node.input(26).replace_source_output(bias.output(0))
        node.input(27).replace_source_output(begins.output(0))
    model.add_parameters([bias, begins])
    model.validate_nodes_and_infer_types()
    return model


def test_paged_attention_takes_an_ancestor_mask_among_new_tokens(runner, smollm2_export, monkeypatch):
    monkeypatch.setattr(paged, "_prepare_model", _with_query_mask)
    shard = paged.PagedShard(smollm2_export(1, "int4"), 0, "exact", cache_bytes=32 << 20)
    p = PROMPT.shape[1]
    # root 11 -> {12 -> 13, 40} flattened as [11, 12, 40, 13]: 40 must not see 12, 13 must not see 40
    tokens = np.array([11, 12, 40, 13])
    positions = np.array([p, p + 1, p + 1, p + 2])
    ancestors = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=np.uint8)
    shard.open("s", 64)
    blocks = shard._seqs["s"].blocks
    req = shard._req

    def run(ids, pos, past, bias, begins, logits):
        t = len(ids)
        n = shard.blocks_for(past + t)
        feed = {
            "input_ids": ids.astype(np.int64),
            "position_ids": pos.astype(np.int64),
            "past_lens": np.array([past], np.int32),
            "subsequence_begins": np.array([0, t], np.int32),
            "block_indices": blocks[:n],
            "block_indices_begins": np.array([0, n], np.int32),
            paged.LOGITS_INDICES: np.arange(t - logits, t, dtype=np.int64),
            "qq_bias": bias,
            "qq_bias_begins": begins,
        }
        for name, value in feed.items():
            req.set_tensor(name, ov.Tensor(np.ascontiguousarray(value)))
        req.set_tensor("max_context_len", ov.Tensor(np.array(past + t, np.int32)))
        req.infer()
        return req.get_output_tensor(0).data.reshape(-1, shard.vocab_size).copy()

    run(PROMPT[0], np.arange(p), 0, np.zeros(0, np.uint8), np.zeros(0, np.int32), 1)
    out = run(tokens, positions, p, ancestors.reshape(-1), np.array([0, 16], np.int32), 4)
    for row, path in ((1, [11, 12]), (2, [11, 40]), (3, [11, 12, 13])):
        want = _alone(runner, np.array(path))[-1]
        assert np.abs(out[row] - want).max() < TOL, f"row {row} ({path}) saw a node off its path"
