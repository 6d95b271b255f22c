"""Accuracy: running models, comparing outputs, user metrics, the evaluator."""

from __future__ import annotations

import math
import textwrap

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from qdq_optuna.errors import OptionError
from qdq_optuna.measure.accuracy import (
    AccuracyError,
    AccuracyEvaluator,
    error_value,
    load_metric,
    output_errors,
    run_model,
    summarize,
)
from qdq_optuna.model.calibration import METHODS, activation_params, collect_statistics

RNG = np.random.default_rng(0)
W1 = RNG.standard_normal((4, 3, 3, 3)).astype(np.float32)
W2 = RNG.standard_normal((2, 4, 3, 3)).astype(np.float32)


def _model(nodes, initializers) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2, 8, 8])],
        initializers,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def float_model() -> onnx.ModelProto:
    """x -> Conv -> Relu -> Conv -> y."""
    return _model(
        [
            helper.make_node("Conv", ["x", "W1"], ["c1"], pads=[1, 1, 1, 1]),
            helper.make_node("Relu", ["c1"], ["r1"]),
            helper.make_node("Conv", ["r1", "W2"], ["y"], pads=[1, 1, 1, 1]),
        ],
        [numpy_helper.from_array(W1, "W1"), numpy_helper.from_array(W2, "W2")],
    )


def qdq_model(x_scale: float, r_scale: float) -> onnx.ModelProto:
    """The same network with int8 Q/DQ on both conv inputs and both weights."""
    inits = []
    nodes = []

    def scalar(name, value, dtype):
        inits.append(numpy_helper.from_array(np.array(value, dtype=dtype), name))

    for name, weight in (("W1", W1), ("W2", W2)):
        scale = float(np.abs(weight).max()) / 127
        q = np.clip(np.round(weight / scale), -128, 127).astype(np.int8)
        inits.append(numpy_helper.from_array(q, f"{name}_q"))
        scalar(f"{name}_s", scale, np.float32)
        scalar(f"{name}_z", 0, np.int8)
        nodes.append(
            helper.make_node("DequantizeLinear", [f"{name}_q", f"{name}_s", f"{name}_z"], [name])
        )
    for tensor, scale in (("x", x_scale), ("r1", r_scale)):
        scalar(f"{tensor}_s", scale, np.float32)
        scalar(f"{tensor}_z", 0, np.int8)
        nodes += [
            helper.make_node(
                "QuantizeLinear", [tensor, f"{tensor}_s", f"{tensor}_z"], [f"{tensor}_q"]
            ),
            helper.make_node(
                "DequantizeLinear", [f"{tensor}_q", f"{tensor}_s", f"{tensor}_z"], [f"{tensor}_dq"]
            ),
        ]
    nodes += [
        helper.make_node("Conv", ["x_dq", "W1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1_dq", "W2"], ["y"], pads=[1, 1, 1, 1]),
    ]
    return _model(nodes, inits)


@pytest.fixture(scope="module")
def data() -> dict:
    return {"x": np.random.default_rng(1).standard_normal((6, 3, 8, 8)).astype(np.float32)}


@pytest.fixture(scope="module")
def sensible_qdq(data) -> bytes:
    stats = collect_statistics(float_model(), ["x", "r1"], data)
    (sx, _), (sr, _) = (
        activation_params(stats[n], method="minmax", quant_type="int8") for n in ("x", "r1")
    )
    return qdq_model(sx, sr).SerializeToString()


def test_run_model_accepts_proto_bytes_and_path(data, tmp_path):
    model = float_model()
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    a = run_model(model, data)
    b = run_model(model.SerializeToString(), data, batch_size=4)
    c = run_model(path, data, batch_size=6)
    assert a["y"].shape == (6, 2, 8, 8)
    np.testing.assert_allclose(a["y"], b["y"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(a["y"], c["y"], rtol=1e-5, atol=1e-5)


def test_identical_models_have_no_error(data):
    ref = run_model(float_model(), data)
    errors = output_errors(ref, run_model(float_model(), data))
    assert errors["y"] == {"cosine": pytest.approx(1.0), "relative_l2": 0.0, "max_abs": 0.0}
    assert error_value(errors) == 0.0
    assert error_value(errors, "1-cosine") == pytest.approx(0.0, abs=1e-12)


def test_sensible_and_absurd_scales(data, sensible_qdq):
    ref = run_model(float_model(), data)
    good = summarize(output_errors(ref, run_model(sensible_qdq, data)))
    assert good["worst_cosine"] > 0.99
    assert 0 < good["worst_relative_l2"] < 0.1
    bad_model = qdq_model(1e3, 1e3)
    bad = summarize(output_errors(ref, run_model(bad_model, data)))
    assert bad["worst_cosine"] < 0.5
    assert bad["worst_relative_l2"] > 10 * good["worst_relative_l2"]
    assert bad["worst_max_abs"] > good["worst_max_abs"]


@pytest.mark.parametrize("method", METHODS)
def test_every_calibration_method_keeps_outputs_close(data, method):
    stats = collect_statistics(float_model(), ["x", "r1"], data)
    (sx, _), (sr, _) = (
        activation_params(stats[n], method=method, quant_type="int8") for n in ("x", "r1")
    )
    ref = run_model(float_model(), data)
    summary = summarize(output_errors(ref, run_model(qdq_model(sx, sr), data)))
    assert summary["worst_cosine"] > 0.99
    assert summary["worst_relative_l2"] < 0.1


def test_output_errors_edge_cases():
    zeros = {"y": np.zeros((2, 3))}
    assert output_errors(zeros, zeros)["y"]["cosine"] == 1.0
    ones = {"y": np.ones((2, 3))}
    assert output_errors(zeros, ones)["y"]["cosine"] == 0.0
    assert output_errors(ones, zeros)["y"]["relative_l2"] == pytest.approx(1.0)
    flipped = output_errors(ones, {"y": -np.ones((2, 3))})["y"]
    assert flipped["cosine"] == pytest.approx(-1.0) and flipped["max_abs"] == 2.0
    nan = output_errors(ones, {"y": np.full((2, 3), np.nan)})["y"]
    assert nan == {"cosine": -1.0, "relative_l2": math.inf, "max_abs": math.inf}
    masked = {"y": np.array([[1.0, -np.inf]])}
    assert output_errors(masked, masked)["y"]["relative_l2"] == 0.0
    with pytest.raises(ValueError, match="'y'"):
        output_errors(ones, {"y": np.ones((3, 2))})


def test_summarize_takes_worst_output():
    errors = {
        "a": {"cosine": 0.99, "relative_l2": 0.1, "max_abs": 3.0},
        "b": {"cosine": 0.9, "relative_l2": 0.05, "max_abs": 4.0},
    }
    assert summarize(errors) == {
        "worst_cosine": 0.9,
        "worst_relative_l2": 0.1,
        "worst_max_abs": 4.0,
    }
    assert error_value(errors) == 0.1
    assert error_value(errors, "1-cosine") == pytest.approx(0.1)
    assert error_value(errors, "max_abs") == 4.0
    with pytest.raises(OptionError, match="'snr'"):
        error_value(errors, "snr")


METRIC_SOURCE = textwrap.dedent(
    """
    import numpy as np

    def mean_abs(reference, candidate):
        return float(np.mean(np.abs(reference["y"] - candidate["y"])))

    def broken(reference, candidate):
        raise RuntimeError("boom")

    not_callable = 3
    """
)


@pytest.fixture
def metric_dir(tmp_path, monkeypatch):
    (tmp_path / "my_metric_mod.py").write_text(METRIC_SOURCE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(__import__("sys").modules, "my_metric_mod", raising=False)
    return tmp_path


def test_load_metric(metric_dir):
    fn = load_metric("my_metric_mod:mean_abs")
    assert fn({"y": np.zeros(3)}, {"y": np.ones(3)}) == 1.0
    assert load_metric("my_metric_mod.py:mean_abs")({"y": np.zeros(2)}, {"y": np.zeros(2)}) == 0
    for spec, fragment in [
        ("my_metric_mod", "module:function"),
        ("no_such_module_xyz:f", "no_such_module_xyz"),
        ("my_metric_mod:missing", "'missing'"),
        ("my_metric_mod:not_callable", "not callable"),
        ("nothere.py:f", "nothere.py"),
    ]:
        with pytest.raises(OptionError) as err:
            load_metric(spec)
        assert "--metric" in str(err.value) and fragment in str(err.value)


def test_evaluator_default_error(data, sensible_qdq):
    evaluator = AccuracyEvaluator(float_model(), data, batch_size=2)
    error, details = evaluator.evaluate(sensible_qdq)
    assert error == details["worst_relative_l2"] == details["error"]
    assert 0 < error < 0.1
    assert set(details["outputs"]) == {"y"}
    same, _ = evaluator.evaluate(float_model().SerializeToString())
    assert same == 0.0
    cos = AccuracyEvaluator(float_model(), data, error_measure="1-cosine")
    assert cos.evaluate(sensible_qdq)[0] == pytest.approx(1 - details["worst_cosine"])


def test_evaluator_with_user_metric(data, sensible_qdq, metric_dir):
    evaluator = AccuracyEvaluator(float_model(), data, metric="my_metric_mod:mean_abs")
    error, details = evaluator.evaluate(sensible_qdq)
    expected = float(np.mean(np.abs(evaluator.reference["y"] - run_model(sensible_qdq, data)["y"])))
    assert error == pytest.approx(expected) and details["metric"] == error
    assert "worst_cosine" in details
    broken = AccuracyEvaluator(float_model(), data, metric="my_metric_mod:broken")
    with pytest.raises(OptionError, match="--metric.*boom"):
        broken.evaluate(sensible_qdq)
    nan_metric = AccuracyEvaluator(float_model(), data, metric=lambda r, c: float("nan"))
    assert nan_metric.evaluate(sensible_qdq)[0] == math.inf


def test_evaluator_rejects_bad_candidates(data):
    evaluator = AccuracyEvaluator(float_model(), data)
    with pytest.raises(AccuracyError):
        evaluator.evaluate(b"not a model")
    with pytest.raises(OptionError, match="'psnr'"):
        AccuracyEvaluator(float_model(), data, error_measure="psnr")
