"""The ring: how a generation's steps and sessions reach the stages, whatever carries them.

One class for stage services (``RemoteStages``, remote_stages.py: gRPC streams) and for stages
in this process (``InProcessStages``, in_process.py); they differ only in that transport (its
``StageLink``). On paged stages the ring batches: the coordinator's engine loop (engine.py)
forms each step from the running requests' rows and :meth:`Ring.run` carries it as one plan
frame, under the settings and counters of ``batch_steps`` (step_batcher.py). On stateful stages
each session's step travels alone (a plan of one row).

The ring is not told which backend the stages run: it is given what they said they do, the
typed :class:`FleetKv` (fleet_kv.py) a fleet's GetStageInfo answers agree on (in one process: the
stages' own answers), and batches, rewinds and drafts trees by it. Paged stages rewind by
shortening a session, so a generation's cursor keeps physical == logical positions there
(``truncates_on_rewind``). Sessions open with the capacity they may use,
which every paged stage reserves (or refuses) at once; ``accounts`` (the scheduler's
``SessionAccounts``) counts each reservation in the coordinator's mirror of the stages' KV
budget until every stage has released it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from pipeshard.errors import PipeshardError, Unavailable
from pipeshard.services.coordinator.fleet_kv import FleetKv
from pipeshard.services.coordinator.step_batcher import (
    DEFAULT_PREFILL_CHUNK,
    DEFAULT_STEP_TOKENS,
    PAGED_PREFILL_CHUNK,
    BatchSteps,
)
from pipeshard.v1 import activation_pb2

if TYPE_CHECKING:
    from pipeshard.services.coordinator.scheduler import ScheduledRequest, SessionAccounts


class StageFailed(PipeshardError):
    """A stage rejected or failed a step; carries that stage's status code."""

    def __init__(self, error: activation_pb2.StageError):
        super().__init__(f"stage {error.stage_index}: {error.message}")
        self.code = error.code or "INTERNAL"
        self.stage_index = error.stage_index


class ShuttingDown(Unavailable):
    """The coordinator stopped the generations still running at the end of its shutdown grace."""


@dataclass(frozen=True)
class SessionTerms:
    """What a session is opened with on every stage, kept so a move reopens it alike."""

    capacity: int | None = None  # the tokens it may use (a paged stage reserves them or refuses)
    codec: str = ""  # OpenSession's codec for its frames and results (empty: each stage's --codec)


PLAIN = SessionTerms()  # no capacity asked, the stages' own codec


class StageLink(Protocol):
    """A ring's transport: what differs between stage services and stages in this process."""

    @property
    def num_stages(self) -> int: ...

    async def start(self) -> None: ...

    async def run(self, frames: list[activation_pb2.ActivationFrame]) -> list:
        """One step of these sessions' frames through every stage: each frame's StepResult or
        the exception to raise for it (raising fails every frame)."""
        ...

    async def open_session(self, session_id: str, terms: SessionTerms = PLAIN) -> int: ...

    async def release_session(self, session_id: str) -> None: ...

    async def abort_session(self, session_id: str, reason: str) -> None: ...

    async def keep_kv(self, session_id: str, scope: str, token_ids: list[int]) -> set[str]: ...

    async def restore_kv(
        self, session_id: str, scope: str, token_ids: list[int], positions: int, timeout_s: float
    ) -> set[str]: ...

    async def close(self) -> None: ...


class RingLike(Protocol):
    """What a generation needs of the stages (``Ring`` below over any transport)."""

    # The ring rewinds by shortening a session's cache (paged): the cursor keeps no holes.
    truncates_on_rewind: bool
    # The stages verify a draft tree in one row (else requests draft chains).
    verifies_trees: bool

    @property
    def batch_steps(self) -> BatchSteps | None:
        """A ring that batches every step: its settings and counters (None: each row alone)."""
        ...

    @property
    def num_stages(self) -> int: ...

    async def open_session(
        self, session_id: str, capacity: int | None = None, admission: ScheduledRequest | None = None
    ) -> int: ...

    async def step(self, frame: activation_pb2.ActivationFrame) -> activation_pb2.StepResult: ...

    async def run(self, frames: list[activation_pb2.ActivationFrame]) -> list:
        """One step of these sessions' frames (a batching ring's): each one's StepResult or the
        exception for it."""
        ...

    async def release_session(self, session_id: str) -> None: ...

    async def abort_session(self, session_id: str, reason: str) -> None: ...

    async def keep_kv(self, session_id: str, scope: str, token_ids: list[int]) -> set[str]: ...

    async def restore_kv(
        self, session_id: str, scope: str, token_ids: list[int], positions: int, timeout_s: float
    ) -> set[str]: ...


L = TypeVar("L", bound=StageLink)


class Ring(Generic[L]):
    """A ring over the stages ``L`` (its transport, which callers may use as that type)."""

    def __init__(
        self,
        stages: L,
        kv: FleetKv,
        *,
        accounts: SessionAccounts | None = None,
        step_tokens: int = DEFAULT_STEP_TOKENS,
        inflight: int | None = None,
    ):
        """``kv``: what the stages' KV backend does (whether steps are batched, a rewind
        truncates, a draft tree travels in one row, rows have a fixed chunk). ``inflight``: the
        most batched steps travelling at once (None: one per stage)."""
        self.stages = stages
        self.kv = kv
        self.truncates_on_rewind = kv.truncates_on_rewind
        self.verifies_trees = kv.verifies_trees
        # Prompt tokens per frame: the stages' fixed chunk (a static shard's), else the backend's.
        self.prefill_chunk = kv.row_tokens or (
            PAGED_PREFILL_CHUNK if kv.batches_steps else DEFAULT_PREFILL_CHUNK
        )
        self._accounts = accounts
        # The batching's settings and counters (step cost for batch-aware K, speculation/policy.py);
        # None when each session's step travels alone.
        self.batch_steps: BatchSteps | None = None
        if kv.batches_steps:
            self.batch_steps = BatchSteps(step_tokens, inflight or stages.num_stages)

    @property
    def num_stages(self) -> int:
        return self.stages.num_stages

    async def start(self) -> None:
        await self.stages.start()

    async def run(self, frames: list[activation_pb2.ActivationFrame]) -> list:
        """One step of these sessions' frames through every stage, as one plan: each frame's
        StepResult or the exception for it."""
        return await self.stages.run(frames)

    async def step(self, frame: activation_pb2.ActivationFrame) -> activation_pb2.StepResult:
        """One step of one session alone, at once: its frame's result, or the error for it raised
        (the engine's rows on a ring that does not batch; a failover's replay)."""
        (answer,) = await self.stages.run([frame])
        if isinstance(answer, BaseException):
            raise answer
        return answer

    async def open_session(
        self, session_id: str, capacity: int | None = None, admission: ScheduledRequest | None = None
    ) -> int:
        """Opens the session on every stage; returns the smallest max_context among them.
        ``capacity``: the tokens the session may use (a paged stage reserves them or refuses);
        ``admission``: the scheduler's admission of the request it is for, whose KV charge the
        session takes over (None: charged on its own) and whose session codec it asks for (a
        batch job's), on its first session and on every one a move reopens it in."""
        if self._accounts is not None:
            self._accounts.opening(session_id, capacity, admission)
        terms = SessionTerms(capacity, admission.codec if admission is not None else "")
        try:
            return await self.stages.open_session(session_id, terms)
        except BaseException:
            self._closed(session_id)
            raise

    async def release_session(self, session_id: str) -> None:
        try:
            await self.stages.release_session(session_id)
        finally:
            self._closed(session_id)

    async def abort_session(self, session_id: str, reason: str) -> None:
        """Aborts on every stage after a failed generation (logged there with the reason)."""
        try:
            await self.stages.abort_session(session_id, reason)
        finally:
            self._closed(session_id)

    async def keep_kv(self, session_id: str, scope: str, token_ids: list[int]) -> set[str]:
        return await self.stages.keep_kv(session_id, scope, token_ids)

    async def restore_kv(
        self, session_id: str, scope: str, token_ids: list[int], positions: int, timeout_s: float
    ) -> set[str]:
        return await self.stages.restore_kv(session_id, scope, token_ids, positions, timeout_s)

    async def close(self) -> None:
        await self.stages.close()

    def _closed(self, session_id: str) -> None:
        if self._accounts is not None:
            self._accounts.released(session_id)
