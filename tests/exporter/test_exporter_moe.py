"""The mixture-of-experts stage graph: the sparse form (Gather of the experts a step chose) and the
dense fallback (every expert, unchosen ones weighted 0) give the same logits on OpenVINO; only the
sparse form gathers expert weights; expert memory counts every expert, in the export budget and
in the planner's cost."""

from __future__ import annotations

import dataclasses

import numpy as np
import openvino as ov
import pytest

from pipeshard.exporter.budget import stage_params
from pipeshard.exporter.convert import trace_stage
from pipeshard.exporter.families import load_config, resolve_spec
from pipeshard.exporter.stage_module import build_stage_module
from pipeshard.exporter.weights import load_stage_weights


@pytest.fixture(scope="module")
def moe(tiny_model):
    folder, _ = tiny_model("qwen3_moe")
    spec = resolve_spec(load_config(folder))
    return folder, spec


def _compiled(folder, spec, form: str):
    spec = dataclasses.replace(spec, moe=dataclasses.replace(spec.moe, form=form))
    module = build_stage_module(
        spec, 0, spec.num_layers, load_stage_weights(folder, spec, 0, spec.num_layers)
    )
    model = trace_stage(module)
    ops = {op.get_type_name() for op in model.get_ops()}
    compiled = ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    return compiled, ops, module.example_inputs(batch=3, seq=5, past=0)


def test_sparse_and_dense_forms_give_the_same_logits(moe):
    folder, spec = moe
    assert spec.moe is not None and spec.moe.layers == {0, 2, 3}  # layer 1 is mlp_only
    sparse, sparse_ops, inputs = _compiled(folder, spec, "sparse")
    dense, dense_ops, _ = _compiled(folder, spec, "dense")
    assert "NonZero" in sparse_ops and "NonZero" not in dense_ops
    feed = [t.numpy() for t in inputs]
    got, want = sparse(feed)[0], dense(feed)[0]
    assert got.shape == (3, 2, spec.vocab_size)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_expert_memory_counts_every_expert(moe):
    _, spec = moe
    h, m = spec.hidden_size, spec.moe
    assert m is not None
    plain = dataclasses.replace(spec, moe=None)
    per_moe_layer = m.num_experts * (3 * h * m.intermediate_size + h) - 3 * h * spec.intermediate_size
    assert stage_params(spec, 0, 2) - stage_params(plain, 0, 2) == per_moe_layer  # layers 0 (MoE), 1
    assert stage_params(spec, 2, 4) - stage_params(plain, 2, 4) == 2 * per_moe_layer


def test_planner_cost_counts_every_expert(tiny_model):
    from pipeshard.planning.cli import model_cost

    folder, _ = tiny_model("qwen3_moe")
    spec = resolve_spec(load_config(folder))
    m = spec.moe
    assert m is not None
    cost = model_cost(folder, "fp32", None)
    h = spec.hidden_size
    attention = h * (2 * spec.num_heads * spec.head_dim + 2 * spec.num_kv_heads * spec.head_dim)
    mlp = (3 * m.params(h) + 3 * h * spec.intermediate_size) // 4  # three MoE layers and one plain
    assert cost.layer_bytes == (attention + mlp) * 4 + 2 * h * 4
