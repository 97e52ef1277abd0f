"""An in-process ring's stages that record how each result came back (Top1, drawn, logits)."""

from __future__ import annotations

from pipeshard.services.coordinator.in_process import InProcessStages


class ResultSpy(InProcessStages):
    """Records each result's kind: ``top1``, ``sampled`` or ``logits``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.kinds: list[str] = []

    async def run(self, frames):
        results = await super().run(frames)
        for result in results:
            if isinstance(result, Exception):
                continue
            for kind in ("sampled", "logits", "top1"):
                if result.HasField(kind):
                    self.kinds.append(kind)
                    break
        return results
