"""The stage's KV backends as types: chosen once, from the export's manifest and ``--kv``.

A backend is one class that knows its whole family: how its shard compiles (``compile``, which
``load_shard`` runs for each configuration it tries), the session type its shard hands out
(``session``), its row engine (``engine``), its KV capture and restore (``kv``), and what follows
from it for a coordinator (``traits``, reported in GetStageInfo). Nothing downstream compares a
backend's name: the stage (main.py) and the in-process ring (services/coordinator/in_process.py)
ask the chosen object. Every backend proves ``invariant`` by the same self-check
(pipeshard/shard/self_check.py); only paged feeds two-token rows, so the others walk the ladder
without those rungs.

- stateful: one compiled InferRequest per session, its cache as graph state; a step's rows run
  one after another; rewinds mask positions out; draft trees as chains.
- paged: a shared block pool; a plan frame's rows run as one inference; a rewind truncates the
  cache; draft trees as one masked sequence.
- static: S slots of C rows over KV buffers the stage owns (a static export only); rows of at
  most C tokens; a rewind truncates; rows may continue after a kept prefix; no draft trees.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Generic, TypeVar

import openvino as ov

from pipeshard.errors import InvalidArgument
from pipeshard.precision import (
    DEFAULT_PRECISION,
    Configuration,
    canonical,
    configuration,
    is_invariant,
    ladder,
)
from pipeshard.services.stage.domain import TreeForm
from pipeshard.services.stage.engine import StageEngine
from pipeshard.services.stage.kv import StageKv
from pipeshard.services.stage.meters import StageMeters, kv_bytes_per_position
from pipeshard.services.stage.paged_engine import PagedEngine, PagedSession
from pipeshard.services.stage.prefix_store import PrefixStore
from pipeshard.services.stage.sessions import SessionTable
from pipeshard.services.stage.static_engine import StaticEngine, StaticSession
from pipeshard.services.stage.step_engine import RowEngine
from pipeshard.shard.device import DEFAULT_DEVICE
from pipeshard.shard.manifest import KvLayout, Manifest
from pipeshard.shard.paged import DEFAULT_CACHE_BYTES, PagedShard
from pipeshard.shard.runtime import ShardRunner, ShardSession, StageShard
from pipeshard.shard.self_check import prove, self_check_folder
from pipeshard.shard.static import StaticShard
from pipeshard.v1 import stage_pb2

AUTO_KV = "auto"

_TREE_FORMS = {
    TreeForm.NONE: stage_pb2.DRAFT_TREE_FORM_UNSPECIFIED,
    TreeForm.CHAINS: stage_pb2.DRAFT_TREE_FORM_CHAINS,
    TreeForm.PARENTS: stage_pb2.DRAFT_TREE_FORM_PARENTS,
}


@dataclass(frozen=True)
class ShardSpec:
    """What loading one stage's shard takes, whatever its backend."""

    export_dir: Path
    stage: int
    precision: str = DEFAULT_PRECISION
    num_threads: int | None = None
    device: str = DEFAULT_DEVICE
    compile_cache: str = "off"  # "" caches in the export folder (compile_cache.py); stateful and static
    num_streams: int | None = None  # stateful only: CPU streams (None: the latency hint's one)
    cache_bytes: int = DEFAULT_CACHE_BYTES  # paged only: the block pool's byte budget
    invariant_ladder: str = ""  # at `invariant`: the configurations to try (precision.ladder)
    core: ov.Core | None = None


@dataclass(frozen=True)
class SessionLimits:
    """How many sessions a stage holds, per owner, and how long an idle one lives."""

    max_sessions: int = 64
    idle_timeout_s: float = float("inf")
    max_per_owner: int | None = None


@dataclass(frozen=True)
class Traits:
    """What follows from a backend for whoever sends it rows (GetStageInfo carries it)."""

    batches_steps: bool  # a plan frame's rows of many sessions run as one inference
    truncates_on_rewind: bool  # a rewind shortens the cache (no masked holes)
    prefix_reuse: bool  # a row may continue after a kept prefix of its cache (prefix_reuse_length)
    tree_form: TreeForm  # how a draft tree travels in one row
    maps_compile_cache: bool  # its models compile through the compiled-model cache


@dataclass(frozen=True)
class StageParts:
    """One loaded stage of a backend: its shard, row engine and KV service, and the backend's
    facts for GetStageInfo (name, traits, fixed shapes)."""

    shard: StageShard
    engine: RowEngine
    kv: StageKv
    bytes_per_position: int  # what one cached position costs (the stage's KV meter)
    row_tokens: int  # the most tokens one row may carry when the shapes fix it; 0: no such limit
    facts: stage_pb2.GetStageInfoResponse


Sh = TypeVar("Sh", bound=StageShard)
E = TypeVar("E", bound=RowEngine)


class Backend(ABC, Generic[Sh, E]):
    """One KV backend: its shard, session type, row engine and KV access."""

    name: ClassVar[str]
    traits: ClassVar[Traits]
    session: ClassVar[type]
    two_token_rows: ClassVar[bool] = False  # may feed a one-token row as two (precision.Configuration)

    def load_shard(self, spec: ShardSpec) -> Sh:
        """The stage's compiled shard (not yet warmed up) at the precision's configuration: at
        ``invariant`` the first of the backend's ladder that passes its self-check, at ``exact``
        checked against its tolerance (pipeshard/shard/self_check.py)."""
        precision = canonical(spec.precision)
        if precision == "invariant":
            configs = ladder(spec.invariant_ladder, two_token_rows=self.two_token_rows)
        else:
            configs = (configuration(precision),)
        folder = self_check_folder(spec.export_dir, spec.compile_cache, spec.device)
        check = is_invariant(precision)
        return prove(lambda config: self.compile(spec, config), configs, folder, check=check)

    @abstractmethod
    def compile(self, spec: ShardSpec, config: Configuration) -> Sh:
        """The stage's shard compiled in one configuration."""

    @abstractmethod
    def engine(self, shard: Sh, limits: SessionLimits, meters: StageMeters | None = None) -> E:
        """The row engine over the shard's sessions."""

    @abstractmethod
    def kv(self, shard: Sh, engine: E, store: PrefixStore) -> StageKv:
        """Capture and restore over the engine's sessions, with the prefix cache ``store``."""

    @abstractmethod
    def bytes_per_position(self, shard: Sh) -> int:
        """What one cached position costs (the stage's KV meter)."""

    def fixed_chunk(self, shard: Sh) -> int:
        """The most tokens one row may carry when the shapes fix it; 0: no such limit."""
        return 0

    def tree_form(self, shard: Sh) -> TreeForm:
        """How this stage takes a draft tree in one row (NONE: it verifies none)."""
        return self.traits.tree_form

    def load(
        self,
        spec: ShardSpec,
        limits: SessionLimits,
        store: Callable[[StageShard], PrefixStore],
        *,
        meters: StageMeters | None = None,
        prepare: Callable[[StageShard], object] = lambda shard: None,
    ) -> StageParts:
        """Loads the stage's shard, runs ``prepare`` on it (checks, warm-up) and builds its engine
        and KV service (``store``: the shard's prefix cache)."""
        shard = self.load_shard(spec)
        prepare(shard)
        engine = self.engine(shard, limits, meters)
        facts = stage_pb2.GetStageInfoResponse()
        self.describe(shard, facts)
        return StageParts(
            shard=shard,
            engine=engine,
            kv=self.kv(shard, engine, store(shard)),
            bytes_per_position=self.bytes_per_position(shard),
            row_tokens=self.fixed_chunk(shard),
            facts=facts,
        )

    def describe(self, shard: Sh, info: stage_pb2.GetStageInfoResponse) -> None:
        """Fills the backend's fixed facts into a stage's GetStageInfo answer."""
        info.kv_backend = self.name
        info.batches_steps = self.traits.batches_steps
        info.truncates_on_rewind = self.traits.truncates_on_rewind
        info.prefix_reuse = self.traits.prefix_reuse
        info.draft_tree_form = _TREE_FORMS[self.tree_form(shard)]


class StatefulBackend(Backend[ShardRunner, StageEngine]):
    name = "stateful"
    traits = Traits(
        batches_steps=False,
        truncates_on_rewind=False,
        prefix_reuse=False,
        tree_form=TreeForm.CHAINS,
        maps_compile_cache=True,
    )
    session = ShardSession

    def compile(self, spec: ShardSpec, config: Configuration) -> ShardRunner:
        return ShardRunner(
            spec.export_dir,
            spec.stage,
            spec.precision,
            spec.num_threads,
            num_streams=spec.num_streams,
            core=spec.core,
            device=spec.device,
            compile_cache=spec.compile_cache,
            config=config,
        )

    def engine(
        self, shard: ShardRunner, limits: SessionLimits, meters: StageMeters | None = None
    ) -> StageEngine:
        sessions = SessionTable(
            shard.new_session, limits.max_sessions, limits.idle_timeout_s, max_per_owner=limits.max_per_owner
        )
        return StageEngine(
            sessions,
            is_first=shard.is_first,
            is_last=shard.is_last,
            hidden_size=shard.hidden_size,
            max_context=shard.max_context,
            vocab_size=shard.vocab_size,
            meters=meters or StageMeters(shard.stage_index),
        )

    def kv(self, shard: ShardRunner, engine: StageEngine, store: PrefixStore) -> StageKv:
        return StageKv(engine.sessions, shard.kv_source, store)

    def bytes_per_position(self, shard: ShardRunner) -> int:
        return kv_bytes_per_position(shard)


class PagedBackend(Backend[PagedShard, PagedEngine]):
    name = "paged"
    traits = Traits(
        batches_steps=True,
        truncates_on_rewind=True,
        prefix_reuse=False,
        tree_form=TreeForm.PARENTS,
        maps_compile_cache=False,
    )
    session = PagedSession
    two_token_rows = True

    def compile(self, spec: ShardSpec, config: Configuration) -> PagedShard:
        return PagedShard(
            spec.export_dir,
            spec.stage,
            spec.precision,
            spec.num_threads,
            cache_bytes=spec.cache_bytes,
            core=spec.core,
            device=spec.device,
            config=config,
        )

    def engine(
        self, shard: PagedShard, limits: SessionLimits, meters: StageMeters | None = None
    ) -> PagedEngine:
        return PagedEngine(
            shard,
            limits.max_sessions,
            limits.idle_timeout_s,
            limits.max_per_owner,
            meters=meters,
            tree_form=self.tree_form(shard),
        )

    def tree_form(self, shard: PagedShard) -> TreeForm:
        """Trees as one masked sequence where a path's cache slots can move (not u8 pools) and the
        configuration does not promise bit-identical rows. A tree row's masked keys change how
        the attention kernel accumulates: at bf16 a path's logits were found 0.74 away from the
        same tokens decoded as a chain (beyond what the self-check's random tree probe shows), so
        at a bit-identity promise (``invariant``'s bf16 configurations) the stage verifies no
        trees and the coordinator drafts chains; ``exact`` promises a tolerance, which trees keep."""
        check = shard.proof.check if shard.proof is not None else None
        bit_identity = check is not None and check.tolerance == 0
        return TreeForm.PARENTS if shard.moves_slots and not bit_identity else TreeForm.NONE

    def kv(self, shard: PagedShard, engine: PagedEngine, store: PrefixStore) -> StageKv:
        return StageKv.paged(engine, store)

    def bytes_per_position(self, shard: PagedShard) -> int:
        return shard.block_bytes // shard.block_tokens


class StaticBackend(Backend[StaticShard, StaticEngine]):
    name = "static"
    traits = Traits(
        batches_steps=True,
        truncates_on_rewind=True,
        prefix_reuse=True,
        tree_form=TreeForm.NONE,
        maps_compile_cache=True,
    )
    session = StaticSession

    def compile(self, spec: ShardSpec, config: Configuration) -> StaticShard:
        return StaticShard(
            spec.export_dir,
            spec.stage,
            spec.precision,
            spec.num_threads,
            core=spec.core,
            device=spec.device,
            compile_cache=spec.compile_cache,
            config=config,
        )

    def engine(
        self, shard: StaticShard, limits: SessionLimits, meters: StageMeters | None = None
    ) -> StaticEngine:
        return StaticEngine(
            shard, limits.max_sessions, limits.idle_timeout_s, limits.max_per_owner, meters=meters
        )

    def kv(self, shard: StaticShard, engine: StaticEngine, store: PrefixStore) -> StageKv:
        return StageKv.static(engine, store)

    def bytes_per_position(self, shard: StaticShard) -> int:
        return kv_bytes_per_position(shard)

    def fixed_chunk(self, shard: StaticShard) -> int:
        return shard.chunk

    def describe(self, shard: StaticShard, info: stage_pb2.GetStageInfoResponse) -> None:
        super().describe(shard, info)
        info.static_slots, info.static_chunk = shard.slots, shard.chunk


AnyBackend = StatefulBackend | PagedBackend | StaticBackend

BACKENDS: dict[str, type[AnyBackend]] = {b.name: b for b in (StatefulBackend, PagedBackend, StaticBackend)}
KV_CHOICES = (AUTO_KV, *BACKENDS)  # the --kv flag's values

# The backends each manifest kind runs; the first is what ``auto`` picks.
_RUNS: dict[KvLayout, tuple[type[AnyBackend], ...]] = {
    KvLayout.STATEFUL: (PagedBackend, StatefulBackend),
    KvLayout.STATIC: (StaticBackend,),
}


def choose_backend(wanted: str, manifest: Manifest) -> AnyBackend:
    """The backend a stage of ``manifest``'s export runs: a static export's only static (``auto``
    picks it), a stateful export's paged (``auto``) or stateful. Refuses an unknown ``--kv`` and
    one the export cannot run, naming ``kv``."""
    runs = _RUNS[manifest.kv_layout]
    if wanted == AUTO_KV:
        return runs[0]()
    chosen = BACKENDS.get(wanted)
    if chosen is None:
        raise InvalidArgument("kv", f"must be one of {', '.join(KV_CHOICES)}, got {wanted!r}")
    if chosen not in runs:
        raise InvalidArgument(
            "kv",
            f"is {wanted}, but {manifest.export_dir} is a {manifest.kv_layout} export, which runs "
            f"{' or '.join(b.name for b in runs)} (--kv auto follows the manifest)",
        )
    return chosen()
