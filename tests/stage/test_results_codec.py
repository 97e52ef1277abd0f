"""The results link (final stage -> coordinator): logits are compressed by the same per-link
choice as every other hop, from the return link the coordinator measured, and arrive exact."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from pipeshard.errors import InvalidArgument
from pipeshard.link_model import CodecChooser
from pipeshard.services.stage.domain import ReturnMode, RowKind, Step, StepOutput, StepRow
from pipeshard.services.stage.node import StageNode
from pipeshard.services.stage.sessions import SessionTable
from pipeshard.services.stage.wire import frame_from_step
from pipeshard.tensor_codec import Codec, decode

VOCAB = 49152


class _NoKv:
    """A session without a cache (the fake engine computes nothing)."""

    def reset(self) -> None:
        pass


class FinalEngine:
    """The final stage's engine, reduced to what StageNode asks of it: logits for every row."""

    is_first = False
    is_last = True
    hidden_size = 576

    def __init__(self, logits: np.ndarray):
        self.logits = logits
        self.sessions = SessionTable(_NoKv, max_sessions=4, idle_timeout_s=60.0)

    def open(self, owner: str, session_id: str, capacity: int | None = None) -> None:
        self.sessions.open(owner, session_id)

    def run_step(self, step):
        return [StepOutput(row=row, logits=self.logits) for row in step.rows]


def _frame(owner: str, session: str = "s"):
    """The frame the previous stage sends: one position's hidden state, logits asked for."""
    hidden = np.zeros((1, 1, 576), dtype=np.float32)
    row = StepRow(
        session_id=session,
        step_id=1,
        kind=RowKind.DECODE,
        positions=np.arange(1),
        activations=hidden,
        return_mode=ReturnMode.LOGITS,
    )
    return frame_from_step(Step([row], owner))


def _result_codec(mode: str, bandwidth_bytes_s: float | None) -> tuple[int, np.ndarray, np.ndarray]:
    # Logits-like values: a few bits of exponent entropy, so the lane codecs have something to take.
    logits = (np.random.default_rng(0).standard_normal((1, VOCAB)) * 3).astype(np.float32)
    # Sizes are measured on the logits; CPU time on a fake clock (1 us per call), so a loaded
    # machine cannot flip the choice.
    ticks = iter(range(10**6))
    chooser = CodecChooser(mode, None, clock=lambda: next(ticks) * 1e-6)
    node = StageNode(FinalEngine(logits), 1, codec=chooser)

    async def run():
        subscription = node.results.subscribe("owner-a", "sub")
        node.open_session("owner-a", "s", None, "")  # a frame for no open session is refused unread
        if bandwidth_bytes_s is not None:
            node.note_results_link("owner-a", bandwidth_bytes_s)
        assert await node.handle(_frame("owner-a")) is None
        (result,) = await subscription.get()
        return result

    result = asyncio.run(run())
    return result.logits.codec, decode(result.logits, field="logits"), logits


def test_auto_compresses_logits_on_a_slow_return_link_and_they_arrive_exact():
    codec, back, logits = _result_codec("auto", 2.5e6)  # 20 Mbit/s
    assert codec != Codec.CODEC_NONE
    assert back.tobytes() == logits.tobytes()


@pytest.mark.parametrize("bandwidth", [None, 5e9])
def test_auto_leaves_logits_raw_when_the_return_link_is_fast_or_unmeasured(bandwidth):
    codec, back, logits = _result_codec("auto", bandwidth)
    assert codec == Codec.CODEC_NONE
    assert back.tobytes() == logits.tobytes()


def test_a_fixed_codec_applies_to_the_results_link_too():
    codec, back, logits = _result_codec("lane_blocks_zstd", None)
    assert codec == Codec.CODEC_LANE_BLOCKS_ZSTD
    assert back.tobytes() == logits.tobytes()


@pytest.mark.parametrize("bandwidth", [float("nan"), float("inf"), -1.0])
def test_a_nonsense_return_link_measurement_names_its_field(bandwidth):
    node = StageNode(FinalEngine(np.zeros((1, 4), np.float32)), 1)
    with pytest.raises(InvalidArgument, match="`results_link_bandwidth_bytes_per_second`"):
        node.note_results_link("owner-a", bandwidth)


async def _logits_codec(node: StageNode, subscription, session: str) -> int:
    """The codec of the logits ``node`` returns for one step of ``session`` (they arrive exact)."""
    frame = _frame("owner-a", session)
    assert await node.handle(frame) is None
    (result,) = await subscription.get()
    assert decode(result.logits, field="logits").tobytes() == node.engine.logits.tobytes()
    return result.logits.codec


def _final_node(stage_mode: str) -> tuple[StageNode, object]:
    """A final stage whose own ``--codec`` is ``stage_mode``, and owner-a's results subscription."""
    logits = (np.random.default_rng(0).standard_normal((1, VOCAB)) * 3).astype(np.float32)
    node = StageNode(FinalEngine(logits), 1, codec=CodecChooser(stage_mode, None))
    return node, node.results.subscribe("owner-a", "sub")


def _session_codecs(stage_mode: str, session_modes: dict[str, str]) -> dict[str, int]:
    """Each session's logits codec on one final stage whose own ``--codec`` is ``stage_mode``."""

    async def run():
        node, subscription = _final_node(stage_mode)
        out = {}
        for session, mode in session_modes.items():
            node.open_session("owner-a", session, None, mode)
            out[session] = await _logits_codec(node, subscription, session)
        return out

    return asyncio.run(run())


def test_each_session_sends_with_the_codec_it_asked_for():
    codecs = _session_codecs("none", {"off": "none", "on": "lane_blocks_zstd", "default": ""})
    assert codecs == {
        "off": Codec.CODEC_NONE,
        "on": Codec.CODEC_LANE_BLOCKS_ZSTD,
        "default": Codec.CODEC_NONE,  # the stage's own --codec
    }
    # And the other way round: a session may turn off what the stage turns on.
    assert _session_codecs("lane_blocks_zstd", {"off": "none", "default": ""}) == {
        "off": Codec.CODEC_NONE,
        "default": Codec.CODEC_LANE_BLOCKS_ZSTD,
    }


def test_a_session_codec_lives_and_dies_with_its_session():
    async def run():
        node, subscription = _final_node("none")
        node.open_session("owner-a", "s", None, "lane_blocks_zstd")
        assert await _logits_codec(node, subscription, "s") == Codec.CODEC_LANE_BLOCKS_ZSTD
        assert node.engine.sessions.release("owner-a", "s")
        node.open_session("owner-a", "s", None, "")  # the same id again, asking nothing
        assert await _logits_codec(node, subscription, "s") == Codec.CODEC_NONE
        node.open_session("owner-a", "t", None, "lane_blocks_zstd")
        assert node.engine.sessions.reap_idle(now=time.monotonic() + 3600) == ["s", "t"]
        node.open_session("owner-a", "t", None, "")
        assert await _logits_codec(node, subscription, "t") == Codec.CODEC_NONE

    asyncio.run(run())


@pytest.mark.parametrize("mode", ["gzip", "AUTO", "on"])
def test_an_unknown_session_codec_names_its_field_and_opens_nothing(mode):
    node = StageNode(FinalEngine(np.zeros((1, 4), np.float32)), 1)
    with pytest.raises(InvalidArgument, match="`codec`"):
        node.open_session("owner-a", "s", None, mode)
    assert len(node.engine.sessions) == 0


def test_a_session_asking_quantum_over_a_narrow_wire_is_refused():
    node = StageNode(FinalEngine(np.zeros((1, 4), np.float32)), 1, wire_dtype="bf16")
    with pytest.raises(InvalidArgument, match=r"`codec` quantum_zstd takes fp32 .* not --wire-dtype bf16"):
        node.open_session("owner-a", "s", None, "quantum_zstd")
