"""Prefix caching through real fleets (2 stages, INT4), no client change: a chat's next turn
restores its history on every stage; at exact it answers exactly what a fleet whose stages keep
nothing (they report every block not kept, so its coordinator never tries a restore) answers; a
prefix a stage evicted is prefilled cold without a failed restore."""

from __future__ import annotations

import os
import socket
import time

import grpc
import pytest

from pipeshard.clients.client import PipeshardClient
from pipeshard.precision import DEFAULT_PRECISION, is_invariant
from pipeshard.services.launcher import spawn, stage_args

pytestmark = pytest.mark.slow

SYSTEM = "You answer in short, precise sentences. " * 10


@pytest.fixture(scope="module")
def fleets(smollm2_export, fleet_factory, default_fleet):
    """The session's default fleet (invariant, its stages keep prefixes) and one whose stages keep
    none, at the same precision (on one CPU both prove the same configuration)."""
    assert is_invariant(DEFAULT_PRECISION), "warm == cold is promised at an invariant precision"
    cold = fleet_factory(
        smollm2_export(2, "int4"),
        2,
        precision=DEFAULT_PRECISION,
        extra_stage_args=["--prefix-cache-bytes", "0"],
    )
    return default_fleet, cold


def _conversation(address: str) -> list[list[int]]:
    """Three turns (the second speculative); each turn resends the whole history."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name two planets."}]
    replies = []
    with PipeshardClient(address, timeout_s=300) as client:
        for i, question in enumerate(("Which one is larger?", "How far is it from the Sun?", "")):
            spec = {"speculative": "ngram", "k": 3} if i == 1 else {}
            result = client.generate(messages=messages, max_tokens=24, ignore_eos=True, **spec)
            replies.append(result.token_ids)
            messages += [{"role": "assistant", "content": result.text}, {"role": "user", "content": question}]
    return replies


def _next_turn(client: PipeshardClient, max_tokens: int) -> list[dict]:
    """Runs a chat's first turn; returns the second turn's messages (the history and a question)."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name two planets."}]
    first = client.generate(messages=messages, max_tokens=max_tokens, ignore_eos=True)
    return [
        *messages,
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "Which is larger?"},
    ]


def test_warm_turns_equal_cold_turns_and_stages_keeping_nothing_are_not_asked(fleets):
    warm, cold = fleets
    warm_path = warm.process("coordinator").log
    earlier = warm_path.stat().st_size  # the shared fleet's log holds other modules' requests too
    assert _conversation(warm.coordinator) == _conversation(cold.coordinator)
    warm_log = warm_path.read_bytes()[earlier:].decode()
    cold_log = cold.process("coordinator").log.read_text()
    assert warm_log.count('"prefix_cache_hit"') >= 2 and '"prefix_cache_fallback"' not in warm_log
    # The cold fleet's stages keep nothing and say so in each keep's reply: the index holds
    # nothing, so no turn tries a restore (a failed one falls back: test_prefix_cache.py).
    assert '"prefix_cache_hit"' not in cold_log and '"prefix_cache_fallback"' not in cold_log


@pytest.mark.extended
def test_a_fast_fleet_restores_prefixes(smollm2_export, fleet_factory):
    """`make up PRECISION=fast` (paged stages at bf16 with u8 pools, no coordinator flag) keeps and
    restores prefixes too: the u8 pools' blocks travel verbatim (warm vs cold numerics:
    test_paged.py)."""
    fleet = fleet_factory(smollm2_export(2, "int4"), 2, precision="fast")
    with PipeshardClient(fleet.coordinator, timeout_s=300) as client:
        second = client.generate(messages=_next_turn(client, 8), max_tokens=8, ignore_eos=True)
    assert len(second.token_ids) == 8
    log = fleet.process("coordinator").log.read_text()
    assert '"prefix_cache_hit"' in log and '"prefix_cache_fallback"' not in log, log[-2000:]


PAGED_STAGE = ["--kv", "paged", "--num-threads", "1", "--kv-cache-bytes", str(64 << 20)]


@pytest.mark.extended
def test_paged_fleets_warm_turns_equal_cold_turns(smollm2_export, fleet_factory):
    """The same through paged stages and a plan-frame coordinator (--kv paged), where prefix
    caching is on by default at exact: warm turns restore block pools and equal a fleet whose
    stages keep nothing."""
    export = smollm2_export(2, "int4")
    paged = dict(precision="exact", extra_coordinator_args=["--kv", "paged"])
    warm = fleet_factory(export, 2, extra_stage_args=PAGED_STAGE, **paged)
    cold = fleet_factory(export, 2, extra_stage_args=[*PAGED_STAGE, "--prefix-cache-bytes", "0"], **paged)
    assert _conversation(warm.coordinator) == _conversation(cold.coordinator)
    warm_log = warm.process("coordinator").log.read_text()
    assert warm_log.count('"prefix_cache_hit"') >= 2 and '"prefix_cache_fallback"' not in warm_log
    assert '"prefix_cache_hit"' not in cold.process("coordinator").log.read_text()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _served(address: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    with PipeshardClient(address, timeout_s=60) as client:
        while True:
            try:
                client.generate("Say hi.", max_tokens=2)
                return
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)


def test_a_restarted_stage_restores_from_its_spill_folder(smollm2_export, fleet_factory, tmp_path):
    """--prefix-spill-dir: stage 1 is killed (-9) after a chat turn and started again on its port;
    the next turn still restores the history on both stages (stage 1 from its files) and answers
    what it answered before the restart."""
    export = smollm2_export(2, "int4")
    ports = [_free_port(), _free_port()]
    spill = ["--prefix-spill-dir", str(tmp_path / "spill")]
    fleet = fleet_factory(export, 2, precision="exact", stage_ports=ports, extra_stage_args=spill)
    with PipeshardClient(fleet.coordinator, timeout_s=300) as client:
        messages = _next_turn(client, 16)
        before = client.generate(messages=messages, max_tokens=16, ignore_eos=True)
        assert list((tmp_path / "spill" / "stage1").glob("*.kvblock"))
        stage1 = fleet.process("stage1")
        stage1.popen.kill()
        stage1.popen.wait()
        args = stage_args(1, export, ports[1], "exact", "json", None, spill)
        fleet.processes[fleet.processes.index(stage1)] = spawn(
            "stage1", args, fleet.run_dir, dict(os.environ), 180
        )
        _served(fleet.coordinator)
        after = client.generate(messages=messages, max_tokens=16, ignore_eos=True)
    assert after.token_ids == before.token_ids
    log = fleet.process("coordinator").log.read_text()
    assert log.count('"prefix_cache_hit"') == 2 and '"prefix_cache_fallback"' not in log
    assert '"prefix_spill"' in fleet.process("stage1").log.read_text()


# One full 32-position block of f32 KV on a stage of the 2-stage export at exact: 15 layers x K and
# V x 3 KV heads x head size 64 x 4 bytes per position. The cache below holds 14 of them: one of
# the chats (about 10 blocks each), not two.
BLOCK_BYTES = 15 * 2 * 3 * 64 * 4 * 32
MISSES = "pipeshard_coordinator_prefix_stage_misses_total"


def test_a_prefix_a_stage_evicted_is_prefilled_cold_and_one_it_holds_is_restored(
    smollm2_export, fleet_factory
):
    """Stages whose prefix cache holds one chat: chat B's first turn evicts chat A's blocks and the
    stages report it, so A's next turn prefills cold without trying a restore (no failed restore,
    no stage miss) while B's next turn restores what the stages still hold."""
    from pipeshard.services.fleet_status import scrape

    port = _free_port()
    fleet = fleet_factory(
        smollm2_export(2, "int4"),
        2,
        precision="exact",
        extra_stage_args=["--prefix-cache-bytes", str(14 * BLOCK_BYTES)],
        metrics_ports={"coordinator": port},
    )
    chats = {
        name: [{"role": "system", "content": system}, {"role": "user", "content": "Name two planets."}]
        for name, system in (
            ("a", "You answer in short, precise sentences. " * 36),
            ("b", "Be brief and kind. " * 56),
        )
    }
    with PipeshardClient(fleet.coordinator, timeout_s=300) as client:
        first = {}
        for name in ("a", "b"):  # B's keep evicts A's blocks (the least recently used)
            first[name] = client.generate(messages=chats[name], max_tokens=4, ignore_eos=True)
            chats[name] += [
                {"role": "assistant", "content": first[name].text},
                {"role": "user", "content": "Which is larger?"},
            ]
        b = client.generate(messages=chats["b"], max_tokens=4, ignore_eos=True)
        a = client.generate(messages=chats["a"], max_tokens=4, ignore_eos=True)
    assert first["a"].prompt_tokens > 9 * 32 and first["b"].prompt_tokens > 9 * 32  # each ~10 blocks
    assert b.cached_tokens > first["b"].prompt_tokens // 2  # still held: restored
    assert a.cached_tokens == 0  # evicted and reported: a clean cold prefill
    log = fleet.process("coordinator").log.read_text()
    assert log.count('"prefix_cache_hit"') == 1 and '"prefix_cache_fallback"' not in log, log[-2000:]
    assert scrape("127.0.0.1", port).value(MISSES) == 0
    assert any(n == MISSES for n, _ in scrape("127.0.0.1", port).samples)  # the counter is served
