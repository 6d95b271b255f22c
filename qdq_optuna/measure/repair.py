"""A repair that returns quantizer groups to float by error per latency: the guard's repair of a
fast placement that breaks the accuracy bound, done without throwing the speed away.

Bisection (:mod:`qdq_optuna.measure.bisect`) names tensors; removing a tensor's Q/DQ breaks the
integer kernel of its producer and of every reader, so on a real PP-OCR detector it kept 111 of
264 tensors and ran slower than float. Here the unit is a *group*: the quantized inputs of one
node (its DQ -> op -> Q chain: with them gone the node runs float, and ``--exclude-nodes NODE``
says the same), so the chains that remain still fuse. Like NNCF's
``quantize_with_accuracy_control``, each group's contribution is measured from the full plan
down: how much the output error drops when that group alone goes back to float (errors of
quantizers do not add up: on a real PP-OCR detector every head group alone gives a third of the
full error, and returning any one of them from the full plan almost nothing); unlike it, each
group also has a latency cost: what
the runtime ran integer that the group takes back to float (the runtime's report of what it
fused, :class:`~qdq_optuna.backends.what_ran.WhatRan`), weighed by a per-node cost mapping
when one is given (measured integer-vs-float kernel times) or by the node's multiply-adds.
Groups go back to float one at a time, whole, the best drop per cost first, re-ranking the
few best after each, until the plan is within the bound.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from qdq_optuna.backends.what_ran import WhatRan
from qdq_optuna.model.graph import GRAPH_OUTPUT, Graph, node_label
from qdq_optuna.placement.export import QDQExporter, QuantPlan, plan_uses

PlanError = Callable[[QuantPlan], float]

#: a set of groups whose error with only them quantized is at most this share of the bound is
#: not split further: its error is shared among its groups (adaptive group testing)
NEGLIGIBLE_SHARE = 0.05
#: candidates measured again against the plan as it is before each group goes back to float
RERANK = 3
#: ops whose cost is their multiply-adds (output elements x reduced elements); other ops cost
#: their output elements
_MAC_OPS = frozenset({"Conv", "ConvTranspose", "MatMul", "Gemm"})


@dataclass
class Group:
    """Quantized inputs of one node (or one graph output's Q/DQ), returned to float together."""

    name: str
    #: nodes whose inputs the group quantizes (``--exclude-nodes`` names; empty for outputs)
    nodes: tuple[str, ...]
    uses: dict = field(repr=False)
    #: how much the output error drops when this group alone is returned to float from the
    #: plan it was last measured against (NaN: not measured)
    error: float = math.nan
    #: nodes that run integer now and would run float with the group returned
    lost: tuple[str, ...] = ()
    #: latency cost of returning it (relative units unless a measured mapping was given)
    cost: float = 0.0
    returned: bool = False

    @property
    def tensors(self) -> list[str]:
        return sorted({t for t, _, _ in self.uses})

    @property
    def score(self) -> float:
        """Error removed per unit of speed given up (higher: returned first)."""
        err = 0.0 if math.isnan(self.error) else self.error
        return err / max(self.cost, 1e-9)

    def to_dict(self) -> dict:
        return {"group": self.name, "nodes": list(self.nodes), "tensors": self.tensors,
                "error": None if math.isnan(self.error) else self.error,
                "lost_integer_nodes": list(self.lost), "latency_cost": self.cost,
                "returned_to_float": self.returned}


@dataclass
class Repair:
    """What :func:`rank_repair` did: the groups in the order they would go back to float."""

    groups: list[Group]
    kept: QuantPlan
    error: float
    full_error: float
    bound: float
    evaluations: int
    #: where the latency costs came from
    costs_from: str

    @property
    def within(self) -> bool:
        return self.error <= self.bound

    @property
    def returned(self) -> list[Group]:
        return [g for g in self.groups if g.returned]

    def exclude_nodes(self) -> str:
        """A ``--exclude-nodes`` line for the groups returned to float (empty when none)."""
        nodes = [n for g in self.returned for n in g.nodes]
        return "--exclude-nodes " + " ".join(_quoted(n) for n in nodes) if nodes else ""

    def to_dict(self) -> dict:
        return {"bound": self.bound, "error": self.error, "full_error": self.full_error,
                "evaluations": self.evaluations, "costs_from": self.costs_from,
                "returned": len(self.returned), "groups_total": len(self.groups),
                "exclude_nodes": self.exclude_nodes(),
                "sensitivity": [g.to_dict() for g in self.groups]}


def _quoted(name: str) -> str:
    """A node name as a shell word."""
    safe = name and all(c.isalnum() or c in "_-./:#" for c in name)
    return name if safe else "'" + name.replace("'", "'\\''") + "'"


def plan_groups(graph: Graph, plan: QuantPlan) -> list[Group]:
    """The plan's uses split by the node that reads them (one group per quantized node, in
    graph order; a graph output's Q/DQ is a group of its own)."""
    by_node: dict[int, dict] = {}
    outputs: dict[str, dict] = {}
    for (t, n, s), q in plan_uses(plan).items():
        if n == GRAPH_OUTPUT:
            outputs.setdefault(t, {})[(t, n, s)] = q
        else:
            by_node.setdefault(n, {})[(t, n, s)] = q
    groups = [Group(node_label(graph.nodes[n], n), (node_label(graph.nodes[n], n),), uses)
              for n, uses in sorted(by_node.items())]
    return groups + [Group(f"graph output {t}", (), uses) for t, uses in sorted(outputs.items())]


def node_weights(graph: Graph) -> dict[str, float]:
    """Each node's multiply-adds (Conv, MatMul, Gemm) or output elements (other ops): what its
    integer kernel saves, up to a factor, when nothing better is known."""
    out = {}
    for i, node in enumerate(graph.nodes):
        shape = graph.shapes.get(node.output[0]) if node.output else None
        numel = math.prod(shape) if shape and all(isinstance(d, int) and d > 0
                                                  for d in shape) else 1
        reduced = 1
        if node.op_type in _MAC_OPS and len(node.input) > 1:
            w = graph.shapes.get(node.input[1])
            if w and all(isinstance(d, int) and d > 0 for d in w):
                reduced = math.prod(w[1:]) if node.op_type.startswith("Conv") else w[0]
                if node.op_type == "MatMul" and len(w) >= 2:
                    reduced = w[-2]
        out[node_label(node, i)] = float(numel * reduced)
    return out


def latency_costs(graph: Graph, plan: QuantPlan, groups: Sequence[Group],
                  what: WhatRan | None = None,
                  node_costs: Mapping[str, float] | None = None) -> str:
    """Fill each group's ``lost`` and ``cost``: the nodes that run integer with the plan and
    would not without the group (the group's node; the producer of an input whose only
    quantized reader it is), each weighed by ``node_costs`` (node -> what running it integer
    saves, e.g. measured kernel times) where given, else by :func:`node_weights`. A node runs
    integer when one of its inputs is quantized and, where the runtime's report ``what`` is
    known, it is not one the runtime ran in float. Returns where the
    costs came from (for the report)."""
    weights = node_weights(graph)
    if node_costs:
        weights.update({k: float(v) for k, v in node_costs.items()})
    label = {i: node_label(nd, i) for i, nd in enumerate(graph.nodes)}
    readers: dict[str, set[int]] = {}
    for t, n, _ in plan_uses(plan):
        readers.setdefault(t, set()).add(n)

    def integer(n: int) -> bool:
        # a graph input's Q always runs standalone, so a fused input is no test: a quantized
        # node runs integer unless the runtime names it among the float nodes
        return what is None or label[n] not in what.float_nodes

    node_inputs: dict[int, set[str]] = {}
    for t, n, _ in plan_uses(plan):
        node_inputs.setdefault(n, set()).add(t)
    for g in groups:
        lost = set()
        mine = {n for _, n, _ in g.uses}
        for n in mine - {GRAPH_OUTPUT}:
            if integer(n):
                lost.add(n)
        for t in g.tensors:
            producer = graph.producer.get(t)
            if producer is not None and readers[t] <= mine and producer[0] in node_inputs \
                    and integer(producer[0]):
                lost.add(producer[0])
        g.lost = tuple(label[n] for n in sorted(lost))
        g.cost = sum(weights.get(x, 1.0) for x in g.lost)
    told = "the given per-node costs" if node_costs else "multiply-adds of the nodes"
    return told + (f" the runtime ran integer ({what.how})" if what is not None
                   else " (every quantized node assumed integer)")


def rank_repair(exporter: QDQExporter, plan: QuantPlan, error_fn: PlanError, bound: float, *,
                what: WhatRan | None = None, node_costs: Mapping[str, float] | None = None,
                max_evaluations: int = 64,
                time_left: Callable[[], bool] = lambda: True) -> Repair:
    """``plan`` with the fewest speed-weighted groups returned to float that brings
    ``error_fn`` (lower is better; NaN counts as broken) within ``bound``, ranked from the
    full plan down as NNCF's accuracy control does: a group's worth is how much the error
    drops when it alone is returned to float from the current plan (:func:`measure_drops`;
    errors of quantizers do not add up, so the error with a group alone quantized says
    little), per latency cost (:func:`latency_costs`). The best group goes back to float,
    the :data:`RERANK` best of the rest are measured again against the new plan (errors
    interact), and so on until within the bound; then each returned group that costs speed,
    dearest first, is quantized again if the bound still holds without it. Where the greedy
    returns do not reach the bound before the last ``2 log2(groups)`` of ``max_evaluations``
    (an error spread over hundreds of groups), the rest follow in the order of their last
    measured drop per cost, up to the shortest prefix within the bound (galloping, then
    bisection). Within the bound as given: nothing returned. Out of evaluations (or once
    ``time_left()`` is false: the run's timeout) short of the bound, every group is
    returned (the model without Q/DQ)."""
    memo: dict[str, float] = {}

    def err(p: QuantPlan) -> float:
        if p.key not in memo:
            value = error_fn(p)
            memo[p.key] = math.inf if math.isnan(value) else float(value)
        return memo[p.key]

    graph = exporter.graph
    groups = plan_groups(graph, plan)
    full = err(plan)
    costs_from = latency_costs(graph, plan, groups, what, node_costs)
    if full <= bound or not groups:
        return Repair(groups, plan, full, full, bound, len(memo), costs_from)

    def without(gone_groups) -> QuantPlan:
        gone = {u for g in gone_groups for u in g.uses}
        return exporter.plan({u: q for u, q in plan_uses(plan).items() if u not in gone})

    def budget() -> bool:
        return len(memo) < max_evaluations and time_left()

    def drop(returned: list[Group], g: Group, now: float) -> float:
        return now - err(without(returned + [g]))

    measure_drops(groups, lambda gs: full - err(without(gs)), full - bound,
                  budget=lambda: len(memo) < max_evaluations // 2 + 1 and time_left())
    # evaluations kept for the prefix search should the greedy returns not reach the bound
    reserve = 2 * math.ceil(math.log2(len(groups) + 1))
    returned = _greedy(groups, drop, full, bound,
                       lambda: len(memo) < max_evaluations - reserve and time_left())
    if err(without(returned)) > bound:  # an error spread over many groups: return more at once
        rest = sorted((g for g in groups if g not in returned),
                      key=lambda g: (-g.score, g.cost, g.name))
        k = _shortest_prefix(len(rest), lambda k: err(without(returned + rest[:k])) <= bound,
                             budget)
        returned += rest[:k]
    returned = _give_back(returned, lambda gs: err(without(gs)) <= bound, budget)
    for g in returned:
        g.returned = True
    order = {id(g): i for i, g in enumerate(returned)}
    groups.sort(key=lambda g: (order.get(id(g), len(order)), -g.score, g.cost, g.name))
    kept = without(returned)
    return Repair(groups, kept, err(kept), full, bound, len(memo), costs_from)


def _greedy(groups: list[Group], drop: Callable[[list[Group], Group, float], float],
            full: float, bound: float, budget: Callable[[], bool]) -> list[Group]:
    """Groups returned to float one at a time, the best error drop per cost first: before
    each return the :data:`RERANK` best candidates are measured against the plan as it is
    then (a group that only mattered together with one already returned falls back; one
    that only matters once another is gone rises), so each step costs at most that many
    evaluations. Stops within the bound or when the budget ends."""
    returned: list[Group] = []
    now = full
    fresh: set[int] = set()  # groups whose drop was measured against the current plan
    while now > bound and budget():
        rest = sorted((g for g in groups if g not in returned),
                      key=lambda g: (-g.score, g.cost, g.name))
        if not rest:
            break
        for g in rest[:RERANK]:
            if id(g) not in fresh and budget():
                g.error = drop(returned, g, now)
                fresh.add(id(g))
        best = min(rest[:RERANK], key=lambda g: (-g.score, g.cost, g.name))
        if id(best) not in fresh:
            break
        returned.append(best)
        now -= best.error
        fresh = set()
    return returned


def _give_back(returned: list[Group], holds: Callable[[list[Group]], bool],
               budget: Callable[[], bool]) -> list[Group]:
    """The groups returned, without those it need not return: each that costs speed, the
    dearest first, is quantized again when the plan stays within the bound without it (a
    group returned early can be made unnecessary by later ones)."""
    for g in sorted((g for g in returned if g.cost > 0), key=lambda g: -g.cost):
        if len(returned) < 2 or not budget():
            break
        fewer = [x for x in returned if x is not g]
        if holds(fewer):
            returned = fewer
    return returned


def measure_drops(groups: Sequence[Group], drop: Callable[[list[Group]], float],
                  excess: float, *, budget: Callable[[], bool]) -> None:
    """Each group's ``error``: how much the output error drops when it is returned to float
    from the full plan (leave-one-out). Sets of neighbouring groups are returned together
    first; the set with the largest drop is split next (best first, so a budget too small
    for one evaluation per group goes where the error is), and a set whose drop is at most
    :data:`NEGLIGIBLE_SHARE` of ``excess`` (the full plan's error over the bound) is not
    split: its drop is shared among its groups."""
    heap: list[tuple[float, int, list[Group]]] = []
    tie = 0

    def push(chunk: list[Group]) -> None:
        nonlocal tie
        d = drop(chunk)
        for g in chunk:
            g.error = d / len(chunk)
        if len(chunk) > 1 and d > NEGLIGIBLE_SHARE * excess:
            tie += 1
            heapq.heappush(heap, (-d, tie, chunk))

    push(list(groups))
    while heap and budget():
        _, _, chunk = heapq.heappop(heap)
        half = len(chunk) // 2
        for part in (chunk[:half], chunk[half:]):
            if budget():
                push(part)


def measure_contributions(exporter: QDQExporter, groups: Sequence[Group],
                          err: PlanError, bound: float, *,
                          budget: Callable[[], bool]) -> None:
    """Each group's ``error`` as the error with only it quantized (the old ranking; kept for
    ``benchmarks/bound_evidence.py``, which reads what each group does alone). Sets of neighbouring
    groups are measured together and split only while their joint error is more than
    :data:`NEGLIGIBLE_SHARE` of the bound (or the budget ends): a set below that shares its
    error among its groups, so a plan with few harmful groups is ranked in about
    ``harmful x log2(groups)`` evaluations rather than one per group."""
    pending = [list(groups)]
    while pending:
        chunk = pending.pop(0)
        uses = {u: q for g in chunk for u, q in g.uses.items()}
        e = err(exporter.plan(uses))
        if len(chunk) == 1 or e <= NEGLIGIBLE_SHARE * bound or not budget():
            for g in chunk:
                g.error = e / len(chunk)
            continue
        half = len(chunk) // 2
        pending += [chunk[:half], chunk[half:]]


def _shortest_prefix(n: int, holds: Callable[[int], bool], budget: Callable[[], bool]) -> int:
    """The smallest ``k`` in 1..n for which ``holds(k)``, assuming it holds from some ``k`` on:
    gallop (1, 2, 4, ...) then bisect; ``n`` when nothing smaller was shown to hold."""
    lo, hi, k = 0, n, 1
    while k < n and budget():
        if holds(k):
            hi = k
            break
        lo, k = k, 2 * k
    while hi - lo > 1 and budget():
        mid = (lo + hi) // 2
        if holds(mid):
            hi = mid
        else:
            lo = mid
    return hi
