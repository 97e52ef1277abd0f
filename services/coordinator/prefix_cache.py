"""The coordinator's index of token sequences whose KV the stages keep (prefix caching).

At the end of a request every stage keeps its KV of the sequence in its prefix cache
(``CaptureKv`` with ``keep_in_cache``; services/stage/prefix_store.py); this index remembers the
sequence. A new request looks for the cached sequence it shares the longest prefix with and
restores those positions on every stage instead of prefilling them. Sequences are indexed per
scope (the client's identity, pipeshard.auth): a cache hit is faster than a miss, so sharing
entries between clients would let one time its way to another's prompt. The index is a hint: a
stage may have evicted blocks meanwhile, and a failed restore falls back to a cold prefill and
drops the entry. An entry a request is restoring from is pinned: the index's LRU skips it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from pipeshard.services.stage.prefix_store import BLOCK


@dataclass
class _Entry:
    tokens: np.ndarray  # int64
    pins: int = 0


@dataclass
class PrefixHit:
    """A cached sequence and how many of its first positions a request reuses."""

    scope: str
    tokens: list[int]  # the cached sequence, cut after the last block the restore needs
    positions: int
    _key: tuple[str, bytes] = field(repr=False)


class PrefixIndex:
    """Cached sequences per scope, least recently used out beyond ``max_entries``."""

    def __init__(self, max_entries: int = 256, min_tokens: int = 64):
        self.max_entries = max_entries
        self.min_tokens = min_tokens  # a shorter shared prefix is prefilled: restoring it saves nothing
        self._entries: OrderedDict[tuple[str, bytes], _Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, scope: str, prompt: list[int]) -> PrefixHit | None:
        """The longest reusable prefix of ``prompt`` (pinned until :meth:`unpin`), or None. At
        least the prompt's last token is always left to prefill: its logits give the first token."""
        want = np.asarray(prompt, dtype=np.int64)
        best, best_key = 0, None
        for key, entry in self._entries.items():
            if key[0] != scope:
                continue
            n = min(len(entry.tokens), len(want) - 1)
            if n <= best:
                continue
            differ = np.flatnonzero(entry.tokens[:n] != want[:n])
            shared = int(differ[0]) if differ.size else n
            if shared > best:
                best, best_key = shared, key
        if best_key is None or best < self.min_tokens:
            return None
        entry = self._entries[best_key]
        entry.pins += 1
        self._entries.move_to_end(best_key)
        # The stages find a prefix by the hashes of its blocks: send the sequence up to the end of
        # the last block the restore needs (the blocks were cut from the whole sequence).
        cover = min(len(entry.tokens), -(-best // BLOCK) * BLOCK)
        return PrefixHit(scope, entry.tokens[:cover].tolist(), best, best_key)

    def unpin(self, hit: PrefixHit) -> None:
        entry = self._entries.get(hit._key)
        if entry is not None:
            entry.pins -= 1
        self._evict()

    def drop(self, hit: PrefixHit) -> None:
        """Forget an entry a restore failed on (a stage evicted it, or never kept it)."""
        self._entries.pop(hit._key, None)

    def add(self, scope: str, tokens: list[int]) -> None:
        """Remember a kept sequence; the entries it extends are dropped (it covers them)."""
        if len(tokens) < self.min_tokens:
            return
        seq = np.asarray(tokens, dtype=np.int64)
        for key, entry in list(self._entries.items()):
            n = len(entry.tokens)
            if key[0] == scope and not entry.pins and n <= len(seq) and np.array_equal(entry.tokens, seq[:n]):
                del self._entries[key]
        key = (scope, seq.tobytes())
        self._entries[key] = self._entries.pop(key, None) or _Entry(seq)
        self._evict()

    def _evict(self) -> None:
        excess = len(self._entries) - self.max_entries
        for key in [k for k, e in self._entries.items() if not e.pins][: max(0, excess)]:
            del self._entries[key]
