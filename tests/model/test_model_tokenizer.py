"""The repaired tokenizer against the GGUF tokenizer, openvino-tokenizers and the model itself."""

from __future__ import annotations

import random
import unicodedata

import pytest

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "What is the capital of France?"}]

CORPUS = [
    "Hello world",
    "The capital of France is Paris.",
    "Café, naïve, façade, Ångström, résumé, Straße, Øre, Ελληνικά, русский",
    "日本語のテキストと中文字符，한국어도 있어요。",
    "一二三 百 千 are letters, not digits",
    "12345 and 3.14159, 1,000,000 or 2024-05-17T12:34:56Z",
    "x  = 10;  y   =  2;    42",
    "a\n\n2\t\t3\r\n\r\n7",
    "tabs\tand\nnewlines\r\n\tindented\n\n\n",
    "     many spaces     then text     ",
    "def f(x):\n    return x ** 2  # square\n\n\nprint(f(12))\n",
    "if (a && b) { return arr[i] != null; } // 0x1F",
    "Emoji: 😀🚀👍🏽 👨‍👩‍👧‍👦 ❤️",
    "Mixed: naïve café costs €3.50 (≈ ¥500) — ok? ½ ² ٣ ⅷ",
    "<|im_start|>user\nHi<|im_end|>\n",
    "",
    " ",
    "I'm sure they'll say it's fine; we've done it, you'd agree. DON'T",
    "URL https://example.com/a?b=1&c=2#frag",
    "\u00a0non-breaking\u2009thin\u3000ideographic spaces",
    "zero\u200bwidth and combining e\u0301 vs é",
]

# Characters that exercise the pre-tokenizer's edges: whitespace kinds, ASCII and other numbers,
# contractions, multi-byte letters, emoji, punctuation and the chat special tokens.
ALPHABET = [
    *"  \t\n\r\u00a0\u3000",
    *"0123456789½²٣ⅷ①",
    *"abcXYZ'sltdmvre",
    *'é日本한😀.,;:=-_()[]{}"#$%&',
    "<|im_start|>",
    "<|im_end|>",
]


def random_strings(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choices(ALPHABET, k=rng.randint(1, 24))) for _ in range(count)]


def is_number(char: str) -> bool:
    """Unicode category N*, the test Rust's ``char::is_numeric`` and llama.cpp's ``\\p{N}`` apply."""
    return unicodedata.category(char).startswith("N")


def split_digits(text: str) -> list[str]:
    """Isolate every numeric character, as the `smollm` pre-tokenizer's first step does."""
    pieces, current = [], ""
    for char in text:
        if is_number(char):
            pieces += [current, char] if current else [char]
            current = ""
        else:
            current += char
    return [*pieces, current] if current else pieces


def gguf_reader_diverges(text: str) -> bool:
    """Where the missing digit split changes the GGUF tokenizer's ids (see docs/MODEL.md).

    A whitespace run before a number: ``\\s+(?!\\S)`` sees the number and leaves one space for `` ?\\p{N}+``.
    A number outside ASCII: its UTF-8 bytes merge with a preceding space or a following number.
    """
    return any(
        is_number(char) and (not char.isascii() or (i >= 2 and text[i - 2 : i].isspace()))
        for i, char in enumerate(text)
    )


def digits_then_byte_level(tokenizer):
    """The upstream pre-tokenizer as written in its tokenizer.json, around the repaired vocabulary."""
    from tokenizers import Tokenizer, pre_tokenizers

    reference = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    reference.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    return reference


def test_special_tokens(tokenizer) -> None:
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<|im_end|>", 2)
    assert (tokenizer.bos_token, tokenizer.bos_token_id) == ("<|im_start|>", 1)
    assert tokenizer("<|im_start|><|im_end|>").input_ids == [1, 2]
    assert tokenizer("Hello").input_ids == tokenizer("Hello", add_special_tokens=False).input_ids


def test_chat_prompt_has_a_single_leading_bos(tokenizer) -> None:
    ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    text = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert ids[0] == 1 and ids[1] != 1
    # Servers render the template and then encode with special tokens on: the GGUF tokenizer doubles bos here.
    assert tokenizer(text).input_ids == ids
    assert ids.count(1) == text.count("<|im_start|>") == 3  # system, user, assistant turns
    assert text.endswith("<|im_start|>assistant\n")


def test_ids_equal_gguf_tokenizer(tokenizer, gguf_tokenizer) -> None:
    compared = [text for text in CORPUS if not gguf_reader_diverges(text)]
    assert len(compared) >= 15
    for text in compared:
        expected = gguf_tokenizer(text, add_special_tokens=False).input_ids
        assert tokenizer(text, add_special_tokens=False).input_ids == expected, text


def test_ids_equal_gguf_tokenizer_after_digit_split(tokenizer, gguf_tokenizer) -> None:
    """On every string, including those where transformers' GGUF reader lacks the `smollm` digit split."""
    for text in CORPUS:
        expected = [
            i
            for piece in split_digits(text)
            for i in gguf_tokenizer(piece, add_special_tokens=False).input_ids
        ]
        assert tokenizer(text, add_special_tokens=False).input_ids == expected, text


def test_pre_tokenizer_equals_digits_then_byte_level(tokenizer) -> None:
    reference = digits_then_byte_level(tokenizer)
    for text in CORPUS + random_strings(3000):
        assert tokenizer(text).input_ids == reference.encode(text).ids, repr(text)


def test_numbers_are_split_like_upstream(tokenizer) -> None:
    """llama.cpp's `smollm` pre-tokenizer and the upstream tokenizer.json agree on these."""
    tokens = {
        text: tokenizer.convert_ids_to_tokens(tokenizer(text).input_ids) for text in ["  1", "a\n\n2", " ½"]
    }
    assert tokens == {"  1": ["ĠĠ", "1"], "a\n\n2": ["a", "ĊĊ", "2"], " ½": ["Ġ", "Â½"]}


def test_decode_round_trips(tokenizer, gguf_tokenizer) -> None:
    for text in CORPUS:
        assert tokenizer.decode(tokenizer(text).input_ids) == text
        assert tokenizer.decode(gguf_tokenizer(text, add_special_tokens=False).input_ids) == text


def test_openvino_tokenizer_and_detokenizer_match(tokenizer) -> None:
    import numpy as np
    import openvino as ov
    from openvino_tokenizers import convert_tokenizer

    ov_tokenizer, ov_detokenizer = convert_tokenizer(tokenizer, with_detokenizer=True)
    core = ov.Core()
    encode, decode = core.compile_model(ov_tokenizer, "CPU"), core.compile_model(ov_detokenizer, "CPU")
    chat = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    for text in [chat, *CORPUS, *random_strings(300, seed=1)]:
        ids = tokenizer(text).input_ids
        assert encode([text])["input_ids"][0].tolist() == ids, repr(text)
        if ids:
            ov_text = decode(np.array([ids], dtype=np.int64))["string_output"][0]
            assert ov_text == tokenizer.decode(ids, skip_special_tokens=True), repr(text)


def test_greedy_generation_answers_and_stops(tokenizer, hf_model) -> None:
    import torch

    prompt = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt")
    with torch.inference_mode():
        out = hf_model.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24, do_sample=False
        )
    new = out[0, prompt.shape[1] :].tolist()
    assert new[-1] == 2 and 2 not in new[:-1], new
    assert "Paris" in tokenizer.decode(new, skip_special_tokens=True)
