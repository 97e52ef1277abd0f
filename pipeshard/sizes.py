"""Byte sizes as people write them on a command line: ``6G``, ``512MiB``, ``1500000000``."""

from __future__ import annotations

import re

from pipeshard.errors import InvalidArgument

_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_bytes(text: str | int, field: str) -> int:
    """Bytes from a number with an optional binary suffix (K, M, G, T; ``KiB``/``KB`` alike)."""
    if isinstance(text, int):
        value = text
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", str(text), re.I)
        if not match:
            raise InvalidArgument(field, f"must be a byte size such as 6G, 512M or 1500000000, got {text!r}")
        value = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if value < 1:
        raise InvalidArgument(field, f"must be a positive byte size, got {text!r}")
    return value


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"
