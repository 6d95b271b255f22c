"""discover_regions: leaves partition the graph, composites are unions of their children,
tuning regions partition the graph, and the result is a pure function of the model."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import PROPERTY, build_model, check_tree, dag_specs, node_count, spec_summary

from qdq_optuna.model.graph import load_model
from qdq_optuna.placement.regions import RegionConfig, RegionTree, RegionType, discover_regions

ZOO = ["resnet", "mobilenet", "yolo", "transformer", "tiny_chain", "tiny_residual",
       "tiny_concat", "tiny_attention"]


def fingerprint(tree: RegionTree) -> list:
    return [
        [(r.id, r.type.value, r.level, r.parent, tuple(r.children), tuple(r.nodes),
          tuple(r.all_nodes), tuple(r.inputs), tuple(r.outputs), r.kind) for r in tree.regions],
        tree.root, list(tree.leaf_of), list(tree.tuning),
    ]


configs = st.sampled_from(
    [None, RegionConfig(3, 3), RegionConfig(1, 1), RegionConfig(20, 5), RegionConfig(4, 40)]
)


@PROPERTY
@given(dag_specs(), configs)
def test_random_dag_regions_partition(spec, config):
    graph = load_model(build_model(spec))
    tree = discover_regions(graph, config)
    try:
        check_tree(graph, tree)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\nspec: {spec_summary(spec)}") from None


@PROPERTY
@given(dag_specs(), configs)
def test_random_dag_regions_deterministic(spec, config):
    model = build_model(spec)
    before = model.SerializeToString()
    graph = load_model(model)
    first = fingerprint(discover_regions(graph, config))
    assert fingerprint(discover_regions(graph, config)) == first
    assert fingerprint(discover_regions(load_model(model), config)) == first
    assert model.SerializeToString() == before


@PROPERTY
@given(dag_specs())
def test_unnamed_nodes_are_called_by_index(spec):
    graph = load_model(build_model(spec))
    for idx, node in enumerate(graph.nodes):
        assert graph.name_of(idx) == (node.name or f"#{idx}")
    unnamed = [op for op in spec.ops if not op.named]
    assert sum(not n.name for n in graph.nodes) == sum(node_count(op) for op in unnamed)


@pytest.mark.parametrize("name", ZOO)
def test_zoo_regions(zoo_model, name):
    graph = load_model(zoo_model(name))
    tree = discover_regions(graph)
    check_tree(graph, tree)
    assert fingerprint(discover_regions(graph)) == fingerprint(tree)


# -- golden: ResNet ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def resnet(zoo_model):
    graph = load_model(zoo_model("resnet"))
    return graph, discover_regions(graph)


def _index(graph, name: str) -> int:
    return next(i for i, n in enumerate(graph.nodes) if n.name == name)


@pytest.mark.parametrize("layer", ["layer2.0", "layer3.0", "layer4.0"])
def test_resnet_downsampling_add_relu_share_a_leaf_with_a_conv(resnet, layer):
    graph, tree = resnet
    add = _index(graph, f"{layer}/add")
    relu = _index(graph, f"{layer}/relu2")
    holders = [leaf for leaf in tree.leaves if add in leaf.nodes]
    assert len(holders) == 1
    leaf = holders[0]
    assert relu in leaf.nodes
    assert [leaf.id for leaf in tree.leaves if relu in leaf.nodes] == [leaf.id]
    assert leaf.kind == "compute"
    assert any(graph.nodes[x].op_type == "Conv" for x in leaf.nodes)


def test_resnet_blocks_are_composites(resnet):
    graph, tree = resnet
    for layer in ("layer1.0", "layer2.0", "layer3.0", "layer4.0"):
        members = {i for i, n in enumerate(graph.nodes) if n.name.startswith(f"{layer}/")}
        owners = [r for r in tree.regions if r.type is RegionType.COMPOSITE
                  and set(r.all_nodes) == members]
        assert len(owners) == 1, layer
        assert owners[0].kind == "block" and owners[0].id in tree.tuning


def test_single_node_graph(zoo_model):
    from onnx import TensorProto, helper

    graph_proto = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "one",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
    )
    model = helper.make_model(graph_proto, opset_imports=[helper.make_opsetid("", 17)])
    graph = load_model(model)
    tree = discover_regions(graph)
    check_tree(graph, tree)
    assert len(tree.leaves) == 1 and tree.tuning == [tree.leaves[0].id]
    assert graph.name_of(0) == "#0"
