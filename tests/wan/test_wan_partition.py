"""A kernel partition of a hop in the WAN emulator (nftables drops every packet of stage 0's hop
to stage 1; no socket closes) is a dead hop within the stated bound: the running request ends
UNAVAILABLE naming stage 1 as unreachable from stage 0's next hop, and it stays so while the
partition lasts (a re-dialled call can look connected; the hop counts as up only once an
acknowledgement crosses). One lane: with replicas it fails over instead
(tests/pipeline/test_link_faults_fleet.py). Healed, the fleet serves the same tokens again.
Root and nft only."""

from __future__ import annotations

import json
import os
import shutil
import time

import grpc
import pytest

from pipeshard.clients.client import PipeshardClient
from pipeshard.services.wan.emulator import WanFleet

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("nft") is None,
        reason="the WAN emulator's link faults need root, iproute2 and nft (nftables)",
    ),
]

KEEPALIVE_S, KEEPALIVE_TIMEOUT_S = 1.0, 2.0
BOUND_S = KEEPALIVE_S + KEEPALIVE_TIMEOUT_S + 1.0  # docs/RELIABILITY.md "Link faults"
LOAD_SLACK_S = 5.0
PROMPT = "Write a short story about a lighthouse keeper."
TOKENS = 24


def _last_reachability(fleet: WanFleet, host: str) -> bool | None:
    log = fleet.fleet.process("coordinator").log.read_text().splitlines()
    events = [json.loads(line) for line in log if '"stage_reachability"' in line]
    return next((e["up"] for e in reversed(events) if e["address"].startswith(host)), None)


def test_a_partitioned_hop_is_named_within_the_bound_and_serves_again_once_healed(
    smollm2_export, tmp_path, monkeypatch
):
    shards = smollm2_export(2, "int4")
    monkeypatch.setenv("PIPESHARD_KEEPALIVE_S", str(KEEPALIVE_S))
    monkeypatch.setenv("PIPESHARD_KEEPALIVE_TIMEOUT_S", str(KEEPALIVE_TIMEOUT_S))
    fleet = WanFleet(shards, 2, delay_ms=5, rate_mbit=None, run_dir=tmp_path)
    with fleet, PipeshardClient(fleet.coordinator, timeout_s=120) as client:
        solo = client.generate(PROMPT, max_tokens=TOKENS, ignore_eos=True).token_ids
        got: list[int] = []
        began = None
        with pytest.raises(grpc.RpcError) as failed:
            for chunk in client.stream(PROMPT, max_tokens=TOKENS * 20, ignore_eos=True):
                got.extend(chunk.token_ids)
                if began is None and len(got) >= 4:
                    fleet.link_fault(0, "partition")
                    began = time.monotonic()
        named_after = time.monotonic() - began
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "stage 1" in failed.value.details() and "next hop" in failed.value.details()
        assert named_after <= BOUND_S + LOAD_SLACK_S, f"{named_after:.1f} s (bound {BOUND_S:g} s)"
        assert got == solo[: len(got)]
        time.sleep(2 * BOUND_S)  # re-dialled meanwhile: it must not count as up (nothing crosses)
        assert _last_reachability(fleet, "10.77.1.1") is False
        fleet.heal(0)
        deadline = time.monotonic() + 120
        while True:  # the hop re-dials with backoff (at most 2 s) once packets pass again
            try:
                again = client.generate(PROMPT, max_tokens=TOKENS, ignore_eos=True).token_ids
                break
            except grpc.RpcError:
                assert time.monotonic() < deadline, "the healed hop never served again"
                time.sleep(0.5)
        assert again == solo
