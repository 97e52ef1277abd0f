"""The DP planner against brute force on small random fleets, and its error messages."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeshard.errors import InvalidArgument
from pipeshard.planning.cost import Curve, Link, ModelCost
from pipeshard.planning.dp import micro_batch_counts, plan_layers, round_ms, stage_ms
from pipeshard.planning.nodes import Node


def _model(layers: int, **kw) -> ModelCost:
    base = dict(
        num_layers=layers,
        hidden_size=64,
        layer_bytes=100,
        embed_bytes=40,
        head_bytes=60,
        kv_bytes_per_token=1,
        context=10,
    )
    return ModelCost(**{**base, **kw})


def _compositions(total: int, parts: int):
    """Ordered ways to write ``total`` as ``parts`` positive integers."""
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield [(bounds[k], bounds[k + 1]) for k in range(parts)]


def _brute(nodes, model, objective, batch, counts=None):
    """Every subset of nodes in order, every split, every micro-batch count: the best round time."""
    best = math.inf
    counts = counts or ([1] if objective == "latency" else micro_batch_counts(batch))
    for m in counts:
        rows = batch // m
        for used in range(1, len(nodes) + 1):
            for subset in itertools.combinations(range(len(nodes)), used):
                for ranges in _compositions(model.num_layers, used):
                    if any(
                        model.stage_bytes(a, b, batch) > nodes[i].usable_bytes
                        for i, (a, b) in zip(subset, ranges, strict=True)
                    ):
                        continue
                    pairs = zip(subset, ranges, strict=True)
                    times = [stage_ms(nodes[i], model, a, b, rows) for i, (a, b) in pairs]
                    best = min(best, round_ms(times, m))
    return best


ms = st.floats(0.0, 10.0, allow_nan=False)
curve = st.one_of(
    ms.map(Curve.constant),
    st.tuples(ms, ms).map(lambda p: Curve(((1, p[0]), (4, p[0] + p[1])))),
)
link = st.builds(Link, mbit=st.sampled_from([math.inf, 0.5, 5.0, 100.0]), rtt_ms=st.floats(0.0, 20.0))
node = st.builds(
    Node,
    name=st.just("n"),
    address=st.just(""),
    per_layer_ms=curve,
    memory_bytes=st.integers(150, 2000),
    link_to_next=link,
    overhead_ms=curve,
    embed_ms=curve,
    head_ms=curve,
)


@settings(max_examples=150, deadline=None)
@given(
    nodes=st.lists(node, min_size=1, max_size=4),
    layers=st.integers(1, 7),
    objective=st.sampled_from(["latency", "throughput"]),
    batch=st.sampled_from([1, 2, 4, 6]),
)
def test_planner_equals_brute_force(nodes, layers, objective, batch):
    nodes = [Node(**{**n.__dict__, "name": f"n{i}"}) for i, n in enumerate(nodes)]
    model = _model(layers)
    batch = 1 if objective == "latency" else batch
    want = _brute(nodes, model, objective, batch)
    if math.isinf(want):
        with pytest.raises(InvalidArgument, match="memory constraint"):
            plan_layers(nodes, model, objective, batch)
        return
    plan = plan_layers(nodes, model, objective, batch)
    assert plan.round_ms == pytest.approx(want, rel=1e-9, abs=1e-9)
    # the plan is what it claims: contiguous, in node order, fits, and its times add up
    assert plan.stages[0].layer_start == 0 and plan.stages[-1].layer_end == layers
    order = [s.node for s in plan.stages]
    assert order == sorted(order, key=lambda name: int(name[1:]))
    by_name = {n.name: n for n in nodes}
    rows = batch // plan.micro_batches
    times = []
    for prev, s in zip((None, *plan.stages), plan.stages, strict=False):
        assert prev is None or prev.layer_end == s.layer_start
        assert s.memory_bytes <= by_name[s.node].usable_bytes
        times.append(stage_ms(by_name[s.node], model, s.layer_start, s.layer_end, rows))
        assert s.step_ms == pytest.approx(times[-1])
    assert round_ms(times, plan.micro_batches) == pytest.approx(plan.round_ms)
    assert set(plan.skipped) == {n.name for n in nodes} - set(order)


small = st.integers(0, 4).map(float).map(Curve.constant)
tied_node = st.builds(
    Node,
    name=st.just("n"),
    address=st.just(""),
    per_layer_ms=small,
    memory_bytes=st.integers(150, 1000),
    overhead_ms=small,
    head_ms=small,
)


@settings(max_examples=300, deadline=None)
@given(
    nodes=st.lists(tied_node, min_size=2, max_size=4),
    layers=st.integers(2, 6),
    m=st.sampled_from([2, 3, 4]),
)
def test_fixed_micro_batches_with_many_ties_equals_brute_force(nodes, layers, m):
    """Small integer times tie often: the search over the bottleneck bound must still be exact."""
    nodes = [Node(**{**n.__dict__, "name": f"n{i}"}) for i, n in enumerate(nodes)]
    model = _model(layers, kv_bytes_per_token=0)
    want = _brute(nodes, model, "throughput", m, counts=[m])
    if math.isinf(want):
        return
    plan = plan_layers(nodes, model, "throughput", batch=m, micro_batches=m)
    assert plan.micro_batches == m
    assert plan.round_ms == pytest.approx(want)


def _node(name, per_layer, memory=10**9, **kw):
    curve = Curve.constant(per_layer)
    return Node(name=name, address=f"{name}:1", per_layer_ms=curve, memory_bytes=memory, **kw)


def test_slow_node_gets_fewer_layers_and_useless_node_is_skipped():
    model = _model(30)
    nodes = [_node("fast", 1.0), _node("slow", 2.0), _node("useless", 100.0)]
    plan = plan_layers(nodes, model, "latency")
    assert plan.skipped == ("slow", "useless")  # one fast node alone: no hops, cheapest layers
    mem = model.stage_bytes(0, 12, 1)  # the fast node holds at most 12 layers with the embedding
    nodes = [_node("fast", 1.0, memory=mem), _node("slow", 2.0), _node("useless", 100.0)]
    plan = plan_layers(nodes, model, "latency")
    assert plan.split == [12, 18] and plan.skipped == ("useless",)
    assert plan.ranges == "0:12,12:30"
    assert plan.tok_s == pytest.approx(1000 / (12 * 1.0 + 18 * 2.0))


def test_throughput_balances_stages_and_picks_micro_batches():
    """Compute-bound rows (time grows with them): three nodes pipelining micro-batches beat one."""
    model = _model(12)
    linear = Curve(((1, 1.0), (6, 6.0)))
    nodes = [Node(name=k, address="", per_layer_ms=linear, memory_bytes=10**9) for k in "abc"]
    plan = plan_layers(nodes, model, "throughput", batch=6)
    assert plan.split == [4, 4, 4]
    assert plan.micro_batches in (3, 6)  # enough groups to keep every stage busy
    assert plan.round_ms == pytest.approx(24.0)
    assert plan.tok_s == pytest.approx(1000 * 6 / 24.0)
    alone = plan_layers(nodes[:1], model, "throughput", batch=6)
    assert alone.round_ms == pytest.approx(72.0) and alone.micro_batches == 1


@pytest.mark.parametrize(
    ("call", "field", "text"),
    [
        (lambda: plan_layers([], _model(4)), "nodes", "is empty"),
        (lambda: plan_layers([_node("a", 1.0, memory=50)], _model(4)), "nodes", "memory constraint"),
        (lambda: plan_layers([_node("a", 1.0)], _model(4), "fastest"), "objective", "latency, throughput"),
        (lambda: plan_layers([_node("a", 1.0)], _model(4), "throughput", batch=0), "batch", "positive"),
        (
            lambda: plan_layers([_node("a", 1.0)], _model(4), "throughput", batch=4, micro_batches=3),
            "micro_batches",
            "divide",
        ),
    ],
)
def test_bad_input_names_the_field(call, field, text):
    with pytest.raises(InvalidArgument, match=text) as info:
        call()
    assert info.value.field == field


def test_memory_error_says_when_total_would_fit_but_no_split_does():
    model = _model(2, layer_bytes=100, embed_bytes=0, head_bytes=0, kv_bytes_per_token=0)
    nodes = [_node("a", 1.0, memory=150), _node("b", 1.0, memory=50), _node("c", 1.0, memory=60)]
    with pytest.raises(InvalidArgument, match="no contiguous split fits"):
        plan_layers(nodes, model)


def _min_over_bounds(nodes, model, batch, m):
    """Reference for one m, independent of the planner's search: the least round time is the least
    over every stage time tau of max(S(tau), m * tau), S(tau) the least sum of plans whose stages
    all take <= tau (a plain Python recurrence per tau)."""
    layers, rows = model.num_layers, batch // m
    times = {
        (i, a, b): stage_ms(n, model, a, b, rows)
        for i, n in enumerate(nodes)
        for a in range(layers)
        for b in range(a + 1, layers + 1)
        if model.stage_bytes(a, b, batch) <= n.usable_bytes
    }
    best = math.inf
    for tau in set(times.values()):
        g = [math.inf] * layers + [0.0]  # g[a]: least sum from layer a with the nodes after i
        for i in reversed(range(len(nodes))):
            g = [
                min(
                    [g[a]]
                    + [
                        t + g[b]
                        for b in range(a + 1, layers + 1)
                        if (t := times.get((i, a, b), math.inf)) <= tau
                    ]
                )
                for a in range(layers)
            ] + [0.0]
        best = min(best, max(g[0], m * tau))
    return best


@settings(max_examples=40, deadline=None)
@given(
    nodes=st.lists(st.one_of(node, tied_node), min_size=2, max_size=4),
    layers=st.integers(8, 14),
    m=st.sampled_from([2, 3, 4, 8]),
)
def test_throughput_search_equals_every_bound_on_longer_models(nodes, layers, m):
    """More layers than brute force can enumerate: many candidate bounds for the search to skip."""
    nodes = [
        Node(**{**n.__dict__, "name": f"n{i}", "memory_bytes": n.memory_bytes * 4})
        for i, n in enumerate(nodes)
    ]
    model = _model(layers)
    want = _min_over_bounds(nodes, model, m, m)
    if math.isinf(want):
        return
    plan = plan_layers(nodes, model, "throughput", batch=m, micro_batches=m)
    assert plan.round_ms == pytest.approx(want, rel=1e-9, abs=1e-9)
