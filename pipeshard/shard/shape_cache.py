"""The OpenVINO Core a long-serving stage compiles with: the CPU plugin's per-shape caches bounded.

A paged stage sees a new step shape (tokens x KV blocks) with almost every long-context step. The
CPU plugin keeps an executor per shape of each compiled model (its runtime cache, 5,000 entries by
default) and oneDNN keeps the primitives behind them (its primitive cache, 1,024): both fill for
hours, so a stage's native memory grew by megabytes a round of the hostile soak and did not level
off. Bounded together they hold it flat; either alone does not (docs/RELIABILITY.md "Hostile
soak"). A shape evicted costs its preparation again (about a step's time) when it comes back.
"""

from __future__ import annotations

import os

import openvino as ov
import structlog

from pipeshard.errors import InvalidArgument

log = structlog.get_logger(__name__)

# 64 of each: malloc's bytes in use flat from about 400 random long steps on (docs/RELIABILITY.md
# "Hostile soak"), and decoding no slower than with the defaults within noise (bench-commits).
SHAPE_CACHE_ENTRIES = 64
ONEDNN_CAPACITY = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"  # read by oneDNN once, when the plugin first runs


def bounded_core(entries: int = SHAPE_CACHE_ENTRIES) -> ov.Core:
    """A Core whose CPU plugin keeps at most ``entries`` executors per compiled model, with oneDNN
    keeping at most ``entries`` primitives (0: the plugin's own defaults). Call it before the CPU
    plugin first runs in this process; an ONEDNN_PRIMITIVE_CACHE_CAPACITY already in the
    environment wins."""
    if entries < 0:
        raise InvalidArgument(
            "shape_cache_entries", f"must be 0 (the plugin's defaults) or more, got {entries}"
        )
    core = ov.Core()
    if entries:
        os.environ.setdefault(ONEDNN_CAPACITY, str(entries))
        # Set on the Core, not per compile: the plugin does not list it in SUPPORTED_PROPERTIES,
        # so device.py would drop it from a compile's properties.
        core.set_property("CPU", {"CPU_RUNTIME_CACHE_CAPACITY": entries})
    log.info(
        "shape_caches", runtime_cache=entries or "default", primitive_cache=os.environ.get(ONEDNN_CAPACITY)
    )
    return core
