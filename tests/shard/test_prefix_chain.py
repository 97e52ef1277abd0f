"""The prefix cache's block keys (pipeshard/shard/prefix_chain.py), shared by stages and coordinator."""

from __future__ import annotations

from pipeshard.shard.prefix_chain import BLOCK, block_chain


def test_same_tokens_same_keys_and_a_different_block_changes_it_and_every_later_key():
    a = block_chain("s", list(range(3 * BLOCK)))
    assert a == block_chain("s", list(range(3 * BLOCK)))
    changed = list(range(3 * BLOCK))
    changed[BLOCK + 5] = -1  # one token in the second block
    b = block_chain("s", changed)
    assert a[0].key == b[0].key
    assert a[1].key != b[1].key and a[2].key != b[2].key  # the chain carries the change on
    assert block_chain("other", list(range(BLOCK)))[0].key != a[0].key  # scopes never share a key


def test_a_partial_last_block_has_its_own_key():
    full = block_chain("s", list(range(2 * BLOCK)))
    partial = block_chain("s", list(range(BLOCK + 6)))
    assert [(b.start, b.end) for b in partial] == [(0, BLOCK), (BLOCK, BLOCK + 6)]
    assert partial[0].key == full[0].key and partial[1].key != full[1].key
    assert block_chain("s", list(range(BLOCK + 6)))[1].key == partial[1].key
    assert block_chain("s", list(range(BLOCK + 7)))[1].key != partial[1].key
    assert block_chain("s", []) == []
