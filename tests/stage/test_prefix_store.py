"""The stage's prefix cache: blocks keyed by (owner, scope, token prefix), shared, LRU by bytes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pipeshard.errors import InvalidArgument, NotFound
from pipeshard.services.stage.prefix_store import PrefixStore
from pipeshard.shard.prefix_chain import BLOCK, block_chain


def kv(tokens: list[int]) -> list[np.ndarray]:
    """Fake KV whose every position holds its token id: [kv_heads 2, T, head_dim 3], K and V."""
    a = np.broadcast_to(np.asarray(tokens, np.float32)[None, :, None], (2, len(tokens), 3))
    return [a, -a]


def test_prefix_of_a_kept_sequence_comes_back_and_shared_blocks_are_stored_once():
    store = PrefixStore(1 << 20)
    system = list(range(1000, 1000 + 2 * BLOCK))
    one, two = [*system, 1, 2, 3], [*system, 7, 8, 9, 10]
    first = store.put("o", "s", one, kv(one))
    second = store.put("o", "s", two, kv(two))
    per_position = 2 * (2 * 3 * 4)  # K and V of 2 heads x 3 dims of f32
    assert first == len(one) * per_position
    assert second == 4 * per_position  # only the new partial block: the system prompt is shared
    k, v = store.get("o", "s", two, 66)
    assert k.shape == (2, 66, 3) and k[0, :, 0].tolist() == two[:66] and (v == -k).all()
    with pytest.raises(NotFound):
        store.get("o", "other-scope", two, 10)
    with pytest.raises(NotFound):
        store.get("another-owner", "s", two, 10)
    with pytest.raises(InvalidArgument) as err:
        store.get("o", "s", two, len(two) + 1)
    assert err.value.field == "positions"


def test_least_recently_used_blocks_go_beyond_the_budget():
    per_block = BLOCK * 2 * (2 * 3 * 4)
    store = PrefixStore(2 * per_block)
    a, b = list(range(BLOCK)), list(range(100, 100 + BLOCK))
    store.put("o", "s", a, kv(a))
    store.put("o", "s", b, kv(b))
    store.get("o", "s", a, BLOCK)  # a is now the most recently used
    c = list(range(200, 200 + BLOCK))
    store.put("o", "s", c, kv(c))
    assert store.nbytes == 2 * per_block and len(store) == 2
    store.get("o", "s", a, 1)
    with pytest.raises(NotFound):
        store.get("o", "s", b, 1)
    assert PrefixStore(0).put("o", "s", a, kv(a)) == 0  # a zero budget keeps nothing


def test_dropped_blocks_are_reported_to_their_owner_once():
    per_block = BLOCK * 2 * (2 * 3 * 4)
    store = PrefixStore(2 * per_block)
    a, b = list(range(BLOCK)), list(range(100, 100 + BLOCK))
    store.put("o", "s", a, kv(a))
    store.put("other", "s", b, kv(b))
    assert store.take_dropped("o") == []
    c = list(range(200, 200 + 2 * BLOCK))  # two blocks: a and b go
    store.put("o", "s", c, kv(c))
    assert store.take_dropped("o") == [block_chain("s", a)[0].key]
    assert store.take_dropped("o") == []  # reported once
    assert store.take_dropped("other") == [block_chain("s", b)[0].key]  # on its own next reply
    store.put("o", "s", a, kv(a))  # kept again (c's first block goes): a is not reported
    assert store.take_dropped("o") == [block_chain("s", c)[0].key]
    # Blocks too large for the budget are never kept: they are reported at once.
    keys = sorted(b.key for b in block_chain("s", c))
    tiny = PrefixStore(per_block - 1)
    assert tiny.put("o", "s", c, kv(c)) == 0 and tiny.take_dropped("o") == keys


def test_a_departed_owners_dropped_keys_are_forgotten_and_others_kept():
    """An owner whose lease ran out takes no more replies: its dropped keys are not kept for it."""
    per_block = BLOCK * 2 * (2 * 3 * 4)
    store = PrefixStore(per_block)
    a, b, c = (list(range(n, n + BLOCK)) for n in (0, 100, 200))
    store.put("gone", "s", a, kv(a))
    store.put("other", "s", b, kv(b))  # a is dropped, for "gone"
    store.put("gone", "s", c, kv(c))  # b is dropped, for "other"
    store.forget_owner("gone")
    assert store.take_dropped("gone") == []
    assert store.take_dropped("other") == [block_chain("s", b)[0].key]


def test_a_block_evicted_from_memory_is_reported_only_when_its_spill_file_goes_too(tmp_path):
    from pipeshard.services.stage.prefix_spill import PrefixSpill

    a, b = list(range(BLOCK)), list(range(100, 100 + BLOCK))
    per_block = BLOCK * 2 * (2 * 3 * 4)
    spill = PrefixSpill(tmp_path, _source(), 1 << 20)
    store = PrefixStore(per_block, spill)
    store.put("o", "s", a, kv(a))
    one_file = spill.nbytes
    store.put("o", "s", b, kv(b))  # a leaves memory but stays on disk: still held
    assert len(store) == 1 and store.take_dropped("o") == []
    spill.budget_bytes = one_file  # the disk too has room for one block now: a's file goes
    spill._evict()
    assert store.take_dropped("o") == [block_chain("s", a)[0].key]


# -- spilled to disk ------------------------------------------------------------------------------


def _source(stage: int = 0, export_id: str = "export-a"):
    from pipeshard.shard.kvblob import KvSource

    names = ("past_key_values.0.key", "past_key_values.0.value")
    return KvSource("sha256:model", export_id, stage, 0, 1, names, kv_heads=2, head_dim=3)


def test_a_new_store_on_the_spill_folder_restores_what_the_old_one_kept(tmp_path):
    from pipeshard.services.stage.prefix_spill import PrefixSpill

    tokens = list(range(500, 500 + 2 * BLOCK + 5))
    old = PrefixStore(1 << 20, PrefixSpill(tmp_path, _source(), 1 << 20))
    old.put("o", "s", tokens, kv(tokens))
    assert len(old.spill) == 3
    # A restarted stage: an empty store in memory over the same folder.
    new = PrefixStore(1 << 20, PrefixSpill(tmp_path, _source(), 1 << 20))
    assert len(new) == 0
    k, v = new.get("o", "s", tokens, len(tokens))
    assert k[0, :, 0].tolist() == tokens and (v == -k).all()
    assert len(new) == 3  # read back into memory
    with pytest.raises(NotFound):
        new.get("another-owner", "s", tokens, 10)


def test_spilled_blocks_of_another_export_or_damaged_are_dropped_not_used(tmp_path):
    from pipeshard.services.stage.prefix_spill import SUFFIX, PrefixSpill

    tokens = list(range(BLOCK))
    PrefixStore(1 << 20, PrefixSpill(tmp_path, _source(), 1 << 20)).put("o", "s", tokens, kv(tokens))
    other = PrefixStore(1 << 20, PrefixSpill(tmp_path, _source(export_id="export-b"), 1 << 20))
    with pytest.raises(NotFound):
        other.get("o", "s", tokens, BLOCK)
    assert not list(tmp_path.glob(f"*{SUFFIX}"))  # refused and deleted
    PrefixStore(1 << 20, PrefixSpill(tmp_path, _source(), 1 << 20)).put("o", "s", tokens, kv(tokens))
    (path,) = tmp_path.glob(f"*{SUFFIX}")
    data = bytearray(path.read_bytes())
    data[-40] ^= 0xFF  # a flipped byte inside the arrays or the checksum
    path.write_bytes(bytes(data))
    with pytest.raises(NotFound):
        PrefixStore(1 << 20, PrefixSpill(tmp_path, _source(), 1 << 20)).get("o", "s", tokens, BLOCK)
    assert not path.exists()


def test_the_spill_folder_keeps_its_byte_budget_oldest_out(tmp_path):
    from pipeshard.services.stage.prefix_spill import PrefixSpill

    spill = PrefixSpill(tmp_path, _source(), 1 << 20)
    store = PrefixStore(1 << 20, spill)
    a, b = list(range(BLOCK)), list(range(100, 100 + BLOCK))
    store.put("o", "s", a, kv(a))
    one = spill.nbytes
    store.put("o", "s", b, kv(b))
    small = PrefixSpill(tmp_path, _source(), one + one // 2)  # reopened with room for one block
    assert len(small) == 1 and small.nbytes <= small.budget_bytes
    assert small.read("o", block_chain("s", b)[0].key) is not None  # the newer file stayed
    with pytest.raises(InvalidArgument) as err:
        PrefixSpill(tmp_path, _source(), -1)
    assert err.value.field == "prefix_spill_bytes"


# -- a paged stage's quantized pool blocks ---------------------------------------------------------


def _block_source():
    from pipeshard.shard.kvblob import BlockLayout

    return dataclasses.replace(_source(), blocks=BlockLayout("uint8", BLOCK, ((2, 40, 3), (2, BLOCK, 5))))


def blocks(tokens: list[int]) -> list[np.ndarray]:
    """Fake pool blocks [blocks, 2, rows, cols] whose every byte is its block's first token (mod 256)."""
    firsts = np.asarray(tokens[::BLOCK], np.uint8)
    return [
        np.broadcast_to(firsts[:, None, None, None], (len(firsts), 2, *shape)).copy()
        for shape in ((40, 3), (BLOCK, 5))
    ]


def test_pool_blocks_are_kept_and_spilled_verbatim_one_per_block(tmp_path):
    from pipeshard.services.stage.prefix_spill import PrefixSpill

    source = _block_source()
    store = PrefixStore(1 << 20, PrefixSpill(tmp_path, source, 1 << 20), layout=source.blocks)
    system = list(range(10, 10 + 2 * BLOCK))
    one, two = [*system, 1, 2, 3], [*system, 7, 8]
    store.put("o", "s", one, blocks(one))
    assert store.put("o", "s", two, blocks(two)) == 2 * 40 * 3 + 2 * BLOCK * 5  # one new block
    k, v = store.get("o", "s", two, 2 * BLOCK + 1)
    assert k.shape == (3, 2, 40, 3) and v.shape == (3, 2, BLOCK, 5) and k.dtype == np.uint8
    assert k[:, 0, 0, 0].tolist() == [10, 10 + BLOCK, 7]
    # A restarted stage reads the blocks back from its spill folder, bytes unchanged.
    again = PrefixStore(1 << 20, PrefixSpill(tmp_path, source, 1 << 20), layout=source.blocks)
    np.testing.assert_array_equal(again.get("o", "s", two, len(two))[1], v)
    with pytest.raises(InvalidArgument) as err:
        PrefixStore(1 << 20, layout=dataclasses.replace(source.blocks, tokens=16))
    assert err.value.field == "layout"
