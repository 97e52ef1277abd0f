"""Real 2-stage fleets with emulated latency: the same tokens, and every token pays N+1 delayed hops."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from pipeshard.clients.client import PipeshardClient
from pipeshard.services.launcher import start_fleet
from pipeshard.services.wan.emulator import WanFleet

pytestmark = pytest.mark.slow

STAGES = 2
DELAY_MS = 20.0
HOPS = STAGES + 1  # coordinator -> stage 0 -> stage 1 -> coordinator
REQUEST = {"prompt": "What is the capital of France?", "max_tokens": 16, "ignore_eos": True}


def _decode(address: str) -> tuple[list[int], float]:
    """Greedy token ids and the per-token time in ms (the coordinator's decode rate)."""
    with PipeshardClient(address, timeout_s=120) as client:
        client.generate(**REQUEST)  # warm-up: first-request costs stay out of the timing
        result = client.generate(**REQUEST)
    assert result.completion_tokens == 16
    return result.token_ids, 1000.0 / result.tok_s


@pytest.fixture(scope="module")
def shards(smollm2_export):
    return smollm2_export(STAGES, "int4")


@pytest.fixture(scope="module")
def plain(shards, tmp_path_factory):
    fleet = start_fleet(shards, STAGES, tmp_path_factory.mktemp("plain"))
    try:
        yield _decode(fleet.coordinator)
    finally:
        fleet.stop()


def test_in_process_hop_delay_keeps_tokens_and_delays_every_hop(shards, plain, tmp_path):
    delay = ["--hop-delay-ms", f"{DELAY_MS:g}"]
    fleet = start_fleet(shards, STAGES, tmp_path, extra_stage_args=delay, extra_coordinator_args=delay)
    try:
        tokens, per_token_ms = _decode(fleet.coordinator)
    finally:
        fleet.stop()
    print(f"hook: {per_token_ms:.1f} ms/token at {DELAY_MS:g} ms/hop (plain {plain[1]:.1f})")
    assert tokens == plain[0]
    assert per_token_ms >= HOPS * DELAY_MS


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="the WAN emulator needs root and iproute2 (network namespaces, veth pairs, tc)",
)
def test_wan_fleet_keeps_tokens_delays_every_hop_and_leaves_nothing(shards, plain, tmp_path):
    with WanFleet(shards, STAGES, DELAY_MS, 100, tmp_path) as fleet:
        namespaces = [link.namespace for link in fleet.links]
        veths = [link.root_if for link in fleet.links]
        tokens, per_token_ms = _decode(fleet.coordinator)
    print(f"wan: {per_token_ms:.1f} ms/token at {DELAY_MS:g} ms/hop, 100 mbit (plain {plain[1]:.1f})")
    assert tokens == plain[0]
    assert per_token_ms >= HOPS * DELAY_MS
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    links = subprocess.run(["ip", "link"], capture_output=True, text=True, check=True).stdout
    assert not any(name in listed for name in namespaces), listed
    assert not any(veth in links for veth in veths), links
