"""Tiny fp32 exports match Hugging Face at every stage boundary, for prefill and decode.

Tolerance: shards compiled with f32 inference and an f32 KV cache; every stage output (hidden
states at its layer boundary, or logits) must satisfy |ov - hf| <= 1e-4 + 1e-4 * |hf|.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeshard.shard.manifest import load_manifest
from pipeshard.shard.runtime import ShardRunner

RTOL = ATOL = 1e-4
PREFILL, DECODE = 7, 10


def _sessions(export_dir):
    manifest = load_manifest(export_dir).to_dict()
    runners = [ShardRunner(export_dir, i, precision="f32") for i in range(manifest["num_stages"])]
    return manifest, [r.new_session() for r in runners]


def _hf_reference(hf, ids):
    with torch.no_grad():
        out = hf(torch.from_numpy(ids), output_hidden_states=True)
    return [h.numpy() for h in out.hidden_states], out.logits.numpy()


@pytest.mark.parametrize("stages", [1, 2, 3])
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_every_stage_matches_hf_boundary(family, stages, tiny_model, tiny_export):
    _, hf = tiny_model(family)
    manifest, sessions = _sessions(tiny_export(family, stages))
    rng = np.random.default_rng(stages)
    ids = rng.integers(0, 256, size=(1, PREFILL + DECODE), dtype=np.int64)
    hidden, logits = _hf_reference(hf, ids)
    steps = [(0, PREFILL)] + [(t, t + 1) for t in range(PREFILL, PREFILL + DECODE)]
    for a, b in steps:
        x = ids[:, a:b]
        for entry, session in zip(manifest["stages"], sessions, strict=True):
            y = session.run(x, np.arange(a, b)[None], return_last=b - a)
            last = entry["layer_end"] == manifest["model"]["num_layers"]
            ref = logits[:, a:b] if last else hidden[entry["layer_end"]][:, a:b]
            np.testing.assert_allclose(
                y, ref, rtol=RTOL, atol=ATOL, err_msg=f"stage {entry['index']} at [{a},{b})"
            )
            x = y
    assert [s.past_length for s in sessions] == [PREFILL + DECODE] * stages


def test_return_last_slices_logits(tiny_model, tiny_export):
    _, hf = tiny_model("llama")
    _, sessions = _sessions(tiny_export("llama", 1))
    ids = np.arange(3, 12, dtype=np.int64)[None]
    _, logits = _hf_reference(hf, ids)
    out = sessions[0].run(ids, return_last=3)
    assert out.shape == (1, 3, 256)
    np.testing.assert_allclose(out, logits[:, -3:], rtol=RTOL, atol=ATOL)
    sessions[0].reset()
    out = sessions[0].run(ids)
    assert out.shape == (1, 1, 256)
    np.testing.assert_allclose(out, logits[:, -1:], rtol=RTOL, atol=ATOL)


def _chain_run(sessions, ids, positions=None, return_last=1):
    x = ids
    for s in sessions:
        x = s.run(x, positions, return_last=return_last)
    return x


@pytest.mark.parametrize(("family", "stages"), [("llama", 2), ("qwen2", 3), ("mistral", 1)])
def test_masked_rewind_equals_never_run(family, stages, tiny_export):
    """Run K extra tokens, invalidate them, continue: identical to never having run them."""
    export = tiny_export(family, stages)
    rng = np.random.default_rng(7)
    prompt = rng.integers(0, 256, size=(1, 6), dtype=np.int64)
    follow = rng.integers(0, 256, size=(1, 4), dtype=np.int64)
    junk = rng.integers(0, 256, size=(1, 3), dtype=np.int64)

    _, clean = _sessions(export)
    _chain_run(clean, prompt)
    want = [_chain_run(clean, follow[:, i : i + 1]) for i in range(4)]

    _, rewound = _sessions(export)
    _chain_run(rewound, prompt)
    _chain_run(rewound, junk, return_last=3)  # a rejected speculative block at physical 6..8
    for s in rewound:
        s.invalidate(6, 9)
    got = []
    for i in range(4):
        # logical positions continue at 6 (the default: the number of valid positions)
        got.append(_chain_run(rewound, follow[:, i : i + 1]))
        if i == 1:  # a second hole in the middle of the cache
            _chain_run(rewound, junk[:, :2], return_last=2)
            for s in rewound:
                s.invalidate(s.past_length - 2, s.past_length)
    assert rewound[0].past_length == 6 + 3 + 4 + 2
    assert rewound[0].valid_length == 6 + 4
    assert rewound[0].mask.tolist() == [1] * 6 + [0] * 3 + [1, 1, 0, 0, 1, 1]
    for i, (a, b) in enumerate(zip(want, got, strict=True)):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5, err_msg=f"token {i}")


def test_explicit_positions_after_rewind(tiny_export):
    """Explicit logical position_ids equal to the defaults give the same result."""
    export = tiny_export("llama", 2)
    ids = np.arange(20, 30, dtype=np.int64)[None]
    _, a = _sessions(export)
    _, b = _sessions(export)
    for sessions, explicit in ((a, False), (b, True)):
        _chain_run(sessions, ids[:, :5], np.arange(5)[None] if explicit else None)
        _chain_run(sessions, ids[:, 5:8], np.arange(5, 8)[None] if explicit else None, return_last=3)
        for s in sessions:
            s.invalidate(6, 8)
    out_a = _chain_run(a, ids[:, 8:9])
    out_b = _chain_run(b, ids[:, 8:9], np.array([[6]]))
    np.testing.assert_array_equal(out_a, out_b)


def test_no_beam_idx_export_matches(tiny_model, tiny_export):
    """Benchmark config B0: no beam_idx port, same numbers."""
    from pipeshard.exporter.convert import kv_reorder_report

    _, hf = tiny_model("llama")
    export = tiny_export("llama", 2, beam_idx=False)
    manifest, sessions = _sessions(export)
    for entry in manifest["stages"]:
        assert "beam_idx" not in [p["name"] for p in entry["inputs"]]
        assert entry["kv_reorder"] == {"read_values": len(entry["state_variables"]), "beam_idx_gathers": 0}
    ids = np.arange(1, 9, dtype=np.int64)[None]
    _, logits = _hf_reference(hf, ids)
    out = _chain_run(sessions, ids, return_last=8)
    np.testing.assert_allclose(out, logits, rtol=RTOL, atol=ATOL)
    import openvino as ov

    model = ov.Core().read_model(export / manifest["stages"][0]["model"])
    assert kv_reorder_report(model)["beam_idx_gathers"] == 0
