"""`pipeshard plan --max-stage-memory`: placements within the limit, or a refusal naming the stage."""

from __future__ import annotations

import pytest

from pipeshard.errors import InvalidArgument
from pipeshard.planning.cost import Curve, ModelCost
from pipeshard.planning.dp import plan_layers, plan_within
from pipeshard.planning.nodes import Node
from pipeshard.sizes import parse_bytes

MODEL = ModelCost(
    num_layers=8, hidden_size=64, layer_bytes=100, embed_bytes=300, head_bytes=300, kv_bytes_per_token=0
)


def _nodes(count: int, ms: float = 1.0) -> list[Node]:
    return [Node(f"n{k}", "", Curve.constant(ms * (k + 1)), 10_000) for k in range(count)]


def test_limit_moves_layers_off_the_fast_node():
    free = plan_layers(_nodes(2), MODEL)  # the first node is faster: it takes everything
    assert max(s.memory_bytes for s in free.stages) > 700
    capped = plan_within(_nodes(2), MODEL, max_stage_memory=700)
    assert len(capped.stages) == 2
    assert all(s.memory_bytes <= 700 for s in capped.stages)


def test_refusal_names_the_stage_and_its_estimate():
    with pytest.raises(InvalidArgument) as err:
        plan_within(_nodes(2), MODEL, max_stage_memory=500)
    message = str(err.value)
    assert err.value.field == "max_stage_memory"
    assert "stage 0 (layers 0:" in message and "on n0" in message
    assert f"{plan_layers(_nodes(2), MODEL).stages[0].memory_bytes / 2**30:.2f} GiB" in message


@pytest.mark.parametrize(
    ("text", "value"), [("6G", 6 * 2**30), ("512MiB", 512 * 2**20), ("1500", 1500), ("1.5k", 1536)]
)
def test_byte_sizes(text, value):
    assert parse_bytes(text, "x") == value


@pytest.mark.parametrize("text", ["", "six", "-1G", "0"])
def test_bad_byte_sizes_name_the_field(text):
    with pytest.raises(InvalidArgument, match="max_stage_memory"):
        parse_bytes(text, "max_stage_memory")
