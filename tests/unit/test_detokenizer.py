"""Streaming text never splits a UTF-8 character and honours stop strings."""

from __future__ import annotations

from pipeshard.services.coordinator.detokenizer import IncrementalDetokenizer


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
