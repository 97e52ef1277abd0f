"""Prompt ids: plain text gets what the tokenizer's post-processor adds (nothing for SmolLM2, a bos
for Gemma 3), and messages need a chat template (a base model refuses them by name)."""

from __future__ import annotations

import copy

import pytest

from pipeshard.errors import InvalidArgument
from pipeshard.shard.prompting import Prompter


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def test_plain_text_ids_are_the_tokenizers_own(tokenizer):
    text = "Hello there, 42 times"
    assert Prompter(tokenizer).encode(text, []) == tokenizer.encode(text, add_special_tokens=False)


def test_messages_without_a_chat_template_are_refused_naming_the_field(tokenizer):
    base = copy.deepcopy(tokenizer)
    base.chat_template = None
    assert Prompter(tokenizer).encode("", [("user", "hi")])  # with its template: fine
    with pytest.raises(InvalidArgument) as err:
        Prompter(base).encode("", [("user", "hi")])
    assert err.value.field == "messages" and "no chat template" in str(err.value)
    assert Prompter(base).encode("hi", [])  # plain text still served
