"""Turning a request into prompt ids: plain text as is (with the bos a tokenizer asks for, as
Gemma's does), chat messages through the chat template. A model without one (a base model such
as Gemma 3 270M) refuses messages: it continues raw text only, and a made-up chat format would
only look like an answer."""

from __future__ import annotations

from pathlib import Path

from pipeshard import allocator
from pipeshard.errors import InvalidArgument

_ROLES = ("system", "user", "assistant")


class Prompter:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.eos_ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()

    @classmethod
    def from_dir(cls, folder: Path) -> Prompter:
        """The folder's tokenizer. Parsing its tokenizer.json frees most of what it allocated, but
        malloc keeps those pages: about 200 MB for Gemma 3's (262,144 pieces, 513,511 merges), 15 MB
        for SmolLM2's. They are handed back, so a coordinator does not hold them for its lifetime."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder)
        allocator.trim()
        return cls(tokenizer)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def user_text(self, text: str) -> list[int]:
        """``text`` as a user sends it: one chat message, or plain text to continue on a base model
        (warm-ups and `generate --local` need no chat format to exist)."""
        return self.encode("", [("user", text)]) if self.has_chat_template else self.encode(text, [])

    @staticmethod
    def check_size(prompt: str, messages: list[tuple[str, str]], max_bytes: int) -> None:
        """Refuses a prompt over ``max_bytes`` of UTF-8 before any tokenizing work is spent on it."""
        field = "messages" if messages else "prompt"
        size = (
            sum(len(c.encode()) + len(r.encode()) for r, c in messages) if messages else len(prompt.encode())
        )
        if size > max_bytes:
            raise InvalidArgument(field, f"is {size} bytes, above the limit of {max_bytes} bytes")

    def encode(self, prompt: str, messages: list[tuple[str, str]]) -> list[int]:
        if prompt and messages:
            raise InvalidArgument("prompt", "and `messages` are exclusive: set exactly one")
        if messages:
            for i, (role, content) in enumerate(messages):
                if role not in _ROLES:
                    raise InvalidArgument(
                        f"messages[{i}].role", f"must be one of {', '.join(_ROLES)}, got {role!r}"
                    )
                if not content:
                    raise InvalidArgument(f"messages[{i}].content", "must not be empty")
            if not self.has_chat_template:
                raise InvalidArgument(
                    "messages",
                    "cannot be used with this model: it has no chat template (a base model); "
                    "send `prompt` with the text to continue",
                )
            chat = [{"role": r, "content": c} for r, c in messages]
            return list(self.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True))
        if not prompt:
            raise InvalidArgument("prompt", "must not be empty (or send `messages`)")
        # The tokenizer's own post-processor decides: SmolLM2's adds nothing, Gemma's a bos.
        return list(self.tokenizer.encode(prompt, add_special_tokens=True))
