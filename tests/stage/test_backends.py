"""The KV backends as types (services/stage/backends.py): chosen once from the manifest and
``--kv``, each one class for its shard, session, engine and KV access, and what GetStageInfo
answers for each."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from pipeshard.errors import FailedPrecondition, InvalidArgument
from pipeshard.services.stage.backends import (
    BACKENDS,
    KV_CHOICES,
    PagedBackend,
    SessionLimits,
    StatefulBackend,
    StaticBackend,
    choose_backend,
)
from pipeshard.services.stage.domain import TreeForm
from pipeshard.services.stage.engine import StageEngine
from pipeshard.services.stage.kv import PagedAccess, StatefulAccess, StaticAccess
from pipeshard.services.stage.paged_engine import PagedEngine, PagedSession
from pipeshard.services.stage.servicer import StageServicer
from pipeshard.services.stage.static_engine import StaticEngine, StaticSession
from pipeshard.shard.manifest import KvLayout, check_layout
from pipeshard.shard.paged import PagedShard
from pipeshard.shard.runtime import ShardRunner, ShardSession
from pipeshard.shard.static import StaticShard
from pipeshard.v1 import stage_pb2
from tests.stage.test_row_engines import OWNER, FakePagedShard, FakeSession, FakeStaticShard

STATIC = SimpleNamespace(kv_layout=KvLayout.STATIC, export_dir="/x/static")
STATEFUL = SimpleNamespace(kv_layout=KvLayout.STATEFUL, export_dir="/x/plain")


def test_each_manifest_kind_chooses_its_backend_class():
    assert type(choose_backend("auto", STATEFUL)) is PagedBackend
    assert type(choose_backend("paged", STATEFUL)) is PagedBackend
    assert type(choose_backend("stateful", STATEFUL)) is StatefulBackend
    assert type(choose_backend("auto", STATIC)) is StaticBackend
    assert type(choose_backend("static", STATIC)) is StaticBackend
    assert set(KV_CHOICES) == {"auto", *BACKENDS} and len(BACKENDS) == 3


def test_the_backend_follows_the_manifest_and_a_mismatch_is_refused_by_name():
    for wanted, manifest in (("paged", STATIC), ("stateful", STATIC), ("static", STATEFUL)):
        with pytest.raises(InvalidArgument, match=f"`kv` is {wanted}, but .* export, which runs"):
            choose_backend(wanted, manifest)


def test_an_unknown_backend_is_refused_by_name():
    with pytest.raises(
        InvalidArgument, match="`kv` must be one of auto, stateful, paged, static, got 'ring'"
    ):
        choose_backend("ring", STATEFUL)


def test_an_unknown_manifest_kind_is_refused_by_name(tmp_path):
    check_layout(tmp_path, None, False)  # exports before the field: the static block decides
    check_layout(tmp_path, "static", True)
    check_layout(tmp_path, "stateful", False)
    with pytest.raises(
        FailedPrecondition, match="kv_layout is 'paged-v2'; this pipeshard reads stateful or static"
    ):
        check_layout(tmp_path, "paged-v2", False)
    with pytest.raises(FailedPrecondition, match="kv_layout is 'static' but the `static` block is missing"):
        check_layout(tmp_path, "static", False)


def test_each_backend_names_its_family():
    """One class per backend reaches its shard, session, engine and KV access."""
    family = {
        StatefulBackend: (ShardRunner, ShardSession),
        PagedBackend: (PagedShard, PagedSession),
        StaticBackend: (StaticShard, StaticSession),
    }
    for backend, (shard, session) in family.items():
        assert backend.session is session
        assert backend.compile.__annotations__["return"] == shard.__name__
    limits = SessionLimits(8, 60.0, 4)
    paged = PagedBackend().engine(FakePagedShard(True), limits)
    static_shard = FakeStaticShard(True)
    static_shard.kv_source = SimpleNamespace(blocks=None)
    static = StaticBackend().engine(static_shard, limits)
    assert isinstance(paged, PagedEngine) and paged.sessions.max_per_owner == 4
    assert isinstance(static, StaticEngine) and static.sessions.max_per_owner == 4
    assert isinstance(PagedBackend().kv(paged.shard, paged, None).access, PagedAccess)
    assert isinstance(StaticBackend().kv(static.shard, static, None).access, StaticAccess)
    runner = SimpleNamespace(
        new_session=FakeSession, is_first=True, is_last=True, hidden_size=4, max_context=64, vocab_size=11,
        stage_index=0, kv_source=SimpleNamespace(blocks=None),
    )  # fmt: skip
    stateful = StatefulBackend().engine(runner, limits)
    assert isinstance(stateful, StageEngine) and stateful.tree_form is TreeForm.CHAINS
    assert isinstance(StatefulBackend().kv(runner, stateful, None).access, StatefulAccess)


def _info(backend, engine, shard, owner_metadata=()):
    facts = stage_pb2.GetStageInfoResponse(stage_index=0)
    backend.describe(shard, facts)
    servicer = StageServicer(SimpleNamespace(engine=engine, next_hops=[]), facts)
    context = SimpleNamespace(invocation_metadata=lambda: owner_metadata)
    return asyncio.run(servicer.GetStageInfo(stage_pb2.GetStageInfoRequest(), context))


def test_stage_info_answers_what_follows_from_each_backend():
    limits = SessionLimits(8, 60.0)
    runner = SimpleNamespace(
        new_session=FakeSession, is_first=True, is_last=True, hidden_size=4, max_context=64, vocab_size=11,
        stage_index=0,
    )  # fmt: skip
    stateful = StatefulBackend()
    engine = stateful.engine(runner, limits)
    engine.open(OWNER, "a")
    info = _info(stateful, engine, runner)
    assert (info.kv_backend, info.batches_steps, info.truncates_on_rewind, info.prefix_reuse) == (
        "stateful", False, False, False,
    )  # fmt: skip
    assert info.draft_tree_form == stage_pb2.DRAFT_TREE_FORM_CHAINS and info.live_sessions == 1
    assert (info.static_chunk, info.kv_cache_blocks) == (0, 0)

    shard = FakePagedShard(True)
    shard.usage = lambda: SimpleNamespace(
        budget_bytes=64 << 10, bytes_used=0, block_tokens=8, blocks_total=64, blocks_free=64
    )
    paged = PagedBackend()
    info = _info(paged, paged.engine(shard, limits), shard)
    assert (info.kv_backend, info.batches_steps, info.truncates_on_rewind, info.prefix_reuse) == (
        "paged", True, True, False,
    )  # fmt: skip
    assert info.draft_tree_form == stage_pb2.DRAFT_TREE_FORM_PARENTS
    assert (info.kv_cache_blocks, info.kv_block_tokens, info.static_chunk) == (64, 8, 0)

    static = StaticBackend()
    shard = FakeStaticShard(True)
    engine = static.engine(shard, limits)
    engine.open(OWNER, "a")
    engine.open(OWNER, "b")
    info = _info(static, engine, shard)
    assert (info.kv_backend, info.batches_steps, info.truncates_on_rewind, info.prefix_reuse) == (
        "static", True, True, True,
    )  # fmt: skip
    assert info.draft_tree_form == stage_pb2.DRAFT_TREE_FORM_UNSPECIFIED  # no draft trees
    assert (info.static_slots, info.static_chunk, info.static_slots_used, info.kv_cache_blocks) == (
        4,
        8,
        2,
        0,
    )


@pytest.mark.slow
def test_a_manifest_naming_an_unknown_kind_is_refused_when_read(smollm2_export):
    import json

    from pipeshard.shard.manifest import MANIFEST, Manifest

    export = smollm2_export(2, "int4")
    raw = json.loads((export / MANIFEST).read_text())
    assert Manifest.from_dict(export, raw).kv_layout is KvLayout.STATEFUL
    with pytest.raises(FailedPrecondition, match="kv_layout is 'paged-v2'"):
        Manifest.from_dict(export, {**raw, "kv_layout": "paged-v2"})
