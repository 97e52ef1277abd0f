"""Incremental detokenization that never emits half a UTF-8 character, and stop strings.

Uses the prefix/read offset scheme: decode a short window of recent ids twice and emit the
difference only when it does not end in U+FFFD (an incomplete byte sequence).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any


def ids_decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    """``tokenizer.decode(ids, skip_special_tokens=True)``; for a fast tokenizer that cleans up no
    spaces, its Rust backend's own decode, which is all transformers' ``decode`` then calls: its
    Python wrapper cost 6x the decode itself, twice per token of every stream (docs/BENCHMARKS.md,
    bench-latency)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        return functools.partial(backend.decode, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = (), streamed: Sequence[int] = ()):
        """``streamed``: tokens whose text a caller already has (a resumed request's): decoded and
        marked streamed, so what follows, a stop string across the seam included, comes out as if
        the stream had never changed hands (held-back text included)."""
        self._decode = ids_decoder(tokenizer)
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # all decoded text
        self._emitted = 0  # characters of ``text`` already streamed
        self.stopped = False
        for token in streamed:
            self.add(token)
        self.delta()

    def add(self, token_id: int) -> None:
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.text += new_text[len(prefix_text) :]
            self._prefix, self._read = self._read, len(self._ids)
        for s in self._stop:
            at = self.text.find(s)
            if at != -1:
                self.text = self.text[:at]
                self.stopped = True

    def delta(self, final: bool = False) -> str:
        """Text not yet streamed; holds back a tail that could still become a stop string."""
        end = len(self.text) if (final or self.stopped) else max(self._emitted, len(self.text) - self._hold)
        out = self.text[self._emitted : end]
        self._emitted = end
        return out
