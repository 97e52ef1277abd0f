"""Gemma 3's tokenizer rebuilt from its GGUF: the SentencePiece BPE the model was trained with.

transformers reads the GGUF (``tokenizer.ggml.model`` ``llama``: pieces, scores, token types) into
a Unigram model over the scores, which splits text into far more pieces than the model saw ("The
capital of France is" becomes 10 pieces, not 5), and it keeps only 4 of the 6,249 control tokens
as special. The GGUF's own tokenizer (llama.cpp's SPM) merges adjacent pieces by score, highest
first; BPE merges ranked by the merged piece's score do the same. So the repair keeps the pieces
and ids and builds: merges from the scores, byte fallback for characters no piece has, spaces as
``▁`` with no prefix space (``add_space_prefix`` false), a bos added in front, control tokens
special and user-defined tokens (newline and tab runs, image markers) matched whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors
from transformers import GemmaTokenizerFast

NORMAL, CONTROL, USER_DEFINED, BYTE = 1, 3, 4, 6
SPACE = "\u2581"
MODEL_MAX_LENGTH = 32768


@dataclass(frozen=True)
class GgufVocab:
    """The tokenizer fields of a GGUF (``tokenizer.ggml.*``)."""

    pieces: list[str]
    scores: list[float]
    types: list[int]
    bos_id: int
    eos_id: int
    unk_id: int
    pad_id: int

    @classmethod
    def read(cls, gguf: Path) -> GgufVocab:
        from gguf import GGUFReader

        fields = GGUFReader(str(gguf)).fields

        def values(name: str) -> list:
            field = fields[name]
            return [field.parts[i] for i in field.data]

        def scalar(name: str) -> int:
            return int(values(name)[0][0])

        return cls(
            pieces=[bytes(p).decode("utf-8") for p in values("tokenizer.ggml.tokens")],
            scores=[float(s[0]) for s in values("tokenizer.ggml.scores")],
            types=[int(t[0]) for t in values("tokenizer.ggml.token_type")],
            bos_id=scalar("tokenizer.ggml.bos_token_id"),
            eos_id=scalar("tokenizer.ggml.eos_token_id"),
            unk_id=scalar("tokenizer.ggml.unknown_token_id"),
            pad_id=scalar("tokenizer.ggml.padding_token_id"),
        )


def bpe_merges(vocab: GgufVocab) -> list[tuple[str, str]]:
    """Every split of a normal piece into two normal pieces, ranked by the piece's score."""
    ids = {p: i for i, (p, t) in enumerate(zip(vocab.pieces, vocab.types, strict=True)) if t == NORMAL}
    ranked = []
    for piece, i in ids.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                ranked.append((-vocab.scores[i], ids[left], ids[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def gemma3_tokenizer(vocab: GgufVocab) -> GemmaTokenizerFast:
    """The repaired tokenizer: same ids as the GGUF, its SPM segmentation, bos in front."""
    pieces = {p: i for i, p in enumerate(vocab.pieces)}
    unk = vocab.pieces[vocab.unk_id]
    backend = Tokenizer(
        models.BPE(vocab=pieces, merges=bpe_merges(vocab), unk_token=unk, byte_fallback=True, fuse_unk=True)
    )
    backend.normalizer = normalizers.Replace(" ", SPACE)
    backend.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    bos = vocab.pieces[vocab.bos_id]
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab.bos_id)]
    )
    added = [
        AddedToken(p, normalized=SPACE in p, special=t == CONTROL, lstrip=False, rstrip=False)
        for p, t in zip(vocab.pieces, vocab.types, strict=True)
        if t in (CONTROL, USER_DEFINED)
    ]
    backend.add_tokens(added)
    return GemmaTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token=vocab.pieces[vocab.eos_id],
        unk_token=unk,
        pad_token=vocab.pieces[vocab.pad_id],
        add_bos_token=True,
        clean_up_tokenization_spaces=False,
        model_max_length=MODEL_MAX_LENGTH,
    )


def spm_reference(vocab: GgufVocab, text: str) -> list[int]:
    """The GGUF's own segmentation, written from its definition (tests compare the repair with
    it): user-defined and control pieces whole, then in each run between them the adjacent pair
    whose concatenation is the best-scored piece merges first; characters no piece has become
    their UTF-8 bytes' pieces. Quadratic: for short texts."""
    pieces = {p: i for i, (p, t) in enumerate(zip(vocab.pieces, vocab.types, strict=True)) if t == NORMAL}
    whole = sorted(
        (p for p, t in zip(vocab.pieces, vocab.types, strict=True) if t in (CONTROL, USER_DEFINED)),
        key=len,
        reverse=True,
    )
    ids = {p: i for i, p in enumerate(vocab.pieces)}
    out: list[int] = []
    run = ""
    i = 0
    while i < len(text):
        match = next((w for w in whole if text.startswith(w, i)), None)
        if match is None:
            run += text[i]
            i += 1
            continue
        out += _spm_run(vocab, pieces, ids, run)
        out.append(ids[match])
        run = ""
        i += len(match)
    return out + _spm_run(vocab, pieces, ids, run)


def _spm_run(vocab: GgufVocab, pieces: dict[str, int], ids: dict[str, int], text: str) -> list[int]:
    symbols = list(text.replace(" ", SPACE))
    while True:
        best = None
        for k in range(len(symbols) - 1):
            merged = symbols[k] + symbols[k + 1]
            if merged in pieces and (best is None or vocab.scores[pieces[merged]] > best[0]):
                best = (vocab.scores[pieces[merged]], k)
        if best is None:
            break
        k = best[1]
        symbols[k : k + 2] = [symbols[k] + symbols[k + 1]]
    out = []
    for s in symbols:
        if s in pieces:
            out.append(pieces[s])
        else:
            out += [ids[f"<0x{b:02X}>"] for b in s.encode("utf-8")]
    return out
