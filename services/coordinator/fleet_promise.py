"""What a fleet promises about its answers, from its stages' GetStageInfo: one precision on every
stage (a stage at ``fast`` makes every row load-dependent, so a mixed fleet is refused), the
configuration each stage proved (at ``invariant`` each paged stage walks the ladder on its own
CPU, so one may have fallen back: said at start and in ``pipeshard top``), and the
``system_fingerprint`` the OpenAI gateway shows, which changes when the export, the promise or a
stage's configuration does: the tokens are reproducible on fleets that share it."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from pipeshard.errors import FailedPrecondition
from pipeshard.v1 import stage_pb2


@dataclass(frozen=True)
class FleetPromise:
    model_fingerprint: str
    precision: str
    invariant: bool
    configurations: tuple[str, ...] = ()  # per stage, what it compiled (GetStageInfo.configuration)
    fallbacks: tuple[str, ...] = ()  # per stage that fell back: "stage N: what failed"

    @property
    def system_fingerprint(self) -> str:
        """OpenAI's form (``fp_`` and hex) over the export's fingerprint, the precision, whether
        it promises invariance and each stage's configuration: a client comparing answers sees
        when any of them changed."""
        promise = "invariant" if self.invariant else "load-dependent"
        parts = [self.model_fingerprint, self.precision, promise]
        if any(self.configurations):  # stages before GetStageInfo.configuration: the old form
            parts.append(",".join(self.configurations))
        digest = hashlib.sha256("|".join(parts).encode()).hexdigest()
        return f"fp_{digest[:12]}"

    def describe(self) -> str:
        """One line for the start log: the promise, each stage's configuration, any fallback."""
        promise = "invariant" if self.invariant else "load-dependent"
        stages = ", ".join(f"stage {i} {c}" for i, c in enumerate(self.configurations) if c)
        fell = f"; fell back: {' | '.join(self.fallbacks)}" if self.fallbacks else ""
        return f"{self.precision} ({promise}{': ' + stages if stages else ''}){fell}"


def fleet_promise(stages: list[stage_pb2.GetStageInfoResponse]) -> FleetPromise:
    """The promise every stage shares; stages at different precisions (or invariance) are refused,
    naming each stage's."""
    kinds = {(info.precision, info.invariant) for info in stages}
    if len(kinds) > 1:
        each = ", ".join(
            f"stage {info.stage_index} {info.precision or '?'} "
            f"({'invariant' if info.invariant else 'load-dependent'})"
            for info in stages
        )
        raise FailedPrecondition(
            f"the stages run different precisions ({each}): start them with one --precision"
        )
    fingerprints = sorted({info.model_fingerprint for info in stages})
    if len(fingerprints) > 1:
        raise FailedPrecondition(
            f"the stages serve different exports (model fingerprints {', '.join(fingerprints)})"
        )
    return FleetPromise(
        fingerprints[0],
        stages[0].precision,
        stages[0].invariant,
        tuple(info.configuration for info in stages),
        tuple(
            f"stage {info.stage_index} serves {info.configuration}: {info.invariant_fallback}"
            for info in stages
            if info.invariant_fallback
        ),
    )
