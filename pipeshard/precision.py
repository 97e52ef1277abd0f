"""The inference precisions every entry point offers, and the one all of them default to.

``default`` is the CPU plugin's own choice (bf16 where the CPU has it, a u8 KV cache, activations
quantized on the fly inside INT4/INT8-weight matmuls); ``f32`` computes and caches in f32;
``exact`` is the mode in which speculation, chunked prefill and batching never change a token
(docs/ARCHITECTURE.md, "Exactness"). ``pipeshard.shard.runtime.compile_properties`` maps each to
CPU properties. Flags, settings, the Makefile and the benchmarks read DEFAULT_PRECISION from here.
"""

from __future__ import annotations

PRECISIONS = ("default", "f32", "exact")
DEFAULT_PRECISION = "default"
