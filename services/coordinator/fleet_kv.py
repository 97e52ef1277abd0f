"""What the fleet's KV backend lets this coordinator do, asked of the stages (GetStageInfo).

The coordinator is not told ``paged``: each stage reports its backend and what follows from it
(services/stage/backends.py ``Traits``): whether a plan frame's rows run as one inference,
whether a rewind truncates, whether a row may reuse a kept prefix, how a draft tree travels and
the most tokens a row may carry. The ring and the decode loop are built from that answer. A
fleet whose stages run different backends cannot run one plan frame, so it is refused at start,
naming the stages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipeshard.errors import FailedPrecondition, InvalidArgument
from pipeshard.v1 import stage_pb2

AUTO = "auto"


@dataclass(frozen=True)
class FleetKv:
    """The stages' one KV backend, as the coordinator uses it."""

    backend: str  # its name (logs, and the --kv check)
    batches_steps: bool  # every running session's step in one plan frame
    truncates_on_rewind: bool  # a rewind shortens the cache: the cursor keeps no holes
    prefix_reuse: bool  # rows may continue after a kept prefix of their cache
    tree_form: int  # stage_pb2.DraftTreeForm: how a draft tree travels (unspecified: none)
    row_tokens: int  # the most tokens one row may carry (0: no limit beyond max_context)

    @classmethod
    def of(cls, info: stage_pb2.GetStageInfoResponse) -> FleetKv:
        """One stage's answer."""
        return cls(
            backend=info.kv_backend,
            batches_steps=info.batches_steps,
            truncates_on_rewind=info.truncates_on_rewind,
            prefix_reuse=info.prefix_reuse,
            tree_form=info.draft_tree_form,
            row_tokens=info.static_chunk,
        )

    @classmethod
    def agreed(cls, wanted: str, infos: Sequence[stage_pb2.GetStageInfoResponse]) -> FleetKv:
        """The backend every stage runs. Refuses a fleet of different backends (naming each
        stage's) and a ``--kv`` the stages do not run (naming ``kv``)."""
        if not infos:
            raise FailedPrecondition("the fleet has no stages to ask for their KV backend")
        answers = [cls.of(info) for info in infos]
        if any(a != answers[0] for a in answers[1:]):
            runs = ", ".join(
                f"stage {info.stage_index} runs {a.backend or 'an unnamed backend'}"
                + ("" if a.backend != answers[0].backend else f" ({a.describe()})")
                for info, a in zip(infos, answers, strict=True)
            )
            raise FailedPrecondition(
                f"the stages run different KV backends ({runs}): start every stage with the same --kv"
            )
        fleet = answers[0]
        if wanted not in (AUTO, fleet.backend):
            raise InvalidArgument(
                "kv", f"is {wanted} but the stages run {fleet.backend} (--kv auto follows them)"
            )
        return fleet

    @property
    def verifies_trees(self) -> bool:
        """The stages take a draft tree in one row (chains or parents); else requests draft chains."""
        return self.tree_form != stage_pb2.DRAFT_TREE_FORM_UNSPECIFIED

    def describe(self) -> str:
        """The traits in a few words (what a refusal names when two stages differ only there)."""
        form = stage_pb2.DraftTreeForm.Name(self.tree_form)
        return (
            f"batches_steps={self.batches_steps}, truncates_on_rewind={self.truncates_on_rewind}, "
            f"prefix_reuse={self.prefix_reuse}, tree_form={form}, row_tokens={self.row_tokens}"
        )
