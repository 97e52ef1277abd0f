"""Standby KV copies without processes: whole blocks only, one capture at a time, the byte limit,
and a restore that sends the parts back as captured, in order (the real capture and restore run
in tests/pipeline/test_failover_fleet.py)."""

from __future__ import annotations

import asyncio

import numpy as np

from pipeshard.errors import Unavailable
from pipeshard.services.coordinator.kv_standby import KvStandby, StandbyCopy
from pipeshard.shard.kvblob import (
    KvBlob,
    KvSource,
    SnapshotBytes,
    from_proto,
    join_parts,
    snapshot_chunks,
    to_proto,
)
from pipeshard.v1 import kv_pb2

SOURCE = KvSource("f", "e", 0, 0, 1, ("k",), kv_heads=1, head_dim=1)


class _Lane:
    """Answers captures with position-valued arrays (so a join shows its order); records calls."""

    def __init__(self):
        self.captures: list[tuple[str, int, int]] = []
        self.restored: dict[str, list[list[SnapshotBytes]]] = {}
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail = False
        self.sent_bytes = 0  # of the parts captured, over both stages

    async def capture_part(self, session_id: str, token_ids: list[int], start: int) -> list[SnapshotBytes]:
        self.captures.append((session_id, start, len(token_ids)))
        await self.gate.wait()
        if self.fail:
            raise Unavailable("stage 1 at x is unreachable")
        values = np.arange(start, len(token_ids), dtype=np.float32).reshape(1, -1, 1)
        blob = KvBlob.build(SOURCE, [values], tuple(token_ids[start:]), start=start)
        part = SnapshotBytes(tuple(snapshot_chunks(to_proto(blob), chunk_bytes=40)[1]), blob.positions)
        self.sent_bytes += 2 * part.nbytes
        return [part] * 2

    async def restore_parts(
        self,
        session_id: str,
        parts: list[list[SnapshotBytes]],
        timeout_s: float,
        stages: list[int] | None = None,
    ) -> None:
        self.restored[session_id] = parts


def _joined(parts: list[SnapshotBytes]) -> KvBlob:
    """What a stage restores from the parts it was sent."""
    return join_parts([from_proto(kv_pb2.KvSnapshot.FromString(b"".join(p.chunks))) for p in parts])


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_copies_follow_whole_blocks_and_restore_as_the_captured_parts():
    async def main():
        lane = _Lane()
        standby = KvStandby(lane, block_tokens=4, max_bytes=1 << 20)
        tokens = list(range(100, 120))
        mine = StandbyCopy()  # what the request holds
        standby.computed(mine, "s", tokens[:3])  # no whole block yet
        await _settle()
        assert lane.captures == []
        lane.gate.clear()
        standby.computed(mine, "s", tokens[:9])  # blocks 0-1
        standby.computed(mine, "s", tokens[:13])  # a capture is under way: waits for the next report
        lane.gate.set()
        await _settle()
        standby.computed(mine, "s", tokens[:13])  # block 2
        await _settle()
        assert lane.captures == [("s", 0, 8), ("s", 8, 12)]
        assert standby.nbytes == lane.sent_bytes  # two parts on two stages, as serialized

        copy = standby.take(mine)
        assert copy.positions == 12 and copy.tokens == tokens[:12]
        assert await standby.restore(copy, "t", 5.0) == 12
        parts = lane.restored["t"]
        assert len(parts) == 2 and [part.positions for part in parts[0]] == [8, 4]
        joined = _joined(parts[0])
        assert joined.start == 0 and joined.token_ids == tuple(tokens[:12])
        np.testing.assert_array_equal(joined.arrays[0].ravel(), np.arange(12))
        standby.computed(copy, "t", tokens[:17])  # the copy follows the new session from where it stands
        await _settle()
        assert lane.captures[-1] == ("t", 12, 16)
        standby.drop(copy)  # the request ended
        assert standby.nbytes == 0

    asyncio.run(main())


def test_a_failed_capture_leaves_the_copy_and_the_limit_stops_new_parts():
    async def main():
        lane = _Lane()
        standby = KvStandby(lane, block_tokens=4, max_bytes=1)  # reached by the first part
        lane.fail = True
        failed, limited = StandbyCopy(), StandbyCopy()
        standby.computed(failed, "s", list(range(8)))
        await _settle()
        assert standby.nbytes == 0 and standby.take(failed).positions == 0
        lane.fail = False
        standby.computed(limited, "u", list(range(4)))
        await _settle()
        standby.computed(limited, "u", list(range(8)))  # the limit is reached: no further part
        await _settle()
        assert standby.nbytes == lane.sent_bytes and lane.captures[-1] == ("u", 0, 4)
        standby.drop(standby.take(limited))
        assert standby.nbytes == 0

    asyncio.run(main())
