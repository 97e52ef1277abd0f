"""The inference precisions every entry point offers, the one all of them default to, the compile
configurations behind them, and which of them promise invariance.

``invariant`` (the default, issue 49) is the fastest configuration that proves, on the CPU it
runs on, that a row's tokens do not depend on the rows sharing its step, on speculation, on how
its prompt was chunked or on prefix reuse (docs/ARCHITECTURE.md, "Precision and exactness"): a
stage walks its backend's ladder (INVARIANT_LADDER, SINGLE_ROW_LADDER), compiling each
configuration and running its self-check (pipeshard/shard/self_check.py), and serves the first
that passes, ending at ``exact``.
``exact`` is f32 with an f32 KV cache and no dynamic quantization (issue 34's invariant mode: a
row within 1e-3 of one-row decoding); ``fast`` is the CPU plugin's own choice (bf16 where the
CPU has it, a u8 KV cache, activations quantized on the fly inside INT4/INT8-weight matmuls),
batch-dependent; ``f32`` computes and caches in f32 (compiled like ``exact``, without its
promise); ``default`` names DEFAULT_PRECISION. ``pipeshard.shard.runtime.compile_properties``
maps each to CPU properties. Flags, settings, the Makefile and the benchmarks read
DEFAULT_PRECISION from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeshard.errors import InvalidArgument

PRECISIONS = ("default", "fast", "f32", "exact", "invariant")
DEFAULT_PRECISION = "invariant"
# The precisions that promise a row's tokens independent of load, speculation, chunking and
# prefix reuse: ``exact`` by its numerics, ``invariant`` by the self-check its stages pass.
INVARIANT_PRECISIONS = frozenset({"exact", "invariant"})


@dataclass(frozen=True)
class Configuration:
    """CPU compile properties (beyond the LATENCY hint), whether a paged stage feeds a one-token
    row as two tokens (the previous token re-fed, so every row takes the multi-query attention
    path), and the self-check's tolerance: 0 promises bit-identical rows."""

    name: str
    properties: dict[str, Any] = field(default_factory=dict)
    two_token_rows: bool = False
    tolerance: float = 0.0


_F32 = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0}
CONFIGURATIONS = {
    c.name: c
    for c in (
        Configuration("fast"),
        Configuration("f32", _F32),
        # issue 34's promise: every logit within 1e-3 of one-row decoding (1.4e-4 measured)
        Configuration("exact", _F32, tolerance=1e-3),
        # bf16 inference and a bf16 KV cache, activations quantized per group inside the INT4
        # matmuls (their rows then do not see each other), every row multi-query: bit-identical
        # on the AMD EPYC (Zen 4, AVX-512 BF16) of bench-precision-modes 2026-12-05
        Configuration(
            "bf16-kv16",
            {
                "INFERENCE_PRECISION_HINT": "bf16",
                "KEY_CACHE_PRECISION": "bf16",
                "VALUE_CACHE_PRECISION": "bf16",
            },
            two_token_rows=True,
        ),
        # the same in f32 with an f16 cache, for CPUs without bf16
        Configuration(
            "f32-kv16",
            {"INFERENCE_PRECISION_HINT": "f32", "KEY_CACHE_PRECISION": "f16", "VALUE_CACHE_PRECISION": "f16"},
            two_token_rows=True,
        ),
        # bf16 with a bf16 cache, rows fed as they come: for stages that cannot re-feed a token
        # (stateful, static). Bit-identical on a static stage of this AMD EPYC (its KV buffers are
        # f32 inputs, so the cache properties do not apply); a stateful stage fails it (a split
        # prompt: 1.2-2.2), a paged one too (a decode row beside another: 0.6-1.05)
        Configuration(
            "bf16-kv16-single",
            {
                "INFERENCE_PRECISION_HINT": "bf16",
                "KEY_CACHE_PRECISION": "bf16",
                "VALUE_CACHE_PRECISION": "bf16",
            },
        ),
        # `fast`'s u8 cache with two-token rows: not invariant (a chunk attends its own tokens
        # unquantized), so it fails its self-check; for tests and the bench, never a default rung
        Configuration(
            "bf16-kv8",
            {"INFERENCE_PRECISION_HINT": "bf16", "KEY_CACHE_PRECISION": "u8", "VALUE_CACHE_PRECISION": "u8"},
            two_token_rows=True,
        ),
    )
}
# What ``invariant`` tries, fastest first; ``exact`` ends it (a stage that fails even that
# reports itself load-dependent). Paged stages feed two-token rows; stateful and static stages
# cannot (a stateful cache only appends, a static step packs what it is sent), so they skip the
# rungs that need them and walk SINGLE_ROW_LADDER by default.
INVARIANT_LADDER = ("bf16-kv16", "f32-kv16", "exact")
SINGLE_ROW_LADDER = ("bf16-kv16-single", "exact")


def canonical(precision: str) -> str:
    """The precision a name stands for: ``default`` becomes DEFAULT_PRECISION, so what a stage
    reports and what fleets compare is never the alias."""
    if precision not in PRECISIONS:
        raise InvalidArgument("precision", f"must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return DEFAULT_PRECISION if precision == "default" else precision


def is_invariant(precision: str) -> bool:
    """Whether that precision promises the same tokens under any load (see INVARIANT_PRECISIONS)."""
    return canonical(precision) in INVARIANT_PRECISIONS


def ladder(names: str | None = None, *, two_token_rows: bool = True) -> tuple[Configuration, ...]:
    """The configurations ``invariant`` tries, from a comma-separated list (``--invariant-ladder``;
    empty: INVARIANT_LADDER, or SINGLE_ROW_LADDER for a backend that cannot feed two-token rows);
    every name must be a configuration. Such a backend skips the rungs that need two-token rows,
    and tries ``exact`` when none is left."""
    default = INVARIANT_LADDER if two_token_rows else SINGLE_ROW_LADDER
    picked = tuple(n.strip() for n in (names or "").split(",") if n.strip()) or default
    unknown = [n for n in picked if n not in CONFIGURATIONS]
    if unknown:
        choices = ", ".join(CONFIGURATIONS)
        raise InvalidArgument("invariant_ladder", f"names {', '.join(unknown)}; choose from {choices}")
    configs = tuple(CONFIGURATIONS[n] for n in picked)
    if two_token_rows:
        return configs
    return tuple(c for c in configs if not c.two_token_rows) or (CONFIGURATIONS["exact"],)


def configuration(precision: str) -> Configuration:
    """The one configuration a precision compiles where no self-check runs (profiles, benches,
    local chains): ``invariant`` is then its last rung, ``exact``."""
    name = canonical(precision)
    return CONFIGURATIONS[INVARIANT_LADDER[-1] if name == "invariant" else name]
