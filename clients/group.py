"""Several coordinators of one fleet as one: each request goes to the one with the fewest
requests outstanding, and a stream whose coordinator goes away continues on another.

The state a stream needs to continue lives here, beside the caller, not in the coordinator that
died: the request as sent and the completion tokens streamed so far. On UNAVAILABLE (the process
died, or refused while shutting down) or a summary that says the coordinator stopped it
(FINISH_REASON_CANCELLED, sent only for a server-side stop), the same request goes to the next
coordinator with ``resume_token_ids`` set to those tokens: it continues after them, and the
caller sees one unbroken stream (docs/RELIABILITY.md, "Coordinators in a group").
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import grpc

from pipeshard.v1 import coordinator_pb2

Stub = TypeVar("Stub")


def parse_addresses(addresses: str | Sequence[str]) -> list[str]:
    """``"a:1,b:2"`` or a sequence of addresses, each as given; ValueError if none."""
    parts = addresses.split(",") if isinstance(addresses, str) else list(addresses)
    out = [a.strip() for a in parts if a.strip()]
    if not out:
        raise ValueError("no coordinator address given")
    return out


class Coordinators(Generic[Stub]):
    """The group's stubs and how many requests each has outstanding (thread-safe)."""

    def __init__(self, stubs: Sequence[Stub]):
        self.stubs = list(stubs)
        self._outstanding = [0] * len(self.stubs)
        self._turn = itertools.count()  # ties go round the group
        self._lock = threading.Lock()

    def take(self, avoid: int | None = None) -> int:
        """The index of the least-loaded coordinator (not ``avoid`` if there is another), counted
        as one more outstanding until :meth:`give`."""
        with self._lock:
            start = next(self._turn)
            order = [(start + i) % len(self.stubs) for i in range(len(self.stubs))]
            choices = [i for i in order if i != avoid] or order
            best = min(choices, key=lambda i: self._outstanding[i])
            self._outstanding[best] += 1
            return best

    def give(self, index: int) -> None:
        with self._lock:
            self._outstanding[index] -= 1


def resumable_error(exc: BaseException) -> bool:
    """The coordinator went away or is leaving: another one can continue the request."""
    return isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]


def stopped_by_server(response: coordinator_pb2.GenerateResponse) -> bool:
    """A summary the coordinator ended early itself (a shutdown): the request can go on elsewhere."""
    return (
        response.HasField("summary")
        and response.summary.finish_reason == coordinator_pb2.FINISH_REASON_CANCELLED
    )


@dataclass
class Resumption:
    """What a stream needs to continue on another coordinator: the request and its tokens so far."""

    request: coordinator_pb2.GenerateRequest
    streamed: list[int] = field(default_factory=list)
    failures: int = 0  # in a row, with no token in between

    def saw(self, response: coordinator_pb2.GenerateResponse) -> None:
        if response.HasField("chunk"):
            if response.chunk.token_ids:
                self.failures = 0
            self.streamed.extend(response.chunk.token_ids)

    def retry(self, group_size: int) -> coordinator_pb2.GenerateRequest | None:
        """The request to send next, continuing after the tokens streamed; None once every
        coordinator failed in a row without a new token (then the failure is the caller's)."""
        self.failures += 1
        if self.failures >= group_size:
            return None
        again = coordinator_pb2.GenerateRequest()
        again.CopyFrom(self.request)
        again.resume_token_ids.extend(self.streamed)
        return again


class _Resuming:
    """What both kinds of call share: the group, the request's resumption and the live call."""

    def __init__(
        self,
        group: Coordinators[Any],
        request: coordinator_pb2.GenerateRequest,
        call: Callable[[Any, coordinator_pb2.GenerateRequest], Any],
    ):
        self._group = group
        self._state = Resumption(request)
        self._call = call
        self._index = group.take()
        self._current = call(group.stubs[self._index], request)
        self._done = False
        self._cancelled = False

    def _resumes(self, exc: grpc.RpcError) -> bool:
        """Whether a failed call goes on elsewhere (then it already has)."""
        return not self._cancelled and resumable_error(exc) and self._move()

    def _move(self) -> bool:
        """Sends the request on to another coordinator; False if there is none left to try."""
        again = self._state.retry(len(self._group.stubs))
        if again is None:
            return False
        self._group.give(self._index)
        self._index = self._group.take(avoid=self._index)
        self._current = self._call(self._group.stubs[self._index], again)
        return True

    def _finish(self) -> None:
        if not self._done:
            self._done = True
            self._group.give(self._index)

    def _failed(self, exc: grpc.RpcError) -> None:
        """A failed read: returns when the call went on elsewhere, else ends it and raises ``exc``."""
        if self._resumes(exc):
            return
        self._finish()
        raise exc

    def _delivers(self, response: coordinator_pb2.GenerateResponse) -> bool:
        """Whether ``response`` goes to the caller (counted as streamed); False when the server
        stopped the stream and it went on elsewhere."""
        if stopped_by_server(response) and self._move():
            return False
        self._state.saw(response)
        return True


class ResumingCall(_Resuming):
    """A Generate stream over a group (the sync client's): iterate it, ``cancel()`` it."""

    def __iter__(self) -> Iterator[coordinator_pb2.GenerateResponse]:
        return self

    def __next__(self) -> coordinator_pb2.GenerateResponse:
        while not self._done:
            try:
                response = next(self._current)
            except StopIteration:
                break
            except grpc.RpcError as exc:
                self._failed(exc)
                continue
            if self._delivers(response):
                return response
        self._finish()
        raise StopIteration

    def cancel(self) -> None:
        self._cancelled = True
        self._current.cancel()
        self._finish()


class AsyncResumingCall(_Resuming):
    """A Generate stream over a group for asyncio (the gateway's and the async client's): ``read()``
    (``grpc.aio.EOF`` at the end) or ``async for``, and ``cancel()``, as a ``grpc.aio`` call."""

    async def read(self) -> Any:
        while not self._done:
            try:
                response = await self._current.read()
            except grpc.RpcError as exc:
                self._failed(exc)
                continue
            if response is grpc.aio.EOF:
                break
            if self._delivers(response):
                return response
        self._finish()
        return grpc.aio.EOF

    def __aiter__(self) -> AsyncResumingCall:
        return self

    async def __anext__(self) -> coordinator_pb2.GenerateResponse:
        response = await self.read()
        if response is grpc.aio.EOF:
            raise StopAsyncIteration
        return response

    def cancel(self) -> bool:
        self._cancelled = True
        self._finish()
        return self._current.cancel()
