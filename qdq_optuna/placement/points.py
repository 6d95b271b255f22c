"""Pattern-relative insertion points and their resolution to tensor uses.

Three kinds, all addressed relative to the pattern so one scheme applies to every member region:

* ``NodeInput``: input ``slot`` of pattern node ``node``.
* ``ChildRegionInput``: input ``index`` of child region ``child``: every use inside that child.
* ``RegionOutput``: output ``index`` of child ``child`` (or of the region itself for a leaf):
  every use of the tensor anywhere (a graph output too, where the rules allow it: see
  ``graph.GRAPH_OUTPUT``), i.e. one tensor-level Q/DQ pair.
* ``Dynamic``: pattern node ``index`` run dynamically (activations quantized per call, int8
  weights; the rules' ``dynamic_ops``): a mode rather than a place, as an on/off point so the
  sampler, the studies and the cache treat it like any other (:mod:`.dynamic`).
* ``WeightOnly``: pattern node ``index`` run weight-only (``slot``: which of the modes,
  ``weight_int8`` or ``weight_int4``; the rules' ``weight_only_modes``), written as ONNX
  Runtime's MatMulNBits (:mod:`.weight_only`); a mode as well, exclusive with the others.

A point resolves, per member region, to the set of tensor uses it covers, after the runtime's
rules drop the uses that must never carry Q/DQ. Points that cover nothing, or exactly what an
earlier point covers in every member, are not offered: each offered point changes the model.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from qdq_optuna.model.graph import Graph, Use
from qdq_optuna.placement.dynamic import (
    DYNAMIC_SLOT,
    MODE_SLOTS,
    QuantMode,
    dynamic_use,
    mode_use,
    slot_mode,
)
from qdq_optuna.placement.patterns import Pattern, PatternIndex
from qdq_optuna.placement.regions import RegionTree
from qdq_optuna.placement.rules import RuntimeRules

NODE_INPUT = "NodeInput"
CHILD_REGION_INPUT = "ChildRegionInput"
REGION_OUTPUT = "RegionOutput"
DYNAMIC = "Dynamic"
WEIGHT_ONLY = "WeightOnly"


@dataclass(frozen=True)
class InsertionPoint:
    kind: str
    #: pattern-relative node index (NodeInput) or child index (-1: the region itself)
    index: int
    #: input slot (NodeInput) or boundary index (child input / output)
    slot: int
    label: str = ""

    @property
    def id(self) -> str:
        if self.kind == NODE_INPUT:
            return f"n{self.index}.{self.label}.in{self.slot}"
        if self.kind == CHILD_REGION_INPUT:
            return f"c{self.index}.in{self.slot}"
        if self.kind == DYNAMIC:
            return f"n{self.index}.{self.label}.dynamic"
        if self.kind == WEIGHT_ONLY:
            return f"n{self.index}.{self.label}.{slot_mode(self.slot).value}"
        owner = f"c{self.index}." if self.index >= 0 else ""
        return f"{owner}out{self.slot}.{self.label}"

    def to_dict(self) -> dict:
        return {"kind": self.kind, "index": self.index, "slot": self.slot, "label": self.label}

    @staticmethod
    def from_dict(d: dict) -> InsertionPoint:
        return InsertionPoint(d["kind"], int(d["index"]), int(d["slot"]), d.get("label", ""))


@dataclass
class PatternPoints:
    """The offered points of one pattern and what they cover in every member region."""

    pattern: Pattern
    points: list[InsertionPoint]
    #: point id -> region id -> covered uses (sorted)
    resolved: dict[str, dict[int, list[Use]]]
    #: point ids that move together: all inputs of one Concat
    concat_groups: list[list[str]] = field(default_factory=list)
    #: point ids of one op's inputs and output (the runtime fuses the op only with all of them)
    fusion_groups: list[list[str]] = field(default_factory=list)
    #: points dropped, with the reason (for ``inspect``)
    dropped: dict[str, str] = field(default_factory=dict)

    @property
    def ids(self) -> list[str]:
        return [p.id for p in self.points]

    def uses(self, point_ids: Iterable[str]) -> set[Use]:
        out: set[Use] = set()
        for pid in point_ids:
            for uses in self.resolved[pid].values():
                out.update(uses)
        return out

    def tensors(self, point_id: str) -> dict[int, list[str]]:
        return {r: sorted({u[0] for u in uses}) for r, uses in self.resolved[point_id].items()}


def enumerate_points(
    graph: Graph, tree: RegionTree, patterns: PatternIndex, pattern: Pattern, rules: RuntimeRules
) -> PatternPoints:
    rep = pattern.representative
    rep_nodes = pattern.node_maps[rep]
    index_of = {n: i for i, n in enumerate(rep_nodes)}
    candidates: list[tuple[InsertionPoint, dict[int, list[Use]]]] = []

    def member_use(region: int, idx: int, slot: int) -> Use:
        node_idx = pattern.node(region, idx)
        mslot = pattern.slot(region, idx, slot)
        return (graph.nodes[node_idx].input[mslot], node_idx, mslot)

    def filt(uses: Iterable[Use]) -> list[Use]:
        return sorted(u for u in set(uses) if u[0] and rules.quantizable(graph, u))

    # NodeInput
    for idx, n in enumerate(rep_nodes):
        node = graph.nodes[n]
        for slot, t in enumerate(node.input):
            if not t:
                continue
            p = InsertionPoint(NODE_INPUT, idx, slot, node.op_type)
            candidates.append((p, {r: filt([member_use(r, idx, slot)]) for r in pattern.regions}))

    rep_region = tree[rep]
    children = sorted(rep_region.children, key=lambda c: tree[c].all_nodes[0])
    # ChildRegionInput
    for j, child in enumerate(children):
        child_nodes = set(tree[child].all_nodes)
        for k, t in enumerate(tree[child].inputs):
            rep_uses = [(index_of[c], s) for c, s in graph.consumers.get(t, []) if c in child_nodes]
            resolved = {r: filt(member_use(r, i, s) for i, s in rep_uses) for r in pattern.regions}
            candidates.append((InsertionPoint(CHILD_REGION_INPUT, j, k), resolved))
    # RegionOutput (children's outputs; a leaf's own outputs)
    owners = list(enumerate(children)) if children else [(-1, rep)]
    for j, owner in owners:
        for k, t in enumerate(tree[owner].outputs):
            p_node, p_out = graph.producer[t]
            idx = index_of[p_node]
            resolved = {}
            for r in pattern.regions:
                mt = graph.nodes[pattern.node(r, idx)].output[p_out]
                resolved[r] = filt(graph.uses(mt) + graph.output_uses(mt))
            label = graph.nodes[p_node].op_type
            candidates.append((InsertionPoint(REGION_OUTPUT, j, k, label), resolved))
    # Dynamic (a node's mode): where every member's node can run dynamically
    for idx, n in enumerate(rep_nodes):
        members = {r: pattern.node(r, idx) for r in pattern.regions}
        if all(rules.offers_mode(graph, m, QuantMode.DYNAMIC) for m in members.values()):
            candidates.append((InsertionPoint(DYNAMIC, idx, DYNAMIC_SLOT, graph.nodes[n].op_type),
                               {r: [dynamic_use(graph, m)] for r, m in members.items()}))
        # WeightOnly (a node's mode too): one point per weight-only mode the rules offer
        for mode in rules.weight_only_modes:
            if all(rules.offers_mode(graph, m, mode) for m in members.values()):
                candidates.append((
                    InsertionPoint(WEIGHT_ONLY, idx, MODE_SLOTS[mode], graph.nodes[n].op_type),
                    {r: [mode_use(graph, m, mode)] for r, m in members.items()}))

    points: list[InsertionPoint] = []
    resolved_by_id: dict[str, dict[int, list[Use]]] = {}
    seen: dict[tuple, str] = {}
    dropped: dict[str, str] = {}
    for p, resolved in candidates:
        key = tuple(tuple(resolved[r]) for r in pattern.regions)
        if not any(resolved.values()):
            dropped[p.id] = "covers no quantizable use"
            continue
        if key in seen:
            dropped[p.id] = f"same model as {seen[key]}"
            continue
        seen[key] = p.id
        points.append(p)
        resolved_by_id[p.id] = resolved

    pp = PatternPoints(pattern=pattern, points=points, resolved=resolved_by_id, dropped=dropped)
    _groups(graph, pp, rules, index_of)
    return pp


def _groups(graph: Graph, pp: PatternPoints, rules: RuntimeRules, index_of: dict[int, int]) -> None:
    rep = pp.pattern.representative
    # the point covering exactly one representative use
    single: dict[Use, str] = {}
    for pid, res in pp.resolved.items():
        if len(res[rep]) == 1 and res[rep][0] not in single:
            single[res[rep][0]] = pid
    # the point covering every use of a tensor (a tensor-level Q/DQ)
    whole: dict[str, str] = {}
    for pid, res in pp.resolved.items():
        tensors = {u[0] for u in res[rep]}
        if len(tensors) == 1:
            t = next(iter(tensors))
            all_uses = {u for u in graph.uses(t) + graph.output_uses(t) if rules.quantizable(graph, u)}
            if set(res[rep]) == all_uses and t not in whole:
                whole[t] = pid
    concat, fusion = [], []
    for n in pp.pattern.node_maps[rep]:
        node = graph.nodes[n]
        in_uses = [(t, n, s) for s, t in enumerate(node.input) if t and rules.quantizable(graph, (t, n, s))]
        if node.op_type == "Concat":
            if in_uses and len(in_uses) == len([t for t in node.input if t]) and all(u in single for u in in_uses):
                group = sorted({single[u] for u in in_uses})
                if len(group) >= 2 and group not in concat:
                    concat.append(group)
        if node.op_type in rules.fusion_group_ops:
            members = [single[u] for u in in_uses if u in single]
            for t in node.output:
                if t in whole:
                    members.append(whole[t])
                else:
                    members.extend(single[u] for u in graph.uses(t) + graph.output_uses(t)
                                   if u in single)
            group = sorted(set(members))
            if len(group) >= 2 and group not in fusion:
                fusion.append(group)
    pp.concat_groups = concat
    pp.fusion_groups = fusion


def chain_groups(uses_of: dict[tuple[str, str], frozenset]) -> list[frozenset[tuple[str, str]]]:
    """The chains: per tensor, the points (of any pattern) that quantize only that tensor,
    when they belong to more than one pattern (a producer's output pair and its consumers'
    input pairs are one Q/DQ pair). ``uses_of``: (pattern id, point id) -> the uses it
    quantizes."""
    by_tensor: dict[str, set[tuple[str, str]]] = {}
    for pt, uses in uses_of.items():
        tensors = {u[0] for u in uses}
        if len(tensors) == 1:
            by_tensor.setdefault(next(iter(tensors)), set()).add(pt)
    return [frozenset(pts) for _, pts in sorted(by_tensor.items())
            if len({p for p, _ in pts}) > 1]
