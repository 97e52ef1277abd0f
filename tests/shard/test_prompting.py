"""Prompt ids: plain text gets what the tokenizer's post-processor adds (nothing for SmolLM2, a bos
for Gemma 3), and messages need a chat template (a base model refuses them by name)."""

from __future__ import annotations

import copy
import platform
import subprocess
import sys

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


# In a fresh process: the RSS a malloc_trim still releases after Prompter.from_dir (the tokenizer's
# parse leaves its freed pages with malloc unless from_dir hands them back: 15 MB for SmolLM2's).
_LEFT_TO_TRIM = """
import sys, transformers
from pipeshard import allocator
from pipeshard.shard.prompting import Prompter

def rss():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("RssAnon")) * 1024

allocator.trim()
prompter = Prompter.from_dir(sys.argv[1])
before = rss()
allocator.trim()
print(before - rss())
"""


@pytest.mark.slow
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc_trim only")
def test_loading_the_tokenizer_leaves_no_freed_heap_resident(smollm2_dir):
    out = subprocess.run(
        [sys.executable, "-c", _LEFT_TO_TRIM, str(smollm2_dir)], capture_output=True, text=True, check=True
    )
    assert int(out.stdout.split()[-1]) < 4 << 20
