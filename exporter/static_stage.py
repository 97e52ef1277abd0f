"""Stateless static-shape stage graphs (``pipeshard export --static``): the form an NPU compiles.

An NPU plugin compiles only static shapes and keeps no graph state, so a static stage's KV cache
is a set of plain inputs and outputs and every inference has the same shape:

- ``input_ids`` int64 [S, C] (stage 0) or ``hidden_states`` f32 [S, C, H]: S slots of C rows;
- ``attention_mask`` int64 [S, L + C]: 1 = a key the slot's queries may see (its valid cache
  positions, then its valid new rows); causality over the new rows is built in-graph;
- ``position_ids`` int64 [S, C]: each row's logical (rotary) position;
- ``past_key_values.{layer}.key`` / ``.value`` f32 [S, kv_heads, L, head_dim]: the stage's
  cache buffers, owned and bound by the stage (pipeshard/shard/static.py).

Outputs: ``hidden_states`` f32 [S, C, H] or ``logits`` f32 [S, C, vocab], then
``present.{layer}.key`` / ``.value`` f32 [S, kv_heads, C, head_dim]: the new rows' K/V only,
which the stage writes into its buffers at each slot's length. The graph is the stateful
export's module (stage_module.py) traced at these shapes without the state transformation.
"""

from __future__ import annotations

import openvino as ov
import torch
from torch import nn

from pipeshard.exporter.convert import disable_ovc_telemetry
from pipeshard.exporter.stage_module import StageModule
from pipeshard.shard.manifest import StaticLayout


class StaticStage(nn.Module):
    """A stage module at fixed [slots, chunk] rows over KV inputs of ``context`` positions,
    returning only the new rows' K/V and, on the last stage, logits for every row."""

    def __init__(self, inner: StageModule, layout: StaticLayout, context: int):
        super().__init__()
        self.inner = inner
        self.layout = layout
        self.context = context

    def input_names(self) -> list[str]:
        return [n for n in self.inner.input_names() if n != "logits_to_keep"]

    def output_names(self) -> list[str]:
        return self.inner.output_names()

    def forward(self, x, attention_mask, position_ids, *past):
        chunk = self.layout.chunk
        rest = (torch.tensor(chunk, dtype=torch.int64), *past) if self.inner.is_last else past
        out, *presents = self.inner(x, attention_mask, position_ids, *rest)
        return (out, *(p[:, :, -chunk:] for p in presents))

    def input_spec(self) -> list[tuple[ov.PartialShape, ov.Type]]:
        s, (slots, chunk) = self.inner.spec, (self.layout.slots, self.layout.chunk)
        main = (
            (ov.PartialShape([slots, chunk]), ov.Type.i64)
            if self.inner.is_first
            else (ov.PartialShape([slots, chunk, s.hidden_size]), ov.Type.f32)
        )
        specs = [
            main,
            (ov.PartialShape([slots, self.context + chunk]), ov.Type.i64),
            (ov.PartialShape([slots, chunk]), ov.Type.i64),
        ]
        kv = (ov.PartialShape([slots, s.num_kv_heads, self.context, s.head_dim]), ov.Type.f32)
        return specs + [kv] * (2 * len(self.inner.layer_indices))

    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        s, (slots, chunk) = self.inner.spec, (self.layout.slots, self.layout.chunk)
        if self.inner.is_first:
            x = torch.zeros(slots, chunk, dtype=torch.int64)
        else:
            x = torch.zeros(slots, chunk, s.hidden_size)
        mask = torch.ones(slots, self.context + chunk, dtype=torch.int64)
        pos = torch.arange(chunk, dtype=torch.int64)[None].expand(slots, chunk).contiguous()
        kv = [
            torch.zeros(slots, s.num_kv_heads, self.context, s.head_dim)
            for _ in range(2 * len(self.inner.layer_indices))
        ]
        return (x, mask, pos, *kv)


def trace_static(module: StageModule, layout: StaticLayout, context: int) -> ov.Model:
    """The stateless static-shape OpenVINO model of a stage module, ports named as the module says."""
    disable_ovc_telemetry()
    static = StaticStage(module, layout, context).eval()
    with torch.no_grad():
        model = ov.convert_model(static, example_input=static.example_inputs(), input=static.input_spec())
    for port, name in zip(model.inputs, static.input_names(), strict=True):
        port.get_tensor().set_names({name})
        port.get_node().set_friendly_name(name)
    for port, name in zip(model.outputs, static.output_names(), strict=True):
        port.get_tensor().set_names({name})
    model.validate_nodes_and_infer_types()
    return model


def kv_port_names(model: ov.Model) -> list[str]:
    """The KV inputs in layer order, key before value: what a static stage's KV blob names."""

    def order(name: str) -> tuple:
        parts = name.split(".")
        return (int(parts[1]), parts[-1] != "key")

    names = [p.get_any_name() for p in model.inputs if p.get_any_name().startswith("past_key_values.")]
    return sorted(names, key=order)
