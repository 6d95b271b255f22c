"""The accuracy claim with its spread: per-sample errors of the shipped model on the guard's
data (min, median, worst, the upper confidence bound of their mean), ``--accuracy-confidence``
holding the bound on that upper bound, and the warning when the guard's data is too small to
support the claim. Real ONNX Runtime sessions on small generated models."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
from scipy import stats
from test_noise_floor import _data, _sigmoid_model

from qdq_optuna.errors import OptionError
from qdq_optuna.measure.accuracy import AccuracyEvaluator, error_spread, samples_needed

pytestmark = pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")


def test_the_upper_bound_covers_the_true_mean_as_often_as_its_confidence():
    """Over many draws of 8 normal samples, the 90% upper bound is at or above the true mean
    about 90% of the time (the plain mean would cover it half the time)."""
    rng = np.random.default_rng(7)
    draws = [error_spread(rng.normal(0.04, 0.01, size=8), 0.9) for _ in range(3000)]
    covered = np.mean([d["upper"] >= 0.04 for d in draws])
    assert 0.88 <= covered <= 0.92, covered
    assert np.mean([d["mean"] >= 0.04 for d in draws]) < 0.55
    d = draws[0]
    assert d["min"] <= d["median"] <= d["worst"] and d["samples"] == 8
    assert d["mean"] < d["upper"]


def test_one_sample_or_a_broken_one_claims_nothing():
    assert math.isinf(error_spread(np.array([0.01]), 0.9)["upper"])
    assert math.isinf(error_spread(np.array([0.01, math.inf]), 0.9)["upper"])


def test_samples_needed_is_the_fewest_whose_upper_bound_fits():
    spread = error_spread(np.array([0.02, 0.09, 0.05, 0.11]), 0.9)
    bound = spread["mean"] + 0.3 * (spread["upper"] - spread["mean"])
    n = samples_needed(spread, bound)
    assert n is not None and n > spread["samples"]

    def upper(k: int) -> float:
        return spread["mean"] + stats.t.ppf(0.9, k - 1) * spread["sd"] / math.sqrt(k)

    assert upper(n) <= bound < upper(n - 1)
    assert samples_needed(spread, spread["mean"] * 0.9) is None  # the mean itself is past


def test_each_samples_error_is_its_error_alone():
    """The spread's figures are the errors each sample gives when scored by itself."""
    model, data = _sigmoid_model(3.0), _data(6)
    candidate = _sigmoid_model(3.3).SerializeToString()  # another model: errors differ
    evaluator = AccuracyEvaluator(model.SerializeToString(), data)
    _, details = evaluator.evaluate(candidate)
    alone = [AccuracyEvaluator(model.SerializeToString(), {"x": data["x"][i:i + 1]})
             .evaluate(candidate)[0] for i in range(6)]
    spread = details["spread"]
    assert spread["samples"] == 6
    assert spread["min"] == pytest.approx(min(alone))
    assert spread["worst"] == pytest.approx(max(alone))
    assert spread["median"] == pytest.approx(float(np.median(alone)))
    assert spread["mean"] == pytest.approx(float(np.mean(alone)))
    assert max(alone) > 1.05 * min(alone)  # they do spread

    held = AccuracyEvaluator(model.SerializeToString(), data, confidence=0.9)
    error, held_details = held.evaluate(candidate)
    assert error == pytest.approx(spread["upper"]) and error > spread["mean"]
    assert held_details["all_samples_error"] == pytest.approx(details["error"])


def test_a_metric_is_spread_per_sample_unless_it_scores_whole_data_sets_only():
    model, data = _sigmoid_model(3.0), _data(6)
    candidate = _sigmoid_model(3.3).SerializeToString()

    def mean_abs(ref, out):
        return float(np.mean(np.abs(ref["y"] - out["y"])))

    _, details = AccuracyEvaluator(model.SerializeToString(), data,
                                   metric=mean_abs).evaluate(candidate)
    alone = [mean_abs({"y": r}, {"y": c}) for r, c in zip(
        AccuracyEvaluator(model.SerializeToString(), data).reference["y"],
        AccuracyEvaluator(candidate, data).reference["y"])]
    assert details["spread"]["worst"] == pytest.approx(max(alone), rel=1e-5)

    labels = np.arange(6)

    def accuracy_over_labels(ref, out):  # a task metric over the whole data's labels
        return float(np.mean(out["y"].reshape(len(labels), -1).argmax(1) != labels))

    _, details = AccuracyEvaluator(model.SerializeToString(), data,
                                   metric=accuracy_over_labels).evaluate(candidate)
    assert "spread" not in details


def test_accuracy_confidence_is_checked():
    from qdq_optuna import TuneOptions

    with pytest.raises(OptionError, match="--accuracy-confidence"):
        TuneOptions(model="m.onnx", output_dir="o", accuracy_confidence=1.5)


def test_the_run_states_its_claim_and_holds_the_bound_on_the_upper_bound(tmp_path, caplog):
    """A run without the option reports its claim's spread (and warns when the upper bound
    is past the bound: the held-out samples do not support it); with the option, at a bound
    between the first run's mean and upper bound, what ships has its upper bound within."""
    from test_guard_run import _backend

    from qdq_optuna import Config, tune

    def run(name: str, bound: float, **extra):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="qdq_optuna"):
            result = tune(_sigmoid_model(20.0), tmp_path / name, backend=_backend(),
                          runtime="onnxruntime", calibration_data=_data(16),
                          max_output_error=bound, config=Config(schemes_per_region=2),
                          progress=False, **extra)
        warned = [r.getMessage() for r in caplog.records
                  if r.getMessage().startswith("accuracy claim")]
        return result.report["accuracy"], warned, (result.output_dir / "report.md").read_text()

    first, _, md = run("first", 1.0)
    claim = first["claim"]
    assert claim["samples"] == 4 and claim["held_on"] == "all samples"  # 4 of 16 held out
    assert claim["min"] <= claim["median"] <= claim["worst"] and claim["upper"] > claim["mean"]
    assert "Per sample (4 samples)" in md
    assert first["error"] > 0, "nothing was quantized: no claim to test"

    bound = (claim["mean"] + claim["upper"]) / 2
    plain, warned, md = run("plain", bound)
    c = plain["claim"]
    if c["upper_within_bound"]:
        assert not warned
    else:  # within by the error over all samples, not by the upper bound: said, with a size
        assert plain["status"] != "float model past bound"
        assert len(warned) == 1 and "samples with this spread would" in warned[0], warned
        assert "do not support the claim" in md

    held, warned, md = run("held", bound, accuracy_confidence=0.9)
    c = held["claim"]
    assert held["confidence"] == 0.9 and c["held_on"] == "upper"
    assert c["upper_within_bound"] and held["error"] == pytest.approx(c["upper"])
    assert not warned and "--accuracy-confidence 0.9" in md


@pytest.mark.parametrize("samples", [8, 16])
def test_a_claim_on_the_calibration_samples_themselves_says_so(tmp_path, caplog, samples):
    """Under 16 calibration samples and no validation data, the guard scores the samples the
    scales came from: the run warns and report.md says what that claim is worth; from 16 on a
    quarter is held out and neither appears."""
    from test_guard_run import _backend

    from qdq_optuna import Config, tune
    from qdq_optuna.outputs.report import CALIBRATION_DATA_CAVEAT

    with caplog.at_level(logging.WARNING, logger="qdq_optuna"):
        result = tune(_sigmoid_model(20.0), tmp_path / "run", backend=_backend(),
                      runtime="onnxruntime", calibration_data=_data(samples),
                      config=Config(schemes_per_region=2), progress=False)
    warned = "the samples its scales come from" in caplog.text
    md = (result.output_dir / "report.md").read_text()
    kind = result.report["accuracy"]["data_kind"]
    if samples < 16:
        assert warned and CALIBRATION_DATA_CAVEAT in md and kind == "calibration data"
    else:
        assert not warned and CALIBRATION_DATA_CAVEAT not in md
        assert kind == "held-out part of the calibration data"
