"""PatternIndex: signatures are invariant under relabeling, members of a pattern are truly
isomorphic to its representative (node maps, slot maps), and everything is deterministic."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from onnx import AttributeProto, helper
from strategies import (
    PROPERTY,
    analyze,
    build_model,
    canonical_to_relabeled,
    check_tree,
    dag_specs,
    isomorphic_pairs,
    spec_summary,
)

from qdq_optuna.model.graph import load_model
from qdq_optuna.placement.patterns import COMMUTATIVE_OPS, PatternIndex
from qdq_optuna.placement.regions import RegionTree, RegionType, discover_regions
from qdq_optuna.runtimes.onnxruntime import ONNXRUNTIME_CPU
from qdq_optuna.runtimes.tensorrt import TENSORRT

REPO = Path(__file__).resolve().parents[1]


def pattern_fingerprint(index: PatternIndex) -> list:
    return [
        (p.id, p.signature, tuple(p.regions), tuple(p.ops),
         tuple((r, tuple(m)) for r, m in sorted(p.node_maps.items())),
         tuple((r, tuple(m)) for r, m in sorted(p.slot_maps.items())))
        for p in index.patterns
    ] + [sorted(index.signatures.items())]


def _attrs(node) -> list:
    """Kernel-relevant attributes; a tensor attribute (a Constant's value) by type and shape."""
    out = []
    for a in node.attribute:
        if a.name in ("name", "doc_string"):
            continue
        if a.type == AttributeProto.TENSOR:
            out.append((a.name, a.t.data_type, tuple(a.t.dims)))
        else:
            out.append((a.name, helper.get_attribute_value(a)))
    return sorted(out, key=repr)


def check_isomorphisms(graph, tree: RegionTree, index: PatternIndex) -> None:
    """Each member of each pattern is the representative's graph under node_maps/slot_maps."""
    assert sorted(r for p in index.patterns for r in p.regions) == sorted(tree.tuning)
    assert len({p.id for p in index.patterns}) == len(index.patterns)
    outputs = set(graph.graph_outputs)
    for p in index.patterns:
        rep = p.representative
        rep_nodes = p.node_maps[rep]
        assert rep_nodes == tree[rep].all_nodes
        pos = {n: i for i, n in enumerate(rep_nodes)}
        assert p.ops == [graph.nodes[n].op_type for n in rep_nodes]
        sigs = {index.signatures[r] for r in p.regions}
        assert len(sigs) == 1 and p.signature.startswith(sigs.pop())
        assert len({tree[r].type for r in p.regions}) == 1
        for r in p.regions:
            region = tree[r]
            nodes = p.node_maps[r]
            assert sorted(nodes) == region.all_nodes, f"{p.id}: node map of {r} is not a bijection"
            inside = set(nodes)
            boundary: dict[str, str] = {}
            for i, (rn, mn) in enumerate(zip(rep_nodes, nodes)):
                a, b = graph.nodes[rn], graph.nodes[mn]
                assert a.op_type == b.op_type and a.domain == b.domain
                assert _attrs(a) == _attrs(b), f"{p.id}: attributes differ at node {i}"
                perm = p.slot_maps[r][i]
                assert sorted(perm) == list(range(len(a.input)))
                if a.op_type not in COMMUTATIVE_OPS:
                    assert tuple(perm) == tuple(range(len(a.input)))
                for s, ta in enumerate(a.input):
                    tb = b.input[perm[s]]
                    assert p.slot(r, i, s) == perm[s] and p.node(r, i) == mn
                    assert bool(ta) == bool(tb)
                    if not ta:
                        continue
                    if graph.is_constant(ta) or graph.is_constant(tb):
                        assert graph.is_constant(ta) and graph.is_constant(tb)
                        assert len(graph.shapes.get(ta) or ()) == len(graph.shapes.get(tb) or ())
                        assert graph.elem_types.get(ta) == graph.elem_types.get(tb)
                        continue
                    pa, pb = graph.producer.get(ta), graph.producer.get(tb)
                    if pa is not None and pa[0] in set(rep_nodes):
                        assert pb is not None and pb[0] in inside, f"{p.id}: internal edge lost"
                        assert pb == (nodes[pos[pa[0]]], pa[1]), f"{p.id}: edge maps elsewhere"
                    else:
                        assert pb is None or pb[0] not in inside
                        # boundary tensors correspond one to one
                        assert boundary.setdefault(ta, tb) == tb
                for oa, ob in zip(a.output, b.output):
                    leaves_a = oa in outputs or any(
                        c not in set(rep_nodes) for c, _ in graph.consumers.get(oa, []))
                    leaves_b = ob in outputs or any(
                        c not in inside for c, _ in graph.consumers.get(ob, []))
                    assert leaves_a == leaves_b
            assert len(set(boundary.values())) == len(boundary)
            # children correspond: each representative child maps onto one member child
            if region.children:
                member_children = {frozenset(tree[c].all_nodes): c for c in region.children}
                for child in tree[rep].children:
                    image = frozenset(nodes[pos[n]] for n in tree[child].all_nodes)
                    assert image in member_children, (
                        f"{p.id}: child {child} of {rep} maps across children of {r}")
                    assert index.signatures[member_children[image]] == index.signatures[child]


@PROPERTY
@given(st.one_of(dag_specs(), dag_specs(repeated=True)))
def test_random_dag_patterns_are_isomorphisms(spec):
    graph = load_model(build_model(spec))
    tree = discover_regions(graph)
    index = PatternIndex(graph, tree)
    try:
        check_isomorphisms(graph, tree, index)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\nspec: {spec_summary(spec)}") from None


@PROPERTY
@given(dag_specs())
def test_random_dag_patterns_deterministic(spec):
    model = build_model(spec)
    a = analyze(model, TENSORRT)
    b = analyze(model, TENSORRT)
    assert pattern_fingerprint(a.index) == pattern_fingerprint(b.index)
    again = PatternIndex(a.graph, a.tree)
    assert pattern_fingerprint(again) == pattern_fingerprint(a.index)
    assert [pp.ids for pp in a.points] == [pp.ids for pp in b.points]
    assert [pp.resolved for pp in a.points] == [pp.resolved for pp in b.points]


# -- signature invariance --------------------------------------------------------------------


@PROPERTY
@given(isomorphic_pairs(reorder=False))
def test_signatures_invariant_under_renaming_and_swaps(pair):
    """Same node order, renamed tensors and nodes, swapped Add/Mul inputs: same regions, same
    pattern signatures, same number of offered points per pattern."""
    spec, relabel, model, relabeled = pair
    for rules in (TENSORRT, ONNXRUNTIME_CPU):
        a, b = analyze(model, rules), analyze(relabeled, rules)
        assert [r.all_nodes for r in a.tree.regions] == [r.all_nodes for r in b.tree.regions]
        assert a.index.signatures == b.index.signatures, spec_summary(spec)
        assert Counter(p.signature for p in a.index.patterns) == Counter(
            p.signature for p in b.index.patterns)
        assert Counter((pp.pattern.signature, len(pp.points)) for pp in a.points) == Counter(
            (pp.pattern.signature, len(pp.points)) for pp in b.points)
        if not relabel.swapped:
            assert [pp.ids for pp in a.points] == [pp.ids for pp in b.points]


def _transplant(tree: RegionTree, where: list[int], names: dict[str, str]) -> RegionTree:
    """The same regions (same node sets) expressed in a relabeled, reordered graph."""
    regions = []
    for r in tree.regions:
        regions.append(replace(
            r,
            nodes=sorted(where[n] for n in r.nodes),
            all_nodes=sorted(where[n] for n in r.all_nodes),
            inputs=[names[t] for t in r.inputs],
            outputs=[names[t] for t in r.outputs],
            children=list(r.children),
        ))
    leaf_of = [0] * len(where)
    for n, rid in enumerate(tree.leaf_of):
        leaf_of[where[n]] = rid
    tuning = sorted(tree.tuning, key=lambda rid: regions[rid].all_nodes[0])
    return RegionTree(regions=regions, root=tree.root, leaf_of=leaf_of, tuning=tuning)


@PROPERTY
@given(isomorphic_pairs())
def test_signatures_invariant_under_permutation(pair):
    """A topologically permuted, renamed, input-swapped copy: the same node sets get the same
    signatures, and the pattern signatures form the same multiset.

    (Region *discovery* is a function of the node order, so the permuted copy is analysed with
    the original regions carried over node by node.)"""
    spec, relabel, model, relabeled = pair
    g1, g2 = load_model(model), load_model(relabeled)
    where = canonical_to_relabeled(spec, relabel)
    names = {g1.graph_inputs[0]: g2.graph_inputs[0]}
    for i, j in enumerate(where):
        for a, b in zip(g1.nodes[i].output, g2.nodes[j].output):
            names[a] = b
        assert g1.nodes[i].op_type == g2.nodes[j].op_type
    tree1 = discover_regions(g1)
    tree2 = _transplant(tree1, where, names)
    i1, i2 = PatternIndex(g1, tree1), PatternIndex(g2, tree2)
    assert i1.signatures == i2.signatures, spec_summary(spec)
    assert Counter(p.signature for p in i1.patterns) == Counter(p.signature for p in i2.patterns)
    assert Counter(len(p.regions) for p in i1.patterns) == Counter(
        len(p.regions) for p in i2.patterns)
    check_isomorphisms(g2, tree2, i2)


@PROPERTY
@given(isomorphic_pairs())
def test_permuted_copy_is_analysed_consistently(pair):
    """Whatever regions the permuted copy gets, they satisfy every structural property."""
    _, _, _, relabeled = pair
    graph = load_model(relabeled)
    tree = discover_regions(graph)
    check_tree(graph, tree)
    check_isomorphisms(graph, tree, PatternIndex(graph, tree))


def test_different_graphs_do_not_share_a_pattern():
    """Conv->Relu and Conv->Sigmoid chains: same shape of graph, different ops."""
    from strategies import DagSpec, OpSpec

    spec = DagSpec(
        channels=2,
        ops=(OpSpec("Conv", (0,)), OpSpec("Relu", (1,)), OpSpec("Add", (2, 0)),
             OpSpec("Conv", (3,)), OpSpec("Sigmoid", (4,)), OpSpec("Add", (5, 3))),
        all_dangling_outputs=True,
    )
    a = analyze(build_model(spec), TENSORRT)
    check_isomorphisms(a.graph, a.tree, a.index)
    for p in a.index.patterns:
        ops = {tuple(a.graph.nodes[n].op_type for n in p.node_maps[r]) for r in p.regions}
        assert len(ops) == 1


# -- golden: zoo models -----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["resnet", "mobilenet", "yolo", "transformer", "tiny_residual"])
def test_zoo_patterns_are_isomorphisms(analyzed, name):
    a = analyzed(name, TENSORRT)
    check_isomorphisms(a.graph, a.tree, a.index)


def _block_of(graph, region) -> set[str]:
    return {graph.nodes[n].name.split("/")[0] for n in region.all_nodes}


def test_resnet_basic_blocks_share_a_pattern(zoo_model):
    from qdq_optuna.examples import zoo

    graph = load_model(zoo.small("resnet", blocks=(2, 2, 2, 2)))
    tree = discover_regions(graph)
    index = PatternIndex(graph, tree)
    by_block = {}
    for p in index.patterns:
        for r in p.regions:
            blocks = _block_of(graph, tree[r])
            if len(blocks) == 1:
                by_block[blocks.pop()] = p.id
    plain = {by_block[b] for b in ("layer1.0", "layer1.1", "layer2.1", "layer3.1", "layer4.1")}
    down = {by_block[b] for b in ("layer2.0", "layer3.0", "layer4.0")}
    assert len(plain) == 1 and len(down) == 1 and plain != down
    pattern = next(p for p in index.patterns if p.id in down)
    assert len(pattern.regions) == 3
    assert tree[pattern.representative].type is RegionType.COMPOSITE

    # the default small ResNet: its three downsampling blocks are one pattern
    a = load_model(zoo_model("resnet"))
    t = discover_regions(a)
    i = PatternIndex(a, t)
    groups = [sorted(b for r in p.regions for b in _block_of(a, t[r])) for p in i.patterns]
    assert ["layer2.0", "layer3.0", "layer4.0"] in groups


def test_transformer_layers_share_patterns(analyzed):
    a = analyzed("transformer", TENSORRT)
    layer_patterns = [p for p in a.index.patterns
                      if all(a.graph.nodes[n].name.startswith("layer")
                             for r in p.regions for n in a.tree[r].all_nodes)]
    assert layer_patterns
    for p in layer_patterns:
        layers = {a.graph.nodes[n].name.split("/")[0] for r in p.regions
                  for n in a.tree[r].all_nodes}
        assert layers == {"layer0", "layer1"}, (p.id, p.ops)


# -- determinism across processes (string hashing differs per process) -----------------------

_SCRIPT = textwrap.dedent(
    """
    import json
    from qdq_optuna.examples import zoo
    from qdq_optuna.model.graph import load_model
    from qdq_optuna.placement.points import enumerate_points
    from qdq_optuna.runtimes.tensorrt import TENSORRT
    from qdq_optuna.placement.patterns import PatternIndex
    from qdq_optuna.placement.regions import discover_regions

    out = []
    for name in ("yolo", "transformer"):
        g = load_model(zoo.small(name))
        t = discover_regions(g)
        i = PatternIndex(g, t)
        out.append([[r.id, r.type.value, r.all_nodes, r.parent] for r in t.regions])
        for p in i.patterns:
            pp = enumerate_points(g, t, i, p, TENSORRT)
            out.append([p.id, p.signature, p.regions, pp.ids,
                        sorted((k, sorted(v.items())) for k, v in pp.resolved.items()),
                        pp.concat_groups, pp.fusion_groups])
    print(json.dumps(out))
    """
)


def test_deterministic_across_processes():
    results = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        proc = subprocess.run(
            [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, cwd=REPO,
            timeout=120, check=True,
        )
        results.append(json.loads(proc.stdout))
    assert results[0] == results[1]
