"""A standby copy's parts cross to a stage in few messages (whole parts packed, large parts
chunked) and the stage's RestoreKvStream reassembles exactly the parts sent, in order."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from pipeshard.errors import InvalidArgument
from pipeshard.ownership import new_secret, owner_metadata
from pipeshard.services.coordinator.remote_stages import restore_requests
from pipeshard.services.stage.kv import StageKv
from pipeshard.services.stage.servicer import StageServicer
from pipeshard.shard.kvblob import KvBlob, KvSource, SnapshotBytes, snapshot_chunks, to_proto
from pipeshard.v1 import stage_pb2

SOURCE = KvSource("f", "e", 0, 0, 1, ("k",), kv_heads=1, head_dim=4)


def _part(start: int, end: int, chunk_bytes: int = 0) -> SnapshotBytes:
    values = np.arange(start * 4, end * 4, dtype=np.float32).reshape(1, end - start, 4)
    blob = KvBlob.build(SOURCE, [values], tuple(range(start, end)), start=start)
    return SnapshotBytes(tuple(snapshot_chunks(to_proto(blob), chunk_bytes)[1]), blob.positions)


class _Kv(StageKv):
    """The stage's real checks and join; the load only records what it was given."""

    def __init__(self):
        super().__init__(None, SOURCE, None)
        self.loaded: list[tuple[str, KvBlob]] = []

    def restore(self, owner: str, session_id: str, blob: KvBlob, *, checked: bool = False) -> int:
        self.loaded.append((session_id, blob))
        return blob.positions


def _restore(requests: list[stage_pb2.RestoreKvStreamRequest]) -> tuple[_Kv, int]:
    kv = _Kv()
    servicer = StageServicer(SimpleNamespace(kv=kv), stage_pb2.GetStageInfoResponse())
    context = SimpleNamespace(invocation_metadata=lambda: owner_metadata(new_secret()))

    async def stream():
        for request in requests:
            yield request

    response = asyncio.run(servicer.RestoreKvStream(stream(), context))
    return kv, response.positions


def test_small_parts_ride_whole_many_to_a_message_and_join_exactly():
    # a prefill part of 64 positions, then one part per 8-position block, as the copy captures them
    parts = [_part(0, 64), *(_part(s, s + 8) for s in range(64, 160, 8))]
    limit = 3 * max(p.nbytes for p in parts[1:])  # room for three block parts a message
    requests = list(restore_requests("s1", parts, limit))
    assert requests[0].session_id == "s1" and all(not r.session_id for r in requests[1:])
    assert [len(r.whole_parts) for r in requests] == [1, 3, 3, 3, 3]
    assert all(not r.snapshot_chunk for r in requests)
    kv, positions = _restore(requests)
    ((session_id, blob),) = kv.loaded
    assert session_id == "s1" and positions == blob.positions == 160
    np.testing.assert_array_equal(blob.arrays[0].reshape(-1), np.arange(160 * 4, dtype=np.float32))
    assert blob.token_ids == tuple(range(160))


def test_a_part_larger_than_a_message_goes_in_chunks_between_whole_parts():
    small = _part(0, 8)
    large = _part(8, 72, chunk_bytes=256)  # captured in several chunks
    tail = _part(72, 80)
    requests = list(restore_requests("s2", [small, large, tail]))
    chunked = [r for r in requests if r.snapshot_chunk]
    assert len(chunked) == len(large.chunks) > 1
    assert chunked[0].next_part and not any(r.next_part for r in chunked[1:])
    kv, positions = _restore(requests)
    assert positions == 80
    np.testing.assert_array_equal(kv.loaded[0][1].arrays[0].reshape(-1), np.arange(80 * 4, dtype=np.float32))


def test_a_chunk_after_a_whole_part_without_next_part_is_refused():
    whole = stage_pb2.RestoreKvStreamRequest(session_id="s3", whole_parts=[_part(0, 8).chunks[0]])
    stray = stage_pb2.RestoreKvStreamRequest(snapshot_chunk=b"x", snapshot_bytes=1)
    with pytest.raises(InvalidArgument, match="exceed the announced"):
        _restore([whole, stray])
    with pytest.raises(InvalidArgument, match="empty part"):
        _restore([stage_pb2.RestoreKvStreamRequest(session_id="s4", whole_parts=[b""])])
