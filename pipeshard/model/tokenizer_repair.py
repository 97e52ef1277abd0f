"""Rebuild the tokenizer transformers derives from the SmolLM2 GGUF into the one the model was trained with.

transformers reads the GGUF (tokenizer.ggml.model ``gpt2``, pre ``smollm``) into a Llama-style fast tokenizer
with three defects (see docs/MODEL.md): eos ``<|im_start|>``, a bos added to every encode (doubled by the chat
template), and a SentencePiece-style decoder (ByteFallback, Fuse, Replace) that openvino-tokenizers cannot
convert. It also drops the ``smollm`` digit split. The repair keeps the vocabulary, merges and added tokens
and replaces everything around them with the GPT-2 byte-level pipeline of the upstream SmolLM2 tokenizer.
"""

from __future__ import annotations

import json

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import GPT2TokenizerFast, PreTrainedTokenizerFast

BOS_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
UNK_TOKEN = "<|endoftext|>"
MODEL_MAX_LENGTH = 8192

# Upstream splits with Digits(individual_digits=True) and then the GPT-2 regex inside each piece, so a
# whitespace run stops at a digit as at the end of the text. This one regex does both at once: ``\p{N}``
# is a piece of its own and ``(?![^\s\p{N}])`` treats a following number like the end of the text.
# openvino-tokenizers fuses Digits + ByteLevel into the GPT-2 regex with ``(?!\S)``, which sees the digit,
# and then disagrees with transformers on "  1" or "a\n\n2"; it converts this pattern as written.
SMOLLM_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+"


def byte_level_backend(source: PreTrainedTokenizerFast) -> Tokenizer:
    """Byte-level BPE with ``source``'s vocabulary, merges and added tokens; nothing added at encode time."""
    bpe = json.loads(source.backend_tokenizer.to_str())["model"]
    merges = [tuple(m) for m in bpe["merges"]]
    backend = Tokenizer(models.BPE(vocab=bpe["vocab"], merges=merges, byte_fallback=False, fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SMOLLM_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    backend.add_special_tokens(
        [
            AddedToken(token.content, lstrip=False, rstrip=False, normalized=False, special=True)
            for _, token in sorted(source.added_tokens_decoder.items())
        ]
    )
    return backend


def repair_tokenizer(source: PreTrainedTokenizerFast) -> GPT2TokenizerFast:
    """Same ids as ``source`` (see docs/MODEL.md on digits), eos/pad ``<|im_end|>``, no automatic bos."""
    if source.chat_template is None:
        raise ValueError("the source tokenizer carries no chat template")
    return GPT2TokenizerFast(
        tokenizer_object=byte_level_backend(source),
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        add_prefix_space=False,
        add_bos_token=False,
        clean_up_tokenization_spaces=False,
        model_max_length=MODEL_MAX_LENGTH,
        chat_template=source.chat_template,
    )
