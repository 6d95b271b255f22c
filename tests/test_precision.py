"""High precision: the float part converted to FP16/BF16 once, Q/DQ exported into it.

Converted models must pass the checker and agree with FP32 (ONNX Runtime runs FP16, its
reference evaluator BF16); exported Q/DQ models keep FP16 everywhere outside the Q/DQ pairs,
quantize weights from their FP32 values and take scales calibrated on the FP32 model.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qdq_optuna import PreparedModel
from qdq_optuna.errors import OptionError
from qdq_optuna.model.precision import (
    KEEP_FP32,
    convert_precision,
    float_types,
)
from qdq_optuna.runtimes import profile_for

#: relative L2 error of FP16 / BF16 outputs against FP32 that the zoo models stay within
#: (FP16 keeps 11 significant bits, BF16 8; errors accumulate over ~20 layers)
FP16_TOLERANCE = 1e-2
BF16_TOLERANCE = 5e-2


def feeds_for(model: onnx.ModelProto, seed: int = 0, scale: float = 1.0) -> dict:
    rng = np.random.default_rng(seed)
    out = {}
    inits = {t.name for t in model.graph.initializer}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        shape = [d.dim_value for d in tt.shape.dim]
        if tt.elem_type == TensorProto.FLOAT:
            out[vi.name] = (rng.standard_normal(shape) * scale).astype(np.float32)
        else:  # token ids: small enough for every zoo vocabulary
            out[vi.name] = rng.integers(0, 40, shape).astype(
                helper.tensor_dtype_to_np_dtype(tt.elem_type))
    return out


def run_ort(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), so,
                                   providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-30))


@pytest.mark.parametrize("name", ["resnet", "mobilenet", "yolo", "transformer"])
def test_fp16_conversion_is_valid_and_agrees_with_fp32(zoo_model, name):
    model = zoo_model(name)
    before = model.SerializeToString()
    hp = convert_precision(model, "fp16")
    assert model.SerializeToString() == before  # the input is never modified
    onnx.checker.check_model(hp.model, full_check=True)
    types = float_types(hp.model)
    io = {vi.name for vi in (*hp.model.graph.input, *hp.model.graph.output)}
    fp32 = {t for t, e in types.items() if e == TensorProto.FLOAT}
    # only the graph's I/O (keep_io_types) and float-only inputs (Resize scales) stay FP32
    assert all(t in io or t.endswith(".scales") for t in fp32), sorted(fp32)
    assert sum(e == TensorProto.FLOAT16 for e in types.values()) > len(types) // 2
    for vi in (*hp.model.graph.input, *hp.model.graph.output):
        if vi.type.tensor_type.elem_type != TensorProto.INT64:
            assert vi.type.tensor_type.elem_type == TensorProto.FLOAT
    feeds = feeds_for(model)
    for a, b in zip(run_ort(model, feeds), run_ort(hp.model, feeds)):
        assert b.dtype == np.float32
        assert rel_l2(a, b) < FP16_TOLERANCE
        assert rel_l2(a, b) > 0  # it did compute in FP16


def test_keep_io_types_off_gives_fp16_inputs_and_outputs(zoo_model):
    hp = convert_precision(zoo_model("resnet"), "fp16", keep_io_types=False)
    onnx.checker.check_model(hp.model)
    assert hp.model.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT16
    assert hp.model.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT16
    assert not [n for n in hp.model.graph.node if n.op_type == "Cast"]
    assert hp.source_names == {}


def test_graph_io_casts_map_to_fp32_names(zoo_model):
    hp = convert_precision(zoo_model("resnet"), "fp16")
    casts = [n for n in hp.model.graph.node if n.op_type == "Cast"]
    assert len(casts) == 2
    assert hp.model.graph.node[0].op_type == "Cast"  # placed where the graph stays sorted
    assert hp.model.graph.node[-1].op_type == "Cast"
    assert hp.source_name(casts[0].output[0]) == "input"
    assert hp.source_name(casts[1].input[0]) == "logits"
    assert hp.source_tensors([casts[0].output[0], "input", "relu_out"]) == ["input", "relu_out"]
    scales = hp.rekey_scales({"input": (0.5, 0), ("logits", "fp8"): (0.25, 0)})
    assert scales[casts[0].output[0]] == (0.5, 0)
    assert scales[(casts[1].input[0], "fp8")] == (0.25, 0)


def decomposed_layer_norm(hidden: int = 16) -> onnx.ModelProto:
    """x -> x - mean -> Pow 2 -> ReduceMean -> + eps -> Sqrt -> Div, then Exp: the ops that
    overflow FP16 once activations pass 256."""
    nodes = [
        helper.make_node("ReduceMean", ["x"], ["mean"], name="mean", axes=[-1]),
        helper.make_node("Sub", ["x", "mean"], ["centered"], name="sub"),
        helper.make_node("Pow", ["centered", "two"], ["sq"], name="pow"),
        helper.make_node("ReduceMean", ["sq"], ["var"], name="var", axes=[-1]),
        helper.make_node("Add", ["var", "eps"], ["var_eps"], name="add_eps"),
        helper.make_node("Sqrt", ["var_eps"], ["std"], name="sqrt"),
        helper.make_node("Div", ["centered", "std"], ["normed"], name="div"),
        helper.make_node("Mul", ["normed", "gamma"], ["y"], name="gamma"),
    ]
    inits = [numpy_helper.from_array(np.array(2.0, np.float32), "two"),
             numpy_helper.from_array(np.array(1e-5, np.float32), "eps"),
             numpy_helper.from_array(np.linspace(0.5, 1.5, hidden).astype(np.float32), "gamma")]
    graph = helper.make_graph(
        nodes, "ln", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, hidden])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, hidden])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_keep_fp32_ops_prevent_fp16_overflow():
    model = decomposed_layer_norm()
    # squares up to ~2e5 overflow FP16, the variance (~2e4) and everything else fit
    feeds = {"x": np.random.default_rng(0).normal(0, 150, (4, 16)).astype(np.float32)}
    assert (feeds["x"] ** 2).max() > 65504 > (feeds["x"] ** 2).mean(axis=-1).max()
    (want,) = run_ort(model, feeds)
    hp = convert_precision(model, "fp16")
    onnx.checker.check_model(hp.model)
    assert set(hp.kept_fp32) == {"mean", "pow", "var"}
    assert hp.kept_fp32["pow"] == KEEP_FP32["Pow"].reason
    types = float_types(hp.model)
    # Pow -> ReduceMean run in FP32 without an FP16 round trip between them
    pow_node = next(n for n in hp.model.graph.node if n.name == "pow")
    var_node = next(n for n in hp.model.graph.node if n.name == "var")
    assert var_node.input[0] == pow_node.output[0]
    assert types[pow_node.output[0]] == TensorProto.FLOAT
    # onnx's reference evaluator computes each op in its own type, as a GPU runtime does
    # (ONNX Runtime's CPU provider computes FP16 Pow/ReduceMean in FP32 and would hide this)
    from onnx.reference import ReferenceEvaluator

    (got,) = ReferenceEvaluator(hp.model).run(None, feeds)
    assert np.isfinite(got).all() and rel_l2(want, got) < FP16_TOLERANCE
    # without the list, the squares overflow FP16 and the output is garbage
    naive = convert_precision(model, "fp16", keep_fp32={})
    assert naive.kept_fp32 == {}
    with np.errstate(all="ignore"):
        (bad,) = ReferenceEvaluator(naive.model).run(None, feeds)
    assert not np.isfinite(bad).all() or rel_l2(want, bad) > 0.1


def test_bf16_upgrades_opset_and_agrees_in_reference_evaluator(zoo_model):
    from onnx.reference import ReferenceEvaluator

    model = zoo_model("resnet")
    hp = convert_precision(model, "bf16")
    assert hp.opsets == (17, 22)  # Conv and pooling take bfloat16 from opset 22
    onnx.checker.check_model(hp.model, full_check=True)
    types = float_types(hp.model)
    assert TensorProto.FLOAT16 not in types.values()
    assert sum(e == TensorProto.BFLOAT16 for e in types.values()) > len(types) // 2
    weight = next(t for t in hp.model.graph.initializer if t.name == "conv1.weight")
    assert weight.data_type == TensorProto.BFLOAT16
    import ml_dtypes

    fp32 = numpy_helper.to_array(next(t for t in model.graph.initializer
                                      if t.name == "conv1.weight"))
    np.testing.assert_array_equal(  # rounded from FP32, not from an FP16 copy
        numpy_helper.to_array(weight).view(np.uint16),
        fp32.astype(ml_dtypes.bfloat16).view(np.uint16))
    feeds = feeds_for(model)
    (want,) = run_ort(model, feeds)
    (got,) = ReferenceEvaluator(hp.model).run(None, feeds)
    assert 0 < rel_l2(want, got) < BF16_TOLERANCE


def test_bf16_transformer_needs_no_upgrade(zoo_model):
    from onnx.reference import ReferenceEvaluator

    model = zoo_model("transformer")
    hp = convert_precision(model, "bf16")
    assert hp.opsets == (17, 17)
    feeds = feeds_for(model)
    (want,) = run_ort(model, feeds)
    (got,) = ReferenceEvaluator(hp.model).run(None, feeds)
    assert 0 < rel_l2(want, got) < BF16_TOLERANCE


def test_bad_combinations_name_the_option(zoo_model):
    with pytest.raises(OptionError, match=r"^--high-precision: unknown 'fp64' \(choose from"):
        convert_precision(zoo_model("tiny_chain"), "fp64")
    with pytest.raises(OptionError, match=r"^--high-precision bf16 needs opset >= 22 \(.*Conv"):
        convert_precision(zoo_model("resnet"), "bf16", upgrade_opset=False)
    with pytest.raises(OptionError, match=r"^--high-precision bf16 cannot run on --backend "
                                          r"onnxruntime"):
        profile_for("onnxruntime").high_precision("bf16", "onnxruntime")
    with pytest.raises(OptionError, match=r"^--high-precision fp16 cannot run on --backend "
                                          r"onnxruntime"):
        profile_for("onnxruntime").high_precision("fp16", "onnxruntime")
    for err in (OptionError,):
        try:
            convert_precision(zoo_model("resnet"), "bf16", upgrade_opset=False)
        except err as exc:
            assert "\n" not in str(exc)


def test_defaults_follow_the_backend():
    assert profile_for("tensorrt").high_precision(None, "tensorrt") == "fp16"
    assert profile_for("tensorrt").high_precision(None, "trtexec") == "fp16"
    assert profile_for("tensorrt").high_precision(None, "costmodel") == "fp16"
    # placed by ONNX Runtime's rules, the model ships to ONNX Runtime CPU: FP32 (its Q/DQ
    # fusions refuse FP16 scales; with FP16 the real YOLOv8n shipped a model it cannot load)
    assert profile_for("onnxruntime").high_precision(None, "costmodel") == "fp32"
    assert profile_for("tensorrt").high_precision(None, "ort-cuda") == "fp16"
    assert profile_for("onnxruntime").high_precision(None, "onnxruntime") == "fp32"
    assert profile_for("tensorrt").high_precision(None, "pkg.mod:fn") == "fp16"
    assert profile_for("onnxruntime").high_precision(None, "pkg.mod:fn") == "fp32"
    assert profile_for("tensorrt").high_precision("bf16", "tensorrt") == "bf16"
    assert convert_precision(decomposed_layer_norm(), "fp32") is None


# -- Q/DQ in a converted model -------------------------------------------------------------------
def all_points(pm: PreparedModel) -> set:
    uses: set = set()
    for pp in pm.tunable:
        uses |= pp.uses(pp.ids)
    return uses


@pytest.mark.parametrize("name", ["resnet", "transformer", "yolo"])
def test_exports_keep_fp16_outside_the_qdq_pairs(zoo_model, name):
    pm = PreparedModel.prepare(zoo_model(name), runtime="tensorrt", high_precision="fp16")
    assert pm.to_json()["high_precision"] == "fp16"
    assert pm.graph.opset >= 19  # FP16 scales need QuantizeLinear-19
    exporter = pm.exporter()
    float_model = exporter.to_model(exporter.plan(set()))
    exported = exporter.to_model(exporter.plan(all_points(pm)))
    onnx.checker.check_model(exported, full_check=True)
    before, after = float_types(float_model), float_types(exported)
    fp32_before = {t for t, e in before.items() if e == TensorProto.FLOAT}
    fp32_after = {t for t, e in after.items() if e == TensorProto.FLOAT}
    assert fp32_after == fp32_before  # no tensor left FP16 for FP32 because of Q/DQ
    inits = {t.name: t for t in exported.graph.initializer}
    qdq = [n for n in exported.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")]
    assert len(qdq) > 10
    for node in qdq:
        assert inits[node.input[1]].data_type == after[node.input[0] if node.op_type ==
                                                        "QuantizeLinear" else node.output[0]]
        if node.op_type == "DequantizeLinear":
            assert after[node.output[0]] == TensorProto.FLOAT16


def test_weights_are_quantized_from_fp32_values(zoo_model):
    model = zoo_model("resnet")
    pm = PreparedModel.prepare(model, runtime="tensorrt", high_precision="fp16")
    exporter = pm.exporter()
    exported = exporter.to_model(exporter.plan(all_points(pm)))
    inits = {t.name: numpy_helper.to_array(t) for t in exported.graph.initializer}
    fp32 = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    checked = differs = 0
    for node in exported.graph.node:
        if node.op_type != "DequantizeLinear" or node.input[0] not in inits \
                or inits[node.input[0]].dtype != np.int8:
            continue
        name = node.input[0].removesuffix("_quantized")
        w32, q, scale = fp32[name], inits[node.input[0]], inits[node.input[1]]
        assert scale.dtype == np.float16
        s = scale.astype(np.float32).reshape(-1, *[1] * (w32.ndim - 1))
        np.testing.assert_array_equal(q, np.clip(np.rint(w32 / s), -127, 127))
        from_fp16 = np.clip(np.rint(w32.astype(np.float16).astype(np.float32) / s), -127, 127)
        differs += int((from_fp16 != q).sum())
        # the FP16 scales are rounded up: nothing the FP32 scale kept in range is clipped
        assert np.abs(w32 / s).max() <= 127.0 + 1e-3
        checked += 1
    assert checked == 13 and differs > 0  # quantizing the FP16 copy would give other integers


def test_scales_calibrated_on_fp32_names_reach_the_converted_graph(zoo_model):
    pm = PreparedModel.prepare(zoo_model("resnet"), runtime="tensorrt", high_precision="fp16")
    cast_out = pm.graph.nodes[0].output[0]
    assert pm.high_precision.source_name(cast_out) == "input"
    assert "input" in pm.high_precision.source_tensors(pm.candidate_tensors())
    exporter = pm.exporter(scales={"input": (0.0375, 0)})
    assert exporter.activation_params(cast_out, "int8") == (0.0375, 0)
    uses = {u for u in all_points(pm) if u[0] == cast_out}
    exported = exporter.to_model(exporter.plan(uses))
    q = next(n for n in exported.graph.node if n.op_type == "QuantizeLinear")
    scale = numpy_helper.to_array(next(t for t in exported.graph.initializer
                                       if t.name == q.input[1]))
    assert scale.dtype == np.float16 and scale >= np.float16(0.0375)
    assert float(scale) == pytest.approx(0.0375, rel=1e-3)


def test_fp16_qdq_model_computes_what_the_fp32_one_does(zoo_model):
    """Same plan, same scales: the FP16 Q/DQ model's outputs stay within FP16 rounding of the
    FP32 Q/DQ model's (ONNX Runtime CPU runs both)."""
    from qdq_optuna.model import calibration

    model = zoo_model("resnet")
    feeds = feeds_for(model)
    calib = {"input": np.concatenate([feeds_for(model, seed)["input"] for seed in (1, 2, 3)])}
    errors = {}
    for precision in ("fp32", "fp16"):
        pm = PreparedModel.prepare(model, runtime="tensorrt", high_precision=precision)
        hp = pm.high_precision
        tensors = hp.source_tensors(pm.candidate_tensors()) if hp else pm.candidate_tensors()
        fp32_model = hp.source.full_model() if hp else pm.graph.full_model()
        stats = calibration.collect_statistics(fp32_model, tensors, calib)  # always FP32
        scales = calibration.activation_scales(stats, method="minmax", quant_type="int8")
        exporter = pm.exporter(scales=scales)
        plan = exporter.plan(all_points(pm))
        (out,) = run_ort(exporter.to_model(plan), feeds)
        errors[precision] = rel_l2(run_ort(model, feeds)[0], out)
    # FP16 around the Q/DQ costs next to nothing next to INT8's own error
    assert errors["fp16"] < 1.25 * errors["fp32"] + FP16_TOLERANCE
    assert errors["fp32"] > FP16_TOLERANCE  # and that error is measurable


def test_values_fp16_cannot_hold_keep_their_nodes_fp32():
    """Nodes whose inputs or outputs exceed MAX_ABS on the range data stay FP32, Constant
    weights included (exporters write weights as Constant nodes; the converter would clamp a
    1e5 to FP16's 65504)."""
    from onnx.reference import ReferenceEvaluator

    nodes = [
        helper.make_node("Constant", [], ["big"], name="c_big",
                         value=numpy_helper.from_array(np.array(1e5, np.float32))),
        helper.make_node("Constant", [], ["small"], name="c_small",
                         value=numpy_helper.from_array(np.array(1e-5, np.float32))),
        helper.make_node("Mul", ["x", "big"], ["up"], name="up"),
        helper.make_node("Mul", ["up", "small"], ["down"], name="down"),
        helper.make_node("Relu", ["down"], ["y"], name="relu"),
    ]
    graph = helper.make_graph(
        nodes, "scale", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    feeds = {"x": np.linspace(-2, 2, 16, dtype=np.float32).reshape(2, 8)}
    (want,) = run_ort(model, feeds)
    hp = convert_precision(model, "fp16")
    assert set(hp.kept_fp32) == {"up", "down"}
    assert hp.kept_fp32["up"].startswith("reads or writes values up to ")
    (got,) = ReferenceEvaluator(hp.model).run(None, feeds)
    assert rel_l2(want, got) < FP16_TOLERANCE
    off = convert_precision(model, "fp16", max_abs=None)
    assert off.kept_fp32 == {}
    with np.errstate(all="ignore"):
        (bad,) = ReferenceEvaluator(off.model).run(None, feeds)
    assert not np.isfinite(bad).all() or rel_l2(want, bad) > 0.1


# -- what a user sees checking the shipped FP16 model on ONNX Runtime CPU -------------------------
def _session(path, **config) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    for key, value in config.items():
        so.add_session_config_entry(key, value)
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("runtime", ["tensorrt", "onnxruntime"])
def test_report_says_what_onnx_runtime_cpu_does_with_the_fp16_model(tmp_path, runtime):
    """An FP16 float part, under TensorRT's rules and under ONNX Runtime's (whose guard would
    otherwise score ONNX Runtime's fused kernels, which refuse the FP16 QLinearConcat: an
    internal error before): the guard scores the Q/DQ as written; the report also says what a
    default ONNX Runtime CPU session does with the file (here: refuses it, its QLinearConcat
    fusion takes no FP16 scales), and how to check it the guard's way."""
    from qdq_optuna import Config, tune
    from qdq_optuna.examples import zoo

    model = zoo.build("tiny_concat")
    result = tune(model, tmp_path / "out", backend="costmodel", runtime=runtime,
                  high_precision="fp16", config=Config.preset("quick"), progress=False)
    assert result.report["high_precision"]["precision"] == "fp16"
    acc = result.report["accuracy"]
    assert "graph optimizations off" in acc["scored_as"]
    check = acc["onnxruntime_cpu_default"]
    path = tmp_path / "out" / "optimized.onnx"
    try:
        _session(path)
        loads = True
    except Exception as exc:  # ONNX Runtime's own exception types
        loads, refused = False, str(exc).splitlines()[0]
    assert check["loads"] == loads
    if not loads:
        assert refused in check["refused"]
        text = (tmp_path / "out" / "report.md").read_text()
        assert "session.disable_quant_qdq" in text and "refuses" in text
    # the way the report says to check it runs the model and gives the guard's error
    feeds = feeds_for(onnx.load(str(path)))
    as_written = _session(path, **{"session.disable_quant_qdq": "1"}).run(None, feeds)
    reference = run_ort(model, feeds)
    worst = max(rel_l2(r, np.asarray(c, np.float32)) for r, c in zip(reference, as_written))
    assert np.isfinite(worst) and worst < 0.5


def test_the_fp16_repro_reproduces():
    """benchmarks/ort_fp16_qdq_repro.py: every case is valid ONNX and runs as written; the
    optimized session agrees or refuses (today: Concat refuses)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "ort_fp16_qdq_repro.py"
    if not path.exists():
        pytest.skip("the benchmarks folder is not beside the installed suite")
    spec = importlib.util.spec_from_file_location("ort_fp16_qdq_repro", path)
    repro = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(repro)
    lines = {op: repro.check(op) for op in repro.OPS}
    for op, line in lines.items():
        assert line.startswith("refused: ") or float(line.split()[-1]) < 1e-3, (op, line)
