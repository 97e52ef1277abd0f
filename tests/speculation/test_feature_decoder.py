"""The ``eagle-decoder`` feature draft: a decoder layer attending over the accepted positions.

Fast: the coordinator's numpy drafter (its cache of kept positions, drafted levels with a tree
mask) computes what the training module's teacher-forced passes compute; siblings in a tree do
not see each other; positions observed over several steps equal one step's; a gap in the
features starts the cache over; training raises the held-out chain it reports.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pipeshard.exporter.eagle_decoder import DecoderDraft, Sequences, chain_kept, train_decoder
from pipeshard.exporter.target_texts import FeatureTexts
from pipeshard.services.coordinator.speculation.feature import DecoderFeatureDrafter
from pipeshard.services.coordinator.speculation.tree import TreeShape
from pipeshard.shard import feature_draft
from pipeshard.shard.feature_decoder import FeatureDecoderModel

H, V, S, MLP = 128, 64, 24, 32  # two heads of 64


def random_decoder(folder: Path, seed: int = 0) -> DecoderDraft:
    torch.manual_seed(seed)
    embed = torch.randn(V, H).half().float()  # the file keeps fp16 rows
    draft = DecoderDraft(embed, torch.randn(S, H), torch.arange(0, V, V // S)[:S], 1e-5, MLP)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.3 * torch.randn_like(p))
    meta = feature_draft.FeatureDraftMeta("eagle-decoder", "sha256:test", H, V, MLP, 1e-5, heads=draft.heads)
    feature_draft.write(folder, meta, draft.arrays())
    return draft


def _sequence(n: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, H)).astype(np.float32), rng.integers(0, V, n)


def test_numpy_drafter_is_the_training_modules_passes(tmp_path):
    """Root at r (the cache holding positions 0..r) and two drafted levels fed the teacher's
    tokens: the training module's passes 0, 1, 2 at r, r + 1, r + 2."""
    draft = random_decoder(tmp_path)
    feats, tokens = _sequence(9)
    with torch.no_grad():
        passes = draft.passes(
            torch.as_tensor(feats)[None], torch.as_tensor(tokens)[None], torch.as_tensor([9]), 3
        )
    drafter = DecoderFeatureDrafter(FeatureDecoderModel(tmp_path))
    r = 5
    drafter.observe(feats[:3])  # two steps' kept positions, fed at the next proposal
    drafter.observe(feats[3 : r + 1])
    context = [0, *tokens[: r + 1]]  # the token at t + 1 pairs with the feature at t
    out, logits = drafter._root(context)
    np.testing.assert_allclose(logits[0], passes[0][1][0, r].numpy(), rtol=1e-4, atol=1e-4)
    out, logits, nodes = drafter._level([-1], out, tokens[[r + 1]])
    np.testing.assert_allclose(logits[0], passes[1][1][0, r + 1].numpy(), rtol=1e-4, atol=1e-4)
    out, logits, _ = drafter._level(nodes, out, tokens[[r + 2]])
    np.testing.assert_allclose(logits[0], passes[2][1][0, r + 2].numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(out[0], passes[2][0][0, r + 2].numpy(), rtol=1e-4, atol=1e-4)


def test_tree_siblings_do_not_see_each_other(tmp_path):
    random_decoder(tmp_path)
    feats, tokens = _sequence(4)
    model = FeatureDecoderModel(tmp_path)

    def level_two(drafter: DecoderFeatureDrafter, first: list[int], second: int) -> np.ndarray:
        drafter.observe(feats)
        out, _ = drafter._root([0, *tokens])
        out1, _, nodes = drafter._level([-1] * len(first), np.repeat(out, len(first), 0), np.asarray(first))
        last = first.index(second)
        _, logits, _ = drafter._level([nodes[last]], out1[[last]], np.asarray([7]))
        return logits[0]

    alone = level_two(DecoderFeatureDrafter(model), [5], 5)
    beside = level_two(DecoderFeatureDrafter(model), [3, 5, 9], 5)
    np.testing.assert_allclose(beside, alone, rtol=1e-4, atol=1e-4)


def test_decoder_drafter_chains_trees_and_gaps(tmp_path):
    random_decoder(tmp_path)
    model = FeatureDecoderModel(tmp_path)
    drafter = DecoderFeatureDrafter(model)
    assert drafter.propose([1, 2], 4, None).tokens == []  # nothing observed yet
    feats, tokens = _sequence(6)
    drafter.observe(feats[:2])
    chain = drafter.propose([0, *tokens[:2]], 4, None)
    assert len(chain.tokens) == 4 and all(0 <= t < V for t in chain.tokens)
    tree = drafter.propose_tree([0, *tokens[:2]], TreeShape(3, 4))
    assert len(tree.nodes) == 12 and tree.nodes[tree.main[0]].token == chain.tokens[0]
    # Observed one by one or together, the same positions give the same drafts.
    one_by_one = DecoderFeatureDrafter(model)
    for i in range(4):
        one_by_one.observe(feats[i : i + 1])
        one_by_one.propose([0, *tokens[: i + 1]], 2, None)
    together = DecoderFeatureDrafter(model)
    together.observe(feats[:4])
    context = [0, *tokens[:4]]
    assert one_by_one.propose(context, 5, None).tokens == together.propose(context, 5, None).tokens
    # A step without features: idle, and the cache starts over from the next ones.
    together.observe(None)
    assert together.propose(context, 4, None).tokens == []
    together.observe(feats[4:5])
    fresh = DecoderFeatureDrafter(model)
    fresh.observe(feats[4:5])
    context = [*context, int(tokens[4])]
    assert together.propose(context, 4, None).tokens == fresh.propose(context, 4, None).tokens


def test_decoder_chain_continued_over_its_own_guesses_is_its_longer_chain(tmp_path):
    """Traversals in flight: over guesses the target has not answered, the drafted nodes attend
    to the cache of answered positions and to the guesses as their ancestors, so continuing from
    the draft's own proposal gives what one longer proposal gives."""
    random_decoder(tmp_path)
    model = FeatureDecoderModel(tmp_path)
    drafter = DecoderFeatureDrafter(model)
    feats, tokens = _sequence(3)
    drafter.observe(feats)
    context = [0, *tokens]
    chain = drafter.propose(context, 8, None).tokens
    for n in range(1, 5):
        assert drafter.propose(context + chain[:n], 3, None, guessed=n).tokens == chain[n : n + 3]
    # The answered positions stay the cache's: a continuation does not add the guesses to it.
    assert drafter.propose(context, 8, None).tokens == chain


@pytest.fixture
def one_thread():
    """Small torch steps on a loaded 2-core machine: two threads' barriers cost more than they give."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.timeout(300)
def test_training_raises_the_held_out_chain(one_thread):
    """Texts whose next feature and token follow from the last two positions: only attention can
    read the one before the last; training lifts the chain the distil reports."""
    rng = np.random.default_rng(0)
    table = rng.standard_normal((V, H)).astype(np.float32)
    ids, features, argmax = [], [], []
    for _ in range(16):
        seq = list(rng.integers(0, V, 3))
        while len(seq) < 16:
            seq.append((seq[-1] * 7 + seq[-3] * 3) % V)
        seq_a = np.asarray(seq)
        ids.append(seq_a)
        features.append(table[seq_a].astype(np.float16))
        argmax.append(np.append(seq_a[1:], 0))
    data = FeatureTexts(ids, features, argmax)
    torch.manual_seed(0)
    draft = DecoderDraft(torch.as_tensor(table), torch.as_tensor(table[:S]), torch.arange(S), 1e-5, MLP)
    before = chain_kept(draft, Sequences(data), 3)
    train_decoder(draft, data, epochs=40, lr=1e-2, batch=8, seed=0, report=lambda *a: None)
    after = chain_kept(draft, Sequences(data), 3)
    assert after[1] > before[1] + 0.5, (before, after)


def test_soft_targets_reach_every_pass_where_the_texts_hold_them(tmp_path):
    """With soft targets the decoder's batches carry the target's top-k at t + 1 (padded like the
    rest) and its loss mixes them in; without them (or at weight 0) the loss is the argmax's."""
    from pipeshard.exporter.eagle_decoder import loss

    draft = random_decoder(tmp_path)
    rng = np.random.default_rng(2)
    lengths = (7, 5)
    ids = [rng.integers(0, V, n) for n in lengths]
    data = FeatureTexts(
        ids,
        [rng.standard_normal((n, H)).astype(np.float16) for n in lengths],
        [np.append(i[1:], 0) for i in ids],  # all answer
        soft_ids=[rng.integers(0, V, (n, 3)).astype(np.int32) for n in lengths],
        soft_probs=[rng.random((n, 3)).astype(np.float16) for n in lengths],
    )
    soft = Sequences(data, soft=True)
    batch = soft.batch(draft, np.arange(2))
    top_ids, top_probs = batch[-1]
    assert top_ids.shape == (2, 6, 3) and top_probs.shape == (2, 6, 3)
    assert top_ids[1, :4].tolist() == data.soft_ids[1][1:].tolist()  # t + 1's, from the answer's start
    assert not top_probs[1, 4:].any()  # padding
    plain = Sequences(data).batch(draft, np.arange(2))
    assert plain[-1] is None
    with torch.no_grad():
        hard = loss(draft, plain, 1.0)
        assert torch.allclose(loss(draft, batch, 1.0, 0.0), hard)
        mixed = loss(draft, batch, 1.0, 0.5)
    assert torch.isfinite(mixed) and not torch.allclose(mixed, hard)
