"""What exporting one stage costs in memory, estimated before anything is loaded.

A stage export process holds its layers' weights as float32 (the traced module), the converted
OpenVINO graph that shares them, and NNCF's working copies while it compresses; the estimate is
``EXPORT_FACTOR`` x the stage's float32 weights plus the interpreter, torch and OpenVINO
(``EXPORT_BASE``), calibrated on synthetic Llama 3 exports (docs/BENCHMARKS.md "bench-scale").
``--max-stage-memory`` refuses a split with a stage over the limit before any stage runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipeshard.errors import InvalidArgument
from pipeshard.exporter.families import ModelSpec
from pipeshard.sizes import gib

EXPORT_FACTOR = 1.4
EXPORT_BASE = 900 * 2**20


def layer_params(spec: ModelSpec, layer: int) -> int:
    """Parameters of one decoder layer; a MoE layer counts every expert (all are resident)."""
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    bias = (q + 2 * kv if spec.qkv_bias else 0) + (spec.hidden_size if spec.o_bias else 0)
    norms = 2 * spec.head_dim if spec.family.qk_norm else 0
    return spec.hidden_size * (2 * q + 2 * kv) + spec.mlp_params(layer) + bias + norms


def stage_params(spec: ModelSpec, layer_start: int, layer_end: int) -> int:
    """Parameters one stage loads: its layers, the embedding (first), final norm and head (last)."""
    table = spec.vocab_size * spec.hidden_size
    first, last = layer_start == 0, layer_end == spec.num_layers
    params = sum(layer_params(spec, i) + 2 * spec.hidden_size for i in range(layer_start, layer_end))
    if first:
        params += table
    if last:  # final norm, and the head unless it is stage 0's own (tied) embedding tensor
        params += spec.hidden_size + (0 if first and spec.tie_word_embeddings else table)
    return params


@dataclass(frozen=True)
class StageExportEstimate:
    index: int
    layer_start: int
    layer_end: int
    params: int

    @property
    def peak_bytes(self) -> int:
        return int(self.params * 4 * EXPORT_FACTOR + EXPORT_BASE)


def export_estimates(spec: ModelSpec, layers: Sequence[int]) -> list[StageExportEstimate]:
    starts = [sum(layers[:i]) for i in range(len(layers))]
    return [
        StageExportEstimate(i, a, a + n, stage_params(spec, a, a + n))
        for i, (a, n) in enumerate(zip(starts, layers, strict=True))
    ]


def check_export_memory(spec: ModelSpec, layers: Sequence[int], limit: int | None) -> None:
    """InvalidArgument naming the first stage whose estimated export peak is over ``limit``."""
    if limit is None:
        return
    for est in export_estimates(spec, layers):
        if est.peak_bytes > limit:
            raise InvalidArgument(
                "max_stage_memory",
                f"is {gib(limit)}, but stage {est.index} (layers {est.layer_start}..{est.layer_end - 1}, "
                f"{est.params / 1e9:.2f} B parameters) needs an estimated {gib(est.peak_bytes)} to export; "
                "use more stages or a --split with fewer layers there",
            )
