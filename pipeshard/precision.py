"""The inference precisions every entry point offers, the one all of them default to, and which
of them promise invariance.

``exact`` (the default) is the mode in which a row's tokens do not depend on the rows sharing its
step, on speculation, on how its prompt was chunked or on prefix reuse (docs/ARCHITECTURE.md,
"Precision and exactness"); ``fast`` is the CPU plugin's own choice (bf16 where the CPU has it, a
u8 KV cache, activations quantized on the fly inside INT4/INT8-weight matmuls), faster on long
prompts but batch-dependent; ``f32`` computes and caches in f32 (today compiled like ``exact``,
without its promise); ``default`` names DEFAULT_PRECISION. ``pipeshard.shard.runtime.
compile_properties`` maps each to CPU properties. Flags, settings, the Makefile and the benchmarks
read DEFAULT_PRECISION from here.
"""

from __future__ import annotations

from pipeshard.errors import InvalidArgument

PRECISIONS = ("default", "fast", "f32", "exact")
DEFAULT_PRECISION = "exact"
# The precisions that promise a row's tokens independent of load, speculation, chunking and
# prefix reuse (bench-precision-modes: no cheaper configuration keeps all four on this CPU).
INVARIANT_PRECISIONS = frozenset({"exact"})


def canonical(precision: str) -> str:
    """The precision a name stands for: ``default`` becomes DEFAULT_PRECISION, so what a stage
    reports and what fleets compare is never the alias."""
    if precision not in PRECISIONS:
        raise InvalidArgument("precision", f"must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return DEFAULT_PRECISION if precision == "default" else precision


def is_invariant(precision: str) -> bool:
    """Whether that precision promises the same tokens under any load (see INVARIANT_PRECISIONS)."""
    return canonical(precision) in INVARIANT_PRECISIONS
