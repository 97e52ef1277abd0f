"""Which drafted tokens the target keeps.

Greedy: the longest prefix of drafts equal to the target's own argmax at each position, then
the target's token after it, so the output is exactly target-only greedy decoding.

Sampling: the rejection-sampling correction (Leviathan et al. 2023; Chen et al. 2023). Draft
token d drawn from q is kept with probability min(1, p(d) / q(d)); the first rejected position
draws from the residual max(p - q, 0), renormalised; if every draft is kept, one more token is
drawn from the target's last row. Each emitted token then follows the target distribution p
exactly, whatever the draft proposes. A draft with no distribution (prompt lookup) is a point
mass: q(d) = 1.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np


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


def accept_sampled(
    drafts: Sequence[int],
    draft_probs: Sequence[np.ndarray] | None,
    target_rows: np.ndarray,
    probabilities: Callable[[np.ndarray], np.ndarray],
    rng: np.random.Generator,
) -> list[int]:
    """``target_rows`` are the target's logits [K + 1, vocab]; ``probabilities`` turns one row
    into the request's sampling distribution (temperature, top-k, top-p); ``draft_probs[i]`` is
    the distribution ``drafts[i]`` was drawn from (None: point masses)."""
    if target_rows.shape[0] != len(drafts) + 1:
        raise ValueError(f"need {len(drafts) + 1} target rows for {len(drafts)} drafts")
    kept: list[int] = []
    for i, draft in enumerate(drafts):
        p = probabilities(target_rows[i])
        q = None if draft_probs is None else draft_probs[i]
        q_draft = 1.0 if q is None else float(q[draft])
        if q_draft > 0.0 and rng.random() * q_draft < p[draft]:
            kept.append(int(draft))
            continue
        if q is None:
            residual = p.copy()
            residual[draft] = 0.0
        else:
            residual = np.maximum(p - q, 0.0)
        total = residual.sum()
        # p == q (nothing left over) cannot reject; guard rounding anyway.
        residual = p if total <= 0.0 else residual / total
        return [*kept, int(rng.choice(residual.size, p=residual))]
    last = probabilities(target_rows[len(drafts)])
    return [*kept, int(rng.choice(last.size, p=last))]
