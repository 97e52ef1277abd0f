"""The CPU plugin's per-shape caches bounded (pipeshard/shard/shape_cache.py): malloc's bytes in use
stay flat while a PagedShard runs step shapes it has never run, and keep growing without the bound.

Each side runs tests/shard/shape_churn.py in a process of its own (oneDNN reads its cache capacity
once per process), both at once. A stage keeps 64 shapes; this test keeps 8, so that a first pass
of 16 new shapes fills both caches and two more passes of 16 each stay within a minute.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pipeshard.shard.shape_cache import ONEDNN_CAPACITY
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.slow

MIB = 1 << 20
ENTRIES = 8
# Growth over the last two passes (32 new shapes): bounded +0.02 MiB, unbounded +21 MiB (measured).
FLAT = 2 * MIB


def churn(export, entries: int) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != ONEDNN_CAPACITY}  # bounded_core decides
    argv = [sys.executable, "-m", "tests.shard.shape_churn", str(export), str(entries), "3", "512"]
    return subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, text=True)


def bytes_in_use(proc: subprocess.Popen) -> list[int]:
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0
    return json.loads(out.strip().splitlines()[-1])  # after the shard's log lines


def test_bounded_shape_caches_hold_malloc_flat_under_new_step_shapes(smollm2_export):
    export = smollm2_export(2, "int4")
    bounded, default = churn(export, ENTRIES), churn(export, 0)
    bounded_used, default_used = bytes_in_use(bounded), bytes_in_use(default)
    # The same shapes without the bound keep adding memory every pass: the workload is the leak's.
    assert default_used[1] - default_used[0] > 2 * FLAT and default_used[2] - default_used[1] > 2 * FLAT
    grown = bounded_used[2] - bounded_used[0]
    assert grown < FLAT, f"bytes in use grew {grown / MIB:.1f} MiB over 32 new shapes with the bound"
