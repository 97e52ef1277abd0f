"""The step interface (services/stage/step_engine.py): the stateful, paged and static engines pass
the same row-level tests, over fake models whose logits favour token (position + 3) % VOCAB."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from pipeshard.errors import InvalidArgument, NotFound, PipeshardError, Unimplemented
from pipeshard.sampling import Distribution, rng_state
from pipeshard.services.stage.backends import PagedBackend
from pipeshard.services.stage.domain import ReturnMode, RowKind, SamplingStep, Step, StepRow, TreeForm
from pipeshard.services.stage.engine import StageEngine
from pipeshard.services.stage.paged_engine import PagedEngine
from pipeshard.services.stage.sessions import SessionTable
from pipeshard.services.stage.static_engine import StaticEngine
from pipeshard.shard.self_check import Proof, SelfCheck
from pipeshard.shard.static import StaticShard

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
    kv_source = SimpleNamespace(blocks=None)  # f32 pools: draft trees' paths can move
    moves_slots = True
    proof = None  # no self-check ran (a precision with no promise)

    def __init__(self, is_last: bool):
        self.is_first, self.is_last = True, is_last
        self.lengths: dict = {}
        self.rooms: dict = {}
        self.steps = 0
        self.moves: list = []
        self.parents: list = []

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

    def move(self, seq, start: int, kept) -> None:
        self.moves.append((start, tuple(kept)))

    def step(self, rows):
        self.steps += 1
        outs = []
        for row in rows:
            self.parents.append(row.parents)
            self.lengths[row.seq] += len(row.inputs)
            if self.is_last:
                outs.append(_logits(row.positions[len(row.positions) - row.logits :]))
            else:
                outs.append(_hidden(row.positions))
        return outs

    def step_features(self, rows):
        outs = self.step(rows)
        return outs, ([out[:, :1] for out in outs] if self.is_last else None)


class FakeStaticShard:
    """A static shard's slots and checks (the real ones) over a fake model."""

    stage_index, hidden_size, max_context, vocab_size = 0, HIDDEN, MAX_CONTEXT, VOCAB
    slots, chunk, name = 4, 8, "static shard fake stage 0 (4 slots x 8)"
    check = StaticShard.check
    acquire = StaticShard.acquire
    release = StaticShard.release
    length = StaticShard.length
    rewind = StaticShard.rewind
    slots_used = StaticShard.slots_used

    def __init__(self, is_last: bool):
        import threading

        self.is_first, self.is_last = True, is_last
        self.lengths = np.zeros(self.slots, np.int64)
        self._free = list(range(self.slots - 1, -1, -1))
        self._lock = threading.Lock()
        self.steps = 0

    def step(self, rows):
        self.steps += 1
        outs = []
        for row in rows:
            self.check(row)
            self.lengths[row.slot] = row.start + len(row.positions)
            if self.is_last:
                outs.append(_logits(row.positions[len(row.positions) - row.logits :]))
            else:
                outs.append(_hidden(row.positions))
        return outs


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
    elif backend == "static":
        engine = StaticEngine(FakeStaticShard(is_last), max_sessions=8, idle_timeout_s=60.0)
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


BACKENDS = ["stateful", "paged", "static"]


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
    # The paged and static caches drop the tail; the stateful one keeps it masked.
    assert length(e, "a") == (9 if backend == "stateful" else 7)
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
    (lambda: row("b", RowKind.DECODE, [VOCAB], 0), InvalidArgument, r"`input_ids` must lie in \[0, 11\)"),
    (lambda: replace(prefill("b", 2), positions=np.arange(1)), InvalidArgument, "`positions`"),
    (lambda: row("b", RowKind.DECODE, [1], 0, invalidate=((0, 5),)), InvalidArgument, "`mask_update`"),
    (lambda: row("b", RowKind.DECODE, [1], 0, return_mode=ReturnMode.SAMPLED), InvalidArgument, "`sampling`"),
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


def test_each_backend_refuses_the_other_backends_tree_form_by_name():
    chains = replace(row("b", RowKind.VERIFY, [1, 2, 1, 3], 0, return_last=2), tree_chains=2)
    chains = replace(chains, positions=np.array([0, 1, 0, 1]))
    (out,) = make_engine("paged").run([chains])
    assert isinstance(out, InvalidArgument) and "`tree_chains`" in str(out) and "--kv stateful" in str(out)
    masked = row("b", RowKind.VERIFY, [1, 2, 3], 0, return_last=3, tree_parents=(-1, 0, 0))
    masked = replace(masked, positions=np.array([0, 1, 1]))
    (out,) = make_engine("stateful").run([masked])
    assert isinstance(out, InvalidArgument) and "`tree_parents`" in str(out) and "--kv paged" in str(out)


def _tree_row(session: str, start: int) -> StepRow:
    """The pending token, then a tree: node 0 -> {1, 2}, node 3 beside node 0 (row parents)."""
    parents = (-1, 0, 1, 1, 0)
    out = row(session, RowKind.VERIFY, [1, 4, 5, 6, 7], start, return_last=5, tree_parents=parents)
    return replace(out, positions=start + np.array([0, 1, 2, 2, 1]))


def test_paged_tree_row_runs_masked_and_the_next_row_keeps_its_path():
    e = make_engine("paged")
    e.run([prefill("a", 6), prefill("b", 3)])
    tree, other = e.run([_tree_row("a", 6), row("b", RowKind.DECODE, [2], 3)])
    assert tree.top1.token_ids.tolist() == [(p + 3) % VOCAB for p in (6, 7, 8, 8, 7)]
    assert e.shard.parents[-2:] == [(-1, 0, 1, 1, 0), None]  # the causal row stays causal
    assert length(e, "a") == 11 and other.top1.token_ids.tolist() == [(3 + 3) % VOCAB]
    # accepted: node 0 then its second child (row tokens 1, 3); the other two nodes' slots go
    keep = row("a", RowKind.DECODE, [9], 9, tree_kept=(0, 1, 3), invalidate=((9, 11),))
    (out,) = e.run([keep])
    assert not isinstance(out, Exception), out
    assert e.shard.moves == [(6, (0, 1, 3))] and length(e, "a") == 10


BAD_AFTER_TREE = [
    (dict(tree_kept=(0, 2)), "`tree_kept` .*not a path"),  # 2's parent is 1, not 0
    (dict(tree_kept=(0, 1, 4)), "`tree_kept` .*not a path"),  # 4 hangs off 0, not 1
    (dict(tree_kept=(0, 9)), "`tree_kept` .*not a path"),  # beyond the row
    # nothing moves: the leading path (pending, node 0, node 1) may stay, not a fourth slot
    (dict(invalidate=((10, 11),)), "`tree_kept` .*path only"),
]


@pytest.mark.parametrize(("fields", "match"), BAD_AFTER_TREE)
def test_a_row_after_a_tree_row_keeps_a_path_or_is_refused_by_name(fields, match):
    e = make_engine("paged")
    e.run([prefill("a", 6)])
    e.run([_tree_row("a", 6)])
    fields = {"invalidate": ((9, 11),), **fields}
    (out,) = e.run([row("a", RowKind.DECODE, [9], 9, **fields)])
    with pytest.raises(InvalidArgument, match=match):
        raise out
    assert e.shard.moves == [] and length(e, "a") == 11  # nothing moved or dropped


def test_a_tree_rows_leading_path_may_stay_without_a_move():
    e = make_engine("paged")
    e.run([prefill("a", 6)])
    e.run([_tree_row("a", 6)])
    (out,) = e.run([row("a", RowKind.DECODE, [9], 9, invalidate=((9, 11),))])
    assert not isinstance(out, Exception), out
    assert e.shard.moves == [] and length(e, "a") == 10


def test_paged_tree_rows_are_checked_by_name():
    """What the session decides (a path named after a row that was not a tree row); a tree row's
    own shape is the decoder's check (tests/stage/test_rows.py)."""
    e = make_engine("paged")
    e.run([prefill("a", 6)])
    (out,) = e.run([row("a", RowKind.DECODE, [9], 6, tree_kept=(0,))])
    with pytest.raises(InvalidArgument, match=r"`tree_kept` .*not a tree row"):
        raise out
    assert length(e, "a") == 6


def test_paged_trees_need_pools_of_one_value_per_slot():
    e = make_engine("paged")
    e.shard.moves_slots = False  # a u8 pool: its blocks hold each token's scales too
    e.run([prefill("a", 6)])
    (out,) = e.run([_tree_row("a", 6)])
    with pytest.raises(InvalidArgument, match=r"`tree_parents` .*one value per slot .*u8"):
        raise out


def test_a_paged_stage_at_a_bit_identity_promise_verifies_no_trees():
    """A tree row's masked keys change how the attention kernel accumulates, so a paged stage whose
    configuration promises bit-identical rows takes no tree (it reports none, a tree row is refused
    by name); one that promises a tolerance (``exact``) or nothing takes them where slots move."""
    shard = FakePagedShard(True)
    for tolerance, form in ((0.0, TreeForm.NONE), (1e-3, TreeForm.PARENTS)):
        shard.proof = Proof("x", SelfCheck(True, 0.0, tolerance, "all shapes", 0.1))
        assert PagedBackend().tree_form(shard) is form
    shard.proof = None
    assert PagedBackend().tree_form(shard) is TreeForm.PARENTS
    shard.moves_slots = False
    assert PagedBackend().tree_form(shard) is TreeForm.NONE
    e = make_engine("paged")
    e.tree_form = TreeForm.NONE
    e.run([prefill("a", 6)])
    (out,) = e.run([_tree_row("a", 6)])
    with pytest.raises(InvalidArgument, match=r"`tree_parents` this paged stage verifies no draft trees"):
        raise out
    assert length(e, "a") == 6


def test_static_rows_name_their_slot_and_bad_slots_chunks_and_positions_are_refused_by_name():
    e = make_engine("static")
    (a,) = e.run([prefill("a", 3, last=True)])
    assert a.row.slot_id == 0  # written into the row the stage passes on (the next plan frame)
    slot_b = e.sessions.get(OWNER, "b").slot
    bad = [
        (replace(prefill("b", 2), slot_id=9), r"`slot_id` must be -1 or in \[0, 4\)"),
        (replace(prefill("b", 2), slot_id=0), f"`slot_id` session 'b' holds slot {slot_b}, not 0"),
        (prefill("b", 9), r"`tokens` a row holds at most 8 tokens on the static shard"),
        (row("b", RowKind.DECODE, [1], MAX_CONTEXT), r"`positions` must lie in \[0, 64\)"),
        (replace(prefill("b", 2), prefix_reuse_length=5), r"`prefix_reuse_length` must be in \[0, 0\]"),
    ]
    for bad_row, match in bad:
        (out,) = e.run([bad_row])
        assert isinstance(out, InvalidArgument), match
        with pytest.raises(InvalidArgument, match=match):
            raise out
    assert length(e, "b") == 0
    (ok,) = e.run([replace(prefill("b", 2), slot_id=slot_b)])
    assert ok.row.slot_id == slot_b and length(e, "b") == 2


def test_static_prefix_reuse_continues_after_the_kept_positions():
    e = make_engine("static")
    e.run([prefill("a", 6)])
    (out,) = e.run([replace(prefill("a", 2, start=4, last=True), prefix_reuse_length=4)])
    assert out.top1.token_ids.tolist() == [(5 + 3) % VOCAB] and length(e, "a") == 6


def test_static_sessions_hold_a_slot_each_up_to_the_shards_slots():
    e = make_engine("static")  # a, b and c hold three of the four slots
    e.open(OWNER, "d")
    with pytest.raises(PipeshardError, match="all 4 slots of the static shard fake"):
        e.open(OWNER, "e")
    assert len(e.sessions) == 4  # the refused session is not left open
    e.sessions.release(OWNER, "a")
    e.open(OWNER, "e")
    assert e.sessions.get(OWNER, "e").slot == 0


def test_a_paged_session_cut_back_refuses_a_frame_computed_before_the_cut():
    """RouteSession's keep_positions (a per-hop failover): the session is shortened; a frame of
    the old steps still on its way starts past the cut and is refused, never written, and the
    caller's own next row, starting at the cut, runs."""
    e = make_engine("paged")
    (out,) = e.run([prefill("a", 6)])
    assert not isinstance(out, Exception)
    e.keep_positions(OWNER, "a", 4)
    assert e.sessions.get(OWNER, "a").past_length == 4
    (stale,) = e.run([row("a", RowKind.DECODE, [1], 6)])
    assert isinstance(stale, InvalidArgument) and "positions" in str(stale) and "cut back" in str(stale)
    assert e.sessions.get(OWNER, "a").past_length == 4
    (own,) = e.run([row("a", RowKind.DECODE, [1], 4)])
    assert not isinstance(own, Exception) and e.sessions.get(OWNER, "a").past_length == 5
    with pytest.raises(InvalidArgument, match="keep_positions"):
        e.keep_positions(OWNER, "a", 9)
    with pytest.raises(Unimplemented, match="paged"):
        make_engine("stateful").keep_positions(OWNER, "a", 0)
