"""Request parameters (OpenAI/vLLM names), their validation, and token selection.

Greedy requests ask the final stage for Top1 only. Sampling requests draw with a per-request
seeded generator, so a seed reproduces its output: the final stage draws with it
(RETURN_MODE_SAMPLED, the math in pipeshard/sampling.py), or the coordinator does from logits.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from pipeshard.errors import InvalidArgument
from pipeshard.sampling import Distribution, check_stop
from pipeshard.services.coordinator.grammar import GrammarSpec

MAX_TOP_LOGPROBS = 20  # as OpenAI's


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False  # return each generated token's logprob and text
    grammar: GrammarSpec | None = None  # structured output: the text follows this grammar
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), sorted by id
    top_logprobs: int = 0  # with logprobs: this many most likely tokens per position
    # Completion tokens another coordinator already streamed (GenerateRequest.resume_token_ids):
    # they are counted out of max_tokens, and the draw, penalties and grammar continue after them.
    resumed: tuple[int, ...] = ()

    @property
    def chooses_here(self) -> bool:
        """Tokens are chosen on the coordinator from the final stage's logits (not Top1 or a
        final-stage draw): the logits are shaped, or the alternatives are asked for."""
        return self.shapes_logits or self.top_logprobs > 0

    @property
    def shapes_logits(self) -> bool:
        """The logits are changed before a token is chosen: chosen here, from the final stage's logits."""
        return (
            self.grammar is not None
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or bool(self.logit_bias)
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def resuming(self, token_ids: Sequence[int], vocab_size: int) -> SamplingParams:
        """These parameters continuing after ``token_ids`` (already streamed by another
        coordinator): the tokens left of max_tokens. InvalidArgument names resume_token_ids."""
        if not token_ids:
            return self
        if len(token_ids) >= self.max_tokens:
            raise InvalidArgument(
                "resume_token_ids",
                f"must be fewer than max_tokens ({self.max_tokens}), got {len(token_ids)} tokens",
            )
        for t in token_ids:
            if not 0 <= t < vocab_size:
                raise InvalidArgument("resume_token_ids", f"{t} is not a token id (vocabulary {vocab_size})")
        return dataclasses.replace(
            self, max_tokens=self.max_tokens - len(token_ids), resumed=(*self.resumed, *token_ids)
        )

    def validate(self, *, prompt_tokens: int, max_context: int, vocab_size: int) -> None:
        """Raise InvalidArgument naming the first parameter that is out of range."""
        if self.max_tokens <= 0:
            raise InvalidArgument("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if prompt_tokens >= max_context:
            raise InvalidArgument(
                "prompt", f"has {prompt_tokens} tokens, which leaves no room in the context of {max_context}"
            )
        if prompt_tokens + self.max_tokens > max_context:
            raise InvalidArgument(
                "max_tokens",
                f"must be at most {max_context - prompt_tokens} for this {prompt_tokens}-token prompt "
                f"(context {max_context}), got {self.max_tokens}",
            )
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidArgument("temperature", f"must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidArgument("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidArgument("top_k", f"must be 0 (disabled) or positive, got {self.top_k}")
        check_stop(self.stop, self.stop_token_ids)
        for t in self.stop_token_ids:
            if not 0 <= t < vocab_size:
                raise InvalidArgument("stop_token_ids", f"{t} is not a token id (vocabulary {vocab_size})")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidArgument(
                "top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2.0 <= value <= 2.0):
                raise InvalidArgument(name, f"must be in [-2, 2], got {value}")
        for t, bias in self.logit_bias:
            if not 0 <= t < vocab_size:
                raise InvalidArgument("logit_bias", f"{t} is not a token id (vocabulary {vocab_size})")
            if not (math.isfinite(bias) and -100.0 <= bias <= 100.0):
                raise InvalidArgument("logit_bias", f"of token {t} must be in [-100, 100], got {bias}")


@dataclass
class Sampler:
    """Draws the next token from logits under one request's parameters."""

    params: SamplingParams
    rng: np.random.Generator = field(init=False)
    distribution: Distribution = field(init=False)

    def __post_init__(self) -> None:
        stream = np.random.PCG64(self.params.seed)  # default_rng's generator
        # Each token drawn without speculation takes one 64-bit output of the stream (one
        # ``random()`` in ``choice``), so a resumed request's stream is where it would have been.
        stream.advance(len(self.params.resumed))
        self.rng = np.random.Generator(stream)
        self.distribution = Distribution(self.params.temperature, self.params.top_k, self.params.top_p)

    def probabilities(self, logits: np.ndarray) -> np.ndarray:
        """The distribution sampled from: temperature, then top-k, then top-p, renormalised."""
        return self.distribution.probabilities(logits)

    def sample(self, logits: np.ndarray) -> int:
        probs = self.probabilities(logits)
        return int(self.rng.choice(probs.size, p=probs))


class LogitShaper:
    """One request's changes to each row of logits before its token is chosen: logit_bias, the
    presence and frequency penalties over the tokens generated so far, and the grammar's mask."""

    def __init__(self, params: SamplingParams, constraint=None):
        self.params = params
        self.constraint = constraint
        self.counts: dict[int, int] = {}  # generated tokens and how often each came
        for token in params.resumed:  # streamed before a coordinator change: generated all the same
            self.took(token)

    def shaped(self, row: np.ndarray) -> np.ndarray:
        """A shaped copy of ``row`` (the input stays as it came)."""
        p = self.params
        out = row.astype(np.float32, copy=True)
        if p.logit_bias:
            ids, biases = zip(*p.logit_bias, strict=True)
            out[list(ids)] += np.asarray(biases, dtype=np.float32)
        if self.counts and (p.presence_penalty or p.frequency_penalty):
            seen = np.fromiter(self.counts, dtype=np.int64)
            n = np.fromiter(self.counts.values(), dtype=np.float32)
            out[seen] -= p.presence_penalty + p.frequency_penalty * n
        return out if self.constraint is None else self.constraint.masked(out)

    @property
    def mask_only(self) -> bool:
        """The grammar is the only shaping: the final stage can apply it (``allowed_bits``)."""
        p = self.params
        return self.constraint is not None and not (p.logit_bias or p.presence_penalty or p.frequency_penalty)

    def allowed_bits(self) -> bytes:
        """The grammar's mask of the next position as a little-endian bitmask (the stage's)."""
        if self.constraint is None:
            raise RuntimeError("no grammar to mask with")
        return self.constraint.allowed_bits()

    def took(self, token: int) -> None:
        self.counts[token] = self.counts.get(token, 0) + 1
        if self.constraint is not None:
            self.constraint.consume(token)


def top_logprobs(logits: np.ndarray, n: int) -> tuple[list[int], list[float]]:
    """The ``n`` most likely tokens of one row of logits and their raw log-probabilities
    (log-softmax before temperature, top-k or top-p, as token_logprobs), most likely first."""
    row = logits.astype(np.float64)
    top = row.max()
    log_z = top + np.log(np.exp(row - top).sum())
    ids = np.argpartition(-row, n - 1)[:n]
    ids = ids[np.lexsort((ids, -row[ids]))]  # most likely first, ties by id
    return [int(i) for i in ids], [float(row[i] - log_z) for i in ids]


def token_logprobs(logits: np.ndarray, tokens: list[int]) -> list[float]:
    """Log-probability of ``tokens[i]`` under row i of ``logits`` [n, vocab]: the model's raw
    distribution (log-softmax of the logits, before temperature, top-k or top-p), in float64."""
    rows = logits[: len(tokens)].astype(np.float64)
    top = rows.max(axis=-1)
    log_z = top + np.log(np.exp(rows - top[:, None]).sum(axis=-1))
    return [float(rows[i, t] - log_z[i]) for i, t in enumerate(tokens)]
