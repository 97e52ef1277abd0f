"""SmolLM2-135M-Instruct through in-process chains of 1, 2 and 3 shards."""

from __future__ import annotations

import json

import pytest

from pipeshard.shard.chain import LocalChain

pytestmark = pytest.mark.slow

TOKENS = 64
NEAR_TIE = 0.5  # top-1 minus top-2 logit at a divergence between INT4 chains


def _first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


@pytest.fixture(scope="module")
def hf_greedy_check(hf_model):
    """Checks a continuation against HF transformers greedy: one fp32 forward over prompt + continuation,
    whose argmax at every position must be the next generated token. By induction that is exactly
    HF greedy decoding (eos not suppressed) without paying for 8 x 64 decode steps in torch."""
    import torch

    def check(prompt: list[int], generated: list[int]) -> float:
        seq = torch.tensor([prompt + generated[:-1]])
        with torch.no_grad():
            logits = hf_model(seq).logits[0, len(prompt) - 1 :]
        want = logits.argmax(-1).tolist()
        d = _first_diff(generated, want)
        assert d is None, f"first difference at token {d}: ov {generated[d]}, hf {want[d]}"
        top2 = logits.topk(2, dim=-1).values
        return float((top2[:, 0] - top2[:, 1]).min())

    return check


@pytest.mark.parametrize(
    "stages", [pytest.param(1, marks=pytest.mark.extended), 2, pytest.param(3, marks=pytest.mark.extended)]
)
def test_fp32_chain_matches_hf_greedy(stages, smollm2_export, chat_prompt_ids, hf_greedy_check):
    """fp32 shards, f32 inference and KV cache: token for token what HF transformers greedy decodes."""
    chain = LocalChain(smollm2_export(stages, "fp32"), precision="f32")
    margins = []
    for i, ids in enumerate(chat_prompt_ids):
        got = chain.generate_greedy(ids, TOKENS, ignore_eos=True).token_ids
        assert len(got) == TOKENS
        try:
            margins.append(hf_greedy_check(ids, got))
        except AssertionError as exc:
            raise AssertionError(f"prompt {i}: {exc}") from None
    print(f"{stages} stages: smallest HF top-2 margin along the 8 continuations {min(margins):.4f}")


def test_fp32_chain_matches_hf_generate(smollm2_export, chat_prompt_ids, hf_model):
    """One prompt against HF's own generate() (stops at eos <|im_end|>, like the chain)."""
    import torch

    ids = chat_prompt_ids[0]
    chain = LocalChain(smollm2_export(1, "fp32"), precision="f32")
    got = chain.generate_greedy(ids, TOKENS, eos_ids=[2])
    with torch.no_grad():
        ref = hf_model.generate(
            torch.tensor([ids]), do_sample=False, max_new_tokens=TOKENS, eos_token_id=2, pad_token_id=2
        )
    assert got.token_ids == ref[0, len(ids) :].tolist()
    assert got.finish_reason == "stop"


@pytest.mark.extended
def test_int4_chains_agree_or_near_tie(smollm2_export, chat_prompt_ids):
    """INT4 at `fast` (bf16 inference, u8 KV cache): 1, 2 and 3 stages decode the same tokens, or
    diverge only where the top-2 logits are nearly tied."""
    results = {}
    for stages in (1, 2, 3):
        chain = LocalChain(smollm2_export(stages, "int4"), precision="fast")
        results[stages] = [
            chain.generate_greedy(ids, TOKENS, ignore_eos=True, top2_margins=True) for ids in chat_prompt_ids
        ]
        del chain
    report = []
    for stages in (2, 3):
        for p, (ref, other) in enumerate(zip(results[1], results[stages], strict=True)):
            d = _first_diff(ref.token_ids, other.token_ids)
            if d is None:
                continue
            margin = min(ref.margins[d], other.margins[d])
            report.append((stages, p, d, margin))
            print(f"{stages} stages, prompt {p}: diverges at token {d}, top-2 margin {margin:.3f}")
    identical = 16 - len(report)
    print(f"{identical}/16 INT4 continuations identical to the 1-stage chain")
    for stages, p, d, margin in report:
        assert margin < NEAR_TIE, (
            f"{stages} stages, prompt {p}: diverged at token {d} with margin {margin:.3f}"
        )


def test_generate_cli_json(smollm2_export, capsys):
    from pipeshard.cli import build_parser

    parser = build_parser()
    export = smollm2_export(2, "int4")
    args = parser.parse_args(
        ["generate", "--local", str(export), "--max-tokens", "24", "--json", "What is the capital of France?"]
    )
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) >= {
        "text",
        "token_ids",
        "finish_reason",
        "prompt_tokens",
        "completion_tokens",
        "ttft_ms",
        "tok_s",
    }
    assert out["finish_reason"] in ("stop", "length")
    assert out["completion_tokens"] == len(out["token_ids"]) <= 24
    assert "Paris" in out["text"]
    assert out["prompt_tokens"] > 10 and out["ttft_ms"] > 0

    args = parser.parse_args(
        ["generate", "--local", str(export), "--max-tokens", "8", "--ignore-eos", "--json", "Hi"]
    )
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["completion_tokens"] == 8 and out["finish_reason"] == "length"
    assert out["kept_per_traversal"] == [7]  # without speculation each step after the first keeps one
