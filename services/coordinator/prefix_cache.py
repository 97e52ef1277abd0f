"""The coordinator's index of the blocks the stages keep in their prefix caches (prefix caching).

At the end of a request every stage keeps its KV of the sequence in its prefix cache
(``CaptureKv`` with ``keep_in_cache``; services/stage/prefix_store.py) as 32-position blocks
under hash-chain keys (pipeshard/shard/prefix_chain.py); this index holds the same keys, each
with its block's tokens and the block it chains on. A new request walks its prompt's chain from
the longest block down to the first key indexed, then extends the match into that block's
successors token by token, and restores those positions on every stage instead of prefilling
them. Stages report the keys they drop (evicted, or never kept for want of room) in their keep
and restore replies; the index forgets those and every block chained on them, so what it finds
is what every stage still holds, as far as reported. A restore that fails anyway (a stage
miss: another coordinator's keep evicted the block and this one has not heard yet, or the stage
restarted without a spill folder) falls back to a cold prefill and forgets the hit's chain.

The scope (the client's identity, pipeshard.auth) is hashed into every key: a cache hit is
faster than a miss, so sharing blocks between clients would let one time its way to another's
prompt. Blocks a request is restoring from are pinned: the index's LRU skips them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from pipeshard.shard.prefix_chain import BLOCK, block_chain


@dataclass
class _Block:
    scope: str
    tokens: np.ndarray  # this block's own tokens, int64 (BLOCK of them, fewer when partial)
    parent: str | None  # the key of the block it chains on (None: a sequence's first)
    children: set[str] = field(default_factory=set)
    pins: int = 0


@dataclass
class PrefixHit:
    """A cached chain and how many of its first positions a request reuses."""

    scope: str
    tokens: list[int]  # the cached sequence, cut after the last block the restore needs
    positions: int
    keys: list[str] = field(repr=False)  # the chain's blocks, first to last (pinned)


class PrefixIndex:
    """Indexed blocks by chain key, least recently used leaf out beyond ``max_blocks``.

    A block is always used no later than the blocks chained on it (a lookup or add touches a
    chain from its last block back to its first), so the least recently used block is a leaf and
    evicting it never strands a descendant; pins likewise cover whole chains."""

    def __init__(self, max_blocks: int = 65536, min_tokens: int = 64):
        self.max_blocks = max_blocks
        self.min_tokens = min_tokens  # a shorter shared prefix is prefilled: restoring it saves nothing
        self._blocks: OrderedDict[str, _Block] = OrderedDict()
        self._roots: dict[str, set[str]] = {}  # per scope: the keys of first blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def lookup(self, scope: str, prompt: list[int]) -> PrefixHit | None:
        """The longest reusable prefix of ``prompt`` (pinned until :meth:`unpin`), or None. At
        least the prompt's last two tokens are always left to prefill: the last one's logits give
        the first token, and a suffix of two or more runs as a chunk, the attention path every
        row of an ``invariant`` stage takes (a one-token row after a restore cannot re-feed the
        token before it: the stage never saw that token's input; pipeshard/shard/paged.py)."""
        usable = prompt[:-2]
        chain = [b for b in block_chain(scope, usable) if b.end - b.start == BLOCK]
        full = next((i for i in range(len(chain) - 1, -1, -1) if chain[i].key in self._blocks), -1)
        keys = [b.key for b in chain[: full + 1]]
        positions = len(keys) * BLOCK
        # Extend into a successor block: a partial one (a shorter kept sequence) or a block the
        # prompt leaves early, reused up to the first token that differs.
        successors = self._blocks[keys[-1]].children if keys else self._roots.get(scope, set())
        rest = np.asarray(usable[positions : positions + BLOCK], dtype=np.int64)
        best, best_key = 0, None
        for key in successors:
            shared = _shared(self._blocks[key].tokens, rest)
            if shared > best:
                best, best_key = shared, key
        if best_key is not None:
            keys.append(best_key)
            positions += best
        if positions < self.min_tokens:
            return None
        tokens = np.concatenate([self._blocks[key].tokens for key in keys]).tolist()
        for key in keys:
            self._blocks[key].pins += 1
        self._touch(keys)
        return PrefixHit(scope, tokens, positions, keys)

    def unpin(self, hit: PrefixHit) -> None:
        for key in hit.keys:
            block = self._blocks.get(key)
            if block is not None:
                block.pins -= 1
        self._evict()

    def drop(self, hit: PrefixHit) -> None:
        """Forget the chain a restore failed on (a stage missed a block the index held): which
        block was missing is not known, so all of it goes, and what chains on it."""
        self.forget(hit.keys[:1])

    def add(self, scope: str, tokens: list[int]) -> None:
        """Index a sequence the stages kept (its blocks they already held are only touched)."""
        if len(tokens) < self.min_tokens:
            return
        parent = None
        keys = []
        for start, end, key in block_chain(scope, tokens):
            if key not in self._blocks:
                self._blocks[key] = _Block(scope, np.asarray(tokens[start:end], dtype=np.int64), parent)
                self._successors(self._blocks[key]).add(key)
            keys.append(key)
            parent = key
        self._touch(keys)
        self._evict()

    def forget(self, keys: Iterable[str]) -> None:
        """Drop blocks a stage reports it dropped, and every block chained on them."""
        stack = list(keys)
        while stack:
            key = stack.pop()
            block = self._blocks.pop(key, None)
            if block is None:
                continue
            stack.extend(block.children)
            siblings = self._successors(block)
            siblings.discard(key)
            if block.parent is None and not siblings:
                del self._roots[block.scope]

    def _successors(self, block: _Block) -> set[str]:
        """The set ``block`` belongs to: its parent's children, or its scope's first blocks."""
        if block.parent is None:
            return self._roots.setdefault(block.scope, set())
        parent = self._blocks.get(block.parent)
        return parent.children if parent is not None else set()

    def _touch(self, keys: list[str]) -> None:
        for key in reversed(keys):  # the first block ends up the most recent of its chain
            self._blocks.move_to_end(key)

    def _evict(self) -> None:
        excess = len(self._blocks) - self.max_blocks
        if excess <= 0:
            return
        leaves = [k for k, b in self._blocks.items() if not b.pins][:excess]
        self.forget(leaves)


def _shared(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n
