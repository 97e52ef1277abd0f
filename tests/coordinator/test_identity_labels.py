"""Per-identity metrics name no API key nor caller host unless the operator asks: by default a
label is the identity's kind (key, token, peer), and identities of one kind add up in it."""

from __future__ import annotations

import asyncio

import prometheus_client
import pytest

from pipeshard.identity import Identity
from pipeshard.metrics import identity_label, set_identity_labels
from pipeshard.services.coordinator.scheduler import Scheduler

RUNNING = "pipeshard_coordinator_running_requests_by_identity"


@pytest.fixture
def labels():
    yield set_identity_labels
    set_identity_labels("kind")


def running(label: str) -> float | None:
    return prometheus_client.REGISTRY.get_sample_value(RUNNING, {"identity": label})


async def hold(scheduler: Scheduler, names: list[str], check) -> None:
    """Runs one request per name at once, calls ``check`` while all run, then lets them go."""
    gate = asyncio.Event()
    started = 0

    async def one(name: str) -> None:
        nonlocal started
        async with scheduler.admit(Identity(name), 10):
            started += 1
            await gate.wait()

    tasks = [asyncio.create_task(one(name)) for name in names]
    while started < len(names):
        await asyncio.sleep(0)
    check()
    gate.set()
    await asyncio.gather(*tasks)


def test_by_default_a_label_is_the_identitys_kind_and_kinds_add_up(labels):
    """Removing the default (labels by name) makes the text show ``key:alice`` and this fail."""
    names = ["key:alice", "key:bob", "peer:10.1.2.3", "token:fleet"]
    assert [identity_label(name) for name in names] == ["key", "key", "peer", "token"]

    def check():
        assert (running("key"), running("peer"), running("token")) == (2, 1, 1)
        text = prometheus_client.generate_latest().decode()
        assert "alice" not in text and "bob" not in text and "10.1.2.3" not in text

    asyncio.run(hold(Scheduler(max_running=8, max_queue=8), names, check))
    assert running("key") is None  # nothing running: the series goes


def test_names_only_when_the_operator_asks(labels):
    labels("names")

    def check():
        assert (running("key:alice"), running("key:bob"), running("key")) == (1, 1, None)

    asyncio.run(hold(Scheduler(max_running=8, max_queue=8), ["key:alice", "key:bob"], check))
    with pytest.raises(ValueError, match="metrics_identity_labels"):
        labels("hashed")
