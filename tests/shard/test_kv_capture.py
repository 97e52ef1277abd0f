"""export_kv / import_kv: a session's KV captured as a blob and restored into a fresh session."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pipeshard.errors import FailedPrecondition, InvalidArgument
from pipeshard.shard.kvblob import KvBlob, from_proto, to_proto
from pipeshard.shard.runtime import ShardRunner, export_kv, import_kv


def _chain_step(sessions, ids: list[int], return_last: int = 1) -> np.ndarray:
    x = np.asarray([ids], dtype=np.int64)
    for s in sessions[:-1]:
        x = s.run(x)
    return sessions[-1].run(x, return_last=return_last)


def _greedy(sessions, token: int, n: int) -> list[int]:
    out = []
    for _ in range(n):
        token = int(np.argmax(_chain_step(sessions, [token])[0, -1]))
        out.append(token)
    return out


@pytest.fixture(scope="module")
def int4_runners(smollm2_export):
    export = smollm2_export(2, "int4")
    return [ShardRunner(export, i, precision="exact") for i in range(2)]


def test_blob_refusals(tiny_export):
    runner = ShardRunner(tiny_export("llama", 2), 0, "f32")
    session = runner.new_session()
    session.run(np.arange(10, 20)[None])
    session.invalidate(3, 5)
    blob = export_kv(session, token_ids=tuple(range(8)))
    assert blob.positions == 8 and blob.arrays[0].shape[1] == 8
    assert blob.source.names == tuple(runner.state_variables)
    # The proto round trip keeps everything, checksum included.
    back = from_proto(to_proto(blob))
    back.check_for(runner.kv_source)
    assert back.checksum == blob.checksum and back.token_ids == blob.token_ids

    fresh = runner.new_session()
    other_model = dataclasses.replace(blob.source, model_fingerprint="sha256:other")
    with pytest.raises(FailedPrecondition, match="model"):
        import_kv(fresh, KvBlob.build(other_model, list(blob.arrays)))
    other_layers = dataclasses.replace(blob.source, layer_start=1, layer_end=2)
    with pytest.raises(FailedPrecondition, match="layers"):
        import_kv(fresh, KvBlob.build(other_layers, list(blob.arrays)))
    damaged = [a.copy() for a in blob.arrays]
    damaged[1][0, 0, 0] += 1.0
    with pytest.raises(InvalidArgument, match="corrupt") as err:
        import_kv(fresh, dataclasses.replace(blob, arrays=tuple(damaged)))
    assert err.value.field == "snapshot.checksum"
    short = [a[:1] for a in blob.arrays]  # one KV head instead of the model's
    with pytest.raises(InvalidArgument, match="must be float32"):
        import_kv(fresh, KvBlob.build(blob.source, short))
    with pytest.raises(InvalidArgument) as err:
        export_kv(session, positions=9)
    assert err.value.field == "positions"
    assert fresh.past_length == 0  # every refusal left the session untouched
    busy = runner.new_session()
    busy.run(np.array([[1, 2]]))
    with pytest.raises(FailedPrecondition, match="empty session"):
        import_kv(busy, blob)


def test_restore_continues_like_the_original(tiny_export):
    """Tiny llama: a restored session's next logits equal the original's (f32, exactly the same state)."""
    runner = ShardRunner(tiny_export("llama", 1), 0, "f32")
    original = runner.new_session()
    original.run(np.arange(10, 22)[None])
    restored = runner.new_session()
    import_kv(restored, export_kv(original))
    assert (restored.past_length, restored.valid_length) == (12, 12)
    np.testing.assert_array_equal(restored.run(np.array([[5, 6]])), original.run(np.array([[5, 6]])))


def test_parts_join_into_the_whole_capture(tiny_export):
    """Parts captured from positions on (a standby copy's, kv_standby.py) join into exactly the
    whole capture, through the proto, checksum and all; parts that do not chain, or a part alone
    restored, are refused."""
    from pipeshard.shard.kvblob import join_parts

    runner = ShardRunner(tiny_export("llama", 1), 0, "f32")
    session = runner.new_session()
    session.run(np.arange(10, 22)[None])
    session.invalidate(4, 6)  # a rejected draft's hole: parts count mask-valid positions
    ids = tuple(range(100, 110))
    whole = export_kv(session, token_ids=ids)
    parts = [
        from_proto(to_proto(export_kv(session, positions=end, token_ids=ids[start:end], start=start)))
        for start, end in ((0, 3), (3, 7), (7, 10))
    ]
    assert [p.start for p in parts] == [0, 3, 7] and parts[1].token_ids == ids[3:7]
    joined = join_parts(parts)
    assert joined.start == 0 and joined.token_ids == ids and joined.checksum == whole.checksum
    for a, b in zip(joined.arrays, whole.arrays, strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(InvalidArgument, match="starts at position 3, not 0"):
        join_parts(parts[1:])
    with pytest.raises(InvalidArgument, match="starts at position 7, not 3"):
        join_parts([parts[0], parts[2]])
    with pytest.raises(InvalidArgument) as err:
        export_kv(session, positions=5, start=5)
    assert err.value.field == "from_position"
    # A part's checksum covers where it starts: moved, it no longer verifies.
    with pytest.raises(InvalidArgument, match="corrupt"):
        dataclasses.replace(parts[1], start=0).check_for(runner.kv_source)


@pytest.mark.slow
def test_capture_restore_int4_exact_identical_tokens(int4_runners, chat_prompt_ids):
    """INT4 2-stage at exact: capture mid-decode on both stages, restore into fresh sessions,
    continue: the same 48 tokens as the uninterrupted session."""
    prompt = chat_prompt_ids[1]
    original = [r.new_session() for r in int4_runners]
    first = int(np.argmax(_chain_step(original, prompt)[0, -1]))
    head = _greedy(original, first, 16)
    blobs = [export_kv(s) for s in original]
    want = _greedy(original, head[-1], 48)
    restored = [r.new_session() for r in int4_runners]
    for s, blob in zip(restored, blobs, strict=True):
        import_kv(s, from_proto(to_proto(blob)))
    assert _greedy(restored, head[-1], 48) == want


@pytest.mark.slow
def test_capture_after_speculative_rewind_drops_holes(int4_runners, chat_prompt_ids):
    """A rewound draft leaves a masked hole; the blob keeps only valid positions and the restored
    session decodes exactly what the holey original decodes."""
    prompt = chat_prompt_ids[2]
    original = [r.new_session() for r in int4_runners]
    first = int(np.argmax(_chain_step(original, prompt)[0, -1]))
    n = len(prompt)
    # A verify step of 1 real + 4 junk drafts, all rejected: masked out on every stage.
    _chain_step(original, [first, 504, 3575, 282, 4649], return_last=5)
    for s in original:
        s.invalidate(n + 1, n + 5)
    assert original[0].valid_length == n + 1 and original[0].past_length == n + 5
    blobs = [export_kv(s) for s in original]
    assert all(b.positions == n + 1 for b in blobs)
    # The target's own token after `first`, from the verify row of `first`: rerun cleanly.
    clean = [r.new_session() for r in int4_runners]
    _chain_step(clean, prompt)
    token = int(np.argmax(_chain_step(clean, [first])[0, -1]))
    want = _greedy(original, token, 40)
    restored = [r.new_session() for r in int4_runners]
    for s, blob in zip(restored, blobs, strict=True):
        import_kv(s, blob)
    assert _greedy(restored, token, 40) == want == _greedy(clean, token, 40)


def test_a_stage_joins_the_parts_it_is_sent(tiny_export):
    """A restore streamed as parts (a standby copy's, RestoreKvStreamRequest.next_part): the stage
    verifies each part's checksum and joins them into exactly the whole capture; a damaged part, a
    gap or a lone later part is refused."""
    from pipeshard.services.stage.kv import StageKv

    runner = ShardRunner(tiny_export("llama", 1), 0, "f32")
    session = runner.new_session()
    session.run(np.arange(10, 22)[None])
    ids = tuple(range(100, 112))
    whole = export_kv(session, token_ids=ids)
    parts = [
        from_proto(to_proto(export_kv(session, positions=end, token_ids=ids[start:end], start=start)))
        for start, end in ((0, 4), (4, 8), (8, 12))
    ]
    kv = StageKv(None, runner.kv_source, None)
    joined = kv.check_parts(parts)
    assert joined.positions == 12 and joined.token_ids == ids
    for a, b in zip(joined.arrays, whole.arrays, strict=True):
        np.testing.assert_array_equal(a, b)
    damaged = dataclasses.replace(parts[1], arrays=(parts[1].arrays[0] + 1, *parts[1].arrays[1:]))
    with pytest.raises(InvalidArgument, match="corrupt"):
        kv.check_parts([parts[0], damaged, parts[2]])
    with pytest.raises(InvalidArgument, match="starts at position 8, not 4"):
        kv.check_parts([parts[0], parts[2]])
    with pytest.raises(InvalidArgument, match="joined to the parts before it"):
        kv.check_parts([parts[2]])


def test_the_last_input_travels_with_the_last_part_under_the_checksum(tiny_export):
    """A capture's ``last_input`` (what a two-token stage re-feeds after a restore) survives the
    proto, is covered by the checksum (changed, the blob is corrupt) and leaves a blob without it
    hashed as before; joined parts carry the last part's."""
    from pipeshard.shard.kvblob import join_parts

    runner = ShardRunner(tiny_export("llama", 1), 0, "f32")
    session = runner.new_session()
    session.run(np.arange(10, 22)[None])
    plain = export_kv(session)
    last = np.array([21], dtype=np.int64)
    blob = KvBlob.build(plain.source, list(plain.arrays), positions=12, last_input=last)
    back = from_proto(to_proto(blob))
    back.check_for(runner.kv_source)
    assert back.last_input is not None and np.array_equal(back.last_input, last)
    assert blob.checksum != plain.checksum and from_proto(to_proto(plain)).last_input is None
    with pytest.raises(InvalidArgument, match="corrupt"):
        dataclasses.replace(back, last_input=np.array([20], dtype=np.int64)).check_for(runner.kv_source)
    parts = [export_kv(session, positions=6), export_kv(session, positions=12, start=6)]
    parts[1] = KvBlob.build(parts[1].source, list(parts[1].arrays), start=6, last_input=last)
    joined = join_parts(parts)
    assert np.array_equal(joined.last_input, last) and joined.checksum == blob.checksum
