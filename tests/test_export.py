"""QDQExporter: plans merge uses into one Q/DQ pair per tensor, every export is a valid model
that ONNX Runtime runs, scales have the right shapes, and nothing the user passed is modified."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from onnx import TensorProto, numpy_helper
from strategies import (
    PROPERTY,
    analyze,
    build_model,
    dag_specs,
    random_feeds,
    run_ort,
    spec_summary,
)

from qdq_optuna.errors import ModelError, OptionError
from qdq_optuna.examples import zoo
from qdq_optuna.model.graph import GRAPH_OUTPUT, load_model, opset_of
from qdq_optuna.placement.export import (
    QDQExporter,
    QuantPlan,
    check_quant_type,
    dequantized_weights,
    quantized_tensors,
    required_opset,
    upgrade_for,
    weight_scales,
)
from qdq_optuna.placement.rules import WEIGHTED_OPS
from qdq_optuna.runtimes.onnxruntime import ONNXRUNTIME_CPU
from qdq_optuna.runtimes.tensorrt import TENSORRT

RULES = [TENSORRT, ONNXRUNTIME_CPU]
QDQ = ("QuantizeLinear", "DequantizeLinear")
ZP_TYPE = {"int8": TensorProto.INT8, "uint8": TensorProto.UINT8,
           "fp8": TensorProto.FLOAT8E4M3FN}


def original_nodes(exported: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The exported model's nodes minus the Q/DQ it added, in order (the float model has no
    Q/DQ, so these are the original nodes, same order, same indices)."""
    return [n for n in exported.graph.node if n.op_type not in QDQ]


def check_export(graph, plan: QuantPlan, exported: onnx.ModelProto) -> None:
    """Structural checks of one export against its plan."""
    inits = {t.name: t for t in exported.graph.initializer}
    producers = {o: n for n in exported.graph.node for o in n.output}
    nodes = original_nodes(exported)
    # a quantized graph output keeps its name (its DQ writes it): its producer writes another
    renamed = {t: f"{t}_float" for t, cons, _ in plan.activations
               if any(n == GRAPH_OUTPUT for n, _ in cons)}
    assert len(nodes) == len(graph.nodes)
    for mine, theirs in zip(nodes, graph.nodes):
        assert mine.op_type == theirs.op_type and mine.name == theirs.name
        assert list(mine.output) == [renamed.get(t, t) for t in theirs.output]

    assert {t.removesuffix("_float") if t.endswith("_float") and t.removesuffix("_float") in renamed
            else t for t in quantized_tensors(exported)} == set(plan.tensors)
    qs = [n for n in exported.graph.node if n.op_type == "QuantizeLinear"]
    assert len(qs) == len(plan.activations), "one QuantizeLinear per quantized tensor"

    covered: dict[tuple[int, int], str] = {}
    for tensor, consumers, qtype in plan.activations:
        (q,) = [n for n in qs if n.input[0] == renamed.get(tensor, tensor)
                and inits[n.input[2]].data_type == ZP_TYPE[qtype]]
        scale, zp = inits[q.input[1]], inits[q.input[2]]
        # activations: per-tensor scalars
        assert list(scale.dims) == [] and list(zp.dims) == [], tensor
        assert scale.data_type == graph.elem_types[tensor]
        assert zp.data_type == ZP_TYPE[qtype]
        assert float(numpy_helper.to_array(scale)) > 0
        dqs = [n for n in exported.graph.node if n.op_type == "DequantizeLinear"
               and n.input[0] == q.output[0]]
        assert len(dqs) == 1
        dq = dqs[0]
        assert list(dq.input[1:]) == list(q.input[1:])
        assert graph.is_activation(tensor)
        for n, s in consumers:
            if n == GRAPH_OUTPUT:  # the DQ writes the graph output itself
                assert graph.graph_outputs[s] == tensor == dq.output[0]
                continue
            assert graph.nodes[n].input[s] == tensor
            assert nodes[n].input[s] == dq.output[0], "covered use not rewired"
            covered[(n, s)] = tensor
        # every other consumer still reads the float tensor
        readers = [(n, s) for n, node in enumerate(nodes) for s, t in enumerate(node.input)
                   if t == dq.output[0]]
        assert sorted(readers) == sorted(c for c in consumers if c[0] != GRAPH_OUTPUT)

    weights = {(n, s): q for n, s, q in plan.weights}
    for n, s, wq in plan.weights:
        dq = producers[nodes[n].input[s]]
        assert dq.op_type == "DequantizeLinear"
        w, w_scale, w_zp = (inits[i] for i in dq.input)
        original = graph.initializer(graph.nodes[n].input[s])
        assert list(w.dims) == list(original.dims)
        spec = WEIGHTED_OPS.get(graph.nodes[n].op_type)
        if spec is None or s != spec.weight_slot:
            check_constant_operand(graph, n, s, wq, covered, plan, dq, inits)
            continue
        assert w.data_type == ZP_TYPE[wq] and w_zp.data_type == ZP_TYPE[wq]
        axis = spec.axis(graph, n)
        # weights: per channel along the right axis
        assert [a.i for a in dq.attribute if a.name == "axis"] == [axis]
        assert list(w_scale.dims) == [original.dims[axis]]
        assert list(w_zp.dims) == [original.dims[axis]]
        assert (numpy_helper.to_array(w_scale) > 0).all()
        # a weight is quantized only with its activation
        assert any((n, a) in covered for a in spec.activation_slots)
    for (n, s) in covered:
        spec = WEIGHTED_OPS.get(graph.nodes[n].op_type)
        if spec and s in spec.activation_slots and graph.nodes[n].input[spec.weight_slot] in \
                graph.initializers:
            assert (n, spec.weight_slot) in weights
    # every other input is the original one (a renamed graph output's new name)
    for n, node in enumerate(nodes):
        for s, t in enumerate(node.input):
            if (n, s) not in covered and (n, s) not in weights and not (
                    s == 2 and (n, 1) in weights and t.endswith("_dequantized")):
                assert t == renamed.get(graph.nodes[n].input[s], graph.nodes[n].input[s]), (n, s)
    # no initializer is left behind unused
    used = {t for n in exported.graph.node for t in n.input}
    assert set(inits) <= used | {i.name for i in exported.graph.input}


def check_constant_operand(graph, n, s, qtype, covered, plan, dq, inits) -> None:
    """A constant input quantized with its op (ONNX Runtime's rules): per tensor, in the
    activations' type, within half a step of its value; only when the op's every float
    activation input is covered (a table: when every reader of its output is)."""
    node = graph.nodes[n]
    w, w_scale, w_zp = (numpy_helper.to_array(inits[i]) for i in dq.input)
    assert w_scale.shape == () and w_zp.shape == () and w.dtype == w_zp.dtype
    assert inits[dq.input[0]].data_type == ZP_TYPE[qtype] and qtype in ("uint8", "int8")
    assert not any(a.name == "axis" for a in dq.attribute)
    original = graph.array(node.input[s])
    restored = (w.astype(np.float64) - float(w_zp)) * float(w_scale)
    if node.op_type in ONNXRUNTIME_CPU.table_ops:
        assert s == 0
        out = node.output[0]
        (pair,) = [cons for t, cons, _ in plan.activations if t == out]
        assert set(pair) == {(c, k) for _, c, k in graph.uses(out) + graph.output_uses(out)}
        return
    assert node.op_type in ONNXRUNTIME_CPU.constant_operand_ops
    acts = [k for k, t in enumerate(node.input) if graph.is_activation(t)]
    assert acts and all((n, k) in covered for k in acts)
    assert np.abs(restored - original).max() <= float(w_scale) / 2 + 1e-6


# -- properties on random DAGs ----------------------------------------------------------------


@PROPERTY
@given(
    st.one_of(dag_specs(), dag_specs(repeated=True)),
    st.sampled_from(RULES),
    st.sampled_from(["int8", "uint8"]),
    st.data(),
)
def test_random_exports_are_valid(spec, rules, qtype, data):
    model = build_model(spec)
    before = model.SerializeToString()
    a = analyze(model, rules)
    refs = a.point_refs()
    chosen = data.draw(st.sets(st.sampled_from(range(len(refs)))) if refs else st.just(set()))
    uses = set()
    for i in chosen:
        pp, pid = refs[i]
        uses |= pp.uses([pid])
    graph_before = a.graph.full_model().SerializeToString()
    exporter = QDQExporter(a.graph, rules, qtype)
    plan = exporter.plan(uses)
    blob = exporter.to_bytes(plan)
    exported = onnx.load_from_string(blob)
    try:
        onnx.checker.check_model(exported, full_check=True)
        check_export(a.graph, plan, exported)
        feeds = {"x": np.random.default_rng(0).standard_normal((1, spec.channels, 8, 8),
                                                                 dtype=np.float32)}
        outputs = run_ort(blob, feeds)
        assert len(outputs) == len(model.graph.output)
        # random Mul/Conv chains can overflow float32 already; finiteness is only owed then
        if all(np.isfinite(o).all() for o in run_ort(model.SerializeToString(), feeds)):
            assert all(np.isfinite(o).all() for o in outputs)
    except Exception as exc:
        raise AssertionError(f"{exc}\nspec: {spec_summary(spec)}\nplan: {plan}") from exc
    # (g) nothing the user (or the Graph) holds was modified
    assert model.SerializeToString() == before
    assert a.graph.full_model().SerializeToString() == graph_before
    # the plan is the identity of the model
    assert exporter.to_bytes(exporter.plan(uses)) == blob
    assert exporter.plan(sorted(uses)).key == plan.key
    # covering at least the planned uses; never anything the plan did not ask for
    planned = {(t, n, s) for t, cons, _ in plan.activations for n, s in cons}
    assert uses <= planned
    if rules is ONNXRUNTIME_CPU:
        assert planned == uses  # no promotions on ONNX Runtime
    else:  # TensorRT promotes Concat consumers of a tensor whose other uses are covered
        for t, n, _ in planned - uses:
            assert a.graph.nodes[n].op_type == "Concat"
            assert all((t, c, s) in planned for c, s in a.graph.consumers[t]
                       if a.graph.nodes[c].op_type != "Concat")


@PROPERTY
@given(dag_specs(), st.sampled_from(RULES))
def test_empty_plan_is_the_float_model(spec, rules):
    a = analyze(build_model(spec), rules)
    exporter = QDQExporter(a.graph, rules, rules.default_quant_type)
    plan = exporter.plan([])
    assert len(plan) == 0 and plan.qdq_pairs == 0 and plan.tensors == []
    exported = exporter.to_model(plan)
    assert exported.SerializeToString() == a.graph.full_model().SerializeToString()


@PROPERTY
@given(dag_specs(), st.sampled_from(RULES), st.sampled_from(["int8", "uint8"]))
def test_everything_quantized_runs(spec, rules, qtype):
    model = build_model(spec)
    before = model.SerializeToString()
    a = analyze(model, rules)
    exporter = QDQExporter(a.graph, rules, qtype)
    plan = exporter.plan(a.all_uses())
    exported = exporter.to_model(plan)
    onnx.checker.check_model(exported, full_check=True)
    check_export(a.graph, plan, exported)
    run_ort(exported, {"x": np.ones((1, spec.channels, 8, 8), np.float32)})
    assert model.SerializeToString() == before


# -- merging and promotion -------------------------------------------------------------------


def test_partial_cover_of_fanned_out_tensor(analyzed):
    """Covering one of two consumers: one Q/DQ pair feeding only that consumer."""
    a = analyzed("tiny_concat", TENSORRT)
    graph = a.graph
    tensor = "stem/relu_out"
    branch_a, branch_b = a.node("branch_a/conv"), a.node("branch_b/conv")
    exporter = QDQExporter(graph, TENSORRT, "int8")
    plan = exporter.plan({(tensor, branch_a, 0)})
    assert plan.activations == ((tensor, ((branch_a, 0),), "int8"),)
    assert plan.weights == ((branch_a, 1, "int8"),)
    exported = exporter.to_model(plan)
    onnx.checker.check_model(exported, full_check=True)
    check_export(graph, plan, exported)
    nodes = original_nodes(exported)
    qs = [n for n in exported.graph.node if n.op_type == "QuantizeLinear"]
    assert [q.input[0] for q in qs] == [tensor]
    assert nodes[branch_a].input[0].endswith("_dequantized")
    assert nodes[branch_b].input[0] == tensor
    assert nodes[branch_b].input[1] == "branch_b/conv.weight"
    assert "branch_b/conv.weight" in {t.name for t in exported.graph.initializer}
    assert "branch_a/conv.weight" not in {t.name for t in exported.graph.initializer}
    run_ort(exported)


def test_uses_of_one_tensor_merge_into_one_pair(analyzed):
    """q/k/v MatMuls share their input: covering all three gives one QuantizeLinear for it,
    and the residual Add still reads the float tensor."""
    a = analyzed("transformer", TENSORRT)
    graph = a.graph
    tensor = "embeddings/layernorm_out"
    qkv = [a.node(f"layer0/attention/{x}/matmul") for x in ("query", "key", "value")]
    residual = a.node("layer0/attention/residual")
    exporter = QDQExporter(graph, TENSORRT, "int8")
    plan = exporter.plan({(tensor, n, 0) for n in qkv})
    assert plan.tensors == [tensor] and len(plan) == 1 and plan.qdq_pairs == 4
    exported = exporter.to_model(plan)
    onnx.checker.check_model(exported, full_check=True)
    check_export(graph, plan, exported)
    qs = [n for n in exported.graph.node if n.op_type == "QuantizeLinear"]
    assert len(qs) == 1 and qs[0].input[0] == tensor
    (dq,) = [n for n in exported.graph.node if n.op_type == "DequantizeLinear"
             and n.input[0] == qs[0].output[0]]
    nodes = original_nodes(exported)
    assert sorted(n for n, node in enumerate(nodes) if dq.output[0] in node.input) == sorted(qkv)
    assert nodes[residual].input[1] == tensor
    # MatMul weights [hidden, hidden]: per channel along the last axis
    inits = {t.name: t for t in exported.graph.initializer}
    for n in qkv:
        w_dq = next(x for x in exported.graph.node if x.output[0] == nodes[n].input[1])
        assert [x.i for x in w_dq.attribute if x.name == "axis"] == [1]
        assert list(inits[w_dq.input[1]].dims) == [32]
    out = run_ort(exported)
    assert out[0].shape == (1, 16, 32)


def test_tensorrt_promotes_concat_consumers(analyzed):
    a = analyzed("yolo", TENSORRT)
    graph = a.graph
    tensor = "model.9/pool0_out"
    pool1, concat = a.node("model.9/pool1"), a.node("model.9/concat")
    assert sorted(graph.consumers[tensor]) == sorted([(pool1, 0), (concat, 1)])
    exporter = QDQExporter(graph, TENSORRT, "int8")
    plan = exporter.plan({(tensor, pool1, 0)})
    assert plan.activations == ((tensor, tuple(sorted([(pool1, 0), (concat, 1)])), "int8"),)
    exported = exporter.to_model(plan)
    check_export(graph, plan, exported)
    nodes = original_nodes(exported)
    assert nodes[concat].input[1].endswith("_dequantized")
    # not when a non-Concat consumer stays uncovered
    split = "model.4/split_out1"
    conv, add = a.node("model.4/m.0/cv1/conv"), a.node("model.4/m.0/add")
    plan = exporter.plan({(split, conv, 0)})
    assert plan.activations == ((split, ((conv, 0),), "int8"),)
    plan = exporter.plan({(split, conv, 0), (split, add, 0)})
    assert len(plan.activations[0][1]) == 3
    # and never on ONNX Runtime
    ort_a = QDQExporter(graph, ONNXRUNTIME_CPU, "uint8")
    assert ort_a.plan({(tensor, pool1, 0)}).activations == ((tensor, ((pool1, 0),), "uint8"),)


# -- runtime specifics -------------------------------------------------------------------------


def test_onnxruntime_gemm_bias_is_int32(analyzed):
    a = analyzed("resnet", ONNXRUNTIME_CPU)
    graph = a.graph
    fc = a.node("fc")
    exporter = QDQExporter(graph, ONNXRUNTIME_CPU, "uint8")
    plan = exporter.plan({("flatten_out", fc, 0)})
    assert plan.weights == ((fc, 1, "int8"),)
    exported = exporter.to_model(plan)
    onnx.checker.check_model(exported, full_check=True)
    inits = {t.name: t for t in exported.graph.initializer}
    producers = {o: n for n in exported.graph.node for o in n.output}
    gemm = original_nodes(exported)[fc]
    bias_dq = producers[gemm.input[2]]
    assert bias_dq.op_type == "DequantizeLinear"
    q_bias, b_scale, b_zp = (inits[i] for i in bias_dq.input)
    assert q_bias.data_type == TensorProto.INT32 and b_zp.data_type == TensorProto.INT32
    assert list(q_bias.dims) == [10] and list(b_scale.dims) == [10]
    # bias scale = activation scale x weight scale (what ORT's QGemm requires)
    act_scale, _ = exporter.activation_params("flatten_out", "uint8")
    w_dq = producers[gemm.input[1]]
    w_scale = numpy_helper.to_array(inits[w_dq.input[1]])
    np.testing.assert_allclose(numpy_helper.to_array(b_scale), act_scale * w_scale, rtol=1e-6)
    bias = numpy_helper.to_array(graph.initializer("fc.bias"))
    np.testing.assert_allclose(
        numpy_helper.to_array(q_bias) * numpy_helper.to_array(b_scale), bias,
        atol=float(numpy_helper.to_array(b_scale).max()))
    assert "fc.bias" not in inits and "fc.weight" not in inits
    assert dequantized_weights(exported) == {q_bias.name, w_dq.input[0]}
    run_ort(exported)
    # TensorRT keeps the float bias
    trt = QDQExporter(load_model(graph.full_model()), TENSORRT, "int8")
    gemm_trt = original_nodes(trt.to_model(trt.plan({("flatten_out", fc, 0)})))[fc]
    assert gemm_trt.input[2] == "fc.bias"


def test_fp8_export_after_upgrade(zoo_model):
    model = zoo_model("resnet")
    before = model.SerializeToString()
    graph = load_model(model)
    assert required_opset(graph, ["fp8"]) == 19 and required_opset(graph, ["int8"]) == 13
    assert upgrade_for(graph, ["int8"]) is graph
    a = analyze(graph, TENSORRT, quant_types=["fp8"])
    assert a.graph.opset == 19 and opset_of(a.graph.model) == 19
    exporter = QDQExporter(a.graph, TENSORRT, "fp8")
    plan = exporter.plan(a.all_uses())
    assert {q for _, _, q in plan.activations} == {"fp8"}
    assert {q for _, _, q in plan.weights} == {"fp8"}
    exported = exporter.to_model(plan)
    onnx.checker.check_model(exported, full_check=True)
    check_export(a.graph, plan, exported)
    inits = {t.name: t for t in exported.graph.initializer}
    zps = [inits[n.input[2]] for n in exported.graph.node if n.op_type in QDQ]
    assert zps and all(z.data_type == TensorProto.FLOAT8E4M3FN for z in zps)
    assert opset_of(exported) == 19
    run_ort(exported)
    assert model.SerializeToString() == before


@pytest.mark.parametrize("opset, qtype, target", [(10, "int8", 13), (11, "int8", 13),
                                                  (13, "fp8", 19), (13, "int8", 13)])
@pytest.mark.parametrize("rules", RULES, ids=lambda r: r.name)
def test_pipeline_on_older_opset(zoo_model, opset, qtype, target, rules):
    model = zoo_model("resnet")
    model.opset_import[0].version = opset  # the ResNet's ops read the same at opset 10-17
    before = model.SerializeToString()
    a = analyze(model, rules, quant_types=[qtype])
    assert a.graph.opset == target
    exporter = QDQExporter(a.graph, rules, qtype)
    plan = exporter.plan(a.all_uses())
    exported = exporter.to_model(plan)
    onnx.checker.check_model(exported, full_check=True)
    check_export(a.graph, plan, exported)
    assert opset_of(exported) == target
    run_ort(exported)
    assert model.SerializeToString() == before


def test_upgrade_failure_is_a_model_error():
    # a Clip with min/max inputs is only valid from opset 11; at "opset 10" the converter fails
    model = zoo.small("mobilenet")
    model.opset_import[0].version = 10
    with pytest.raises(ModelError):
        analyze(model, TENSORRT)


def test_uint8_zero_points(analyzed):
    a = analyzed("tiny_chain", ONNXRUNTIME_CPU)
    exporter = QDQExporter(a.graph, ONNXRUNTIME_CPU, "uint8")
    assert exporter.activation_params("relu1_out", "uint8") == (0.1, 0)  # after Relu
    assert exporter.activation_params("input", "uint8") == (0.1, 128)
    assert exporter.activation_params("input", "int8") == (0.1, 0)
    custom = QDQExporter(a.graph, ONNXRUNTIME_CPU, "uint8", scales={"input": (0.02, 7)},
                         default_scale=0.5)
    assert custom.activation_params("input", "uint8") == (0.02, 7)
    assert custom.activation_params("relu1_out", "uint8") == (0.5, 0)
    exported = custom.to_model(custom.plan(a.graph.uses("input")))
    inits = {t.name: t for t in exported.graph.initializer}
    (q,) = [n for n in exported.graph.node if n.op_type == "QuantizeLinear"]
    assert float(numpy_helper.to_array(inits[q.input[1]])) == pytest.approx(0.02)
    assert int(numpy_helper.to_array(inits[q.input[2]])) == 7


def test_mixed_quant_types_per_use(analyzed):
    a = analyzed("tiny_concat", TENSORRT)
    exporter = QDQExporter(a.graph, TENSORRT, "int8")
    uses = {u: "int8" for u in a.graph.uses("stem/relu_out")}
    uses.update({u: "none" for u in a.graph.uses("fuse/relu_out")})
    plan = exporter.plan(uses)
    assert plan.tensors == ["stem/relu_out"]


def test_weight_scales():
    w = np.arange(24, dtype=np.float32).reshape(2, 3, 2, 2) - 12
    per_channel = weight_scales(w, 0, "int8")
    assert per_channel.shape == (2,)
    np.testing.assert_allclose(per_channel, np.abs(w).reshape(2, -1).max(1) / 127)
    assert weight_scales(w, 1, "fp8").shape == (3,)
    assert weight_scales(w, None, "int8").shape == ()
    assert float(weight_scales(np.zeros((4, 4), np.float32), 0, "int8").min()) > 0


def test_a_quant_type_member_is_its_plain_name():
    """Members compare, hash and print as the plain names that runs store."""
    from qdq_optuna.model.calibration import QuantType

    assert QuantType.FP8 == "fp8" and "fp8" in {QuantType.FP8} and QuantType.INT8 in {"int8"}
    assert f"{QuantType.UINT8}" == "uint8" and QuantType.parse("int8") is QuantType.INT8
    with pytest.raises(OptionError, match=r"^--quant-type: unknown 'int4' \(choose from"):
        QuantType.parse("int4")


def test_options_are_checked(analyzed):
    a = analyzed("tiny_chain", TENSORRT)
    assert check_quant_type("fp8") == "fp8"
    with pytest.raises(OptionError, match="--quant-type"):
        check_quant_type("int4")
    with pytest.raises(OptionError, match="--quant-type"):
        QDQExporter(a.graph, TENSORRT, "int16")
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(OptionError, match="default_q_scale"):
            QDQExporter(a.graph, TENSORRT, "int8", default_scale=bad)


@pytest.mark.parametrize("qtype, zero_point", [("int8", 128), ("uint8", -1), ("uint8", 256)])
def test_default_zero_point_out_of_range_is_an_option_error(analyzed, qtype, zero_point):
    a = analyzed("tiny_chain", TENSORRT)
    with pytest.raises(OptionError, match="zero"):
        exporter = QDQExporter(a.graph, TENSORRT, qtype, default_zero_point=zero_point)
        exporter.to_bytes(exporter.plan(a.graph.uses("relu1_out")))


def test_save_and_reload(tmp_path, analyzed):
    a = analyzed("tiny_residual", TENSORRT)
    exporter = QDQExporter(a.graph, TENSORRT, "int8")
    plan = exporter.plan(a.all_uses())
    path = exporter.save(plan, tmp_path / "out" / "model.onnx")
    assert path.is_file() and not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]
    again = load_model(path, allow_qdq=True)
    assert quantized_tensors(again.model) == set(plan.tensors)
    with pytest.raises(ModelError):
        load_model(path)


def test_exported_node_names_are_unique():
    """Q/DQ node names must not collide with the model's own node names (load_model refuses
    duplicate names, so the export could not be read back, e.g. as a --qdq-baseline)."""
    model = zoo.tiny_chain()
    model.graph.node[2].name = "conv2_in"
    graph = load_model(model)
    exporter = QDQExporter(graph, TENSORRT, "int8")
    exported = exporter.to_model(exporter.plan(graph.uses("relu1_out")))
    names = [n.name for n in exported.graph.node]
    assert len(names) == len(set(names))
    load_model(exported, allow_qdq=True)


def test_exported_node_names_do_not_collide_with_model_node_names():
    model = zoo.tiny_chain()
    conv2 = next(n for n in model.graph.node if n.name == "conv2")
    conv2.name = "relu1_out_QuantizeLinear"
    graph = load_model(model)
    exporter = QDQExporter(graph, TENSORRT, "int8")
    exported = exporter.to_model(exporter.plan(graph.uses("relu1_out")))
    names = [n.name for n in exported.graph.node]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def _colliding_names_model() -> onnx.ModelProto:
    """tiny_chain with tensors called 'a/b' and 'a_b' (both sanitize to 'a_b')."""
    model = zoo.tiny_chain()
    rename = {"relu1_out": "a/b", "relu2_out": "a_b"}
    for node in model.graph.node:
        node.input[:] = [rename.get(t, t) for t in node.input]
        node.output[:] = [rename.get(t, t) for t in node.output]
    for vi in model.graph.value_info:
        vi.name = rename.get(vi.name, vi.name)
    return model


def test_colliding_sanitized_names_stay_unique():
    graph = load_model(_colliding_names_model())
    exporter = QDQExporter(graph, TENSORRT, "int8")
    plan = exporter.plan(graph.uses("a/b") + graph.uses("a_b"))
    exported = exporter.to_model(plan)
    onnx.checker.check_model(exported, full_check=True)
    check_export(graph, plan, exported)
    run_ort(exported)


def test_same_plan_same_bytes_whatever_was_exported_before():
    graph = load_model(_colliding_names_model())
    first, second = QDQExporter(graph, TENSORRT, "int8"), QDQExporter(graph, TENSORRT, "int8")
    plan_a, plan_b = first.plan(graph.uses("a_b")), first.plan(graph.uses("a/b"))
    assert second.plan(graph.uses("a_b")).key == plan_a.key
    a_first = first.to_bytes(plan_a)
    second.to_bytes(plan_b)
    assert second.to_bytes(plan_a) == a_first


def test_quant_plan_key_and_sizes(analyzed):
    a = analyzed("tiny_residual", TENSORRT)
    exporter = QDQExporter(a.graph, TENSORRT, "int8")
    uses = sorted(a.all_uses())
    plan = exporter.plan(uses)
    assert plan.key == exporter.plan(list(reversed(uses))).key == QDQExporter(
        a.graph, TENSORRT, "int8").plan(uses).key
    assert plan.key != exporter.plan(uses[1:]).key
    assert len(plan.key) == 24
    assert plan.qdq_pairs == len(plan.activations) + len({(n, s) for n, s, _ in plan.weights})
    assert plan.tensors == sorted({t for t, _, _ in plan.activations})


def test_export_accepts_a_graph_input_tensor(analyzed):
    a = analyzed("tiny_chain", TENSORRT)
    exporter = QDQExporter(a.graph, TENSORRT, "int8")
    plan = exporter.plan(a.graph.uses("input"))
    exported = exporter.to_model(plan)
    onnx.checker.check_model(exported, full_check=True)
    check_export(a.graph, plan, exported)
    assert exported.graph.node[0].op_type in QDQ  # Q/DQ of a graph input come first
    out_q = run_ort(exported, random_feeds(exported))
    out_f = run_ort(a.graph.full_model(), random_feeds(exported))
    assert out_q[0].shape == out_f[0].shape


def test_untouched_zoo_models_through_everything(zoo_model):
    for name in ("yolo", "transformer", "mobilenet", "tiny_attention"):
        model = zoo_model(name)
        before = model.SerializeToString()
        for rules in RULES:
            a = analyze(model, rules)
            exporter = QDQExporter(a.graph, rules, rules.default_quant_type)
            plan = exporter.plan(a.all_uses())
            exported = exporter.to_model(plan)
            onnx.checker.check_model(exported, full_check=True)
            check_export(a.graph, plan, exported)
            run_ort(exported)
        assert model.SerializeToString() == before


def test_weights_live_once_in_the_graph_and_exports_share_them():
    """Compaction moves every big initializer's data out of the parsed model into one
    serialized copy that all exporters of the graph concatenate; nothing about the model
    changes (full model, arrays, exported bytes)."""
    model = zoo.build("resnet", "small")
    graph = load_model(model)
    before = graph.full_model().SerializeToString()
    arrays = {t.name: numpy_helper.to_array(t) for t in graph.model.graph.initializer}
    plain = QDQExporter(load_model(model), TENSORRT, "int8", data_dir=None)
    first = QDQExporter(graph, TENSORRT, "int8")
    second = QDQExporter(graph, TENSORRT, "int8")
    big = [t.name for t in model.graph.initializer if t.ByteSize() >= 1 << 10]
    assert big and graph.compacted == set(big)
    light = {t.name: t for t in graph.model.graph.initializer}
    for name in big:
        assert not light[name].raw_data and list(light[name].dims) == list(arrays[name].shape)
        np.testing.assert_array_equal(graph.array(name), arrays[name])
        assert first._init_bytes[name] is second._init_bytes[name] is graph.init_fields[name]
    assert graph.full_model().SerializeToString() == before
    conv = next(n for n in range(len(graph.nodes)) if graph.nodes[n].op_type == "Conv")
    uses = {(graph.nodes[conv].input[0], conv, 0)}
    assert first.to_bytes(first.plan(uses)) == plain.to_bytes(plain.plan(uses))
    assert onnx.load_from_string(first.to_bytes(first.plan(set()))) == graph.full_model()


# -- ONNX Runtime's recipe: graph outputs, constant operands, tables ---------------------------


def _bias_model() -> onnx.ModelProto:
    """x -> MatMul(w) -> Add(b) -> y (graph output) -> Relu -> z."""
    rng = np.random.default_rng(1)
    inits = [numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.uniform(0.5, 2.0, 8).astype(np.float32), "b")]
    nodes = [onnx.helper.make_node("MatMul", ["x", "w"], ["mm"], name="matmul"),
             onnx.helper.make_node("Add", ["mm", "b"], ["y"], name="add"),
             onnx.helper.make_node("Relu", ["y"], ["z"], name="relu")]
    info = onnx.helper.make_tensor_value_info
    graph = onnx.helper.make_graph(
        nodes, "bias", [info("x", TensorProto.FLOAT, [4, 8])],
        [info("y", TensorProto.FLOAT, [4, 8]), info("z", TensorProto.FLOAT, [4, 8])], inits)
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])


def test_a_quantized_graph_output_keeps_its_name_and_its_op_runs_quantized(zoo_model):
    """tiny_concat ends in a Conv writing the graph output: with the output's Q/DQ (its DQ
    writes the output's name) ONNX Runtime runs that Conv as a QLinearConv too."""
    from qdq_optuna.backends import onnxruntime_kernels as kernels
    from qdq_optuna.placement import starts
    from qdq_optuna.runtimes.prepared import PreparedModel

    pm = PreparedModel.prepare(zoo_model("tiny_concat"), runtime="onnxruntime")
    exporter = pm.exporter()
    uses = starts.all_on_start(pm).uses
    assert ("output", GRAPH_OUTPUT, 0) in uses
    plan = exporter.plan(uses)
    model = exporter.to_model(plan)
    onnx.checker.check_model(model, full_check=True)
    check_export(pm.graph, plan, model)
    assert [o.name for o in model.graph.output] == ["output"]
    (writer,) = [n for n in model.graph.node if "output" in n.output]
    assert writer.op_type == "DequantizeLinear"
    (out,) = run_ort(model.SerializeToString(), random_feeds(model))
    assert out.shape == (1, 16, 16, 16) and np.isfinite(out).all()
    convs = sum(n.op_type == "Conv" for n in pm.graph.nodes)
    with_output = kernels.kernels_of(model)
    without = kernels.kernels_of(exporter.to_bytes(exporter.plan(uses - {("output", GRAPH_OUTPUT, 0)})))
    assert with_output.ops["QLinearConv"] == convs and "Conv" not in with_output.float_ops
    assert without.ops["QLinearConv"] == convs - 1 and without.float_ops["Conv"] == 1


def test_a_graph_output_read_by_nodes_in_two_types():
    """Mixed types: the graph output's pair (uint8) and a reader's (int8) both quantize the
    tensor its producer now writes under a new name."""
    from strategies import analyze

    a = analyze(_bias_model(), ONNXRUNTIME_CPU, quant_types=("uint8", "int8"))
    relu = a.node("relu")
    exporter = QDQExporter(a.graph, ONNXRUNTIME_CPU, "uint8")
    plan = exporter.plan({("y", GRAPH_OUTPUT, 0): "uint8", ("y", relu, 0): "int8"})
    model = exporter.to_model(plan)
    onnx.checker.check_model(model, full_check=True)
    check_export(a.graph, plan, model)
    feeds = {"x": np.random.default_rng(0).standard_normal((4, 8), dtype=np.float32)}
    (y, z), (fy, _) = run_ort(model, feeds), run_ort(_bias_model(), feeds)
    inside = np.abs(fy) < 12.7  # the default scale 0.1 and zero point 128 hold these
    assert inside.mean() > 0.9 and np.abs(y - fy)[inside].max() <= 0.05 + 1e-5
    assert np.isfinite(z).all() and (z >= 0).all()


def test_constant_operands_come_with_their_ops_activations():
    """A bias Add whose activation input carries Q/DQ gets its constant quantized as
    ``quantize_static`` does (activation type, per tensor, asymmetric: the same integers), so
    ONNX Runtime runs it as a QLinearAdd; with the activation float, the constant stays float."""
    from onnxruntime.quantization.quant_utils import compute_data_quant_params
    from strategies import analyze

    from qdq_optuna.backends import onnxruntime_kernels as kernels

    a = analyze(_bias_model(), ONNXRUNTIME_CPU, quant_types=("uint8",))
    matmul, add, relu = a.node("matmul"), a.node("add"), a.node("relu")
    exporter = QDQExporter(a.graph, ONNXRUNTIME_CPU, "uint8")
    uses = {("x", matmul, 0), ("mm", add, 0), ("y", relu, 0), ("y", GRAPH_OUTPUT, 0)}
    plan = exporter.plan(uses)
    assert (add, 1, "uint8") in plan.weights and (matmul, 1, "int8") in plan.weights
    model = exporter.to_model(plan)
    check_export(a.graph, plan, model)
    producers = {o: n for n in model.graph.node for o in n.output}
    dq = producers[original_nodes(model)[add].input[1]]
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    zero_point, scale = compute_data_quant_params(a.graph.array("b").reshape(-1), TensorProto.UINT8, False)
    assert float(inits[dq.input[1]]) == pytest.approx(float(scale))
    assert int(inits[dq.input[2]]) == int(zero_point) and inits[dq.input[0]].dtype == np.uint8
    assert kernels.kernels_of(model).ops.get("QLinearAdd") == 1
    # the Add's activation input float: its constant stays float
    assert not any(n == add for n, _, _ in exporter.plan(uses - {("mm", add, 0)}).weights)
    # TensorRT never quantizes constant operands
    assert not any(n == add for n, _, _ in QDQExporter(a.graph, TENSORRT, "int8").plan(
        {u for u in uses if u[1] != GRAPH_OUTPUT}).weights)


def test_an_embedding_table_takes_its_lookups_scale(zoo_model):
    """When every reader of a Gather's output reads it through Q/DQ, the constant table is
    quantized with that output's scale and zero point: the same numbers (a lookup commutes
    with quantization), and ONNX Runtime looks up the quantized table with no Q after it."""
    import dataclasses

    from qdq_optuna.backends import onnxruntime_kernels as kernels
    from qdq_optuna.placement import starts
    from qdq_optuna.runtimes.prepared import PreparedModel

    pm = PreparedModel.prepare(zoo_model("transformer"), runtime="onnxruntime")
    gather = next(i for i, n in enumerate(pm.graph.nodes) if n.op_type == "Gather")
    out = pm.graph.nodes[gather].output[0]
    uses = starts.all_on_start(pm).uses
    assert {u for u in pm.graph.uses(out)} <= uses
    exporter = pm.exporter()
    plan = exporter.plan(uses)
    assert (gather, 0, "uint8") in plan.weights
    plain = QDQExporter(pm.graph, dataclasses.replace(pm.rules, table_ops=frozenset()), "uint8")
    assert not any(n == gather for n, _, _ in plain.plan(uses).weights)
    feeds = random_feeds(pm.graph.model)
    ours, theirs = run_ort(exporter.to_bytes(plan), feeds), run_ort(plain.to_bytes(plain.plan(uses)), feeds)
    assert all(np.array_equal(x, y) for x, y in zip(ours, theirs))
    assert kernels.kernels_of(exporter.to_bytes(plan)).ops["QuantizeLinear"] == \
        kernels.kernels_of(plain.to_bytes(plain.plan(uses))).ops["QuantizeLinear"] - 1
    # one reader left float: the table stays float
    first = next(iter(pm.graph.uses(out)))
    assert not any(n == gather for n, _, _ in exporter.plan(uses - {first}).weights)


@pytest.mark.parametrize("saturates", [True, False])
def test_weights_take_seven_bits_where_onnx_runtime_kernels_saturate(monkeypatch, saturates):
    """ONNX Runtime's u8 x s8 kernels on x86-64 without VNNI sum pairs in 16 bits: 8-bit
    weights overflow there, so its rules quantize weights to 7 bits (its ``reduce_range``);
    TensorRT's never do."""
    import qdq_optuna.placement.export as export
    from qdq_optuna import PreparedModel

    monkeypatch.setattr(export, "cpu_saturates_u8s8", lambda: saturates)
    for runtime in ("onnxruntime", "tensorrt"):
        pm = PreparedModel.prepare(zoo.build("resnet", "small"), runtime=runtime)
        exporter = pm.exporter()
        uses = set()
        for pp in pm.tunable:
            uses |= set(pp.uses(pp.ids))
        model = exporter.to_model(exporter.plan(uses))
        weights = [numpy_helper.to_array(t) for t in model.graph.initializer
                   if t.data_type == TensorProto.INT8 and t.dims and len(t.dims) > 1]
        assert weights
        largest = max(int(np.abs(w.astype(np.int32)).max()) for w in weights)
        assert largest == (63 if saturates and runtime == "onnxruntime" else 127), runtime


@pytest.mark.parametrize("saturates", [True, False])
def test_openvino_rules_give_the_first_layer_seven_bit_weights_where_kernels_saturate(
        monkeypatch, saturates):
    """OpenVINO's CPU kernels saturate the same way; the raw input a first layer reads spans
    the whole u8 range, so that layer's weights take 7 bits there (NNCF's default overflow
    fix) and every other layer keeps 8."""
    import qdq_optuna.placement.export as export
    from qdq_optuna import PreparedModel

    monkeypatch.setattr(export, "cpu_saturates_u8s8", lambda: saturates)
    pm = PreparedModel.prepare(zoo.build("resnet", "small"), runtime="openvino")
    exporter = pm.exporter()
    model = exporter.to_model(exporter.plan({u for pp in pm.tunable for u in pp.uses(pp.ids)}))
    inits = {t.name: t for t in model.graph.initializer}
    first = model.graph.node[[n.op_type for n in model.graph.node].index("Conv")]
    largest = {}
    for node in model.graph.node:
        if node.op_type == "DequantizeLinear" and node.input[0] in inits \
                and inits[node.input[0]].data_type == TensorProto.INT8:
            reader = next(n for n in model.graph.node if node.output[0] in n.input)
            w = numpy_helper.to_array(inits[node.input[0]]).astype(np.int32)
            largest[reader.name] = int(np.abs(w).max())
    assert len(largest) > 3 and first.name in largest
    assert largest.pop(first.name) == (63 if saturates else 127)
    assert set(largest.values()) == {127}
