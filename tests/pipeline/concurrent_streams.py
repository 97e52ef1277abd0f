"""Concurrent greedy streams through a coordinator, each told when it has tokens out: how the
fault tests land a kill mid-stream under several users and compare every stream after."""

from __future__ import annotations

import threading
from collections.abc import Callable

from pipeshard.clients.client import PipeshardClient


def stream_tokens(
    client: PipeshardClient,
    prompt: str,
    tokens: int,
    on_out: Callable[[], object] | None = None,
    after: int = 0,
) -> list[int]:
    """A stream's token ids (eos ignored), calling ``on_out`` once ``after`` of them are out."""
    out: list[int] = []
    for chunk in client.stream(prompt, max_tokens=tokens, ignore_eos=True):
        out.extend(chunk.token_ids)
        if on_out is not None and len(out) >= after:
            on_out()
            on_out = None
    return out


def concurrently(
    address: str, prompts: list[str], tokens: int, on_out: Callable[[], object] | None = None, after: int = 0
) -> tuple[list[list[int]], list[BaseException]]:
    """Every prompt streamed at once, one thread each: their tokens, and what any raised."""
    results: list[list[int]] = [[] for _ in prompts]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            with PipeshardClient(address, timeout_s=300) as client:
                results[i] = stream_tokens(client, prompts[i], tokens, on_out, after)
        except BaseException as exc:  # recorded: the test asserts there were none
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    return results, errors
