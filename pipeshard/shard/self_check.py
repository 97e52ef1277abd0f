"""A stage's proof, on the CPU it runs on, that its compiled shard computes a row alike whatever
shares its step and however its sequence was cut into steps (issue 49).

Invariance is a property of the CPU plugin's kernels, not of a setting: the same properties
give bit-identical rows on one instruction set and not on another, and on one backend and not
on another (a static stage's KV buffers are f32 inputs, a stateful stage's cache is graph
state). So every stage at ``invariant`` or ``exact`` runs this small version of
bench-precision-modes' kernels check as it loads, on the shapes a fleet sends its backend (a
probe per backend runs them): a decode row alone (M = 1) and, where rows of other sessions share
the inference (paged, static), beside their chunks (M = 2, 8, 41), a prompt token decoded alone
against the same token inside a prefill chunk, a 3-token verify row alone and beside a chunk, a
prompt split into two chunks against one, and the path of a draft tree with a side branch and
the token decoded after it (as one masked sequence on a paged stage whose pools let the path
move, as two chains on a stateful one; static stages run no trees). Each is compared with the
same tokens inside one whole chunk (48 tokens, a static stage's chunk if shorter): logits on the
last stage, as they are; hidden states on the others, each position's difference over that
position's RMS in the whole chunk, the scale the next layer's RMSNorm reads them at (a middle
stage's residual stream reaches thousands in a few channels, where f32's last bit is already
above 1e-3, so an absolute difference there says nothing about the logits the promise is about).
The largest difference must be within the configuration's tolerance (0 for a bit-identity
promise, which the scaling leaves exact) for the stage to report ``invariant``.

A result is cached in ``self_check.json`` beside the compile cache (compile_cache.py), keyed by
the export, stage, backend, device, configuration, OpenVINO build and the CPU's name and flags, so a
restart on the same machine does not run it again and a move to another CPU does.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Generic, TypeVar

import numpy as np
import openvino as ov
import structlog

from pipeshard.precision import Configuration
from pipeshard.shard.compile_cache import OFF, cache_folder, writable_cache
from pipeshard.shard.manifest import load_manifest
from pipeshard.shard.paged import PagedRow, PagedShard
from pipeshard.shard.runtime import ShardRunner, ShardSession, StageShard
from pipeshard.shard.static import StaticRow, StaticShard

log = structlog.get_logger(__name__)

CACHE_FILE = "self_check.json"
VERSION = 5  # bump when the shapes checked change, so old cached results are not trusted
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


def cache_key(shard: StageShard, configuration: str, properties: dict) -> str:
    """One cached result per export, stage, backend, device, configuration and CPU."""
    fields = [
        f"v{VERSION}",
        shard.manifest.export_id or shard.manifest.model.fingerprint,
        str(shard.stage_index),
        type(shard).__name__,
        configuration,
        json.dumps(properties, sort_keys=True, default=str),
        cpu_identity(shard.core, shard.device),
    ]
    return hashlib.sha256("|".join(fields).encode()).hexdigest()[:24]


def difference(got: np.ndarray, want: np.ndarray, *, logits: bool) -> float:
    """The largest difference between a row's outputs and the whole chunk's: logits as they are;
    hidden states [T, H] over each position's RMS in ``want`` (module doc). 0 only when identical."""
    delta = np.abs(np.asarray(got, dtype=np.float64) - want)
    if not logits:
        rms = np.sqrt(np.mean(np.square(want, dtype=np.float64), axis=-1, keepdims=True))
        delta = delta / np.maximum(rms, np.finfo(np.float32).tiny)
    return float(delta.max())


def _inputs(shard: StageShard, rng: np.random.Generator, n: int) -> np.ndarray:
    if shard.is_first:
        return rng.integers(100, min(5000, shard.vocab_size), n).astype(np.int64)
    return rng.standard_normal((n, shard.hidden_size)).astype(np.float32)


K = TypeVar("K", bound=Hashable)  # how a probe names an open sequence


class _Probe(ABC, Generic[K]):
    """How the check runs sequences on one backend's shard: open one, run a step of rows (one per
    sequence, every token's outputs back), run a draft tree the way that backend runs it."""

    kind: str
    batches = True  # other sequences' rows share the inference (else "beside" shapes are moot)

    def __init__(self, shard) -> None:
        self.shard = shard
        self.whole = _WHOLE
        self.splits: tuple[int, ...] = (5,)

    @abstractmethod
    def open(self) -> K: ...

    @abstractmethod
    def step(self, rows: list[tuple[K, np.ndarray]]) -> list[np.ndarray]: ...

    @abstractmethod
    def free(self, seq: K) -> None: ...

    def tree(self, seq: K, path: np.ndarray, side: np.ndarray, prefix: int) -> np.ndarray | None:
        """The outputs of a draft tree's path (``path``, 3 tokens after ``prefix``, with ``side``
        branching off its first node), then the next token (``path[3]``) decoded alone once the
        path is accepted; None where this backend runs no draft trees."""
        return None


class _PagedProbe(_Probe[Hashable]):
    kind = "paged"

    def __init__(self, shard: PagedShard) -> None:
        super().__init__(shard)
        self.splits = tuple(sorted({5, shard.block_tokens}))
        self._names = iter(range(10**6))

    def open(self) -> Hashable:
        key = ("__self_check__", next(self._names))
        self.shard.open(key, self.whole)
        return key

    def step(self, rows: list[tuple[Hashable, np.ndarray]]) -> list[np.ndarray]:
        logits = self.shard.is_last  # every token's logits, so each compares with the whole chunk's
        return self.shard.step([PagedRow(k, x, logits=len(x) if logits else 0) for k, x in rows])

    def free(self, seq: Hashable) -> None:
        self.shard.free(seq)

    def tree(self, seq: Hashable, path: np.ndarray, side: np.ndarray, prefix: int) -> np.ndarray | None:
        """The path 0 -> 2 -> 3 with node 1 a sibling of node 2: one masked sequence."""
        if not self.shard.moves_slots:  # draft trees (adaptive speculation) run where a slot can move
            return None
        nodes = np.concatenate([path[:1], side[:1], path[1:3]])
        positions = np.array([prefix, prefix + 1, prefix + 1, prefix + 2], dtype=np.int64)
        row = PagedRow(seq, nodes, positions=positions, parents=(-1, 0, 0, 2))
        if self.shard.is_last:
            row = replace(row, logits=4)
        out = self.shard.step([row])[0]
        self.shard.move(seq, prefix, (0, 2, 3))
        self.shard.rewind(seq, prefix + 3)
        return np.concatenate([out[[0, 2, 3]], self.step([(seq, path[3:4])])[0]])


class _StatefulProbe(_Probe[int]):
    """One InferRequest per session: a step's rows run one after another."""

    kind = "stateful"
    batches = False

    def __init__(self, shard: ShardRunner) -> None:
        super().__init__(shard)
        self._sessions: dict[int, ShardSession] = {}

    def open(self) -> int:
        key = len(self._sessions)
        self._sessions[key] = self.shard.new_session()
        return key

    def step(self, rows: list[tuple[int, np.ndarray]]) -> list[np.ndarray]:
        return [self._run(self._sessions[k], x) for k, x in rows]

    def _run(self, session: ShardSession, x: np.ndarray) -> np.ndarray:
        return session.run(x[None], return_last=len(x) if self.shard.is_last else 1)[0]

    def free(self, seq: int) -> None:
        self._sessions.pop(seq).reset()

    def tree(self, seq: int, path: np.ndarray, side: np.ndarray, prefix: int) -> np.ndarray | None:
        """Root-to-leaf chains as batch rows: the path, and the first node with two side tokens."""
        if not self.shard.has_beam_idx:
            return None
        session = self._sessions[seq]
        chains = np.concatenate([path[:3], path[:1], side[:2]])
        positions = np.tile(np.arange(prefix, prefix + 3, dtype=np.int64), 2)
        out = session.run_chains(chains[None], positions, 2, return_last=3 if self.shard.is_last else 1)[0]
        session.keep_chain(0)
        return np.concatenate([out[:3], self._run(session, path[3:4])])


class _StaticProbe(_Probe[int]):
    """Slots of at most ``chunk`` rows; single-token steps run the decode twin."""

    kind = "static"

    def __init__(self, shard: StaticShard) -> None:
        super().__init__(shard)
        self.whole = min(_WHOLE, shard.chunk)

    def open(self) -> int:
        return self.shard.acquire()

    def step(self, rows: list[tuple[int, np.ndarray]]) -> list[np.ndarray]:
        shard = self.shard
        return shard.step(
            [
                StaticRow(
                    k,
                    shard.length(k),
                    x,
                    np.arange(shard.length(k), shard.length(k) + len(x), dtype=np.int64),
                    logits=len(x) if shard.is_last else 0,
                )
                for k, x in rows
            ]
        )

    def free(self, seq: int) -> None:
        self.shard.release(seq)


def probe(shard: StageShard) -> _Probe:
    """The check's runner for this backend's shard."""
    if isinstance(shard, PagedShard):
        return _PagedProbe(shard)
    if isinstance(shard, StaticShard):
        return _StaticProbe(shard)
    if isinstance(shard, ShardRunner):
        return _StatefulProbe(shard)
    raise TypeError(f"no self-check for {type(shard).__name__}")


def measure(shard: StageShard) -> tuple[float, str]:
    """The largest |difference| between a row's outputs in the fleet's shapes and the same tokens
    inside one whole chunk, and which shape gave it."""
    runner = probe(shard)
    whole_n = runner.whole
    rng = np.random.default_rng(49)
    seq_tokens = _inputs(shard, rng, whole_n)
    other = _inputs(shard, rng, 64)
    opened: list = []

    def open_seq() -> Hashable:
        opened.append(runner.open())
        return opened[-1]

    def close() -> None:
        while opened:  # at once: a static shard has a few slots
            runner.free(opened.pop())

    def run(prefix: int, n: int, beside: int) -> np.ndarray:
        """Tokens prefix..prefix+n of the sequence after its first ``prefix`` (one chunk), in a
        step with another session's chunk of ``beside`` tokens."""
        seq = open_seq()
        if prefix:
            runner.step([(seq, seq_tokens[:prefix])])
        rows = [(seq, seq_tokens[prefix : prefix + n])]
        if beside:
            rows.append((open_seq(), other[:beside]))
        try:
            return runner.step(rows)[0]
        finally:
            close()

    try:
        whole = run(0, whole_n, 0)
        # name -> (the first token's index in the whole chunk, tokens, tokens beside); at 48
        # tokens: tokens 8 and 33 alone, a decode row at 20, a verify row at 12
        one, late, mid, verify = whole_n // 6, whole_n * 2 // 3 + 1, whole_n * 5 // 12, whole_n // 4
        shapes: dict[str, tuple[int, int, int]] = {
            f"token {one} decoded alone": (one, 1, 0),
            f"token {late} decoded alone": (late, 1, 0),
            "3-token verify row": (verify, 3, 0),
        }
        if runner.batches:
            wide = min(40, whole_n - 1)
            shapes |= {
                "decode row beside a 1-token row": (mid, 1, 1),
                "decode row beside a 7-token chunk": (mid, 1, 7),
                f"decode row beside a {wide}-token chunk": (mid, 1, wide),
                "3-token verify row beside an 8-token chunk": (verify, 3, 8),
            }
        for at in runner.splits:
            if 0 < at < whole_n:
                shapes[f"prompt split {at}+{whole_n - at}"] = (at, whole_n - at, 0)
        worst, worst_name = -1.0, "none"
        for name, (start, n, beside) in shapes.items():
            delta = difference(run(start, n, beside), whole[start : start + n], logits=shard.is_last)
            if delta > worst:
                worst, worst_name = delta, name
        at = whole_n // 3  # a draft tree after 16 of 48 tokens
        seq = open_seq()
        runner.step([(seq, seq_tokens[:at])])
        path = runner.tree(seq, seq_tokens[at : at + 4], other, at)
        if path is not None:
            shapes["draft tree's path"] = (at, 4, 0)
            delta = difference(path, whole[at : at + 4], logits=shard.is_last)
            if delta > worst:
                worst, worst_name = delta, "draft tree's path"
        if worst == 0:
            worst_name = f"all {len(shapes)} shapes bit-identical"
        return worst, worst_name
    finally:
        close()


def self_check(
    shard: StageShard,
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
    """What a stage serves and why: the configuration it compiled, its self-check (None:
    the precision promises nothing, so none ran) and the configurations that failed before it."""

    configuration: str
    check: SelfCheck | None
    fallbacks: tuple[str, ...] = ()

    @property
    def invariant(self) -> bool:
        return self.check is not None and self.check.passed

    def describe_fallbacks(self) -> str:
        return "; ".join(self.fallbacks)


S = TypeVar("S", bound=StageShard)


def prove(
    load: Callable[[Configuration], S],
    configurations: tuple[Configuration, ...],
    cache_folder: Path | None,
    *,
    check: bool = True,
) -> S:
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
        del shard  # its compiled model and KV buffers go before the next compiles
    raise ValueError("no configuration to try")


def self_check_folder(export_dir: Path, compile_cache: str, device: str) -> Path | None:
    """Where the cache file goes: the compile cache's folder for this export and device (its
    default folder when compiled-model caching is off); None when it cannot be written."""
    setting = "" if compile_cache.strip().lower() == OFF else compile_cache
    return writable_cache(cache_folder(setting, load_manifest(export_dir), device))
