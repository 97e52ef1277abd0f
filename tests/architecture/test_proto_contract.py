"""The wire contract: messages round-trip, and every field and value carries a comment."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from pipeshard.tensor_codec import Codec, decode, encode
from pipeshard.v1 import activation_pb2, coordinator_pb2, kv_pb2, tensor_pb2

PROTO_DIR = Path(__file__).resolve().parents[2] / "proto" / "pipeshard" / "v1"


def test_activation_frame_round_trip():
    hidden = np.linspace(-3, 3, 2 * 576, dtype=np.float32).reshape(1, 2, 576)
    frame = activation_pb2.ActivationFrame(
        session_id="s-1",
        step_id=7,
        positions=[12, 13],
        tensors=[tensor_pb2.NamedTensor(name="hidden_states", tensor=encode(hidden, Codec.CODEC_ZSTD))],
        plan=activation_pb2.PlanFrame(
            rows=[
                activation_pb2.PlanRow(
                    slot_id=-1,
                    position=12,
                    tokens=2,
                    kind=activation_pb2.ROW_KIND_VERIFY,
                    mask_update=activation_pb2.MaskUpdate(
                        invalidate=[activation_pb2.CacheRange(start=9, end=11)]
                    ),
                    return_mode=activation_pb2.RETURN_MODE_TOP1,
                    return_last=2,
                )
            ]
        ),
    )
    back = activation_pb2.ActivationFrame.FromString(frame.SerializeToString())
    assert back == frame
    assert back.plan.rows[0].slot_id == -1 and back.plan.rows[0].kind == activation_pb2.ROW_KIND_VERIFY
    np.testing.assert_array_equal(decode(back.tensors[0].tensor), hidden)


def test_generate_request_seed_presence_is_tracked():
    req = coordinator_pb2.GenerateRequest(prompt="hi", params=coordinator_pb2.SamplingParams(max_tokens=3))
    assert not req.params.HasField("seed")
    req.params.seed = 0
    back = coordinator_pb2.GenerateRequest.FromString(req.SerializeToString())
    assert back.params.HasField("seed") and back.params.seed == 0


def test_kv_snapshot_round_trip():
    snap = kv_pb2.KvSnapshot(stage_index=1, model_fingerprint="abc", token_ids=[1, 2, 3])
    snap.states.add(name="past_key_values.0.key", tensor=encode(np.zeros((1, 3, 3, 64), np.float32)))
    assert kv_pb2.KvSnapshot.FromString(snap.SerializeToString()) == snap


def test_every_field_and_enum_value_is_commented():
    declaration = re.compile(r"^\s*(?:optional |repeated )?[\w.]+ \w+ = \d+;|^\s*[A-Z0-9_]+ = \d+;")
    missing, checked = [], 0
    for path in sorted(PROTO_DIR.glob("*.proto")):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if not declaration.match(line):
                continue
            checked += 1
            if not lines[i - 1].strip().startswith("//"):
                missing.append(f"{path.name}:{i + 1}: {line.strip()}")
    assert checked > 100, f"the pattern found only {checked} declarations"
    assert not missing, "uncommented declarations:\n" + "\n".join(missing)
