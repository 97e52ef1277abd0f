"""The one translation of a plan row (services/stage/rows.py): every option decoded once into a
``StepRow``, each malformed one refused there by name, and ``plan_row`` its inverse."""

from __future__ import annotations

from dataclasses import fields

import numpy as np
import pytest

from pipeshard.errors import InvalidArgument
from pipeshard.sampling import Distribution, rng_state
from pipeshard.services.stage.domain import ReturnMode, RowKind, SamplingStep, StepRow
from pipeshard.services.stage.rows import plan_row, row_from_plan
from pipeshard.v1 import activation_pb2 as pb

DECODE = dict(session_id="s", step_id=3, tokens=1, kind=pb.ROW_KIND_DECODE, return_mode=pb.RETURN_MODE_TOP1)


def _decode(positions=(4,), **fields_):
    row = pb.PlanRow(**{**DECODE, **fields_})
    ids = np.arange(len(positions), dtype=np.int64)[None]
    return row_from_plan(row, np.asarray(positions, dtype=np.int64), ids, "owner")


MALFORMED = [
    (dict(session_id=""), "plan.rows.session_id", "must not be empty"),
    (dict(return_mode=99), "plan.rows.return_mode", "unknown value 99"),
    (dict(kind=pb.ROW_KIND_UNSPECIFIED), "plan.rows.kind", "must be PREFILL, DECODE or VERIFY"),
    (dict(return_last=-1), "plan.rows.return_last", "must be >= 0"),
    (dict(tree_chains=-2), "plan.rows.tree_chains", "must be >= 0"),
    (dict(tree_keep=-1), "plan.rows.tree_keep", "must be >= 0"),
    (dict(prefix_reuse_length=-5), "plan.rows.prefix_reuse_length", "must be >= 0"),
    (dict(draft_heads=-1), "plan.rows.draft_heads", "must be >= 0"),
    (dict(slot_id=-2), "plan.rows.slot_id", "must be -1"),
    (
        dict(mask_update=pb.MaskUpdate(invalidate=[pb.CacheRange(start=5, end=3)])),
        "plan.rows.mask_update",
        r"range \[5, 3\)",
    ),
    (dict(head_path_tokens=[1]), "plan.rows.head_path_tokens", "without draft_heads"),
    (dict(return_mode=pb.RETURN_MODE_SAMPLED), "plan.rows.sampling", "is required"),
    (
        dict(return_mode=pb.RETURN_MODE_SAMPLED, sampling=pb.SamplingRequest(temperature=-1.0)),
        "plan.rows.sampling.temperature",
        "",
    ),
    (dict(return_last=2), "kind", "a decode row cannot return 2"),
    (dict(kind=pb.ROW_KIND_VERIFY), "kind", "a verify row cannot return 1"),
    (dict(draft_heads=99, head_path_tokens=[1]), "draft_heads", "must be 0 or in 1.."),
    (dict(draft_heads=2, return_mode=pb.RETURN_MODE_LOGITS), "draft_heads", "must return Top1"),
    (dict(draft_heads=2), "head_path_tokens", "must hold the row's 1 returned token ids"),
    (dict(tree_parents=[0]), "tree_parents", "entry 0 must name an earlier token"),
    (dict(tree_kept=[2, 1]), "tree_kept", "must be ascending"),
    (dict(allowed_tokens=b"\x01", return_mode=pb.RETURN_MODE_LOGITS), "plan.rows.allowed_tokens", "Top1"),
    (
        dict(allowed_tokens=b"\x01", kind=pb.ROW_KIND_VERIFY, return_last=2),
        "plan.rows.allowed_tokens",
        "return_last 1 only",
    ),
]


@pytest.mark.parametrize(
    ("options", "field", "match"), MALFORMED, ids=[m[1] + ":" + m[2][:16] for m in MALFORMED]
)
def test_each_malformed_option_is_refused_by_name(options, field, match):
    with pytest.raises(InvalidArgument, match=f"`{field}`.*{match}") as refused:
        _decode(**options)
    assert refused.value.field == field


def test_a_tree_row_splits_into_its_chains_or_is_refused():
    row = _decode(positions=(4, 5, 4, 5), tokens=4, kind=pb.ROW_KIND_VERIFY, return_last=2, tree_chains=2)
    assert row.tree_chains == 2 and row.tokens == 4
    with pytest.raises(InvalidArgument, match="`tree_chains` must divide"):
        _decode(positions=(4, 5, 6), tokens=3, kind=pb.ROW_KIND_VERIFY, return_last=2, tree_chains=2)


def test_plan_row_is_the_inverse_of_the_decoder_on_every_option():
    sampling = SamplingStep(Distribution(0.7, 5, 0.9), rng_state(np.random.default_rng(11)), [4])
    row = StepRow(
        session_id="s1",
        step_id=9,
        kind=RowKind.VERIFY,
        positions=np.array([10, 11], dtype=np.int64),
        activations=np.array([[5, 4]], dtype=np.int64),
        owner="o",
        invalidate=((12, 14),),
        return_mode=ReturnMode.SAMPLED,
        return_last=2,
        sampling=sampling,
        tree_keep=1,
        tree_kept=(0, 2),
        slot_id=3,
        prefix_reuse_length=7,
        return_features=True,
    )
    back = row_from_plan(plan_row(row), row.positions, row.activations, "o")
    for f in fields(StepRow):
        a, b = getattr(row, f.name), getattr(back, f.name)
        if isinstance(a, np.ndarray):
            np.testing.assert_array_equal(a, b)
        else:
            assert a == b, f.name
    greedy = StepRow(
        "s2", 1, RowKind.VERIFY, np.array([3, 4]), np.array([[1, 2]]), return_last=2, top1_ids_only=True,
        draft_heads=3, head_path_tokens=(1, 2), tree_parents=(-1, 0),
    )  # fmt: skip
    again = row_from_plan(plan_row(greedy), greedy.positions, greedy.activations, "")
    assert (again.top1_ids_only, again.draft_heads, again.head_path_tokens, again.tree_parents) == (
        True, 3, (1, 2), (-1, 0),
    )  # fmt: skip
    masked = StepRow("s3", 2, RowKind.DECODE, np.array([7]), np.array([[1]]), allowed_tokens=b"\x05\x80")
    assert row_from_plan(plan_row(masked), masked.positions, masked.activations, "").allowed_tokens == (
        b"\x05\x80"
    )


def test_the_final_stage_takes_the_top1_among_the_allowed_tokens():
    from pipeshard.services.stage.step_engine import allowed_only

    logits = np.array([[5.0, 1.0, 3.0, 4.0, 9.0, 2.0, 0.0, 7.0, 8.0, 6.0]], dtype=np.float32)
    masked = allowed_only(logits, bytes([0b00001100, 0b10]))  # tokens 2, 3 and 9; none past the mask
    assert int(masked.argmax()) == 9 and np.isneginf(masked[0, [0, 1, 4, 5, 6, 7, 8]]).all()
    assert masked[0, 3] == 4.0
    with pytest.raises(InvalidArgument, match="`allowed_tokens`"):
        allowed_only(logits, bytes(2))


def test_a_tree_of_parents_is_checked_against_its_positions():
    tree = dict(tokens=3, kind=pb.ROW_KIND_VERIFY, return_last=3)
    assert _decode(positions=(6, 7, 7), tree_parents=[-1, 0, 0], **tree).tree_parents == (-1, 0, 0)
    state = rng_state(np.random.default_rng(1))
    sampling = pb.SamplingRequest(temperature=1.0, top_p=1.0, rng_state=state, draft_tokens=[1, 2])
    for positions, options, match in (
        ((6, 7, 9), dict(tree_parents=[-1, 0, 1]), "`tree_parents` entry 2"),
        ((6, 7, 7), dict(tree_parents=[-1, 0]), "`tree_parents` must hold one entry per token"),
        (
            (6, 7, 7),
            dict(tree_parents=[-1, 0, 0], return_mode=pb.RETURN_MODE_SAMPLED, sampling=sampling),
            "`tree_parents` .*SAMPLED",
        ),
    ):
        with pytest.raises(InvalidArgument, match=match):
            _decode(positions=positions, **tree, **options)
