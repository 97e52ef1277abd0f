"""The coordinator's token frame is built as protobuf directly: the same frame as its StepRow
written by frame_from_step, and it reads back as that row."""

from __future__ import annotations

import numpy as np
import pytest

from pipeshard.sampling import Distribution, rng_state
from pipeshard.services.stage.domain import ReturnMode, RowKind, SamplingStep, Step, StepRow
from pipeshard.services.stage.wire import frame_from_step, step_from_frame, token_frame, tree_positions

CASES = {
    "decode": dict(ids=[7], start=30, greedy=True),
    "decode without probabilities": dict(ids=[7], start=30, greedy=True, probabilities=False),
    "prefill chunk": dict(ids=[1, 2, 3, 4], start=0, greedy=True, fill_only=True),
    "last prompt chunk": dict(ids=[1, 2, 3], start=4, greedy=False),
    "verify with a rewind": dict(ids=[5, 6, 7], start=9, greedy=True, return_last=3, invalidate=[(9, 11)]),
    "sampled": dict(
        ids=[5, 6],
        start=2,
        greedy=False,
        return_last=2,
        sampling=SamplingStep(Distribution(0.7, 20, 0.9), rng_state(np.random.default_rng(3)), [6]),
    ),
    "tree chains": dict(ids=[1, 2, 3, 4], start=6, greedy=True, return_last=2, chains=2, keep_chain=1),
    "tree parents": dict(
        ids=[1, 2, 3, 4],
        start=6,
        greedy=True,
        return_last=4,
        parents=(-1, 0, 0, 2),
        kept=(0, 1),
        features=True,
    ),
}


def _row(ids, start, greedy, *, fill_only=False, return_last=1, invalidate=(), sampling=None, chains=1,
         keep_chain=-1, parents=(), kept=(), probabilities=True, features=False) -> StepRow:  # fmt: skip
    """The row as the coordinator means it (what token_frame's arguments say)."""
    if fill_only:
        mode, sampling = ReturnMode.NONE, None
    else:
        mode = ReturnMode.SAMPLED if sampling else ReturnMode.TOP1 if greedy else ReturnMode.LOGITS
    kind = (
        RowKind.VERIFY
        if return_last > 1
        else RowKind.PREFILL
        if fill_only or len(ids) > 1
        else RowKind.DECODE
    )
    positions = (
        tree_positions(start, parents)
        if parents
        else np.tile(np.arange(start, start + len(ids) // chains, dtype=np.int64), chains)
    )
    return StepRow(
        session_id="s",
        step_id=4,
        kind=kind,
        positions=positions,
        activations=np.asarray([ids], dtype=np.int64),
        invalidate=tuple(invalidate),
        return_mode=mode,
        return_last=return_last,
        sampling=sampling,
        tree_chains=chains,
        tree_keep=keep_chain,
        tree_parents=tuple(parents),
        tree_kept=tuple(kept),
        top1_ids_only=mode is ReturnMode.TOP1 and not probabilities,
        return_features=features and not fill_only,
    )


@pytest.mark.parametrize("case", CASES)
def test_token_frame_is_its_rows_frame_and_reads_back_as_it(case):
    args = CASES[case]
    frame = token_frame("s", 4, **args)
    expected = _row(**args)
    written = frame_from_step(Step([expected]))
    frame.sent_unix_nanos = written.sent_unix_nanos = 0
    assert frame == written
    (row,) = step_from_frame(frame, "input_ids").rows
    assert row.positions.tolist() == expected.positions.tolist()
    assert row.activations.tolist() == expected.activations.tolist()
    for name in ("kind", "invalidate", "return_mode", "return_last", "sampling", "tree_chains", "tree_keep",
                 "tree_parents", "tree_kept", "top1_ids_only", "return_features"):  # fmt: skip
        assert getattr(row, name) == getattr(expected, name), name
