"""Stage 0 hosted inside the coordinator process (``--host-stage0``): one network hop fewer.

The ring talks to it through the same two surfaces it uses for a remote stage: ``send`` for
frames (run inline on the event loop like any stage, output forwarded to stage 1 over its hop stream) and
a stub-like object whose control methods call the stage servicer directly.
"""

from __future__ import annotations

from pipeshard.services.stage.node import StageNode
from pipeshard.services.stage.servicer import StageServicer


class LocalEntry:
    """Stands where the HopStream to stage 0 would be."""

    def __init__(self, node: StageNode):
        self.node = node

    def start(self) -> None:
        """Dials the hosted stage 0's next hop now, so its link is probed while nothing computes."""
        for hop in self.node.next_hops:
            hop.start()

    async def send(self, frame) -> None:
        await self.node.handle(frame)  # failures travel the ring as error frames

    async def close(self) -> None:
        await self.node.close()


class _LocalContext:
    """The part of a servicer context the stage servicer reads: the caller's metadata."""

    def __init__(self, metadata):
        self._metadata = tuple(metadata or ())

    def invocation_metadata(self):
        return self._metadata


class LocalStageStub:
    """Answers the unary control calls of StageService in-process (same protos, no network)."""

    def __init__(self, servicer: StageServicer):
        self._servicer = servicer

    def __getattr__(self, method: str):
        handler = getattr(self._servicer, method)

        async def call(request, timeout=None, wait_for_ready=None, metadata=None):
            return await handler(request, _LocalContext(metadata))

        return call
