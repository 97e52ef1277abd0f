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

import numpy as np

from pipeshard.errors import InvalidArgument
from pipeshard.planning.cost import ModelCost
from pipeshard.planning.nodes import Node
from pipeshard.planning.plan import OBJECTIVES, Plan, StagePlan


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


def stage_table(nodes: Sequence[Node], model: ModelCost, rows: int, resident: int) -> np.ndarray:
    """Step times [node, a, b] of every candidate stage (inf where b <= a or it does not fit)."""
    n_layers = model.num_layers
    a = np.arange(n_layers + 1)[:, None]
    b = np.arange(n_layers + 1)[None, :]
    count = (b - a).astype(np.float64)
    first, last = (a == 0), (b == n_layers)
    per_layer = model.layer_bytes + model.kv_bytes_per_token * model.context * resident
    need = count * per_layer + first * model.embed_bytes + last * model.head_bytes
    mid_send, last_send = model.wire_bytes(rows, False), model.wire_bytes(rows, True)

    def column(values: list[float]) -> np.ndarray:
        return np.array(values, dtype=np.float64)[:, None, None]

    sends = [(n.link_to_next.transfer_ms(mid_send), n.link_to_next.transfer_ms(last_send)) for n in nodes]
    t = (
        column([n.overhead_ms.at(rows) + mid for n, (mid, _) in zip(nodes, sends, strict=True)])
        + count * column([n.per_layer_ms.at(rows) for n in nodes])
        + first * column([n.embed_ms.at(rows) for n in nodes])
        + last * column([n.head_ms.at(rows) + end - mid for n, (mid, end) in zip(nodes, sends, strict=True)])
    )
    fits = (count >= 1) & (need <= column([n.usable_bytes for n in nodes]))
    return np.where(fits, t, np.inf)


def _least_sum(
    cost: np.ndarray, cap: float = np.inf, stages: bool = True
) -> tuple[float, list[tuple[int, int, int]]]:
    """The least sum of stage times over plans whose every stage takes <= cap; its stages."""
    n_nodes, size, _ = cost.shape
    n_layers = size - 1
    if cap != np.inf:
        cost = np.where(cost <= cap, cost, np.inf)
    best = np.full(size, np.inf)
    best[n_layers] = 0.0
    rows = np.arange(size)
    choice = np.full((n_nodes, size), -1, dtype=np.int64)
    for i in range(n_nodes - 1, -1, -1):
        total = cost[i] + best
        if not stages:  # the search only needs the value
            best = np.minimum(total.min(axis=1), best)
            continue
        arg = total.argmin(axis=1)
        use = total[rows, arg]
        take = use < best  # ties skip the node: fewer stages for the same time
        choice[i] = np.where(take, arg, -1)
        best = np.minimum(use, best)
    if not np.isfinite(best[0]):
        return np.inf, []
    if not stages:
        return float(best[0]), []
    out, a = [], 0
    for i in range(n_nodes):
        if a == n_layers:
            break
        if choice[i, a] >= 0:
            out.append((i, a, int(choice[i, a])))
            a = int(choice[i, a])
    return float(best[0]), out


def _least_bottleneck(cost: np.ndarray) -> float:
    """The least possible largest stage time over all plans (min-max recurrence, O(N L^2))."""
    n_nodes, size, _ = cost.shape
    best = np.full(size, np.inf)
    best[size - 1] = 0.0
    for i in range(n_nodes - 1, -1, -1):
        best = np.minimum(np.maximum(cost[i], best).min(axis=1), best)
    return float(best[0])


def _best_for(
    cost: np.ndarray, m: int, total: float, stages: list[tuple[int, int, int]], bottleneck: float
) -> tuple[float, list[tuple[int, int, int]]]:
    """The least round time max(sum, m * max) and its stages, for m micro-batches, given the
    least unconstrained sum ``total``, its ``stages`` and the least bottleneck."""
    if not stages or m == 1:
        return total, stages

    def value(st: list[tuple[int, int, int]]) -> float:
        return round_ms([float(cost[i, a, b]) for i, a, b in st], m)

    # S(tau) >= total, so S(tau) <= m * tau needs tau >= total / m, and no plan exists below the
    # least bottleneck; it holds from the largest stage time of the unconstrained optimum on.
    # Only candidate bounds in between are searched.
    low = max(total / m, bottleneck)
    high = max(low, max(float(cost[i, a, b]) for i, a, b in stages))
    finite = cost[np.isfinite(cost)]
    taus = np.unique(finite[(finite >= low) & (finite <= high)])
    below = finite[finite < low]
    lo, hi = 0, len(taus) - 1  # the smallest candidate with S(tau) <= m * tau
    while lo < hi:
        mid = (lo + hi) // 2
        if _least_sum(cost, taus[mid], stages=False)[0] <= m * taus[mid]:
            hi = mid
        else:
            lo = mid + 1
    candidates = [stages]
    if len(taus):
        candidates.append(_least_sum(cost, taus[lo])[1])
    under = taus[lo - 1] if lo > 0 else (below.max() if len(below) else None)
    if under is not None:
        candidates.append(_least_sum(cost, under)[1])
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
    # bound cannot beat the best round found so far is not searched.
    tables = {m: stage_table(nodes, model, batch // m, batch) for m in counts}
    sums = {m: _least_sum(tables[m]) for m in counts}
    necks = {m: _least_bottleneck(tables[m]) if m > 1 else 0.0 for m in counts}
    bound = {m: max(sums[m][0], m * necks[m]) for m in counts}
    found: tuple[float, int, list, np.ndarray] | None = None
    for m in sorted(counts, key=lambda m: (bound[m], m)):
        if found is not None and bound[m] > found[0]:
            break
        value, stages = _best_for(tables[m], m, *sums[m], necks[m])
        if stages and (found is None or value < found[0] or (value == found[0] and m < found[1])):
            found = (value, m, stages, tables[m])
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
            )
            for i, a, b in stages
        ),
        round_ms=value,
        tok_s=1000.0 * batch / value if value > 0 else float("inf"),
        skipped=tuple(n.name for k, n in enumerate(nodes) if k not in used),
    )
