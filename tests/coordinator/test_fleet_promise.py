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
    assert DEFAULT_PRECISION == canonical("default") == "invariant" and is_invariant("default")
    assert is_invariant("exact") and not is_invariant("fast") and not is_invariant("f32")
    with pytest.raises(InvalidArgument) as err:
        canonical("bf16")
    assert err.value.field == "precision" and "'bf16'" in str(err.value)


def test_fingerprint_follows_the_export_and_the_promise():
    default = fleet_promise([info(0, "default"), info(1, "invariant")])
    assert default.precision == "invariant" and default.invariant
    fingerprints = {
        default.system_fingerprint,
        fleet_promise([info(0, "exact"), info(1, "exact")]).system_fingerprint,
        fleet_promise([info(0, "fast"), info(1, "fast")]).system_fingerprint,
        fleet_promise([info(0, "invariant", "def"), info(1, "invariant", "def")]).system_fingerprint,
    }
    assert len(fingerprints) == 4 and all(f.startswith("fp_") and len(f) == 15 for f in fingerprints)
    assert fleet_promise([info(0, "invariant")]).system_fingerprint == default.system_fingerprint


def test_mixed_fleets_are_refused_naming_each_stage():
    with pytest.raises(FailedPrecondition) as err:
        fleet_promise([info(0, "exact"), info(1, "fast")])
    assert "stage 0 exact (invariant), stage 1 fast (load-dependent)" in str(err.value)
    with pytest.raises(FailedPrecondition) as err:
        fleet_promise([info(0, "exact", "abc"), info(1, "exact", "xyz")])
    assert "abc, xyz" in str(err.value)


def test_each_stages_configuration_and_fallback_is_in_the_promise():
    """At ``invariant`` each stage proves its own configuration: a stage that fell back changes the
    fingerprint (its tokens differ) and is named in the start line."""
    both = [info(0, "invariant"), info(1, "invariant")]
    for stage in both:
        stage.configuration = "bf16-kv16"
    fast_fleet = fleet_promise(both)
    both[1].configuration, both[1].invariant_fallback = "exact", "bf16-kv16: self-check FAILED: ..."
    fell = fleet_promise(both)
    assert fell.invariant and fell.configurations == ("bf16-kv16", "exact")
    assert fell.system_fingerprint != fast_fleet.system_fingerprint
    assert fell.fallbacks == ("stage 1 serves exact: bf16-kv16: self-check FAILED: ...",)
    assert "stage 0 bf16-kv16, stage 1 exact" in fell.describe() and "fell back" in fell.describe()
    assert "fell back" not in fast_fleet.describe()
