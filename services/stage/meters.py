"""A stage's Prometheus metrics: step time and rows per step, open sessions and the KV cache they hold.

Step metrics are recorded where the engine runs a step; the session and cache gauges are read
from the session table when /metrics is scraped, so they cost nothing between scrapes.
"""

from __future__ import annotations

import contextlib

from pipeshard.metrics import (
    STAGE_CACHE_BYTES,
    STAGE_CACHE_POSITIONS,
    STAGE_HEADS_SECONDS,
    STAGE_KV_RESTORED_BLOCKS,
    STAGE_SESSIONS,
    STAGE_STEP_ROWS,
    STAGE_STEP_SECONDS,
)
from pipeshard.services.stage.sessions import SessionTable
from pipeshard.shard.runtime import ShardRunner
from pipeshard.shard.static import StaticShard

# Element size of the KV cache precisions the CPU plugin reports (KV_CACHE_PRECISION).
_KV_ELEMENT_BYTES = {"u8": 1, "i8": 1, "f16": 2, "bf16": 2, "f32": 4}


def kv_bytes_per_position(runner: ShardRunner | StaticShard) -> int:
    """Bytes one cache position costs on this stage: every state variable (a K or V of one layer)
    holds KV heads x head size elements at the compiled KV cache precision (f32 if unknown)."""
    model = runner.manifest.model
    precision = "f32"
    with contextlib.suppress(RuntimeError):
        precision = str(runner.compiled.get_property("KV_CACHE_PRECISION")).lower()
    return (
        len(runner.state_variables)
        * model.num_kv_heads
        * model.head_dim
        * _KV_ELEMENT_BYTES.get(precision, 4)
    )


class StageMeters:
    """The metrics of one stage, labelled by its index."""

    def __init__(self, stage_index: int):
        label = str(stage_index)
        self._seconds = STAGE_STEP_SECONDS.labels(stage=label)
        self._rows = STAGE_STEP_ROWS.labels(stage=label)
        self._heads = STAGE_HEADS_SECONDS.labels(stage=label)
        self._label = label

    def step(self, seconds: float, rows: int) -> None:
        """One step's compute time and the rows (tokens, all sessions together) it computed."""
        self._seconds.observe(seconds)
        self._rows.observe(rows)

    def heads(self, seconds: float) -> None:
        """One row's draft heads on the final stage (--draft-heads)."""
        self._heads.observe(seconds)

    def restored(self, shared: int, copied: int) -> None:
        """One prefix-cache restore on a paged stage: its blocks referenced in the pool, and copied."""
        STAGE_KV_RESTORED_BLOCKS.labels(stage=self._label, how="shared").inc(shared)
        STAGE_KV_RESTORED_BLOCKS.labels(stage=self._label, how="copied").inc(copied)

    def watch(self, sessions: SessionTable, bytes_per_position: int) -> None:
        """Serve the session and cache gauges from ``sessions`` at scrape time."""
        STAGE_SESSIONS.labels(stage=self._label).set_function(lambda: len(sessions))
        STAGE_CACHE_POSITIONS.labels(stage=self._label).set_function(sessions.cached_positions)
        STAGE_CACHE_BYTES.labels(stage=self._label).set_function(
            lambda: sessions.cached_positions() * bytes_per_position
        )
