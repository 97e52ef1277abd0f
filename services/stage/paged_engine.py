"""Runs the rows of many sessions in one inference on a paged shard (pipeshard/shard/paged.py).

The paged backend behind the step interface (step_engine.py): each row is checked on its own,
so a bad row fails only its own session; the good ones then share one inference. Sessions live in the same
``SessionTable`` (keyed by owner, so a session is only usable by its owner); a session's handle
reserves its blocks when it opens and gives them back when the table releases or reaps it.

Rewind: the paged cache has no validity mask. A row's ``invalidate`` ranges must be the tail
of the session's cache (what the coordinator's rejected drafts are); the session is shortened
to the range's start and the next tokens overwrite those slots.

Draft trees: a row with ``tree_parents`` runs its tokens as one sequence under an ancestor mask
(``PagedShard``); its nodes fill the slots after the cache in row order. The session's next row
names the accepted path (``tree_kept``): those slots move down behind the cache before the
row's rewind drops the rest, so only the path's cache stays, at its own positions.

Sampling (RETURN_MODE_SAMPLED): the last stage draws each row from its own logits with the
row's own generator state (pipeshard/sampling.py, as ``StageEngine`` does), so a batched step
returns a few token ids per session instead of 49152 floats per position.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

from pipeshard.errors import Internal, InvalidArgument, PipeshardError, ResourceExhausted
from pipeshard.services.stage.domain import Computed, ReturnMode, StepRow, TreeForm
from pipeshard.services.stage.meters import StageMeters
from pipeshard.services.stage.sessions import SessionTable
from pipeshard.services.stage.step_engine import Ready, RowEngine, tail_rewound
from pipeshard.shard.paged import PagedRow, PagedShard
from pipeshard.v1 import stage_pb2

_keys = itertools.count()


@dataclass(frozen=True)
class TreeStep:
    """A session's last tree row: where it started in the cache and its tokens' parents."""

    start: int
    parents: tuple[int, ...]

    def in_place(self, kept: tuple[int, ...]) -> int:
        """How many of the row's slots hold a path's cache once ``kept`` moved (none named: the
        leading tokens that each follow the one before)."""
        if kept:
            return len(kept)
        return next((i for i, p in enumerate(self.parents) if p != i - 1), len(self.parents))

    def check_path(self, kept: tuple[int, ...]) -> None:
        """``kept`` is a path from the row's first token down its parents."""
        if kept[-1] >= len(self.parents) or any(
            self.parents[k] != (kept[i - 1] if i else -1) for i, k in enumerate(kept)
        ):
            raise InvalidArgument(
                "tree_kept",
                f"{list(kept)} is not a path from the first of the last tree row's "
                f"{len(self.parents)} tokens",
            )


class PagedSession:
    """A session's handle on the shared paged cache (what the session table holds). It adds the
    blocks it reserves to its owner's count in ``held`` and takes them off when it frees them, so
    the owner share is checked without walking the owner's sessions."""

    def __init__(self, shard: PagedShard, held: dict[str, int]):
        self.shard = shard
        self.key = ("session", next(_keys))
        self.reserved = False
        self._held = held
        self._owner = ""
        self._blocks = 0
        self.tree: TreeStep | None = None  # the last row, when it was a tree row
        self.cut: int | None = None  # the length RouteSession cut it to, until the next row starts there

    @property
    def past_length(self) -> int:
        return self.shard.length(self.key) if self.reserved else 0

    def reserve(self, owner: str, capacity: int) -> None:
        self.shard.open(self.key, capacity)
        self.reserved = True
        self._owner, self._blocks = owner, self.shard.capacity(self.key) // self.shard.block_tokens
        self._held[owner] = self._held.get(owner, 0) + self._blocks

    def reset(self) -> None:
        """Gives the session's blocks back (the table calls it on release and reaping)."""
        self.tree = None
        self.cut = None
        if self.reserved:
            self.shard.free(self.key)
            self.reserved = False
            left = self._held[self._owner] - self._blocks
            if left:
                self._held[self._owner] = left
            else:
                del self._held[self._owner]


class PagedEngine(RowEngine[PagedSession]):
    """The stage's compute over a paged shard: open sessions with a capacity, run rows in batches."""

    def __init__(
        self,
        shard: PagedShard,
        max_sessions: int,
        idle_timeout_s: float,
        max_per_owner=None,
        *,
        meters: StageMeters | None = None,
        tree_form: TreeForm = TreeForm.PARENTS,
    ):
        """``tree_form``: NONE where this stage's configuration verifies no draft trees
        (``PagedBackend.tree_form``)."""
        self.shard = shard
        self.tree_form = tree_form
        self.meters = meters or StageMeters(shard.stage_index)
        self._held: dict[str, int] = {}  # owner -> the blocks its sessions hold
        self.sessions = SessionTable(
            lambda: PagedSession(shard, self._held), max_sessions, idle_timeout_s, max_per_owner
        )
        # An owner may reserve the share of the block pool it may hold of the sessions, so one
        # caller's long reservations cannot take the whole pool from the others.
        share = 1.0 if max_per_owner is None else min(1.0, max_per_owner / max_sessions)
        self.owner_blocks = max(1, int(shard.blocks_total * share))
        self.is_first = shard.is_first
        self.is_last = shard.is_last
        self.hidden_size = shard.hidden_size
        self.max_context = shard.max_context
        self.vocab_size = shard.vocab_size

    kv_backend = "paged"

    def describe(self, info: stage_pb2.GetStageInfoResponse, owner: str | None) -> None:
        """The block pool's use, and the caller's share of it and holding in it."""
        usage = self.shard.usage()
        info.kv_cache_budget_bytes = usage.budget_bytes
        info.kv_cache_used_bytes = usage.bytes_used
        info.kv_block_tokens = usage.block_tokens
        info.kv_cache_blocks = usage.blocks_total
        info.kv_owner_share_blocks = self.owner_blocks
        if owner is not None:
            info.kv_owner_held_blocks = self.held_blocks(owner)

    def held_blocks(self, owner: str) -> int:
        """The blocks ``owner``'s sessions hold."""
        return self._held.get(owner, 0)

    def reset(self, owner: str, session_id: str) -> None:
        """Forgets the session's tokens; it keeps its reservation."""
        session = self.sessions.get(owner, session_id)
        session.tree = None
        self.shard.rewind(session.key, 0)

    def keep_positions(self, owner: str, session_id: str, positions: int) -> None:
        """Shortens the session to ``positions`` (at most what it holds: named otherwise)."""
        session = self.sessions.get(owner, session_id)
        if positions > session.past_length:
            raise InvalidArgument(
                "keep_positions", f"{positions} is more than the {session.past_length} the session holds"
            )
        session.tree = None
        self.shard.rewind(session.key, positions)
        session.cut = positions

    def open(self, owner: str, session_id: str, capacity: int | None = None) -> None:
        """Opens a session and reserves room for ``capacity`` tokens (the export's max_context
        when None); refuses with RESOURCE_EXHAUSTED naming the budget when it cannot fit."""
        capacity = min(capacity or self.max_context, self.max_context)
        held = self.held_blocks(owner)
        need = self.shard.blocks_for(capacity)
        # What the pool cannot hold at all gets the pool's own refusal (naming the budget) below,
        # and so does a caller's first session (a full-context request may exceed a small share).
        fits_pool = need <= self.shard.usage().blocks_free
        if fits_pool and held and held + need > self.owner_blocks:
            raise ResourceExhausted(
                f"this caller holds {held} of the KV cache's {self.shard.blocks_total} blocks and may hold "
                f"{self.owner_blocks} (max_sessions_per_owner / max_sessions of the budget); "
                f"{capacity} more tokens need {need}"
            )
        session = self.sessions.open(owner, session_id)
        try:
            # Drafts may ask beyond max_context on a full-length request; they never get it (check_step).
            session.reserve(owner, capacity)
        except PipeshardError:
            self.sessions.release(owner, session_id)
            raise

    def _rewound(self, row: StepRow, session: PagedSession) -> int:
        """The paged cache has no mask: a rewind shortens the session to its range's start."""
        length = tail_rewound(row, session.past_length, "the paged cache")
        tree, kept = session.tree, row.tree_kept
        if tree is None:
            if kept:
                raise InvalidArgument(
                    "tree_kept", "names a path, but the session's last row was not a tree row"
                )
            return length
        if kept:
            tree.check_path(kept)
        kept_end = tree.start + tree.in_place(kept)
        if length > kept_end:
            raise InvalidArgument(
                "tree_kept",
                f"after a tree row the cache keeps its path only: {length - tree.start} slots past the "
                f"row's start remain, {kept_end - tree.start} hold the path",
            )
        return length

    def _check_room(self, row: StepRow, session: PagedSession, start: int) -> None:
        if row.tree_parents and not self.shard.moves_slots:
            raise InvalidArgument(
                "tree_parents",
                "draft trees need KV pools of one value per slot (f32, f16, bf16); this stage's are u8",
            )
        if session.cut is not None:
            if len(row.positions) and int(row.positions[0]) != start:
                # A frame computed for the session before it was cut back (RouteSession, a
                # per-hop failover) and still on its way: refused, never written.
                raise InvalidArgument(
                    "positions",
                    f"start at {int(row.positions[0])}, but session {row.session_id!r} was cut back "
                    f"to {session.cut} positions and holds {start}",
                )
            session.cut = None  # the first row after the cut is the caller's own
        room = self.shard.capacity(session.key)
        if start + row.tokens > room:
            raise ResourceExhausted(
                f"session {row.session_id!r} would grow to {start + row.tokens} tokens, "
                f"beyond the {room} it reserved"
            )

    def _compute(self, ready: list[Ready[PagedSession]]) -> list[Computed]:
        """One inference for every ready row (a failure raises: it fails them all)."""
        if not ready:
            return []
        rows = []
        for r in ready:
            row, session = r.row, r.session
            if row.tree_kept and session.tree is not None:  # _rewound refused a path without a tree
                self.shard.move(session.key, session.tree.start, row.tree_kept)
            self.shard.rewind(session.key, r.start)
            session.tree = TreeStep(r.start, row.tree_parents) if row.tree_parents else None
            want = row.return_last if self.is_last and row.return_mode is not ReturnMode.NONE else 0
            parents = row.tree_parents or None
            rows.append(
                PagedRow(session.key, row.activations[0], row.positions, logits=want, parents=parents)
            )
        started = time.perf_counter_ns()
        outs, features = self.shard.step_features(rows)
        self.meters.step((time.perf_counter_ns() - started) / 1e9, sum(len(row.inputs) for row in rows))
        if not self.is_last:
            return [Computed(out[None]) for out in outs]
        if features is None:
            raise Internal("the final stage's shard returned no features")
        return [Computed(out, f) for out, f in zip(outs, features, strict=True)]
