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

Conversions: where an op with no integer kernel on this runtime (LRN, Softmax, ...), or the
model's own input or output, meets a timed node running integer, a standalone Q or DQ converts
the tensor between them (:class:`Boundary`); so does a tensor between two timed nodes of which
one runs integer and the other not. Each is priced by the size of its tensor on the line
through a standalone Q's and DQ's timings on this machine (``KernelTable.conversion_ms``). The
limit then keeps a node float where its integer kernel gains less than the conversions it
would add (a few passes of single-node changes from every node at its faster kernel), and is
never above the placed model's own estimate.

What this cannot see: ops outside the kernel table run at their float time in the estimate,
whatever precision they run in, and a tensor written or read by such an op (a Reshape, an
Add without an integer kernel timed) is not priced as a conversion; so a measured model can be
slower than its estimate, and the report gives that rest too.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from qdq_optuna.measure.kernels import (
    DEQUANTIZE,
    KERNEL_OPS,
    QUANTIZE,
    TAIL_OPS,
    KernelDecision,
    KernelTable,
)
from qdq_optuna.placement.dynamic import QuantMode


@dataclass(frozen=True)
class NodeGap:
    """One timed node: as placed, at its kernel in the limit (its fastest, unless the limit
    keeps it off that one to spare conversions), and whether the two were told apart."""

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


#: report.json's ``gap_by_op`` key of the conversions the placed model has beyond the limit's
CONVERSIONS = "conversions (standalone Q/DQ)"


@dataclass(frozen=True)
class Boundary:
    """A tensor between a timed node's kernel and a float op (an op with no integer kernel on
    this runtime, the model's input or output), or between two timed nodes: where a model
    that runs one side integer and the other not converts it with a standalone Q or DQ."""

    tensor: str
    elements: int
    #: the timed node writing it (through the Relu/Clip its kernel folds in); None: a float op
    #: or the model's input writes it
    writer: str | None
    #: the timed nodes reading it
    readers: tuple[str, ...]
    #: a float op or the model's output reads it too
    float_readers: bool

    def conversions(self, integer: set[str] | frozenset[str]) -> tuple[bool, bool]:
        """(a Q, a DQ) on this tensor when the nodes ``integer`` run integer kernels."""
        writes_int = self.writer is not None and self.writer in integer
        reads_int = any(r in integer for r in self.readers)
        reads_float = self.float_readers or any(r not in integer for r in self.readers)
        return (not writes_int and reads_int, writes_int and reads_float)


def boundaries(prepared, ops: frozenset[str] = KERNEL_OPS) -> list[Boundary]:
    """Every tensor of ``prepared``'s graph where a conversion may stand (:class:`Boundary`),
    with ``ops`` the kernel table's op types; a tensor an op of neither kind writes or reads
    (a Reshape, an untimed Add) is left out: what runs there is not known."""
    g = prepared.graph
    float_only = {n.op_type for n in g.nodes if not prepared.rules.has_integer_kernel(n.op_type)}
    kernel_out: dict[str, str] = {}  # tensor -> the timed node whose kernel writes it
    folded: set[str] = set()  # a kernel's output its folded Relu/Clip reads
    for n in g.nodes:
        if n.op_type not in ops or not n.output:
            continue
        out = n.output[0]
        while True:
            readers = g.consumers.get(out, [])
            if len(readers) != 1 or g.nodes[readers[0][0]].op_type not in TAIL_OPS \
                    or out in g.graph_outputs:
                break
            folded.add(out)
            out = g.nodes[readers[0][0]].output[0]
        kernel_out[out] = n.name
    shapes = g.shapes
    found = []
    for tensor in {t for n in g.nodes for t in n.output if t} | set(g.graph_inputs):
        if tensor in folded:
            continue
        shape = shapes.get(tensor)
        if not shape or not all(isinstance(d, int) and d > 0 for d in shape):
            continue
        writer = kernel_out.get(tensor)
        if writer is None and tensor in g.producer \
                and g.nodes[g.producer[tensor][0]].op_type not in float_only:
            continue  # an op of neither kind writes it
        readers, float_readers = [], tensor in g.graph_outputs
        for k, _ in g.consumers.get(tensor, []):
            node = g.nodes[k]
            if node.op_type in ops:
                readers.append(node.name)
            elif node.op_type in float_only:
                float_readers = True
        if writer is None and not readers or writer is not None and not (
                readers or float_readers):
            continue
        found.append(Boundary(tensor, math.prod(shape), writer, tuple(sorted(set(readers))),
                              float_readers))
    return sorted(found, key=lambda b: b.tensor)


@dataclass(frozen=True)
class Limit:
    """The limit estimate (ms, in the float model's measured terms) and a placed model's
    estimate and gaps; both include the conversions their kernels need."""

    float_ms: float
    limit_ms: float
    placed_ms: float
    nodes: tuple[NodeGap, ...]
    #: the conversions (ms) the limit's and the placed model's kernels need, and how many
    conversions_ms: float = 0.0
    placed_conversions_ms: float = 0.0
    conversions: int = 0
    placed_conversions: int = 0
    #: the timed nodes the limit keeps off their faster kernel to spare conversions
    kept_for_conversions: tuple[str, ...] = field(default=())

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
        """Op type -> its nodes' gap (ms), and :data:`CONVERSIONS` -> the conversions the
        placed model has beyond the limit's; largest first (no entry: no gap)."""
        out: dict[str, float] = defaultdict(float)
        for n in self.nodes:
            if n.gap_ms > 0:
                out[n.op] += n.gap_ms
        extra = self.placed_conversions_ms - self.conversions_ms
        if extra > 0:
            out[CONVERSIONS] += extra
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
                "conversions_ms": r(self.conversions_ms), "conversions": self.conversions,
                "placed_conversions_ms": r(self.placed_conversions_ms),
                "placed_conversions": self.placed_conversions,
                "kept_for_conversions": list(self.kept_for_conversions),
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
             patterns: dict[str, str], modes: dict[str, str] | None = None,
             bounds: list[Boundary] | None = None) -> Limit:
    """The limit from ``table`` and the float model's latency ``float_ms`` (each timed node
    at its fastest kernel, per-node modes included where timed, and the conversions at
    ``bounds`` those kernels need: :func:`boundaries`), and the model whose nodes
    ``integer_nodes`` are set up as static integer kernels and ``modes`` (node -> mode name)
    run in a per-node mode, estimated the same way."""
    modes = modes or {}
    kernels_of = {name: _kernels(t) for name, t in table.timings.items()}
    placed = {name: modes.get(name) if modes.get(name) in kernels else (
        KernelDecision.INTEGER.value if name in integer_nodes else KernelDecision.FLOAT.value)
        for name, kernels in kernels_of.items()}
    choice = {name: min(kernels, key=lambda k: kernels[k][0])
              for name, kernels in kernels_of.items()}
    priced = _Conversions(table, bounds or ())
    kept = priced.settle(choice, kernels_of)

    def total(kernels_chosen: dict[str, str]) -> tuple[float, float, int]:
        conv, count = priced.cost(_integer(kernels_chosen))
        return sum(kernels_of[n][k][0] for n, k in kernels_chosen.items()), conv, count

    rest = max(float_ms - sum(t.float_ms for t in table.timings.values()), 0.0)
    placed_kernels, placed_conv, placed_n = total(placed)
    limit_kernels, limit_conv, limit_n = total(choice)
    if limit_kernels + limit_conv > placed_kernels + placed_conv:  # the placed model is one
        choice, kept = dict(placed), set()
        limit_kernels, limit_conv, limit_n = placed_kernels, placed_conv, placed_n
    # each node's gap is to its kernel in the limit (a node the limit keeps float to spare
    # conversions has none when placed float); counted where the two were told apart
    nodes = tuple(NodeGap(name, t.op, patterns.get(name), placed[name],
                          kernels_of[name][placed[name]][0], kernels_of[name][choice[name]][0],
                          _told_apart(kernels_of[name], placed[name], choice[name]))
                  for name, t in table.timings.items())
    return Limit(float_ms, rest + limit_kernels + limit_conv,
                 rest + placed_kernels + placed_conv, nodes, limit_conv, placed_conv,
                 limit_n, placed_n, tuple(sorted(kept)))


def _integer(choice: dict[str, str]) -> set[str]:
    return {n for n, k in choice.items() if k == KernelDecision.INTEGER.value}


class _Conversions:
    """The conversions a choice of kernels needs at the boundaries whose timed nodes the
    table has, priced by the table's standalone Q and DQ timings."""

    #: passes of single-node changes :meth:`settle` makes at most
    PASSES = 4

    def __init__(self, table: KernelTable, bounds) -> None:
        timed = table.timings
        self.bounds, self.q_ms, self.dq_ms = [], [], []
        for b in bounds:
            if (b.writer is not None and b.writer not in timed) or any(
                    r not in timed for r in b.readers):
                continue  # a kernel not timed: what runs there is not known
            q = table.conversion_ms(QUANTIZE, b.elements)
            dq = table.conversion_ms(DEQUANTIZE, b.elements)
            if q is None or dq is None:
                continue
            self.bounds.append(b)
            self.q_ms.append(q)
            self.dq_ms.append(dq)
        self.near: dict[str, list[int]] = defaultdict(list)
        for i, b in enumerate(self.bounds):
            for n in ({b.writer} - {None}) | set(b.readers):
                self.near[n].append(i)

    def cost(self, integer: set[str], only: list[int] | None = None) -> tuple[float, int]:
        """(ms, count) of the conversions when ``integer`` run integer kernels."""
        ms, count = 0.0, 0
        for i in (range(len(self.bounds)) if only is None else only):
            q, dq = self.bounds[i].conversions(integer)
            ms += q * self.q_ms[i] + dq * self.dq_ms[i]
            count += q + dq
        return ms, count

    def settle(self, choice: dict[str, str], kernels_of: dict[str, dict]) -> set[str]:
        """Change ``choice`` in place, one node at a time, where a node's other kernel (its
        integer one, or its fastest non-integer one) costs less with the conversions it
        changes; returns the nodes left off their fastest kernel."""
        integer_k = KernelDecision.INTEGER.value
        fastest, integer = dict(choice), _integer(choice)
        for _ in range(self.PASSES):
            changed = False
            for node in sorted(self.near):
                kernels = kernels_of.get(node)
                if kernels is None or integer_k not in kernels:
                    continue
                other = integer_k if choice[node] != integer_k else min(
                    (k for k in kernels if k != integer_k), key=lambda k: kernels[k][0])
                now = kernels[choice[node]][0] + self.cost(integer, self.near[node])[0]
                then = kernels[other][0] + self.cost(integer ^ {node}, self.near[node])[0]
                if then < now - 1e-9:
                    choice[node], changed = other, True
                    integer ^= {node}
            if not changed:
                break
        return {n for n in choice if choice[n] != fastest[n]}


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
