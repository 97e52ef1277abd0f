"""The coordinator's engine core: every running request under one id that never changes.

A request's sessions on the stages change (a prefix restore that fails opens a fresh one, a
failover opens one on another lane); its :class:`RequestId` does not, so what the coordinator
knows of a request is found by that id, and its sessions are a field of the request. The table
(``EngineCore.requests``) holds each request from the moment its sessions open until they are
released or aborted, whatever way it ends (finished, failed, cancelled by its client), and each
request's :class:`RequestStatus` says where it is in its life.
"""

from __future__ import annotations

import enum
import uuid
from typing import Generic, NewType, Protocol, TypeVar

RequestId = NewType("RequestId", str)


def new_request_id() -> RequestId:
    """A fresh id, unique across coordinators (a uuid4)."""
    return RequestId(uuid.uuid4().hex)


class RequestStatus(enum.Enum):
    PREFILLING = "prefilling"  # its prompt is going through the stages
    DECODING = "decoding"  # producing tokens
    MOVING = "moving"  # its lane failed: reopened, restored and replayed on another
    FINISHED = "finished"  # ended (stop, length, error or cancelled); its sessions are let go


class Tracked(Protocol):
    """What the engine needs of a request it tracks."""

    @property
    def id(self) -> RequestId: ...

    @property
    def status(self) -> RequestStatus: ...


R = TypeVar("R", bound=Tracked)


class EngineCore(Generic[R]):
    """The requests running on this coordinator, by their id."""

    def __init__(self) -> None:
        self.requests: dict[RequestId, R] = {}

    def add(self, request: R) -> None:
        """Tracks a request whose sessions just opened; its id must be new."""
        if request.id in self.requests:
            raise ValueError(f"request {request.id} is already running")
        self.requests[request.id] = request

    def remove(self, request: R) -> None:
        """The request has ended (every exit path comes here once its sessions are let go)."""
        if request.status is not RequestStatus.FINISHED:
            raise ValueError(f"request {request.id} is {request.status.value}, not finished")
        self.requests.pop(request.id, None)

    def with_status(self, status: RequestStatus) -> list[R]:
        return [r for r in self.requests.values() if r.status is status]
