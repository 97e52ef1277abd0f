"""Decoding bounded by what the stage can use, checked on declared sizes before anything is
decompressed; and the requests' own bounds (stop lists, ids, subscriptions, trees)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import zstandard

from pipeshard.errors import InvalidArgument, ResourceExhausted
from pipeshard.sampling import MAX_STOP, check_stop
from pipeshard.services.stage.domain import RowKind
from pipeshard.services.stage.results import ResultBroker
from pipeshard.services.stage.step_engine import check_tree_parents
from pipeshard.services.stage.wire import FrameLimits, step_from_frame, token_frame
from pipeshard.shard.kvblob import (
    BlockLayout,
    KvBlob,
    KvSource,
    RestoreLimits,
    check_chunk_bytes,
    from_proto,
    to_proto,
)
from pipeshard.tensor_codec import Codec, MalformedTensor, decode, encode
from pipeshard.tensor_codec_quantum import decode_fp32, encode_fp32
from pipeshard.v1 import tensor_pb2

SOURCE = KvSource(
    "sha256:m", "sha256:e", 1, 15, 30, ("k0", "v0"), 3, 64, BlockLayout("uint8", 16, ((3, 16, 64),) * 2)
)


def test_decode_refuses_beyond_the_callers_limit_before_decompressing():
    tensor = encode(np.zeros((4, 1024), np.float32), Codec.CODEC_ZSTD)
    with pytest.raises(MalformedTensor, match="over the 1000-byte frame shape"):
        decode(tensor, max_bytes=1000, limit="frame shape")
    assert decode(tensor, max_bytes=4 * 4096).shape == (4, 1024)


def test_quantum_decoding_in_chunks_is_exact_across_chunk_boundaries():
    rng = np.random.default_rng(7)
    values = (rng.standard_normal(200_003) * 2.0**-3).astype(np.float32)
    values[::7] = np.float32(1e-40)  # subnormals keep every bit
    bits = decode_fp32(encode_fp32(values), values.size)
    assert bits.tobytes() == values.view(np.uint32).tobytes()


def _frame(tokens: int, shape: list[int]):
    frame = token_frame("s", 0, [0] * tokens, 0, True)
    del frame.tensors[:]
    tensor = encode(np.zeros(shape, np.float32))
    frame.tensors.append(tensor_pb2.NamedTensor(name="hidden_states", tensor=tensor))
    return frame


def test_frames_are_held_against_the_stage_limits_by_their_declared_shape():
    limits = FrameLimits(hidden_size=8, max_tokens=4)
    assert step_from_frame(_frame(2, [1, 2, 8]), "hidden_states", limits).rows[0].tokens == 2
    with pytest.raises(InvalidArgument, match="hidden_states"):
        step_from_frame(_frame(2, [1, 3, 8]), "hidden_states", limits)
    with pytest.raises(ResourceExhausted, match="max_frame_tokens 4"):
        step_from_frame(_frame(5, [1, 5, 8]), "hidden_states", limits)
    long_id = _frame(2, [1, 2, 8])
    long_id.plan.rows[0].session_id = "x" * 1000
    with pytest.raises(InvalidArgument, match="session_id"):
        step_from_frame(long_id, "hidden_states", limits)


def _blob(positions: int) -> KvBlob:
    arrays = [np.zeros((1, 3, 16, 64), np.uint8)] * 2
    return KvBlob.build(SOURCE, arrays, positions=positions)


def test_snapshots_are_checked_against_the_stage_before_any_state_decodes():
    snapshot = to_proto(_blob(16))
    assert from_proto(snapshot, SOURCE, 64).positions == 16
    huge = zstandard.ZstdCompressor().compress(bytes(64 << 20))
    for named in snapshot.states:
        named.tensor.CopyFrom(
            tensor_pb2.Tensor(
                dtype=named.tensor.dtype, shape=[21845, 3, 16, 64], data=huge, codec=Codec.CODEC_ZSTD
            )
        )
    with pytest.raises(InvalidArgument, match=r"snapshot\.states"):
        from_proto(snapshot, SOURCE, 64)
    snapshot.positions = 21845 * 16
    with pytest.raises(InvalidArgument, match="max_context"):
        from_proto(snapshot, SOURCE, 64)


def test_restore_streams_and_capture_chunks_are_bounded():
    limits = RestoreLimits.of(SOURCE, 64)
    assert limits.max_parts == 4
    limits.check(4, limits.max_bytes, limits.max_chunks)
    with pytest.raises(ResourceExhausted, match="max_parts"):
        limits.check(5, 10, 10)
    with pytest.raises(ResourceExhausted, match="max_bytes"):
        limits.check(1, limits.max_bytes + 1, 1)
    assert check_chunk_bytes(0) == 1 << 20
    for bad in (1, 1 << 30):
        with pytest.raises(InvalidArgument, match="chunk_bytes"):
            check_chunk_bytes(bad)


def test_stop_lists_are_bounded_by_name():
    check_stop(["a"] * MAX_STOP)
    with pytest.raises(InvalidArgument, match="`stop`"):
        check_stop(["a"] * (MAX_STOP + 1))
    with pytest.raises(InvalidArgument, match="`stop`"):
        check_stop(["a" * 10_000])


def test_results_subscriptions_are_bounded_per_owner_and_in_all():
    broker = ResultBroker(max_per_owner=2, max_total=3)
    broker.subscribe("a", "1")
    broker.subscribe("a", "2")
    broker.subscribe("a", "2")  # a reconnect replaces, it does not add
    with pytest.raises(ResourceExhausted, match="max_subscriptions_per_owner"):
        broker.subscribe("a", "3")
    broker.subscribe("b", "1")
    with pytest.raises(ResourceExhausted, match="max_subscriptions"):
        broker.subscribe("c", "1")


def test_a_parent_beyond_the_row_is_refused_by_name():
    frame = token_frame("s", 0, [1, 2, 3, 4], 0, True)
    (row,) = step_from_frame(frame, "input_ids").rows
    assert row.kind is RowKind.PREFILL
    bad = dataclasses.replace(row, tree_parents=(-1, 7, 0, 1))
    with pytest.raises(InvalidArgument, match="tree_parents"):
        check_tree_parents(bad)
