"""One row's answer from the final stage, read once from its ``StepResult`` into a typed value.

Acceptance, logprobs and the drafters read this, never the protobuf: which fields an answer
carries (the argmax ids, tokens drawn on the final stage, logits, features, draft heads' candidates)
is decided here, and each tensor is decoded (and checked) once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeshard.errors import Internal
from pipeshard.services.stage.wire import head_candidates
from pipeshard.shard.draft_heads import HeadCandidates
from pipeshard.tensor_codec import decode
from pipeshard.v1 import activation_pb2


@dataclass(frozen=True)
class Drawn:
    """Tokens drawn on the final stage with the request's generator, and that generator's state
    after the draws (the coordinator continues from it)."""

    token_ids: list[int]
    rng_state: bytes


@dataclass(frozen=True)
class StepAnswer:
    """``top1``: each returned row's argmax id (greedy rows), with its probability when asked;
    ``drawn``: tokens drawn on the final stage (sampled rows); ``logits``: the returned rows'
    logits (rows the coordinator chooses from); ``features``: the final hidden state per row
    (feature drafts); ``heads``: the draft heads' candidates (None when absent or malformed)."""

    top1: list[int]
    top1_probabilities: list[float]
    drawn: Drawn | None = None
    logits: np.ndarray | None = None
    features: np.ndarray | None = None
    heads: HeadCandidates | None = None

    def rows(self) -> np.ndarray:
        """The logits of the returned rows (a row the coordinator chooses from must carry them)."""
        if self.logits is None:
            raise Internal("the final stage returned no logits for a row that needs them")
        return self.logits


def read_answer(result: activation_pb2.StepResult) -> StepAnswer:
    """The typed answer of one row's ``StepResult`` (its tensors decoded and checked here)."""
    drawn = None
    if result.HasField("sampled"):
        drawn = Drawn(list(result.sampled.token_ids), result.sampled.rng_state)
    return StepAnswer(
        top1=list(result.top1.token_ids),
        top1_probabilities=list(result.top1.probabilities),
        drawn=drawn,
        logits=decode(result.logits, field="logits") if result.HasField("logits") else None,
        features=decode(result.features, field="features") if result.HasField("features") else None,
        heads=head_candidates(result),
    )
