"""Bias correction (``measure/bias.py``) on small generated models under real ONNX Runtime
sessions: a coarse weight quantization shifts the quantized Conv outputs; folding the measured
shift into the biases removes it, without changing the Q/DQ structure or ONNX Runtime's
integer kernels, and without touching the input model."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from qdq_optuna.backends.onnxruntime_kernels import kernels_of
from qdq_optuna.measure.accuracy import run_model
from qdq_optuna.measure.bias import MODES, FloatMeans, channel_means, correct_biases
from qdq_optuna.model import calibration
from qdq_optuna.runtimes.prepared import PreparedModel


def _coarse_weights(rng, cout: int, cin: int, k: int) -> np.ndarray:
    """Per output channel one large weight and many small positive ones that round to 0 at
    that channel's int8 step: the quantized layer loses their (positive) sum."""
    w = rng.uniform(0.0, 0.3, size=(cout, cin, k, k)) * (4.0 / 127)
    w[:, 0, 0, 0] = 4.0 * rng.choice([-1.0, 1.0], size=cout)
    return w.astype(np.float32)


def biased_conv_model(seed: int = 0) -> onnx.ModelProto:
    """x -> Conv(bias) -> Relu -> Conv(no bias) -> y: both Convs' quantized outputs shifted."""
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array(_coarse_weights(rng, 8, 4, 3), "w1"),
             numpy_helper.from_array(rng.normal(0, 0.1, 8).astype(np.float32), "b1"),
             numpy_helper.from_array(_coarse_weights(rng, 8, 8, 1), "w2")]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1] * 4),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2"], ["y"], name="conv2")]
    graph = helper.make_graph(
        nodes, "biased", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 8, 8])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _data(n: int, seed: int) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).uniform(0, 1, (n, 4, 8, 8)).astype(np.float32)}


def _every_point(model: onnx.ModelProto, cal: dict | None = None
                 ) -> tuple[onnx.ModelProto, dict, onnx.ModelProto]:
    """(float model, calibration data, Q/DQ model with every offered point on)."""
    pm = PreparedModel.prepare(model, runtime="onnxruntime")
    cal = _data(16, 1) if cal is None else cal
    stats = calibration.collect_statistics(pm.graph.full_model(), pm.candidate_tensors(), cal)
    exporter = pm.exporter(calibration.activation_scales(
        stats, method=calibration.DEFAULT_METHOD, quant_type=pm.quant_type))
    uses = set()
    for pp in pm.tunable:
        uses |= pp.uses(pp.ids)
    return pm.graph.full_model(), cal, exporter.to_model(exporter.plan(uses))


@pytest.fixture(scope="module")
def exported():
    """(float model, calibration data, Q/DQ model with every offered point on)."""
    return _every_point(biased_conv_model())


def _layer_outputs(model: onnx.ModelProto) -> dict[str, str]:
    """Conv node name -> its output tensor."""
    return {n.name: n.output[0] for n in model.graph.node if n.op_type == "Conv"}


def _mean_shift(float_model, model, data) -> float:
    """Mean |per-channel mean difference| over the Convs' outputs."""
    f_out, q_out = _layer_outputs(float_model), _layer_outputs(model)
    ref = channel_means(float_model, dict.fromkeys(f_out.values(), 1), data)
    got = channel_means(model, dict.fromkeys(q_out.values(), 1), data)
    return float(np.mean([np.abs(ref[f_out[k]] - got[q_out[k]]).mean() for k in f_out]))


def _rel_l2(ref: dict, got: dict) -> float:
    a, b = ref["y"].ravel().astype(np.float64), got["y"].ravel().astype(np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(a))


@pytest.mark.parametrize("mode", ["isolated", "sequential"])
def test_correction_removes_the_shift_and_lowers_the_error(exported, mode):
    float_model, cal, qdq = exported
    result = correct_biases(qdq, FloatMeans(float_model, cal), cal, mode=mode)
    assert sorted(result.layers) == ["conv1", "conv2"] and result.mean_abs_shift > 0
    before, after = _mean_shift(float_model, qdq, cal), _mean_shift(float_model, result.model,
                                                                     cal)
    assert after < 0.25 * before
    held = _data(8, 2)  # other samples: the shift is systematic, not fitted to the data
    ref = run_model(float_model, held)
    assert _mean_shift(float_model, result.model, held) < 0.5 * _mean_shift(float_model, qdq,
                                                                            held)
    assert _rel_l2(ref, run_model(result.model, held)) < 0.8 * _rel_l2(ref, run_model(qdq, held))


def test_sequential_shifts_are_exact_where_joint_ones_double_count(exported):
    """The second Conv's measured shift in ``joint`` mode also carries the first one's, which
    the first Conv's correction removes too: the joint correction leaves more shift behind."""
    float_model, cal, qdq = exported
    means = FloatMeans(float_model, cal)
    left = {m: _mean_shift(float_model, correct_biases(qdq, means, cal, mode=m).model, cal)
            for m in MODES}
    assert left["sequential"] < 1e-3 * _mean_shift(float_model, qdq, cal)
    assert left["sequential"] < left["joint"]


def test_corrected_model_keeps_its_qdq_and_kernels_and_the_input_is_untouched(exported,
                                                                              tmp_path):
    float_model, cal, qdq = exported
    path = tmp_path / "qdq.onnx"
    onnx.save(qdq, path)
    given = onnx.load(path)
    before_file, before_proto = path.read_bytes(), given.SerializeToString()
    result = correct_biases(given, FloatMeans(float_model, cal), cal)
    corrected = result.model
    assert path.read_bytes() == before_file and given.SerializeToString() == before_proto
    onnx.checker.check_model(corrected, full_check=True)

    def ops(m):
        return collections.Counter(n.op_type for n in m.graph.node)

    assert ops(corrected) == ops(qdq)
    assert ops(qdq)["QuantizeLinear"] > 0
    assert kernels_of(corrected).ops == kernels_of(qdq).ops
    assert "QLinearConv" in kernels_of(corrected).ops
    # only the biases moved: the bias-less Conv got one, the weights are the same integers
    new = {t.name: numpy_helper.to_array(t) for t in corrected.graph.initializer}
    old = {t.name: numpy_helper.to_array(t) for t in qdq.graph.initializer}
    conv2 = next(n for n in corrected.graph.node if n.name == "conv2")
    assert len(conv2.input) == 3 and conv2.input[2] in new and conv2.input[2] not in old
    changed = {k for k in old if not np.array_equal(old[k], new[k])}
    assert changed == {"b1"}
    run_model(corrected, cal)  # a default (fully optimized) ONNX Runtime session


def _gemm_model() -> onnx.ModelProto:
    rng = np.random.default_rng(3)
    w = rng.uniform(0.0, 0.3, (16, 6)).astype(np.float32) * (4.0 / 127)
    w[0, :] = 4.0
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "w", "b"], ["y"], name="fc", transB=0)], "gemm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 6])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.zeros(6, np.float32), "b")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_an_int32_bias_behind_a_dequantize_moves_in_its_own_steps():
    """ONNX Runtime's QGemm wants its bias as int32 (exported behind a DequantizeLinear): the
    correction moves those integers, in steps of the bias scale."""
    model, cal, qdq = _every_point(_gemm_model(), {
        "x": np.random.default_rng(4).uniform(0, 1, (16, 16)).astype(np.float32)})
    gemm = next(n for n in qdq.graph.node if n.op_type == "Gemm")
    producers = {o: n for n in qdq.graph.node for o in n.output}
    assert producers[gemm.input[2]].op_type == "DequantizeLinear"
    result = correct_biases(qdq, FloatMeans(model, cal), cal)
    assert result.layers == ["fc"]
    ints = producers[gemm.input[2]].input[0]
    old = {t.name: numpy_helper.to_array(t) for t in qdq.graph.initializer}[ints]
    new = {t.name: numpy_helper.to_array(t) for t in result.model.graph.initializer}[ints]
    assert new.dtype == np.int32 and not np.array_equal(old, new)
    ref = run_model(model, cal)
    err = {k: float(np.abs(run_model(m, cal)["y"] - ref["y"]).mean(axis=0).mean())
           for k, m in (("before", qdq), ("after", result.model))}
    assert err["after"] < 0.5 * err["before"]


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """The same deterministic run without and with ``bias_correction`` (a callable backend
    on which every Q/DQ pair saves time: both ship Q/DQ)."""
    import _latency_fns as fns

    from qdq_optuna import Config, tune
    from qdq_optuna.backends.callable import CallableBackend

    model = biased_conv_model()
    runs = {}
    for on in (False, True):
        out = tmp_path_factory.mktemp("bias") / f"run_{on}"
        result = tune(model, out, backend=CallableBackend(fns.every_qdq_faster,
                                                          deterministic=True),
                      runtime="onnxruntime", calibration_data=_data(16, 1),
                      bias_correction=on, config=Config(schemes_per_region=4),
                      progress=False)
        runs[on] = (out, result.report)
    return model, runs


def test_the_run_scores_and_ships_the_corrected_model(two_runs):
    from qdq_optuna.measure.accuracy import hold_out, output_errors, summarize

    model, runs = two_runs
    out, report = runs[True]
    acc = report["accuracy"]
    shipped = onnx.load(out / "optimized.onnx")
    assert acc["bias_correction"]["applied"] and acc["bias_correction"]["layers"] >= 1
    assert "Bias correction: applied to" in (out / "report.md").read_text()
    # the claimed error is the shipped (corrected) file's, on the guard's data
    guard_data = hold_out((_data(16, 1), "cal"))[1][0]
    ref = run_model(model, guard_data)
    claimed = summarize(output_errors(ref, run_model(shipped, guard_data)))["worst_relative_l2"]
    assert acc["error"] == pytest.approx(claimed, rel=1e-5)
    # the plain run ships the same placement uncorrected, with a larger error
    plain_out, plain = runs[False]
    assert "bias_correction" not in plain["accuracy"]
    plain_model = onnx.load(plain_out / "optimized.onnx")
    assert collections.Counter(n.op_type for n in plain_model.graph.node) == \
        collections.Counter(n.op_type for n in shipped.graph.node)
    assert acc["error"] < plain["accuracy"]["error"]


def test_a_layer_upstream_of_every_difference_is_not_measured_again(exported):
    """The corrector caches a layer's shift by the graph upstream of it: the same plan again
    runs nothing and gives the same model; a plan that quantizes only the first Conv reuses
    its shift."""
    from qdq_optuna.measure.bias import BiasCorrector

    float_model, cal, qdq = exported
    corrector = BiasCorrector(float_model, cal)
    first = corrector.correct(qdq)
    assert first.runs == 2  # two levels: conv2 reads conv1
    again = corrector.correct(qdq)
    assert again.runs == 0
    assert again.model.SerializeToString() == first.model.SerializeToString()
    pm = PreparedModel.prepare(biased_conv_model(), runtime="onnxruntime")
    stats = calibration.collect_statistics(pm.graph.full_model(), pm.candidate_tensors(), cal)
    exporter = pm.exporter(calibration.activation_scales(
        stats, method=calibration.DEFAULT_METHOD, quant_type=pm.quant_type))
    only_first = exporter.to_model(exporter.plan({("x", 0, 0)}))
    done = corrector.correct(only_first)
    assert done.layers == ["conv1"] and done.runs == 0
    b1 = {t.name: numpy_helper.to_array(t) for t in first.model.graph.initializer}["b1"]
    np.testing.assert_array_equal(
        {t.name: numpy_helper.to_array(t) for t in done.model.graph.initializer}["b1"], b1)


def _conv_transpose_model() -> onnx.ModelProto:
    """x -> Conv(bias) -> Relu -> ConvTranspose(no bias) -> y."""
    rng = np.random.default_rng(5)
    inits = [numpy_helper.from_array(_coarse_weights(rng, 8, 4, 3), "w1"),
             numpy_helper.from_array(rng.normal(0, 0.1, 8).astype(np.float32), "b1"),
             numpy_helper.from_array(_coarse_weights(rng, 8, 4, 2), "wt")]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1] * 4),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("ConvTranspose", ["r1", "wt"], ["y"], name="up", strides=[2, 2])]
    graph = helper.make_graph(
        nodes, "up", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 16, 16])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_no_bias_is_added_where_it_would_change_the_kernels():
    """ONNX Runtime fuses a quantized ConvTranspose without a bias into its integer kernel but
    not one with a float bias: the correction leaves a bias-less ConvTranspose alone."""
    model, cal, qdq = _every_point(_conv_transpose_model())
    result = correct_biases(qdq, FloatMeans(model, cal), cal)
    assert result.layers == ["conv1"] and "up" in result.skipped
    assert kernels_of(result.model).ops == kernels_of(qdq).ops
