"""Hierarchical regions: leaves that partition the graph exactly, composites above them.

Bottom-up, every node lands in exactly one LEAF: a compute op (Conv, MatMul, ...) opens a leaf
and pulls in its fusible epilogue (BN, activations, bias/residual Add, ...); other ops form
"glue" leaves along their dataflow. Then the graph is cut where a single activation is live
(the block boundaries of ResNets, transformer layers, ...): a block of several leaves becomes a
COMPOSITE. Top-down, a block larger than ``minimum_topdown_search_size`` nodes is refined into
sequence composites of at most ``maximum_sequence_region_size`` nodes. The ROOT holds the rest.

The *tuning regions* (one study per pattern of them) are the smallest composites and the leaves
no composite took: each spans at most a few fusion groups, so one scheme is a handful of bits.
Everything is a pure function of the graph's node order: same model, same regions and ids.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from qdq_optuna.model.graph import CONSTANT_OPS, Graph
from qdq_optuna.placement.rules import COMPUTE_OPS

#: Ops that a compute op's kernel can absorb as an epilogue (join the compute leaf).
EPILOGUE_OPS = frozenset(
    {
        "BatchNormalization", "Relu", "LeakyRelu", "PRelu", "Sigmoid", "Tanh", "Clip",
        "HardSigmoid", "HardSwish", "Elu", "Selu", "Softplus", "Gelu", "Erf", "Add", "Sub",
        "Mul", "Div", "Mish", "Swish",
    }
)


class RegionType(str, enum.Enum):
    LEAF = "LEAF"
    COMPOSITE = "COMPOSITE"
    ROOT = "ROOT"


@dataclass
class Region:
    id: int
    type: RegionType
    level: int
    parent: int | None = None
    children: list[int] = field(default_factory=list)
    #: direct nodes (leaves only), graph.node indices in topological order
    nodes: list[int] = field(default_factory=list)
    #: all nodes below this region, topological order
    all_nodes: list[int] = field(default_factory=list)
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    kind: str = ""  # "compute" | "glue" for leaves, "block" | "sequence" for composites


@dataclass
class RegionTree:
    regions: list[Region]
    root: int
    #: node index -> id of its leaf
    leaf_of: list[int]
    #: ids of the regions that get studies (see module docstring), topological order
    tuning: list[int]

    def __getitem__(self, rid: int) -> Region:
        return self.regions[rid]

    @property
    def leaves(self) -> list[Region]:
        return [r for r in self.regions if r.type is RegionType.LEAF]


@dataclass(frozen=True)
class RegionConfig:
    maximum_sequence_region_size: int = 10
    minimum_topdown_search_size: int = 10


def _boundaries(graph: Graph, nodes: list[int]) -> tuple[list[str], list[str]]:
    inside = set(nodes)
    produced: set[str] = set()
    for n in nodes:
        produced.update(o for o in graph.nodes[n].output if o)
    inputs: list[str] = []
    seen: set[str] = set()
    for n in nodes:
        for t in graph.nodes[n].input:
            if t and t not in produced and t not in seen and not graph.is_constant(t):
                seen.add(t)
                inputs.append(t)
    outputs: list[str] = []
    graph_outputs = set(graph.graph_outputs)
    for n in nodes:
        for t in graph.nodes[n].output:
            if not t:
                continue
            if t in graph_outputs or any(c not in inside for c, _ in graph.consumers.get(t, [])):
                outputs.append(t)
    return inputs, outputs


def _build_leaves(graph: Graph, max_size: int) -> tuple[list[list[int]], list[str], set[int]]:
    """Bottom-up: assign every node to exactly one leaf."""
    leaf_of: dict[int, int] = {}
    leaves: list[list[int]] = []
    kinds: list[str] = []
    deferred: list[int] = []
    shape_values = graph.shape_values()
    for idx, node in enumerate(graph.nodes):
        producers = sorted(
            {graph.producer[t][0] for t in node.input if t in graph.producer and t not in graph.constants}
        )
        producers = [p for p in producers if p in leaf_of]
        outputs = [t for t in node.output if t]
        if node.op_type not in COMPUTE_OPS and (
            (outputs and all(t in shape_values for t in outputs))
            or (not producers and (node.op_type in CONSTANT_OPS or all(
                (not t) or graph.is_constant(t) for t in node.input)))
        ):
            deferred.append(idx)  # constant-like: joins its first consumer's leaf later
            continue
        target = None
        if node.op_type not in COMPUTE_OPS and producers:
            cand = leaf_of[producers[-1]]
            if len(leaves[cand]) < max_size:
                if kinds[cand] == "glue" or (
                    kinds[cand] == "compute" and node.op_type in EPILOGUE_OPS
                ):
                    target = cand
        if target is None:
            target = len(leaves)
            leaves.append([])
            kinds.append("compute" if node.op_type in COMPUTE_OPS else "glue")
        leaves[target].append(idx)
        leaf_of[idx] = target
    # constant-like nodes: the leaf of their first consumer (resolved in reverse so chains work)
    for idx in reversed(deferred):
        consumers = sorted(
            c for t in graph.nodes[idx].output for c, _ in graph.consumers.get(t, [])
        )
        consumers = [c for c in consumers if c in leaf_of]
        if consumers:
            target = leaf_of[consumers[0]]
        else:
            target = len(leaves)
            leaves.append([])
            kinds.append("glue")
        leaves[target].append(idx)
        leaf_of[idx] = target
    for leaf in leaves:
        leaf.sort()
    # number leaves by their first node so ids follow the graph order
    order = sorted(range(len(leaves)), key=lambda i: leaves[i][0])
    return [leaves[i] for i in order], [kinds[i] for i in order], set(deferred)


def _cut_blocks(graph: Graph, leaves: list[list[int]], floating: set[int]) -> list[list[int]]:
    """Group leaves into blocks separated by positions where one activation is live.

    Constant-like nodes (``floating``: constants, and shape arithmetic such as a detector's
    anchor grid, :meth:`Graph.shape_values`) sit anywhere in the node order; they follow their
    leaf and neither span nor place it, nor keep an activation live.
    """
    n = len(graph.nodes)
    if n == 0:
        return []
    leaf_of = [-1] * n
    anchored = [[x for x in leaf if x not in floating] or leaf for leaf in leaves]
    for lid, leaf in enumerate(anchored):
        leaf_of[min(leaf)] = lid
    leaf_last = [max(leaf) for leaf in anchored]
    leaf_first = [min(leaf) for leaf in anchored]
    # last consumer position of each non-constant, non-graph-input tensor
    last_use: dict[str, int] = {}
    for idx, node in enumerate(graph.nodes):
        if idx in floating:  # a Shape reads no values: it keeps no activation live
            continue
        for t in node.input:
            if t and t in graph.producer and graph.producer[t][0] not in floating:
                last_use[t] = idx
    # live count after position i = tensors produced at <= i and last used at > i
    delta = [0] * (n + 1)
    for t, last in last_use.items():
        p = graph.producer[t][0]
        if last > p:
            delta[p] += 1
            delta[last] -= 1
    # a leaf spanning position i forbids a cut there
    span = [0] * (n + 1)
    for lid in range(len(leaves)):
        if leaf_last[lid] > leaf_first[lid]:
            span[leaf_first[lid]] += 1
            span[leaf_last[lid]] -= 1
    cuts = []
    live = spanning = 0
    for i in range(n - 1):
        live += delta[i]
        spanning += span[i]
        if live <= 1 and spanning == 0:
            cuts.append(i)
    blocks: list[list[int]] = []
    start = 0
    for c in cuts + [n - 1]:
        lids = sorted({leaf_of[i] for i in range(start, c + 1) if leaf_of[i] >= 0})
        if lids:
            blocks.append(lids)
        start = c + 1
    return blocks


def _sequences(leaf_ids: list[int], sizes: list[int], max_size: int) -> list[list[int]]:
    groups: list[list[int]] = []
    size = 0
    for lid in leaf_ids:
        if groups and size + sizes[lid] <= max_size:
            groups[-1].append(lid)
            size += sizes[lid]
        else:
            groups.append([lid])
            size = sizes[lid]
    return groups


def _connected(graph: Graph, a: list[int], b: list[int]) -> bool:
    outs = {t for n in a for t in graph.nodes[n].output}
    return any(t in outs for n in b for t in graph.nodes[n].input)


def discover_regions(graph: Graph, config: RegionConfig | None = None) -> RegionTree:
    cfg = config or RegionConfig()
    max_seq = max(1, cfg.maximum_sequence_region_size)
    leaves, kinds, floating = _build_leaves(graph, max_seq)
    blocks = _cut_blocks(graph, leaves, floating)
    # a region's size counts what runs: constants and shape arithmetic ride along for free
    sizes = [sum(1 for n in leaf if n not in floating) for leaf in leaves]

    regions: list[Region] = []

    def new(rtype: RegionType, level: int, kind: str, nodes: list[int], children=()) -> Region:
        r = Region(id=len(regions), type=rtype, level=level, kind=kind, children=list(children))
        r.all_nodes = sorted(nodes)
        if rtype is RegionType.LEAF:
            r.nodes = sorted(nodes)
        r.inputs, r.outputs = _boundaries(graph, r.all_nodes)
        regions.append(r)
        return r

    root = new(RegionType.ROOT, 0, "root", list(range(len(graph.nodes))))
    leaf_region: dict[int, int] = {}
    for lid, nodes in enumerate(leaves):
        leaf_region[lid] = new(RegionType.LEAF, 0, kinds[lid], nodes).id

    def nodes_of(lids: list[int]) -> list[int]:
        return [n for lid in lids for n in leaves[lid]]

    top: list[int] = []
    tuning: list[int] = []
    pending_chain: list[int] = []  # consecutive single-leaf blocks, merged into sequences

    def flush_chain() -> None:
        for group in _sequences(pending_chain, sizes, max_seq):
            if len(group) == 1:
                top.append(leaf_region[group[0]])
                tuning.append(leaf_region[group[0]])
            else:
                seq = new(RegionType.COMPOSITE, 1, "sequence", nodes_of(group),
                          [leaf_region[g] for g in group])
                top.append(seq.id)
                tuning.append(seq.id)
        pending_chain.clear()

    for block in blocks:
        if len(block) == 1:
            lid = block[0]
            if pending_chain and not _connected(graph, leaves[pending_chain[-1]], leaves[lid]):
                flush_chain()
            pending_chain.append(lid)
            continue
        flush_chain()
        block_nodes = nodes_of(block)
        if sum(sizes[lid] for lid in block) <= cfg.minimum_topdown_search_size:
            comp = new(RegionType.COMPOSITE, 1, "block", block_nodes,
                       [leaf_region[lid] for lid in block])
            top.append(comp.id)
            tuning.append(comp.id)
            continue
        children: list[int] = []
        for group in _sequences(block, sizes, max_seq):
            if len(group) == 1:
                children.append(leaf_region[group[0]])
                tuning.append(leaf_region[group[0]])
            else:
                seq = new(RegionType.COMPOSITE, 1, "sequence", nodes_of(group),
                          [leaf_region[g] for g in group])
                children.append(seq.id)
                tuning.append(seq.id)
        comp = new(RegionType.COMPOSITE, 2, "block", block_nodes, children)
        top.append(comp.id)
    flush_chain()
    return _link(graph, regions, root, top, [leaf_region[lid] for lid in range(len(leaves))],
                 leaves, tuning)


def _link(graph: Graph, regions: list[Region], root: Region, top: list[int],
          leaf_ids: list[int], leaves: list[list[int]], tuning: list[int]) -> RegionTree:
    """The tree: parents and levels set, every node's leaf, the tuned regions in graph order."""
    for rid in top:
        regions[rid].parent = root.id
    root.children = top
    for r in regions:
        for c in r.children:
            regions[c].parent = r.id
    root.level = 1 + max((regions[c].level for c in top), default=0)
    leaf_of = [0] * len(graph.nodes)
    for lid, nodes in enumerate(leaves):
        for n in nodes:
            leaf_of[n] = leaf_ids[lid]
    tuning.sort(key=lambda rid: regions[rid].all_nodes[0])
    return RegionTree(regions=regions, root=root.id, leaf_of=leaf_of, tuning=tuning)
