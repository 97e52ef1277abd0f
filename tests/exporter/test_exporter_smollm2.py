"""Structure of the real SmolLM2 exports (shared with the runtime tests through ``smollm2_export``)."""

from __future__ import annotations

import numpy as np
import openvino as ov
import pytest

from pipeshard.exporter.convert import kv_reorder_report
from pipeshard.shard.manifest import verify_shard

pytestmark = pytest.mark.slow

EXPORTS = [
    pytest.param(stages, weights, marks=() if stages == 2 else pytest.mark.extended)
    for weights in ("fp32", "int4")
    for stages in (1, 2, 3)
]


@pytest.mark.parametrize(("stages", "weights"), EXPORTS)
def test_every_shard_has_a_beam_gather_per_state(stages, weights, smollm2_export):
    export = smollm2_export(stages, weights)
    core = ov.Core()
    total = 0
    for stage in range(stages):
        manifest = verify_shard(export, stage, hashes=False).to_dict()
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
    manifest = verify_shard(export, 0, hashes=False).to_dict()
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


@pytest.mark.parametrize(
    "stages", [pytest.param(1, marks=pytest.mark.extended), 2, pytest.param(3, marks=pytest.mark.extended)]
)
def test_fp32_stages_match_hf_at_every_boundary(stages, smollm2_export, hf_model, chat_prompt_ids):
    """Each stage's output equals HF's hidden states at its layer boundary (logits for the last),
    prefill then 10 decode steps, f32 compile hints. Tolerance |ov - hf| <= 2e-3 + 1e-4 * |hf|:
    SmolLM2's residual stream reaches about 2.5e4 in the middle layers (HF fp32)."""
    import torch

    from pipeshard.shard.manifest import load_manifest
    from pipeshard.shard.runtime import ShardRunner

    export = smollm2_export(stages, "fp32")
    manifest = load_manifest(export).to_dict()
    sessions = [ShardRunner(export, i, precision="f32").new_session() for i in range(stages)]
    prompt = chat_prompt_ids[1]
    ids = np.asarray([[*prompt, 504, 3575, 282, 4649, 314, 7042, 30, 216, 198, 2]], dtype=np.int64)
    with torch.no_grad():
        out = hf_model(torch.from_numpy(ids), output_hidden_states=True)
    hidden, logits = [h.numpy() for h in out.hidden_states], out.logits.numpy()
    n = len(prompt)
    for a, b in [(0, n), *[(t, t + 1) for t in range(n, ids.shape[1])]]:
        x = ids[:, a:b]
        for entry, session in zip(manifest["stages"], sessions, strict=True):
            y = session.run(x, np.arange(a, b)[None], return_last=b - a)
            is_last = entry["index"] == stages - 1
            ref = logits[:, a:b] if is_last else hidden[entry["layer_end"]][:, a:b]
            np.testing.assert_allclose(
                y, ref, rtol=1e-4, atol=2e-3, err_msg=f"stage {entry['index']} [{a},{b})"
            )
            x = y
