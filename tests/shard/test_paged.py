"""The paged backend (pipeshard/shard/paged.py) on INT4 2-stage SmolLM2 shards in exact mode: rows of
many sequences in one inference give each sequence the tokens of its stateful solo run, whoever
joins or leaves; rewind, admission and bad rows."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pipeshard.errors import InvalidArgument, NotFound, ResourceExhausted
from pipeshard.shard.chain import LocalChain
from pipeshard.shard.paged import PagedRow, PagedShard

pytestmark = pytest.mark.slow

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def export(smollm2_export):
    return smollm2_export(2, "int4")


@pytest.fixture(scope="module")
def paged(export):
    return [PagedShard(export, s, "exact", 1, cache_bytes=64 << 20) for s in (0, 1)]


@pytest.fixture(scope="module")
def solo(export, chat_prompt_ids):
    """Greedy NEW_TOKENS of every prompt on the stateful backend, one at a time."""
    chain = LocalChain(export, "exact", 1)
    return [chain.generate_greedy(ids, NEW_TOKENS, ignore_eos=True).token_ids for ids in chat_prompt_ids]


def _step(paged, feeds: dict) -> dict:
    """One inference per stage for ``feeds`` (seq -> token ids); returns seq -> last-row logits."""
    seqs = list(feeds)
    hidden = paged[0].step([PagedRow(s, np.array(feeds[s])) for s in seqs])
    logits = paged[1].step([PagedRow(s, h, logits=1) for s, h in zip(seqs, hidden, strict=True)])
    return {s: lg[-1] for s, lg in zip(seqs, logits, strict=True)}


def test_sequences_joining_and_leaving_match_their_solo_runs(paged, chat_prompt_ids, solo):
    # Prompt i joins at step 3 * i; prompts end after NEW_TOKENS, freeing blocks that later ones reuse.
    arrivals = {i: 3 * i for i in range(len(chat_prompt_ids))}
    pending: dict[int, list[int]] = {}
    out: dict[int, list[int]] = {}
    step = 0
    while len(out) < len(chat_prompt_ids) or pending:
        for i, at in arrivals.items():
            if at == step:
                for p in paged:
                    p.open(i, len(chat_prompt_ids[i]) + NEW_TOKENS)
                pending[i] = list(chat_prompt_ids[i])
                out[i] = []
        if pending:
            for i, logits in _step(paged, pending).items():
                out[i].append(int(logits.argmax()))
                pending[i] = [out[i][-1]]
                if len(out[i]) == NEW_TOKENS:
                    del pending[i]
                    assert all(p.free(i) for p in paged)
        step += 1
    assert [out[i] for i in range(len(chat_prompt_ids))] == solo
    assert all(p.usage().blocks_used == 0 for p in paged)


def test_rewind_recomputes_the_same_logits(paged, chat_prompt_ids):
    ids = chat_prompt_ids[0]
    for p in paged:
        p.open("r", len(ids) + 8)
    try:
        first = _step(paged, {"r": ids})["r"]
        tokens = [int(first.argmax())]
        logits = []
        for _ in range(4):
            logits.append(_step(paged, {"r": tokens[-1:]})["r"])
            tokens.append(int(logits[-1].argmax()))
        for p in paged:
            p.rewind("r", len(ids) + 2)  # drop the last two tokens fed
        again = [_step(paged, {"r": [t]})["r"] for t in tokens[2:4]]
        np.testing.assert_array_equal(np.stack(again), np.stack(logits[2:4]))
        assert paged[0].length("r") == len(ids) + 4
        with pytest.raises(InvalidArgument, match="`length`"):
            paged[0].rewind("r", len(ids) + 5)
    finally:
        for p in paged:
            p.free("r")


def test_a_long_prefill_asks_the_head_for_one_row(paged):
    for p in paged:
        p.open("long", 1025)
    try:
        hidden = paged[0].step([PagedRow("long", np.full(1024, 42, dtype=np.int64))])
        assert hidden[0].shape == (1024, 576)
        logits = paged[1].step([PagedRow("long", hidden[0], logits=1)])
        assert logits[0].shape == (1, 49152)
        assert paged[1].step([PagedRow("long", np.zeros((1, 576), np.float32), logits=0)])[0].shape == (
            0,
            49152,
        )
    finally:
        for p in paged:
            p.free("long")


def test_admission_refuses_what_the_budget_cannot_hold(export):
    stage = PagedShard(export, 0, "exact", 1, cache_bytes=3 * 737280)
    usage = stage.usage()
    assert (usage.blocks_total, usage.block_tokens, usage.budget_bytes) == (3, 32, 3 * 737280)
    stage.open("a", 64)
    with pytest.raises(ResourceExhausted, match="KV cache budget of 2211840 bytes"):
        stage.open("b", 64)
    assert stage.usage().blocks_used == 2 and stage.usage().bytes_used == 2 * 737280
    stage.open("b", 32)
    with pytest.raises(ResourceExhausted, match="beyond its reservation of 32"):
        stage.step([PagedRow("b", np.zeros(33, dtype=np.int64))])
    stage.free("a")
    stage.open("c", 40)
    assert stage.usage().blocks_free == 0
    with pytest.raises(InvalidArgument, match="`cache_bytes`"):
        PagedShard(export, 0, "exact", 1, cache_bytes=1000)


def test_bad_rows_fail_the_step_and_change_nothing(paged):
    first, last = paged
    first.open("x", 64)
    first.open("y", 64)
    try:
        first.step([PagedRow("x", np.array([1, 2, 3]))])
        cases = [
            ([PagedRow("x", np.array([1.5]))], InvalidArgument, "`input_ids`"),
            ([PagedRow("x", np.array([[1, 2]]))], InvalidArgument, "`input_ids`"),
            ([PagedRow("x", np.array([4])), PagedRow("x", np.array([5]))], InvalidArgument, "appears twice"),
            ([PagedRow("y", np.array([4])), PagedRow("nobody", np.array([5]))], NotFound, "nobody"),
            ([PagedRow("x", np.array([4, 5]), positions=np.array([3]))], InvalidArgument, "`position_ids`"),
            ([PagedRow("x", np.array([4]), positions=np.array([-1]))], InvalidArgument, "`position_ids`"),
            ([PagedRow("x", np.array([4]), logits=1)], InvalidArgument, "`logits`"),
            ([], InvalidArgument, "`rows`"),
        ]
        for rows, error, message in cases:
            with pytest.raises(error, match=message):
                first.step(rows)
        assert (first.length("x"), first.length("y")) == (3, 0)
        last.open("z", 8)
        try:
            with pytest.raises(InvalidArgument, match="`hidden_states`"):
                last.step([PagedRow("z", np.zeros((1, 575), np.float32), logits=1)])
            with pytest.raises(InvalidArgument, match="`logits`"):
                last.step([PagedRow("z", np.zeros((1, 576), np.float32), logits=2)])
            assert last.length("z") == 0
        finally:
            last.free("z")
        with pytest.raises(NotFound):
            first.length("nobody")
        assert first.free("nobody") is False
    finally:
        first.free("x")
        first.free("y")


def test_fast_precision_blocks_hold_32_tokens_with_a_u8_cache(export):
    # The u8 key cache keeps its scales as extra rows ([blocks, 3, 40, 64]); blocks still hold 32
    # tokens, and a sequence longer than one block decodes like its prefill predicted.
    stage = PagedShard(export, 0, "fast", cache_bytes=8 << 20)
    assert stage.block_tokens == 32
    assert stage.block_bytes == 15 * (3 * 40 * 64 + 3 * 32 * 72)
    stage.open("a", 100)
    stage.open("b", 100)
    hidden = stage.step([PagedRow("a", np.arange(70)), PagedRow("b", np.arange(5, 75))])
    assert [h.shape for h in hidden] == [(70, 576), (70, 576)]
    assert np.isfinite(hidden[0]).all() and np.isfinite(hidden[1]).all()
    assert stage.usage().blocks_used == 8


def test_exported_kv_restores_into_another_sequence(paged, chat_prompt_ids):
    ids = chat_prompt_ids[2]
    for p in paged:
        p.open("src", len(ids) + 4)
        p.open("dst", len(ids) + 4)
    try:
        token = int(_step(paged, {"src": ids})["src"].argmax())
        blobs = [p.export_kv("src") for p in paged]
        assert len(blobs[0]) == 30 and blobs[0][0].shape == (3, len(ids), 64)
        assert paged[0].kv_source.blocks is None  # f32 pools: the backend-neutral f32 layout
        for p, blob in zip(paged, blobs, strict=True):
            p.import_kv("dst", blob, len(ids))
        after = _step(paged, {"src": [token], "dst": [token]})
        np.testing.assert_array_equal(after["dst"], after["src"])
        with pytest.raises(InvalidArgument, match="`arrays`"):
            paged[0].import_kv("dst", blobs[0][:3], len(ids))
        # A prefix (the prefix cache's keep) reads only its blocks and equals the whole cut short.
        n = len(ids) - 5
        head = paged[1].export_kv("src", n)
        np.testing.assert_array_equal(head[15], blobs[1][15][:, :n])
        with pytest.raises(InvalidArgument) as err:
            paged[1].export_kv("src", len(ids) + 2)
        assert err.value.field == "positions"
        # Parts from block boundaries (a standby copy's) read only their blocks and chain into the whole.
        bt = paged[1].block_tokens
        part = paged[1].export_kv("src", len(ids), bt)
        np.testing.assert_array_equal(part[15], blobs[1][15][:, bt:])
        with pytest.raises(InvalidArgument) as err:
            paged[1].export_kv("src", len(ids), bt - 1)
        assert err.value.field == "from_position"
    finally:
        for p in paged:
            p.free("src")
            p.free("dst")


def _teacher_forced(stages, seq: str, feed: list[int], forced: list[int]) -> np.ndarray:
    """Last-row logits after ``feed`` and after each forced token, one sequence per step."""
    out = [_step(stages, {seq: feed})[seq]]
    out += [_step(stages, {seq: [t]})[seq] for t in forced]
    return np.array(out)


def test_fast_precision_kv_is_captured_verbatim(export, chat_prompt_ids):
    """`fast` precision's u8 pools are captured as their blocks, scale rows included, so a
    restored sequence continues bit for bit as the one it was captured from (and through the
    snapshot's proto). Restoring a prefix that ends inside a block stays within `fast`'s
    chunking noise of a fresh run; restoring another prompt's KV does not."""
    from pipeshard.errors import FailedPrecondition
    from pipeshard.shard.kvblob import KvBlob, from_proto, to_proto

    stages = [PagedShard(export, s, "fast", cache_bytes=32 << 20) for s in (0, 1)]
    layout = stages[0].kv_source.blocks
    assert layout is not None and layout.dtype == "uint8" and layout.shapes[:2] == ((3, 40, 64), (3, 32, 72))
    prompt, other = chat_prompt_ids[0] * 3, chat_prompt_ids[1] * 3
    assert len(prompt) % 32, "the prompt must end inside a block"
    suffix = chat_prompt_ids[2][-12:]
    for p in stages:
        for seq in ("src", "dst", "fresh", "part", "wrong"):
            p.open(seq, 320)
    _step(stages, {"src": prompt})
    _step(stages, {"wrong": other})
    for p in stages:
        blob = KvBlob.build(p.kv_source, p.export_kv("src"), positions=len(prompt))
        assert blob.arrays[0].shape == (layout.blocks_for(len(prompt)), 3, 40, 64)
        back = from_proto(to_proto(blob))
        back.check_for(p.kv_source)
        p.import_kv("dst", back.arrays, back.positions)
        with pytest.raises(FailedPrecondition, match="float32 positions"):
            back.check_for(dataclasses.replace(p.kv_source, blocks=None))
        damaged = [a.copy() for a in back.arrays]
        damaged[3][0, 0, 0, 0] ^= 1
        with pytest.raises(InvalidArgument, match="corrupt"):
            dataclasses.replace(back, arrays=tuple(damaged)).check_for(p.kv_source)
    forced = [int(t) for t in _teacher_forced(stages, "fresh", prompt + suffix, []).argmax(-1)]
    want = _teacher_forced(stages, "src", suffix, forced[:8])
    np.testing.assert_array_equal(_teacher_forced(stages, "dst", suffix, forced[:8]), want)

    # A prefix ending mid-block of a longer kept sequence: its last block's scales also cover the
    # rows after it. Compared with a fresh sequence fed the same chunks (the same kernels).
    cut = len(prompt) - 7
    for p in stages:
        p.import_kv("part", p.export_kv("src", cut), cut)
        p.rewind("fresh", 0)
        p.import_kv("wrong", p.export_kv("wrong", cut), cut)
    _step(stages, {"fresh": prompt[:cut]})
    tail = prompt[cut:] + suffix
    fresh = _teacher_forced(stages, "fresh", tail, forced[:8])
    part = _teacher_forced(stages, "part", tail, forced[:8])
    wrong = _teacher_forced(stages, "wrong", tail, forced[:8])
    noise, off = np.abs(part - fresh).max(), np.abs(wrong - fresh).max()
    assert noise < 1.5 and noise < off / 4, (noise, off)
    assert (part.argmax(-1) == fresh.argmax(-1)).mean() >= 0.75
