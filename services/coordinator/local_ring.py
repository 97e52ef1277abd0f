"""Every stage of an export in this process, behind the ring's interface (no network).

Frames go through the same wire decoding and ``StageEngine`` as in a stage service, so a
``Generation`` over a ``LocalRing`` runs exactly the distributed decode loop, speculation
included. ``pipeshard generate --local``, the exactness matrix and single-node benchmarks use it.
"""

from __future__ import annotations

from pathlib import Path

import openvino as ov

from pipeshard.errors import PipeshardError
from pipeshard.precision import DEFAULT_PRECISION
from pipeshard.services.coordinator.ring import StageFailed
from pipeshard.services.stage.engine import StageEngine
from pipeshard.services.stage.kv import StageKv
from pipeshard.services.stage.meters import StageMeters
from pipeshard.services.stage.prefix_store import PrefixStore
from pipeshard.services.stage.sessions import SessionTable
from pipeshard.services.stage.wire import result_from_output, stage_error, step_from_frame
from pipeshard.shard.manifest import input_port, load_manifest
from pipeshard.shard.runtime import ShardRunner
from pipeshard.v1 import activation_pb2

LOCAL_OWNER = "local"  # one process, one party: the operator running it


class InProcessKv:
    """The prefix cache's keep and restore on every stage's ``StageKv`` (``self.kv``) in this
    process, for the in-process rings; a stage's refusal fails the call as ``StageFailed``."""

    async def keep_kv(self, session_id: str, scope: str, token_ids: list[int]) -> set[str]:
        for i, kv in enumerate(self.kv):
            self._on(i, kv.keep, session_id, scope, token_ids)
        return self._dropped()

    async def restore_kv(
        self, session_id: str, scope: str, token_ids: list[int], positions: int, timeout_s: float
    ) -> set[str]:
        for i, kv in enumerate(self.kv):
            self._on(i, kv.restore_cached, session_id, scope, token_ids, positions)
        return self._dropped()

    def _dropped(self) -> set[str]:
        return {key for kv in self.kv for key in kv.dropped(LOCAL_OWNER)}

    def _on(self, index: int, method, *args):
        try:
            return method(LOCAL_OWNER, *args)
        except PipeshardError as exc:
            raise StageFailed(stage_error(index, exc)) from None


class LocalRing(InProcessKv):
    def __init__(
        self,
        export_dir: Path | str,
        precision: str = DEFAULT_PRECISION,
        num_threads: int | None = None,
        *,
        max_sessions: int = 64,
        prefix_cache_bytes: int = 512 * 1024 * 1024,
    ):
        self.export_dir = Path(export_dir)
        manifest = load_manifest(self.export_dir)
        core = ov.Core()
        self.runners = [
            ShardRunner(self.export_dir, i, precision, num_threads, core=core)
            for i in range(manifest.num_stages)
        ]
        self.max_context = manifest.max_context
        self.vocab_size = manifest.model.vocab_size
        self._engines = [
            StageEngine(
                SessionTable(r.new_session, max_sessions, idle_timeout_s=float("inf")),
                is_first=r.is_first,
                is_last=r.is_last,
                hidden_size=r.hidden_size,
                max_context=r.max_context,
                vocab_size=r.vocab_size,
                meters=StageMeters(r.stage_index),
            )
            for r in self.runners
        ]
        self.kv = [
            StageKv(e.sessions, r.kv_source, PrefixStore(prefix_cache_bytes))
            for e, r in zip(self._engines, self.runners, strict=True)
        ]

    @property
    def num_stages(self) -> int:
        return len(self._engines)

    def warmup(self) -> None:
        for runner in self.runners:
            runner.warmup()

    async def open_session(self, session_id: str, capacity: int | None = None) -> int:
        for engine in self._engines:
            engine.sessions.open(LOCAL_OWNER, session_id)
        return self.max_context

    async def release_session(self, session_id: str) -> None:
        for engine in self._engines:
            engine.sessions.release(LOCAL_OWNER, session_id)

    async def abort_session(self, session_id: str, reason: str) -> None:
        await self.release_session(session_id)  # in one process there is no other stage to tell

    async def step(self, frame: activation_pb2.ActivationFrame) -> activation_pb2.StepResult:
        frame.owner = LOCAL_OWNER
        try:
            step = step_from_frame(frame, input_port(True))
        except PipeshardError as exc:
            raise StageFailed(stage_error(0, exc)) from None
        for index, engine in enumerate(self._engines):
            (out,) = engine.run_step(step)
            if isinstance(out, Exception):
                raise StageFailed(stage_error(index, out)) from None
            step.rows = [out.row.carrying(out.hidden_states)]
        return result_from_output(out, step.compute_micros)
