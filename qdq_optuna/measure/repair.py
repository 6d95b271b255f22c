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

:func:`repair` is *the* repair, of the starts and of the shipped model alike: the ranked repair
first; where it keeps nothing within the bound, bisection over tensors; float where that keeps
nothing either.
"""

from __future__ import annotations

import heapq
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum

from qdq_optuna.backends.base import Backend
from qdq_optuna.backends.what_ran import WhatRan
from qdq_optuna.measure.bisect import Bisection, bisect_plan
from qdq_optuna.model.calibration import QuantType
from qdq_optuna.model.graph import GRAPH_OUTPUT, Graph, node_label
from qdq_optuna.placement.dynamic import QuantMode, mode_use, use_mode
from qdq_optuna.placement.export import QDQExporter, QuantPlan, plan_uses

log = logging.getLogger("qdq_optuna")

PlanError = Callable[[QuantPlan], float]

#: a set of groups whose error with only them quantized is at most this share of the bound is
#: not split further: its error is shared among its groups (adaptive group testing)
NEGLIGIBLE_SHARE = 0.05
#: candidates measured again against the plan as it is before each group goes back to float
RERANK = 3
#: a node that can run dynamically (activations quantized per call, :class:`QuantMode`) is
#: switched to that mode instead of going back to float when the switch removes at least this
#: share of the error going back to float would: the node keeps an integer kernel, and a
#: per-call range recovers what a calibrated scale loses on inputs of changing range
MODE_SHARE = 0.9
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
    #: how many groups share :attr:`error` (a set of neighbours not split further)
    shared: int = 1
    #: the use that runs the group's node dynamically instead (None: no such mode here)
    dynamic: tuple | None = field(default=None, repr=False)
    #: the mode the repair switched the node to instead of float (None: not switched)
    switched: QuantMode | None = None

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
                "returned_to_float": self.returned,
                "fixed_by": "float" if self.returned else
                (self.switched.value if self.switched is not None else None)}


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
    #: estimated speed gained over the model without Q/DQ (:meth:`Fusion.total`, the costs'
    #: units) by the ``full`` plan and by the ``kept`` one: at or below 0, the repaired plan is
    #: expected to run no faster than float
    speed: dict = field(default_factory=dict)

    @property
    def within(self) -> bool:
        return self.error <= self.bound

    @property
    def returned(self) -> list[Group]:
        return [g for g in self.groups if g.returned]

    @property
    def switched(self) -> list[Group]:
        """The groups whose node the repair switched to another mode instead of float."""
        return [g for g in self.groups if g.switched is not None]

    def exclude_nodes(self) -> str:
        """A ``--exclude-nodes`` line for the groups returned to float (empty when none)."""
        nodes = [n for g in self.returned for n in g.nodes]
        return "--exclude-nodes " + " ".join(_quoted(n) for n in nodes) if nodes else ""

    def to_dict(self) -> dict:
        return {"bound": self.bound, "error": self.error, "full_error": self.full_error,
                "evaluations": self.evaluations, "costs_from": self.costs_from,
                "estimated_speed": self.speed,
                "returned": len(self.returned), "switched": len(self.switched),
                "groups_total": len(self.groups),
                "exclude_nodes": self.exclude_nodes(),
                "sensitivity": [g.to_dict() for g in self.groups]}



class RepairMethod(str, Enum):
    """Which step of :func:`repair` gave its plan (report.json ``accuracy.repair``)."""

    #: quantizer groups returned to float by error per latency cost (:func:`rank_repair`)
    RANKED = "ranked groups"
    #: the Q/DQ of the tensors bisection named removed (:func:`~qdq_optuna.measure.bisect.bisect_plan`)
    BISECTION = "bisection"
    #: nothing quantized kept the bound: the model without Q/DQ
    FLOAT = "float"
    #: the ranked repair kept nothing and the run's time was up before bisection
    NO_TIME = "no time"


@dataclass
class Repaired:
    """What :func:`repair` made of a plan past the bound: the plan (within the bound, or the
    model without Q/DQ), the step that gave it, and each step's own result."""

    plan: QuantPlan
    method: RepairMethod
    #: the ranked repair's table (always run first)
    ranked: Repair
    #: the bisection, when the ranked repair kept nothing within the bound
    bisection: Bisection | None = None

    @property
    def kept_quantized(self) -> bool:
        """Whether a quantized plan within the bound was kept."""
        return self.method in (RepairMethod.RANKED, RepairMethod.BISECTION)

    @property
    def evaluations(self) -> int:
        return self.ranked.evaluations + (self.bisection.evaluations if self.bisection else 0)

    @property
    def responsible(self) -> list[str]:
        """The activation tensors whose Q/DQ the repair took out (all or some of their uses):
        the returned groups', bisection's, or every tensor (nothing kept)."""
        if self.method is RepairMethod.RANKED:
            return sorted({t for g in self.ranked.returned for t in g.tensors})
        if self.bisection is not None:
            return list(self.bisection.responsible)
        return sorted({t for g in self.ranked.groups for t in g.tensors})


def read_ran(backend: Backend, exporter: QDQExporter, plan: QuantPlan) -> WhatRan | None:
    """What the runtime ran integer for ``plan`` (a repair's latency costs), or None when the
    backend cannot tell."""
    try:
        return backend.what_ran(exporter.to_bytes(plan))
    except Exception as exc:  # a report only sharpens the costs: never the failure
        log.info("what the runtime ran could not be read (%s)", exc)
        return None


#: error evaluations :func:`repair` may spend ranking quantizer groups and finding how many to
#: return to float (:func:`rank_repair`)
REPAIR_EVALUATIONS = 64
#: error evaluations the bisection over tensors may spend where the ranked repair kept nothing
BISECT_EVALUATIONS = 48


def repair(exporter: QDQExporter, plan: QuantPlan, error_fn: PlanError, bound: float, *,
           what: WhatRan | None = None, max_evaluations: int | None = None,
           bisect_evaluations: int | None = None,
           time_left: Callable[[], bool] = lambda: True,
           rank_time_left: Callable[[], bool] | None = None) -> Repaired:
    """``plan`` (past ``bound``) brought within it: :func:`rank_repair` (quantizer groups back to
    float by error per latency cost; ``max_evaluations``, default :data:`REPAIR_EVALUATIONS`;
    ``rank_time_left``, else ``time_left``); where that keeps nothing quantized within the
    bound (an error spread over hundreds of groups ranks coarsely),
    :func:`~qdq_optuna.measure.bisect.bisect_plan` over tensors (``bisect_evaluations``,
    default :data:`BISECT_EVALUATIONS`; skipped once ``time_left()`` is false); the model without
    Q/DQ where neither keeps anything. The plan returned never breaks the bound unless it is
    the model without Q/DQ."""
    found = rank_repair(exporter, plan, error_fn, bound, what=what,
                        max_evaluations=REPAIR_EVALUATIONS if max_evaluations is None
                        else max_evaluations,
                        time_left=rank_time_left or time_left)
    if found.within and found.kept.quantized:
        return Repaired(found.kept, RepairMethod.RANKED, found)
    if not time_left():
        return Repaired(exporter.plan(set()), RepairMethod.NO_TIME, found)
    cut = bisect_plan(exporter, plan, error_fn, bound, max_evaluations=BISECT_EVALUATIONS
                      if bisect_evaluations is None else bisect_evaluations)
    if cut.within and cut.kept.quantized:
        return Repaired(cut.kept, RepairMethod.BISECTION, found, cut)
    return Repaired(exporter.plan(set()), RepairMethod.FLOAT, found, cut)


class _ScoredOnce:
    """``error_fn`` scored once per plan (by its key); NaN reads as infinity, so a plan whose
    outputs broke never looks within the bound. ``memo`` counts the evaluations."""

    def __init__(self, error_fn: PlanError) -> None:
        self.error_fn = error_fn
        self.memo: dict[str, float] = {}

    def __call__(self, p: QuantPlan) -> float:
        if p.key not in self.memo:
            value = self.error_fn(p)
            self.memo[p.key] = math.inf if math.isnan(value) else float(value)
        return self.memo[p.key]

def _quoted(name: str) -> str:
    """A node name as a shell word."""
    safe = name and all(c.isalnum() or c in "_-./:#" for c in name)
    return name if safe else "'" + name.replace("'", "'\\''") + "'"


#: what one element of a stand-alone QuantizeLinear or DequantizeLinear costs, in multiply-adds
#: an integer kernel saves: a CPU's float kernels run some 30-50 G multiply-adds a second per
#: core and its u8 x s8 kernels about twice that, so each multiply-add run integer saves ~0.01-
#: 0.02 ns, while a stand-alone Q or DQ reads and writes each element once (~0.2-0.5 ns)
BOUNDARY_MACS = 16.0


class Fusion:
    """What runs integer for a set of quantized uses, and what returning groups to float does
    to it: the runtime's fusion rules (:class:`~qdq_optuna.placement.rules.RuntimeRules`) read
    as a node runs integer when one of its inputs is quantized, all of them for a fusion
    group's op, and, for an op the runtime fuses only with a Q after it
    (``output_quantized_ops``: ONNX Runtime's QLinear kernels), its output quantized for every
    reader too; a
    node the runtime's report ``what`` names as float never does. A quantized tensor whose
    producer runs float pays a stand-alone Q, one read by a float node a stand-alone DQ
    (:data:`BOUNDARY_MACS` per element each), so returning one tensor in the middle of an
    integer chain costs the kernels it breaks *and* the float island's new boundaries, while
    returning the end of a chain costs the end alone."""

    def __init__(self, graph: Graph, plan: QuantPlan, weights: Mapping[str, float],
                 rules=None, what: WhatRan | None = None, boundary: float = BOUNDARY_MACS):
        self.graph, self.weights = graph, weights
        self.label = {i: node_label(nd, i) for i, nd in enumerate(graph.nodes)}
        self.groups_ops = rules.fusion_group_ops if rules is not None else frozenset()
        self.out_ops = rules.output_quantized_ops if rules is not None else frozenset()
        self.never = what.float_nodes if what is not None else frozenset()
        self.boundary = boundary
        #: tensor -> the nodes (GRAPH_OUTPUT too) that read it quantized, now
        self.readers: dict[str, set[int]] = {}
        #: node -> its quantized input tensors in the full plan (a fusion group needs them all)
        self.wanted: dict[int, set[str]] = {}
        for t, n, _ in plan_uses(plan):
            self.readers.setdefault(t, set()).add(n)
            self.wanted.setdefault(n, set()).add(t)

    def integer(self, n: int) -> bool:
        if n == GRAPH_OUTPUT or self.label[n] in self.never or n not in self.wanted:
            return False
        node = self.graph.nodes[n]
        have = [t in self.readers and n in self.readers[t] for t in self.wanted[n]]
        if not any(have) or (node.op_type in self.groups_ops and not all(have)):
            return False
        if node.op_type in self.out_ops:
            return all(self._all_read_quantized(o) for o in node.output if o)
        return True

    def _all_read_quantized(self, tensor: str) -> bool:
        """Every reader of ``tensor`` (a graph output too) reads it through its Q: ONNX
        Runtime fuses a node into its QLinear kernel only when each consumer of its output is
        a QuantizeLinear; one float reader leaves the node float (a real PP-OCRv4 detector:
        four large Convs whose output also fed a returned group ran float, 27 % of its
        multiply-adds, where counting any quantized reader had them integer)."""
        readers = self.readers.get(tensor)
        if not readers:
            return False
        wanted = {n for n, _ in self.graph.consumers.get(tensor, [])}
        if tensor in self.graph.graph_outputs:
            wanted.add(GRAPH_OUTPUT)
        return wanted <= readers

    def _numel(self, t: str) -> float:
        shape = self.graph.shapes.get(t)
        ok = shape and all(isinstance(d, int) and d > 0 for d in shape)
        return float(math.prod(shape)) if ok else 1.0

    def _local(self, nodes: set[int], tensors: set[str]) -> tuple[float, set[int]]:
        """Latency of ``nodes`` and the boundaries at ``tensors`` (less is faster), and which
        of the nodes run integer."""
        ints = {n for n in nodes if self.integer(n)}
        total = -sum(self.weights.get(self.label[n], 1.0) for n in ints)
        for t in tensors:
            readers = self.readers.get(t)
            if not readers:
                continue
            producer = self.graph.producer.get(t)
            if producer is None or not self.integer(producer[0]):
                total += self.boundary * self._numel(t)  # stand-alone Q
            if any(not self.integer(r) for r in readers):
                total += self.boundary * self._numel(t)  # stand-alone DQ
        return total, ints

    def _around(self, uses) -> tuple[set[int], set[str]]:
        nodes = {n for _, n, _ in uses if n != GRAPH_OUTPUT}
        nodes |= {self.graph.producer[t][0] for t, _, _ in uses if t in self.graph.producer}
        tensors = {t for t, _, _ in uses}
        for n in nodes:
            node = self.graph.nodes[n]
            tensors |= {x for x in list(node.input) + list(node.output) if x}
        return nodes, tensors

    def _apply(self, uses, on: bool) -> None:
        for t, n, _ in uses:
            if on:
                self.readers.setdefault(t, set()).add(n)
            elif t in self.readers:
                self.readers[t].discard(n)
                if not self.readers[t]:
                    del self.readers[t]

    def change(self, uses, on: bool = False) -> tuple[float, tuple[str, ...]]:
        """What quantizing (``on``) or returning ``uses`` to float would cost in latency
        (positive: slower), and the nodes it takes off integer; nothing changes."""
        uses = [u for u in uses if (u[1] in self.readers.get(u[0], ())) != on]
        nodes, tensors = self._around(uses)
        before, ints = self._local(nodes, tensors)
        self._apply(uses, on)
        after, ints_after = self._local(nodes, tensors)
        self._apply(uses, not on)
        return after - before, tuple(self.label[n] for n in sorted(ints - ints_after))

    def returned(self, uses) -> None:
        """``uses`` go back to float from now on."""
        self._apply(uses, False)

    def restored(self, uses) -> None:
        self._apply(uses, True)

    def total(self) -> float:
        """The plan's estimated latency against the model without Q/DQ (negative: faster)."""
        tensors = set(self.readers)
        return self._local(set(range(len(self.graph.nodes))), tensors)[0]


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
                  node_costs: Mapping[str, float] | None = None, rules=None) -> str:
    """Fill each group's ``lost`` and ``cost`` for returning it alone from ``plan``: the
    nodes it takes off integer and the latency that costs, the stand-alone Q/DQ it creates
    included (:class:`Fusion`, under the runtime's ``rules`` and its report ``what``), each
    node weighed by ``node_costs`` (node -> what running it integer saves, e.g. measured
    kernel times) where given, else by :func:`node_weights`. Returns where the costs came
    from (for the report)."""
    fusion, told = _fusion(graph, plan, what, node_costs, rules)
    _recost(fusion, groups)
    return told


def estimated_speed(exporter: QDQExporter, plan: QuantPlan, what: WhatRan | None = None,
                    node_costs: Mapping[str, float] | None = None) -> float:
    """What the plan's integer kernels gain over float by the repair's cost model
    (:class:`Fusion`, the costs' units): how much speed its integer chains hold, which is
    what survives a repair; ONNX Runtime's recipe placement of a real PP-OCRv4 detector
    measured faster than every point on but holds half its estimated gain, and its repair
    within the bound ran 0.9x FP32 where every point's repaired placement ran 1.3x."""
    fusion, _ = _fusion(exporter.graph, plan, what, node_costs, exporter.rules)
    return -fusion.total()


def _fusion(graph: Graph, plan: QuantPlan, what: WhatRan | None,
            node_costs: Mapping[str, float] | None, rules) -> tuple[Fusion, str]:
    weights = node_weights(graph)
    boundary = BOUNDARY_MACS
    if node_costs:
        # a Q/DQ element in the given units: the given costs' median per multiply-add
        ratios = sorted(float(v) / weights[k] for k, v in node_costs.items()
                        if weights.get(k, 0) > 0 and v > 0)
        if ratios:
            boundary *= ratios[len(ratios) // 2]
        weights.update({k: float(v) for k, v in node_costs.items()})
    told = "the given per-node costs" if node_costs else "multiply-adds of the nodes"
    told += (f" the runtime ran integer ({what.how})" if what is not None
             else " (every quantized node assumed integer)")
    if rules is not None:
        told += f", and the stand-alone Q/DQ a return creates ({rules.name} fusion rules)"
    return Fusion(graph, plan, weights, rules, what, boundary), told


def _recost(fusion: Fusion, groups: Sequence[Group]) -> None:
    """Each group's cost of going back to float from the plan as it is now."""
    for g in groups:
        if not g.returned:
            g.cost, g.lost = fusion.change(g.uses)


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
    err = _ScoredOnce(error_fn)
    memo = err.memo

    graph = exporter.graph
    groups = plan_groups(graph, plan)
    full = err(plan)
    fusion, costs_from = _fusion(graph, plan, what, node_costs, exporter.rules)
    _recost(fusion, groups)
    speed = {"full": -fusion.total()}
    if full <= bound or not groups:
        return Repair(groups, plan, full, full, bound, len(memo), costs_from, speed | {
            "kept": speed["full"]})

    _offer_dynamic(graph, groups, exporter.rules)
    switched: list[Group] = []  # nodes run dynamically instead: in every plan tried after

    def without(gone_groups) -> QuantPlan:
        return _changed(exporter, plan, gone_groups, switched)

    def budget() -> bool:
        return len(memo) < max_evaluations and time_left()

    def drop(returned: list[Group], g: Group, now: float) -> float:
        return now - err(without(returned + [g]))

    def switch(returned: list[Group], g: Group) -> float:
        """The error with ``g``'s node run dynamically (the groups ``returned`` in float)."""
        return err(_changed(exporter, plan, returned, [*switched, g]))

    measure_drops(groups, lambda gs: full - err(without(gs)), full - bound,
                  budget=lambda: len(memo) < max_evaluations // 2 + 1 and time_left())
    # evaluations kept for the prefix search should the greedy returns not reach the bound
    reserve = 2 * math.ceil(math.log2(len(groups) + 1))
    returned = _greedy(groups, drop, full, bound, fusion,
                       lambda: len(memo) < max_evaluations - reserve and time_left(),
                       switch=switch, switched=switched)
    if err(without(returned)) > bound:  # an error spread over many groups: return more at once
        rest = _cheapest_order([g for g in groups if g not in returned and g not in switched],
                               fusion)
        k = _shortest_prefix(len(rest), lambda k: err(without(returned + rest[:k])) <= bound,
                             budget)
        returned += rest[:k]
        for g in rest[:k]:
            fusion.returned(g.uses)
    returned = _give_back(returned, lambda gs: err(without(gs)) <= bound, budget, fusion)
    for g in returned:
        g.returned = True
    _recost(fusion, groups)
    order = {id(g): i for i, g in enumerate(returned)}
    groups.sort(key=lambda g: (order.get(id(g), len(order)), -g.score, g.cost, g.name))
    kept = without(returned)
    speed["kept"] = -fusion.total()
    return Repair(groups, kept, err(kept), full, bound, len(memo), costs_from, speed)


def _key(g: Group) -> tuple:
    return (-g.score, g.cost, g.name)


def _changed(exporter: QDQExporter, plan: QuantPlan, to_float: Sequence[Group],
             to_dynamic: Sequence[Group] = ()) -> QuantPlan:
    """``plan`` with the groups ``to_float`` returned to float and the nodes of ``to_dynamic``
    run dynamically (their :attr:`Group.dynamic` use) instead of as placed."""
    gone = {u for g in [*to_float, *to_dynamic] for u in g.uses}
    uses = {u: q for u, q in plan_uses(plan).items() if u not in gone}
    uses.update((g.dynamic, QuantType.INT8) for g in to_dynamic)
    return exporter.plan(uses)


def _offer_dynamic(graph: Graph, groups: Sequence[Group], rules) -> None:
    """Set :attr:`Group.dynamic` for each group of static Q/DQ whose node may run dynamically
    in this run (``rules``: the runtime's rules for the modes searched)."""
    for g in groups:
        nodes = {n for _, n, _ in g.uses}
        if len(nodes) != 1 or any(use_mode(u) is not None for u in g.uses):
            continue
        (n,) = nodes
        if n != GRAPH_OUTPUT and rules.offers_mode(graph, n, QuantMode.DYNAMIC):
            g.dynamic = mode_use(graph, n, QuantMode.DYNAMIC)


def _greedy(groups: list[Group], drop: Callable[[list[Group], Group, float], float],
            full: float, bound: float, fusion: Fusion,
            budget: Callable[[], bool],
            switch: Callable[[list[Group], Group], float] | None = None,
            switched: list[Group] | None = None) -> list[Group]:
    """Groups returned to float one at a time, the best error drop per cost first: before
    each return the :data:`RERANK` best candidates are measured against the plan as it is
    then (a group that only mattered together with one already returned falls back; one
    that only matters once another is gone rises), so each step costs at most that many
    evaluations; after each, the others' costs are read again against the plan as it is
    (a neighbour of a float island costs less: its return removes Q/DQ boundaries). Stops
    within the bound or when the budget ends. A group whose node can run dynamically
    (``switch``: the error with it so) is switched instead of returned when that removes
    :data:`MODE_SHARE` of the error returning it would, or reaches the bound (it joins
    ``switched``; its node keeps an integer kernel, so nothing is recosted)."""
    returned: list[Group] = []
    switched = [] if switched is None else switched
    now = full
    fresh: set[int] = set()  # groups whose drop was measured against the current plan
    while now > bound and budget():
        rest = sorted((g for g in groups if g not in returned and g not in switched), key=_key)
        if not rest:
            break
        for g in rest[:RERANK]:
            if id(g) not in fresh and budget():
                g.error = drop(returned, g, now)
                fresh.add(id(g))
        best = min(rest[:RERANK], key=_key)
        if id(best) not in fresh:
            break
        if best.dynamic is not None and switch is not None and budget():
            error = switch(returned, best)
            if error <= bound or now - error >= MODE_SHARE * best.error:
                best.switched = QuantMode.DYNAMIC
                switched.append(best)
                now = error
                fresh = set()
                continue
        returned.append(best)
        fusion.returned(best.uses)
        _recost(fusion, [g for g in rest if g is not best])
        now -= best.error
        fresh = set()
    return returned


def _cheapest_order(rest: list[Group], fusion: Fusion) -> list[Group]:
    """``rest`` in the order the prefix search returns them: each next the best of its last
    measured drop per latency cost, the cost read against the plan with the ones before it
    already returned (so float islands grow whole and the integer chains left stay long),
    no evaluation spent; ``fusion`` is left as it was."""
    order: list[Group] = []
    left = list(rest)
    while left:
        _recost(fusion, left)
        best = min(left, key=_key)
        order.append(best)
        left.remove(best)
        fusion.returned(best.uses)
    for g in order:
        fusion.restored(g.uses)
    _recost(fusion, rest)
    return order


def _give_back(returned: list[Group], holds: Callable[[list[Group]], bool],
               budget: Callable[[], bool], fusion: Fusion) -> list[Group]:
    """The groups returned, without those it need not return: each whose quantizing again
    would gain speed (against the plan as repaired), the most first, is quantized again
    when the plan stays within the bound without it (a group returned early can be made
    unnecessary by later ones)."""
    gain = {id(g): -fusion.change(g.uses, on=True)[0] for g in returned}
    for g in sorted((g for g in returned if gain[id(g)] > 0), key=lambda g: -gain[id(g)]):
        if len(returned) < 2 or not budget():
            break
        fewer = [x for x in returned if x is not g]
        if holds(fewer):
            returned = fewer
            fusion.restored(g.uses)
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
            g.error, g.shared = d / len(chunk), len(chunk)
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


#: plans the shipped model's sensitivity table may score (report.md's table on every run)
SENSITIVITY_EVALUATIONS = 16
#: groups the table's ``--exclude-nodes`` line names, the most sensitive first
SENSITIVITY_EXCLUDE = 3


def sensitivity(exporter: QDQExporter, plan: QuantPlan, error_fn: PlanError, *,
                max_evaluations: int = SENSITIVITY_EVALUATIONS,
                time_left: Callable[[], bool] = lambda: True) -> dict | None:
    """Which quantizer groups of ``plan`` cost the most output error, measured as the repair
    ranks them (:func:`measure_drops`: the drop when a group alone goes back to float, sets of
    neighbouring groups first, split where the error is) within ``max_evaluations`` plans
    scored, so a model within its bound gets the table too at a small, fixed cost; a group
    left in a set shares its set's drop (``shared_by``). None when ``plan`` has no Q/DQ."""
    groups = plan_groups(exporter.graph, plan)
    if not groups:
        return None
    err = _ScoredOnce(error_fn)
    memo = err.memo

    def without(gone_groups) -> QuantPlan:
        return _changed(exporter, plan, gone_groups)

    full = err(plan)
    measure_drops(groups, lambda gs: full - err(without(gs)), full,
                  budget=lambda: len(memo) < max_evaluations and time_left())
    fusion, costs_from = _fusion(exporter.graph, plan, None, None, exporter.rules)
    _recost(fusion, groups)
    groups.sort(key=lambda g: (-(0.0 if math.isnan(g.error) else g.error), g.shared, g.name))
    dynamic_drops = _dynamic_drops(exporter, plan, groups[:SENSITIVITY_EXCLUDE], full, err,
                                   lambda: len(memo) < max_evaluations + SENSITIVITY_EXCLUDE
                                   and time_left())
    top = [n for g in groups[:SENSITIVITY_EXCLUDE] if g.error > 0 for n in g.nodes]
    return {"error": full, "evaluations": len(memo), "groups_total": len(groups),
            "costs_from": costs_from,
            "exclude_nodes": "--exclude-nodes " + " ".join(_quoted(n) for n in top) if top
            else "",
            "groups": [{"group": g.name, "nodes": list(g.nodes), "tensors": g.tensors,
                        "error_drop": None if math.isnan(g.error) else g.error,
                        "shared_by": g.shared, "latency_cost": g.cost}
                       | _mode_fix(g, dynamic_drops.get(id(g))) for g in groups]}


def _dynamic_drops(exporter: QDQExporter, plan: QuantPlan, groups: Sequence[Group],
                   full: float, err: PlanError, budget: Callable[[], bool]) -> dict[int, float]:
    """id(group) -> how much the output error drops when the group's node runs dynamically
    instead (the groups that have that mode in this run, while ``budget()`` holds)."""
    _offer_dynamic(exporter.graph, groups, exporter.rules)
    drops = {}
    for g in groups:
        if g.dynamic is None or not budget():
            continue
        drops[id(g)] = full - err(_changed(exporter, plan, (), (g,)))
    return drops


def _mode_fix(g: Group, dynamic_drop: float | None) -> dict:
    """The sensitivity row's mode columns: the drop with the node run dynamically (when
    measured) and what fixes the group: ``dynamic`` when that removes :data:`MODE_SHARE` of
    the error going back to float does (it keeps an integer kernel), else ``float``."""
    if dynamic_drop is None:
        return {}
    drop = 0.0 if math.isnan(g.error) else g.error
    return {"dynamic_error_drop": dynamic_drop,
            "fix": QuantMode.DYNAMIC.value if dynamic_drop >= MODE_SHARE * drop else "float"}


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
