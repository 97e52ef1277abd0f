"""Who a request belongs to, and what it may hold.

An identity is the unit of quotas, fair share, metrics and prefix-cache scope. Its ``name`` is
safe to show (a key's name, or how a plaintext caller is recognised), never a secret.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Identity:
    name: str
    # this identity's share of the fleet when it is full, relative to others (weighted turns)
    weight: float = 1.0
    # per-identity limits; None means the coordinator's default
    max_running: int | None = None
    max_queued: int | None = None
