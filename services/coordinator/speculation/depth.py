"""How many of one request's speculative steps may travel at once: the in-flight depth D.

While a request's step t (its draft) travels the stages, its step t+1 may go, drafted on the
assumption that t's draft is accepted whole; up to D of them travel at once. That pays when a
step's round trip is mostly waiting (hops), not compute: D is the round trip over the stages'
compute per step, measured on the answers of decode steps (D = 1 on one node, whenever the stages'
compute fills the round trip, which is plain speculation, and while a step waits less than
``MIN_WAIT_S`` beyond its compute). An operator may fix D
(``--spec-depth``); 0 chooses it from the measurements, at most ``AUTO_MAX_DEPTH``.
"""

from __future__ import annotations

from dataclasses import dataclass

# The most steps of one request auto depth sends ahead (each dropped step costs the stages work).
AUTO_MAX_DEPTH = 4
# The largest depth an operator may fix.
MAX_DEPTH = 8
# Auto depth stays 1 while a step waits less than this beyond the stages' compute (a fleet on one
# machine or a LAN: the coordinator's and gRPC's own time is not worth a dropped step's work).
MIN_WAIT_S = 0.020
# Sharing its steps with other requests, a row goes ahead only while its chance to stand (every
# draft and guess it is built on accepted) is at least this: a dropped row's positions and drafting
# delay every row of its step (8 users at 100 ms with a draft keeping a quarter of its tokens
# dropped more than two rows for each one kept). Alone its step waits on the hops anyway.
MIN_STANDING = 0.1
# Weight of the newest observation in the running averages.
_NEWEST = 0.2


@dataclass
class InFlightDepth:
    """``fixed``: D set by the operator (1: one step at a time); 0: chosen from the measured round
    trip and compute (running averages over decode steps' answers)."""

    fixed: int = 0
    round_trip_s: float = 0.0
    compute_s: float = 0.0
    observed: int = 0
    stages: int = 0  # stages that reported compute in the latest answer

    def __post_init__(self) -> None:
        if not 0 <= self.fixed <= MAX_DEPTH:
            raise ValueError(f"spec_depth must be 0 (auto) or 1..{MAX_DEPTH}, got {self.fixed}")

    def observe(self, round_trip_s: float, compute_micros: list[int]) -> None:
        """One decode step's wall time from send to answer and each stage's reported compute in it
        (stage 0 first; empty when they report none)."""
        compute_s = sum(compute_micros) / 1e6
        if compute_s <= 0.0 or round_trip_s <= 0.0:
            return
        self.stages = len(compute_micros)
        weight = 1.0 if not self.observed else _NEWEST
        self.round_trip_s += weight * (round_trip_s - self.round_trip_s)
        self.compute_s += weight * (compute_s - self.compute_s)
        self.observed += 1

    def depth(self) -> int:
        """D for the next speculative row: the fixed one, or how many steps' compute fits in one
        round trip (1 before any measurement, and on one node)."""
        if self.fixed:
            return self.fixed
        if not self.observed or self.stages <= 1 or self.round_trip_s - self.compute_s < MIN_WAIT_S:
            return 1
        return max(1, min(AUTO_MAX_DEPTH, int(self.round_trip_s / self.compute_s)))


def worth_sending(acceptance: float, built_on: int, shared: bool) -> bool:
    """Whether a row built on ``built_on`` tokens in flight (drafts and guesses, each kept with
    ``acceptance``) plus its own guess goes ahead: always alone, in a shared step while its chance
    to stand is at least ``MIN_STANDING``."""
    return not shared or acceptance ** (built_on + 1) >= MIN_STANDING
