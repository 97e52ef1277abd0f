"""Continuous batching over a fleet of paged stages (``--kv paged``): each step of every running
session rides in one plan frame.

Behind the ring's interface, so ``Generation`` runs unchanged: a ``StepBatcher`` forms each step
from every session's frame (step_batcher.py) and ``Ring.step_plan`` sends them as one plan frame
whose rows each stage runs in one inference; the final stage answers each row on its own, so every
generation gets its own result. Sessions open with the capacity they may use, which every paged
stage reserves (or refuses) at once; a release or cancellation frees it on every stage.

Up to ``inflight`` plan frames travel the ring at once (default: one per stage), so each stage
works on a different step; a stage runs frames in arrival order, so this needs nothing of it.
"""

from __future__ import annotations

from pipeshard.services.coordinator.ring import Ring
from pipeshard.services.coordinator.step_batcher import DEFAULT_STEP_TOKENS, PAGED_PREFILL_CHUNK, StepBatcher
from pipeshard.v1 import activation_pb2


class PlanRing:
    # Paged stages rewind by shortening a session: the generation's cursor keeps physical == logical.
    truncates_on_rewind = True
    prefill_chunk = PAGED_PREFILL_CHUNK

    def __init__(
        self,
        ring: Ring,
        step_tokens: int = DEFAULT_STEP_TOKENS,
        gather_s: float = 0.002,
        inflight: int | None = None,
    ):
        """``inflight``: the most steps travelling the ring at once (None: one per stage)."""
        self.ring = ring
        self._open: set[str] = set()
        self.batcher = StepBatcher(
            ring.step_plan, lambda: len(self._open), step_tokens, gather_s, inflight or ring.num_stages
        )

    @property
    def num_stages(self) -> int:
        return self.ring.num_stages

    @property
    def batch_steps(self) -> StepBatcher:
        """Step cost and load for batch-aware K (speculation/policy.py, ``BatchSteps``)."""
        return self.batcher

    async def open_session(self, session_id: str, capacity: int | None = None) -> int:
        max_context = await self.ring.open_session(session_id, capacity)
        self._open.add(session_id)
        return max_context

    async def release_session(self, session_id: str) -> None:
        self._open.discard(session_id)
        self.batcher.forget(session_id)
        await self.ring.release_session(session_id)

    async def abort_session(self, session_id: str, reason: str) -> None:
        self._open.discard(session_id)
        self.batcher.forget(session_id)
        await self.ring.abort_session(session_id, reason)

    async def keep_kv(self, session_id: str, scope: str, token_ids: list[int]) -> set[str]:
        return await self.ring.keep_kv(session_id, scope, token_ids)

    async def restore_kv(
        self, session_id: str, scope: str, token_ids: list[int], positions: int, timeout_s: float
    ) -> set[str]:
        return await self.ring.restore_kv(session_id, scope, token_ids, positions, timeout_s)

    async def step(self, frame: activation_pb2.ActivationFrame) -> activation_pb2.StepResult:
        return await self.batcher.step(frame)

    async def close(self) -> None:
        await self.batcher.close()
