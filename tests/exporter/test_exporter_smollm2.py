"""Structure of the real SmolLM2 exports (shared with the runtime tests through ``smollm2_export``)."""

from __future__ import annotations

import numpy as np
import openvino as ov
import pytest

from exporter.convert import kv_reorder_report
from exporter.manifest import verify_shard

pytestmark = pytest.mark.slow

EXPORTS = [(1, "fp32"), (2, "fp32"), (3, "fp32"), (1, "int4"), (2, "int4"), (3, "int4")]


@pytest.mark.parametrize(("stages", "weights"), EXPORTS)
def test_every_shard_has_a_beam_gather_per_state(stages, weights, smollm2_export):
    export = smollm2_export(stages, weights)
    core = ov.Core()
    total = 0
    for stage in range(stages):
        manifest = verify_shard(export, stage, hashes=False)
        entry = manifest["stages"][stage]
        model = core.read_model(export / entry["model"])
        report = kv_reorder_report(model)
        layers = entry["layer_end"] - entry["layer_start"]
        assert report == {"read_values": 2 * layers, "beam_idx_gathers": 2 * layers}
        assert len(entry["state_variables"]) == 2 * layers
        total += layers
    assert total == 30


def test_int4_layout(smollm2_export):
    """Decoder matrices INT4 symmetric in groups of 64; embedding and LM head INT8 per channel."""
    export = smollm2_export(1, "int4")
    manifest = verify_shard(export, 0, hashes=False)
    assert manifest["weights"] == {
        "format": "int4",
        "group_size": 64,
        "mode": "int4_sym",
        "embedding_and_lm_head": "int8",
    }
    model = ov.Core().read_model(export / manifest["stages"][0]["model"])
    int4, int8 = [], []
    for op in model.get_ops():
        if op.get_type_name() != "Constant":
            continue
        kind = op.get_output_element_type(0).get_type_name()
        shape = list(op.get_output_partial_shape(0).to_shape())
        if kind == "i4":
            int4.append(shape)
        elif kind in ("u8", "i8") and len(shape) == 2 and np.prod(shape) > 1_000_000:
            int8.append(shape)
    assert len(int4) == 30 * 7 and all(s[-1] == 64 for s in int4)
    assert sorted(int8) == [[49152, 576], [49152, 576]]  # embedding + (tied) LM head
    assert manifest["tokenizer"]["openvino_tokenizer"] == "openvino_tokenizer.xml"
    assert manifest["tokenizer"]["chat_template"] is True
    assert manifest["model"]["eos_token_ids"] == [2]
    assert manifest["max_context"] == 4096
    for entry in manifest["stages"]:
        assert entry["export"]["peak_rss_bytes"] > 100 * 2**20
