"""Pattern signatures and pattern-relative addressing.

Two regions share a pattern only if they are the same labelled graph: op types, the attributes
that change the kernel, internal edges with their input slots (order-free for commutative ops),
constant inputs, which outputs leave the region, and, for composites, the children's signatures.

A Weisfeiler-Lehman refinement gives an order-invariant signature cheaply; regions with equal
signatures are then matched node by node against the pattern's first region (its
*representative*) by an explicit isomorphism search, so a hash collision or a WL blind spot can
never put different graphs in one pattern. The match gives every member a map from the
representative's node order (the *pattern-relative* index) to its own nodes and input slots.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import defaultdict
from dataclasses import dataclass, field

from onnx import AttributeProto

from qdq_optuna.model.graph import Graph
from qdq_optuna.placement.regions import Region, RegionTree

COMMUTATIVE_OPS = frozenset({"Add", "Mul", "Max", "Min", "Sum", "Mean", "And", "Or", "Xor", "Equal"})
#: attributes that never change the kernel (names, docs)
_IGNORED_ATTRS = frozenset({"name", "doc_string"})
_MATCH_STEP_LIMIT = 200_000


def _h(obj: object) -> str:
    return hashlib.blake2b(repr(obj).encode(), digest_size=12).hexdigest()


def _attr_value(attr: AttributeProto) -> object:
    t = attr.type
    if t == AttributeProto.FLOAT:
        return round(attr.f, 7)
    if t == AttributeProto.INT:
        return attr.i
    if t == AttributeProto.STRING:
        return attr.s.decode(errors="replace")
    if t == AttributeProto.FLOATS:
        return tuple(round(f, 7) for f in attr.floats)
    if t == AttributeProto.INTS:
        return tuple(attr.ints)
    if t == AttributeProto.STRINGS:
        return tuple(s.decode(errors="replace") for s in attr.strings)
    if t == AttributeProto.TENSOR:
        return ("tensor", attr.t.data_type, tuple(attr.t.dims))
    return ("attr", t)


def _const_desc(graph: Graph, tensor: str) -> tuple:
    """Constant inputs: dtype and rank; small integer constants (shapes, axes) by value."""
    shape = graph.shapes.get(tensor) or ()
    dtype = graph.elem_types.get(tensor, 0)
    desc: tuple = ("k", dtype, len(shape))
    init = None
    if tensor in graph.initializers and dtype in (6, 7) and len(shape) <= 1:  # INT32/INT64
        size = 1
        for d in shape:
            size *= d
        if size <= 8:
            init = _small_initializer_values(graph, tensor)
    if init is not None:
        desc = desc + (init,)
    return desc


def _small_initializer_values(graph: Graph, tensor: str) -> tuple | None:
    cache = graph.__dict__.setdefault("_small_values", {})
    if tensor not in cache:
        from onnx import numpy_helper

        t = graph.initializer(tensor)
        cache[tensor] = tuple(int(v) for v in numpy_helper.to_array(t).reshape(-1)) if t else None
    return cache[tensor]


@dataclass
class _Labelled:
    nodes: list[int]
    inside: set[int]
    labels: dict[int, str]


def _kind(graph: Graph, tensor: str, inside: set[int]) -> str:
    if not tensor:
        return "-"
    if graph.is_constant(tensor):
        return "k"
    p = graph.producer.get(tensor)
    if p is not None and p[0] in inside:
        return "i"
    return "b"


def _label_region(graph: Graph, nodes: list[int], child_sig: dict[int, str]) -> _Labelled:
    inside = set(nodes)
    outputs = set(graph.graph_outputs)
    labels: dict[int, str] = {}
    for n in nodes:
        node = graph.nodes[n]
        attrs = tuple(
            sorted((a.name, _attr_value(a)) for a in node.attribute if a.name not in _IGNORED_ATTRS)
        )
        ins = []
        for t in node.input:
            k = _kind(graph, t, inside)
            ins.append(_const_desc(graph, t) if k == "k" else (k,))
        if node.op_type in COMMUTATIVE_OPS:
            ins.sort()
        outs = tuple(
            bool(t) and (t in outputs or any(c not in inside for c, _ in graph.consumers.get(t, [])))
            for t in node.output
        )
        labels[n] = _h((node.domain, node.op_type, attrs, tuple(ins), outs, child_sig.get(n, "")))
    # Weisfeiler-Lehman refinement along internal edges (both directions) and shared boundaries
    distinct = len(set(labels.values()))
    for _ in range(len(nodes)):
        new: dict[int, str] = {}
        for n in nodes:
            node = graph.nodes[n]
            ins = []
            for t in node.input:
                k = _kind(graph, t, inside)
                if k == "i":
                    p, o = graph.producer[t]
                    ins.append(("i", labels[p], o))
                elif k == "b":
                    ins.append(("b", tuple(sorted(
                        labels[c] for c, _ in graph.consumers.get(t, []) if c in inside
                    ))))
                else:
                    ins.append((k,))
            if node.op_type in COMMUTATIVE_OPS:
                ins.sort()
            cons = []
            for o, t in enumerate(node.output):
                for c, s in graph.consumers.get(t, []):
                    if c in inside:
                        slot = "c" if graph.nodes[c].op_type in COMMUTATIVE_OPS else s
                        cons.append((o, labels[c], slot))
            cons.sort()
            new[n] = _h((labels[n], tuple(ins), tuple(cons)))
        labels = new
        now = len(set(labels.values()))
        if now == distinct:
            break
        distinct = now
    return _Labelled(nodes=sorted(nodes), inside=inside, labels=labels)


def _match(graph: Graph, rep: _Labelled, mem: _Labelled) -> tuple[dict[int, int], dict[int, tuple]] | None:
    """Isomorphism from the representative to a member that respects labels, slots and
    boundary sharing. Returns (node map, per-node slot permutation) or None."""
    if sorted(rep.labels.values()) != sorted(mem.labels.values()):
        return None
    matcher = _Matcher(graph, rep, mem)
    if not matcher.assign(0):
        return None
    return matcher.iso, matcher.perms


class _Matcher:
    """The backtracking search of :func:`_match`: representative nodes in order, each tried
    against the member's nodes of the same label, inputs slot by slot."""

    def __init__(self, graph: Graph, rep: _Labelled, mem: _Labelled) -> None:
        self.graph, self.rep, self.mem = graph, rep, mem
        self.by_label: dict[str, list[int]] = defaultdict(list)
        for m in mem.nodes:
            self.by_label[mem.labels[m]].append(m)
        self.iso: dict[int, int] = {}
        self.perms: dict[int, tuple] = {}
        self.used: set[int] = set()
        self.ext: dict[str, str] = {}
        self.ext_rev: dict[str, str] = {}
        self.steps = 0

    def try_inputs(self, r: int, m: int):
        graph, rep, mem = self.graph, self.rep, self.mem
        rn, mn = graph.nodes[r], graph.nodes[m]
        if len(rn.input) != len(mn.input) or len(rn.output) != len(mn.output):
            return None
        arity = len(rn.input)
        if rn.op_type in COMMUTATIVE_OPS and arity <= 6:
            options = itertools.permutations(range(arity))
        else:
            options = [tuple(range(arity))]
        for perm in options:
            self.steps += 1
            new_ext: dict[str, str] = {}
            ok = True
            for s in range(arity):
                tr, tm = rn.input[s], mn.input[perm[s]]
                kr, km = _kind(graph, tr, rep.inside), _kind(graph, tm, mem.inside)
                if kr != km:
                    ok = False
                elif kr == "i":
                    pr, orr = graph.producer[tr]
                    pm, om = graph.producer[tm]
                    ok = self.iso.get(pr) == pm and orr == om
                elif kr == "k":
                    ok = _const_desc(graph, tr) == _const_desc(graph, tm)
                elif kr == "b":
                    mapped = self.ext.get(tr, new_ext.get(tr))
                    if mapped is not None:
                        ok = mapped == tm
                    else:
                        back = self.ext_rev.get(tm) or next(
                            (a for a, b in new_ext.items() if b == tm), None
                        )
                        ok = back is None
                        if ok:
                            new_ext[tr] = tm
                if not ok:
                    break
            if ok:
                return perm, new_ext
        return None

    def assign(self, i: int) -> bool:
        order = self.rep.nodes
        if i == len(order):
            return True
        if self.steps > _MATCH_STEP_LIMIT:
            return False
        r = order[i]
        for m in self.by_label[self.rep.labels[r]]:
            if m in self.used:
                continue
            res = self.try_inputs(r, m)
            if res is None:
                continue
            perm, new_ext = res
            self.iso[r], self.perms[r] = m, perm
            self.used.add(m)
            for a, b in new_ext.items():
                self.ext[a], self.ext_rev[b] = b, a
            if self.assign(i + 1):
                return True
            del self.iso[r], self.perms[r]
            self.used.discard(m)
            for a, b in new_ext.items():
                del self.ext[a], self.ext_rev[b]
        return False


@dataclass
class Pattern:
    id: str
    signature: str
    #: member region ids; the first is the representative
    regions: list[int]
    #: canonical (pattern-relative) node index -> graph node index, per member region
    node_maps: dict[int, list[int]] = field(default_factory=dict)
    #: per member, per canonical node: representative input slot -> member input slot
    slot_maps: dict[int, list[tuple[int, ...]]] = field(default_factory=dict)
    ops: list[str] = field(default_factory=list)

    @property
    def representative(self) -> int:
        return self.regions[0]

    def node(self, region: int, index: int) -> int:
        return self.node_maps[region][index]

    def slot(self, region: int, index: int, slot: int) -> int:
        return self.slot_maps[region][index][slot]


class PatternIndex:
    """Signatures for every region and patterns of the tuning regions."""

    def __init__(self, graph: Graph, tree: RegionTree) -> None:
        self.graph = graph
        self.tree = tree
        self._labelled: dict[int, _Labelled] = {}
        self.signatures: dict[int, str] = {}
        for region in sorted(tree.regions, key=lambda r: (r.level, r.id)):
            if region.type.value != "ROOT":
                self._signature(region)
        self.patterns: list[Pattern] = self._group(tree.tuning)
        self.pattern_of: dict[int, Pattern] = {r: p for p in self.patterns for r in p.regions}

    def _signature(self, region: Region) -> str:
        child_sig: dict[int, str] = {}
        for c in region.children:
            for n in self.tree[c].all_nodes:
                child_sig[n] = self.signatures[c]
        lab = _label_region(self.graph, region.all_nodes, child_sig)
        self._labelled[region.id] = lab
        sig = _h((region.type.value, tuple(sorted(lab.labels.values()))))
        self.signatures[region.id] = sig
        return sig

    def _group(self, region_ids: list[int]) -> list[Pattern]:
        by_sig: dict[str, list[int]] = defaultdict(list)
        for rid in region_ids:
            by_sig[self.signatures[rid]].append(rid)
        patterns: list[Pattern] = []
        for rid in region_ids:  # topological order of first appearance
            sig = self.signatures[rid]
            if sig not in by_sig:
                continue
            members = by_sig.pop(sig)
            while members:
                rep = members[0]
                rep_lab = self._labelled[rep]
                group, rest = [rep], []
                maps = {rep: ([*rep_lab.nodes], [tuple(range(len(self.graph.nodes[n].input)))
                                                  for n in rep_lab.nodes])}
                for other in members[1:]:
                    res = _match(self.graph, rep_lab, self._labelled[other])
                    if res is None:
                        rest.append(other)
                        continue
                    iso, perms = res
                    maps[other] = ([iso[n] for n in rep_lab.nodes], [perms[n] for n in rep_lab.nodes])
                    group.append(other)
                suffix = "" if not patterns or all(p.signature != sig for p in patterns) else (
                    f"~{sum(p.signature.startswith(sig) for p in patterns)}"
                )
                pat = Pattern(
                    id=f"P{len(patterns):03d}",
                    signature=sig + suffix,
                    regions=group,
                    node_maps={r: m[0] for r, m in maps.items()},
                    slot_maps={r: m[1] for r, m in maps.items()},
                    ops=[self.graph.nodes[n].op_type for n in rep_lab.nodes],
                )
                patterns.append(pat)
                members = rest
        return patterns
