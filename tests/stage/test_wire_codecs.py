"""What a stage sends on: the codec and the (lossy, opt-in) wire dtype of its hidden states."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pipeshard.errors import InvalidArgument
from pipeshard.services.stage.domain import RowKind, Step, StepOutput, StepRow
from pipeshard.services.stage.main import StageSettings, build_node
from pipeshard.services.stage.wire import frame_from_outputs, step_from_frame
from pipeshard.tensor_codec import Codec


def _frame(hidden: np.ndarray, *args):
    row = StepRow(session_id="s", step_id=3, kind=RowKind.PREFILL, positions=np.arange(2), activations=hidden)
    return frame_from_outputs(Step([row]), [StepOutput(row=row, hidden_states=hidden)], *args)


@pytest.mark.parametrize("codec", [Codec.CODEC_NONE, Codec.CODEC_LANE_BLOCKS_ZSTD])
def test_fp32_wire_is_exact(codec):
    hidden = (np.random.default_rng(0).standard_normal((1, 2, 576)) * 4).astype(np.float32)
    frame = _frame(hidden, codec)
    assert frame.tensors[0].tensor.codec == codec
    assert step_from_frame(frame, "hidden_states").rows[0].activations.tobytes() == hidden.tobytes()


@pytest.mark.parametrize(("wire_dtype", "rtol"), [("fp16", 2**-11), ("bf16", 2**-8)])
def test_narrow_wire_halves_the_bytes_and_arrives_as_float32(wire_dtype, rtol):
    hidden = (np.random.default_rng(1).standard_normal((1, 2, 576)) * 4).astype(np.float32)
    frame = _frame(hidden, Codec.CODEC_NONE, wire_dtype)
    assert len(frame.tensors[0].tensor.data) == hidden.nbytes // 2
    back = step_from_frame(frame, "hidden_states").rows[0].activations
    assert back.dtype == np.float32 and back.shape == hidden.shape
    np.testing.assert_allclose(back, hidden, rtol=rtol, atol=1e-6)
    assert back.tobytes() != hidden.tobytes()  # lossy


def test_quantum_codec_with_a_narrow_wire_dtype_is_refused_at_start():
    settings = StageSettings(shards=Path("unused"), codec="quantum_zstd", wire_dtype="fp16")
    with pytest.raises(InvalidArgument, match="`codec` quantum_zstd takes fp32"):
        build_node(settings)
