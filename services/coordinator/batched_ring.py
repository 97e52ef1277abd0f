"""Every stage of an export in this process on the paged backend, stepping all sessions together.

Behind the ring's interface, like ``LocalRing``: each ``Generation`` sends its frames and awaits
its result as if it were alone; a ``StepBatcher`` forms each step from every session's frame
(step_batcher.py) and the step runs every stage's ``PagedEngine`` over all of them at once. In
exact mode at one thread a row's result does not depend on the rows beside it
(tests/coordinator/test_batched_ring.py), so every session gets its solo run's tokens.

With ``inflight`` > 1 several steps run at once, each stage on its own worker thread taking one
step at a time (a stage's lock), so stage 0 starts the next step while stage 1 runs the last one.
The default is 1: here the stages share the machine's cores (docs/BENCHMARKS.md, bench-mbatch).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import openvino as ov

from pipeshard.errors import PipeshardError
from pipeshard.precision import DEFAULT_PRECISION
from pipeshard.services.coordinator.local_ring import LOCAL_OWNER, InProcessKv
from pipeshard.services.coordinator.ring import StageFailed
from pipeshard.services.coordinator.step_batcher import DEFAULT_STEP_TOKENS, PAGED_PREFILL_CHUNK, StepBatcher
from pipeshard.services.stage.domain import Step
from pipeshard.services.stage.kv import StageKv
from pipeshard.services.stage.paged_engine import PagedEngine
from pipeshard.services.stage.prefix_store import PrefixStore
from pipeshard.services.stage.wire import result_from_output, stage_error, step_from_frame
from pipeshard.shard.manifest import input_port, load_manifest
from pipeshard.shard.paged import DEFAULT_CACHE_BYTES, PagedShard
from pipeshard.v1 import activation_pb2


class BatchedRing(InProcessKv):
    """All stages in-process over paged KV caches; concurrent sessions share each inference."""

    # Rewinds shorten a session (no mask): the generation's cursor keeps physical == logical.
    truncates_on_rewind = True
    prefill_chunk = PAGED_PREFILL_CHUNK

    def __init__(
        self,
        export_dir: Path | str,
        precision: str = DEFAULT_PRECISION,
        num_threads: int | None = None,
        *,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        max_sessions: int = 64,
        step_tokens: int = DEFAULT_STEP_TOKENS,
        gather_s: float = 0.002,
        prefix_cache_bytes: int = 512 * 1024 * 1024,
        inflight: int = 1,
        core: ov.Core | None = None,
    ):
        """``core``: a Core carrying extra CPU properties (bench-precision-modes compares
        compile settings through it); a fresh one by default."""
        self.export_dir = Path(export_dir)
        manifest = load_manifest(self.export_dir)
        core = core or ov.Core()
        self.shards = [
            PagedShard(self.export_dir, i, precision, num_threads, cache_bytes=cache_bytes, core=core)
            for i in range(manifest.num_stages)
        ]
        self._engines = [PagedEngine(s, max_sessions, idle_timeout_s=float("inf")) for s in self.shards]
        self.kv = [
            StageKv.paged(e, PrefixStore(prefix_cache_bytes, layout=e.shard.kv_source.blocks))
            for e in self._engines
        ]
        self.max_context = manifest.max_context
        self.vocab_size = manifest.model.vocab_size
        self._open: set[str] = set()
        self._locks: list[asyncio.Lock] = []  # one step at a time per stage (made per event loop)
        self._locks_loop: asyncio.AbstractEventLoop | None = None
        self._batcher = StepBatcher(self._run_step, lambda: len(self._open), step_tokens, gather_s, inflight)

    @property
    def steps_run(self) -> int:
        """Steps (one inference per stage each) run so far."""
        return self._batcher.steps_run

    @property
    def num_stages(self) -> int:
        return len(self._engines)

    @property
    def batch_steps(self) -> StepBatcher:
        """Step cost and load for batch-aware K (speculation/policy.py, ``BatchSteps``)."""
        return self._batcher

    def warmup(self) -> None:
        for shard in self.shards:
            shard.warmup()

    async def open_session(self, session_id: str, capacity: int | None = None) -> int:
        opened = []
        try:
            for engine in self._engines:
                engine.open(LOCAL_OWNER, session_id, capacity)
                opened.append(engine)
        except PipeshardError:
            for engine in opened:
                engine.sessions.release(LOCAL_OWNER, session_id)
            raise
        self._open.add(session_id)
        return self.max_context

    async def release_session(self, session_id: str) -> None:
        """Frees the session's blocks on every stage at once; a queued frame of it fails."""
        self._open.discard(session_id)
        self._batcher.forget(session_id)
        for engine in self._engines:
            engine.sessions.release(LOCAL_OWNER, session_id)

    async def abort_session(self, session_id: str, reason: str) -> None:
        await self.release_session(session_id)

    async def close(self) -> None:
        await self._batcher.close()

    async def _run_step(self, frames: list[activation_pb2.ActivationFrame]) -> list:
        """Every stage over the step's rows, each on a worker thread (the event loop meanwhile
        takes the next frames); a row failing on a stage answers with its error."""
        answers: list = [None] * len(frames)
        live: list[int] = []
        rows = []
        for i, frame in enumerate(frames):
            try:
                rows.extend(step_from_frame(frame, input_port(True)).rows)
                live.append(i)
            except PipeshardError as exc:
                answers[i] = StageFailed(stage_error(0, exc))
        step = Step(rows, LOCAL_OWNER)
        for index, engine in enumerate(self._engines):
            if not live:
                break
            try:
                async with self._stage_lock(index):
                    outs = await asyncio.to_thread(engine.run_step, step)
            except Exception as exc:  # an inference failure fails every row of the step
                for i in live:
                    answers[i] = StageFailed(stage_error(index, exc))
                break
            nxt, step.rows = [], []
            for i, out in zip(live, outs, strict=True):
                if isinstance(out, Exception):
                    answers[i] = StageFailed(stage_error(index, out))
                elif engine.is_last:
                    answers[i] = result_from_output(out, step.compute_micros)
                else:
                    nxt.append(i)
                    step.rows.append(out.row.carrying(out.hidden_states))
            live = nxt
        return answers

    def _stage_lock(self, index: int) -> asyncio.Lock:
        loop = asyncio.get_running_loop()
        if self._locks_loop is not loop:  # a lock belongs to one event loop; a ring may see several
            self._locks = [asyncio.Lock() for _ in self._engines]
            self._locks_loop = loop
        return self._locks[index]

    async def step(self, frame: activation_pb2.ActivationFrame) -> activation_pb2.StepResult:
        frame.owner = LOCAL_OWNER
        return await self._batcher.step(frame)
