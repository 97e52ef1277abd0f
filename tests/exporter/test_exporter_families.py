"""Qwen3 (QK-norm), Phi-3 (fused qkv and gate-up), Gemma 3 (four norms, scaled embedding,
local layers with a 4-token window, so a 33-token sequence is mostly outside it) and Qwen3-MoE
(routed experts, the sparse form) as families: tiny fp32 exports at 2 stages give Hugging Face's
greedy token ids over a whole sequence and its teacher-forced logits within
|ov - hf| <= 1e-4 + 1e-4 * |hf|; at 1 stage, and on the paged backend (prefill whole and in
chunks), in `make test-extended`."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeshard.shard.chain import LocalChain
from pipeshard.shard.paged import PagedRow, PagedShard

FAMILIES = ("qwen3", "phi3", "gemma3_text", "qwen3_moe")
RTOL = ATOL = 1e-4
PROMPT, NEW_TOKENS = 9, 24


def _prompt() -> np.ndarray:
    return np.random.default_rng(52).integers(0, 256, size=PROMPT, dtype=np.int64)


def _hf_greedy(hf, prompt: np.ndarray, n: int) -> list[int]:
    ids = torch.from_numpy(prompt)[None]
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            token = int(hf(ids).logits[0, -1].argmax())
            out.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out


@pytest.mark.parametrize(
    "stages", [pytest.param(1, marks=pytest.mark.extended), 2, pytest.param(3, marks=pytest.mark.extended)]
)
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_and_teacher_forced_logits_match_hf(family, stages, tiny_model, tiny_export):
    _, hf = tiny_model(family)
    export = tiny_export(family, stages)
    prompt = _prompt()
    want = _hf_greedy(hf, prompt, NEW_TOKENS)
    chain = LocalChain(export, "f32", 1)
    assert chain.generate_greedy(prompt, NEW_TOKENS, ignore_eos=True).token_ids == want

    # Teacher forcing over the whole sequence: the prompt, then HF's tokens one decode step each.
    sequence = np.concatenate([prompt, np.array(want[:-1], dtype=np.int64)])[None]
    with torch.no_grad():
        ref = hf(torch.from_numpy(sequence)).logits.numpy()
    chain.reset()
    got = [chain.step(sequence[:, :PROMPT], return_last=PROMPT)]
    got += [chain.step(sequence[:, t : t + 1]) for t in range(PROMPT, sequence.shape[1])]
    np.testing.assert_allclose(np.concatenate(got, axis=1), ref, rtol=RTOL, atol=ATOL)


@pytest.mark.extended
@pytest.mark.parametrize("family", FAMILIES)
def test_paged_backend_greedy_matches_hf(family, tiny_model, tiny_export):
    """Two sequences sharing every step, the second prefilled in chunks of 4, at 2 stages."""
    _, hf = tiny_model(family)
    export = tiny_export(family, 2)
    prompts = [_prompt(), _prompt()[::-1].copy()]
    want = [_hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    shards = [PagedShard(export, s, "f32", 1, cache_bytes=4 << 20) for s in (0, 1)]
    for seq, p in enumerate(prompts):
        for shard in shards:
            shard.open(seq, len(p) + NEW_TOKENS)
    pending = {0: [prompts[0]], 1: [prompts[1][i : i + 4] for i in range(0, PROMPT, 4)]}
    out: dict[int, list[int]] = {0: [], 1: []}
    while any(len(v) < NEW_TOKENS for v in out.values()):
        seqs = [s for s in pending if len(out[s]) < NEW_TOKENS]
        chunks = {s: pending[s].pop(0) for s in seqs}
        last = {s: not pending[s] for s in seqs}
        hidden = shards[0].step([PagedRow(s, chunks[s]) for s in seqs])
        logits = shards[1].step(
            [PagedRow(s, h, logits=int(last[s])) for s, h in zip(seqs, hidden, strict=True)]
        )
        for s, lg in zip(seqs, logits, strict=True):
            if last[s]:
                out[s].append(int(lg[-1].argmax()))
                pending[s] = [np.array([out[s][-1]], dtype=np.int64)]
    assert [out[0], out[1]] == want


def test_fused_tensors_are_split_by_rows(tiny_model):
    """Phi-3's qkv_proj and gate_up_proj reach the stage module as HF's own q/k/v and gate/up."""
    from pipeshard.exporter.families import load_config, resolve_spec
    from pipeshard.exporter.weights import load_stage_weights

    folder, hf = tiny_model("phi3")
    spec = resolve_spec(load_config(folder))
    weights = load_stage_weights(folder, spec, 0, 1)
    attn, mlp = hf.model.layers[0].self_attn, hf.model.layers[0].mlp
    q = spec.num_heads * spec.head_dim
    kv = spec.num_kv_heads * spec.head_dim
    qkv = attn.qkv_proj.weight.detach()
    assert torch.equal(weights["layers.0.self_attn.q_proj.weight"], qkv[:q])
    assert torch.equal(weights["layers.0.self_attn.k_proj.weight"], qkv[q : q + kv])
    assert torch.equal(weights["layers.0.self_attn.v_proj.weight"], qkv[q + kv :])
    gate_up = mlp.gate_up_proj.weight.detach()
    assert torch.equal(weights["layers.0.mlp.gate_proj.weight"], gate_up[: spec.intermediate_size])
    assert torch.equal(weights["layers.0.mlp.up_proj.weight"], gate_up[spec.intermediate_size :])


def _verify_greedy(
    chain: LocalChain, prompt: np.ndarray, want: list[int], k: int = 3
) -> tuple[list[int], int, int]:
    """Greedy with k-token drafts verified in one step each, rejected drafts masked out of the cache
    (the speculative rewind). Drafts are the reference continuation with one token spoiled at a
    rotating place, so steps accept some drafts and reject the rest; returns the tokens and the
    drafts accepted and rejected."""
    chain.reset()
    out = [int(chain.step(prompt[None])[0, -1].argmax())]
    accepted = rejected = 0
    while len(out) < len(want):
        n = len(out)
        draft = [*want[n : n + k], *[0] * k][:k]
        spoil = n % (k + 1)
        if spoil < k:
            draft[spoil] = (draft[spoil] + 1) % 256
        start, valid = chain.past_length, chain.sessions[0].valid_length
        positions = np.arange(valid, valid + 1 + k, dtype=np.int64)[None]
        logits = chain.step(np.array([[out[-1], *draft]]), positions, return_last=1 + k)
        greedy = logits[0].argmax(-1).tolist()
        a = 0
        while a < k and draft[a] == greedy[a]:
            a += 1
        out += greedy[: a + 1]
        accepted, rejected = accepted + a, rejected + k - a
        chain.invalidate(start + 1 + a, start + 1 + k)
    return out[: len(want)], accepted, rejected


@pytest.mark.extended
@pytest.mark.parametrize("stages", [1, 3])
@pytest.mark.parametrize("family", ["gemma3_text", "qwen3_moe"])
def test_speculative_rewind_and_prefix_restore_give_the_plain_greedy(family, stages, tiny_model, tiny_export):
    """Local layers' windows count only valid cache entries, so drafts rejected and masked out
    leave HF's greedy tokens; a prompt prefix restored from another chain's KV (the prefix cache's
    capture and restore) continues to the same tokens."""
    from pipeshard.shard.runtime import export_kv, import_kv

    _, hf = tiny_model(family)
    export = tiny_export(family, stages)
    prompt = _prompt()
    want = _hf_greedy(hf, prompt, NEW_TOKENS)
    chain = LocalChain(export, "f32", 1)
    got, accepted, rejected = _verify_greedy(chain, prompt, want)
    assert got == want
    assert accepted > 0 and rejected > 0

    chain.reset()
    chain.step(prompt[None, :6])
    blobs = [export_kv(s) for s in chain.sessions]
    warm = LocalChain(export, "f32", 1)
    for session, blob in zip(warm.sessions, blobs, strict=True):
        import_kv(session, blob)
    logits = warm.step(prompt[None, 6:])
    out = [int(logits[0, -1].argmax())]
    for _ in range(NEW_TOKENS - 1):
        out.append(int(warm.step(np.array([[out[-1]]]))[0, -1].argmax()))
    assert out == want
