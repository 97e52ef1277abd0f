"""Uneven layer ranges (what a plan asks for) export exactly like even ones.

Tiny fp32 models: every stage boundary of an uneven split matches Hugging Face, prefill and
decode (the tolerance of test_exporter_parity). SmolLM2 fp32 (slow): a 3-stage chain split
0:4,4:23,23:30 decodes the 8 prompts token for token as HF greedy.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeshard.exporter.export import export_model
from pipeshard.shard.chain import LocalChain
from pipeshard.shard.manifest import load_manifest
from pipeshard.shard.runtime import ShardRunner

RTOL = ATOL = 1e-4
PREFILL, DECODE = 7, 6


@pytest.mark.parametrize(
    ("family", "split"), [("llama", "0:1,1:4"), ("qwen2", "0:3,3:4"), ("mistral", "0:1,1:3,3:4")]
)
def test_uneven_split_matches_hf_at_every_boundary(family, split, tiny_model, tmp_path):
    folder, hf = tiny_model(family)
    out = tmp_path / "export"
    export_model(
        folder,
        out,
        split=split,
        weights="fp32",
        isolate=False,
        convert_tokenizer=False,
        progress=lambda e: None,
    )
    manifest = load_manifest(out).to_dict()
    assert ",".join(f"{s['layer_start']}:{s['layer_end']}" for s in manifest["stages"]) == split
    sessions = [ShardRunner(out, i, precision="f32").new_session() for i in range(manifest["num_stages"])]
    ids = np.random.default_rng(3).integers(0, 256, size=(1, PREFILL + DECODE), dtype=np.int64)
    with torch.no_grad():
        ref = hf(torch.from_numpy(ids), output_hidden_states=True)
    steps = [(0, PREFILL)] + [(t, t + 1) for t in range(PREFILL, PREFILL + DECODE)]
    for a, b in steps:
        x = ids[:, a:b]
        for entry, session in zip(manifest["stages"], sessions, strict=True):
            x = session.run(x, np.arange(a, b)[None], return_last=b - a)
            last = entry["layer_end"] == manifest["model"]["num_layers"]
            want = ref.logits[:, a:b] if last else ref.hidden_states[entry["layer_end"]][:, a:b]
            np.testing.assert_allclose(
                x, want.numpy(), rtol=RTOL, atol=ATOL, err_msg=f"stage {entry['index']} [{a},{b})"
            )


@pytest.mark.slow
@pytest.mark.extended
def test_uneven_smollm2_chain_equals_hf_greedy(smollm2_dir, hf_model, chat_prompt_ids, tmp_path_factory):
    out = tmp_path_factory.mktemp("uneven") / "smollm2-uneven-fp32"
    export_model(
        smollm2_dir,
        out,
        split="0:4,4:23,23:30",
        weights="fp32",
        isolate=False,  # saves three process start-ups
        convert_tokenizer=False,
        progress=lambda e: None,
    )
    chain = LocalChain(out, precision="f32")
    for i, ids in enumerate(chat_prompt_ids):
        got = chain.generate_greedy(ids, 64, ignore_eos=True).token_ids
        with torch.no_grad():  # one forward over prompt + continuation: its argmaxes are HF greedy
            logits = hf_model(torch.tensor([ids + got[:-1]])).logits[0, len(ids) - 1 :]
        assert got == logits.argmax(-1).tolist(), f"prompt {i}"
