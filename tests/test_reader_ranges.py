"""Activation ranges cut where every reader stops telling values apart (calibration's
``reader_bounds``): measured on exported models run by ONNX Runtime, and the rule's limits."""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from qdq_optuna.measure.accuracy import output_errors, run_model
from qdq_optuna.model import calibration
from qdq_optuna.model.graph import Graph
from qdq_optuna.runtimes.prepared import PreparedModel


def _model(nodes, outputs, inits, opset=17) -> onnx.ModelProto:
    """x [1, 4, 16, 16] -> Conv (wide logits: weights of std 20) -> ``nodes``."""
    rng = np.random.default_rng(0)
    weights = {"w": (rng.standard_normal((8, 4, 3, 3)) * 20).astype(np.float32),
               "b": np.zeros(8, np.float32), **inits}
    conv = helper.make_node("Conv", ["x", "w", "b"], ["logits"], name="conv", pads=[1, 1, 1, 1])
    graph = helper.make_graph(
        [conv, *nodes], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                            [1, 4, 16, 16])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, [1, 8, 16, 16]) for o in outputs],
        [numpy_helper.from_array(v, k) for k, v in weights.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _sigmoid_model(**extra) -> onnx.ModelProto:
    return _model([helper.make_node("Sigmoid", ["logits"], ["p"], name="sig")], ["p"], {},
                  **extra)


def _data(samples: int = 8) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {"x": rng.standard_normal((samples, 4, 16, 16)).astype(np.float32)}


def _sigmoid_error(model: onnx.ModelProto, cut: bool) -> float:
    """Relative L2 vs FP32 of the Sigmoid's input and output quantized (QLinearSigmoid in ONNX
    Runtime), scales cut at the readers or not. The Conv's input stays float: its rounding
    would reach the logits magnified by the wide weights whichever scale they get."""
    pm = PreparedModel.prepare(model, runtime="onnxruntime")
    data = _data()
    stats = calibration.collect_statistics(pm.graph.full_model(), pm.candidate_tensors(), data)
    bounds = calibration.reader_bounds(pm.graph) if cut else None
    exporter = pm.exporter(calibration.activation_scales(
        stats, method="minmax", quant_type=pm.quant_type, bounds=bounds))
    uses = set()
    for pp in pm.tunable:
        uses |= {u for u in pp.uses(pp.ids) if u[0] in ("logits", "p")}
    plan = exporter.plan(uses)
    assert "logits" in plan.tensors  # the Sigmoid's input carries a Q/DQ
    ref = run_model(pm.graph.full_model(), data)
    got = run_model(exporter.to_bytes(plan), data)
    return output_errors(ref, got)["p"]["relative_l2"]


def test_cut_sigmoid_input_gives_a_much_lower_output_error():
    """Logits of about +-150 through a Sigmoid: the 8-bit step of their full range is ~1.2, so
    every output near 0.5 moves by up to ~0.15; cut at the Sigmoid's saturation the step is
    0.06. Both exports run in ONNX Runtime with its fused kernels."""
    model = _sigmoid_model()
    pm = PreparedModel.prepare(model, runtime="onnxruntime")
    stats = calibration.collect_statistics(pm.graph.full_model(), ["logits"], _data())
    assert stats["logits"].amax > 50  # the premise: logits far past saturation
    full, cut = _sigmoid_error(model, cut=False), _sigmoid_error(model, cut=True)
    assert cut < full / 3, (cut, full)


def test_sigmoid_and_tanh_bounds_follow_the_output_step():
    """The cut leaves at most an eighth of an 8-bit output step of each op's limit behind."""
    lo, hi = calibration.READER_RANGES["Sigmoid"]
    assert lo == -hi and 7 < hi < 8.5
    tail = calibration.SATURATION_TAIL_STEPS / 255
    assert math.isclose(1 - 1 / (1 + math.exp(-hi)), tail, rel_tol=1e-6)
    t_lo, t_hi = calibration.READER_RANGES["Tanh"]
    assert t_lo == -t_hi
    assert math.isclose(1 - math.tanh(t_hi), 2 * tail, rel_tol=1e-3)


def _bounds(model: onnx.ModelProto) -> dict:
    return calibration.reader_bounds(Graph.from_model(model))


def test_a_second_reader_or_a_graph_output_keeps_the_full_range():
    """The same logits also read by an Add, or also a graph output: no cut, and the run's
    scales are those of the statistics alone."""
    add = helper.make_node("Add", ["logits", "logits"], ["twice"], name="add")
    sig = helper.make_node("Sigmoid", ["logits"], ["p"], name="sig")
    assert "logits" in _bounds(_sigmoid_model())
    shared = _model([sig, add], ["p", "twice"], {})
    exposed = _model([sig], ["p", "logits"], {})
    for model in (shared, exposed):
        bounds = _bounds(model)
        assert "logits" not in bounds
        pm = PreparedModel.prepare(model, runtime="onnxruntime")
        stats = calibration.collect_statistics(pm.graph.full_model(), ["logits"], _data())
        assert calibration.activation_scales(stats, method="minmax", quant_type="uint8",
                                             bounds=calibration.reader_bounds(pm.graph)) \
            == calibration.activation_scales(stats, method="minmax", quant_type="uint8")


def test_hard_sigmoid_bounds_come_from_its_attributes():
    node = helper.make_node("HardSigmoid", ["logits"], ["p"], alpha=0.25, beta=0.25)
    assert _bounds(_model([node], ["p"], {}))["logits"] == pytest.approx((-1.0, 3.0))
    default = helper.make_node("HardSigmoid", ["logits"], ["p"])  # alpha 0.2, beta 0.5
    assert _bounds(_model([default], ["p"], {}))["logits"] == pytest.approx((-2.5, 2.5))


def test_clip_bounds_come_from_its_inputs_or_attributes():
    lo, hi = np.array(-1.5, np.float32), np.array(4.0, np.float32)
    inputs = helper.make_node("Clip", ["logits", "lo", "hi"], ["c"])
    assert _bounds(_model([inputs], ["c"], {"lo": lo, "hi": hi}))["logits"] == (-1.5, 4.0)
    upper_only = helper.make_node("Clip", ["logits", "", "hi"], ["c"])
    assert _bounds(_model([upper_only], ["c"], {"hi": hi}))["logits"] == (-math.inf, 4.0)
    attrs = helper.make_node("Clip", ["logits"], ["c"], min=0.0, max=6.0)  # opset 6: Relu6
    assert _bounds(_model([attrs], ["c"], {}, opset=6))["logits"] == (0.0, 6.0)
    # a limit computed at run time is unknown: no cut
    neg = helper.make_node("Neg", ["hi_in"], ["lo_run"])
    runtime = helper.make_node("Clip", ["logits", "lo_run", "hi"], ["c"])
    model = _model([neg, runtime], ["c"], {"hi": hi, "hi_in": hi})
    assert "logits" not in _bounds(model)


def test_relu_and_hard_swish_cut_the_low_end_and_several_readers_take_the_hull():
    relu = helper.make_node("Relu", ["logits"], ["r"])
    assert _bounds(_model([relu], ["r"], {}))["logits"] == (0.0, math.inf)
    swish = helper.make_node("HardSwish", ["logits"], ["s"])
    assert _bounds(_model([swish], ["s"], {}, opset=14))["logits"] == (-3.0, math.inf)
    sig = helper.make_node("Sigmoid", ["logits"], ["p"])
    both = _bounds(_model([relu, sig], ["r", "p"], {}))["logits"]
    assert both == (calibration.READER_RANGES["Sigmoid"][0], math.inf)


def test_a_reshape_between_passes_the_readers_bound_back():
    """x -> Reshape -> Sigmoid: the Reshape moves values only, so its input is cut too."""
    shape = np.array([1, -1], np.int64)
    nodes = [helper.make_node("Reshape", ["logits", "shape"], ["flat"]),
             helper.make_node("Sigmoid", ["flat"], ["p"])]
    model = _model(nodes, ["p"], {"shape": shape})
    model.graph.output[0].type.tensor_type.shape.ClearField("dim")
    model.graph.output[0].type.tensor_type.shape.dim.add().dim_value = 1
    model.graph.output[0].type.tensor_type.shape.dim.add().dim_value = 8 * 16 * 16
    bounds = _bounds(model)
    assert bounds["logits"] == bounds["flat"] == calibration.READER_RANGES["Sigmoid"]


def test_uint8_and_int8_scales_of_a_cut_range():
    """uint8 (ONNX Runtime): asymmetric over the cut range, a Relu input starting at zero
    point 0; int8 (TensorRT): symmetric over the cut range's larger end."""
    stats = calibration.TensorStatistics.empty()
    stats.update(np.linspace(-150.0, 100.0, 10001))
    edge = calibration.READER_RANGES["Sigmoid"][1]
    scale, zp = calibration.activation_params(stats, method="minmax", quant_type="uint8",
                                              bound=(-edge, edge))
    assert scale == pytest.approx(2 * edge / 255, rel=1e-6) and zp in (127, 128)
    scale, zp = calibration.activation_params(stats, method="minmax", quant_type="int8",
                                              bound=(-edge, edge))
    assert (scale, zp) == (pytest.approx(edge / 127, rel=1e-6), 0)
    scale, zp = calibration.activation_params(stats, method="minmax", quant_type="uint8",
                                              bound=(0.0, math.inf))
    assert (scale, zp) == (pytest.approx(100 / 255, rel=1e-6), 0)
    scale, _ = calibration.activation_params(stats, method="minmax", quant_type="int8",
                                             bound=(0.0, math.inf))
    assert scale == pytest.approx(100 / 127, rel=1e-6)  # not 150 / 127: the negatives are cut
    assert calibration.clipped_by_readers({"t": stats}, {"t": (0.0, math.inf)}) == ["t"]
    assert calibration.clipped_by_readers({"t": stats}, {"t": (-200.0, 200.0)}) == []


def test_the_report_counts_the_ranges_cut(tmp_path):
    """report.json's ``reader_clipped_ranges`` and a report.md line: the Sigmoid's logits."""
    from qdq_optuna import Config, tune

    path = tmp_path / "m.onnx"
    onnx.save(_sigmoid_model(), str(path))
    np.savez(tmp_path / "cal.npz", **_data())
    result = tune(str(path), tmp_path / "out", backend="costmodel", runtime="onnxruntime",
                  progress=False,
                  calibration_data=str(tmp_path / "cal.npz"), config=Config.preset("quick"))
    assert result.report["reader_clipped_ranges"] == 1
    text = (tmp_path / "out" / "report.md").read_text()
    assert "activation ranges cut to what their readers distinguish: 1 tensors" in text


def _hard_swish_written_out() -> list:
    """logits -> * scale -> + shift -> y * Clip(y + 3, 0, 6) / 6 (how Paddle exports it)."""
    return [helper.make_node("Mul", ["logits", "k_mul"], ["scaled"]),
            helper.make_node("Add", ["scaled", "k_add"], ["y"]),
            helper.make_node("Add", ["y", "three"], ["y3"]),
            helper.make_node("Clip", ["y3", "zero", "six"], ["gate"]),
            helper.make_node("Mul", ["y", "gate"], ["prod"]),
            helper.make_node("Div", ["prod", "six"], ["hs"])]


def _hard_swish_inits(scale: float, shift: float) -> dict:
    return {"k_mul": np.array([scale], np.float32), "k_add": np.array([shift], np.float32),
            "three": np.array(3.0, np.float32), "zero": np.array(0.0, np.float32),
            "six": np.array(6.0, np.float32)}


def test_a_hard_swish_written_out_cuts_below_minus_three_through_scalar_maps():
    """y * Clip(y + 3, 0, 6) is 0 for y <= -3: y is cut there, and the cut passes back through
    the scalar Add and Mul before it (logits = (y - shift) / scale), so the Conv's output is
    cut too; y + 3 takes the Clip's exact ends."""
    model = _model(_hard_swish_written_out(), ["hs"], _hard_swish_inits(2.0, 0.5))
    bounds = _bounds(model)
    assert bounds["y"] == (-3.0, math.inf)
    assert bounds["y3"] == (0.0, 6.0)
    assert bounds["scaled"] == pytest.approx((-3.5, math.inf))
    assert bounds["logits"] == pytest.approx((-1.75, math.inf))
    # a negative factor turns the interval around
    flipped = _bounds(_model(_hard_swish_written_out(), ["hs"], _hard_swish_inits(-2.0, 0.5)))
    assert flipped["logits"] == pytest.approx((-math.inf, 1.75))
    # a gate that is not 0 below a point (Clip from -1) cuts nothing at the product
    inits = _hard_swish_inits(2.0, 0.5) | {"zero": np.array(-1.0, np.float32)}
    assert "y" not in _bounds(_model(_hard_swish_written_out(), ["hs"], inits))


def test_x_times_hard_sigmoid_of_x_is_cut_where_the_gate_closes():
    nodes = [helper.make_node("HardSigmoid", ["logits"], ["g"], alpha=1 / 6, beta=0.5),
             helper.make_node("Mul", ["logits", "g"], ["hs"])]
    assert _bounds(_model(nodes, ["hs"], {}))["logits"] == pytest.approx((-3.0, math.inf))
    silu = [helper.make_node("Sigmoid", ["logits"], ["g"]),
            helper.make_node("Mul", ["logits", "g"], ["s"])]  # never exactly 0: no cut
    assert "logits" not in _bounds(_model(silu, ["s"], {}))


def test_cut_hard_swish_input_gives_a_lower_output_error():
    """The written-out HardSwish on wide Conv outputs, only its input y quantized (uint8):
    cut at -3 the 256 levels cover half the range, and the output error drops."""
    model = _model(_hard_swish_written_out(), ["hs"], _hard_swish_inits(1.0, 0.0))
    pm = PreparedModel.prepare(model, runtime="onnxruntime")
    data = _data()
    stats = calibration.collect_statistics(pm.graph.full_model(), pm.candidate_tensors(), data)
    ref = run_model(pm.graph.full_model(), data)
    errs = []
    for bounds in (None, calibration.reader_bounds(pm.graph)):
        exporter = pm.exporter(calibration.activation_scales(
            stats, method="minmax", quant_type="uint8", bounds=bounds))
        uses = {u for pp in pm.tunable for u in pp.uses(pp.ids) if u[0] == "logits"}
        assert uses
        got = run_model(exporter.to_bytes(exporter.plan(uses)), data)
        errs.append(output_errors(ref, got)["hs"]["relative_l2"])
    assert errs[1] < 0.75 * errs[0], errs


def test_a_run_stored_before_the_cut_does_not_resume_with_other_scales(tmp_path, monkeypatch):
    """Scales are made from the cached statistics each time: a run stored without the cut
    (its settings lack ``activation_ranges``) is refused, naming what changed."""
    from qdq_optuna import Config, tune
    from qdq_optuna.errors import UserError
    from qdq_optuna.search import _prepare

    path = tmp_path / "m.onnx"
    onnx.save(_sigmoid_model(), str(path))
    np.savez(tmp_path / "cal.npz", **_data())
    real = _prepare.fingerprint

    def before(*args, **kwargs):
        fp = real(*args, **kwargs)
        fp.pop("activation_ranges")
        return fp

    def run():
        return tune(str(path), tmp_path / "out", backend="costmodel", runtime="onnxruntime",
                    progress=False, calibration_data=str(tmp_path / "cal.npz"),
                    config=Config.preset("quick"))

    monkeypatch.setattr(_prepare, "fingerprint", before)
    run()
    monkeypatch.setattr(_prepare, "fingerprint", real)
    with pytest.raises(UserError, match="activation_ranges"):
        run()
