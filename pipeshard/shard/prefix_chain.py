"""The prefix cache's block keys, computed the same way by a stage's store and the coordinator's index.

A sequence is cut into blocks of BLOCK positions; each block's key is the hash of the scope and
*every* token up to the block's end (a hash chain), so two sequences share a key exactly when
they share the scope and all tokens up to that block's end. The stage keeps KV blocks under these
keys and reports the keys it drops; the coordinator indexes the same keys, so what it finds is
what the stages hold.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

BLOCK = 32  # positions per block: the paged backend's block size, so both can share this layout


class ChainBlock(NamedTuple):
    """One block of a sequence: its positions ``[start, end)`` and its chain key (hex)."""

    start: int
    end: int
    key: str


def block_chain(scope: str, token_ids: Sequence[int]) -> list[ChainBlock]:
    """The blocks of ``token_ids`` in order; the last one is partial when the length is not a
    multiple of BLOCK (its key then differs from the full block a longer sequence has there)."""
    digest = hashlib.sha256(scope.encode() + b"\0")
    ids = np.asarray(token_ids, dtype="<i8")
    out = []
    for start in range(0, len(ids), BLOCK):
        end = min(start + BLOCK, len(ids))
        digest.update(ids[start:end].tobytes())
        out.append(ChainBlock(start, end, digest.copy().hexdigest()))
    return out
