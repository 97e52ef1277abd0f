"""Every stage of an export in this process: the ring's transport without a network.

Frames go through the same wire decoding and the same engines as in a stage service, so a
``Generation`` over such a ring runs exactly the distributed decode loop, speculation included.
``pipeshard generate --local``, the exactness matrix and single-node benchmarks use it.

Stateful stages run a step inline on the event loop. Paged stages run each step of every
session at once (the engine loop forms it, engine.py), each stage on a worker thread taking one
step at a time (a stage's lock), so with ``inflight`` > 1 stage 0 starts the next step while
stage 1 runs the last one; the default is 1: here the stages share the machine's cores
(docs/BENCHMARKS.md, bench-mbatch). In exact mode at one thread a row's result does not depend
on the rows beside it (tests/coordinator/test_batched_ring.py), so every session gets its solo
run's tokens.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import openvino as ov

from pipeshard.errors import PipeshardError
from pipeshard.precision import DEFAULT_PRECISION
from pipeshard.services.coordinator.fleet_kv import AUTO, FleetKv
from pipeshard.services.coordinator.ring import PLAIN, Ring, SessionTerms, StageFailed
from pipeshard.services.coordinator.step_batcher import DEFAULT_STEP_TOKENS
from pipeshard.services.stage.backends import (
    AUTO_KV,
    AnyBackend,
    PagedBackend,
    SessionLimits,
    ShardSpec,
    StageParts,
    StatefulBackend,
    StaticBackend,
    choose_backend,
)
from pipeshard.services.stage.domain import Step
from pipeshard.services.stage.prefix_store import PrefixStore
from pipeshard.services.stage.step_engine import RowEngine
from pipeshard.services.stage.wire import result_from_output, stage_error, step_from_frame
from pipeshard.shard import draft_heads
from pipeshard.shard.manifest import input_port, load_manifest
from pipeshard.shard.paged import DEFAULT_CACHE_BYTES
from pipeshard.shard.runtime import StageShard
from pipeshard.v1 import activation_pb2

LOCAL_OWNER = "local"  # one process, one party: the operator running it
PREFIX_CACHE_BYTES = 512 * 1024 * 1024


class InProcessStages:
    """Every stage's engine and KV service in this process, behind the ring's ``StageLink``."""

    def __init__(self, export_dir: Path, backend: AnyBackend, parts: Sequence[StageParts]):
        manifest = load_manifest(export_dir)
        self.export_dir = export_dir
        self.kv_backend = backend.name  # for messages and tests: nothing compares it
        # What the stages do, from their own GetStageInfo facts, as a fleet's coordinator asks.
        self.fleet_kv = FleetKv.agreed(AUTO, [p.facts for p in parts])
        self.shards = [p.shard for p in parts]  # one per stage, of the backend's shard class
        self.engines = [p.engine for p in parts]
        self.kv = [p.kv for p in parts]
        self.max_context = manifest.max_context
        self.vocab_size = manifest.model.vocab_size
        self._locks: list[asyncio.Lock] = []  # one step at a time per stage (made per event loop)
        self._locks_loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def of(
        cls,
        backend: AnyBackend,
        export_dir: Path | str,
        precision: str = DEFAULT_PRECISION,
        num_threads: int | None = None,
        *,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        max_sessions: int = 64,
        prefix_cache_bytes: int = PREFIX_CACHE_BYTES,
        core: ov.Core | None = None,
        invariant_ladder: str = "",
    ) -> InProcessStages:
        """Every stage of the export on ``backend``, sharing one Core. ``core``: a Core carrying
        extra CPU properties (bench-precision-modes compares compile settings through it);
        ``invariant_ladder``: at precision ``invariant``, the configurations to try
        (``--invariant-ladder``)."""
        export_dir = Path(export_dir)
        core = core or ov.Core()
        limits = SessionLimits(max_sessions)

        def store(shard: StageShard) -> PrefixStore:
            return PrefixStore(prefix_cache_bytes, layout=shard.kv_source.blocks)

        parts = [
            backend.load(
                ShardSpec(
                    export_dir,
                    i,
                    precision,
                    num_threads,
                    cache_bytes=cache_bytes,
                    core=core,
                    invariant_ladder=invariant_ladder,
                ),
                limits,
                store,
            )
            for i in range(load_manifest(export_dir).num_stages)
        ]
        return cls(export_dir, backend, parts)

    @classmethod
    def stateful(
        cls,
        export_dir: Path | str,
        precision: str = DEFAULT_PRECISION,
        num_threads: int | None = None,
        **kw: Any,
    ) -> InProcessStages:
        return cls.of(StatefulBackend(), export_dir, precision, num_threads, **kw)

    @classmethod
    def paged(
        cls,
        export_dir: Path | str,
        precision: str = DEFAULT_PRECISION,
        num_threads: int | None = None,
        **kw: Any,
    ) -> InProcessStages:
        return cls.of(PagedBackend(), export_dir, precision, num_threads, **kw)

    @classmethod
    def static(
        cls,
        export_dir: Path | str,
        precision: str = DEFAULT_PRECISION,
        num_threads: int | None = None,
        **kw: Any,
    ) -> InProcessStages:
        """Every stage of a static export (``pipeshard export --static``), a slot per session."""
        return cls.of(StaticBackend(), export_dir, precision, num_threads, **kw)

    def ring(self, *, step_tokens: int = DEFAULT_STEP_TOKENS, inflight: int = 1) -> Ring[InProcessStages]:
        """The ring over these stages, built from what they report of their backend (batching
        every session's steps, counted by stage 0's session table; in rows of a fixed chunk)."""
        return Ring(self, self.fleet_kv, step_tokens=step_tokens, inflight=inflight)

    @property
    def num_stages(self) -> int:
        return len(self.engines)

    def run_heads(self, folder: Path | str) -> int:
        """The final stage runs the draft heads in ``folder`` (as ``pipeshard stage --draft-heads``,
        checked against the export's weights); returns how many."""
        meta = draft_heads.read_meta(Path(folder))
        draft_heads.check_target(meta, self.export_dir, Path(folder))
        self.engines[-1].heads = draft_heads.DraftHeads(Path(folder), meta)
        return meta.heads

    def warmup(self) -> None:
        for shard in self.shards:
            shard.warmup()

    async def start(self) -> None:
        """Nothing to connect in one process."""

    async def close(self) -> None:
        """Nothing to disconnect in one process."""

    async def open_session(self, session_id: str, terms: SessionTerms = PLAIN) -> int:
        """Opens on every stage, all or nothing (a paged stage may refuse the capacity); its codec
        has no wire to apply to here."""
        opened = []
        try:
            for engine in self.engines:
                engine.open(LOCAL_OWNER, session_id, terms.capacity)
                opened.append(engine)
        except PipeshardError:
            for engine in opened:
                engine.sessions.release(LOCAL_OWNER, session_id)
            raise
        return self.max_context

    async def release_session(self, session_id: str) -> None:
        for engine in self.engines:
            engine.sessions.release(LOCAL_OWNER, session_id)

    async def abort_session(self, session_id: str, reason: str) -> None:
        await self.release_session(session_id)  # in one process there is no other stage to tell

    async def run(self, frames: list[activation_pb2.ActivationFrame]) -> list:
        """Every stage over the step's rows; a row failing on a stage answers with its error."""
        answers: list = [None] * len(frames)
        live: list[int] = []
        rows = []
        for i, frame in enumerate(frames):
            frame.owner = LOCAL_OWNER
            try:
                rows.extend(step_from_frame(frame, input_port(True)).rows)
                live.append(i)
            except PipeshardError as exc:
                answers[i] = StageFailed(stage_error(0, exc))
        step = Step(rows, LOCAL_OWNER)
        for index, engine in enumerate(self.engines):
            if not live:
                break
            try:
                outs = await self._run_on(index, engine, step)
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

    async def _run_on(self, index: int, engine: RowEngine, step: Step) -> list:
        """Stateful stages inline; paged ones on a worker thread, one step at a time each (the
        event loop meanwhile takes the next frames)."""
        if not self.fleet_kv.batches_steps:  # a batched step runs off the event loop
            return engine.run_step(step)
        async with self._stage_lock(index):
            return await asyncio.to_thread(engine.run_step, step)

    def _stage_lock(self, index: int) -> asyncio.Lock:
        loop = asyncio.get_running_loop()
        if self._locks_loop is not loop:  # a lock belongs to one event loop; a ring may see several
            self._locks = [asyncio.Lock() for _ in self.engines]
            self._locks_loop = loop
        return self._locks[index]

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
        """A KV call on one stage; its refusal fails the call as ``StageFailed``."""
        try:
            return method(LOCAL_OWNER, *args)
        except PipeshardError as exc:
            raise StageFailed(stage_error(index, exc)) from None


def local_ring(
    export_dir: Path | str,
    precision: str = DEFAULT_PRECISION,
    num_threads: int | None = None,
    *,
    max_sessions: int = 64,
    prefix_cache_bytes: int = PREFIX_CACHE_BYTES,
) -> Ring[InProcessStages]:
    """A ring over every stage of the export in this process on the stateful backend."""
    stages = InProcessStages.stateful(
        export_dir, precision, num_threads, max_sessions=max_sessions, prefix_cache_bytes=prefix_cache_bytes
    )
    return stages.ring()


def batched_ring(
    export_dir: Path | str,
    precision: str = DEFAULT_PRECISION,
    num_threads: int | None = None,
    *,
    cache_bytes: int = DEFAULT_CACHE_BYTES,
    max_sessions: int = 64,
    step_tokens: int = DEFAULT_STEP_TOKENS,
    prefix_cache_bytes: int = PREFIX_CACHE_BYTES,
    inflight: int = 1,
    core: ov.Core | None = None,
    invariant_ladder: str = "",
) -> Ring[InProcessStages]:
    """A ring over every stage of the export in this process on the paged backend (the static
    one for a static export), batching every running session's steps."""
    stages = InProcessStages.of(
        choose_backend(AUTO_KV, load_manifest(Path(export_dir))),
        export_dir,
        precision,
        num_threads,
        cache_bytes=cache_bytes,
        max_sessions=max_sessions,
        prefix_cache_bytes=prefix_cache_bytes,
        core=core,
        invariant_ladder=invariant_ladder,
    )
    return stages.ring(step_tokens=step_tokens, inflight=inflight)
