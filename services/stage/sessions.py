"""Per-session KV state on one stage: one InferRequest per session, reaped when idle."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from pipeshard.errors import InvalidArgument, NotFound, ResourceExhausted


class ShardSessionLike(Protocol):
    """What the stage needs from the shard runtime's session."""

    past_length: int

    def run(self, x: np.ndarray, position_ids: np.ndarray, return_last: int = 1) -> np.ndarray: ...

    def invalidate(self, start: int, end: int) -> None: ...

    def reset(self) -> None: ...


@dataclass
class _Entry:
    session: ShardSessionLike
    last_used: float = field(default_factory=time.monotonic)


class SessionTable:
    """Sessions by id, bounded in number; the factory builds a fresh shard session."""

    def __init__(self, factory: Any, max_sessions: int, idle_timeout_s: float):
        self._factory = factory
        self._max = max_sessions
        self._idle = idle_timeout_s
        self._entries: dict[str, _Entry] = {}
        # Released sessions are reset and reused: a fresh InferRequest pays for its buffers on its
        # first (prefill) inference, which showed as tens of ms of TTFT per request.
        self._free: list[ShardSessionLike] = []

    def __len__(self) -> int:
        return len(self._entries)

    def open(self, session_id: str) -> ShardSessionLike:
        if not session_id:
            raise InvalidArgument("session_id", "must not be empty")
        if session_id in self._entries:
            raise InvalidArgument("session_id", f"{session_id!r} is already open")
        if len(self._entries) >= self._max:
            raise ResourceExhausted(f"stage holds its maximum of {self._max} sessions")
        entry = _Entry(self._free.pop() if self._free else self._factory())
        self._entries[session_id] = entry
        return entry.session

    def get(self, session_id: str) -> ShardSessionLike:
        entry = self._entries.get(session_id)
        if entry is None:
            raise NotFound(f"unknown session {session_id!r}")
        entry.last_used = time.monotonic()
        return entry.session

    def release(self, session_id: str) -> bool:
        entry = self._entries.pop(session_id, None)
        if entry is None:
            return False
        self._recycle(entry.session)
        return True

    def _recycle(self, session: ShardSessionLike) -> None:
        session.reset()
        self._free.append(session)

    def reap_idle(self, now: float | None = None) -> list[str]:
        """Release sessions unused for longer than the idle timeout; returns their ids."""
        now = time.monotonic() if now is None else now
        stale = [sid for sid, e in self._entries.items() if now - e.last_used > self._idle]
        for sid in stale:
            self._recycle(self._entries.pop(sid).session)
        return stale
