"""Ask running stages how many sessions they hold: how tests see that state was released."""

from __future__ import annotations

import time

import grpc

from pipeshard.v1 import stage_pb2, stage_pb2_grpc


def live_sessions(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        stub = stage_pb2_grpc.StageServiceStub(channel)
        return stub.GetStageInfo(stage_pb2.GetStageInfoRequest(), timeout=5).live_sessions


def sessions_after_release(addresses: list[str], timeout_s: float = 30) -> list[int]:
    """Live sessions per stage once they all reach zero, or as they stand when the time is up."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(live_sessions(a) for a in addresses):
        time.sleep(0.2)
    return [live_sessions(a) for a in addresses]
