"""Where the runtime left something a move can win: the standing model's "what ran"
(:class:`~qdq_optuna.backends.what_ran.WhatRan`), read once per standing model, never per trial.

A Q/DQ pair the runtime fused into an integer kernel, with no float compute next to it and no
reformat at it, has nothing to gain from removal: a move that only switches such pairs off is
not measured. A move is kept when one of its tensors has a standalone Q or DQ or a reformat,
when a node reading or writing one of its tensors ran in float next to integer neighbours, or
when it switches a point on (the report says nothing about a pair that is not there yet).

On a measured backend whose report names the nodes it ran inside integer layers (OpenVINO's
runtime graph), a move that switches points on is dropped too when every node reading or
writing their tensors already ran integer, with no reformat or standalone Q/DQ there: the new
pair can change no layer's precision, only add a requantization (*settled* points). From
NNCF's placement on a real YOLOv8n every backbone layer runs u8, so of its moves only those at
the detection head's float Concats and Softmax, and at the image input, are measured; each
other one cost a 12-round A/B of about a minute that could not separate (intervals +-15 %).
The size rule below covers additions too: a pair added where no multiply-add op may change
precision saves at most an element-wise pass over its tensors and the outputs of the nodes
reading them.

On a measured backend (not a deterministic one) a move is also dropped when the work it can
save is too small to measure (additions: :meth:`Unfused.added`). Removing a Q/DQ pair saves
at most the standalone Q and DQ ops on its tensor (an element-wise pass each), so a move whose
standalone Q/DQ and float-island tensors hold less than :data:`MIN_RESOLVABLE_SHARE` of the
model's activation elements cannot show a gain an interleaved A/B resolves (a move at a
reformat, or on a tensor of unknown size, is always kept). On a real YOLOv8n (ONNX Runtime CPU)
this leaves the detection head's decode (six 4,200-element tensors, 0.2 % of 14.8 M) unmeasured:
each of its eleven moves cost a 12-round A/B that could not separate (intervals +-10 %).

With kernel evidence (``Config.kernel_evidence``, a measured backend): "fused, so futile" is
false where the runtime's integer kernel is slower than its float one (Inception v1's 1x1
Convs on an AVX512-VNNI CPU, ONNX Runtime 1.32: 1.245x over FP32 with them float, 1.174x with
every Conv integer). So each integer kernel of the standing model is timed against its float
kernel on this machine (:func:`~qdq_optuna.measure.kernels.kernel_table`, cached per runtime
and CPU flags), and a fused pair next to such a node is pruned only where the integer kernel
measured faster (the A/B interval excludes 1); where float measured faster, or the two could
not be told apart, the removal is measured, and removals the table says gain are proposed
first, by the measured gain (``gains``).

A visit with no move kept is skipped; a round that changes nothing ends the lane (with
:data:`FINAL_LINE` when the report skipped any of its visits).
A backend that cannot tell (``what_ran`` returns None) prunes nothing.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Iterable
from contextlib import nullcontext as _nothing

from qdq_optuna.backends.what_ran import WhatRan
from qdq_optuna.measure.kernels import (
    KERNEL_OPS,
    KernelCache,
    KernelDecision,
    KernelTable,
    kernel_cache,
    units,
    with_shapes,
    with_tails,
)
from qdq_optuna.placement.dynamic import QuantMode, node_modes, use_mode
from qdq_optuna.search._moves import Point

log = logging.getLogger("qdq_optuna")

#: the line that ends a descent the runtime says is done
FINAL_LINE = "nothing the runtime left unfused: the standing model is final"
#: on a measured backend, a removal whose standalone Q/DQ and float-island tensors hold less
#: than this share of the model's activation elements is not measured (an element-wise pass
#: over 1 % of the activations is far below the A/B's resolution: its target half-width is
#: 1.5 %, and every activation element of a convolution costs many multiply-adds besides)
MIN_RESOLVABLE_SHARE = 0.01
#: why a move was dropped (the skip reasons of a visit)
FUSED = "fused"
TOO_SMALL = "too small"
INTEGER = "integer"
#: ops whose work grows faster than their tensors' elements (multiply-adds per element): a pair
#: added next to one that may change precision is never too small to measure
HEAVY_OPS = frozenset({"Conv", "ConvTranspose", "MatMul", "Gemm", "Einsum"})


class Unfused:
    """The standing models' reports (by plan key) and the moves they leave worth measuring."""

    def __init__(self, search, uses_of: dict[Point, frozenset]) -> None:
        self.s = search
        self.uses_of = uses_of
        self.backend = search.plans.measurer.backend if search.plans is not None else None
        self.read: dict[str, WhatRan | None] = {}
        #: how often a report was read (once per standing model)
        self.reads = 0
        plans = getattr(search, "plans", None)
        #: whether gains below a measurement's resolution are dropped (measured backends)
        self.measured = plans is not None and not plans.deterministic
        self.numel = _numel(search.prepared.graph)
        self.total = sum(n for n in self.numel.values() if n)
        #: the kernel evidence so far (every standing model's integer kernels, merged); None:
        #: not measured (an exact backend, or ``kernel_evidence`` off)
        self.kernels: KernelTable | None = None
        self.evidence = self.measured and self.backend is not None and kernels_timed(search)
        #: whether the every-point-on model's kernels were timed (:func:`every_point_model`)
        self._offered_timed = False

    def of(self, schemes: dict[str, dict[str, int]], lane: str | None = None
           ) -> WhatRan | None:
        """The report for the whole model at ``schemes`` (with ``lane``'s pinned uses; read
        at most once per model)."""
        if self.backend is None:
            return None
        exporter = self.s.exporter
        plan = exporter.plan(self.s.record.uses(schemes, self.s.record.pinned(lane)))
        if plan.key not in self.read:
            self.read[plan.key] = self._read(exporter, plan)
        return self.read[plan.key]

    def _read(self, exporter, plan) -> WhatRan | None:
        step = getattr(self.s, "wall", None)
        try:
            with step.step("descent", "what ran") if step else _nothing():
                model = exporter.to_bytes(plan)
                what = self.backend.what_ran(model)
        except Exception as exc:  # a report is an optimisation: never the run's failure
            log.info("what the runtime ran could not be read (%s): nothing is pruned", exc)
            return None
        self.reads += 1
        left = getattr(self.s, "remaining", lambda: None)()
        if what is not None and self.evidence and (left is None or left > 0):  # time left
            with step.step("descent", "kernel timing") if step else _nothing():
                self._time_kernels(exporter, model, what)
                if self.kernels is not None and not self._offered_timed:  # once a run
                    self._offered_timed = True
                    read = every_point_model(self.s, exporter, self.backend,
                                             set(self.kernels.timings))
                    if read is not None:
                        self._time_kernels(exporter, *read)
        if what is not None:
            log.info("what ran (%s): %d Q/DQ fused, %d standalone, %d float next to integer, "
                     "%d reformats", what.how, len(what.fused), len(what.standalone),
                     len(what.float_nodes), len(what.reformats))
        return what

    def standing_placed(self, schemes: dict[str, dict[str, int]], lane: str | None = None
                        ) -> tuple[set[str] | None, dict[str, str]]:
        """The nodes the standing model at ``schemes`` sets up as static integer kernels
        (None: no kernel table yet, or not readable) and those it runs in a per-node mode."""
        if self.kernels is None:
            return None, {}
        uses = self.s.record.uses(schemes, self.s.record.pinned(lane))
        model = self.s.exporter.to_bytes(self.s.exporter.plan(uses))
        return placed_and_modes(self.kernels, model)

    def pattern_sites(self, what: WhatRan | None) -> dict[str, bool]:
        """Pattern id -> whether the runtime left something unfused in it that a move can
        close: a standalone Q or DQ or a reformat at one of its tensors, or a node of it that
        ran float next to integer ones (what a conversion move can close). A conversion no
        placement can avoid does not count (:func:`unavoidable`)."""
        if what is None:
            return {}
        g, out = self.s.prepared.graph, {}
        kept, floats = unavoidable(self.s.prepared, self.kernels, what)
        left = (what.standalone | what.reformats) - kept
        for pp in self.s.prepared.tunable:
            uses = pp.uses(pp.ids)
            tensors = {u[0] for u in uses}
            nodes = {g.nodes[u[1]].name for u in uses if 0 <= u[1] < len(g.nodes)}
            out[pp.pattern.id] = bool(tensors & left or nodes & (what.float_nodes - floats))
        return out

    def _time_kernels(self, exporter, model: bytes, what: WhatRan) -> None:
        """Time the standing model's integer kernels not timed yet (those that ran float in
        the whole model left out); merged into :attr:`kernels`."""
        timed = set(self.kernels.timings if self.kernels else ())
        try:
            table = time_kernels(self.s, model, self._cache(), skip=what.float_nodes | timed,
                                 timed=timed, deadline=self.s.plans.measurer.deadline)
        except Exception as exc:  # evidence is an optimisation: never the run's failure
            log.info("kernels could not be timed (%s): fused pairs are pruned as before", exc)
            return
        log.info("kernel evidence: %d timed, %d from the cache (%.1f s); float faster at %d of "
                 "%d", table.timed, table.cached, table.seconds,
                 sum(t.decision == "float" for t in table.timings.values()), len(table.timings))
        if self.kernels is None:
            self.kernels = table
        else:
            self.kernels.merge(table)

    def _cache(self) -> KernelCache | None:
        """``--kernel-cache``'s cache, opened on first use (None: off)."""
        if not hasattr(self, "_kernel_cache"):
            self._kernel_cache = kernel_cache(getattr(self.s, "kernel_cache", None))
        return self._kernel_cache

    def kernel_sites(self, tensor: str, node: int) -> list[str]:
        """Why removing a fused pair at ``tensor`` (read by ``node``) may still win by the
        kernel evidence: its reader or producer measured float faster, or not slower."""
        if self.kernels is None:
            return []
        g = self.s.prepared.graph
        names = [g.nodes[node].name]
        if tensor in g.producer:
            names.append(g.nodes[g.producer[tensor][0]].name)
        out = []
        for n in names:
            t = self.kernels.timings.get(n)
            if t is not None and t.decision != "integer":
                out.append(f"kernel {n}: {t.decision} (int {t.int_ms:.3g} ms, float "
                           f"{t.float_ms:.3g} ms)")
        return out

    def gains(self, what: WhatRan | None) -> Callable[[Point], float] | None:
        """Per point: the ms its removal saves by the kernel table (the nodes next to its
        tensors measured float faster, each counted once); None without evidence."""
        if what is None or self.kernels is None:
            return None
        g = self.s.prepared.graph

        def gain(pt: Point) -> float:
            _, nodes = self._around(pt)
            ts = [self.kernels.timings.get(g.nodes[n].name) for n in nodes]
            return sum(t.gain_ms for t in ts if t is not None and t.decision == "float")
        return gain

    def add_gains(self) -> Callable[[Point], float]:
        """Per point: the ms adding its Q/DQ can save by the kernel table (the nodes next to
        its tensors whose integer kernel measured faster, each counted once): a move that
        sets up an integer MaxPool, Concat or Add where the runtime has the kernel goes first."""
        g, timings = self.s.prepared.graph, self.kernels.timings

        def gain(pt: Point) -> float:
            _, nodes = self._around(pt)
            ts = [timings.get(g.nodes[n].name) for n in nodes]
            return sum(-t.gain_ms for t in ts
                       if t is not None and t.decision is KernelDecision.INTEGER)
        return gain

    def site_tensors(self, points: Iterable[Point], what: WhatRan) -> dict[str, list[str]]:
        """Tensor -> why a move over ``points`` can still win there (empty: it cannot)."""
        g = self.s.prepared.graph
        found: dict[str, list[str]] = {}
        for pt in points:
            for tensor, node, _ in self.uses_of[pt]:
                why = found.setdefault(tensor, [])
                if tensor in what.standalone:
                    why.append(f"standalone Q/DQ at {tensor}")
                if tensor in what.reformats:
                    why.append(f"reformat at {tensor}")
                names = [g.nodes[node].name]
                if tensor in g.producer:
                    names.append(g.nodes[g.producer[tensor][0]].name)
                why.extend(f"float {n}" for n in names if n in what.float_nodes)
                if tensor in what.fused and tensor not in what.standalone:
                    why.extend(self.kernel_sites(tensor, node))
        return {t: why for t, why in found.items() if why}

    # -- for our sampler's move engine, which drops a visit's moves by these -----------------
    def point_sites(self, what: WhatRan | None) -> Callable[[Point], dict[str, int]] | None:
        """Per point: the tensors where removing its Q/DQ may still win, with their
        activation elements (-1: a reformat there, or a size unknown: never too small to
        measure); empty: the runtime fused it. None: no report (nothing is pruned)."""
        if what is None:
            return None

        def sites(pt: Point) -> dict[str, int]:
            return {t: -1 if t in what.reformats or self.numel.get(t) is None
                    or any(w.startswith("kernel ") for w in why)
                    else self.numel[t] for t, why in self.site_tensors([pt], what).items()}
        return sites

    def settled(self, what: WhatRan | None) -> Callable[[Point], bool] | None:
        """Per point: whether a Q/DQ pair there can change no layer's precision, by the report:
        every node reading or writing its tensors ran inside an integer layer, and no reformat
        or standalone Q/DQ is at them (a graph input never is: the runtime converts it). None
        when the report cannot tell (no ``integer_nodes``) or the backend is exact (it prices
        any change)."""
        if what is None or what.integer_nodes is None or not self.measured:
            return None
        g, integer = self.s.prepared.graph, what.integer_nodes

        def settled(pt: Point) -> bool:
            tensors, nodes = self._around(pt)
            return all(t in g.producer for t in tensors) \
                and not tensors & (what.reformats | what.standalone) \
                and all(g.nodes[n].name in integer for n in nodes)
        return settled

    def added(self, what: WhatRan | None) -> Callable[[Point], int] | None:
        """Per point: the activation elements a Q/DQ pair added there can save work on (its
        tensors and the outputs of the nodes reading them), -1 when unbounded: a size is
        unknown, or a node next to it does multiply-adds (:data:`HEAVY_OPS`) and is not known
        to have run integer already. None on an exact backend, or without a report."""
        if what is None or not self.measured:
            return None
        g, integer = self.s.prepared.graph, what.integer_nodes or frozenset()

        def elements(pt: Point) -> int:
            tensors, nodes = self._around(pt)
            if any(g.nodes[n].op_type in HEAVY_OPS and g.nodes[n].name not in integer
                   for n in nodes):
                return -1
            written = {t for _, n, _ in self.uses_of[pt] for t in g.nodes[n].output if t}
            sizes = [self.numel.get(t) for t in tensors | written]
            return -1 if any(n is None for n in sizes) else sum(sizes)
        return elements

    def _around(self, pt: Point) -> tuple[set[str], set[int]]:
        """A point's tensors, and the nodes reading or writing them (by index)."""
        g = self.s.prepared.graph
        tensors = {tensor for tensor, _, _ in self.uses_of[pt]}
        nodes = {node for _, node, _ in self.uses_of[pt]}
        nodes |= {g.producer[t][0] for t in tensors if t in g.producer}
        return tensors, nodes

    def pruning(self, schemes: dict[str, dict[str, int]], lane: str | None = None) -> dict:
        """The standing model's report as the keyword arguments of
        :meth:`~qdq_optuna.search._moves.MoveSpace.visit` (read once per standing model)."""
        return self.pruning_of(self.of(schemes, lane))

    def pruning_of(self, what: WhatRan | None) -> dict:
        """:meth:`pruning` from a report (and the kernel evidence so far)."""
        out = {"sites": self.point_sites(what), "resolvable": self.resolvable(),
               "settled": self.settled(what), "added": self.added(what)}
        gains = self.gains(what)
        if gains is None:
            return out
        return {**out, "gains": gains, "add_gains": self.add_gains()}

    def resolvable(self) -> dict | None:
        """What a removal must touch to be measured: ``min_share`` of ``total`` activation
        elements (None: an exact backend measures any gain)."""
        return {"min_share": MIN_RESOLVABLE_SHARE, "total": self.total} if self.measured \
            else None


def kernels_timed(search) -> bool:
    """Whether ``search`` times kernels: its runtime's profile can (``kernel_timing``) and
    ``Config.kernel_evidence`` is on."""
    return getattr(search, "kernel_timing", None) is not None and \
        getattr(search.config, "kernel_evidence", False)


def time_kernels(search, model: bytes, cache: KernelCache | None, *, skip: Iterable[str],
                 deadline: float | None, timed: Iterable[str] = ()) -> KernelTable:
    """The kernel table of ``model`` (a Q/DQ model of ``search``'s graph) against its float
    export: ``skip``'s nodes (run float in the whole model, or timed already) left out,
    ``timed``'s op units too; no new timing past ``deadline``. The run's first table (none
    ``timed``) also times a standalone Q and DQ (the conversions' prices)."""
    import onnx

    exporter = search.exporter
    timed = set(timed)
    return search.kernel_timing(
        onnx.load_from_string(exporter.to_bytes(exporter.plan(set()))),
        onnx.load_from_string(model), cache=cache, skip=skip, timed=timed, deadline=deadline,
        conversions=not timed)


def unavoidable(prepared, kernels: KernelTable | None, what: WhatRan
            ) -> tuple[set[str], set[str]]:
    """``(tensors, nodes)`` of ``prepared``'s graph, by ``what`` ran and the ``kernels``
    table: the float nodes no placement can make integer (an op the
    runtime has no integer kernel for, ``rules.quantizable_ops``: ONNX Runtime's LRN,
    BatchNormalization), and the conversions no placement can avoid without giving up a
    kernel measured faster as integer: a standalone Q/DQ or reformat between such a node
    (or the model's own input or output) and nodes whose integer kernels the kernel
    table measured faster, every one of them. A visit for such a conversion only tries
    to give those kernels up. Inception v1 (onnx's test data, ONNX Runtime): the stem's
    visit tried five such moves, each 1.00-1.11x slower, for 35 s. Where a neighbour's
    integer kernel was not measured faster (DenseNet's Mul after a BatchNormalization:
    removing that conversion gained 2 %), the conversion still counts."""
    g = prepared.graph
    timings = kernels.timings if kernels is not None else {}
    float_only = {i for i, n in enumerate(g.nodes)
                  if not prepared.rules.has_integer_kernel(n.op_type)}
    ends = set(g.graph_inputs) | set(g.graph_outputs)
    tensors = set()
    for t in what.standalone | what.reformats:
        touching = {n for n, _ in g.consumers.get(t, [])}
        if t in g.producer:
            touching.add(g.producer[t][0])
        others = touching - float_only
        # each neighbour with the ops it fuses with (a Relu counts as its Conv's kernel)
        if (t in ends or touching & float_only) and others and all(
                any(_integer_faster(timings.get(g.nodes[k].name)) for k in with_tails(g, {n}))
                for n in others):
            tensors.add(t)
    return tensors, {g.nodes[i].name for i in float_only} & what.float_nodes


def every_point_model(search, exporter, backend, timed: set[str]
                      ) -> tuple[bytes, WhatRan] | None:
    """The model with every offered static point on and what ran of it (its MatMuls' mode
    kernels are timed beside their static ones where the runtime has them), where a node of
    ``KERNEL_OPS`` is not in ``timed`` (it runs float in the standing model: a float start, a
    repaired one); else None. Timing its kernels lets the gap plan say which patterns' integer
    kernels would gain, instead of visiting every pattern it cannot speak for. ShuffleNet
    (onnx's test data) on ONNX Runtime: float was the best start (every quantized start ran
    2.3x slower) and the descent visited all 13 patterns for 95 s without a commit."""
    pm = search.prepared
    if {n.name for n in pm.graph.nodes if n.op_type in KERNEL_OPS} <= timed:
        return None
    # static points only: a node with a mode point on runs that mode, not a static unit
    every = exporter.plan(search.record.uses(
        {pp.pattern.id: {pid: int(not any(use_mode(u) is not None for u in pp.uses([pid])))
                         for pid in pp.ids} for pp in pm.tunable}))
    try:
        model = exporter.to_bytes(every)
        what = backend.what_ran(model)
    except Exception as exc:  # evidence is an optimisation: never the run's failure
        log.info("what ran with every point on could not be read (%s)", exc)
        return None
    return None if what is None else (model, what)


def _integer_faster(timing) -> bool:
    return timing is not None and timing.decision is KernelDecision.INTEGER


def skip_reason(dropped: Counter) -> str:
    """A skipped visit's reason: what its dropped moves could not win."""
    parts = []
    if dropped[FUSED]:
        parts.append(f"{dropped[FUSED]} only remove Q/DQ the runtime fused, with no float or "
                     "reformat next to them")
    if dropped[TOO_SMALL]:
        parts.append(f"{dropped[TOO_SMALL]} only change element-wise work on under "
                     f"{MIN_RESOLVABLE_SHARE:.0%} of the model's activations: a gain "
                     "too small to measure")
    if dropped[INTEGER]:
        parts.append(f"{dropped[INTEGER]} only add Q/DQ where every neighbouring layer "
                     "already ran integer (no layer's precision would change)")
    return f"all {sum(dropped.values())} move(s): " + "; ".join(parts)


def _numel(graph) -> dict[str, int | None]:
    """Elements of every activation tensor (graph inputs and node outputs; None when a
    dimension is unknown)."""
    tensors = {t for n in graph.nodes for t in n.output if t}
    tensors |= {vi.name for vi in graph.model.graph.input}
    tensors -= graph.initializers | graph.constants
    out = {}
    for t in tensors:
        shape = graph.shapes.get(t)
        ok = shape is not None and all(isinstance(d, int) and d > 0 for d in shape)
        out[t] = math.prod(shape) if ok else None
    return out


#: what the search did with each kernel's evidence
KERNEL_ACTIONS = {"integer": "removal pruned (integer faster)",
                  "float": "removal tried first (float faster)",
                  "tie": "removal measured (no difference resolved)"}


def placed_and_modes(table: KernelTable, model: bytes | None
                     ) -> tuple[set[str] | None, dict[str, str]]:
    """The nodes ``model`` (its bytes, read once) sets up as static integer kernels (None:
    not readable) and those it runs in a per-node mode (node -> dynamic or weight-only)."""
    if not isinstance(model, bytes):
        return None, {}
    import onnx

    try:
        proto = onnx.load_from_string(model)
    except Exception:  # the table still ships without the column
        return None, {}
    try:
        modes = node_modes(proto)
    except Exception:  # the estimate then takes those nodes as placed float
        modes = {}
    per_node = {mode.value for mode in QuantMode if mode.per_node}
    try:
        placed = {u.node for u in units(with_shapes(proto), table.output_q, table.ops)}
    except Exception:  # the table still ships without the column
        placed = None
    return placed, {n: m for n, m in modes.items() if m in per_node}


def kernel_table_entry(table: KernelTable, placed: set[str] | None,
                       modes: dict[str, str]) -> dict:
    """The kernel table for the report: per node, integer and float ms on this machine, the
    ratio float/integer with its interval, what the search did, and how the shipped model
    runs the node (:func:`placed_and_modes`: its per-node mode, ``dynamic`` or weight-only,
    where it has one; else ``integer``: set up as an integer kernel, or ``float``; no column
    when ``placed`` is None)."""
    out = table.to_dict()
    for row in out["kernels"]:
        row["action"] = KERNEL_ACTIONS[row["decision"]]
        if row["node"] in modes:  # a ViT's dynamic MatMuls read "float" before
            row["shipped"] = modes[row["node"]]
        elif placed is not None:
            row["shipped"] = "integer" if row["node"] in placed else "float"
    return out
