"""Place contiguous layer ranges on an ordered list of nodes by dynamic programming.

Every candidate stage (node i, layers [a, b)) has a step time t(i, a, b) and a memory need
(pipeshard.planning.cost); ranges that do not fit a node's memory are excluded. A plan uses
some of the nodes in their given order (a node that does not help is skipped), each with at
least one layer, the ranges covering [0, L) in order.

latency     one sequence: minimise the sum of the stage times (a token visits every stage).
            G[i][a] = min(G[i+1][a], min_b t(i, a, b) + G[i+1][b]), G[N][L] = 0: O(N L^2).
throughput  ``batch`` sequences in m micro-batches of batch/m rows (m is chosen too): a round
            (every sequence one token further) takes max(sum_s t_s, m * max_s t_s): a
            micro-batch's trip round the ring, or the busiest stage serving all m. For each m
            the same recurrence, restricted to stages with t <= tau, gives the least sum S(tau);
            S falls and m*tau rises with tau, so a binary search over the candidate stage times
            finds the best trade-off: O(N L^2 log(N L^2)) per m.
The recurrence is evaluated with numpy, one node at a time over all (a, b) at once: 8 nodes x 80
layers plan in milliseconds (bench-planner).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from pipeshard.errors import InvalidArgument
from pipeshard.planning.cost import ModelCost
from pipeshard.planning.nodes import Node
from pipeshard.planning.plan import OBJECTIVES, Plan, StagePlan
from pipeshard.sizes import gib


def stage_ms(node: Node, model: ModelCost, a: int, b: int, rows: int) -> float:
    """Step time of node running layers [a, b) for ``rows`` sequences, its send included."""
    last = b == model.num_layers
    return (
        node.overhead_ms.at(rows)
        + (b - a) * node.per_layer_ms.at(rows)
        + (node.embed_ms.at(rows) if a == 0 else 0.0)
        + (node.head_ms.at(rows) if last else 0.0)
        + node.link_to_next.transfer_ms(model.wire_bytes(rows, last))
    )


def round_ms(times: Sequence[float], micro_batches: int) -> float:
    """Time for every micro-batch to advance one token through stages of these step times."""
    return max(sum(times), micro_batches * max(times))


def stage_tables(nodes: Sequence[Node], model: ModelCost, batch: int, counts: Sequence[int]) -> np.ndarray:
    """Step times [k, node, a, b] of every candidate stage with counts[k] micro-batches of
    batch / counts[k] rows (inf where b <= a or the range does not fit the node): one numpy
    expression for every count, the grids and the memory check shared."""
    n_layers = model.num_layers
    a = np.arange(n_layers + 1)[:, None]
    b = np.arange(n_layers + 1)[None, :]
    count = (b - a).astype(np.float64)
    per_layer = model.layer_bytes + model.kv_bytes_per_token * model.context * batch
    need = count * per_layer + (a == 0) * model.embed_bytes + (b == n_layers) * model.head_bytes
    usable = np.array([n.usable_bytes for n in nodes], dtype=np.float64)[:, None, None]
    coef = np.empty((4, len(counts), len(nodes)))
    for k, m in enumerate(counts):
        rows = batch // m
        mid_send, last_send = model.wire_bytes(rows, False), model.wire_bytes(rows, True)
        for i, n in enumerate(nodes):
            mid = n.link_to_next.transfer_ms(mid_send)
            coef[:, k, i] = (
                n.overhead_ms.at(rows) + mid,
                n.per_layer_ms.at(rows),
                n.embed_ms.at(rows),
                n.head_ms.at(rows) + n.link_to_next.transfer_ms(last_send) - mid,
            )
    # built in place: numpy's broadcast where() over [k, node, a, b] costs more than the rest
    t = count * coef[1, ..., None, None]
    t += coef[0, ..., None, None]
    t += np.where((count >= 1) & (need <= usable), 0.0, np.inf)
    t[..., 0, :] += coef[2, ..., None]  # the embedding on the first stage
    t[..., :, n_layers] += coef[3, ..., None]  # the head, and the smaller send, on the last
    return t


def _least_sums(cost: np.ndarray, caps: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per table k of cost [k, node, a, b]: the least sum of stage times over plans whose every
    stage takes <= caps[k] (inf if none), and choice [k, node, a]: the end of the range the
    node takes when the rest of a best plan starts at layer a with it, or -1 if it is skipped."""
    n_tables, n_nodes, size = cost.shape[:3]
    best = np.full((n_tables, size), np.inf)
    best[:, size - 1] = 0.0
    choice = np.empty((n_tables, n_nodes, size), dtype=np.int64)
    for i in range(n_nodes - 1, -1, -1):
        c = cost[:, i] if caps is None else np.where(cost[:, i] <= caps[:, None, None], cost[:, i], np.inf)
        total = c + best[:, None, :]
        arg, use = total.argmin(axis=2), total.min(axis=2)
        choice[:, i] = np.where(use < best, arg, -1)  # ties skip the node: fewer stages, same time
        np.minimum(use, best, out=best)
    return best[:, 0], choice


def _stages(choice: np.ndarray) -> list[tuple[int, int, int]]:
    """The stages (node, a, b) of the best plan from layer 0, from one table's choice [node, a];
    none if no plan fits."""
    out, a, end = [], 0, choice.shape[1] - 1
    for i in range(choice.shape[0]):
        if a == end:
            break
        if choice[i, a] >= 0:
            out.append((i, a, int(choice[i, a])))
            a = int(choice[i, a])
    return out if a == end else []


def _least_bottlenecks(cost: np.ndarray) -> np.ndarray:
    """Per table k of cost [k, node, a, b]: the least possible largest stage time over all plans
    (the min-max recurrence)."""
    n_nodes, size = cost.shape[1], cost.shape[2]
    best = np.full((cost.shape[0], size), np.inf)
    best[:, size - 1] = 0.0
    for i in range(n_nodes - 1, -1, -1):
        np.minimum(np.maximum(cost[:, i], best[:, None, :]).min(axis=2), best, out=best)
    return best[:, 0]


def _best_for(
    cost: np.ndarray, m: int, total: float, stages: list[tuple[int, int, int]], bottleneck: float
) -> tuple[float, list[tuple[int, int, int]]]:
    """The least round time max(sum, m * max) and its stages, for m micro-batches, given the
    least unconstrained sum ``total``, its ``stages`` and the least bottleneck."""

    def value(st: list[tuple[int, int, int]]) -> float:
        return round_ms([float(cost[i, a, b]) for i, a, b in st], m)

    high = max(float(cost[i, a, b]) for i, a, b in stages)
    if m == 1 or m * high <= total:  # the least sum is reached with the busiest stage in the shadow
        return value(stages), stages
    # The answer is the smallest stage-time bound tau with S(tau) <= m * tau (S: the least sum
    # under the bound), or the bound just below it. S(tau) >= total, so tau >= total / m, and no
    # plan exists below the least bottleneck; the unconstrained optimum holds from its busiest
    # stage on. Only candidate bounds in between are searched.
    low = max(total / m, bottleneck)
    finite = cost[np.isfinite(cost)]
    taus = np.unique(np.append(finite[(finite >= low) & (finite <= high)], high))
    scaled = m * taus  # the predicate's right side, as it is compared
    sums: dict[int, tuple[float, list[tuple[int, int, int]]]] = {}

    def least(k: int) -> tuple[float, list[tuple[int, int, int]]]:
        """S(taus[k]) and its stages; k = -1 stands for the largest bound below the range."""
        if k not in sums:
            cap = taus[k : k + 1] if k >= 0 else np.array([finite[finite < low].max(initial=-np.inf)])
            least_sum, choice = _least_sums(cost[None], cap)
            sums[k] = float(least_sum[0]), _stages(choice[0])
        return sums[k]

    # Binary search for the smallest k with S(taus[k]) <= m * taus[k] (it holds at the top: S is
    # total there). Every probe also bounds the answer by value: below a bound with sum s no
    # bound under s / m can hold, and above it every bound from s / m on holds (S only falls).
    # The plans at that k and just below it are the candidates (below, the sum decides).
    lo, hi = 0, len(taus) - 1
    probe = lo  # the busiest stage often decides: try the lowest bound first
    while lo < hi:
        s = least(probe)[0]
        at = int(np.searchsorted(scaled, s, side="left"))
        if s <= scaled[probe]:
            hi, lo = probe, max(lo, min(at, probe))
        else:
            lo, hi = probe + 1, min(hi, max(at, probe + 1))
        probe = (lo + hi) // 2
    candidates = [stages, least(lo)[1]]
    if lo > 0 or low > bottleneck:  # below the least bottleneck no plan exists
        candidates.append(least(lo - 1)[1])
    best = min((c for c in candidates if c), key=value)
    return value(best), best


def _infeasible(nodes: Sequence[Node], model: ModelCost, resident: int) -> InvalidArgument:
    per_layer = model.layer_bytes + model.kv_bytes_per_token * model.context * resident
    need = model.num_layers * per_layer + model.embed_bytes + model.head_bytes
    have = sum(n.usable_bytes for n in nodes)
    return InvalidArgument(
        "nodes",
        f"cannot hold {model.name}: memory constraint not met ({model.num_layers} layers of "
        f"{per_layer} bytes each with the KV cache of {resident} x {model.context} tokens, plus "
        f"{model.embed_bytes + model.head_bytes} bytes of embedding and head on the end stages: "
        f"{need} bytes at least; the nodes offer {have} bytes"
        + ("" if have < need else ", but no contiguous split fits each node")
        + ")",
    )


def micro_batch_counts(batch: int) -> list[int]:
    """Micro-batch counts m that split ``batch`` sequences into equal groups."""
    return [m for m in range(1, batch + 1) if batch % m == 0]


def plan_layers(
    nodes: Sequence[Node],
    model: ModelCost,
    objective: str = "latency",
    batch: int = 1,
    micro_batches: int | None = None,
) -> Plan:
    """The optimal plan for ``objective``; for throughput the micro-batch count too, unless given."""
    if not nodes:
        raise InvalidArgument("nodes", "is empty: list at least one node, in pipeline order")
    if objective not in OBJECTIVES:
        raise InvalidArgument("objective", f"must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
    if not isinstance(batch, int) or batch < 1:
        raise InvalidArgument("batch", f"must be a positive integer, got {batch!r}")
    if objective == "latency":
        if batch != 1 or micro_batches not in (None, 1):
            raise InvalidArgument("batch", "applies to the throughput objective (latency is one sequence)")
        counts = [1]
    elif micro_batches is None:
        counts = micro_batch_counts(batch)
    else:
        if micro_batches not in micro_batch_counts(batch):
            raise InvalidArgument("micro_batches", f"must divide batch {batch}, got {micro_batches!r}")
        counts = [micro_batches]
    # max(least sum, m * least bottleneck) bounds each m's round time from below: an m whose
    # bound cannot beat the best round found so far is not searched. The tables, sums and
    # bottlenecks of every m come from one batched recurrence each.
    tables = stage_tables(nodes, model, batch, counts)
    necks = _least_bottlenecks(tables) if max(counts) > 1 else np.zeros(1)
    totals, choices = _least_sums(tables)
    bound = {k: max(totals[k], m * necks[k]) for k, m in enumerate(counts)}
    found: tuple[float, int, list, np.ndarray] | None = None
    for k in sorted(bound, key=lambda k: (bound[k], counts[k])):
        m = counts[k]
        if not np.isfinite(bound[k]) or (found is not None and bound[k] > found[0]):
            break  # no plan fits (then for no m: memory does not depend on m), or m cannot win
        stages = _stages(choices[k])
        if not stages:
            break
        value, stages = _best_for(tables[k], m, float(totals[k]), stages, float(necks[k]))
        if found is None or value < found[0] or (value == found[0] and m < found[1]):
            found = (value, m, stages, tables[k])
    if found is None:
        raise _infeasible(nodes, model, batch)
    value, m, stages, table = found
    rows = batch // m
    used = {i for i, _, _ in stages}
    return Plan(
        model=model.name,
        num_layers=model.num_layers,
        objective=objective,
        batch=batch,
        micro_batches=m,
        stages=tuple(
            StagePlan(
                node=nodes[i].name,
                address=nodes[i].address,
                layer_start=a,
                layer_end=b,
                step_ms=float(table[i, a, b]),
                tok_s=1000.0 * rows / float(table[i, a, b]) if table[i, a, b] > 0 else float("inf"),
                memory_bytes=model.stage_bytes(a, b, batch),
                device=nodes[i].device,
            )
            for i, a, b in stages
        ),
        round_ms=value,
        tok_s=1000.0 * batch / value if value > 0 else float("inf"),
        skipped=tuple(n.name for k, n in enumerate(nodes) if k not in used),
    )


def plan_within(
    nodes: Sequence[Node],
    model: ModelCost,
    objective: str = "latency",
    batch: int = 1,
    micro_batches: int | None = None,
    max_stage_memory: int | None = None,
) -> Plan:
    """:func:`plan_layers` with no stage over ``max_stage_memory`` bytes (weights, KV, head).

    Every node is capped at the limit; when nothing fits, the error names the stage of the
    uncapped plan that is over it, with its estimate."""
    if max_stage_memory is None:
        return plan_layers(nodes, model, objective, batch, micro_batches)
    capped = [replace(n, memory_bytes=min(n.memory_bytes, max_stage_memory + n.reserve_bytes)) for n in nodes]
    try:
        return plan_layers(capped, model, objective, batch, micro_batches)
    except InvalidArgument as capped_error:
        if capped_error.field != "nodes":
            raise
        free = plan_layers(nodes, model, objective, batch, micro_batches)  # raises if nothing fits at all
        k, worst = max(enumerate(free.stages), key=lambda ks: ks[1].memory_bytes)
        raise InvalidArgument(
            "max_stage_memory",
            f"is {gib(max_stage_memory)}, but no placement on these {len(nodes)} node(s) keeps "
            f"every stage under it: the best plan's stage {k} (layers {worst.layer_start}:"
            f"{worst.layer_end} on {worst.node}) needs an estimated {gib(worst.memory_bytes)} "
            f"(weights and the KV cache of {batch} x {model.context} tokens); add nodes or lower --context",
        ) from None
