"""Per-session KV state on one stage: one InferRequest per session, reaped when idle.

Sessions are keyed by (owner, session id): an owner (pipeshard.ownership) sees only its own, so
ids chosen by different coordinators never collide and a lookup cannot reveal another owner's
session. Each owner holds at most ``max_per_owner`` of the stage's ``max_sessions``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from pipeshard.errors import InvalidArgument, NotFound, ResourceExhausted


class ShardSessionLike(Protocol):
    """What the table needs of a backend's session (each engine's own type has the rest)."""

    @property
    def past_length(self) -> int: ...

    def reset(self) -> None:
        """Gives back what the session holds; it may be reused for another."""


S = TypeVar("S", bound=ShardSessionLike)


@dataclass
class _Entry(Generic[S]):
    session: S
    last_used: float = field(default_factory=time.monotonic)
    codec: str = ""  # the wire codec mode the session asked for at OpenSession ("": the stage's own)
    hop: int = 0  # which next hop its frames go to (per-hop routing; 0: this replica's own lane's)


class SessionTable(Generic[S]):
    """Sessions by (owner, id), bounded in number; the factory builds a fresh shard session."""

    def __init__(
        self,
        factory: Callable[[], S],
        max_sessions: int,
        idle_timeout_s: float,
        max_per_owner: int | None = None,
    ):
        self._factory = factory
        self._max = max_sessions
        self._max_per_owner = max_sessions if max_per_owner is None else max_per_owner
        self._idle = idle_timeout_s
        self._entries: dict[tuple[str, str], _Entry[S]] = {}
        self._per_owner: dict[str, int] = {}
        # Released sessions are reset and reused: a fresh InferRequest pays for its buffers on its
        # first (prefill) inference, which showed as tens of ms of TTFT per request.
        self._free: list[S] = []

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def max_per_owner(self) -> int:
        """Sessions one owner may hold here (never more than the table's own maximum)."""
        return min(self._max_per_owner, self._max)

    def owners(self) -> list[str]:
        return list(self._per_owner)

    def cached_positions(self) -> int:
        """Cache positions the open sessions hold (read by the metrics thread: list() of the
        values is one step under the GIL, so a concurrent open or release cannot break it)."""
        return sum(entry.session.past_length for entry in list(self._entries.values()))

    def open(self, owner: str, session_id: str) -> S:
        if not session_id:
            raise InvalidArgument("session_id", "must not be empty")
        if (owner, session_id) in self._entries:
            raise InvalidArgument("session_id", f"{session_id!r} is already open")
        if self._per_owner.get(owner, 0) >= self._max_per_owner:
            raise ResourceExhausted(
                f"this caller holds its maximum of {self._max_per_owner} sessions on the stage "
                "(max_sessions_per_owner)"
            )
        if len(self._entries) >= self._max:
            raise ResourceExhausted(f"stage holds its maximum of {self._max} sessions")
        entry = _Entry(self._free.pop() if self._free else self._factory())
        self._entries[(owner, session_id)] = entry
        self._per_owner[owner] = self._per_owner.get(owner, 0) + 1
        return entry.session

    def get(self, owner: str, session_id: str) -> S:
        """The owner's session; another owner's session is as unknown as one never opened."""
        entry = self._entry(owner, session_id)
        entry.last_used = time.monotonic()
        return entry.session

    def has(self, owner: str, session_id: str) -> bool:
        """Whether ``owner`` holds ``session_id`` here (another owner's is as absent as none)."""
        return (owner, session_id) in self._entries

    def set_codec(self, owner: str, session_id: str, mode: str) -> None:
        """Keeps the session's codec mode on its entry, so it is forgotten with the session."""
        self._entry(owner, session_id).codec = mode

    def codec(self, owner: str, session_id: str) -> str:
        """The session's codec mode; "" for the stage's own (or a session no longer open)."""
        entry = self._entries.get((owner, session_id))
        return "" if entry is None else entry.codec

    def set_hop(self, owner: str, session_id: str, hop: int) -> None:
        """Keeps the session's next hop (an index the node has checked) on its entry."""
        self._entry(owner, session_id).hop = hop

    def hop(self, owner: str, session_id: str) -> int:
        """The session's next hop; 0 (the first) for a session no longer open."""
        entry = self._entries.get((owner, session_id))
        return 0 if entry is None else entry.hop

    def _entry(self, owner: str, session_id: str) -> _Entry[S]:
        entry = self._entries.get((owner, session_id))
        if entry is None:
            raise NotFound(f"unknown session {session_id!r}")
        return entry

    def release(self, owner: str, session_id: str) -> bool:
        entry = self._entries.pop((owner, session_id), None)
        if entry is None:
            return False
        self._drop(owner, entry)
        return True

    def release_owner(self, owner: str) -> list[str]:
        """Release every session of ``owner`` (its coordinator went away); returns their ids."""
        ids = [sid for (o, sid) in self._entries if o == owner]
        for sid in ids:
            self._drop(owner, self._entries.pop((owner, sid)))
        return ids

    def _drop(self, owner: str, entry: _Entry[S]) -> None:
        left = self._per_owner[owner] - 1
        if left:
            self._per_owner[owner] = left
        else:
            del self._per_owner[owner]
        entry.session.reset()
        self._free.append(entry.session)

    def reap_idle(self, now: float | None = None) -> list[str]:
        """Release sessions unused for longer than the idle timeout; returns their ids."""
        now = time.monotonic() if now is None else now
        stale = [key for key, e in self._entries.items() if now - e.last_used > self._idle]
        for owner, sid in stale:
            self._drop(owner, self._entries.pop((owner, sid)))
        return [sid for _, sid in stale]
