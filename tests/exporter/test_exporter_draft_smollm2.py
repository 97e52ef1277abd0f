"""A SmolLM2 self-draft (2 layers, 4096-token head) against HF transformers cut to 2 layers."""

from __future__ import annotations

import numpy as np
import pytest

from pipeshard.shard.drafts import check_same_tokenizer
from pipeshard.shard.manifest import verify_export
from pipeshard.shard.runtime import ShardRunner

pytestmark = [pytest.mark.slow, pytest.mark.extended]


def test_smollm2_draft_matches_truncated_hf(
    smollm2_dir, smollm2_draft, smollm2_export, chat_prompt_ids, tmp_path
):
    """fp32 draft, f32 hints: logits at the kept ids equal HF's 2-layer model's, prefill and decode."""
    import torch
    from transformers import AutoModelForCausalLM

    from pipeshard.exporter.truncate import truncate_model

    export = smollm2_draft(2, 4096, "fp32")
    m = verify_export(export).to_dict()
    assert m["draft"] == {"layers": 2, "vocab_ids": "stage_0/draft_vocab_ids.npy", "source_layers": 30}
    runner = ShardRunner(export, 0, precision="f32")
    # Token ids are in BPE merge order in this tokenizer, and the 17 specials (eos 2) are ids 0..16.
    assert runner.vocab_ids.tolist() == list(range(4096))
    check_same_tokenizer(smollm2_export(1, "fp32"), export)

    hf = AutoModelForCausalLM.from_pretrained(truncate_model(smollm2_dir, tmp_path / "hf2", 2)).eval()
    prompt = chat_prompt_ids[2]
    ids = np.asarray([[*prompt, 504, 3575, 282, 4649, 314]], dtype=np.int64)
    with torch.no_grad():
        ref = hf(torch.from_numpy(ids)).logits.numpy()[..., runner.vocab_ids]
    session = runner.new_session()
    n = len(prompt)
    got = [session.run(ids[:, :n], return_last=n)]
    got += [session.run(ids[:, t : t + 1]) for t in range(n, ids.shape[1])]
    np.testing.assert_allclose(np.concatenate(got, axis=1), ref, rtol=1e-4, atol=2e-3)
