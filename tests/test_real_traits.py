"""The traits real third-party models showed, on small generated models (``tests/corpus.py``):
``dim_value: -1`` inputs, Constant-node weights, a pattern with zero insertion points, nodes
the version converter or ONNX Runtime adds or fuses, opset domains ORT declares, and a
heavy-tailed activation that min/max calibration breaks."""

from __future__ import annotations

import json
import math
import re

import corpus
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from test_cli import cli

import qdq_optuna
from qdq_optuna.config import Config
from qdq_optuna.errors import ModelError
from qdq_optuna.examples import zoo
from qdq_optuna.measure.accuracy import AccuracyEvaluator
from qdq_optuna.measure.bisect import (
    bisect_plan,
    plan_error_function,
    sub_plan,
)
from qdq_optuna.measure.bound import DEFAULT_MAX_OUTPUT_ERROR
from qdq_optuna.model import calibration
from qdq_optuna.model.graph import InputShapes, load_model, node_label, opset_of, used_domains
from qdq_optuna.runtimes.prepared import PreparedModel

RUNTIMES = {"tensorrt": "int8", "onnxruntime": "uint8"}


def _all_uses(pm: PreparedModel) -> set:
    return set().union(*(pp.uses(pp.ids) for pp in pm.tunable))


def _run(model_bytes: bytes, feeds: dict) -> list[np.ndarray]:
    return ort.InferenceSession(model_bytes, providers=["CPUExecutionProvider"]).run(None, feeds)


# -- dim_value: -1 ----------------------------------------------------------------------------
def test_minus_one_dims_are_dynamic_and_input_shapes_fix_them():
    model = corpus.dynamic_minus_one()
    graph = load_model(model, InputShapes.parse("x:1x3x16x16"))
    assert graph.shapes["x"] == (1, 3, 16, 16)
    assert graph.shapes["y"] == (1, 4)  # the output's stored -1 gave way to inference


def test_minus_one_dims_hint_can_be_followed(tmp_path):
    path = tmp_path / "paddle_like.onnx"
    onnx.save(corpus.dynamic_minus_one(), str(path))
    with pytest.raises(ModelError) as info:
        load_model(str(path))
    hint = re.search(r"--input-shapes (\S+)", str(info.value)).group(1)
    assert hint == "x:Nx3xNxN"
    proc = cli("inspect", path, "--runtime", "tensorrt", "--input-shapes",
               hint.replace("N", "1", 1).replace("N", "16"))
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr


def test_minus_one_dims_calibrate_on_random_inputs():
    data = calibration.random_calibration_data(corpus.dynamic_minus_one(), {"x": (1, 3, 8, 8)},
                                               samples=2)
    assert data["x"].shape == (2, 3, 8, 8)


# -- Constant-node weights ------------------------------------------------------------------------
@pytest.mark.parametrize("runtime", list(RUNTIMES))
def test_constant_node_weights_are_quantized(runtime):
    model = corpus.constant_weights()
    before = model.SerializeToString()
    pm = PreparedModel.prepare(model, runtime=runtime)
    exporter = pm.exporter()
    plan = exporter.plan(_all_uses(pm))
    weighted = {pm.graph.nodes[n].op_type for n, s, _ in plan.weights if s == 1}
    assert weighted == {"Conv", "MatMul"} and len({n for n, _, _ in plan.weights}) == 3
    quantized = exporter.to_model(plan)
    onnx.checker.check_model(quantized)
    dq_out = {o for n in quantized.graph.node if n.op_type == "DequantizeLinear" for o in n.output}
    for node in quantized.graph.node:
        if node.op_type in ("Conv", "MatMul"):
            assert node.input[1] in dq_out, node
    x = np.random.default_rng(0).standard_normal((1, 3, 8, 8)).astype(np.float32)
    ref = _run(model.SerializeToString(), {"x": x})[0]
    got = _run(quantized.SerializeToString(), {"x": x})[0]
    assert np.isfinite(got).all() and got.shape == ref.shape
    assert model.SerializeToString() == before


def test_inspect_lists_the_weights_it_will_quantize():
    doc = PreparedModel.prepare(corpus.constant_weights(), runtime="tensorrt").to_json()
    assert doc["weights"]["quantized"] == ["w1", "w2", "w3"]
    assert doc["weights"]["float"] == {}
    conv_points = [pt for p in doc["patterns"] for pt in p["insertion_points"]
                   if any("w1" in w for w in pt["weights"].values())]
    assert conv_points, "the point in front of the first Conv brings its weight along"
    # the Constant nodes and the Transpose are gone into initializers: named, not renumbered
    assert doc["graph"]["file_nodes"] == len(corpus.constant_weights().graph.node)
    assert set(doc["graph"]["vanished"]) == {"#0", "#1", "#4", "#9", "#10"}


# -- #index labels index the user's file ----------------------------------------------------------
@pytest.mark.parametrize("build", [corpus.old_opset_unnamed, corpus.constant_weights])
@pytest.mark.parametrize("runtime", list(RUNTIMES))
def test_index_labels_are_the_files_indices(build, runtime):
    model = build()
    pm = PreparedModel.prepare(model, runtime=runtime)
    doc = pm.to_json()
    user_ops = [n.op_type for n in model.graph.node]
    labels = {node_label(n, i) for i, n in enumerate(model.graph.node)}
    for idx, node in enumerate(pm.graph.nodes):
        origin = pm.graph.origin(idx)
        if origin.label is not None:
            assert origin.label in labels
            k = int(origin.label[1:])
            assert user_ops[k] == node.op_type or origin.absorbed, (origin, node.op_type)
    for region in doc["regions"]:
        for name in region["file_nodes"]:
            assert name in labels, name
        for name in region["nodes"]:
            assert name in labels or name in doc["node_origins"], name


def test_converter_nodes_are_named_as_new(tmp_path):
    pm = PreparedModel.prepare(corpus.old_opset_unnamed(), runtime="tensorrt")
    created = [pm.graph.name_of(i) for i, o in enumerate(pm.graph.origins) if o.label is None]
    assert created and all(name.startswith("opset13/") for name in created)
    assert all(not n.name for i, n in enumerate(pm.graph.nodes) if pm.graph.origins[i].label)


# -- a pattern with zero points ---------------------------------------------------------------------
def test_zero_point_pattern_is_not_tuned(tmp_path):
    pm = PreparedModel.prepare(corpus.integer_path(), runtime="tensorrt")
    doc = pm.to_json()
    empty = [p for p in doc["patterns"] if not p["insertion_points"]]
    assert empty, "the int32 Reshape's pattern offers no point"
    assert all(not p["tuned"] for p in empty)
    untuned = {r for p in empty for r in p["regions"]}
    tuned_patterns = {r for p in doc["patterns"] if p["insertion_points"] for r in p["regions"]}
    for region in doc["regions"]:
        assert region["tuned"] == (region["id"] in tuned_patterns)
        if region["id"] in untuned:
            assert not region["tuned"]
    path = tmp_path / "ints.onnx"
    onnx.save(corpus.integer_path(), str(path))
    proc = cli("inspect", path, "--runtime", "tensorrt")
    assert proc.returncode == 0 and "(no insertion point: not tuned)" in proc.stdout


# -- ONNX Runtime's preprocessed graph ----------------------------------------------------------
def test_ort_inspect_maps_fused_nodes_to_the_files_names():
    model = zoo.build("transformer", "small")
    names = {n.name for n in model.graph.node}
    doc = PreparedModel.prepare(model, runtime="onnxruntime").to_json()
    assert "ONNX Runtime" in doc["graph"]["description"]
    assert doc["graph"]["file_nodes"] == len(model.graph.node)
    fused = {k: v for k, v in doc["node_origins"].items() if k.endswith("MatMulAddFusion")}
    assert fused and all(len(v) == 2 and v[0].endswith("matmul") and v[1].endswith("add")
                         for v in fused.values())
    listed = set()
    for region in doc["regions"]:
        assert set(region["file_nodes"]) <= names
        assert all(n in names or n in doc["node_origins"] for n in region["nodes"])
        if region["type"] == "LEAF":
            listed.update(region["file_nodes"])
    assert listed | set(doc["graph"]["vanished"]) == names  # every file node accounted for


def test_inspect_text_says_which_graph(tmp_path):
    path = tmp_path / "t.onnx"
    onnx.save(zoo.build("transformer", "small"), str(path))
    proc = cli("inspect", path)
    assert proc.returncode == 0, proc.stderr
    assert "describes ONNX Runtime's basic-optimized graph" in proc.stdout
    assert "MatMulAddFusion <- " in proc.stdout
    doc = json.loads(cli("inspect", path, "--json").stdout)
    old_keys = {"model", "sha256", "runtime", "quant_type", "preprocess", "opset", "nodes",
                "regions", "patterns"}
    assert old_keys <= set(doc)


@pytest.mark.parametrize("runtime", list(RUNTIMES))
def test_exported_models_declare_only_used_domains(runtime):
    model = zoo.build("resnet", "small")
    model.opset_import.append(onnx.helper.make_opsetid("ai.onnx.ml", 2))  # as magika's file
    pm = PreparedModel.prepare(model, runtime=runtime)
    exporter = pm.exporter()
    for plan in (exporter.plan(set()), exporter.plan(_all_uses(pm))):
        model = exporter.to_model(plan)
        declared = {imp.domain for imp in model.opset_import}
        assert declared <= used_domains(model) | {""}, declared


# -- a heavy-tailed activation --------------------------------------------------------------------
#: rare outliers (about 1 in 16,000 values: rarer than the 99.99th percentile) and dense ones
#: (1 in 1,000), with the calibration inputs each is measured on
TAILS = {"rare": ((4.6, 300.0), 32), "dense": ((3.3, 100.0), 8)}


@pytest.fixture(scope="module")
def heavy():
    held = {"x": np.random.default_rng(1).standard_normal((8, 4, 16, 16)).astype(np.float32)}
    out = {}
    for tail, (params, samples) in TAILS.items():
        model = corpus.heavy_tail(*params)
        cal = {"x": np.random.default_rng(0).standard_normal((samples, 4, 16, 16))
               .astype(np.float32)}
        for runtime, qtype in RUNTIMES.items():
            pm = PreparedModel.prepare(model, runtime=runtime)
            stats = calibration.collect_statistics(pm.graph.full_model(),
                                                   pm.candidate_tensors(), cal)
            evaluator = AccuracyEvaluator(pm.exporter().to_bytes(pm.exporter().plan(set())),
                                          held, optimize=runtime == "onnxruntime")
            out[tail, runtime] = (pm, stats, evaluator, qtype)
    return out


def _full_error(entry, method: str) -> tuple[float, object, object]:
    pm, stats, evaluator, qtype = entry
    exporter = pm.exporter(calibration.activation_scales(stats, method=method, quant_type=qtype))
    plan = exporter.plan(_all_uses(pm))
    return evaluator.evaluate(exporter.to_bytes(plan))[0], exporter, plan


def test_default_calibration_method_is_measured_percentile():
    assert calibration.DEFAULT_METHOD == "percentile"
    proc = cli("tune", "-h")
    assert "default percentile" in " ".join(proc.stdout.split())


@pytest.mark.parametrize("runtime", list(RUNTIMES))
@pytest.mark.parametrize("tail", list(TAILS))
def test_heavy_tail_breaks_minmax(heavy, runtime, tail):
    stats = heavy[tail, runtime][1]["heavy"]
    assert stats.max > 50 and stats.min < 0  # the tail, and a bulk around 0.8
    minmax, _, _ = _full_error(heavy[tail, runtime], "minmax")
    assert minmax > DEFAULT_MAX_OUTPUT_ERROR


@pytest.mark.parametrize("runtime", list(RUNTIMES))
def test_rare_outliers_do_not_break_the_default(heavy, runtime):
    minmax, _, _ = _full_error(heavy["rare", runtime], "minmax")
    default, _, _ = _full_error(heavy["rare", runtime], calibration.DEFAULT_METHOD)
    assert default < DEFAULT_MAX_OUTPUT_ERROR / 2 and default < minmax / 10


@pytest.mark.parametrize("runtime", list(RUNTIMES))
def test_bisection_names_the_heavy_tailed_pairs(heavy, runtime):
    """Dense outliers break the default method too: the guard names the pairs that do it."""
    pm, stats, evaluator, _ = heavy["dense", runtime]
    error, exporter, plan = _full_error(heavy["dense", runtime], calibration.DEFAULT_METHOD)
    assert error > DEFAULT_MAX_OUTPUT_ERROR
    found = bisect_plan(exporter, plan, plan_error_function(exporter, evaluator),
                        DEFAULT_MAX_OUTPUT_ERROR)
    assert found.full_error == pytest.approx(error)
    # the tail: ``heavy`` and the Conv output it runs into (-10 x heavy), where that output is
    # a point (TensorRT runs the Sigmoid in conv2's kernel: no Q/DQ between them)
    tailed = {t for t, s in stats.items() if s.max - s.min > 50}
    assert "heavy" in tailed and ("c2" in tailed) == ("c2" in set(pm.candidate_tensors()))
    assert found.responsible and set(found.responsible) <= {"heavy", "c2"}
    assert found.within and found.error <= DEFAULT_MAX_OUTPUT_ERROR
    assert set(found.kept.tensors) == set(plan.tensors) - set(found.responsible)
    # about 2 log2(n) evaluations per culprit
    assert found.evaluations <= 2 * len(found.responsible) * np.ceil(np.log2(len(plan.tensors))) + 4
    for t in found.responsible:  # 1-minimal: putting any one back breaks the bound again
        back = [*found.kept.tensors, t]
        assert found.tried.get(tuple(sorted(back)), math.inf) > DEFAULT_MAX_OUTPUT_ERROR or \
            evaluator.evaluate(exporter.to_bytes(sub_plan(exporter, plan, back)))[0] \
            > DEFAULT_MAX_OUTPUT_ERROR


def test_bisection_leaves_a_plan_within_the_bound_alone(heavy):
    error, exporter, plan = _full_error(heavy["rare", "tensorrt"], calibration.DEFAULT_METHOD)
    evaluator = heavy["rare", "tensorrt"][2]
    found = bisect_plan(exporter, plan, plan_error_function(exporter, evaluator),
                        DEFAULT_MAX_OUTPUT_ERROR)
    assert found.responsible == [] and found.evaluations == 1
    assert found.kept.key == plan.key and found.error == pytest.approx(error)


def test_bisection_of_several_and_of_accumulated_errors():
    pm = PreparedModel.prepare(zoo.build("resnet", "small"), runtime="tensorrt")
    exporter = pm.exporter()
    plan = exporter.plan(_all_uses(pm))
    tensors = plan.tensors
    bad = {tensors[1]: 5.0, tensors[-2]: 3.0}
    calls = []

    def error_fn(p):  # each pair adds a little, two of them a lot
        calls.append(p.key)
        return sum(bad.get(t, 0.01) for t in p.tensors)

    found = bisect_plan(exporter, plan, error_fn, bound=1.0)
    assert sorted(found.responsible) == sorted(bad)
    assert found.error <= 1.0 and found.evaluations == len(set(calls))
    # no single pair breaks the bound, their sum does: the fewest pairs whose removal fixes it
    found = bisect_plan(exporter, plan, lambda p: 0.1 * len(p.tensors), bound=0.1 * 3)
    assert found.within and len(found.kept.tensors) <= 3
    assert sub_plan(exporter, plan, found.kept.tensors).key == found.kept.key


# -- shapes only a run resolves -----------------------------------------------------------------
@pytest.mark.parametrize("runtime", list(RUNTIMES))
def test_computed_reshape_gets_static_shapes(runtime):
    from qdq_optuna.backends.costmodel import estimate

    model = corpus.computed_reshape()
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
    assert not any(vi.name == "flat" and vi.type.tensor_type.shape.dim
                   for vi in inferred.graph.value_info)  # what onnx alone gives
    pm = PreparedModel.prepare(model, runtime=runtime)
    assert pm.graph.shapes["flat"] == (1, 8)
    exporter = pm.exporter()
    for plan in (exporter.plan(set()), exporter.plan(_all_uses(pm))):
        assert estimate(exporter.to_model(plan)).total_ms > 0


def test_data_dependent_shapes_stay_open():
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 8])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.INT64, [2, "nonzeros"])
    model = onnx.helper.make_model(
        onnx.helper.make_graph([onnx.helper.make_node("Relu", ["x"], ["r"]),
                                onnx.helper.make_node("NonZero", ["r"], ["y"])], "nz", [x], [y]),
        opset_imports=[onnx.helper.make_opsetid("", 17)])
    graph = load_model(model)
    assert graph.shapes["r"] == (2, 8)
    assert graph.shapes.get("y") is None or not all(isinstance(d, int) for d in graph.shapes["y"])


# -- the float part converted: every trait the real models showed -----------------------------------
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("build", [corpus.constant_batchnorm, corpus.constant_weight_large_values,
                                   corpus.resize_with_roi,
                                   corpus.constant_weights,
                                   corpus.old_opset_unnamed, corpus.dynamic_minus_one,
                                   corpus.computed_reshape])
def test_high_precision_prepares_every_trait(build, precision):
    """paddle2onnx files (Constant-node weights, unnamed nodes) stopped with an IndexError: the
    conversion turned Constants into initializers inside the model the graph transform had
    handed it, so the node list it restored names in had shrunk."""
    model = build()
    before = model.SerializeToString()
    shapes = "x:1x3x8x8" if build is corpus.dynamic_minus_one else None
    pm = PreparedModel.prepare(model, runtime="tensorrt", high_precision=precision,
                               input_shapes=shapes)
    assert pm.high_precision is not None and pm.high_precision.precision == precision
    quantized = pm.exporter().to_model(pm.exporter().plan(_all_uses(pm)))
    onnx.checker.check_model(quantized, full_check=True)
    assert model.SerializeToString() == before  # the user's model is never changed


def test_precision_conversion_leaves_its_input_alone():
    from qdq_optuna.model.graph import load_model
    from qdq_optuna.model.precision import convert_precision

    graph = load_model(corpus.constant_batchnorm())
    before = graph.model.SerializeToString()
    hp = convert_precision(graph, "fp16")
    assert graph.model.SerializeToString() == before
    assert not any(n.op_type == "Constant" and n.output[0].startswith("bn_")
                   for n in hp.model.graph.node)


def test_an_opset_9_model_is_upgraded_on_loading():
    """onnx-caffe2 and early tf2onnx files are opset 9: loading upgrades them with onnx's
    version converter (Q/DQ and per-channel weights need 13) instead of refusing them."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 8, 8])
    w = numpy_helper.from_array(rng.standard_normal((8, 3, 3, 3)).astype(np.float32), "w")
    w_input = helper.make_tensor_value_info("w", TensorProto.FLOAT, [8, 3, 3, 3])
    graph = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
                               helper.make_node("Relu", ["c"], ["y"])], "old", [x, w_input], [y],
                              [w])
    # IR 3, as onnx-caffe2 wrote it: every initializer is a graph input too
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 9)], ir_version=3)
    pm = PreparedModel.prepare(model, runtime="tensorrt", high_precision="fp16")
    assert opset_of(pm.graph.model) >= 13
    quantized = pm.exporter().to_model(pm.exporter().plan(_all_uses(pm)))
    onnx.checker.check_model(quantized, full_check=True)
    assert any(n.op_type == "QuantizeLinear" for n in quantized.graph.node)


# -- an anchor grid computed from shapes (PyTorch's YOLOv8 export) -------------------------------
def _grid(model: onnx.ModelProto | PreparedModel) -> set[str]:
    """The tensors of the computed anchor grids (and of casts the FP16 conversion adds)."""
    nodes = model.graph.nodes if isinstance(model, PreparedModel) else model.graph.node
    return {t for n in nodes for t in n.output if t.startswith("grid")}


def _structure(pm: PreparedModel) -> list[tuple]:
    """Per tuned pattern: its regions' count, its op types (the grid and constants left out)
    and its offered points' count, in graph order: what the search will tune."""
    g, grid = pm.graph, _grid(pm)
    out = []
    for pp in pm.tunable:
        rep = pp.pattern.node_maps[pp.pattern.representative]
        ops = tuple(g.nodes[n].op_type for n in rep if g.nodes[n].op_type != "Constant"
                    and not set(g.nodes[n].output) <= grid)
        out.append((len(pp.pattern.regions), ops, len(pp.ids)))
    return out


def test_shape_arithmetic_is_no_insertion_point_on_tensorrt():
    model = corpus.anchor_grid_head()
    pm = PreparedModel.prepare(model, runtime="tensorrt")
    float_grid = {t for t in _grid(model) if pm.graph.is_float(t)}
    assert {"grid0/h.c", "grid0/grid2d", "grid0"} <= float_grid
    assert not {u[0] for u in _all_uses(pm)} & float_grid
    assert {"h0", "f0", "d0"} <= {u[0] for u in _all_uses(pm)}  # data flows on


@pytest.mark.parametrize("high_precision", ["fp32", "fp16"])
def test_computed_anchor_grid_tunes_like_a_constant_one(high_precision):
    """The grid computed from the heads' shapes (written between the stages) gives the regions,
    patterns and points of the same model with the grid stored as a constant."""
    computed, stored = (PreparedModel.prepare(corpus.anchor_grid_head(computed=c),
                                              runtime="tensorrt", high_precision=high_precision)
                        for c in (True, False))
    assert _structure(computed) == _structure(stored)


@pytest.mark.slow
def test_computed_anchor_grid_searches_like_a_constant_one(tmp_path):
    """On the cost model the search measures as often and ends as fast with either grid."""
    reports = [qdq_optuna.tune(corpus.anchor_grid_head(levels=2, computed=c),
                               tmp_path / str(c), backend="costmodel", progress=False, seed=0,
                               config=Config(schemes_per_region=10)).report
               for c in (True, False)]
    assert reports[0]["measurements"] == reports[1]["measurements"]
    assert reports[0]["final_latency_ms"] == pytest.approx(reports[1]["final_latency_ms"])
