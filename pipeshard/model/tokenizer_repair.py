"""Rebuild the tokenizer transformers derives from the SmolLM2 GGUF into the one the model was trained with.

transformers reads the GGUF (tokenizer.ggml.model ``gpt2``, pre ``smollm``) into a Llama-style fast tokenizer
with three defects (see docs/MODEL.md): eos ``<|im_start|>``, a bos added to every encode (doubled by the chat
template), and a SentencePiece-style decoder (ByteFallback, Fuse, Replace) that openvino-tokenizers cannot
convert. It also drops the ``smollm`` digit split. The repair keeps the vocabulary, merges and added tokens
and replaces everything around them with the GPT-2 byte-level pipeline of the upstream SmolLM2 tokenizer.
"""

from __future__ import annotations

import json

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import GPT2TokenizerFast, PreTrainedTokenizerFast

BOS_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
UNK_TOKEN = "<|endoftext|>"
MODEL_MAX_LENGTH = 8192


def byte_level_backend(source: PreTrainedTokenizerFast) -> Tokenizer:
    """A byte-level BPE with ``source``'s vocabulary, merges and added tokens; nothing added at encode time."""
    bpe = json.loads(source.backend_tokenizer.to_str())["model"]
    merges = [tuple(m) for m in bpe["merges"]]
    backend = Tokenizer(models.BPE(vocab=bpe["vocab"], merges=merges, byte_fallback=False, fuse_unk=False))
    # Individual digits first, as llama.cpp's `smollm` pre-tokenizer and the upstream tokenizer.json do.
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    backend.add_special_tokens(
        [
            AddedToken(token.content, single_word=False, lstrip=False, rstrip=False, normalized=False, special=True)
            for _, token in sorted(source.added_tokens_decoder.items())
        ]
    )
    return backend


def repair_tokenizer(source: PreTrainedTokenizerFast) -> GPT2TokenizerFast:
    """The repaired tokenizer: same ids as ``source`` (digit runs aside), eos/pad ``<|im_end|>``, no auto bos."""
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
