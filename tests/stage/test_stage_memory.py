"""A stage's memory held from the start (services/stage/main.py): its paged KV pool resident once it
is built (in-process shards leave theirs to be paged in), a budget the machine cannot give refused
at start naming --kv-cache-bytes, and its Core's shape caches bounded (pipeshard/shard/shape_cache.py)."""

from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np
import pytest

from pipeshard import headroom
from pipeshard.errors import InvalidArgument
from pipeshard.services.stage.main import StageSettings, build_node
from pipeshard.settings import load_settings
from pipeshard.shard.paged import PagedShard
from pipeshard.shard.shape_cache import ONEDNN_CAPACITY, bounded_core
from tests.exporter.tiny_models import tiny_export, tiny_model  # noqa: F401  (fixtures)

BUDGET = 64 << 20  # a pool of tensors each above malloc's mmap threshold: fresh pages, not reused heap
_LIBC = ctypes.CDLL("libc.so.6", use_errno=True)


def resident_fraction(array: np.ndarray) -> float:
    """The share of ``array``'s pages in RAM (mincore(2))."""
    start = array.ctypes.data // mmap.PAGESIZE * mmap.PAGESIZE
    length = array.ctypes.data + array.nbytes - start
    pages = (length + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    assert _LIBC.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec) / pages


def pools(shard: PagedShard) -> list[np.ndarray]:
    return [shard._req.get_tensor(name).data for name in shard._state_pools]


def stage_argv(export) -> list[str]:
    return [
        "--shards",
        str(export),
        "--kv",
        "paged",
        "--kv-cache-bytes",
        str(BUDGET),
        "--prefix-cache-bytes",
        "0",
    ]


def test_a_stage_holds_its_kv_pool_from_the_start_and_an_in_process_shard_does_not(tiny_export):  # noqa: F811
    export = tiny_export("llama", 1)
    node, _ = build_node(load_settings(StageSettings, stage_argv(export), env={}))
    served = node.engine.shard
    assert served.pool_bytes() > BUDGET // 2
    assert [resident_fraction(pool) for pool in pools(served)] == [1.0] * len(served._state_pools)
    untouched = PagedShard(export, 0, "default", 1, cache_bytes=BUDGET)
    assert np.mean([resident_fraction(pool) for pool in pools(untouched)]) < 0.5


def test_a_budget_the_machine_cannot_give_is_refused_at_start_naming_the_flag(tiny_export, monkeypatch):  # noqa: F811
    monkeypatch.setattr(headroom, "available_bytes", lambda: BUDGET // 2)
    with pytest.raises(InvalidArgument) as err:
        build_node(load_settings(StageSettings, stage_argv(tiny_export("llama", 1)), env={}))
    assert err.value.field == "kv_cache_bytes"
    assert "MiB available: give a smaller --kv-cache-bytes" in str(err.value)


def test_the_shape_caches_bound_leaves_a_users_onednn_capacity_alone(monkeypatch):
    monkeypatch.setenv(ONEDNN_CAPACITY, "5")
    bounded_core(64)
    assert os.environ[ONEDNN_CAPACITY] == "5"
    monkeypatch.delenv(ONEDNN_CAPACITY)
    bounded_core(0)  # the plugin's defaults: nothing set
    assert ONEDNN_CAPACITY not in os.environ
    bounded_core(64)
    assert os.environ[ONEDNN_CAPACITY] == "64"


def test_a_negative_shape_cache_bound_is_refused_naming_it():
    settings = load_settings(StageSettings, ["--shards", "x", "--shape-cache-entries", "-1"], env={})
    with pytest.raises(InvalidArgument) as err:
        build_node(settings)
    assert err.value.field == "shape_cache_entries"
