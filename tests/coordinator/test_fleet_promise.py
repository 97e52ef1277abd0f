"""A fleet's promise: one precision on every stage, and a system_fingerprint that follows the
export and the promise."""

from __future__ import annotations

import pytest

from pipeshard.errors import FailedPrecondition, InvalidArgument
from pipeshard.precision import DEFAULT_PRECISION, canonical, is_invariant
from pipeshard.services.coordinator.fleet_promise import fleet_promise
from pipeshard.v1 import stage_pb2


def info(stage: int, precision: str, fingerprint: str = "abc") -> stage_pb2.GetStageInfoResponse:
    return stage_pb2.GetStageInfoResponse(
        stage_index=stage,
        model_fingerprint=fingerprint,
        precision=canonical(precision),
        invariant=is_invariant(precision),
    )


def test_default_is_the_invariant_precision():
    assert DEFAULT_PRECISION == canonical("default") == "exact" and is_invariant("default")
    assert not is_invariant("fast") and not is_invariant("f32")
    with pytest.raises(InvalidArgument) as err:
        canonical("bf16")
    assert err.value.field == "precision" and "'bf16'" in str(err.value)


def test_fingerprint_follows_the_export_and_the_promise():
    exact = fleet_promise([info(0, "default"), info(1, "exact")])
    assert exact.precision == "exact" and exact.invariant
    fingerprints = {
        exact.system_fingerprint,
        fleet_promise([info(0, "fast"), info(1, "fast")]).system_fingerprint,
        fleet_promise([info(0, "exact", "def"), info(1, "exact", "def")]).system_fingerprint,
    }
    assert len(fingerprints) == 3 and all(f.startswith("fp_") and len(f) == 15 for f in fingerprints)
    assert fleet_promise([info(0, "exact")]).system_fingerprint == exact.system_fingerprint


def test_mixed_fleets_are_refused_naming_each_stage():
    with pytest.raises(FailedPrecondition) as err:
        fleet_promise([info(0, "exact"), info(1, "fast")])
    assert "stage 0 exact (invariant), stage 1 fast (load-dependent)" in str(err.value)
    with pytest.raises(FailedPrecondition) as err:
        fleet_promise([info(0, "exact", "abc"), info(1, "exact", "xyz")])
    assert "abc, xyz" in str(err.value)
