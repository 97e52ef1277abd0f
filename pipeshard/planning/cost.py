"""The cost model the planner optimises: what one stage costs in time and memory.

A stage is a node running layers [a, b) of the model for ``rows`` sequences at once (one
micro-batch of decode steps). Its step time is the node's fixed per-step cost, plus its per-layer
time for each layer, plus the embedding (first stage) or final norm and LM head (last stage),
plus sending its output over the node's outgoing link: hidden states to the next stage, the
Top1 result back to the coordinator from the last. Memory is the weights of its layers, their KV
cache for ``context`` tokens of every resident sequence, and the embedding / head it carries.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from pipeshard.errors import InvalidArgument

# Bytes per weight by export format: int4 keeps one fp16 scale and zero point per group of 64,
# int8 one per output channel (negligible).
BYTES_PER_WEIGHT = {"fp32": 4.0, "fp16": 2.0, "int8": 1.0, "int4": 0.5 + 4.0 / 64}
# The embedding and the LM head stay int8 with int4/int8 weights (the exporter's default).
HEAD_BYTES_PER_WEIGHT = {"fp32": 4.0, "fp16": 2.0, "int8": 1.0, "int4": 1.0}


@dataclass(frozen=True)
class Curve:
    """Milliseconds as a function of the rows (sequences) in a step, from measured points.

    Linear between points and beyond the last two; one point means the same time at every
    batch size (decode on a CPU is bound by reading weights, so this holds for small batches)."""

    points: tuple[tuple[int, float], ...]

    @classmethod
    def constant(cls, ms: float) -> Curve:
        return cls(((1, float(ms)),))

    @classmethod
    def parse(cls, value: object, field: str) -> Curve:
        """A number (ms at every batch size) or a mapping {rows: ms}."""
        if isinstance(value, bool):
            raise InvalidArgument(field, f"must be a number of ms or a mapping rows -> ms, got {value!r}")
        if isinstance(value, int | float):
            if not math.isfinite(value) or value < 0:
                raise InvalidArgument(field, f"must be a finite number >= 0, got {value!r}")
            return cls.constant(value)
        if isinstance(value, Mapping) and value:
            points = []
            for rows, ms in value.items():
                try:
                    r, m = int(rows), float(ms)
                except (TypeError, ValueError):
                    raise InvalidArgument(field, f"has a bad entry {rows!r}: {ms!r}") from None
                if r < 1 or not math.isfinite(m) or m < 0:
                    raise InvalidArgument(field, f"needs rows >= 1 and finite ms >= 0, got {rows!r}: {ms!r}")
                points.append((r, m))
            if len({r for r, _ in points}) != len(points):
                raise InvalidArgument(field, f"lists a row count twice: {dict(value)!r}")
            return cls(tuple(sorted(points)))
        raise InvalidArgument(field, f"must be a number of ms or a mapping rows -> ms, got {value!r}")

    def at(self, rows: int) -> float:
        pts = self.points
        if len(pts) == 1:
            return pts[0][1]
        k = next((k for k in range(1, len(pts)) if rows <= pts[k][0]), len(pts) - 1)
        (r0, m0), (r1, m1) = pts[k - 1], pts[k]
        return max(0.0, m0 + (m1 - m0) * (rows - r0) / (r1 - r0))

    def to_yaml(self) -> float | dict[int, float]:
        return self.points[0][1] if len(self.points) == 1 else {r: m for r, m in self.points}


@dataclass(frozen=True)
class Link:
    """A node's outgoing link: to the next stage, or from the last stage back to the coordinator."""

    mbit: float = math.inf
    rtt_ms: float = 0.0

    def transfer_ms(self, nbytes: float) -> float:
        """One message: half a round trip plus serialisation at the link's rate."""
        return self.rtt_ms / 2 + (0.0 if math.isinf(self.mbit) else nbytes * 8 / (self.mbit * 1e3))


@dataclass(frozen=True)
class ModelCost:
    """The model as the planner sees it: layers, bytes and the size of what crosses a link."""

    num_layers: int
    hidden_size: int
    layer_bytes: int
    embed_bytes: int
    head_bytes: int
    kv_bytes_per_token: int  # K and V of one layer for one token (f32 cache)
    context: int = 4096  # KV reserved per resident sequence
    activation_bytes: int = 4  # per hidden element on the wire (fp32)
    result_bytes: int = 8  # per row returned by the last stage (Top1: id + probability)
    name: str = "model"

    def __post_init__(self):
        if self.num_layers < 1:
            raise InvalidArgument("num_layers", f"must be at least 1, got {self.num_layers}")

    @classmethod
    def estimate(
        cls,
        *,
        num_layers: int,
        hidden_size: int,
        intermediate_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        vocab_size: int,
        tie_word_embeddings: bool,
        weights: str = "int4",
        context: int = 4096,
        name: str = "model",
        mlp_params: int | None = None,
    ) -> ModelCost:
        """Bytes from the parameter counts of a Llama-style decoder layer at the export format;
        ``mlp_params`` replaces the SwiGLU MLP's count (a MoE layer: every expert and the router)."""
        if weights not in BYTES_PER_WEIGHT:
            raise InvalidArgument("weights", f"must be one of {', '.join(BYTES_PER_WEIGHT)}, got {weights!r}")
        q, kv = num_heads * head_dim, num_kv_heads * head_dim
        mlp = 3 * hidden_size * intermediate_size if mlp_params is None else mlp_params
        params = hidden_size * (2 * q + 2 * kv) + mlp
        table = vocab_size * hidden_size * HEAD_BYTES_PER_WEIGHT[weights]
        return cls(
            num_layers=num_layers,
            hidden_size=hidden_size,
            layer_bytes=int(params * BYTES_PER_WEIGHT[weights] + 2 * hidden_size * 4),
            embed_bytes=int(table),
            head_bytes=int(table + hidden_size * 4),  # a tied head is a second copy on the last stage
            kv_bytes_per_token=2 * kv * 4,
            context=context,
            name=name,
        )

    def wire_bytes(self, rows: int, last: bool) -> int:
        return rows * (self.result_bytes if last else self.hidden_size * self.activation_bytes)

    def stage_bytes(self, a: int, b: int, resident: int) -> int:
        """Memory of a stage holding layers [a, b) with ``resident`` sequences' KV caches."""
        per_layer = self.layer_bytes + self.kv_bytes_per_token * self.context * resident
        return (
            (b - a) * per_layer
            + (self.embed_bytes if a == 0 else 0)
            + (self.head_bytes if b == self.num_layers else 0)
        )
