"""The scheduler: running slots, a bounded queue, admission against a mirrored KV budget (fake
stages), fair share across identities, per-identity limits, deadlines and cancellation."""

from __future__ import annotations

import asyncio

import pytest

from pipeshard.errors import DeadlineExceeded, ResourceExhausted
from pipeshard.identity import Identity
from pipeshard.services.coordinator.kv_mirror import KvMirror, StageBudget
from pipeshard.services.coordinator.ring import Ring
from pipeshard.services.coordinator.scheduler import RequestStatus, Scheduler
from tests.coordinator.engine_fakes import STATEFUL_KV

ALICE, BOB = Identity("key:alice"), Identity("key:bob")


def budget(pool: int = 100, share: int = 50, block_tokens: int = 10, stage: int = 0) -> StageBudget:
    return StageBudget(
        stage=stage, block_tokens=block_tokens, pool_blocks=pool, share_blocks=share, max_context=10_000
    )


class Users:
    """Requests held running until released one by one; records the order they were admitted in."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.order: list[str] = []
        self._gates: dict[str, asyncio.Event] = {}
        self.tasks: dict[str, asyncio.Task] = {}

    def start(
        self,
        name: str,
        identity: Identity = ALICE,
        tokens: int = 10,
        timeout_s: float | None = None,
        batch: bool = False,
    ):
        self._gates[name] = gate = asyncio.Event()

        async def run():
            async with self.scheduler.admit(identity, tokens, timeout_s, batch=batch) as request:
                assert request.status is RequestStatus.RUNNING
                self.order.append(name)
                await gate.wait()

        self.tasks[name] = asyncio.create_task(run())

    async def finish(self, name: str) -> None:
        self._gates[name].set()
        await self.tasks[name]
        await settle()


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_capacity_queue_in_arrival_order_and_the_full_queue_named():
    async def scenario():
        scheduler = Scheduler(max_running=1, max_queue=1)
        users = Users(scheduler)
        users.start("first")
        users.start("second")
        await settle()
        assert (scheduler.running, scheduler.queued) == (1, 1)
        with pytest.raises(ResourceExhausted, match=r"coordinator is full.*max_queue 1"):
            async with scheduler.admit(BOB, 10):
                pass
        await users.finish("first")
        await users.finish("second")
        assert users.order == ["first", "second"]
        assert (scheduler.running, scheduler.queued) == (0, 0)

    asyncio.run(scenario())


def test_admits_only_what_every_stage_budget_holds_and_never_over_commits():
    async def scenario():
        # stage 0: share 50 of 100 blocks; stage 1: smaller blocks, share 30 of 60
        kv = KvMirror([budget(), budget(pool=60, share=30, block_tokens=20, stage=1)])
        scheduler = Scheduler(max_running=8, max_queue=8, kv=kv)
        users = Users(scheduler)
        for name in "abcde":
            users.start(name, tokens=200)  # 20 blocks on stage 0, 10 on stage 1
        await settle()
        assert users.order == ["a", "b"]  # a third would take stage 0 to 60 > 50
        assert kv.held == [40, 20] and scheduler.queued == 3
        for name in "abcde":
            await users.finish(name)
            assert kv.held[0] <= 50 and kv.held[1] <= 30
        assert users.order == list("abcde") and kv.held == [0, 0]

    asyncio.run(scenario())


def test_a_waiting_request_is_admitted_when_a_running_one_releases_its_session():
    async def scenario():
        kv = KvMirror([budget()])
        scheduler = Scheduler(max_running=8, max_queue=8, kv=kv)
        session_released = asyncio.Event()

        class Stages:
            async def open_session(self, session_id, terms=None):
                return 10_000

            async def release_session(self, session_id):
                await session_released.wait()  # the stages still hold it meanwhile

        ring = Ring(Stages(), STATEFUL_KV, accounts=scheduler.accounts())
        second = asyncio.Event()

        async def first():
            async with scheduler.admit(ALICE, 400) as admission:
                await ring.open_session("s1", 400, admission)
            await ring.release_session("s1")

        async def waiting():
            async with scheduler.admit(BOB, 400):
                second.set()

        tasks = [asyncio.create_task(first())]
        await settle()
        tasks.append(asyncio.create_task(waiting()))
        await settle()
        # the first request has finished, but its session's blocks are not back yet
        assert not second.is_set() and kv.held == [40] and scheduler.running == 0
        session_released.set()
        await asyncio.gather(*tasks)
        assert second.is_set() and kv.held == [0]

    asyncio.run(scenario())


def test_a_first_session_may_use_the_pool_and_what_no_pool_holds_is_refused_at_once():
    async def scenario():
        kv = KvMirror([budget(pool=100, share=50)])
        scheduler = Scheduler(max_running=8, max_queue=8, kv=kv)
        users = Users(scheduler)
        users.start("big", tokens=800)  # 80 blocks: over the share, but alone it fits the pool
        await settle()
        assert users.order == ["big"]
        with pytest.raises(ResourceExhausted, match=r"stage 0's KV cache budget of 100 blocks of 10 tokens"):
            async with scheduler.admit(BOB, 1_001):
                pass
        await users.finish("big")

    asyncio.run(scenario())


def test_identities_take_turns_by_weight_and_fifo_within_one():
    async def scenario():
        heavy = Identity("key:heavy", weight=2.0)
        scheduler = Scheduler(max_running=1, max_queue=32, max_queued_per_identity=32)
        users = Users(scheduler)
        users.start("hold", Identity("key:other"))
        await settle()
        for i in range(6):
            users.start(f"h{i}", heavy)
        for i in range(3):
            users.start(f"b{i}", BOB)
        await settle()
        for name in ["hold", "h0", "h1", "b0", "h2", "h3", "b1", "h4", "h5", "b2"]:
            await users.finish(name)
        assert users.order == ["hold", "h0", "h1", "b0", "h2", "h3", "b1", "h4", "h5", "b2"]

    asyncio.run(scenario())


def test_one_identitys_burst_does_not_starve_anothers_single_request():
    async def scenario():
        scheduler = Scheduler(
            max_running=2, max_queue=64, max_running_per_identity=2, max_queued_per_identity=32
        )
        users = Users(scheduler)
        for i in range(20):
            users.start(f"a{i}")
        await settle()
        users.start("bob", BOB)
        await settle()
        await users.finish("a0")
        assert users.order[-1] == "bob"  # the first freed slot, ahead of 18 earlier requests

    asyncio.run(scenario())


def test_one_identity_alone_runs_beyond_its_share_up_to_max_running():
    """Work-conserving: the default fleet's 16 users behind one address (one identity) all run at
    once; a key's own max_running stays a hard limit."""

    from pipeshard.services.coordinator.main import CoordinatorSettings

    defaults = CoordinatorSettings()
    assert (defaults.max_running, defaults.max_running_per_identity) == (16, 12)

    async def scenario():
        scheduler = Scheduler(
            defaults.max_running,
            defaults.max_queue,
            max_running_per_identity=defaults.max_running_per_identity,
            max_queued_per_identity=defaults.max_queued_per_identity,
        )
        users = Users(scheduler)
        for i in range(18):
            users.start(f"a{i}")
        capped = Identity("key:capped", max_running=2)
        for i in range(3):
            users.start(f"c{i}", capped)
        await settle()
        running = (scheduler.running_of(ALICE.name), scheduler.running_of(capped.name))
        for name in [*(f"a{i}" for i in range(18)), "c0", "c1", "c2"]:
            await users.finish(name)
        return running

    # alice took 16 before carol's key queued; carol's own limit is never borrowed past
    assert asyncio.run(scenario()) == (16, 0)

    async def capped_alone():
        scheduler = Scheduler(max_running=16, max_queue=64, max_running_per_identity=12)
        users = Users(scheduler)
        capped = Identity("key:capped", max_running=2)
        for i in range(4):
            users.start(f"c{i}", capped)
        await settle()
        running = scheduler.running_of(capped.name)
        for i in range(4):
            await users.finish(f"c{i}")
        return running

    assert asyncio.run(capped_alone()) == 2


def test_an_identity_arriving_gets_every_freed_slot_until_it_has_its_share():
    """The identity that borrowed beyond its share gives it back as its requests end: while
    another waits below its share, the borrower is not admitted again, and neither starves."""

    async def scenario():
        scheduler = Scheduler(max_running=4, max_queue=16, max_running_per_identity=2)
        users = Users(scheduler)
        for i in range(6):
            users.start(f"a{i}")
        await settle()
        assert users.order == ["a0", "a1", "a2", "a3"]  # nobody else waits: alice uses every slot
        for i in range(3):
            users.start(f"b{i}", BOB)
        await settle()
        assert scheduler.running_of(BOB.name) == 0  # no preemption: bob waits for a slot to free
        await users.finish("a0")
        await users.finish("a1")
        assert users.order[4:] == ["b0", "b1"]  # alice at 2 (her share) while bob was below his
        assert (scheduler.running_of(ALICE.name), scheduler.running_of(BOB.name)) == (2, 2)
        await users.finish("a2")
        assert users.order[6] == "a4"  # alice below her share again: her turn
        await users.finish("b0")
        await users.finish("a3")
        await users.finish("b1")
        for name in ["a4", "a5", "b2"]:
            await users.finish(name)
        assert sorted(users.order) == sorted([*(f"a{i}" for i in range(6)), "b0", "b1", "b2"])
        assert (scheduler.running, scheduler.queued) == (0, 0)

    asyncio.run(scenario())


def test_per_identity_limits_and_their_error_texts():
    async def scenario():
        scheduler = Scheduler(max_running=1, max_queue=16, max_queued_per_identity=2)
        users = Users(scheduler)
        for i in range(3):
            users.start(f"a{i}")
        await settle()
        with pytest.raises(
            ResourceExhausted, match=r"`max_queued_per_identity` 2 reached for identity key:alice"
        ):
            async with scheduler.admit(ALICE, 10):
                pass
        own = Identity("key:carol", max_queued=0)
        with pytest.raises(ResourceExhausted, match=r"`max_queued` 0 reached for identity key:carol"):
            async with scheduler.admit(own, 10):
                pass
        users.start("bob", BOB)  # another identity still gets in line
        await settle()
        assert scheduler.queued == 3
        for name in ["a0", "bob", "a1", "a2"]:
            await users.finish(name)
        assert users.order == ["a0", "bob", "a1", "a2"]  # bob's turn comes before alice's second
        assert (scheduler.running, scheduler.queued) == (0, 0)

    asyncio.run(scenario())


def test_defaults_queue_a_burst_of_24_long_requests_of_one_identity():
    from pipeshard.services.coordinator.main import CoordinatorSettings

    defaults = CoordinatorSettings()

    async def scenario():
        kv = KvMirror([budget(pool=1226, share=613, block_tokens=16)])
        scheduler = Scheduler(
            defaults.max_running,
            defaults.max_queue,
            max_running_per_identity=defaults.max_running_per_identity,
            max_queued_per_identity=defaults.max_queued_per_identity,
            kv=kv,
        )
        users = Users(scheduler)
        for i in range(24):
            users.start(f"u{i}", Identity("peer:127.0.0.1"), tokens=2_900)
        await settle()
        assert scheduler.running + scheduler.queued == 24 and scheduler.running < defaults.max_running
        for i in range(24):
            await users.finish(f"u{i}")
        assert len(users.order) == 24

    asyncio.run(scenario())


def test_deadline_while_queued():
    async def scenario():
        scheduler = Scheduler(max_running=1, max_queue=4)
        users = Users(scheduler)
        users.start("holder")
        await settle()
        with pytest.raises(DeadlineExceeded, match="queue"):
            async with scheduler.admit(BOB, 10, timeout_s=0.05):
                pass
        assert scheduler.queued == 0
        await users.finish("holder")
        async with scheduler.admit(BOB, 10, timeout_s=0.05):
            assert scheduler.running == 1

    asyncio.run(scenario())


def test_a_request_cancelled_while_queued_leaves_the_queue_holding_nothing():
    async def scenario():
        kv = KvMirror([budget()])
        scheduler = Scheduler(max_running=1, max_queue=4, kv=kv)
        users = Users(scheduler)
        users.start("holder", tokens=100)
        users.start("cancelled", BOB, tokens=100)
        users.start("next", tokens=100)
        await settle()
        assert scheduler.queued == 2 and kv.held == [10]
        users.tasks["cancelled"].cancel()
        await settle()
        assert scheduler.queued == 1 and kv.held == [10]
        await users.finish("holder")
        await users.finish("next")
        assert users.order == ["holder", "next"] and kv.held == [0]
        assert users.tasks["cancelled"].cancelled()

    asyncio.run(scenario())


def test_a_reopened_session_keeps_its_requests_charge_and_other_sessions_are_charged_alone():
    async def scenario():
        kv = KvMirror([budget()])
        scheduler = Scheduler(max_running=8, max_queue=8, kv=kv)

        class Stages:
            async def open_session(self, session_id, terms=None):
                return 10_000

            async def release_session(self, session_id):
                pass

            async def abort_session(self, session_id, reason):
                pass

        ring = Ring(Stages(), STATEFUL_KV, accounts=scheduler.accounts())
        await ring.open_session("warm-up", 100)  # no request: charged on its own
        assert kv.held == [10]
        await ring.release_session("warm-up")
        assert kv.held == [0]
        async with scheduler.admit(ALICE, 300) as admission:
            await ring.open_session("first", 300, admission)
            await ring.abort_session("first", "prefix restore failed")  # the cold retry follows
            assert kv.held == [30]  # still the request's
            await ring.open_session("retry", 300, admission)
            assert kv.held == [30]
        assert kv.held == [30]  # the retry's session is not released yet
        await ring.release_session("retry")
        assert kv.held == [0]

    asyncio.run(scenario())


@pytest.mark.parametrize("same_identity", [True, False])
def test_batch_requests_wait_for_every_interactive_one(same_identity):
    """A batch job's requests fill idle capacity: interactive requests that arrive later, of the
    same identity or another, are admitted before them."""

    async def scenario():
        scheduler = Scheduler(max_running=1, max_queue=8)
        users = Users(scheduler)
        users.start("running")
        await settle()
        users.start("batch-1", batch=True)
        users.start("batch-2", batch=True)
        await settle()
        users.start("chat", identity=ALICE if same_identity else BOB)
        await settle()
        for name in ("running", "chat", "batch-1"):
            await users.finish(name)
        await users.finish("batch-2")
        return users.order

    assert asyncio.run(scenario()) == ["running", "chat", "batch-1", "batch-2"]


def test_running_limit_is_the_identitys_own_else_the_default_capped_by_max_running():
    scheduler = Scheduler(max_running=4, max_queue=8, max_running_per_identity=3)
    assert scheduler.running_limit(ALICE) == 3
    assert scheduler.running_limit(Identity("key:big", max_running=10)) == 4
    assert scheduler.running_limit(Identity("key:small", max_running=1)) == 1


def test_a_small_request_overtakes_a_blocked_head_a_bounded_number_of_times():
    """Backfill: a short request of the same identity runs ahead of a long one that does not fit
    yet (never-read streams must not hold a normal request in the queue), but at most max_running
    small ones overtake one head, so a large request is not starved."""

    async def scenario():
        kv = KvMirror([budget(pool=100, share=50)])
        scheduler = Scheduler(max_running=3, max_queue=16, kv=kv)
        users = Users(scheduler)
        users.start("stream-1", ALICE, tokens=200)  # 20 blocks
        users.start("stream-2", ALICE, tokens=200)
        users.start("stream-3", ALICE, tokens=200)  # 60 > 50: waits
        users.start("chat", ALICE, tokens=40)  # 4 blocks: fits, and is small beside the head
        await settle()
        assert users.order == ["stream-1", "stream-2", "chat"]
        await users.finish("chat")
        for name in ("small-1", "small-2", "small-3"):
            users.start(name, ALICE, tokens=10)
        await settle()
        assert users.order[3:] == ["small-1"]  # the running slots are full now
        await users.finish("small-1")
        await settle()
        # The head was overtaken max_running (3) times: the next small one waits behind it.
        assert users.order[4:] == ["small-2"]
        await users.finish("small-2")
        await settle()
        assert "small-3" not in users.order
        await users.finish("stream-1")
        await settle()
        assert users.order[5] == "stream-3"

    asyncio.run(scenario())
