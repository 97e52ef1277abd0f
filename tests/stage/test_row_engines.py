"""The step interface (services/stage/step_engine.py): the stateful and the paged engines pass the
same row-level tests, over fake models whose logits favour token (position + 3) % VOCAB."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from pipeshard.errors import InvalidArgument, NotFound, PipeshardError
from pipeshard.sampling import Distribution, rng_state
from pipeshard.services.stage.domain import ReturnMode, RowKind, SamplingStep, Step, StepRow
from pipeshard.services.stage.engine import StageEngine
from pipeshard.services.stage.paged_engine import PagedEngine
from pipeshard.services.stage.sessions import SessionTable

VOCAB, HIDDEN, MAX_CONTEXT = 11, 4, 64
OWNER = "owner-a"


def _logits(positions: np.ndarray) -> np.ndarray:
    out = np.zeros((len(positions), VOCAB), np.float32)
    out[np.arange(len(positions)), (positions + 3) % VOCAB] = 5.0
    return out


def _hidden(positions: np.ndarray) -> np.ndarray:
    return np.repeat(positions.astype(np.float32)[:, None], HIDDEN, axis=1)


class FakeSession:
    """A stateful session: its cache grows by every row it runs; rewinds are masks."""

    is_last = True

    def __init__(self):
        self.past_length = 0
        self.masked: list[tuple[int, int]] = []

    def run(self, x, position_ids, return_last=1):
        self.past_length += x.shape[1]
        positions = position_ids[0]
        if not self.is_last:
            return _hidden(positions)[None]
        return _logits(positions[-return_last:])[None]

    def invalidate(self, start, end):
        self.masked.append((start, end))

    def reset(self):
        self.past_length = 0


class FakePagedShard:
    """A paged shard's bookkeeping and a fake model: lengths per sequence, rewinds shorten."""

    stage_index, hidden_size, max_context, vocab_size = 0, HIDDEN, MAX_CONTEXT, VOCAB
    block_tokens, blocks_total = 8, 64

    def __init__(self, is_last: bool):
        self.is_first, self.is_last = True, is_last
        self.lengths: dict = {}
        self.rooms: dict = {}
        self.steps = 0

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_tokens)

    def usage(self):
        used = sum(self.blocks_for(r) for r in self.rooms.values())
        return SimpleNamespace(blocks_free=self.blocks_total - used)

    def open(self, seq, capacity: int) -> None:
        self.rooms[seq], self.lengths[seq] = self.blocks_for(capacity) * self.block_tokens, 0

    def free(self, seq) -> None:
        del self.rooms[seq], self.lengths[seq]

    def capacity(self, seq) -> int:
        return self.rooms[seq]

    def length(self, seq) -> int:
        return self.lengths[seq]

    def rewind(self, seq, length: int) -> None:
        self.lengths[seq] = length

    def step(self, rows):
        self.steps += 1
        outs = []
        for row in rows:
            self.lengths[row.seq] += len(row.inputs)
            if self.is_last:
                outs.append(_logits(row.positions[len(row.positions) - row.logits :]))
            else:
                outs.append(_hidden(row.positions))
        return outs

    def step_features(self, rows):
        outs = self.step(rows)
        return outs, ([out[:, :1] for out in outs] if self.is_last else None)


def make_engine(backend: str, is_last: bool = True):
    if backend == "stateful":
        session_class = type("Session", (FakeSession,), {"is_last": is_last})
        engine = StageEngine(
            SessionTable(session_class, 8, 60.0),
            is_first=True,
            is_last=is_last,
            hidden_size=HIDDEN,
            max_context=MAX_CONTEXT,
            vocab_size=VOCAB,
        )
    else:
        engine = PagedEngine(FakePagedShard(is_last), max_sessions=8, idle_timeout_s=60.0)
    for session in ("a", "b", "c"):
        engine.open(OWNER, session, 32)
    return engine


def row(session: str, kind: RowKind, ids: list[int], start: int, **kw) -> StepRow:
    return StepRow(
        session_id=session,
        step_id=0,
        kind=kind,
        positions=np.arange(start, start + len(ids), dtype=np.int64),
        activations=np.asarray([ids], np.int64),
        owner=OWNER,
        **kw,
    )


def prefill(session: str, n: int, start: int = 0, last: bool = False) -> StepRow:
    mode = ReturnMode.TOP1 if last else ReturnMode.NONE
    return row(session, RowKind.PREFILL, [1] * n, start, return_mode=mode)


def length(engine, session: str) -> int:
    return engine.sessions.get(OWNER, session).past_length


BACKENDS = ["stateful", "paged"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_prefill_chunk_fills_the_cache_and_the_last_returns_its_last_position(backend):
    e = make_engine(backend)
    (chunk,) = e.run([prefill("a", 5)])
    assert chunk.top1 is None and chunk.logits is None and length(e, "a") == 5
    (last,) = e.run([prefill("a", 3, start=5, last=True)])
    assert last.top1.token_ids.tolist() == [(7 + 3) % VOCAB] and length(e, "a") == 8


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_rows_of_several_sessions_answer_each_their_own(backend):
    e = make_engine(backend)
    e.run([prefill("a", 4), prefill("b", 6)])
    outs = e.run([row("a", RowKind.DECODE, [2], 4), row("b", RowKind.DECODE, [2], 6)])
    assert [(o.row.session_id, o.top1.token_ids.tolist()) for o in outs] == [("a", [7]), ("b", [9])]
    assert (length(e, "a"), length(e, "b")) == (5, 7)


@pytest.mark.parametrize("backend", BACKENDS)
def test_verify_with_a_rewind_of_the_rejected_tail_returns_a_position_per_token(backend):
    e = make_engine(backend)
    e.run([prefill("a", 4)])
    e.run([row("a", RowKind.VERIFY, [2, 3, 4], 4, return_last=3)])  # 7 written, two drafts rejected
    (out,) = e.run([row("a", RowKind.VERIFY, [5, 6], 5, return_last=2, invalidate=((5, 7),))])
    assert out.top1.token_ids.tolist() == [8, 9]
    # The paged cache drops the tail; the stateful one keeps it masked.
    assert length(e, "a") == (7 if backend == "paged" else 9)
    if backend == "stateful":
        assert e.sessions.get(OWNER, "a").masked == [(5, 7)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_return_modes(backend):
    e = make_engine(backend)
    sampling = SamplingStep(Distribution(0.7, 0, 1.0), rng_state(np.random.default_rng(3)), [4])
    top1, logits, sampled = e.run(
        [
            row("a", RowKind.DECODE, [1], 0),
            row("b", RowKind.DECODE, [1], 2, return_mode=ReturnMode.LOGITS),
            row(
                "c",
                RowKind.VERIFY,
                [1, 4],
                0,
                return_mode=ReturnMode.SAMPLED,
                return_last=2,
                sampling=sampling,
            ),
        ]
    )
    assert top1.top1.token_ids.tolist() == [3] and top1.logits is None
    assert logits.logits.shape == (1, VOCAB) and logits.logits.argmax() == 5 and logits.top1 is None
    assert 1 <= len(sampled.sampled.token_ids) <= 2 and sampled.sampled.rng_state != sampling.rng_state


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_non_final_stage_returns_each_rows_hidden_states(backend):
    e = make_engine(backend, is_last=False)
    a, b = e.run([prefill("a", 3), row("b", RowKind.DECODE, [1], 0)])
    assert a.hidden_states.shape == (1, 3, HIDDEN) and b.hidden_states.shape == (1, 1, HIDDEN)
    assert a.hidden_states[0, :, 0].tolist() == [0.0, 1.0, 2.0]


BAD_ROWS = [
    (lambda: row("b", RowKind.DECODE, [1, 2], 0, return_last=2), InvalidArgument, "`kind`"),
    (lambda: row("b", RowKind.VERIFY, [1], 0), InvalidArgument, "`kind`"),
    (lambda: row("b", RowKind.DECODE, [VOCAB], 0), InvalidArgument, r"`input_ids` must lie in \[0, 11\)"),
    (lambda: replace(prefill("b", 2), positions=np.arange(1)), InvalidArgument, "`positions`"),
    (lambda: row("b", RowKind.DECODE, [1], 0, invalidate=((0, 5),)), InvalidArgument, "`mask_update`"),
    (lambda: row("b", RowKind.DECODE, [1], 0, return_mode=ReturnMode.SAMPLED), InvalidArgument, "`sampling`"),
    (
        lambda: replace(prefill("b", 1), attention_mask=np.ones((1, 1), bool)),
        InvalidArgument,
        "`attention_mask`",
    ),
    (lambda: row("zz", RowKind.DECODE, [1], 0), NotFound, "unknown session 'zz'"),
    (
        lambda: replace(row("b", RowKind.DECODE, [1], 0), owner="someone-else"),
        NotFound,
        "unknown session 'b'",
    ),
    (lambda: row("a", RowKind.DECODE, [1], 0), InvalidArgument, "`session_id`.*two rows in one step"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("bad", "error", "match"), BAD_ROWS)
def test_a_bad_row_is_refused_by_name_and_the_other_rows_still_run(backend, bad, error, match):
    e = make_engine(backend)
    good_a, bad_row, good_c = e.run(
        [row("a", RowKind.DECODE, [1], 0), bad(), row("c", RowKind.DECODE, [1], 0)]
    )
    assert isinstance(bad_row, error) and isinstance(bad_row, PipeshardError)
    with pytest.raises(error, match=match):
        raise bad_row
    assert good_a.top1.token_ids.tolist() == good_c.top1.token_ids.tolist() == [3]
    assert length(e, "b") == 0  # the refused row touched nothing


@pytest.mark.parametrize("backend", BACKENDS)
def test_run_step_adds_this_stages_compute_time(backend):
    e = make_engine(backend)
    step = Step([prefill("a", 2)], OWNER, compute_micros=[17])
    (out,) = e.run_step(step)
    assert out.row.session_id == "a" and len(step.compute_micros) == 2 and step.compute_micros[0] == 17
