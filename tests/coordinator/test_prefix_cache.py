"""Prefix caching in the coordinator: the index, the all-or-nothing restore with its fallbacks,
and warm output equal to cold on real INT4 shards at exact (1, 2 and 3 stages, with and without
speculative decoding)."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import REGISTRY

from pipeshard.errors import NotFound
from pipeshard.services.coordinator.generation import Chunk, Generation, Summary
from pipeshard.services.coordinator.prefix_cache import PrefixIndex
from pipeshard.services.coordinator.ring import StageFailed
from pipeshard.services.coordinator.sampling import SamplingParams
from pipeshard.services.stage.wire import stage_error
from pipeshard.shard.prefix_chain import BLOCK, block_chain
from pipeshard.v1 import activation_pb2

# -- the index ----------------------------------------------------------------------------------


def test_index_finds_the_longest_shared_prefix_within_a_scope_only():
    index = PrefixIndex(max_blocks=64, min_tokens=4)
    index.add("alice", list(range(100)))
    index.add("alice", [*range(50), 7, 7, 7, 7, 7, 7])
    hit = index.lookup("alice", [*range(60), 1, 2])
    assert hit.positions == 60 and hit.tokens == list(range(64))  # cut after the block it needs
    index.unpin(hit)
    assert index.lookup("bob", list(range(100))) is None  # another client's entries stay invisible
    # The whole prompt matches: its last two tokens are still prefilled (the last one's logits give
    # the first token; two run as a chunk, the path an invariant stage's rows take).
    assert index.lookup("alice", list(range(100))).positions == 98
    # A longer prompt reuses the whole kept sequence, its partial last block included.
    longer = index.lookup("alice", [*range(100), 5, 5])
    assert longer.positions == 100 and longer.tokens == list(range(100))
    assert index.lookup("alice", [0, 1, 2, 9]) is None  # 3 shared tokens < min_tokens
    assert index.lookup("alice", [0, 1, 2, 3, 4, 9]).tokens == list(range(32))  # within the first block


def test_shared_scope_is_one_scope_for_everyone_and_identities_stay_apart():
    """With --prefix-cache-scope shared every request carries SHARED_PREFIX_SCOPE (servicer.py):
    what one identity kept there another finds; identity scopes never see it or each other."""
    from pipeshard.services.coordinator.servicer import SHARED_PREFIX_SCOPE

    index = PrefixIndex(min_tokens=4)
    index.add(SHARED_PREFIX_SCOPE, list(range(40)))
    index.add("alice", list(range(100, 140)))
    assert index.lookup(SHARED_PREFIX_SCOPE, list(range(42))).positions == 40
    assert index.lookup("alice", list(range(42))) is None
    assert index.lookup("bob", list(range(100, 142))) is None
    assert index.lookup("alice", list(range(100, 142))).positions == 40


def test_an_eviction_report_drops_the_block_and_everything_chained_on_it():
    index = PrefixIndex(min_tokens=4)
    system = list(range(1000, 1000 + 2 * BLOCK))
    one, two = [*system, *range(40)], [*system, *range(500, 540)]
    index.add("s", one)
    index.add("s", two)
    assert len(index) == 2 + 2 * 2  # the system prompt's blocks are indexed once
    index.forget([block_chain("s", one)[2].key])  # one's third block: its fourth goes with it
    assert index.lookup("s", [*one, 1, 1]).positions == 2 * BLOCK
    assert index.lookup("s", [*two, 1, 1]).positions == len(two)
    index.forget([block_chain("s", system)[1].key])  # the system prompt's second block
    assert index.lookup("s", [*two, 1, 1]).positions == BLOCK
    assert len(index) == 1
    index.forget(["not-a-key"])  # a block this index never had
    assert len(index) == 1


def test_lru_evicts_unpinned_leaves_and_a_failed_restore_drops_its_chain():
    index = PrefixIndex(max_blocks=4, min_tokens=1)
    a, b = list(range(2 * BLOCK)), list(range(100, 100 + 2 * BLOCK))
    index.add("s", a)
    pinned = index.lookup("s", [*a, 1])
    index.add("s", b)  # 4 blocks: at the limit
    index.add("s", [7, 7, 7])  # over it: b's last block goes (a is pinned, b's first is newer)
    assert len(index) == 4
    assert index.lookup("s", [*b, 1]).positions == BLOCK
    index.unpin(pinned)
    index.drop(pinned)  # a failed restore forgets the chain it used
    assert index.lookup("s", [*a, 1]) is None


# -- restore and fallback, on a fake ring -------------------------------------------------------


class Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)


class Ring:
    """Answers token 7 to every step; records what happens to sessions; restores as told."""

    truncates_on_rewind, batch_steps = False, None  # a stateful ring's, stepping alone
    verifies_trees = True

    def __init__(self, restore: str = "ok"):
        self.restore, self.calls, self.frames = restore, [], []

    async def open_session(self, session_id, capacity=None, admission=None):
        self.calls.append(("open", session_id))
        return 4096

    async def step(self, frame, slot=None):
        self.frames.append((frame.session_id, list(frame.positions)))
        return activation_pb2.StepResult(top1=activation_pb2.Top1(token_ids=[7], probabilities=[1.0]))

    async def release_session(self, session_id):
        self.calls.append(("release", session_id))

    async def abort_session(self, session_id, reason):
        self.calls.append(("abort", session_id, reason))

    async def keep_kv(self, session_id, scope, token_ids):
        self.calls.append(("keep", session_id, scope, len(token_ids)))
        return set()

    async def restore_kv(self, session_id, scope, token_ids, positions, timeout_s):
        self.calls.append(("restore", session_id, positions))
        if self.restore == "missing":
            raise StageFailed(stage_error(1, NotFound("prefix cache has no block for positions from 32")))
        if self.restore == "hang":
            await asyncio.sleep(60)
        return set()


def _misses() -> float:
    return REGISTRY.get_sample_value("pipeshard_coordinator_prefix_stage_misses_total") or 0.0


async def _generate(generation: Generation, prompt: list[int], scope: str = "c") -> Summary:
    events = [e async for e in generation.run(prompt, SamplingParams(max_tokens=4), scope=scope)]
    await asyncio.sleep(0.01)  # background releases and aborts
    assert all(isinstance(e, Chunk) for e in events[:-1])
    return events[-1]


@pytest.mark.parametrize("failure", ["ok", "missing", "hang"])
def test_second_turn_restores_or_falls_back_whole(failure):
    ring = Ring(failure)
    generation = Generation(ring, Tokenizer(), set(), prefix=PrefixIndex(min_tokens=8), restore_timeout_s=0.2)
    first = list(range(100, 140))

    async def two_turns():
        cold = await _generate(generation, first)
        warm = await _generate(generation, [*first, 7, 7, 7, 5, 6, 7])
        return cold, warm

    misses = _misses()
    cold, warm = asyncio.run(two_turns())
    # Only a stage's NOT_FOUND is a stage miss (a late stage is a timeout, not a miss).
    assert _misses() - misses == (1 if failure == "missing" else 0)
    assert cold.cached_tokens == 0
    kept = [c for c in ring.calls if c[0] == "keep"]
    assert kept[0][2:] == ("c", 40 + 3)  # prompt and generated tokens but the last
    second = [c for c in ring.calls if c[0] == "open"][1][1]
    assert ("restore", second, 43) in ring.calls
    if failure == "ok":
        assert warm.cached_tokens == 43
        assert ring.frames[-4] == (second, [43, 44, 45])  # only the uncached suffix is prefilled
    else:
        # The restored-into session is aborted; a fresh one runs the whole prompt cold.
        assert warm.cached_tokens == 0
        (abort,) = [c for c in ring.calls if c[0] == "abort"]
        assert abort[1] == second and "prefix restore failed" in abort[2]
        third = [c for c in ring.calls if c[0] == "open"][2][1]
        assert ring.frames[-4] == (third, list(range(46)))
        # The failed chain is forgotten; the new sequence's blocks are kept (49 tokens: 2 blocks).
        assert len(generation.prefix) == 2
        assert generation.prefix.lookup("c", list(range(100, 200))).positions == 40
    assert warm.token_ids == cold.token_ids == [7, 7, 7, 7]


def test_other_clients_and_opted_out_requests_neither_hit_nor_keep():
    ring = Ring()
    generation = Generation(ring, Tokenizer(), set(), prefix=PrefixIndex(min_tokens=8))
    prompt = list(range(100, 140))

    async def run():
        await _generate(generation, prompt, scope="alice")
        assert (await _generate(generation, prompt, scope="bob")).cached_tokens == 0
        events = [e async for e in generation.run(prompt, SamplingParams(max_tokens=2), cache=False)]
        return events[-1]

    assert asyncio.run(run()).cached_tokens == 0
    assert [c[2] for c in ring.calls if c[0] == "keep"] == ["alice", "bob"]
    assert not [c for c in ring.calls if c[0] == "restore"]


# -- real shards --------------------------------------------------------------------------------


def _chat(prompter, turns: list[tuple[str, str]]) -> list[int]:
    return prompter.encode("", turns)


@pytest.fixture(scope="module")
def prompter(smollm2_export):
    from pipeshard.shard.prompting import Prompter

    return Prompter.from_dir(smollm2_export(1, "int4"))


def _warm_against_cold(ring, export, prompter, modes, **generation_args) -> list[int]:
    """Three chat turns on one warm Generation against each turn's prompt on a cold one, token for
    token, in each speculative mode; returns every turn's restored positions."""

    from pipeshard.services.coordinator.speculation.sources import DraftSources

    drafts = DraftSources(export)
    args = dict(drafts=drafts, **generation_args)
    warm = Generation(ring, prompter.tokenizer, prompter.eos_ids, prefix=PrefixIndex(), **args)
    cold = Generation(ring, prompter.tokenizer, prompter.eos_ids, **args)
    params = SamplingParams(max_tokens=32, ignore_eos=True)

    async def tokens(generation, ids, speculative="none", k=0):
        events = [e async for e in generation.run(ids, params, speculative=speculative, k=k)]
        return events[-1]

    async def conversation(speculative, k):
        turns = [("system", "You are a careful assistant. " * 12), ("user", "Name three rivers in Europe.")]
        for question in ("And in Africa?", "Which of them is the longest?"):
            ids = _chat(prompter, turns)
            got = await tokens(warm, ids, speculative, k)
            want = await tokens(cold, ids, speculative, k)
            assert got.token_ids == want.token_ids, (speculative, k, len(ids))
            yield got
            turns += [("assistant", got.text), ("user", question)]

    async def run():
        hits = []
        for speculative, k in modes:
            async for summary in conversation(speculative, k):
                hits.append(summary.cached_tokens)
        await warm.released()
        await cold.released()
        return hits

    hits = asyncio.run(run())
    # Every turn after a conversation's first restores most of its prompt; the first turn of each
    # conversation hits the system prompt the previous conversation left.
    assert hits[0] == 0 and all(h >= 64 for h in hits[1:]), hits
    return hits


@pytest.mark.slow
@pytest.mark.parametrize("stages", [pytest.param(n, marks=pytest.mark.extended) for n in (1, 2, 3)])
def test_warm_equals_cold_int4_exact(stages, smollm2_export, prompter):
    """Stateful stages: plain greedy and speculative (prompt lookup at K=3, and adaptive K on 2
    stages)."""
    from pipeshard.services.coordinator.in_process import local_ring

    export = smollm2_export(stages, "int4")
    modes = (("none", 0), ("ngram", 3), ("ngram", 0)) if stages == 2 else (("none", 0), ("ngram", 3))
    _warm_against_cold(local_ring(export, precision="exact"), export, prompter, modes)


def _paged_warm_against_cold(stages, smollm2_export, prompter, modes):
    from pipeshard.services.coordinator.in_process import batched_ring

    export = smollm2_export(stages, "int4")
    ring = batched_ring(export, "exact", 1, cache_bytes=96 << 20)
    _warm_against_cold(ring, export, prompter, modes, prefill_chunk=ring.prefill_chunk)
    stored = [kv.store for kv in ring.stages.kv]
    # Blocks the paged stages captured, stored once however many turns shared them.
    assert all(len(store) and store.nbytes <= store.budget_bytes for store in stored)
    assert [len(kv.sessions) for kv in ring.stages.kv] == [0] * stages  # every session released


@pytest.mark.slow
def test_paged_warm_equals_cold_int4_exact(smollm2_export, prompter):
    """Paged stages (block pools, one thread, exact), 2 stages: a restored prefix's suffix runs in
    the paged kernel's chunks on a filled cache and gives the cold tokens, plain and speculative."""
    _paged_warm_against_cold(2, smollm2_export, prompter, (("none", 0), ("ngram", 3)))


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("stages", [1, 3])
def test_paged_warm_equals_cold_int4_exact_other_stage_counts(stages, smollm2_export, prompter):
    _paged_warm_against_cold(stages, smollm2_export, prompter, (("none", 0), ("ngram", 0)))


@pytest.mark.slow
def test_a_restore_failing_on_one_stage_is_undone_on_every_stage(smollm2_export, prompter):
    """2 stages: stage 0 restores, stage 1 lost what it kept without reporting it (restarted
    without a spill folder) and refuses; the request runs cold in a new session, equal to a cold
    run, no session is left on either stage, and the miss is counted."""
    from pipeshard.services.coordinator.in_process import local_ring
    from pipeshard.services.stage.prefix_store import PrefixStore

    ring = local_ring(smollm2_export(2, "int4"), precision="exact")
    warm = Generation(ring, prompter.tokenizer, prompter.eos_ids, prefix=PrefixIndex())
    cold = Generation(ring, prompter.tokenizer, prompter.eos_ids)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    turns = [("system", "You are a careful assistant. " * 12), ("user", "Name three rivers in Europe.")]

    async def run(generation, ids):
        events = [e async for e in generation.run(ids, params)]
        await generation.released()
        return events[-1]

    async def both():
        first = await run(warm, _chat(prompter, turns))
        ring.stages.kv[1].store = PrefixStore(0)  # stage 1 restarted: its cache is gone, unreported
        ids = _chat(prompter, [*turns, ("assistant", first.text), ("user", "And in Africa?")])
        return await run(warm, ids), await run(cold, ids)

    misses = _misses()
    got, want = asyncio.run(both())
    assert got.cached_tokens == 0 and got.token_ids == want.token_ids
    assert [len(kv.sessions) for kv in ring.stages.kv] == [0, 0]
    assert _misses() - misses == 1
    # The failed chain went; stage 1 (budget 0) reported the second turn's blocks not kept.
    assert len(warm.prefix) == 0
