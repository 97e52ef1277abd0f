"""A plan row's options, translated once: the wire's ``PlanRow`` <-> the typed ``StepRow``.

``row_from_plan`` is the one decoder: it reads every option of a row and checks each one the row
carries on its own, by name (a negative count, an unknown kind or return mode, a rewind range
that ends before it starts, tree and draft-head fields that contradict the rest of the row), so
the engines trust a ``StepRow`` and check only what depends on their stage (its sizes, its
backend's tree form, the sampling vocabulary) and on the session (its cache, its room).
``plan_row`` is the one encoder (a stage passing its rows on, the coordinator's token frames).
"""

from __future__ import annotations

import numpy as np

from pipeshard.errors import InvalidArgument
from pipeshard.sampling import Distribution, check_rng_state
from pipeshard.services.stage.domain import ReturnMode, RowKind, SamplingStep, StepRow
from pipeshard.services.stage.step_engine import check_heads, check_kind, check_tree
from pipeshard.v1 import activation_pb2

_MODES = {
    activation_pb2.RETURN_MODE_UNSPECIFIED: ReturnMode.TOP1,
    activation_pb2.RETURN_MODE_TOP1: ReturnMode.TOP1,
    activation_pb2.RETURN_MODE_LOGITS: ReturnMode.LOGITS,
    activation_pb2.RETURN_MODE_NONE: ReturnMode.NONE,
    activation_pb2.RETURN_MODE_SAMPLED: ReturnMode.SAMPLED,
}
_PB_MODES = {
    ReturnMode.TOP1: activation_pb2.RETURN_MODE_TOP1,
    ReturnMode.LOGITS: activation_pb2.RETURN_MODE_LOGITS,
    ReturnMode.NONE: activation_pb2.RETURN_MODE_NONE,
    ReturnMode.SAMPLED: activation_pb2.RETURN_MODE_SAMPLED,
}
_KINDS = {
    activation_pb2.ROW_KIND_PREFILL: RowKind.PREFILL,
    activation_pb2.ROW_KIND_DECODE: RowKind.DECODE,
    activation_pb2.ROW_KIND_VERIFY: RowKind.VERIFY,
}
_PB_KINDS = {kind: pb for pb, kind in _KINDS.items()}

# Counts a row carries that are never negative (0 is each one's "unset").
_COUNTS = ("return_last", "tree_chains", "tree_keep", "prefix_reuse_length", "draft_heads")


def row_from_plan(
    pb: activation_pb2.PlanRow, positions: np.ndarray, activations: np.ndarray, owner: str
) -> StepRow:
    """The typed row of ``pb``, whose ``positions`` [T] and ``activations`` [1, T(, H)] are its
    slice of the frame; a malformed option is INVALID_ARGUMENT naming its ``plan.rows`` field,
    a contradiction between options names the option (``kind``, ``tree_parents``, ...)."""
    if not pb.session_id:
        raise InvalidArgument("plan.rows.session_id", "must not be empty")
    if pb.return_mode not in _MODES:
        raise InvalidArgument("plan.rows.return_mode", f"unknown value {pb.return_mode}")
    if pb.kind not in _KINDS:
        raise InvalidArgument("plan.rows.kind", f"must be PREFILL, DECODE or VERIFY, got {pb.kind}")
    for name in _COUNTS:
        if getattr(pb, name) < 0:
            raise InvalidArgument(f"plan.rows.{name}", f"must be >= 0, got {getattr(pb, name)}")
    if pb.slot_id < -1:
        raise InvalidArgument(
            "plan.rows.slot_id", f"must be -1 (the stage finds it) or a slot, got {pb.slot_id}"
        )
    invalidate = tuple((r.start, r.end) for r in pb.mask_update.invalidate)
    for start, end in invalidate:
        if not 0 <= start <= end:
            raise InvalidArgument(
                "plan.rows.mask_update", f"range [{start}, {end}) is not a range of positions"
            )
    if pb.head_path_tokens and not pb.draft_heads:
        raise InvalidArgument("plan.rows.head_path_tokens", "must be empty without draft_heads")
    if pb.allowed_tokens and (pb.return_mode != activation_pb2.RETURN_MODE_TOP1 or pb.return_last > 1):
        raise InvalidArgument(
            "plan.rows.allowed_tokens", "masks one Top1 position: RETURN_MODE_TOP1 with return_last 1 only"
        )
    sampled = pb.return_mode == activation_pb2.RETURN_MODE_SAMPLED
    row = StepRow(
        session_id=pb.session_id,
        step_id=pb.step_id,
        kind=_KINDS[pb.kind],
        positions=positions,
        activations=activations,
        owner=owner,
        invalidate=invalidate,
        return_mode=_MODES[pb.return_mode],
        return_last=pb.return_last or 1,
        sampling=_sampling_step(pb) if sampled else None,
        tree_chains=max(1, pb.tree_chains),
        tree_keep=pb.tree_keep - 1,
        tree_parents=tuple(pb.tree_parents),
        tree_kept=tuple(pb.tree_kept),
        top1_ids_only=pb.top1_ids_only,
        slot_id=pb.slot_id,
        prefix_reuse_length=pb.prefix_reuse_length,
        return_features=pb.return_features,
        draft_heads=pb.draft_heads,
        head_path_tokens=tuple(pb.head_path_tokens),
        allowed_tokens=pb.allowed_tokens,
    )
    check_row(row)
    return row


def plan_row(row: StepRow) -> activation_pb2.PlanRow:
    """The PlanRow of a typed row (the inverse of :func:`row_from_plan` on its options)."""
    sampling = row.sampling
    return activation_pb2.PlanRow(
        slot_id=row.slot_id,
        position=int(row.positions[0]) if len(row.positions) else 0,
        prefix_reuse_length=row.prefix_reuse_length,
        session_id=row.session_id,
        step_id=row.step_id,
        tokens=row.tokens,
        return_mode=_PB_MODES[row.return_mode],
        return_last=row.return_last,
        mask_update=activation_pb2.MaskUpdate(
            invalidate=[activation_pb2.CacheRange(start=s, end=e) for s, e in row.invalidate]
        ),
        sampling=_sampling_request(sampling) if sampling is not None else None,
        kind=_PB_KINDS[row.kind],
        tree_chains=row.tree_chains if row.tree_chains > 1 else 0,
        tree_keep=row.tree_keep + 1,
        tree_parents=row.tree_parents,
        tree_kept=row.tree_kept,
        top1_ids_only=row.top1_ids_only,
        return_features=row.return_features,
        draft_heads=row.draft_heads,
        head_path_tokens=row.head_path_tokens,
        allowed_tokens=row.allowed_tokens,
    )


def _sampling_step(pb: activation_pb2.PlanRow) -> SamplingStep:
    if not pb.HasField("sampling"):
        raise InvalidArgument("plan.rows.sampling", "is required with RETURN_MODE_SAMPLED")
    s = pb.sampling
    dist = Distribution(s.temperature, s.top_k, s.top_p)
    dist.check("plan.rows.sampling.")
    check_rng_state(s.rng_state, "plan.rows.sampling.rng_state")
    return SamplingStep(dist, s.rng_state, list(s.draft_tokens))


def _sampling_request(step: SamplingStep) -> activation_pb2.SamplingRequest:
    d = step.distribution
    return activation_pb2.SamplingRequest(
        temperature=d.temperature,
        top_k=d.top_k,
        top_p=d.top_p,
        rng_state=step.rng_state,
        draft_tokens=step.draft_tokens,
    )


def check_row(row: StepRow) -> None:
    """The row's options agree with each other: its kind with what it returns, its tree with its
    tokens, its draft heads with its return mode (what no stage or session changes)."""
    check_kind(row)
    check_tree(row)
    if row.draft_heads:
        check_heads(row)
