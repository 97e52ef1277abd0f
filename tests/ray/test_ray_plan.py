"""A one-node Ray cluster: the planner's placement from Ray's resources, and the refusal of a model
that fits no set of the nodes (naming what it needs and the largest node). The multi-node fleet
tests are `make test-ray` (test_ray_fleet.py)."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install -e '.[ray]' (make setup does)")

from pipeshard.errors import InvalidArgument  # noqa: E402
from pipeshard.planning.cli import model_cost  # noqa: E402
from pipeshard.services.raycluster.members import members  # noqa: E402
from pipeshard.services.raycluster.placement import plan_fleet  # noqa: E402
from pipeshard.sizes import gib  # noqa: E402

GIB = 2**30


@pytest.fixture(scope="module")
def one_node():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "memory": 3 * GIB})
    ray.init(address=cluster.address, namespace="pipeshard-test")
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_one_node_takes_the_whole_model_and_a_model_too_big_is_refused_by_name(one_node, smollm2_dir):
    (node,) = members()
    assert node.memory_bytes == 3 * GIB and node.device == "CPU" and node.is_head
    fp = plan_fleet([node], smollm2_dir, "int4", profile=False)
    cost = model_cost(smollm2_dir, "int4", None)
    assert fp.plan.ranges == f"0:{cost.num_layers}"
    assert [s.node for s in fp.plan.stages] == [node.name]
    assert fp.stage_memory == [cost.stage_bytes(0, cost.num_layers, 1)]
    # the same node offering less than the model needs: refused, with both figures
    small = type(node)(node.node_id, node.ip, cost.stage_bytes(0, cost.num_layers, 1) // 3, "CPU", True)
    with pytest.raises(InvalidArgument) as err:
        plan_fleet([small], smollm2_dir, "int4", profile=False)
    assert err.value.field == "nodes"
    need, offered = gib(cost.stage_bytes(0, cost.num_layers, 1)), gib(small.memory_bytes)
    assert f"needs {need}" in str(err.value) and f"largest node offers {offered}" in str(err.value)
    with pytest.raises(InvalidArgument, match="largest node offers"):
        plan_fleet([small], smollm2_dir, "int4", stages=2, profile=False)
