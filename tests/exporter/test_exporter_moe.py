"""The mixture-of-experts stage graph: the sparse form (Gather of the experts a step chose) and the
dense form (every expert, unchosen ones weighted 0) give the same logits on OpenVINO; only the
sparse form gathers expert weights; the by_rows form runs the sparse one for a step of few rows and
the dense one above, in one graph, and 1 or 8 sequences at a time give the same tokens; an export
takes by_rows at fp16/fp32 and dense at int4; expert memory counts every expert, in the export
budget and in the planner's cost."""

from __future__ import annotations

import dataclasses

import numpy as np
import openvino as ov
import pytest
import torch

from pipeshard.exporter.budget import stage_params
from pipeshard.exporter.convert import trace_stage
from pipeshard.exporter.export import MODEL_XML
from pipeshard.exporter.families import load_config, resolve_spec
from pipeshard.exporter.stage_module import build_stage_module
from pipeshard.exporter.weights import load_stage_weights
from pipeshard.shard.paged import PagedRow, PagedShard


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


def _op_types(model: ov.Model) -> set[str]:
    types = set()
    for op in model.get_ops():
        types.add(op.get_type_name())
        if op.get_type_name() == "If":
            types |= _op_types(op.get_function(0)) | _op_types(op.get_function(1))
    return types


def test_by_rows_form_runs_sparse_for_few_rows_and_dense_for_many(moe):
    """One MoE layer (layer 2) in the by_rows form, with NaN weights in an expert the 1-row step
    does not choose: only the dense form reads it, so a NaN in the output shows which form ran."""
    folder, spec = moe
    spec = dataclasses.replace(spec, moe=dataclasses.replace(spec.moe, form="by_rows"))
    assert spec.moe is not None and spec.moe.sparse_rows == 1  # 8 experts, 2 per token
    module = build_stage_module(spec, 2, 3, load_stage_weights(folder, spec, 2, 3))
    torch.manual_seed(0)
    one, many = module.example_inputs(batch=1, seq=1, past=3), module.example_inputs(batch=3, seq=5, past=0)
    routed = []
    hook = module.layers[0].mlp.router.register_forward_hook(lambda m, i, out: routed.append(out))
    with torch.no_grad():
        want_one = module(*one)[0].numpy()
    hook.remove()
    chosen = set(routed[0].topk(spec.moe.top_k, dim=-1).indices.flatten().tolist())
    unchosen = min(set(range(spec.moe.num_experts)) - chosen)
    with torch.no_grad():
        module.layers[0].mlp.gate_up[unchosen] = float("nan")
    model = trace_stage(module)
    assert {"If", "NonZero"} <= _op_types(model)
    compiled = ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    got_one = compiled([t.numpy() for t in one])[0]
    np.testing.assert_allclose(got_one, want_one, rtol=1e-4, atol=1e-5)  # sparse: NaN never read
    assert np.isnan(compiled([t.numpy() for t in many])[0]).any()  # 15 rows: dense read it


@pytest.mark.parametrize(("weights", "form_ops"), [("fp16", {"If", "NonZero"}), ("int4", set())])
def test_an_export_takes_the_form_of_its_weights(weights, form_ops, tiny_export):
    out = tiny_export("qwen3_moe", 2, weights)
    types = set().union(*(_op_types(ov.Core().read_model(out / f"stage_{s}" / MODEL_XML)) for s in (0, 1)))
    assert types & {"If", "NonZero"} == form_ops
    manifest = (out / "manifest.json").read_text()
    assert ('"form": "by_rows"' in manifest) == (weights == "fp16")


def _paged_greedy(export, prompts: list[np.ndarray], together: bool, new_tokens: int) -> list[list[int]]:
    """Greedy tokens of every prompt on 2 paged stages: all sequences in each step, or one at a time."""
    shards = [PagedShard(export, s, "f32", 1, cache_bytes=8 << 20) for s in (0, 1)]
    out: list[list[int]] = [[] for _ in prompts]
    groups = [list(range(len(prompts)))] if together else [[i] for i in range(len(prompts))]
    for group in groups:
        for seq in group:
            for shard in shards:
                shard.open(seq, len(prompts[seq]) + new_tokens)
        feed = {seq: prompts[seq] for seq in group}
        for _ in range(new_tokens):
            hidden = shards[0].step([PagedRow(seq, feed[seq]) for seq in group])
            logits = shards[1].step(
                [PagedRow(seq, h, logits=1) for seq, h in zip(group, hidden, strict=True)]
            )
            for seq, lg in zip(group, logits, strict=True):
                out[seq].append(int(lg[-1].argmax()))
                feed[seq] = np.array([out[seq][-1]], dtype=np.int64)
    return out


def test_one_or_eight_sequences_a_step_give_the_same_tokens(tiny_export):
    """fp16 by_rows shards: alone, a decode step has 1 row (sparse); 8 together have 8 (dense)."""
    export = tiny_export("qwen3_moe", 2, "fp16")
    rng = np.random.default_rng(8)
    prompts = [rng.integers(0, 256, size=int(n), dtype=np.int64) for n in rng.integers(3, 12, size=8)]
    alone = _paged_greedy(export, prompts, together=False, new_tokens=24)
    assert _paged_greedy(export, prompts, together=True, new_tokens=24) == alone
    assert len({tuple(t) for t in alone}) > 1  # the prompts lead to different sequences


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
