"""All N shards of an export in one process: the reference for the distributed pipeline.

``generate_greedy`` prefills the prompt through every stage, then decodes one token per step.
Timing: ``ttft_s`` is from the call to the first generated token (prefill through the whole
chain plus argmax); ``tok_s`` is decode throughput after the first token,
``(completion_tokens - 1) / (time of last token - time of first token)``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import openvino as ov

from pipeshard.errors import InvalidArgument
from pipeshard.shard.manifest import load_manifest
from pipeshard.shard.runtime import ShardRunner, ShardSession


@dataclass
class GreedyResult:
    token_ids: list[int]
    finish_reason: str  # "stop" (an eos id was generated) or "length"
    prompt_tokens: int
    ttft_s: float
    decode_s: float
    total_s: float
    step_s: list[float] = field(default_factory=list)
    # With ``top2_margins``: top-1 minus top-2 logit at every generated token (near-ties are small).
    margins: list[float] = field(default_factory=list)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tok_s(self) -> float:
        n = self.completion_tokens - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0


class LocalChain:
    """Every stage of an export compiled in this process, one session each."""

    def __init__(
        self,
        export_dir: Path | str,
        precision: str = "default",
        num_threads: int | None = None,
        *,
        verify: bool = True,
    ):
        self.export_dir = Path(export_dir)
        self.manifest = load_manifest(self.export_dir)
        core = ov.Core()
        self.runners = [
            ShardRunner(self.export_dir, i, precision, num_threads, verify=verify, core=core)
            for i in range(self.manifest["num_stages"])
        ]
        self.sessions: list[ShardSession] = [r.new_session() for r in self.runners]
        self.eos_ids = list(self.manifest["model"].get("eos_token_ids", []))
        self._vocab_ids = self.runners[-1].vocab_ids  # a draft's head slice: column -> token id
        self.max_context = self.manifest["max_context"]

    @property
    def past_length(self) -> int:
        return self.sessions[0].past_length

    def reset(self) -> None:
        for s in self.sessions:
            s.reset()

    def warmup(self, prefill: int = 8, decode: int = 2) -> None:
        """A throwaway generation so the first real request does not pay for kernel preparation."""
        self.generate_greedy([0] * prefill, decode + 1, ignore_eos=True)
        self.reset()

    def invalidate(self, start: int, end: int) -> None:
        for s in self.sessions:
            s.invalidate(start, end)

    def step(
        self, ids: np.ndarray, position_ids: np.ndarray | None = None, return_last: int = 1
    ) -> np.ndarray:
        """Run ids [1, T] through every stage; returns logits [1, return_last, vocab] (a copy)."""
        x = np.asarray(ids, dtype=np.int64).reshape(1, -1)
        if position_ids is None:
            v = self.sessions[0].valid_length
            position_ids = np.arange(v, v + x.shape[1], dtype=np.int64).reshape(1, -1)
        last = len(self.sessions) - 1
        for i, s in enumerate(self.sessions):
            x = s.run(x, position_ids, return_last, copy=i == last)
        return x

    def _argmax(self, logits: np.ndarray) -> int:
        i = int(np.argmax(logits))
        return i if self._vocab_ids is None else int(self._vocab_ids[i])

    def generate_greedy(
        self,
        prompt_ids: Sequence[int] | np.ndarray,
        max_new_tokens: int,
        eos_ids: Sequence[int] | None = None,
        ignore_eos: bool = False,
        on_token: Callable[[int], object] | None = None,
        top2_margins: bool = False,
    ) -> GreedyResult:
        """Greedy decode from a fresh cache; ``eos_ids`` defaults to the manifest's."""
        prompt = np.asarray(prompt_ids, dtype=np.int64).reshape(1, -1)
        n_prompt = prompt.shape[1]
        if n_prompt == 0:
            raise InvalidArgument("prompt", "must contain at least one token")
        if n_prompt >= self.max_context:
            raise InvalidArgument(
                "prompt", f"has {n_prompt} tokens; this export's max_context is {self.max_context}"
            )
        if max_new_tokens < 1:
            raise InvalidArgument("max_tokens", f"must be at least 1, got {max_new_tokens}")
        stop = set(self.eos_ids if eos_ids is None else eos_ids)
        budget = min(max_new_tokens, self.max_context - n_prompt + 1)
        self.reset()

        t0 = time.perf_counter()
        logits = self.step(prompt)
        token = self._argmax(logits[0, -1])
        t_first = time.perf_counter()
        tokens, steps, margins = [token], [], []
        if top2_margins:
            margins.append(_margin(logits[0, -1]))
        if on_token:
            on_token(token)
        finish = "stop" if (token in stop and not ignore_eos) else "length"
        ids = np.zeros((1, 1), dtype=np.int64)
        pos = np.zeros((1, 1), dtype=np.int64)
        while finish != "stop" and len(tokens) < budget:
            ts = time.perf_counter()
            ids[0, 0] = token
            pos[0, 0] = self.sessions[0].valid_length
            x = ids
            for s in self.sessions:
                x = s.run(x, pos, 1, copy=False)
            token = self._argmax(x[0, -1])
            if top2_margins:
                margins.append(_margin(x[0, -1]))
            tokens.append(token)
            steps.append(time.perf_counter() - ts)
            if on_token:
                on_token(token)
            if token in stop and not ignore_eos:
                finish = "stop"
        t_end = time.perf_counter()
        return GreedyResult(
            token_ids=tokens,
            finish_reason=finish,
            prompt_tokens=n_prompt,
            ttft_s=t_first - t0,
            decode_s=t_end - t_first,
            total_s=t_end - t0,
            step_s=steps,
            margins=margins,
        )


def _margin(logits: np.ndarray) -> float:
    top2 = np.partition(logits, -2)[-2:]
    return float(top2[1] - top2[0])
