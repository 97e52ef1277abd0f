"""The coordinator asks the fleet what its KV backend lets it do (services/coordinator/fleet_kv.py):
the stages' GetStageInfo answers, built by each stage's backend, decide the ring; a fleet of
different backends is refused at start, naming the stages."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pipeshard.errors import FailedPrecondition, InvalidArgument
from pipeshard.services.coordinator.fleet_kv import FleetKv
from pipeshard.services.coordinator.ring import Ring
from pipeshard.services.coordinator.step_batcher import DEFAULT_PREFILL_CHUNK, PAGED_PREFILL_CHUNK
from pipeshard.services.stage.backends import PagedBackend, StatefulBackend, StaticBackend
from pipeshard.v1 import stage_pb2


def _info(backend, stage: int) -> stage_pb2.GetStageInfoResponse:
    info = stage_pb2.GetStageInfoResponse(stage_index=stage)
    backend.describe(SimpleNamespace(slots=4, chunk=16, proof=None, moves_slots=True), info)
    return info


def _fleet(*backends) -> list[stage_pb2.GetStageInfoResponse]:
    return [_info(b, i) for i, b in enumerate(backends)]


def test_the_ring_follows_what_the_stages_answer():
    stateful = FleetKv.agreed("auto", _fleet(StatefulBackend(), StatefulBackend()))
    assert (stateful.backend, stateful.batches_steps, stateful.truncates_on_rewind) == (
        "stateful",
        False,
        False,
    )
    assert (stateful.row_tokens, stateful.tree_form) == (0, stage_pb2.DRAFT_TREE_FORM_CHAINS)
    paged = FleetKv.agreed("paged", _fleet(PagedBackend(), PagedBackend()))
    assert (paged.batches_steps, paged.truncates_on_rewind, paged.prefix_reuse, paged.row_tokens) == (
        True, True, False, 0,
    )  # fmt: skip
    static = FleetKv.agreed("auto", _fleet(StaticBackend(), StaticBackend()))
    assert (static.batches_steps, static.truncates_on_rewind, static.prefix_reuse, static.row_tokens) == (
        True, True, True, 16,
    )  # fmt: skip
    assert static.tree_form == stage_pb2.DRAFT_TREE_FORM_UNSPECIFIED


@pytest.mark.parametrize(
    ("backend", "batches", "truncates", "trees", "chunk"),
    [
        (StatefulBackend(), False, False, True, DEFAULT_PREFILL_CHUNK),
        (PagedBackend(), True, True, True, PAGED_PREFILL_CHUNK),
        (StaticBackend(), True, True, False, 16),
    ],
    ids=["stateful", "paged", "static"],
)
def test_the_ring_is_given_what_the_fleet_reports_not_a_flag(backend, batches, truncates, trees, chunk):
    """``Ring(stages, kv)``: whether it batches steps, truncates on rewind, drafts trees and how
    long its prefill rows are all follow the stages' answers."""
    kv = FleetKv.agreed("auto", _fleet(backend, backend))
    ring = Ring(SimpleNamespace(num_stages=2), kv)
    assert (ring.batch_steps is not None, ring.truncates_on_rewind) == (batches, truncates)
    assert (ring.verifies_trees, ring.prefill_chunk, ring.kv) == (trees, chunk, kv)
    if batches:
        assert ring.batch_steps is not None and ring.batch_steps.inflight == 2  # one per stage


def test_a_fleet_of_different_backends_is_refused_naming_its_stages():
    with pytest.raises(FailedPrecondition) as refused:
        FleetKv.agreed("auto", _fleet(PagedBackend(), StatefulBackend(), PagedBackend()))
    message = str(refused.value)
    assert "stage 0 runs paged" in message and "stage 1 runs stateful" in message
    assert "stage 2 runs paged" in message and "same --kv" in message


def test_stages_of_one_name_but_other_traits_are_refused_too():
    odd = _info(StaticBackend(), 1)
    odd.static_chunk = 8  # a static stage exported with another chunk
    with pytest.raises(FailedPrecondition, match=r"stage 1 runs static .*row_tokens=8"):
        FleetKv.agreed("auto", [_info(StaticBackend(), 0), odd])


def test_a_kv_flag_the_stages_do_not_run_is_refused_by_name():
    with pytest.raises(InvalidArgument, match="`kv` is stateful but the stages run paged"):
        FleetKv.agreed("stateful", _fleet(PagedBackend(), PagedBackend()))


def test_a_fleet_without_stages_is_refused():
    with pytest.raises(FailedPrecondition, match="no stages"):
        FleetKv.agreed("auto", [])
