"""The limit: a measured estimate of the fastest this model runs on this runtime and machine,
and where a model's gap to it is.

From the run's kernel table (:mod:`~qdq_optuna.measure.kernels`: each Conv/Gemm/MatMul the
runtime ran integer, timed as its integer kernel and as its float one on this machine (a
MatMul also in each per-node mode the run searches: dynamic, weight-only), and,
where the runtime's profile lists them, every node of the ops it has other integer kernels for:
MaxPool, Concat, Add, Resize, ... as op units): every timed node at its faster kernel, every
other op at its float time (the float model's latency less the timed nodes' float times). A
model placed by the search is estimated the same way with each timed node at the kernel it was
placed as; its *gap* is what its nodes lose against their faster kernel, per node, op type and
pattern. A node's gap counts only where its two kernels were told apart (the A/B interval of
integer vs float excludes 1): a tie is no gap.

What this cannot see: ops outside the kernel table (LRN, Softmax, ...) run at their float time
in the estimate, and a conversion (a standalone Q or DQ) costs nothing in it; so a measured
model can be slower than its estimate, and the report gives that rest too.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass

from qdq_optuna.measure.kernels import KERNEL_OPS, KernelDecision, KernelTable
from qdq_optuna.placement.dynamic import QuantMode


@dataclass(frozen=True)
class NodeGap:
    """One timed node: as placed, at its best, and whether its two kernels were told apart."""

    node: str
    op: str
    pattern: str | None
    placed: str  # "integer" or "float"
    placed_ms: float
    best_ms: float
    resolved: bool

    @property
    def gap_ms(self) -> float:
        return self.placed_ms - self.best_ms if self.resolved else 0.0


@dataclass(frozen=True)
class Limit:
    """The limit estimate (ms, in the float model's measured terms) and a placed model's
    estimate and gaps."""

    float_ms: float
    limit_ms: float
    placed_ms: float
    nodes: tuple[NodeGap, ...]

    @property
    def gap_share(self) -> float:
        """The placed model's estimated share of time above the limit."""
        return (self.placed_ms - self.limit_ms) / self.placed_ms if self.placed_ms > 0 else 0.0

    def by_pattern(self) -> dict[str, float]:
        """Pattern id -> its nodes' gap (ms), largest first (no entry: no gap)."""
        out: dict[str, float] = defaultdict(float)
        for n in self.nodes:
            if n.gap_ms > 0 and n.pattern is not None:
                out[n.pattern] += n.gap_ms
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def by_op(self) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for n in self.nodes:
            if n.gap_ms > 0:
                out[n.op] += n.gap_ms
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def to_dict(self) -> dict:
        """report.json's ``limit`` (ms in the in-search baseline's terms; ``limit_ratio``:
        the limit over the float model, what the report scales the final A/B's baseline by)."""
        r = lambda x: round(x, 6)  # noqa: E731
        return {"float_ms": r(self.float_ms), "limit_ms": r(self.limit_ms),
                "limit_ratio": r(self.limit_ms / self.float_ms) if self.float_ms else None,
                "placed_ms": r(self.placed_ms), "placed_ratio":
                r(self.placed_ms / self.float_ms) if self.float_ms else None,
                "timed_nodes": len(self.nodes),
                "timed_by_op": dict(sorted(Counter(n.op for n in self.nodes).items())),
                "gap_by_pattern": {k: r(v) for k, v in self.by_pattern().items()},
                "gap_by_op": {k: r(v) for k, v in self.by_op().items()},
                "nodes": [{"node": n.node, "op": n.op, "pattern": n.pattern,
                           "placed": n.placed, "placed_ms": r(n.placed_ms),
                           "best_ms": r(n.best_ms), "gap_ms": r(n.gap_ms)}
                          for n in sorted(self.nodes, key=lambda n: -n.gap_ms) if n.gap_ms > 0]}


def node_patterns(prepared) -> dict[str, str]:
    """Node name -> the pattern whose region holds it (the pattern of the uses it reads)."""
    g = prepared.graph
    out: dict[str, str] = {}
    for pp in prepared.tunable:
        for _, node, _ in pp.uses(pp.ids):
            if 0 <= node < len(g.nodes):
                out.setdefault(g.nodes[node].name, pp.pattern.id)
    return out


def _kernels(t) -> dict[str, tuple[float, tuple[float, float] | None]]:
    """A timed node's kernels: name -> (ms, the interval of float / that kernel; None for
    float itself): the static integer one and float always, each per-node mode's where timed
    (a MatMul run dynamically, or weight-only)."""
    out = {KernelDecision.INTEGER.value: (t.int_ms, (t.ci_low, t.ci_high)),
           KernelDecision.FLOAT.value: (t.float_ms, None)}
    for mode in (m.value for m in QuantMode if m.per_node):  # KernelTiming's column names
        ms = getattr(t, f"{mode}_ms")
        if ms is not None:
            out[mode] = (ms, getattr(t, f"{mode}_ci"))
    return out


def _told_apart(kernels: dict, a: str, b: str) -> bool:
    """Whether kernels ``a`` and ``b`` of one node measured apart: each against float's
    interval excludes the other's (a kernel against float: its own interval excludes 1)."""
    if a == b:
        return False
    ci = {k: (1.0, 1.0) if v[1] is None else v[1] for k, v in kernels.items()}
    (lo_a, hi_a), (lo_b, hi_b) = ci[a], ci[b]
    return hi_a < lo_b or hi_b < lo_a


def estimate(table: KernelTable, float_ms: float, integer_nodes: set[str],
             patterns: dict[str, str], modes: dict[str, str] | None = None) -> Limit:
    """The limit from ``table`` and the float model's latency ``float_ms`` (each timed node
    at its fastest kernel, per-node modes included where timed), and the model whose nodes
    ``integer_nodes`` are set up as static integer kernels and ``modes`` (node -> mode name)
    run in a per-node mode, estimated the same way."""
    nodes, timed_float, best_sum, placed_sum = [], 0.0, 0.0, 0.0
    modes = modes or {}
    for name, t in table.timings.items():
        kernels = _kernels(t)
        best_kernel = min(kernels, key=lambda k: kernels[k][0])
        best = kernels[best_kernel][0]
        placed = modes.get(name) if modes.get(name) in kernels else (
            KernelDecision.INTEGER.value if name in integer_nodes
            else KernelDecision.FLOAT.value)
        placed_ms = kernels[placed][0]
        nodes.append(NodeGap(name, t.op, patterns.get(name), placed, placed_ms, best,
                             _told_apart(kernels, placed, best_kernel)))
        timed_float += t.float_ms
        best_sum += best
        placed_sum += placed_ms
    rest = max(float_ms - timed_float, 0.0)
    return Limit(float_ms, rest + best_sum, rest + placed_sum, tuple(nodes))


#: a visit is planned when the gap it can close is above this share of the standing model's
#: estimated time: the whole-model A/B's resolution (the timing protocol's target half-width
#: is 1.5 %), below which a commit cannot be confirmed anyway
NOISE_SHARE = 0.015
#: why the plan skipped a pattern, and why it ended a lane
WITHIN_NOISE = ("gap within noise: its timed nodes run at their faster measured "
                "kernel (or within {noise:.3g} ms of it) and the runtime left nothing "
                "unfused in it")
#: how a visit the lane's realization score skipped is said (``search._descent.NOT_EXPECTED``;
#: the report counts those skips by it)
NOT_EXPECTED_PREFIX = "expected gain within noise"
LEFT_WITHIN_NOISE = ("what is left is within noise: the standing model is {gap:.3g} ms from "
                     "the limit estimate (noise {noise:.3g} ms) and the runtime left nothing "
                     "unfused")


@dataclass(frozen=True)
class GapPlan:
    """One round's visits as the gap plans them: the patterns in visit order (largest gap
    first, then those where the runtime left something unfused, then the rest in their
    order), the ones skipped and why, each pattern's gap (ms) and the noise floor (ms)."""

    order: tuple[str, ...]
    skipped: dict[str, str]
    gaps: dict[str, float]
    noise_ms: float
    #: the lane ends here (None: it goes on)
    end: str | None = None

    def to_dict(self) -> dict:
        return {"order": list(self.order), "skipped": dict(self.skipped),
                "gaps": {k: round(v, 6) for k, v in self.gaps.items()},
                "noise_ms": round(self.noise_ms, 6), "end": self.end}


def plan_visits(pattern_ids: list[str], limit: Limit, unfused: dict[str, bool],
                heavy: dict[str, set[str]], standing_ms: float | None = None) -> GapPlan:
    """The round's visits by the gap. ``unfused``: pattern id -> whether the runtime left
    something unfused in it; ``heavy``: pattern id -> its nodes of the table's op types. A pattern
    is skipped only when every heavy node of it was timed, its gap is within noise and the
    runtime left nothing unfused in it (a pattern of other ops, or one with an untimed
    node, is visited: the estimate cannot speak for it); the lane ends when that holds for
    the whole standing model. ``standing_ms``: the standing model's measured latency, the
    noise floor's base (its estimate when not given: the estimate adds the float model's
    whole-model time to kernels timed alone, and reads high when the two disagree)."""
    noise = NOISE_SHARE * (standing_ms or limit.placed_ms)
    by_node = {n.node: n.gap_ms for n in limit.nodes}
    # a node read by two patterns' uses counts for both: either visit may close its gap
    gaps = {p: sum(by_node.get(n, 0.0) for n in heavy.get(p, ())) for p in pattern_ids}
    gaps = {p: g for p, g in gaps.items() if g > 0}
    left = limit.placed_ms - limit.limit_ms
    if left <= noise and not any(unfused.values()):
        return GapPlan((), {}, gaps, noise, LEFT_WITHIN_NOISE.format(gap=left, noise=noise))
    skipped = {p: WITHIN_NOISE.format(noise=noise) for p in pattern_ids
               if heavy.get(p) and heavy[p] <= by_node.keys()
               and gaps.get(p, 0.0) <= noise and not unfused.get(p, True)}
    rank = {p: i for i, p in enumerate(pattern_ids)}
    order = sorted((p for p in pattern_ids if p not in skipped),
                   key=lambda p: (-gaps[p] if gaps.get(p, 0.0) > noise else 0.0,
                                  not unfused.get(p, True), rank[p]))
    return GapPlan(tuple(order), skipped, gaps, noise)


def heavy_nodes(prepared, ops: frozenset[str] = KERNEL_OPS) -> dict[str, set[str]]:
    """Pattern id -> the nodes of ``ops`` (the kernel table's op types) among the nodes its
    uses read into."""
    g, out = prepared.graph, {}
    for pp in prepared.tunable:
        out[pp.pattern.id] = {g.nodes[u[1]].name for u in pp.uses(pp.ids)
                              if 0 <= u[1] < len(g.nodes)
                              and g.nodes[u[1]].op_type in ops}
    return out
