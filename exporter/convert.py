"""Stage module -> stateful OpenVINO model.

1. ``ov.convert_model(module, example_input=...)`` with dynamic batch, sequence and past dims;
   port names are then set from the module's own name lists.
2. Optionally a ``beam_idx`` Parameter (i32 [B]) with ``Gather(past, beam_idx, axis 0)`` in
   front of every KV consumer: the pattern optimum-intel's ``fuse_cache_reorder`` builds, with
   which the CPU plugin compiles the same fused stateful attention as an optimum export.
3. ``apply_make_stateful_transformation`` turns each past/present pair into ReadValue/Assign.
   Variable ids are renamed to ``past_key_values.{layer}.key`` / ``.value``.
4. Each ReadValue gets an initializer of zeros shaped [batch, kv_heads, 0, head_dim], the
   batch read from the main input's shape: without it a bare ``reset_state()`` can leave an
   empty state the CPU plugin's Concat fails on.
"""

from __future__ import annotations

import numpy as np
import openvino as ov
import torch
from openvino import opset13
from openvino._offline_transformations import apply_make_stateful_transformation

from pipeshard.exporter.stage_module import StageModule

BEAM_IDX = "beam_idx"


def _input_spec(module: StageModule) -> list[tuple[ov.PartialShape, ov.Type]]:
    s = module.spec
    main = (
        (ov.PartialShape([-1, -1]), ov.Type.i64)
        if module.is_first
        else (ov.PartialShape([-1, -1, s.hidden_size]), ov.Type.f32)
    )
    specs = [main, (ov.PartialShape([-1, -1]), ov.Type.i64), (ov.PartialShape([-1, -1]), ov.Type.i64)]
    if module.is_last:
        specs.append((ov.PartialShape([]), ov.Type.i64))
    kv = (ov.PartialShape([-1, s.num_kv_heads, -1, s.head_dim]), ov.Type.f32)
    specs += [kv] * (2 * len(module.layer_indices))
    return specs


def disable_ovc_telemetry() -> None:
    """Swap OpenVINO's own no-op telemetry stub in for ``openvino_telemetry`` in the converter.

    ``ov.convert_model`` otherwise sends usage events from background threads; with no network
    here each send waits out its timeout and the process then lingers ~20 s at exit.
    """
    try:
        import openvino.tools.ovc.convert_impl as convert_impl
        import openvino.tools.ovc.telemetry_stub as stub
        import openvino.tools.ovc.telemetry_utils as telemetry_utils
    except ImportError:  # layout changed: conversion still works, it only may linger at exit
        return
    telemetry_utils.tm = stub
    convert_impl.tm = stub


def trace_stage(module: StageModule) -> ov.Model:
    """Convert a stage module to a stateless OpenVINO model with named, dynamic ports."""
    disable_ovc_telemetry()
    with torch.no_grad():
        model = ov.convert_model(module, example_input=module.example_inputs(), input=_input_spec(module))
    for port, name in zip(model.inputs, module.input_names(), strict=True):
        port.get_tensor().set_names({name})
        port.get_node().set_friendly_name(name)
    for port, name in zip(model.outputs, module.output_names(), strict=True):
        port.get_tensor().set_names({name})
    model.validate_nodes_and_infer_types()
    return model


def add_beam_idx(model: ov.Model, kv_inputs: list[str]) -> None:
    """Add ``beam_idx`` (i32 [B]) and a Gather(past, beam_idx, 0) in front of every KV consumer."""
    batch = model.inputs[0].get_partial_shape()[0]
    beam_idx = opset13.parameter(ov.PartialShape([batch]), ov.Type.i32, name=BEAM_IDX)
    beam_idx.output(0).get_tensor().set_names({BEAM_IDX})
    model.add_parameters([beam_idx])
    for name in kv_inputs:
        port = model.input(name)
        consumers = port.get_target_inputs()
        gather = opset13.gather(port, beam_idx, opset13.constant(np.int64(0)))
        for consumer in consumers:
            consumer.replace_source_output(gather.output(0))
    model.validate_nodes_and_infer_types()


def _init_read_values(model: ov.Model) -> None:
    """Zeros [batch, kv_heads, 0, head_dim] as every ReadValue's initializer (batch from input 0)."""
    main = model.inputs[0]
    batch = opset13.gather(
        opset13.shape_of(main, output_type="i64"),
        opset13.constant(np.array([0], np.int64)),
        opset13.constant(0),
    )
    for op in model.get_ops():
        if op.get_type_name() != "ReadValue":
            continue
        pshape = op.get_output_partial_shape(0)
        dims = [batch]
        for d in list(pshape)[1:]:
            dims.append(opset13.constant(np.array([d.get_length() if d.is_static else 0], np.int64)))
        shape = opset13.concat(dims, axis=0)
        zeros = opset13.broadcast(opset13.constant(np.float32(0.0)).output(0), shape)
        if op.get_output_element_type(0) != ov.Type.f32:
            zeros = opset13.convert(zeros, op.get_output_element_type(0))
        op.set_arguments([zeros.output(0)])
    model.validate_nodes_and_infer_types()


def _rename_variables(model: ov.Model, ids: dict[str, str]) -> None:
    """Rename state variables: make_stateful names them ``<param><result>``; we want ``<param>``."""
    for var in model.get_variables():
        info = var.get_info()
        if info.variable_id in ids:
            info.variable_id = ids[info.variable_id]
            var.update(info)


def make_stateful(model: ov.Model, pairs: dict[str, str]) -> None:
    """Turn past/present port pairs into ReadValue/Assign state with ids = the past names."""
    apply_make_stateful_transformation(model, pairs)
    _rename_variables(model, {p + r: p for p, r in pairs.items()})
    _init_read_values(model)


def convert_stage(module: StageModule, beam_idx: bool = True) -> ov.Model:
    """Trace, optionally fuse the beam_idx reorder, and make the KV cache graph state."""
    model = trace_stage(module)
    past = [n for n in module.input_names() if n.startswith("past_key_values.")]
    present = [n for n in module.output_names() if n.startswith("present.")]
    if beam_idx:
        add_beam_idx(model, past)
    make_stateful(model, dict(zip(past, present, strict=True)))
    return model


def state_variable_ids(model: ov.Model) -> list[str]:
    """Variable ids of a model's state, ordered by layer, key before value."""

    def order(name: str) -> tuple:
        parts = name.split(".")
        layer = int(parts[1]) if len(parts) > 2 and parts[1].isdigit() else -1
        return (layer, parts[-1] != "key", name)

    return sorted((v.get_info().variable_id for v in model.get_variables()), key=order)


def kv_reorder_report(model: ov.Model) -> dict[str, int]:
    """Counts of ReadValue ops and of ``Gather(ReadValue, beam_idx, 0)`` ops in a stateful model."""
    read_values = [op for op in model.get_ops() if op.get_type_name() == "ReadValue"]
    gathers = 0
    for op in model.get_ops():
        if op.get_type_name() != "Gather":
            continue
        data = op.input_value(0).get_node()
        index = op.input_value(1).get_node()
        if (
            data.get_type_name() == "ReadValue"
            and index.get_type_name() == "Parameter"
            and (BEAM_IDX in index.output(0).get_names())
        ):
            gathers += 1
    return {"read_values": len(read_values), "beam_idx_gathers": gathers}
