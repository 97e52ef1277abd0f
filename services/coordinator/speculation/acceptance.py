"""Which drafted tokens the target keeps.

Greedy: the longest prefix of drafts equal to the target's own argmax at each position, then
the target's token after it, so the output is exactly target-only greedy decoding.

Sampling: the rejection-sampling correction, ``pipeshard.sampling.accept_sampled`` (shared
with the final stage, which runs it under RETURN_MODE_SAMPLED).
"""

from __future__ import annotations

from collections.abc import Sequence


def accept_greedy(drafts: Sequence[int], target_top1: Sequence[int]) -> list[int]:
    """``target_top1[i]`` is the target's argmax after the context plus ``drafts[:i]``
    (K + 1 entries). Returns the kept drafts followed by the target's own next token."""
    if len(target_top1) != len(drafts) + 1:
        raise ValueError(f"need {len(drafts) + 1} target tokens for {len(drafts)} drafts")
    kept: list[int] = []
    for draft, target in zip(drafts, target_top1, strict=False):
        if draft != target:
            break
        kept.append(draft)
    return [*kept, int(target_top1[len(kept)])]
