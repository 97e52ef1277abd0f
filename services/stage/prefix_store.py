"""The stage's prefix cache: captured KV kept in blocks, keyed by (owner, scope, token prefix).

A sequence's KV is cut into blocks of BLOCK positions; each block is keyed by the hash of its
scope and *every* token up to its end (a hash chain), so two sequences that share a prefix share
its full blocks: a system prompt many conversations start with is stored once. The KV of a
position depends only on the tokens up to it, which is why the first ``n`` positions of any stored
sequence can be restored for a prompt that shares ``n`` tokens with it. Blocks are evicted least
recently used first beyond a byte budget; the keys of an owner's blocks that go (evicted, or not
kept for want of room) are collected until that owner's next keep or restore reply carries them
(:meth:`PrefixStore.take_dropped`), so the coordinator's index forgets what this stage no longer
holds. Owners (coordinators) never see each other's blocks;
within one owner, scopes (client identities) never do. With a spill folder (prefix_spill.py) every
block is also kept on disk, and a block missing from memory is looked for there. A block holds
f32 positions ``[kv_heads, n, head_dim]`` per state or, on a paged stage with quantized pools,
one pool block verbatim ``[1, ...]`` (pipeshard/shard/kvblob.py BlockLayout, whose block size is
this one).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from pipeshard.errors import InvalidArgument, NotFound
from pipeshard.services.stage.prefix_spill import PrefixSpill, owner_digest
from pipeshard.shard.kvblob import BlockLayout
from pipeshard.shard.prefix_chain import BLOCK, block_chain


class PrefixStore:
    """Byte-budgeted LRU of KV blocks, one array per state in each (f32 positions, or a pool block)."""

    def __init__(
        self, budget_bytes: int, spill: PrefixSpill | None = None, layout: BlockLayout | None = None
    ):
        if budget_bytes < 0:
            raise InvalidArgument("prefix_cache_bytes", f"must be >= 0, got {budget_bytes}")
        if layout is not None and layout.tokens != BLOCK:
            raise InvalidArgument("layout", f"has {layout.tokens}-position blocks; the store keeps {BLOCK}")
        self.budget_bytes = budget_bytes
        self.spill = spill
        self.layout = layout
        self._blocks: OrderedDict[tuple[str, str], tuple[np.ndarray, ...]] = OrderedDict()
        # Keys gone since the owner's last report, by owner digest (as the spill names owners).
        self._dropped: dict[str, set[str]] = {}
        self.nbytes = 0
        if spill is not None:
            spill.on_remove = self._spill_removed

    def __len__(self) -> int:
        return len(self._blocks)

    def put(self, owner: str, scope: str, token_ids: Sequence[int], arrays: Sequence[np.ndarray]) -> int:
        """Keep the KV of ``token_ids`` (a KV blob's arrays of len(token_ids) positions); returns
        the bytes newly stored (blocks already held are only marked recently used)."""
        if not token_ids:
            raise InvalidArgument("token_ids", "must name the captured tokens to keep them in the cache")
        added = 0
        chain = block_chain(scope, token_ids)
        for index, (start, end, key) in enumerate(chain):
            slot = (owner, key)
            if slot in self._blocks:
                self._blocks.move_to_end(slot)
                continue
            if self.layout is None:
                block = tuple(np.array(a[:, start:end], dtype=np.float32, order="C") for a in arrays)
            else:
                block = tuple(np.array(a[index : index + 1], order="C") for a in arrays)
            size = sum(b.nbytes for b in block)
            if size > self.budget_bytes:
                # The rest of the sequence would not fit either: its blocks chain on this one.
                self._dropped.setdefault(owner_digest(owner), set()).update(b.key for b in chain[index:])
                break
            self._blocks[slot] = block
            self.nbytes += size
            added += size
            if self.spill is not None:
                self.spill.write(owner, key, block, end - start)
            self._evict()
        return added

    def get(
        self, owner: str, scope: str, token_ids: Sequence[int], positions: int, start: int = 0
    ) -> list[np.ndarray]:
        """The KV of tokens [start, positions) of a kept sequence, one array per state (as a KV
        blob of those positions holds it); ``start`` begins a block (a paged stage shares the
        blocks before it)."""
        if not 0 < positions <= len(token_ids):
            raise InvalidArgument("positions", f"must be in [1, {len(token_ids)}], got {positions}")
        if start % BLOCK or not 0 <= start < positions:
            raise InvalidArgument("start", f"must be a multiple of {BLOCK} below {positions}, got {start}")
        slots = [
            (first, (owner, key))
            for first, _, key in block_chain(scope, token_ids)
            if start <= first < positions
        ]
        blocks = []
        for first, slot in slots:
            block = self._blocks.get(slot)
            if block is None and self.spill is not None:
                block = self.spill.read(*slot)
                if block is not None:  # back in memory: the next hit needs no disk
                    self._blocks[slot] = block
                    self.nbytes += sum(b.nbytes for b in block)
            if block is None:
                raise NotFound(f"prefix cache has no block for positions from {first} (evicted?)")
            blocks.append(block)
        for _, slot in slots:
            self._blocks.move_to_end(slot)
        self._evict()
        if self.layout is not None:
            return [np.concatenate([b[i] for b in blocks]) for i in range(len(blocks[0]))]
        return [
            np.concatenate([b[i] for b in blocks], axis=1)[:, : positions - start]
            for i in range(len(blocks[0]))
        ]

    def take_dropped(self, owner: str) -> list[str]:
        """The keys of ``owner``'s blocks dropped since the last call and not held again (for
        its next reply)."""
        gone = self._dropped.pop(owner_digest(owner), set())
        return sorted(key for key in gone if not self._holds(owner, key))

    def forget_owner(self, owner: str) -> None:
        """An owner that left (its lease ran out): nobody will take its dropped keys any more."""
        self._dropped.pop(owner_digest(owner), None)

    def _holds(self, owner: str, key: str) -> bool:
        return (owner, key) in self._blocks or (self.spill is not None and self.spill.holds(owner, key))

    def _evict(self) -> None:
        while self.nbytes > self.budget_bytes and self._blocks:
            (owner, key), block = self._blocks.popitem(last=False)
            self.nbytes -= sum(b.nbytes for b in block)
            self._dropped.setdefault(owner_digest(owner), set()).add(key)  # take_dropped skips spilled ones

    def _spill_removed(self, digest: str, key: str) -> None:
        self._dropped.setdefault(digest, set()).add(key)
