"""The remote stages' step timeout grows with the rows of a step: a one-pass prefill is not a dead stage."""

from __future__ import annotations

import asyncio

from pipeshard.services.coordinator.remote_stages import TIMEOUT_ROWS, RemoteStages


def test_step_timeout_is_per_started_block_of_rows():
    async def check() -> list[float]:
        stages = RemoteStages(["127.0.0.1:9"], step_timeout_s=2.0)
        rows = [1, TIMEOUT_ROWS, TIMEOUT_ROWS + 1, 4000]
        return [stages.timeout_for(n) for n in rows]

    assert asyncio.run(check()) == [2.0, 2.0, 4.0, 2.0 * 16]
