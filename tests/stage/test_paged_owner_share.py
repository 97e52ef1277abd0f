"""A paged stage's block pool is shared between callers: one caller may reserve at most its share
(max_sessions_per_owner / max_sessions of the pool), so another still finds room."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from pipeshard.errors import ResourceExhausted
from pipeshard.services.stage.paged_engine import PagedEngine


class FakePool:
    """The block bookkeeping of a PagedShard, without a model."""

    stage_index, is_first, is_last, hidden_size, max_context, vocab_size = 0, True, False, 8, 4096, 16
    block_tokens, blocks_total = 32, 100

    def __init__(self):
        self.free_blocks, self.seqs = self.blocks_total, {}

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_tokens)

    def open(self, seq, capacity: int) -> None:
        need = self.blocks_for(capacity)
        if need > self.free_blocks:
            raise ResourceExhausted("pool full")
        self.free_blocks -= need
        self.seqs[seq] = need * self.block_tokens

    def free(self, seq) -> None:
        self.free_blocks += self.seqs.pop(seq) // self.block_tokens

    def capacity(self, seq) -> int:
        return self.seqs[seq]

    def rewind(self, seq, length: int) -> None:
        assert seq in self.seqs and length == 0  # a reset keeps the blocks

    def usage(self) -> SimpleNamespace:
        return SimpleNamespace(blocks_free=self.free_blocks)


def test_one_caller_is_held_to_its_share_and_another_still_opens():
    pool = FakePool()
    engine = PagedEngine(pool, max_sessions=8, idle_timeout_s=60, max_per_owner=4)  # half the pool each
    for i in range(3):
        engine.open("hog", f"h{i}", capacity=16 * 32)  # 16 blocks each: 48 of its 50
    with pytest.raises(ResourceExhausted, match="max_sessions_per_owner") as refused:
        engine.open("hog", "h3", capacity=3 * 32)
    assert "holds 48 of the KV cache's 100 blocks and may hold 50" in str(refused.value)
    engine.open("hog", "h3", capacity=2 * 32)  # what still fits its share
    engine.open("other", "o0", capacity=50 * 32)  # the rest of the pool is the other caller's
    engine.sessions.release("hog", "h0")
    engine.open("hog", "h4", capacity=16 * 32)  # a release gives the share back
    assert pool.free_blocks == 0
    with pytest.raises(ResourceExhausted, match="pool full"):  # beyond the pool: the pool's own refusal
        engine.open("third", "t0", capacity=32)


def test_a_first_session_larger_than_the_share_is_bounded_by_the_pool_only():
    pool = FakePool()
    engine = PagedEngine(pool, max_sessions=8, idle_timeout_s=60, max_per_owner=4)
    engine.open("long", "l0", capacity=70 * 32)  # a full-context request beyond a small pool's share
    with pytest.raises(ResourceExhausted, match="max_sessions_per_owner"):
        engine.open("long", "l1", capacity=32)
    engine.open("other", "o0", capacity=30 * 32)
    assert pool.free_blocks == 0


def test_the_owner_block_count_returns_to_zero_after_open_free_reset_reap_cycles():
    pool = FakePool()
    engine = PagedEngine(pool, max_sessions=8, idle_timeout_s=60, max_per_owner=4)
    for cycle in range(3):
        engine.open("a", "a0", capacity=10 * 32)
        engine.open("a", "a1", capacity=5 * 32 - 1)  # rounds up to whole blocks
        engine.open("b", "b0", capacity=7 * 32)
        with pytest.raises(ResourceExhausted, match="pool full"):  # refused by the pool: nothing counted
            engine.open("b", "b1", capacity=200 * 32)
        assert (engine.held_blocks("a"), engine.held_blocks("b")) == (15, 7)
        engine.reset("a", "a0")  # forgets the tokens, keeps the reservation
        assert engine.held_blocks("a") == 15
        assert engine.sessions.release("a", "a0")
        assert engine.held_blocks("a") == 5
        if cycle == 0:
            engine.sessions.reap_idle(now=time.monotonic() + 3600)
        else:
            engine.sessions.release_owner("a")
            engine.sessions.release_owner("b")
        assert (engine.held_blocks("a"), engine.held_blocks("b")) == (0, 0)
        assert pool.free_blocks == pool.blocks_total


class _Context:
    def __init__(self, metadata=()):
        self._metadata = tuple(metadata)

    def invocation_metadata(self):
        return self._metadata


def test_stage_info_gives_the_caller_its_share_and_the_coordinators_mirror_follows_the_stages_rule():
    """GetStageInfo reports the caller's share and holdings; a KvMirror built from it admits
    exactly what the stage then reserves (a first session beyond the share, then up to the share)."""
    import asyncio

    from pipeshard.ownership import owner_key, owner_metadata
    from pipeshard.services.coordinator.kv_mirror import KvMirror
    from pipeshard.services.stage.servicer import StageServicer
    from pipeshard.v1 import stage_pb2

    pool = FakePool()
    pool.usage = lambda: SimpleNamespace(
        budget_bytes=100 << 10,
        bytes_used=(100 - pool.free_blocks) << 10,
        block_tokens=32,
        blocks_total=100,
        blocks_free=pool.free_blocks,
    )
    engine = PagedEngine(pool, max_sessions=8, idle_timeout_s=60, max_per_owner=4)
    servicer = StageServicer(
        SimpleNamespace(engine=engine, next_hops=[]),
        stage_pb2.GetStageInfoResponse(stage_index=0, max_context=4096),
    )
    secret = "s" * 32
    mine = owner_metadata(secret)

    def info(metadata=mine):
        return asyncio.run(servicer.GetStageInfo(stage_pb2.GetStageInfoRequest(), _Context(metadata)))

    engine.open("someone else", "x", capacity=5 * 32)
    mirror = KvMirror.from_infos([info()])
    assert mirror.budgets[0].share_blocks == 50 and mirror.held == [0]
    assert info(()).max_sessions_per_owner == 4 and info(()).kv_owner_held_blocks == 0  # no owner: none
    for i, blocks in enumerate([60, 10, 30, 20, 4]):  # beyond the share alone, then 30 + 20 > 50
        need = mirror.need(blocks * 32)
        try:
            engine.open(owner_key(secret), f"s{i}", capacity=blocks * 32)
            opened = True
        except ResourceExhausted:
            opened = False
        assert mirror.has_room(need) == opened, (i, blocks)
        if i == 0:  # the first session goes before the others are asked for
            engine.sessions.release(owner_key(secret), "s0")
        elif opened:
            mirror.charge(need)
    assert info().kv_owner_held_blocks == mirror.held[0] == 44
