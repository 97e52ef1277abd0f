"""This coordinator's view of every paged stage's KV block pool, kept so admission never
over-commits it.

A paged stage reserves ``ceil(min(capacity, max_context) / block_tokens)`` blocks when a session
opens (services/stage/paged_engine.py) and refuses the session with RESOURCE_EXHAUSTED when its
owner already holds blocks and would pass its share of the pool (``max_sessions_per_owner /
max_sessions`` of it), or when the pool has too few blocks free; an owner holding nothing may
open one session as large as the free pool. The coordinator is the only caller opening sessions
under its owner key, so counting its own reservations (charged when the scheduler admits a
request, credited when the stages have released its session) keeps the mirror exact; GetStageInfo
gives the share, the pool and what the owner held at start. Other owners' use of a pool is not
mirrored: with several coordinators on one fleet a first session can still find the pool short.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pipeshard.errors import ResourceExhausted
from pipeshard.v1 import stage_pb2

# Blocks a request holds on each paged stage, in pipeline order of the paged stages.
Need = tuple[int, ...]


@dataclass(frozen=True)
class StageBudget:
    """One paged stage's block pool as it applies to this coordinator (its GetStageInfo)."""

    stage: int
    block_tokens: int
    pool_blocks: int
    share_blocks: int
    max_context: int

    @classmethod
    def from_info(cls, info: stage_pb2.GetStageInfoResponse) -> StageBudget:
        return cls(
            stage=info.stage_index,
            block_tokens=info.kv_block_tokens,
            pool_blocks=info.kv_cache_blocks,
            share_blocks=info.kv_owner_share_blocks,
            max_context=info.max_context,
        )

    def blocks_for(self, tokens: int | None) -> int:
        """What the stage reserves for a session opened with ``tokens`` of capacity (None: the
        stage's max_context, as OpenSession without a capacity)."""
        tokens = self.max_context if tokens is None else min(tokens, self.max_context)
        return -(-tokens // self.block_tokens)


class KvMirror:
    """Blocks this coordinator holds on each paged stage against what each lets it hold."""

    def __init__(self, budgets: Sequence[StageBudget], held: Sequence[int] | None = None):
        self.budgets = tuple(budgets)
        self.held = list(held) if held is not None else [0] * len(self.budgets)
        self.on_credit: Callable[[], None] = lambda: None  # the scheduler looks at its queue

    @classmethod
    def from_infos(cls, infos: Sequence[stage_pb2.GetStageInfoResponse]) -> KvMirror:
        """The paged stages' budgets and current holdings (only a block pool reports
        kv_cache_blocks); empty (no limit) for other backends and for stages too old to report."""
        paged = [info for info in infos if info.kv_cache_blocks]
        return cls([StageBudget.from_info(i) for i in paged], [i.kv_owner_held_blocks for i in paged])

    def need(self, tokens: int | None) -> Need:
        return tuple(b.blocks_for(tokens) for b in self.budgets)

    def check_ever_fits(self, tokens: int) -> None:
        """Refuses at once what no stage could hold even with this coordinator holding nothing."""
        for budget, blocks in zip(self.budgets, self.need(tokens), strict=True):
            if blocks > budget.pool_blocks:
                raise ResourceExhausted(
                    f"stage {budget.stage}'s KV cache budget of {budget.pool_blocks} blocks of "
                    f"{budget.block_tokens} tokens (--kv-cache-bytes) cannot hold this request: "
                    f"{tokens} tokens (prompt + max_tokens + drafts) need {blocks} blocks"
                )

    def has_room(self, need: Need) -> bool:
        """True when every stage would reserve ``need`` now (the stages' own rule, see above)."""
        return all(
            held + blocks <= budget.share_blocks or (held == 0 and blocks <= budget.pool_blocks)
            for budget, held, blocks in zip(self.budgets, self.held, need, strict=True)
        )

    def charge(self, need: Need) -> None:
        self.held = [held + blocks for held, blocks in zip(self.held, need, strict=True)]

    def credit(self, need: Need) -> None:
        self.held = [held - blocks for held, blocks in zip(self.held, need, strict=True)]
        self.on_credit()
