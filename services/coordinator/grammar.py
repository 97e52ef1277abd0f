"""Structured outputs: a request's grammar compiled once per text, and the token mask it puts on
each chosen position.

The engine is llguidance (docs/ARCHITECTURE.md, "Structured outputs", says why). A constrained
request's tokens are chosen on the coordinator from the final stage's logits: the grammar's mask
sets every token it does not allow to -inf, then the request's own rule (argmax or its seeded
draw) picks from what is left. Other rows of a batch never see the mask.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from pipeshard import allocator
from pipeshard.errors import InvalidArgument
from pipeshard.services.coordinator.number_bounds import bounded

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# Compiled grammars kept, by their text (a schema sent again starts from its cached matcher).
CACHED_GRAMMARS = 256
# Any JSON object (json_object): its values any JSON, so that their numbers are bounded too.
ANY_OBJECT = {
    "type": "object",
    "additionalProperties": {"$ref": "#/$defs/value"},
    "$defs": {
        "value": {
            "type": ["null", "boolean", "number", "string", "array", "object"],
            "items": {"$ref": "#/$defs/value"},
            "additionalProperties": {"$ref": "#/$defs/value"},
        }
    },
}
# JSON as models write it, with no free whitespace: a flexible grammar lets a small model (or any
# model sampling) fill its tokens with blanks between keys. An unimplemented keyword is an error.
JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's text must follow: ``kind`` json_schema (``text`` the schema as JSON),
    json_object, regex (``text`` the expression) or lark (``text`` a grammar in llguidance's Lark
    syntax)."""

    kind: str
    text: str = ""

    def source(self) -> str:
        """The engine's grammar for this spec (its compile cache key)."""
        import llguidance

        if self.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(bounded(ANY_OBJECT), JSON_OPTIONS)
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.text)
            except json.JSONDecodeError as exc:
                raise InvalidArgument("grammar.json_schema", f"is not valid JSON: {exc}") from None
            if not isinstance(schema, dict):
                raise InvalidArgument("grammar.json_schema", "must be a JSON object")
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(bounded(schema), JSON_OPTIONS)
            except ValueError as exc:
                raise InvalidArgument("grammar.json_schema", f"cannot be compiled: {exc}") from None
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.text)
        if self.kind == "lark":
            return llguidance.LLMatcher.grammar_from_lark(self.text)
        raise InvalidArgument("grammar", f"has an unknown kind {self.kind!r}")


class Constraint:
    """One request's grammar state: the mask of the next position, advanced token by token."""

    def __init__(self, matcher, vocab_size: int):
        self._matcher = matcher
        self._vocab = vocab_size
        self._bits = np.zeros((vocab_size + 31) // 32, dtype=np.int32)

    def allowed(self) -> np.ndarray:
        """The tokens the grammar allows next, as a boolean vector over the vocabulary."""
        self._matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        return np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self._vocab].astype(bool)

    def allowed_bits(self) -> bytes:
        """The tokens the grammar allows next as a bitmask (bit t % 8 of byte t / 8, as the final
        stage's ``allowed_tokens``); InvalidArgument naming ``grammar`` when it allows none."""
        self._matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        if not self._bits.any():
            raise InvalidArgument("grammar", f"allows no token here ({self._matcher.get_error() or 'ended'})")
        return self._bits.astype("<i4", copy=False).tobytes()

    def masked(self, logits: np.ndarray) -> np.ndarray:
        """``logits`` (one row) with every token the grammar forbids at -inf (a copy)."""
        allowed = self.allowed()
        row = logits[: self._vocab]
        if not allowed.any():  # the grammar has ended: nothing but end-of-sequence is left
            raise InvalidArgument("grammar", f"allows no token here ({self._matcher.get_error() or 'ended'})")
        return np.where(allowed, row, -np.inf).astype(np.float32)

    def consume(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            raise InvalidArgument("grammar", f"rejected token {token}: {self._matcher.get_error()}")

    @property
    def stopped(self) -> bool:
        """The grammar is complete and took its end (end-of-sequence): the text is finished."""
        return self._matcher.is_stopped()


class Grammars:
    """Compiles grammars for one tokenizer, caching a pristine matcher per grammar text."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: set[int]):
        self._hf = tokenizer
        self._vocab = vocab_size
        self._eos = sorted(eos_ids)
        self._tokenizer = None  # the engine's view of the vocabulary, built on first use (seconds)
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, object] = OrderedDict()

    def prepare(self):
        """The engine's tokenizer (built once; a few seconds for a 49k vocabulary)."""
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf, n_vocab=self._vocab, eos_token=self._eos or None
                )
                allocator.trim()  # building it frees hundreds of MB on a large vocabulary (Gemma 3's 262k)
            return self._tokenizer

    def compile(self, spec: GrammarSpec):
        """The cached matcher of ``spec`` (compiled on a miss); InvalidArgument naming ``grammar``
        when the engine cannot compile it. Blocking: call it off the event loop."""
        import llguidance

        source = spec.source()
        tokenizer = self.prepare()
        with self._lock:
            matcher = self._cache.get(source)
            if matcher is not None:
                self._cache.move_to_end(source)
                return matcher
        matcher = llguidance.LLMatcher(tokenizer, source, log_level=0)
        if matcher.is_error():
            raise InvalidArgument("grammar", f"cannot be compiled: {matcher.get_error()}")
        with self._lock:
            self._cache[source] = matcher
            while len(self._cache) > CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return matcher

    def constraint(self, spec: GrammarSpec) -> Constraint:
        """A fresh state of ``spec``'s grammar for one request."""
        return Constraint(self.compile(spec).deep_copy(), self._vocab)
