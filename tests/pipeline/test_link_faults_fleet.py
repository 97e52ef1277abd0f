"""Link faults between stages, through real processes: 2 stages x 2 lanes, every hop between stages
through its own forwarder (``faulty_links``), keepalive every 1 s with a 2 s timeout.

A hop that stalls without closing (its forwarder holds every byte, the sockets stay open) is
found by keepalive and named by the coordinator within the stated bound (keepalive + timeout +
1 s), as its lane's next stage being unreachable from the one before; the requests on that lane
finish on the other with the tokens of an undisturbed run. A link that drops (RSTs) is the same
at once. Once healed, the lane rejoins and serves the same tokens.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import UTC, datetime

import pytest

from pipeshard.clients.client import PipeshardClient
from pipeshard.services.launcher import Fleet, link_control, link_name, stage_name
from pipeshard.services.wan.faults import command
from tests.pipeline.concurrent_streams import concurrently

pytestmark = pytest.mark.slow

KEEPALIVE_S, KEEPALIVE_TIMEOUT_S = 1.0, 2.0
BOUND_S = KEEPALIVE_S + KEEPALIVE_TIMEOUT_S + 1.0  # docs/RELIABILITY.md "Link faults"
LOAD_SLACK_S = 5.0  # a shared 2-core machine: the log line may come this much later
TOKENS = 32
FAULT_AFTER = 6  # tokens the first stream has out when the link fails
_SCENE = "The village sits where the river bends past the old mill, the orchard and the stone bridge. " * 4
PROMPTS = [f"{_SCENE}Write a short story about a {animal}." for animal in ("cat", "dog", "fox", "owl")]


@pytest.fixture(scope="module")
def linked(smollm2_export, fleet_factory):
    shards = smollm2_export(2, "int4")
    with pytest.MonkeyPatch.context() as env:  # the fleet's processes inherit these
        env.setenv("PIPESHARD_KEEPALIVE_S", str(KEEPALIVE_S))
        env.setenv("PIPESHARD_KEEPALIVE_TIMEOUT_S", str(KEEPALIVE_TIMEOUT_S))
        fleet = fleet_factory(shards, 2, replicas=2, faulty_links=True)
    with PipeshardClient(fleet.coordinator, timeout_s=300) as client:
        solo = {p: client.generate(p, max_tokens=TOKENS, ignore_eos=True).token_ids for p in PROMPTS}
    return fleet, solo


def _events(fleet: Fleet, name: str, event: str) -> list[dict]:
    lines = fleet.process(name).log.read_text().splitlines()
    return [json.loads(line) for line in lines if f'"{event}"' in line]


def _streams_with_fault(fleet: Fleet, fault: str) -> tuple[list[list[int]], list[BaseException], datetime]:
    """Every prompt streamed at once; ``fault`` is sent to lane 0's link once the first stream
    has FAULT_AFTER tokens. Returns the tokens, the errors and when the fault began."""
    began: list[datetime] = []
    lock = threading.Lock()

    def strike() -> None:
        with lock:
            if not began:
                began.append(datetime.now(UTC))
                command(link_control(fleet.run_dir, 0, 0), fault)

    results, errors = concurrently(fleet.coordinator, PROMPTS, TOKENS, on_out=strike, after=FAULT_AFTER)
    assert began, "no stream reached the fault"
    return results, errors, began[0]


def _lost_hop(fleet: Fleet, since: datetime) -> dict:
    """The coordinator's log of lane 0's stage 1 becoming unreachable after ``since``."""
    address = fleet.lanes[0][1]
    downs = [
        e
        for e in _events(fleet, "coordinator", "stage_reachability")
        if not e["up"] and e["address"] == address and datetime.fromisoformat(e["timestamp"]) >= since
    ]
    assert downs, f"the coordinator never named {address} after the link failed"
    return downs[0]


def _wait_rejoined(fleet: Fleet, since: datetime, timeout_s: float = 120) -> None:
    address = fleet.lanes[0][1]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ups = [
            e
            for e in _events(fleet, "coordinator", "stage_reachability")
            if e["up"] and e["address"] == address and datetime.fromisoformat(e["timestamp"]) > since
        ]
        if ups:
            return
        time.sleep(0.2)
    raise AssertionError(f"lane 0 did not rejoin within {timeout_s:g} s of the link healing")


def test_a_stalled_hop_is_named_within_the_bound_and_its_requests_finish_on_the_other_lane(linked):
    fleet, solo = linked
    failovers_before = len(_events(fleet, "coordinator", "session_failed_over"))
    results, errors, began = _streams_with_fault(fleet, "stall 0")
    assert not errors, errors
    assert results == [solo[p] for p in PROMPTS]
    lost = _lost_hop(fleet, began)
    assert "stage 0's next hop to it is down" in lost["reason"], lost
    seconds = (datetime.fromisoformat(lost["timestamp"]) - began).total_seconds()
    assert seconds <= BOUND_S + LOAD_SLACK_S, f"named {seconds:.1f} s after the stall (bound {BOUND_S:g} s)"
    assert len(_events(fleet, "coordinator", "session_failed_over")) > failovers_before
    lost_on_stage = _events(fleet, stage_name(0, 0), "next_hop_lost")
    assert lost_on_stage and "UNAVAILABLE" in lost_on_stage[-1]["reason"], lost_on_stage
    assert fleet.process(link_name(0, 0)).popen.poll() is None  # the link, not a process, failed

    healed = datetime.now(UTC)
    command(link_control(fleet.run_dir, 0, 0), "heal")
    _wait_rejoined(fleet, healed)
    with PipeshardClient(fleet.coordinator, timeout_s=300) as client:
        for prompt in PROMPTS:  # spread over both lanes again: the same tokens
            assert client.generate(prompt, max_tokens=TOKENS, ignore_eos=True).token_ids == solo[prompt]


def test_a_dropped_link_fails_over_at_once_and_rejoins_when_it_is_back(linked):
    fleet, solo = linked
    results, errors, began = _streams_with_fault(fleet, "reset 3")
    assert not errors, errors
    assert results == [solo[p] for p in PROMPTS]
    lost = _lost_hop(fleet, began)
    assert "next hop" in lost["reason"], lost
    _wait_rejoined(fleet, datetime.fromisoformat(lost["timestamp"]))
    with PipeshardClient(fleet.coordinator, timeout_s=300) as client:
        for prompt in PROMPTS:
            assert client.generate(prompt, max_tokens=TOKENS, ignore_eos=True).token_ids == solo[prompt]
