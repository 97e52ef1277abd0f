"""The texts every feature-reading draft trains on (exporter/target_texts.py).

Fast: the question sampler is seeded and keeps to the top k; a text's answer starts where the
target stops choosing the next token (or where it was recorded, for a sampled text); the soft
targets are the softmax's top k; texts of every kind keep their fields through a split, a join
and the file; the head slice keeps the tokens the target's texts use most.
Slow (the real INT4 export): the target's own questions are distinct, start with an opener, and
none is a benchmark or test prompt.
"""

from __future__ import annotations

import numpy as np
import pytest

from pipeshard.exporter.draft import plan_draft
from pipeshard.exporter.target_texts import (
    OPENERS,
    TEXT_KINDS,
    FeatureTexts,
    join,
    load_texts,
    own_questions,
    sampler,
    save_texts,
    soft_targets,
    token_counts,
)
from tests.speculation.conftest import SPEC_PROMPTS


def test_sampler_is_seeded_and_keeps_to_the_top_k():
    logits = np.zeros(1000, dtype=np.float32)
    top = [7, 300, 999]
    logits[top] = [9.0, 8.5, 8.0]
    first = sampler(3, temperature=1.0, top_k=3)(logits)
    again = sampler(3, temperature=1.0, top_k=3)
    draws = [again(logits) for _ in range(300)]
    assert set(draws) <= set(top) and len(set(draws)) == 3  # each of the three, nothing else
    assert first == draws[0]  # the same seed draws the same first token
    cold = sampler(0, temperature=0.01, top_k=3)
    assert {cold(logits) for _ in range(50)} == {7}  # near zero temperature: the argmax


def test_answer_starts_where_the_target_stops_choosing_the_next_token():
    # prompt 5, 6, 7 (the target would have said 9 after 5 and after 6), then its answer 1, 2, 3
    ids = np.array([5, 6, 7, 1, 2, 3])
    top = np.array([9, 9, 1, 2, 3, 4])
    answer = np.array([1, 2, 3])
    data = FeatureTexts([ids, answer], [np.zeros((6, 2)), np.zeros((3, 2))], [top, np.array([2, 3, 0])])
    assert data.answer_start(0) == 2  # the prompt's last position: its argmax is the answer's first token
    assert data.answer_start(1) == 0  # every next token was the target's: all answer


def test_a_sampled_texts_answer_starts_where_it_was_recorded():
    # the sampled answer 1, 8, 3: the target would have said 2 after 1, so inferring would cut there
    ids = np.array([5, 6, 7, 1, 8, 3])
    top = np.array([9, 9, 1, 2, 3, 4])
    assert FeatureTexts([ids], [np.zeros((6, 2))], [top]).answer_start(0) == 4
    assert FeatureTexts([ids], [np.zeros((6, 2))], [top], starts=[2]).answer_start(0) == 2


def test_soft_targets_are_the_softmaxs_top_k_most_likely_first():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((5, 300)).astype(np.float32) * 3
    ids, probs = soft_targets(logits, k=4)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    assert ids.tolist() == np.argsort(-p, -1)[:, :4].tolist()
    assert np.allclose(probs.astype(np.float32), np.take_along_axis(p, ids, -1), atol=1e-3)
    assert ids.dtype == np.int32 and probs.dtype == np.float16


def _texts(kinds: list[int]) -> FeatureTexts:
    rng = np.random.default_rng(len(kinds))
    n = [3 + i for i in range(len(kinds))]
    return FeatureTexts(
        [rng.integers(0, 50, k) for k in n],
        [rng.standard_normal((k, 2)).astype(np.float16) for k in n],
        [rng.integers(0, 50, k) for k in n],
        starts=list(range(len(kinds))),
        soft_ids=[rng.integers(0, 50, (k, 3)).astype(np.int32) for k in n],
        soft_probs=[rng.random((k, 3)).astype(np.float16) for k in n],
        kinds=kinds,
    )


def _same(a: FeatureTexts, b: FeatureTexts) -> bool:
    def flat(x):
        return [v.tolist() if isinstance(v, np.ndarray) else v for v in x]

    return all(flat(getattr(a, k)) == flat(getattr(b, k)) for k in FeatureTexts.PER_TEXT)


def test_texts_of_every_kind_keep_their_fields_through_split_join_and_file(tmp_path):
    data = _texts([0, 1, 2, 3, 0, 3])
    held, train = data.split(0.34, seed=1)
    assert len(held.ids) == 2 and len(train.ids) == 4
    back = join([held, train])
    order = [int(np.flatnonzero([len(x) == len(i) for x in data.ids])[0]) for i in back.ids]
    assert _same(back, data.pick(order))  # every per-text field moved with its text
    assert [TEXT_KINDS[k] for k in data.of_kind("chat").kinds] == ["chat"]
    assert len(data.of_kind("question").ids) == 2
    save_texts(tmp_path / "t.npz", "k", data)
    again = load_texts(tmp_path / "t.npz", "k")
    assert again is not None and _same(again, data)
    # A file of greedy answers only (no kinds recorded) is all greedy.
    plain = FeatureTexts(data.ids, data.features, data.argmax)
    assert len(plain.of_kind("greedy").ids) == 6 and not plain.of_kind("sampled").ids


def test_head_slice_keeps_the_tokens_the_target_says_most(smollm2_dir):
    plain = plan_draft(smollm2_dir, 1, 1024)
    rare = [i for i in range(40000, 49000, 97) if i not in plain.vocab_ids][:20]
    data = FeatureTexts([np.array(rare)], [np.zeros((len(rare), 2))], [np.array(rare)])
    counted = plan_draft(smollm2_dir, 1, 1024, counts=token_counts(data, 49152))
    assert set(rare) <= set(counted.vocab_ids)  # the texts' tokens first, whatever their merge rank
    assert len(counted.vocab_ids) == 1024  # in place of as many merge-ranked ones
    assert len(set(counted.vocab_ids) & set(plain.vocab_ids)) == 1024 - len(rare)


@pytest.mark.slow
def test_own_questions_are_distinct_open_with_an_opener_and_are_no_benchmark_prompt(smollm2_export):
    from bench.spec import KINDS

    questions = own_questions(smollm2_export(1, "int4"), 12, 0, lambda *a: None, batch=12)
    assert len(questions) == len(set(questions)) == 12
    assert all(q and any(q.startswith(o) for o in OPENERS) for q in questions)
    held = {text for _, text in KINDS} | {m[-1][1] for _, m in SPEC_PROMPTS}
    assert not held & set(questions)
