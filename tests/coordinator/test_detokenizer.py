"""Streaming text never splits a UTF-8 character and honours stop strings."""

from __future__ import annotations

from pipeshard.services.coordinator.detokenizer import IncrementalDetokenizer, ids_decoder


class ByteTokenizer:
    """One token per byte: the harshest case for incremental decoding."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def stream(text: str, stop=()):
    detok = IncrementalDetokenizer(ByteTokenizer(), stop)
    deltas = []
    for b in text.encode():
        detok.add(b)
        deltas.append(detok.delta())
        if detok.stopped:
            break
    deltas.append(detok.delta(final=True))
    return deltas, detok


def test_multibyte_characters_are_never_split():
    text = "Grüße, 東京! 🙂 done"
    deltas, detok = stream(text)
    assert "".join(deltas) == text == detok.text
    assert all("\ufffd" not in d for d in deltas)


def test_stop_string_truncates_and_is_not_streamed():
    deltas, detok = stream("The answer is 42.\nUser: more", stop=("\nUser:",))
    assert detok.stopped
    assert "".join(deltas) == "The answer is 42."
    assert all("User" not in d for d in deltas)


def test_text_without_stop_is_streamed_in_full():
    deltas, detok = stream("abc def", stop=("zzz",))
    assert not detok.stopped and "".join(deltas) == "abc def"


def test_the_bundled_tokenizer_streams_what_its_own_decode_gives(smollm2_dir):
    """The Rust backend's decode (ids_decoder) streams exactly transformers' decode of every token,
    special tokens skipped, multi-byte characters whole."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert ids_decoder(tok).func == tok.backend_tokenizer.decode  # the fast path is taken
    text = "Grüße aus 東京 🙂!\n<|im_end|>def f(x):\n    return x  # ok"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    deltas = []
    for i in ids:
        detok.add(i)
        deltas.append(detok.delta())
    deltas.append(detok.delta(final=True))
    assert "".join(deltas) == detok.text == tok.decode(ids, skip_special_tokens=True)
    assert "<|im_end|>" not in detok.text and "東京 🙂" in detok.text
    assert all("\ufffd" not in d for d in deltas)


def test_a_resumed_stream_continues_the_text_as_if_undisturbed():
    """Another coordinator continues after the tokens a caller already has: it streams exactly
    what the undisturbed stream would have, the held-back tail and a stop string across the seam
    included."""
    text = "Grüße. The answer is 42.\nUser: more"
    stop = ("\nUser:",)
    for seam in range(1, len(text.encode()) - 8):
        detok = IncrementalDetokenizer(ByteTokenizer(), stop)
        streamed: list[str] = []
        data = text.encode()
        for b in data[:seam]:
            detok.add(b)
            streamed.append(detok.delta())
        resumed = IncrementalDetokenizer(ByteTokenizer(), stop, streamed=list(data[:seam]))
        for b in data[seam:]:
            resumed.add(b)
            streamed.append(resumed.delta())
            if resumed.stopped:
                break
        streamed.append(resumed.delta(final=True))
        assert "".join(streamed) == "Grüße. The answer is 42." == resumed.text, seam
