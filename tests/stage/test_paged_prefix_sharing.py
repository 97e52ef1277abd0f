"""A paged stage's prefix cache shares pool blocks (services/stage/kv.py, pipeshard/shard/paged.py):
n sessions restored from one kept prompt reference its full blocks once, continue exactly as a
copied restore does, and a session rewound into what it shares takes its own blocks first, so
the others are untouched. INT4 2-stage SmolLM2 shards in exact mode."""

from __future__ import annotations

import numpy as np
import pytest

from pipeshard.errors import ResourceExhausted
from pipeshard.services.stage.kv import StageKv
from pipeshard.services.stage.paged_engine import PagedEngine
from pipeshard.services.stage.prefix_store import PrefixStore
from pipeshard.shard.kvblob import KvBlob
from pipeshard.shard.paged import PagedRow, PagedShard

pytestmark = pytest.mark.slow

OWNER, SCOPE = "coordinator-a", "user-1"


@pytest.fixture(scope="module")
def stages(smollm2_export):
    export = smollm2_export(2, "int4")
    out = []
    for s in (0, 1):
        engine = PagedEngine(PagedShard(export, s, "exact", 1, cache_bytes=48 << 20), 16, 600.0)
        out.append((engine, StageKv.paged(engine, PrefixStore(64 << 20))))
    return out


def _step(stages, feeds: dict[str, list[int]]) -> dict[str, np.ndarray]:
    """One inference per stage for ``feeds`` (session -> token ids); returns last-row logits."""
    sids = list(feeds)
    first, last = stages[0][0], stages[1][0]
    keys = [[e.sessions.get(OWNER, s).key for s in sids] for e in (first, last)]
    hidden = first.shard.step([PagedRow(k, np.array(feeds[s])) for k, s in zip(keys[0], sids, strict=True)])
    logits = last.shard.step([PagedRow(k, h, logits=1) for k, h in zip(keys[1], hidden, strict=True)])
    return {s: lg[-1] for s, lg in zip(sids, logits, strict=True)}


def _greedy(stages, sids: list[str], first: dict[str, np.ndarray], n: int) -> dict[str, list[int]]:
    out = {s: [int(first[s].argmax())] for s in sids}
    for _ in range(n - 1):
        logits = _step(stages, {s: [out[s][-1]] for s in sids})
        for s in sids:
            out[s].append(int(logits[s].argmax()))
    return out


def test_sessions_restored_from_one_prompt_share_its_blocks(stages, chat_prompt_ids):
    prompt = chat_prompt_ids[0] * 3
    positions = len(prompt) - 1  # the coordinator leaves the prompt's last token to compute
    capacity = len(prompt) + 16
    for engine, _ in stages:
        engine.open(OWNER, "warm", capacity)
    _step(stages, {"warm": prompt})
    for engine, kv in stages:
        kv.keep(OWNER, "warm", SCOPE, prompt)
        engine.sessions.release(OWNER, "warm")
    shard = stages[0][0].shard
    full = len(prompt) // shard.block_tokens
    shared = positions // shard.block_tokens
    need = shard.blocks_for(capacity)
    assert shared >= 2 and all(e.shard.usage().blocks_used == 0 for e, _ in stages)
    assert all(e.shard.usage().blocks_cached == full for e, _ in stages)  # pinned, no session uses them

    sids = [f"choice-{i}" for i in range(4)]
    for engine, kv in stages:
        for sid in sids:
            engine.open(OWNER, sid, capacity)
            kv.restore_cached(OWNER, sid, SCOPE, prompt, positions)
        # The prompt's shared blocks once, and each session's own blocks from the first it writes.
        assert engine.shard.usage().blocks_used == shared + 4 * (need - shared)
        # A copied restore (as a stateful stage does) holds all of its blocks itself.
        engine.open(OWNER, "copy", capacity)
        arrays = kv.store.get(OWNER, SCOPE, prompt, positions)
        kv.restore(OWNER, "copy", KvBlob(kv.source, (), tuple(arrays), "", positions), checked=True)
        assert engine.shard.usage().blocks_used == shared + 4 * (need - shared) + need

    # Every shared session continues bit for bit as the copied one.
    first = _step(stages, {sid: [prompt[-1]] for sid in [*sids, "copy"]})
    for sid in sids:
        np.testing.assert_array_equal(first[sid], first["copy"])
    tokens = _greedy(stages, [*sids, "copy"], first, 6)
    assert all(tokens[sid] == tokens["copy"] for sid in sids)

    # Rewound into the shared prompt, a session takes its own blocks (the partial one copied);
    # what it then writes leaves the others' prompt alone.
    for engine, _ in stages:
        engine.shard.rewind(engine.sessions.get(OWNER, sids[0]).key, positions - 40)
        assert engine.shard.usage().blocks_used > shared + 4 * (need - shared) + need
    _step(stages, {sids[0]: list(range(100, 140))})
    for engine, _ in stages:
        for sid in sids[1:]:
            engine.shard.rewind(engine.sessions.get(OWNER, sid).key, positions)
        engine.shard.rewind(engine.sessions.get(OWNER, "copy").key, positions)
    again = _step(stages, {sid: [prompt[-1]] for sid in [*sids[1:], "copy"]})
    for sid in sids[1:]:
        np.testing.assert_array_equal(again[sid], first["copy"])

    for engine, _ in stages:
        for sid in [*sids, "copy"]:
            engine.sessions.release(OWNER, sid)
        usage = engine.shard.usage()
        assert usage.blocks_used == 0 and usage.blocks_cached == full
        # Pinned blocks no session uses give way to a session that needs the whole pool.
        engine.open(OWNER, "big", usage.blocks_total * usage.block_tokens // 2)
        engine.open(OWNER, "big2", usage.blocks_total * usage.block_tokens // 2)
        assert engine.shard.usage().blocks_cached == 0
        with pytest.raises(ResourceExhausted, match="blocks free"):
            engine.shard.open(("extra",), 1)
        engine.sessions.release(OWNER, "big")
        engine.sessions.release(OWNER, "big2")
