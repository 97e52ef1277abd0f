"""A paged stage's proof, on the CPU it runs on, that its compiled shard computes a row alike
whatever shares its step and however its sequence was cut into steps (issue 49).

Invariance is a property of the CPU plugin's kernels, not of a setting: the same properties
give bit-identical rows on one instruction set and not on another. So every paged stage runs
this small version of bench-precision-modes' kernels check after its warm-up, on the shapes a
fleet sends: a decode row alone (M = 1) and beside other sessions' chunks (M = 2, 8, 41), a
prompt token decoded alone against the same token inside a prefill chunk, a 3-token verify row
alone and beside a chunk, a prompt split into two chunks against one, and (where the pools let
a draft tree's path move) the path of a draft tree with a side branch and the token decoded
after it. Each is compared with
the same tokens inside one whole chunk: hidden states on a middle stage, logits on the last.
The largest difference must be within the configuration's tolerance (0 for a bit-identity
promise) for the stage to report ``invariant``.

A result is cached in ``self_check.json`` beside the compile cache (compile_cache.py), keyed by
the export, stage, device, configuration, OpenVINO build and the CPU's name and flags, so a
restart on the same machine does not run it again and a move to another CPU does.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import openvino as ov
import structlog

from pipeshard.precision import Configuration
from pipeshard.shard.compile_cache import OFF, cache_folder, writable_cache
from pipeshard.shard.manifest import load_manifest
from pipeshard.shard.paged import PagedRow, PagedShard

log = structlog.get_logger(__name__)

CACHE_FILE = "self_check.json"
VERSION = 3  # bump when the shapes checked change, so old cached results are not trusted
_WHOLE = 48  # tokens of the reference chunk


@dataclass(frozen=True)
class SelfCheck:
    """What the check found: ``passed`` when every shape's rows were within ``tolerance`` of the
    whole chunk's; ``worst`` names the shape with the largest difference."""

    passed: bool
    max_delta: float
    tolerance: float
    worst: str
    seconds: float
    cached: bool = False

    def describe(self) -> str:
        verdict = "passed" if self.passed else "FAILED"
        return (
            f"self-check {verdict}: largest difference {self.max_delta:.3g} ({self.worst}), "
            f"tolerance {self.tolerance:g}, {self.seconds:.2f} s{' (cached)' if self.cached else ''}"
        )


def cpu_identity(core: ov.Core, device: str) -> str:
    """The CPU's name, the plugin's capabilities and the kernel's CPU flags: what decides which
    kernel paths the plugin picks."""
    parts = [ov.__version__, device]
    for key in ("FULL_DEVICE_NAME", "OPTIMIZATION_CAPABILITIES"):
        with contextlib.suppress(RuntimeError):
            parts.append(str(core.get_property(device.split(":")[-1].split(",")[0], key)))
    with contextlib.suppress(OSError):
        flags = next(
            (line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), ""
        )
        parts.append(flags)
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def cache_key(shard: PagedShard, configuration: str, properties: dict) -> str:
    """One cached result per export, stage, device, configuration and CPU."""
    fields = [
        f"v{VERSION}",
        shard.manifest.export_id or shard.manifest.model.fingerprint,
        str(shard.stage_index),
        configuration,
        json.dumps(properties, sort_keys=True, default=str),
        cpu_identity(shard.core, shard.device),
    ]
    return hashlib.sha256("|".join(fields).encode()).hexdigest()[:24]


def _inputs(shard: PagedShard, rng: np.random.Generator, n: int) -> np.ndarray:
    if shard.is_first:
        return rng.integers(100, min(5000, shard.vocab_size), n).astype(np.int64)
    return rng.standard_normal((n, shard.hidden_size)).astype(np.float32)


def measure(shard: PagedShard) -> tuple[float, str]:
    """The largest |difference| between a row's outputs in the fleet's shapes and the same tokens
    inside one whole chunk, and which shape gave it."""
    rng = np.random.default_rng(49)
    seq_tokens = _inputs(shard, rng, _WHOLE)
    other = _inputs(shard, rng, 64)
    names = iter(range(10**6))
    opened: list = []

    def open_seq(capacity: int) -> tuple:
        key = ("__self_check__", next(names))
        shard.open(key, capacity)
        opened.append(key)
        return key

    def step(rows: list[PagedRow]) -> list[np.ndarray]:
        if shard.is_last:  # every token's logits, so each compares with the whole chunk's
            rows = [replace(r, logits=len(r.inputs)) for r in rows]
        return shard.step(rows)

    def tree(prefix: int) -> np.ndarray:
        """A draft tree after ``prefix`` tokens: the sequence's next three tokens as the path
        0 -> 2 -> 3 and another token as node 1, a sibling of node 2; the path's outputs, then
        (the path accepted and moved down) the next token decoded alone."""
        seq = open_seq(_WHOLE)
        step([PagedRow(seq, seq_tokens[:prefix])])
        nodes = np.concatenate(
            [seq_tokens[prefix : prefix + 1], other[:1], seq_tokens[prefix + 1 : prefix + 3]]
        )
        positions = np.array([prefix, prefix + 1, prefix + 1, prefix + 2], dtype=np.int64)
        out = step([PagedRow(seq, nodes, positions=positions, parents=(-1, 0, 0, 2))])[0]
        shard.move(seq, prefix, (0, 2, 3))
        shard.rewind(seq, prefix + 3)
        after = step([PagedRow(seq, seq_tokens[prefix + 3 : prefix + 4])])[0]
        return np.concatenate([out[[0, 2, 3]], after])

    def run(prefix: int, n: int, beside: int) -> np.ndarray:
        """Tokens prefix..prefix+n of the sequence after its first ``prefix`` (one chunk), in a
        step with another session's chunk of ``beside`` tokens."""
        seq = open_seq(_WHOLE)
        if prefix:
            step([PagedRow(seq, seq_tokens[:prefix])])
        rows = [PagedRow(seq, seq_tokens[prefix : prefix + n])]
        if beside:
            rows.append(PagedRow(open_seq(beside), other[:beside]))
        return step(rows)[0]

    try:
        whole = run(0, _WHOLE, 0)
        # name -> (the first token's index in the whole chunk, prefix, tokens, tokens beside)
        shapes: dict[str, tuple[int, int, int]] = {
            "token 8 decoded alone": (8, 1, 0),
            "token 33 decoded alone": (33, 1, 0),
            "decode row beside a 1-token row": (20, 1, 1),
            "decode row beside a 7-token chunk": (20, 1, 7),
            "decode row beside a 40-token chunk": (20, 1, 40),
            "3-token verify row": (12, 3, 0),
            "3-token verify row beside an 8-token chunk": (12, 3, 8),
        }
        for at in sorted({5, shard.block_tokens}):
            if 0 < at < _WHOLE:
                shapes[f"prompt split {at}+{_WHOLE - at}"] = (at, _WHOLE - at, 0)
        worst, worst_name = -1.0, "none"
        for name, (start, n, beside) in shapes.items():
            delta = float(np.abs(run(start, n, beside) - whole[start : start + n]).max())
            if delta > worst:
                worst, worst_name = delta, name
        if shard.moves_slots:  # draft trees (adaptive speculation) run where a slot can move
            shapes["draft tree's path"] = (16, 4, 0)
            delta = float(np.abs(tree(16) - whole[16:20]).max())
            if delta > worst:
                worst, worst_name = delta, "draft tree's path"
        if worst == 0:
            worst_name = f"all {len(shapes)} shapes bit-identical"
        return worst, worst_name
    finally:
        for key in opened:
            shard.free(key)


def self_check(
    shard: PagedShard,
    configuration: str,
    properties: dict,
    tolerance: float,
    cache_folder: Path | None,
) -> SelfCheck:
    """The check's result for this shard, from the cache file when it holds one for this export,
    stage, device, configuration and CPU; else measured (and written there)."""
    key = cache_key(shard, configuration, properties)
    path = cache_folder / CACHE_FILE if cache_folder is not None else None
    saved = _read(path)
    if key in saved:
        found = SelfCheck(**{**saved[key], "cached": True})
        log.info("self_check", stage=shard.stage_index, configuration=configuration, result=found.describe())
        return found
    started = time.perf_counter()
    delta, worst = measure(shard)
    result = SelfCheck(
        passed=delta <= tolerance,
        max_delta=delta,
        tolerance=tolerance,
        worst=worst,
        seconds=round(time.perf_counter() - started, 3),
    )
    log.info("self_check", stage=shard.stage_index, configuration=configuration, result=result.describe())
    if path is not None:
        _write(path, {**_read(path), key: {k: v for k, v in asdict(result).items() if k != "cached"}})
    return result


def _read(path: Path | None) -> dict:
    if path is None or not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # a damaged cache file is measured again and rewritten
    return data if isinstance(data, dict) else {}


def _write(path: Path, data: dict) -> None:
    try:
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError as exc:  # a read-only cache folder: the check runs again at the next start
        log.warning("self_check_not_cached", path=str(path), reason=f"{type(exc).__name__}: {exc}")


@dataclass(frozen=True)
class Proof:
    """What a paged stage serves and why: the configuration it compiled, its self-check (None:
    the precision promises nothing, so none ran) and the configurations that failed before it."""

    configuration: str
    check: SelfCheck | None
    fallbacks: tuple[str, ...] = ()

    @property
    def invariant(self) -> bool:
        return self.check is not None and self.check.passed

    def describe_fallbacks(self) -> str:
        return "; ".join(self.fallbacks)


def prove(
    load: Callable[[Configuration], PagedShard],
    configurations: tuple[Configuration, ...],
    cache_folder: Path | None,
    *,
    check: bool = True,
) -> PagedShard:
    """The first of ``configurations`` whose compiled shard passes its self-check (the last one
    if none does, reported as not invariant), with its ``proof``; ``check`` False compiles the
    first and checks nothing (a precision with no promise)."""
    failed: list[str] = []
    for i, config in enumerate(configurations):
        shard = load(config)
        if not check:
            shard.proof = Proof(config.name, None)
            return shard
        result = self_check(shard, config.name, config.properties, config.tolerance, cache_folder)
        last = i == len(configurations) - 1
        if result.passed or last:
            shard.proof = Proof(config.name, result, tuple(failed))
            if failed:
                log.warning(
                    "invariant_fallback",
                    stage=shard.stage_index,
                    serving=config.name,
                    failed="; ".join(failed),
                )
            return shard
        failed.append(f"{config.name}: {result.describe()}")
        del shard  # its compiled model and block pools go before the next compiles
    raise ValueError("no configuration to try")


def self_check_folder(export_dir: Path, compile_cache: str, device: str) -> Path | None:
    """Where the cache file goes: the compile cache's folder for this export and device (its
    default folder when compiled-model caching is off); None when it cannot be written."""
    setting = "" if compile_cache.strip().lower() == OFF else compile_cache
    return writable_cache(cache_folder(setting, load_manifest(export_dir), device))
