"""What a fleet promises about its answers, from its stages' GetStageInfo: one precision on every
stage (a stage at ``fast`` makes every row load-dependent, so a mixed fleet is refused), and the
``system_fingerprint`` the OpenAI gateway shows, which changes when the export or the promise does."""

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

    @property
    def system_fingerprint(self) -> str:
        """OpenAI's form (``fp_`` and hex) over the export's fingerprint, the precision and whether
        it promises invariance: a client comparing answers sees when either changed."""
        promise = "invariant" if self.invariant else "load-dependent"
        digest = hashlib.sha256(f"{self.model_fingerprint}|{self.precision}|{promise}".encode()).hexdigest()
        return f"fp_{digest[:12]}"


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
    return FleetPromise(fingerprints[0], stages[0].precision, stages[0].invariant)
