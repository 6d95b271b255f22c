"""The forward search: where every quantized placement breaks the accuracy bound, build up from
float instead of cutting down from the fast placement.

The repair (:func:`~qdq_optuna.measure.repair.repair`) returns quantizer groups to float from
a placement past the bound; where the error is spread over the whole model (a real PP-OCRv5
text detector: every start 0.51 against a bound of 0.2) it keeps float islands between short
integer chains, and the repaired model runs slower than float. Here each *group* (one node's
quantized inputs and, for an op the runtime fuses only with a Q after it, the Q on its output:
what makes that node run integer) is measured alone: its speed gain from the run's kernel
table where the table has the node (its float kernel less its integer kernel, counted only
where the two were told apart, less the stand-alone Q and DQ it needs alone, priced as the
repair prices them: :data:`~qdq_optuna.measure.repair.BOUNDARY_MACS`), else by timing the float model with that group alone
quantized; its output error with it alone quantized, by the guard's scorer. The groups that
gain go in order of gain per unit of error, and the longest prefix of that order whose *whole*
plan stays within the bound is kept (errors of quantizers do not add up, so each prefix is
scored as one plan: galloping, then bisection); the groups whose gains together are within
noise are left out. Where the run offers a node a per-node dynamic mode (ONNX Runtime's
MatMul/Gemm of a constant weight), the node's dynamic use is a group of its own beside its
static one, with its gain from the table's dynamic kernel: a node whose activation range a
static scale cannot hold often fits the bound dynamically at a little less speed. A node goes
in once, as whichever of its groups ranks first. The result is the in-bound plan with the most
speed found, or float with the reason (:class:`ForwardEnd`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum

from qdq_optuna.measure.kernels import KERNEL_OPS, TAIL_OPS, KernelDecision, KernelTable
from qdq_optuna.measure.repair import BOUNDARY_MACS, node_weights
from qdq_optuna.model.calibration import QuantType
from qdq_optuna.model.graph import GRAPH_OUTPUT, Graph, node_label
from qdq_optuna.placement.dynamic import QuantMode, mode_use, use_mode
from qdq_optuna.placement.export import QDQExporter, QuantPlan, plan_uses
from qdq_optuna.placement.rules import RuntimeRules

#: error evaluations the forward search may spend (each group alone, then the prefixes)
FORWARD_EVALUATIONS = 48
#: groups without a kernel-table figure timed alone in the whole model on a measured backend
#: (one whole-model timing each; a deterministic backend times every such group)
FORWARD_TIMED_ALONE = 4
#: a group's error alone is read as at least this share of the bound when ranking gain per
#: error (a group that adds no error ranks by its gain)
ERROR_FLOOR_SHARE = 1e-3


class GainSource(str, Enum):
    """Where a group's speed gain alone comes from."""

    #: its node's float kernel less its integer kernel, from the run's kernel table
    KERNEL_TABLE = "kernel table"
    #: the float model against the float model with only this group quantized
    WHOLE_MODEL = "whole-model timing"
    #: not measured: no kernel-table figure and no timing left for it
    NONE = "not measured"


class ForwardEnd(str, Enum):
    """Why the forward search stopped where it did (report.json ``forward.end``)."""

    BOUND = "the next group breaks the accuracy bound"
    NOISE = "the gain of the groups left is within noise"
    EVERY_GROUP = "every group that gains speed fits the accuracy bound together"
    NO_GAIN = "no group gains speed beyond noise alone"
    NONE_FITS = "no group that gains speed keeps the accuracy bound"
    NO_TIME = "no error evaluations or time left"


@dataclass
class ForwardGroup:
    """The quantized uses that make one node run integer, and what they do alone."""

    name: str
    #: the uses (of the placement the groups are drawn from) the group quantizes
    uses: dict = field(repr=False)
    #: whether the node is one the kernel table times (Conv, Gemm, MatMul, ConvTranspose)
    kernel: bool = False
    #: the node's multiply-adds (or output elements): the order groups are timed alone in
    weight: float = 0.0
    gain_ms: float = 0.0
    gain_from: GainSource = GainSource.NONE
    #: the output error with this group alone quantized (NaN: not scored)
    error: float = math.nan
    added: bool = False
    #: the node's index in the graph (one group per node and mode)
    node: int = -1
    #: how the group runs its node: static Q/DQ, or a per-node mode (dynamic)
    mode: QuantMode = QuantMode.STATIC
    #: the node's name (a mode group's ``name`` adds its mode; empty: ``name``)
    label: str = ""

    def __post_init__(self) -> None:
        self.label = self.label or self.name

    def to_dict(self) -> dict:
        return {"group": self.name, "mode": self.mode.value, "gain_ms": round(self.gain_ms, 6),
                "gain_from": self.gain_from.value,
                "error_alone": None if math.isnan(self.error) else self.error,
                "added": self.added}


@dataclass(frozen=True)
class ForwardInputs:
    """What the forward search reads: the placement its groups come from, the guard's scorer
    and bound, the float model's latency and the noise below which a gain is no gain, and the
    two sources of a group's gain (the kernel table, whole-model timing)."""

    exporter: QDQExporter
    #: the quantized placement (past the bound) whose groups are added one by one
    placement: QuantPlan
    #: the guard's output error of a plan (NaN: its outputs broke)
    error: Callable[[QuantPlan], float]
    bound: float
    float_ms: float
    noise_ms: float
    #: the run's kernel table for ``placement`` (None: none measured)
    kernels: KernelTable | None = None
    #: the whole model's latency (ms) of a plan (None: no timing)
    timed: Callable[[QuantPlan], float] | None = None
    #: groups without a kernel-table figure timed alone at most
    max_timed: int = FORWARD_TIMED_ALONE
    #: nodes the runtime ran float in ``placement`` (they gain nothing quantized)
    float_nodes: frozenset[str] = frozenset()
    max_evaluations: int = FORWARD_EVALUATIONS
    time_left: Callable[[], bool] = lambda: True


@dataclass
class ForwardResult:
    """The forward search's plan (None: float) and how it got there: ``groups`` in the order
    they were added, then the rest by gain."""

    plan: QuantPlan | None
    end: ForwardEnd
    groups: list[ForwardGroup]
    error: float
    bound: float
    evaluations: int
    timings: int
    float_ms: float
    noise_ms: float
    #: the group whose addition broke the bound (``end`` BOUND)
    next_group: str | None = None

    @property
    def added(self) -> list[ForwardGroup]:
        return [g for g in self.groups if g.added]

    @property
    def estimated_gain_ms(self) -> float:
        return sum(g.gain_ms for g in self.added)

    @property
    def estimated_speedup(self) -> float:
        left = self.float_ms - self.estimated_gain_ms
        return self.float_ms / left if left > 0 else math.inf

    def to_dict(self) -> dict:
        ranked = [g for g in self.groups if g.gain_ms > 0 or g.added]
        return {"end": self.end.value, "next_group": self.next_group,
                "groups_total": len(self.groups), "groups_with_gain": len(ranked),
                "added": len(self.added), "error": self.error, "bound": self.bound,
                "evaluations": self.evaluations, "timings": self.timings,
                "noise_ms": round(self.noise_ms, 6),
                "estimated_gain_ms": round(self.estimated_gain_ms, 6),
                "estimated_speedup": round(self.estimated_speedup, 6),
                "groups": [g.to_dict() for g in ranked]}


def forward_groups(graph: Graph, plan: QuantPlan, output_ops: frozenset[str]) -> list[ForwardGroup]:
    """One group per node that reads a quantized input in ``plan``: its quantized inputs and,
    for an op in ``output_ops`` (the runtime fuses it only with a Q after it), the quantized
    uses of its output, past a Relu/Clip the runtime folds in."""
    uses = plan_uses(plan)
    by_tensor: dict[str, dict] = {}
    by_node: dict[int, dict] = {}
    for use, q in uses.items():
        by_tensor.setdefault(use[0], {})[use] = q
        if use[1] != GRAPH_OUTPUT:
            by_node.setdefault(use[1], {})[use] = q
    weights = node_weights(graph)
    groups = []
    for n, inputs in sorted(by_node.items()):
        node = graph.nodes[n]
        label = node_label(node, n)
        group = dict(inputs)
        if node.op_type in output_ops:
            for t in _outputs_through_tails(graph, n):
                group.update(by_tensor.get(t, {}))
        modes = {use_mode(u) for u in inputs}
        mode = next(iter(modes)) if len(modes) == 1 and None not in modes else QuantMode.STATIC
        name = label if mode is QuantMode.STATIC else f"{label} ({mode.value})"
        groups.append(ForwardGroup(name, group, node.op_type in KERNEL_OPS,
                                   weights.get(label, 0.0), node=n, mode=mode, label=label))
    return groups


def mode_groups(graph: Graph, rules: RuntimeRules | None,
                groups: list[ForwardGroup]) -> list[ForwardGroup]:
    """A dynamic group beside each static group whose node the run (``rules``) offers the
    dynamic mode: the node's dynamic use alone (no Q/DQ on its inputs, none after it)."""
    if rules is None:
        return []
    have = {(g.node, g.mode) for g in groups}
    out = []
    for g in groups:
        if g.mode is not QuantMode.STATIC or g.node < 0 or (g.node, QuantMode.DYNAMIC) in have \
                or not rules.offers_mode(graph, g.node, QuantMode.DYNAMIC):
            continue
        use = mode_use(graph, g.node, QuantMode.DYNAMIC)
        out.append(ForwardGroup(f"{g.label} (dynamic)", {use: QuantType.INT8}, g.kernel,
                                g.weight, node=g.node, mode=QuantMode.DYNAMIC, label=g.label))
    return out


def _outputs_through_tails(graph: Graph, n: int) -> list[str]:
    """``n``'s outputs, and those of a Relu/Clip that alone reads one of them."""
    out = [t for t in graph.nodes[n].output if t]
    for t in list(out):
        readers = graph.consumers.get(t, [])
        if len(readers) == 1 and graph.nodes[readers[0][0]].op_type in TAIL_OPS:
            out += _outputs_through_tails(graph, readers[0][0])
    return out


def forward_search(inputs: ForwardInputs) -> ForwardResult:
    """The in-bound plan built up from float (see the module docstring)."""
    exporter = inputs.exporter
    groups = forward_groups(exporter.graph, inputs.placement,
                            exporter.rules.output_quantized_ops if exporter.rules else frozenset())
    groups += mode_groups(exporter.graph, exporter.rules, groups)
    memo: dict[str, float] = {}

    def err(plan: QuantPlan) -> float:
        if plan.key not in memo:
            value = inputs.error(plan)
            memo[plan.key] = math.inf if math.isnan(value) else float(value)
        return memo[plan.key]

    def of(chosen: list[ForwardGroup]) -> QuantPlan:
        return exporter.plan({u: q for g in chosen for u, q in g.uses.items()})

    timings = _gains(inputs, groups, of)
    gaining = sorted((g for g in groups if g.gain_ms > 0), key=lambda g: -g.gain_ms)
    reserve = 2 * math.ceil(math.log2(len(gaining) + 1)) + 1

    def budget(keep: int = 0) -> bool:
        return len(memo) < inputs.max_evaluations - keep and inputs.time_left()

    for g in gaining:  # the largest gains scored first: a short budget goes where the speed is
        if not budget(reserve):
            break
        g.error = err(of([g]))
    floor = ERROR_FLOOR_SHARE * inputs.bound
    order = sorted((g for g in gaining if not math.isnan(g.error) and g.error <= inputs.bound),
                   key=lambda g: (-g.gain_ms / max(g.error, floor), -g.gain_ms, g.name))
    order = _above_noise(_once_per_node(order), inputs.noise_ms)

    def result(k: int, end: ForwardEnd, next_group: str | None = None) -> ForwardResult:
        for g in order[:k]:
            g.added = True
        plan = of(order[:k]) if k else None
        rest = sorted((g for g in groups if not g.added), key=lambda g: (-g.gain_ms, g.name))
        return ForwardResult(plan, end, order[:k] + rest, err(plan) if plan is not None else 0.0,
                             inputs.bound, len(memo), timings, inputs.float_ms,
                             inputs.noise_ms, next_group)

    if not order:
        if not gaining or sum(g.gain_ms for g in gaining) <= inputs.noise_ms:
            return result(0, ForwardEnd.NO_GAIN)
        scored = [g for g in gaining if not math.isnan(g.error)]
        return result(0, ForwardEnd.NONE_FITS if scored else ForwardEnd.NO_TIME)
    k, cut_short = _longest_prefix(len(order), lambda k: err(of(order[:k])) <= inputs.bound,
                                   budget)
    if k == len(order):
        left = [g for g in gaining if g not in order]
        return result(k, ForwardEnd.NOISE if left else ForwardEnd.EVERY_GROUP)
    if cut_short:
        return result(k, ForwardEnd.NO_TIME)
    return result(k, ForwardEnd.BOUND if k else ForwardEnd.NONE_FITS, order[k].name)


def _gains(inputs: ForwardInputs, groups: list[ForwardGroup],
           of: Callable[[list[ForwardGroup]], QuantPlan]) -> int:
    """Each group's gain alone: the kernel table's figure for its node, else (at most
    ``max_timed`` of them, the heaviest first, while time is left) the float model's latency
    less the model with only that group quantized; gains within ``noise_ms`` count as none
    there (one whole-model timing cannot resolve them). Returns the timings spent."""
    table: Mapping = inputs.kernels.timings if inputs.kernels is not None else {}
    per_element = _conversion_ms(groups, table)
    graph = inputs.exporter.graph
    untimed = []
    for g in groups:
        if g.mode is QuantMode.STATIC and g.label in inputs.float_nodes:
            continue
        t = table.get(g.label)
        if t is not None and g.mode is not QuantMode.STATIC:
            mode_ms, ci = t.mode_ms(g.mode), getattr(t, f"{g.mode.value}_ci")
            if mode_ms is not None and ci is not None:
                g.gain_from = GainSource.KERNEL_TABLE
                # its activations are quantized inside the kernel: no stand-alone Q/DQ
                g.gain_ms = t.float_ms - mode_ms if ci[0] > 1.0 else 0.0
            elif inputs.kernels is None or g.kernel:
                untimed.append(g)
        elif t is not None:
            g.gain_from = GainSource.KERNEL_TABLE
            resolved = t.decision is KernelDecision.INTEGER
            # alone, its input's Q and its output's DQ run stand-alone
            converted = sum(_numel(graph, x) for x in {u[0] for u in g.uses})
            g.gain_ms = t.float_ms - t.int_ms - per_element * converted if resolved else 0.0
        elif inputs.kernels is None or g.kernel:
            untimed.append(g)
    timings = 0
    if inputs.timed is None:
        return timings
    for g in sorted(untimed, key=lambda g: (-g.weight, g.name)):
        if timings >= inputs.max_timed or not inputs.time_left():
            break
        timings += 1
        gain = inputs.float_ms - inputs.timed(of([g]))
        g.gain_from = GainSource.WHOLE_MODEL
        g.gain_ms = gain if gain > inputs.noise_ms else 0.0
    return timings


def _conversion_ms(groups: list[ForwardGroup], table: Mapping) -> float:
    """What one element of a stand-alone Q or DQ costs in ms: :data:`BOUNDARY_MACS`
    multiply-adds at the median ms an integer kernel of the table saves per multiply-add."""
    saved = sorted((t.float_ms - t.int_ms) / g.weight for g in groups
                   if g.mode is QuantMode.STATIC and (t := table.get(g.label)) is not None
                   and g.weight > 0 and t.decision is KernelDecision.INTEGER)
    return BOUNDARY_MACS * saved[len(saved) // 2] if saved else 0.0


def _numel(graph: Graph, tensor: str) -> float:
    shape = graph.shapes.get(tensor)
    ok = shape and all(isinstance(d, int) and d > 0 for d in shape)
    return float(math.prod(shape)) if ok else 0.0


def _once_per_node(order: list[ForwardGroup]) -> list[ForwardGroup]:
    """``order`` with each node's first group only (a node runs in one mode)."""
    seen: set[int] = set()
    out = []
    for g in order:
        if g.node < 0 or g.node not in seen:  # a group of no known node stands alone
            seen.add(g.node)
            out.append(g)
    return out


def _above_noise(order: list[ForwardGroup], noise_ms: float) -> list[ForwardGroup]:
    """``order`` without its tail whose gains together are within ``noise_ms``."""
    left = sum(g.gain_ms for g in order)
    for i, g in enumerate(order):
        if left <= noise_ms:
            return order[:i]
        left -= g.gain_ms
    return order


def _longest_prefix(n: int, holds: Callable[[int], bool],
                    budget: Callable[[], bool]) -> tuple[int, bool]:
    """The largest ``k`` in 0..n for which ``holds(k)``, assuming it holds up to some ``k``:
    gallop (1, 2, 4, ...) then bisect; and whether the budget ended the search first (``k``
    is then the largest shown to hold)."""
    lo, hi, k = 0, n + 1, 1
    while k <= n:
        if not budget():
            return lo, True
        if holds(k):
            lo, k = k, min(2 * k, n) if k < n else n + 1
        else:
            hi = k
            break
    while hi - lo > 1:
        if not budget():
            return lo, True
        mid = (lo + hi) // 2
        if holds(mid):
            lo = mid
        else:
            hi = mid
    return lo, False
