"""enumerate_points: pattern-relative points resolve consistently in every member region,
every offered point changes the model, and the runtime rules keep Q/DQ off the uses that must
never carry it."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper
from strategies import PROPERTY, analyze, build_model, dag_specs, spec_summary

from qdq_optuna.errors import OptionError
from qdq_optuna.model.graph import GRAPH_OUTPUT
from qdq_optuna.placement.points import (
    CHILD_REGION_INPUT,
    NODE_INPUT,
    REGION_OUTPUT,
    InsertionPoint,
)
from qdq_optuna.placement.rules import STRUCTURAL_INPUTS, residual_conv
from qdq_optuna.runtimes import profile_for
from qdq_optuna.runtimes.onnxruntime import ONNXRUNTIME_CPU
from qdq_optuna.runtimes.tensorrt import TENSORRT

RULES = [TENSORRT, ONNXRUNTIME_CPU]


def _children(tree, region: int) -> list[int]:
    return sorted(tree[region].children, key=lambda c: tree[c].all_nodes[0])


def expected_uses(graph, tree, pattern, point: InsertionPoint, member: int) -> set:
    """What ``point`` addresses in ``member`` before the runtime rules, derived from the
    representative through the pattern's node and slot maps."""
    rep = pattern.representative
    pos = {n: i for i, n in enumerate(pattern.node_maps[rep])}

    def mapped(node: int, slot: int):
        i = pos[node]
        m_node = pattern.node(member, i)
        m_slot = pattern.slot(member, i, slot)
        return (graph.nodes[m_node].input[m_slot], m_node, m_slot)

    if point.kind == NODE_INPUT:
        return {mapped(pattern.node_maps[rep][point.index], point.slot)}
    if point.kind == CHILD_REGION_INPUT:
        child = tree[_children(tree, rep)[point.index]]
        tensor = child.inputs[point.slot]
        inside = set(child.all_nodes)
        return {mapped(c, s) for c, s in graph.consumers.get(tensor, []) if c in inside}
    assert point.kind == REGION_OUTPUT
    owner = tree[rep] if point.index < 0 else tree[_children(tree, rep)[point.index]]
    tensor = owner.outputs[point.slot]
    node, out = graph.producer[tensor]
    member_tensor = graph.nodes[pattern.node(member, pos[node])].output[out]
    return set(graph.uses(member_tensor) + graph.output_uses(member_tensor))


def check_points(a, rules) -> None:
    graph, tree = a.graph, a.tree
    for pp in a.points:
        pattern = pp.pattern
        rep = pattern.representative
        assert [p.id for p in pp.points] == pp.ids and len(set(pp.ids)) == len(pp.ids)
        assert set(pp.resolved) == set(pp.ids)
        assert not set(pp.dropped) & set(pp.ids)
        keys = set()
        for point in pp.points:
            assert InsertionPoint.from_dict(point.to_dict()) == point
            res = pp.resolved[point.id]
            assert set(res) == set(pattern.regions)
            # (e) every offered point covers something, and no two points are the same model
            assert any(res.values()), f"{pattern.id}/{point.id} covers nothing"
            key = tuple(tuple(res[r]) for r in pattern.regions)
            assert key not in keys, f"{pattern.id}/{point.id} duplicates another point"
            keys.add(key)
            rep_expected = expected_uses(graph, tree, pattern, point, rep)
            for r in pattern.regions:
                uses = res[r]
                assert uses == sorted(set(uses))
                expected = expected_uses(graph, tree, pattern, point, r)
                # (c) the member's uses are the representative's, mapped through the pattern
                assert set(uses) == {u for u in expected if u[0] and rules.quantizable(graph, u)}, (
                    f"{pattern.id}/{point.id} in region {r}")
                for t, n, s in uses:
                    read = graph.graph_outputs if n == GRAPH_OUTPUT else graph.nodes[n].input
                    assert read[s] == t
                    assert rules.use_reason(graph, (t, n, s)) is None
                    assert graph.is_activation(t)
                assert len({t for t, _, _ in expected}) <= 1
                if point.kind != REGION_OUTPUT:
                    # inside the member; as many uses as in the representative
                    assert len(expected) == len(rep_expected)
                    assert all(n in set(tree[r].all_nodes) for _, n, _ in expected)
                    ops = sorted(graph.nodes[n].op_type for _, n, _ in expected)
                    assert ops == sorted(graph.nodes[n].op_type for _, n, _ in rep_expected)
                if point.kind == CHILD_REGION_INPUT:
                    holders = {c for c in tree[r].children for _, n, _ in expected
                               if n in set(tree[c].all_nodes)}
                    assert len(holders) == 1
                    (holder,) = holders
                    assert {t for t, _, _ in expected} <= set(tree[holder].inputs)
                if point.kind == REGION_OUTPUT and uses:
                    (tensor,) = {t for t, _, _ in uses}
                    producer = graph.producer[tensor][0]
                    assert producer in set(tree[r].all_nodes)
                    # a tensor-level point: every quantizable use of the tensor, anywhere
                    whole = {u for u in graph.uses(tensor) + graph.output_uses(tensor)
                             if rules.quantizable(graph, u)}
                    assert set(uses) == whole
        for group in pp.concat_groups + pp.fusion_groups:
            assert len(group) >= 2 and set(group) <= set(pp.ids) and group == sorted(group)
        for group in pp.concat_groups:
            # all inputs of one Concat in the representative
            consumers = {n for pid in group for _, n, _ in pp.resolved[pid][rep]}
            assert len(consumers) == 1
            (concat,) = consumers
            assert graph.nodes[concat].op_type == "Concat"
            covered = {s for pid in group for _, _, s in pp.resolved[pid][rep]}
            assert covered == {s for s, t in enumerate(graph.nodes[concat].input) if t}


@PROPERTY
@given(st.one_of(dag_specs(), dag_specs(repeated=True)), st.sampled_from(RULES))
def test_random_dag_points(spec, rules):
    a = analyze(build_model(spec), rules)
    try:
        check_points(a, rules)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\nspec: {spec_summary(spec)}") from None


@PROPERTY
@given(dag_specs(), st.sampled_from(RULES))
def test_points_cover_exactly_the_quantizable_uses(spec, rules):
    """Union of all points = every quantizable use of the model; nothing structural."""
    a = analyze(build_model(spec), rules)
    graph = a.graph
    offered = a.all_uses()
    quantizable = {
        (t, n, s) for n, node in enumerate(graph.nodes) for s, t in enumerate(node.input)
        if t and rules.quantizable(graph, (t, n, s))
    } | {u for t in set(graph.graph_outputs) for u in graph.output_uses(t)
         if rules.quantizable(graph, u)}
    assert offered == quantizable
    for t, n, s in offered:
        if n == GRAPH_OUTPUT:  # ONNX Runtime: the output of an op it quantizes
            assert rules is ONNXRUNTIME_CPU and rules.after_quantized_op(graph, t)
            continue
        op = graph.nodes[n].op_type
        assert s not in STRUCTURAL_INPUTS.get(op, ())
        assert not graph.is_constant(t)


@pytest.mark.parametrize("rules", RULES, ids=lambda r: r.name)
@pytest.mark.parametrize("name", ["resnet", "mobilenet", "yolo", "transformer", "tiny_concat",
                                  "tiny_attention"])
def test_zoo_points(analyzed, name, rules):
    check_points(analyzed(name, rules), rules)


def test_profile_for_finds_each_runtimes_rules():
    assert profile_for("tensorrt").rules is TENSORRT
    assert profile_for("onnxruntime").rules is ONNXRUNTIME_CPU
    with pytest.raises(OptionError, match="--runtime"):
        profile_for("coreml")


# -- golden: ResNet and the TensorRT Conv+Add+Relu fusion ------------------------------------


@pytest.mark.parametrize(
    "tensor, add",
    [
        ("layer1.0/bn2_out", "layer1.0/add"),
        ("layer2.0/bn2_out", "layer2.0/add"),
        ("layer4.0/bn2_out", "layer4.0/add"),
    ],
)
def test_tensorrt_never_offers_conv_bn_into_add_relu(analyzed, tensor, add):
    trt = analyzed("resnet", TENSORRT)
    graph = trt.graph
    node = trt.node(add)
    slot = list(graph.nodes[node].input).index(tensor)
    use = (tensor, node, slot)
    assert graph.producer_op(tensor) == "BatchNormalization"
    add_out = graph.nodes[node].output[0]
    assert any(graph.nodes[c].op_type == "Relu" for c, _ in graph.consumers[add_out])
    assert use not in trt.all_uses()
    assert "Conv+Add+Relu" in TENSORRT.use_reason(graph, use)
    # ONNX Runtime has no such fusion: the same use is offered there
    ort_rules = analyzed("resnet", ONNXRUNTIME_CPU)
    assert use in ort_rules.all_uses()


@pytest.mark.parametrize("block", ["layer2.0", "layer3.0", "layer4.0"])
def test_tensorrt_offers_the_downsampling_shortcut(analyzed, block):
    """Both Add inputs of a downsampling block come from Convs: TensorRT fuses the Add into the
    main path's last Conv and wants the other input, the 1x1 shortcut's output, in INT8. That
    one is offered; the main path's stays withheld (never both)."""
    trt = analyzed("resnet", TENSORRT)
    graph = trt.graph
    node = trt.node(f"{block}/add")
    inputs = list(graph.nodes[node].input)
    short = inputs.index(f"{block}/downsample/bn_out")
    main = inputs.index(f"{block}/bn2_out")
    assert residual_conv(graph, node) == short
    assert TENSORRT.use_reason(graph, (inputs[short], node, short)) is None
    assert (inputs[short], node, short) in trt.all_uses()
    assert "Conv+Add+Relu" in TENSORRT.use_reason(graph, (inputs[main], node, main))
    assert (inputs[main], node, main) not in trt.all_uses()


def test_tensorrt_offers_the_identity_shortcut_of_a_basic_block(analyzed):
    """layer1.0's shortcut is the MaxPool output, not a Conv: that Add input stays a point."""
    trt = analyzed("resnet", TENSORRT)
    add = trt.node("layer1.0/add")
    shortcut = trt.graph.nodes[add].input[1]
    assert trt.graph.producer_op(shortcut) == "MaxPool"
    assert (shortcut, add, 1) in trt.all_uses()


def test_conv_add_relu_rule_needs_the_relu(zoo_model):
    """The same Conv->BN->Add without a Relu after the Add is a point on TensorRT."""
    model = zoo_model("tiny_residual")
    add = next(n for n in model.graph.node if n.name == "layer1.0/add")
    relu = next(n for n in model.graph.node if n.name == "layer1.0/relu2")
    relu.op_type = "Sigmoid"
    a = analyze(model, TENSORRT)
    node = a.node("layer1.0/add")
    assert (add.input[0], node, 0) in a.all_uses()


def test_onnxruntime_never_offers_conv_into_relu(analyzed):
    ort_a = analyzed("tiny_chain", ONNXRUNTIME_CPU)
    relu = ort_a.node("relu1")
    use = ("conv1_out", relu, 0)
    assert use not in ort_a.all_uses()
    assert "fused" in ONNXRUNTIME_CPU.use_reason(ort_a.graph, use)
    # TensorRT fuses the Relu into the Conv's kernel too (its Q after the Relu)
    trt_a = analyzed("tiny_chain", TENSORRT)
    assert use not in trt_a.all_uses()
    assert "activation chain" in TENSORRT.use_reason(trt_a.graph, use)
    assert ("relu1_out", trt_a.node("conv2"), 0) in trt_a.all_uses()


# -- golden: YOLO concat groups --------------------------------------------------------------


def test_yolo_concat_groups(analyzed):
    a = analyzed("yolo", TENSORRT)
    graph = a.graph
    groups = [(pp, g) for pp in a.points for g in pp.concat_groups]
    assert len(groups) >= 10
    grouped_concats = set()
    for pp, group in groups:
        for r in pp.pattern.regions:
            concats = {n for pid in group for _, n, _ in pp.resolved[pid][r]}
            assert len(concats) == 1
            (concat,) = concats
            node = graph.nodes[concat]
            assert node.op_type == "Concat"
            covered = {(t, s) for pid in group for t, _, s in pp.resolved[pid][r]}
            assert covered == {(t, s) for s, t in enumerate(node.input)}, node.name
            grouped_concats.add(node.name)
    for name in ("model.2/concat", "model.9/concat", "model.11/concat", "model.22/concat"):
        assert name in grouped_concats, name


# -- golden: transformer structural inputs ---------------------------------------------------


@pytest.mark.parametrize("rules", RULES, ids=lambda r: r.name)
def test_transformer_structural_inputs_are_never_points(analyzed, rules):
    a = analyzed("transformer", rules)
    graph = a.graph
    offered = a.all_uses()
    gathers = [i for i, n in enumerate(graph.nodes) if n.op_type == "Gather"]
    reshapes = [i for i, n in enumerate(graph.nodes) if n.op_type == "Reshape"]
    assert gathers and reshapes
    assert graph.elem_types["input_ids"] == 7  # INT64
    assert not any(t == "input_ids" for t, _, _ in offered)
    assert not any(n in gathers for _, n, _ in offered)
    assert not any(n in reshapes and s == 1 for _, n, s in offered)
    # the reshaped activations themselves are points on ONNX Runtime (Reshape is quantized)
    if rules is ONNXRUNTIME_CPU:
        assert any(n in reshapes and s == 0 for _, n, s in offered)
    # the structural uses are also dropped with a reason
    for n in reshapes:
        shape = graph.nodes[n].input[1]
        assert rules.use_reason(graph, (shape, n, 1)) is not None


@pytest.mark.parametrize("rules", RULES, ids=lambda r: r.name)
def test_qkv_input_is_a_tensor_level_point(analyzed, rules):
    """The LayerNorm output feeding query/key/value (and the residual) has a RegionOutput point
    that covers all its quantizable uses."""
    a = analyzed("transformer", rules)
    graph = a.graph
    tensor = "embeddings/layernorm_out"
    consumers = {graph.nodes[n].name for n, _ in graph.consumers[tensor]}
    assert {f"layer0/attention/{x}/matmul" for x in ("query", "key", "value")} <= consumers
    whole = {u for u in graph.uses(tensor) if rules.quantizable(graph, u)}
    assert any(set(pp.resolved[pid][r]) == whole
               for pp in a.points for pid in pp.ids for r in pp.pattern.regions)


# -- ONNX Runtime: what its recipe quantizes ---------------------------------------------------


def _after_matmul_model() -> onnx.ModelProto:
    """x -> MatMul -> Div(c) -> Exp -> Add(b) -> y -> Clip -> z, the Clip's min computed from
    the MatMul's output; graph outputs y, z and the Exp's output."""
    rng = np.random.default_rng(0)
    const = {"w": rng.standard_normal((8, 8)).astype(np.float32),
             "c": np.array(2.0, np.float32), "b": rng.standard_normal(8).astype(np.float32)}
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["mm"], name="matmul"),
        helper.make_node("Div", ["mm", "c"], ["div"], name="div"),
        helper.make_node("Exp", ["div"], ["exp"], name="exp"),
        helper.make_node("Add", ["exp", "b"], ["y"], name="add"),
        helper.make_node("ReduceMax", ["mm"], ["peak"], name="peak", keepdims=0),
        helper.make_node("Mul", ["peak", "c"], ["low"], name="low"),
        helper.make_node("Clip", ["y", "low"], ["z"], name="clip"),
    ]
    graph = helper.make_graph(
        nodes, "after_matmul", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8]),
         helper.make_tensor_value_info("z", TensorProto.FLOAT, [4, 8]),
         helper.make_tensor_value_info("exp", TensorProto.FLOAT, [4, 8])],
        [numpy_helper.from_array(v, k) for k, v in const.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_onnxruntime_offers_every_reader_of_a_quantized_op_output():
    """ONNX Runtime fuses DQ -> op -> Q only when the Q reads the op's output alone, so the
    readers of such an output (a Div with no kernel of its own, a graph output) may read it
    through the same Q/DQ; a reader of an op ONNX Runtime never quantizes may not, and a
    structural input never is one."""
    a = analyze(_after_matmul_model(), ONNXRUNTIME_CPU)
    g, offered = a.graph, a.all_uses()
    div, exp, clip = a.node("div"), a.node("exp"), a.node("clip")
    assert ONNXRUNTIME_CPU.use_reason(g, ("mm", div, 0)) is None and ("mm", div, 0) in offered
    assert "no quantized kernel" in ONNXRUNTIME_CPU.use_reason(g, ("div", exp, 0))
    assert ("div", exp, 0) not in offered
    assert {("y", GRAPH_OUTPUT, 0), ("z", GRAPH_OUTPUT, 1), ("y", clip, 0)} <= offered
    assert ("exp", GRAPH_OUTPUT, 2) not in offered  # Exp never runs quantized
    # the Mul's output is quantized for any reader, but not as Clip's min (structural)
    assert "structural" in ONNXRUNTIME_CPU.use_reason(g, ("low", clip, 1))
    # TensorRT: every float activation input as before, never a graph output
    trt = analyze(_after_matmul_model(), TENSORRT).all_uses()
    assert ("div", exp, 0) in trt and not any(n == GRAPH_OUTPUT for _, n, _ in trt)
    assert "graph output" in TENSORRT.use_reason(g, ("y", GRAPH_OUTPUT, 0))


def test_graph_output_is_covered_by_its_tensor_level_point(analyzed):
    """tiny_concat ends in a Conv: on ONNX Runtime the point on its output covers the graph
    output, and that point belongs to the Conv's fusion group (DQ in, Q out)."""
    a = analyzed("tiny_concat", ONNXRUNTIME_CPU)
    use = ("output", GRAPH_OUTPUT, 0)
    (pp, pid), = [(pp, pid) for pp in a.points for pid in pp.ids
                  if use in pp.uses([pid])]
    assert pp.uses([pid]) == {use}
    assert any(pid in group for group in pp.fusion_groups)
    assert a.graph.name_of(GRAPH_OUTPUT) == "<graph output>"
    assert use not in analyzed("tiny_concat", TENSORRT).all_uses()


@pytest.mark.parametrize("option", [{"op_types": "Relu,Concat"}, {"exclude_nodes": "sppf/conv"}])
def test_node_filters_keep_the_graph_output_of_an_excluded_node_float(zoo_model, option):
    from qdq_optuna.runtimes.prepared import PreparedModel

    use = ("output", GRAPH_OUTPUT, 0)
    pm = PreparedModel.prepare(zoo_model("tiny_concat"), runtime="onnxruntime", **option)
    assert all(use not in pp.uses(pp.ids) for pp in pm.points)
    assert pm.rules.use_reason(pm.graph, use) is not None
    free = PreparedModel.prepare(zoo_model("tiny_concat"), runtime="onnxruntime")
    assert any(use in pp.uses(pp.ids) for pp in free.points)


def test_tensorrt_rules_take_none_of_the_onnxruntime_recipe_rules():
    assert not TENSORRT.output_quantized_ops and not TENSORRT.constant_operand_ops
    assert not TENSORRT.table_ops
    assert ONNXRUNTIME_CPU.output_quantized_ops == ONNXRUNTIME_CPU.quantizable_ops
