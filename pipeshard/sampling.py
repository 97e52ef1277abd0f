"""Token selection shared by the coordinator and the final stage.

The sampling distribution (temperature, then top-k, then top-p), the speculative
rejection-sampling step, and the request's random generator state as bytes. The coordinator
samples from logits it received (RETURN_MODE_LOGITS) or lets the final stage draw
(RETURN_MODE_SAMPLED): it then ships its generator state with the frame and continues from the
state that comes back, so a seed gives the same tokens wherever the draw happens and a step
returns a few token ids instead of 49152 floats per position.

Rejection sampling (Leviathan et al. 2023; Chen et al. 2023): draft token d drawn from q is
kept with probability min(1, p(d) / q(d)); the first rejected position draws from the residual
max(p - q, 0), renormalised; if every draft is kept, one more token is drawn from the target's
last row. Each emitted token then follows the target distribution p exactly, whatever the draft
proposes. A draft with no distribution (prompt lookup) is a point mass: q(d) = 1.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from pipeshard.errors import InvalidArgument

_RNG_STATE_BYTES = 16 + 16 + 1 + 4  # PCG64 state, increment, has_uint32, uinteger
# Stop strings are matched after every token on the coordinator's event loop: OpenAI's rule of
# at most 4 (TGI's --max-stop-sequences default too), each of bounded length.
MAX_STOP = 4
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64


def check_stop(stop: Sequence[str], stop_token_ids: Sequence[int] = ()) -> None:
    """Refuses a stop list beyond the bounds, naming ``stop`` (before anything else reads it)."""
    if len(stop) > MAX_STOP:
        raise InvalidArgument("stop", f"may hold at most {MAX_STOP} sequences, got {len(stop)}")
    for s in stop:
        if not s:
            raise InvalidArgument("stop", "must not contain empty strings")
        if len(s) > MAX_STOP_CHARS:
            raise InvalidArgument(
                "stop", f"sequences may be at most {MAX_STOP_CHARS} characters, got {len(s)}"
            )
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidArgument(
            "stop_token_ids", f"may hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(stop_token_ids)}"
        )


@dataclass(frozen=True)
class Distribution:
    """The distribution a request samples from, given one row of logits."""

    temperature: float
    top_k: int = 0
    top_p: float = 1.0

    def check(self, prefix: str = "") -> None:
        """InvalidArgument naming the first parameter out of range."""
        if not math.isfinite(self.temperature) or self.temperature <= 0:
            raise InvalidArgument(
                f"{prefix}temperature", f"must be positive to sample, got {self.temperature}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidArgument(f"{prefix}top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidArgument(f"{prefix}top_k", f"must be 0 (disabled) or positive, got {self.top_k}")

    def probabilities(self, logits: np.ndarray) -> np.ndarray:
        """Temperature, then top-k, then top-p, renormalised (float64)."""
        scaled = logits.astype(np.float64) / self.temperature
        if 0 < self.top_k < scaled.size:
            kth = np.partition(scaled, -self.top_k)[-self.top_k]
            scaled = np.where(scaled < kth, -np.inf, scaled)
        probs = np.exp(scaled - scaled.max())
        probs /= probs.sum()
        if self.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            cumulative = np.cumsum(probs[order])
            keep = order[: int(np.searchsorted(cumulative, self.top_p)) + 1]
            mask = np.zeros_like(probs)
            mask[keep] = probs[keep]
            probs = mask / mask.sum()
        return probs


def accept_sampled(
    drafts: Sequence[int],
    draft_probs: Sequence[np.ndarray] | None,
    target_rows: np.ndarray,
    probabilities: Callable[[np.ndarray], np.ndarray],
    rng: np.random.Generator,
) -> list[int]:
    """``target_rows`` are the target's logits [K + 1, vocab]; ``probabilities`` turns one row
    into the request's sampling distribution (temperature, top-k, top-p); ``draft_probs[i]`` is
    the distribution ``drafts[i]`` was drawn from (None: point masses). With no drafts this is a
    plain draw from the one row."""
    if target_rows.shape[0] != len(drafts) + 1:
        raise ValueError(f"need {len(drafts) + 1} target rows for {len(drafts)} drafts")
    kept: list[int] = []
    for i, draft in enumerate(drafts):
        p = probabilities(target_rows[i])
        q = None if draft_probs is None else draft_probs[i]
        q_draft = 1.0 if q is None else float(q[draft])
        if q_draft > 0.0 and rng.random() * q_draft < p[draft]:
            kept.append(int(draft))
            continue
        if q is None:
            residual = p.copy()
            residual[draft] = 0.0
        else:
            residual = np.maximum(p - q, 0.0)
        total = residual.sum()
        # p == q (nothing left over) cannot reject; guard rounding anyway.
        residual = p if total <= 0.0 else residual / total
        return [*kept, int(rng.choice(residual.size, p=residual))]
    last = probabilities(target_rows[len(drafts)])
    return [*kept, int(rng.choice(last.size, p=last))]


def rng_state(rng: np.random.Generator) -> bytes:
    """The generator's PCG64 state as bytes (what travels in SamplingRequest.rng_state)."""
    state = rng.bit_generator.state
    if state["bit_generator"] != "PCG64":
        raise ValueError(f"only PCG64 generators travel, not {state['bit_generator']}")
    inner = state["state"]
    return (
        inner["state"].to_bytes(16, "little")
        + inner["inc"].to_bytes(16, "little")
        + bytes([state["has_uint32"]])
        + state["uinteger"].to_bytes(4, "little")
    )


def check_rng_state(data: bytes, field: str = "rng_state") -> None:
    if len(data) != _RNG_STATE_BYTES or data[32] > 1:
        raise InvalidArgument(field, f"must be {_RNG_STATE_BYTES} bytes of PCG64 state, got {len(data)}")


def restore_rng(rng: np.random.Generator, data: bytes, field: str = "rng_state") -> None:
    """Set ``rng`` (a PCG64 generator) to the state ``data`` holds, in place."""
    check_rng_state(data, field)
    rng.bit_generator.state = {
        "bit_generator": "PCG64",
        "state": {"state": int.from_bytes(data[:16], "little"), "inc": int.from_bytes(data[16:32], "little")},
        "has_uint32": data[32],
        "uinteger": int.from_bytes(data[33:37], "little"),
    }


def sample_step(
    target_rows: np.ndarray, dist: Distribution, drafts: Sequence[int], state: bytes
) -> tuple[list[int], bytes]:
    """The final stage's draw: (kept drafts + next token, generator state after it)."""
    rng = np.random.Generator(np.random.PCG64())
    restore_rng(rng, state, "sampling.rng_state")
    tokens = accept_sampled(drafts, None, target_rows, dist.probabilities, rng)
    return tokens, rng_state(rng)
