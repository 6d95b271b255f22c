"""Hypothesis strategies: random valid ONNX DAGs and isomorphic relabelings of them.

A model is described by a :class:`DagSpec` (a list of ops whose inputs are earlier tensors) and
built by :func:`build_model`. Every tensor in the pool has shape ``[1, C, 8, 8]``, so any op may
read any earlier tensor: fan-out, residual Adds and multi-input Concats happen naturally.

:func:`build_model` can also emit an *isomorphic relabeling* of the same graph (a different
topological node order, renamed tensors and nodes, swapped inputs of Add/Mul), which must give
the same pattern signatures.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import onnx
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
SPATIAL = 8
OP_KINDS = (
    "Conv", "Relu", "Add", "Mul", "MulConst", "Sigmoid", "Concat", "MaxPool", "BatchNormalization",
)

#: settings for the property tests (models are small; ORT sessions dominate the run time);
#: QDQ_PROPERTY_EXAMPLES=1000 runs a deeper search
PROPERTY = settings(
    max_examples=int(os.environ.get("QDQ_PROPERTY_EXAMPLES", "50")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    # CI runs a fixed set of examples (reproducible); local runs keep exploring
    derandomize=bool(os.environ.get("CI")),
)


@dataclass(frozen=True)
class OpSpec:
    #: one of OP_KINDS ("MulConst" is a Mul by a [1, C, 1, 1] initializer)
    kind: str
    #: pool indices of the inputs (0 is the graph input, k the output of op k - 1)
    inputs: tuple[int, ...]
    #: False: the node gets no name (the library then calls it ``#<index>``)
    named: bool = True
    #: Conv only: with a bias initializer
    bias: bool = False
    #: Conv only: reuse the weight initializer of this earlier op (a shared weight)
    shared_weight: int | None = None
    #: MulConst only: the factor comes from a Constant node instead of an initializer
    constant_node: bool = False
    #: Add / Mul / MulConst: inputs in the other order
    swap: bool = False


def node_count(op: OpSpec) -> int:
    """How many ONNX nodes one op becomes."""
    return 2 if op.kind == "Concat" or (op.kind == "MulConst" and op.constant_node) else 1


@dataclass(frozen=True)
class DagSpec:
    channels: int
    ops: tuple[OpSpec, ...]
    #: True: every tensor nobody reads is a graph output; False: only the last one is
    all_dangling_outputs: bool
    seed: int = 0

    @property
    def node_count(self) -> int:
        return sum(node_count(op) for op in self.ops)


@dataclass(frozen=True)
class Relabel:
    """How to turn a spec into an isomorphic copy of its model."""

    #: a topological order of the expanded node list (indices of the canonical order)
    order: tuple[int, ...] | None = None
    #: prefix for every tensor / node name (and a permuted numbering, see ``numbering``)
    prefix: str = ""
    numbering: tuple[int, ...] = ()
    #: op indices (into ``DagSpec.ops``) whose Add/Mul inputs are swapped
    swapped: frozenset[int] = field(default_factory=frozenset)


# ---------------------------------------------------------------------------------------------
# building
# ---------------------------------------------------------------------------------------------


@dataclass
class _Node:
    op_type: str
    inputs: list[str]
    output: str
    name: str
    attrs: dict
    op_index: int
    deps: list[int]  # canonical indices of the nodes producing its inputs


def _expand(spec: DagSpec, swapped: frozenset[int] = frozenset()):
    """Canonical node list and initializers (names are canonical, renamed later)."""
    c = spec.channels
    pool = ["x"]
    producer_of: dict[str, int] = {}
    nodes: list[_Node] = []
    inits: dict[str, np.ndarray] = {}
    conv_weight: dict[int, str] = {}

    def add(op_type, inputs, output, name, attrs, op_index):
        deps = sorted({producer_of[t] for t in inputs if t in producer_of})
        nodes.append(_Node(op_type, list(inputs), output, name, attrs, op_index, deps))
        producer_of[output] = len(nodes) - 1

    for k, op in enumerate(spec.ops):
        rng = np.random.default_rng([spec.seed, k])
        out = f"t{k + 1}"
        name = f"{op.kind.lower()}_{k}" if op.named else ""
        ins = [pool[i] for i in op.inputs]
        if op.kind == "Conv":
            if op.shared_weight is not None and op.shared_weight in conv_weight:
                w = conv_weight[op.shared_weight]
            else:
                w = f"w{k}"
                fan_in = c * 9
                inits[w] = (rng.standard_normal((c, c, 3, 3)) / np.sqrt(fan_in)).astype(np.float32)
            conv_weight[k] = w
            inputs = [ins[0], w]
            if op.bias:
                inits[f"b{k}"] = (0.1 * rng.standard_normal(c)).astype(np.float32)
                inputs.append(f"b{k}")
            attrs = dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[1, 1])
            add("Conv", inputs, out, name, attrs, k)
        elif op.kind in ("Relu", "Sigmoid"):
            add(op.kind, ins[:1], out, name, {}, k)
        elif op.kind in ("Add", "Mul"):
            pair = ins[:2][::-1] if (k in swapped) != op.swap else ins[:2]
            add(op.kind, pair, out, name, {}, k)
        elif op.kind == "MulConst":
            factor = rng.uniform(0.5, 1.5, (1, c, 1, 1)).astype(np.float32)
            if op.constant_node:
                value = numpy_helper.from_array(factor, f"m{k}_value")
                add("Constant", [], f"m{k}", f"{name}_const" if name else "", {"value": value}, k)
            else:
                inits[f"m{k}"] = factor
            pair = [f"m{k}", ins[0]] if (k in swapped) != op.swap else [ins[0], f"m{k}"]
            add("Mul", pair, out, name, {}, k)
        elif op.kind == "MaxPool":
            attrs = dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[1, 1])
            add("MaxPool", ins[:1], out, name, attrs, k)
        elif op.kind == "BatchNormalization":
            params = [
                rng.uniform(0.8, 1.2, c), rng.normal(0.0, 0.1, c), rng.normal(0.0, 0.1, c),
                rng.uniform(0.8, 1.2, c),
            ]
            names = [f"bn{k}_{p}" for p in ("scale", "bias", "mean", "var")]
            for n, v in zip(names, params):
                inits[n] = v.astype(np.float32)
            add("BatchNormalization", [ins[0], *names], out, name, dict(epsilon=1e-5), k)
        elif op.kind == "Concat":
            cat = f"t{k + 1}_cat"
            add("Concat", ins, cat, f"{name}_cat" if name else "", dict(axis=1), k)
            w = f"w{k}"
            fan_in = c * len(ins)
            inits[w] = (rng.standard_normal((c, fan_in, 1, 1)) / np.sqrt(fan_in)).astype(np.float32)
            add("Conv", [cat, w], out, name, dict(kernel_shape=[1, 1]), k)
        else:  # pragma: no cover - OP_KINDS is closed
            raise ValueError(op.kind)
        pool.append(out)
    read = {t for n in nodes for t in n.inputs}
    if spec.all_dangling_outputs:
        outputs = [t for t in pool[1:] if t not in read]
    else:
        outputs = [pool[-1]]
    return nodes, inits, outputs


def build_model(spec: DagSpec, relabel: Relabel | None = None) -> onnx.ModelProto:
    """The ONNX model of ``spec`` (opset 17), optionally relabeled isomorphically."""
    rl = relabel or Relabel()
    nodes, inits, outputs = _expand(spec, rl.swapped)
    order = list(rl.order) if rl.order is not None else list(range(len(nodes)))
    if sorted(order) != list(range(len(nodes))):
        raise ValueError("relabel order is not a permutation of the nodes")

    all_names = ["x", *inits, *(n.output for n in nodes)]
    if rl.prefix:
        numbering = list(rl.numbering) or list(range(len(all_names)))
        rename = {old: f"{rl.prefix}{numbering[i]}" for i, old in enumerate(all_names)}
    else:
        rename = {old: old for old in all_names}

    c = spec.channels
    graph_nodes = []
    for pos, i in enumerate(order):
        n = nodes[i]
        name = n.name
        if name and rl.prefix:
            name = f"{rl.prefix}node{pos}"
        graph_nodes.append(
            helper.make_node(
                n.op_type, [rename[t] for t in n.inputs], [rename[n.output]], name=name, **n.attrs
            )
        )
    initializers = [numpy_helper.from_array(v, rename[k]) for k, v in inits.items()]
    shape = [1, c, SPATIAL, SPATIAL]
    graph = helper.make_graph(
        graph_nodes,
        "random_dag",
        [helper.make_tensor_value_info(rename["x"], TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info(rename[t], TensorProto.FLOAT, shape) for t in outputs],
        initializer=initializers,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=8)


def canonical_to_relabeled(spec: DagSpec, relabel: Relabel) -> list[int]:
    """Canonical node index -> node index in ``build_model(spec, relabel)``."""
    nodes, _, _ = _expand(spec)
    order = list(relabel.order) if relabel.order is not None else list(range(len(nodes)))
    where = [0] * len(order)
    for pos, i in enumerate(order):
        where[i] = pos
    return where


# ---------------------------------------------------------------------------------------------
# strategies
# ---------------------------------------------------------------------------------------------


def _draw_op(draw, kind: str, inputs: tuple[int, ...], convs: list[int], k: int) -> OpSpec:
    named = draw(st.integers(0, 5)) > 0  # about one node in six is unnamed
    bias, shared = False, None
    if kind == "Conv":
        bias = draw(st.booleans())
        if convs and draw(st.integers(0, 4)) == 0:
            shared = draw(st.sampled_from(convs))
        convs.append(k)
    return OpSpec(
        kind,
        inputs,
        named,
        bias,
        shared,
        constant_node=kind == "MulConst" and draw(st.booleans()),
        swap=kind in ("Add", "Mul", "MulConst") and draw(st.booleans()),
    )


def _arity(draw, kind: str) -> int:
    if kind in ("Add", "Mul"):
        return 2
    if kind == "Concat":
        return draw(st.integers(2, 3))
    return 1


@st.composite
def dag_specs(
    draw, min_nodes: int = 3, max_nodes: int = 30, repeated: bool | None = None
) -> DagSpec:
    """A random DAG of 3-30 ONNX nodes (a Concat op is two: Concat, then a 1x1 Conv back to C
    channels; a MulConst whose factor is a Constant node is two as well).

    Half of the specs (``repeated=False``) are free-form (every input drawn among all earlier
    tensors); the other half (``repeated=True``) repeat one random *motif* 2-4 times in a chain
    (as networks repeat blocks), with names and Add/Mul input order drawn per repetition, so
    patterns get several members and non-trivial slot maps.
    """
    channels = draw(st.integers(2, 4))
    ops: list[OpSpec] = []
    convs: list[int] = []

    def free(count: int, lo: int = 0) -> None:
        """``count`` ops reading any tensors from pool index ``lo`` on."""
        for _ in range(count):
            k = len(ops)  # the pool has k + 1 tensors
            kind = draw(st.sampled_from(OP_KINDS))
            arity = _arity(draw, kind)
            # favour the newest tensor so chains form, else any earlier one
            first = draw(st.one_of(st.just(k), st.integers(lo, k)))
            inputs = tuple([first] + [draw(st.integers(lo, k)) for _ in range(arity - 1)])
            ops.append(_draw_op(draw, kind, inputs, convs, k))

    if repeated is None:
        repeated = draw(st.booleans())
    if not repeated:
        free(draw(st.integers(min_nodes, max_nodes)))
    else:
        free(draw(st.integers(0, 3)))
        size = draw(st.integers(2, 6))
        # motif op j reads -1 (the block input) or an earlier motif op's output
        motif = []
        # a residual block (two Convs, an Add back to the block input that keeps it live)
        # becomes a block composite per repetition, all of them one pattern
        residual = draw(st.booleans())
        for j in range(size):
            # a Conv opens a new leaf
            conv = (j == 0 and draw(st.integers(0, 3)) > 0) or (residual and j == size // 2)
            kind = "Conv" if conv else draw(st.sampled_from(OP_KINDS))
            rel = [draw(st.one_of(st.just(j - 1), st.integers(-1, j - 1)))]
            rel += [draw(st.integers(-1, j - 1)) for _ in range(_arity(draw, kind) - 1)]
            motif.append(_draw_op(draw, kind, tuple(rel), [], j))
        if residual:
            motif.append(OpSpec("Add", (size - 1, -1)))
        repeats = draw(st.integers(2, max(2, min(4, (max_nodes - len(ops)) // len(motif)))))
        for _ in range(repeats):
            base = len(ops)  # pool index of the block input
            for template in motif:
                # same structure in every repetition; names, swaps, shared weights vary
                k = len(ops)
                drawn = _draw_op(draw, template.kind, template.inputs, convs, k)
                ops.append(replace(
                    template,
                    inputs=tuple(base + 1 + r for r in template.inputs),
                    named=drawn.named,
                    swap=drawn.swap,
                    shared_weight=drawn.shared_weight,
                ))
        free(draw(st.integers(0, 2)), lo=base)
    # ops only read earlier ops: dropping the last ones keeps a valid graph
    while len(ops) > 3 and sum(node_count(op) for op in ops) > max_nodes:
        ops.pop()
    return DagSpec(
        channels=channels,
        ops=tuple(ops),
        all_dangling_outputs=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


@st.composite
def relabelings(draw, spec: DagSpec, *, reorder: bool = True, swap: bool = True) -> Relabel:
    """An isomorphic relabeling of ``spec``'s model: a random topological order (if
    ``reorder``), renamed tensors and nodes, and swapped Add/Mul inputs (if ``swap``)."""
    nodes, inits, _ = _expand(spec)
    order = None
    if reorder:
        indegree = [len(n.deps) for n in nodes]
        users: list[list[int]] = [[] for _ in nodes]
        for i, n in enumerate(nodes):
            for d in n.deps:
                users[d].append(i)
        ready = [i for i, d in enumerate(indegree) if d == 0]
        order = []
        while ready:
            i = ready.pop(draw(st.integers(0, len(ready) - 1)))
            order.append(i)
            for u in users[i]:
                indegree[u] -= 1
                if indegree[u] == 0:
                    ready.append(u)
        order = tuple(order)
    count = 1 + len(inits) + len(nodes)
    numbering = tuple(draw(st.permutations(range(count))))
    prefix = draw(st.sampled_from(["r", "renamed/", "T_", "n."]))
    swapped: frozenset[int] = frozenset()
    if swap:
        candidates = [k for k, op in enumerate(spec.ops) if op.kind in ("Add", "Mul", "MulConst")]
        if candidates:
            swapped = frozenset(draw(st.lists(st.sampled_from(candidates), unique=True)))
    return Relabel(order=order, prefix=prefix, numbering=numbering, swapped=swapped)


def dag_models(min_nodes: int = 3, max_nodes: int = 30) -> st.SearchStrategy[onnx.ModelProto]:
    """Random valid ONNX DAG models (opset 17, input ``x`` [1, C, 8, 8])."""
    return dag_specs(min_nodes, max_nodes).map(build_model)


@st.composite
def isomorphic_pairs(draw, *, reorder: bool = True, swap: bool = True):
    """(spec, relabel, model, relabeled model)."""
    spec = draw(st.one_of(dag_specs(), dag_specs(repeated=True)))
    relabel = draw(relabelings(spec, reorder=reorder, swap=swap))
    return spec, relabel, build_model(spec), build_model(spec, relabel)


def spec_summary(spec: DagSpec) -> Sequence[str]:
    """A readable listing of a spec (for failure messages)."""
    flags = {"named": "", "bias": "+bias", "constant_node": "+Constant", "swap": "+swap"}
    out = []
    for k, op in enumerate(spec.ops):
        extra = "".join(v for f, v in flags.items() if v and getattr(op, f))
        shared = f"+w{op.shared_weight}" if op.shared_weight is not None else ""
        out.append(f"{k}: {op.kind}{op.inputs}{extra}{shared}{'' if op.named else ' (unnamed)'}")
    return out


# ---------------------------------------------------------------------------------------------
# pipeline helpers shared by the tests
# ---------------------------------------------------------------------------------------------


@dataclass
class Analysis:
    """Everything the model side computes for one graph and one rule table."""

    graph: object  # qdq_optuna.model.graph.Graph
    tree: object  # qdq_optuna.placement.regions.RegionTree
    index: object  # qdq_optuna.placement.patterns.PatternIndex
    points: list  # list[PatternPoints], one per pattern, in pattern order

    def point_refs(self) -> list[tuple[object, str]]:
        """(PatternPoints, point id) for every offered point."""
        return [(pp, pid) for pp in self.points for pid in pp.ids]

    def all_uses(self) -> set[tuple[str, int, int]]:
        out: set[tuple[str, int, int]] = set()
        for pp in self.points:
            out |= pp.uses(pp.ids)
        return out

    def node(self, name: str) -> int:
        """Index of the node called ``name``."""
        return next(i for i, n in enumerate(self.graph.nodes) if n.name == name)


def analyze(source, rules, quant_types: Sequence[str] = ("int8",), input_shapes=None) -> Analysis:
    """load_model (or take a Graph) -> upgrade_for -> regions -> patterns -> points."""
    from qdq_optuna.model.graph import Graph, load_model
    from qdq_optuna.placement.export import upgrade_for
    from qdq_optuna.placement.patterns import PatternIndex
    from qdq_optuna.placement.points import enumerate_points
    from qdq_optuna.placement.regions import discover_regions

    graph = source if isinstance(source, Graph) else load_model(source, input_shapes)
    graph = upgrade_for(graph, quant_types)
    tree = discover_regions(graph)
    index = PatternIndex(graph, tree)
    points = [enumerate_points(graph, tree, index, p, rules) for p in index.patterns]
    return Analysis(graph, tree, index, points)


def random_feeds(model: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    """Random inputs for every graph input (symbolic dims -> 1, int64 inputs in [0, 10))."""
    rng = np.random.default_rng(seed)
    inits = {t.name for t in model.graph.initializer}
    feeds = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else 1 for d in tt.shape.dim]
        if tt.elem_type == TensorProto.INT64:
            feeds[vi.name] = rng.integers(0, 10, size=shape, dtype=np.int64)
        else:
            feeds[vi.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def run_ort(model: onnx.ModelProto | bytes, feeds: dict[str, np.ndarray] | None = None) -> list:
    """Run a model on ONNX Runtime's CPU provider (one thread) and return its outputs."""
    import onnxruntime as ort

    data = model if isinstance(model, bytes) else model.SerializeToString()
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    session = ort.InferenceSession(data, opts, providers=["CPUExecutionProvider"])
    if feeds is None:
        feeds = random_feeds(onnx.load_from_string(data))
    return session.run(None, feeds)


# ---------------------------------------------------------------------------------------------
# structural invariants shared by several test modules
# ---------------------------------------------------------------------------------------------


def check_tree(graph, tree) -> None:
    """Every structural promise of ``discover_regions`` (see qdq_optuna/placement/regions.py)."""
    from qdq_optuna.placement.regions import RegionType

    n = len(graph.nodes)
    everything = list(range(n))
    regions = tree.regions
    assert [r.id for r in regions] == list(range(len(regions)))

    # leaves: an exact partition of the nodes, and leaf_of agrees
    leaves = tree.leaves
    count = Counter(x for leaf in leaves for x in leaf.nodes)
    assert sorted(count) == everything, "a node is in no leaf"
    shared = [k for k, v in count.items() if v > 1]
    assert not shared, f"nodes in several leaves: {shared}"
    for leaf in leaves:
        assert leaf.nodes and leaf.nodes == leaf.all_nodes == sorted(leaf.nodes)
        assert not leaf.children and leaf.kind in ("compute", "glue")
        for x in leaf.nodes:
            assert tree.leaf_of[x] == leaf.id
    assert len(tree.leaf_of) == n

    # composites / root: all_nodes is exactly the union of the children's
    root = tree[tree.root]
    assert root.type is RegionType.ROOT and root.parent is None
    assert root.all_nodes == everything
    assert sum(r.type is RegionType.ROOT for r in regions) == 1
    for r in regions:
        if r.type is RegionType.LEAF:
            continue
        assert r.children, f"region {r.id} has no children"
        assert not r.nodes, f"region {r.id} ({r.type.value}) has direct nodes"
        union = Counter(x for c in r.children for x in tree[c].all_nodes)
        assert set(union.values()) <= {1}, f"children of {r.id} overlap"
        assert sorted(union) == r.all_nodes, f"region {r.id}: all_nodes != union of children"
        for c in r.children:
            assert tree[c].parent == r.id
            assert tree[c].level < r.level
        if r.type is RegionType.COMPOSITE:
            assert r.kind in ("block", "sequence")

    # every non-root region hangs under the root
    for r in regions:
        seen, cur = set(), r
        while cur.parent is not None:
            assert cur.id not in seen
            seen.add(cur.id)
            cur = tree[cur.parent]
        assert cur.id == tree.root

    # tuning regions: a partition too, in topological order, never the root
    assert tree.root not in tree.tuning
    tuning = Counter(x for rid in tree.tuning for x in tree[rid].all_nodes)
    assert sorted(tuning) == everything and set(tuning.values()) <= {1}
    firsts = [tree[rid].all_nodes[0] for rid in tree.tuning]
    assert firsts == sorted(firsts)

    # boundaries: inputs are non-constant tensors read inside and produced outside; outputs are
    # produced inside and read outside (or graph outputs)
    outputs_of_graph = set(graph.graph_outputs)
    for r in regions:
        inside = set(r.all_nodes)
        produced = {t for x in inside for t in graph.nodes[x].output if t}
        read = {t for x in inside for t in graph.nodes[x].input if t}
        assert set(r.inputs) == {t for t in read - produced if not graph.is_constant(t)}
        expected_out = {
            t for t in produced
            if t in outputs_of_graph or any(c not in inside for c, _ in graph.consumers.get(t, []))
        }
        assert set(r.outputs) == expected_out
        assert len(r.inputs) == len(set(r.inputs)) and len(r.outputs) == len(set(r.outputs))
