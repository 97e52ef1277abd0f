"""Export within a memory budget: the per-stage estimate, and `--max-stage-memory` refusing a split."""

from __future__ import annotations

import pytest

from pipeshard.errors import InvalidArgument
from pipeshard.exporter.budget import export_estimates, stage_params
from pipeshard.exporter.export import plan_export
from pipeshard.exporter.families import load_config, resolve_spec
from pipeshard.model.shapes import get_shape
from pipeshard.model.synth import config_json, synthesize


def _spec(name: str):
    return resolve_spec(config_json(get_shape(name), 0, 1, 2))


@pytest.mark.parametrize("name", ["llama-3.2-3b", "llama-3.1-8b", "qwen2.5-3b", "mistral-7b"])
def test_stage_params_add_up_to_the_model(name):
    spec, shape = _spec(name), get_shape(name)
    for layers in (
        [spec.num_layers],
        [8] * (spec.num_layers // 8) + [spec.num_layers % 8] * (spec.num_layers % 8 > 0),
    ):
        total = sum(e.params for e in export_estimates(spec, layers))
        tied_twice = shape.tie_word_embeddings and len(layers) > 1  # the last stage loads the table again
        assert total == shape.params + shape.vocab_size * shape.hidden_size * tied_twice


def test_middle_stages_hold_no_table():
    spec = _spec("llama-3.1-8b")
    assert stage_params(spec, 8, 16) < stage_params(spec, 0, 8) < stage_params(spec, 24, 32)


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    return synthesize(get_shape("test-llama3"), tmp_path_factory.mktemp("b") / "m", progress=lambda _: None)


def _plan(model, tmp_path, limit, stages):
    return plan_export(
        model, tmp_path / "out", stages=stages, split=None, weights="int4", group_size="auto",
        head_precision="int8", int8_sym=False, max_context=None, beam_idx=True, force=False,
        model_name=None, draft=None, max_stage_memory=limit,
    )  # fmt: skip


def test_export_refuses_a_stage_over_the_limit(small_model, tmp_path):
    spec = resolve_spec(load_config(small_model))
    one, two = export_estimates(spec, [4]), export_estimates(spec, [2, 2])
    limit = max(e.peak_bytes for e in two)
    assert _plan(small_model, tmp_path, limit, 2).layers == [2, 2]
    with pytest.raises(InvalidArgument) as err:
        _plan(small_model, tmp_path, limit, 1)
    assert err.value.field == "max_stage_memory"
    assert "stage 0 (layers 0..3" in str(err.value)
    assert f"{one[0].peak_bytes / 2**30:.2f} GiB" in str(err.value)
    assert not (tmp_path / "out").exists()
