"""The accuracy bound as one value object (``measure/bound.py``): where its value comes from,
whether trials carry it as a constraint, and what the report and the fingerprint read of it."""

from __future__ import annotations

import dataclasses

import pytest

from qdq_optuna.measure.accuracy import ErrorMeasure
from qdq_optuna.measure.bound import (
    DEFAULT_MAX_OUTPUT_ERROR,
    RECIPE_ERROR_SLACK,
    RECIPE_FLOOR_ERRORS,
    AccuracyBound,
    AskedBound,
    BoundSource,
    MetricDrop,
    RecipeFloor,
)


def test_the_default_bounds_starts_and_what_ships_but_no_trial():
    bound = AccuracyBound.resolve(AskedBound(None, "relative_l2"), "random:8:1")
    assert (bound.value, bound.source) == (DEFAULT_MAX_OUTPUT_ERROR, BoundSource.DEFAULT)
    assert not bound.constrains_trials and bound.trial_budget is None
    assert bound.excess(10.0) is None
    assert bound.allows(DEFAULT_MAX_OUTPUT_ERROR)
    assert not bound.allows(DEFAULT_MAX_OUTPUT_ERROR * 1.01)
    assert bound.measure is ErrorMeasure.RELATIVE_L2 and bound.label == "relative_l2"
    assert bound.asked.fingerprint_keys() == {"max_output_error": None,
                                              "error_measure": "relative_l2", "metric": None}


def test_a_given_output_error_bounds_every_trial_too():
    bound = AccuracyBound.resolve(AskedBound(0.05, "max_abs"), "random:8:1")
    assert bound.source is BoundSource.MAX_OUTPUT_ERROR and bound.constrains_trials
    assert bound.trial_budget == 0.05
    assert bound.excess(0.08) == pytest.approx(0.03) and bound.excess(0.01) < 0
    assert bound.report_keys() == {"bound": 0.05, "measure": "max_abs", "data": "random:8:1",
                                   "bound_from": "--max-output-error"}


def test_a_metric_drop_is_the_fp32_metric_plus_the_drop():
    asked = AskedBound(None, "relative_l2", "m:top1_error", 0.1, "relative", confidence=0.9)
    drop = MetricDrop(fp32_metric=0.3, max_metric_drop=0.1, drop_type="relative", bound=0.33)
    bound = AccuracyBound.resolve(asked, "--validation-data v.npz:abc", drop)
    assert bound.value == 0.33 and bound.source is BoundSource.MAX_METRIC_DROP
    assert not bound.constrains_trials and bound.label == "metric m:top1_error"
    assert bound.confidence == 0.9
    assert bound.report_keys()["metric_drop"] == {"fp32_metric": 0.3, "max_metric_drop": 0.1,
                                                  "drop_type": "relative", "bound": 0.33}
    # what the fingerprint reads is known before the FP32 metric is measured
    assert asked.fingerprint_keys() == {"max_output_error": None, "error_measure": "relative_l2",
                                        "metric": "m:top1_error",
                                        "max_metric_drop": [0.1, "relative"]}


def test_the_bound_cannot_change_once_built():
    bound = AccuracyBound.resolve(AskedBound(0.1, "relative_l2"), "random:8:1")
    with pytest.raises(dataclasses.FrozenInstanceError):
        bound.value = 1.0  # type: ignore[misc]


def test_an_unknown_measure_is_refused():
    with pytest.raises(ValueError):
        AskedBound(None, "cosine")


def test_the_fastest_recipe_tightens_a_default_bound_but_never_below_cosine_0999():
    bound = AccuracyBound.resolve(AskedBound(None, "relative_l2"), "random:8:1")
    tight = bound.under_recipe("dynamic", 0.06)
    assert (tight.value, tight.source) == (pytest.approx(0.06 * RECIPE_ERROR_SLACK),
                                           BoundSource.RECIPE)
    assert tight.recipe == RecipeFloor("dynamic", 0.06, DEFAULT_MAX_OUTPUT_ERROR)
    assert not tight.allows(0.07) and tight.allows_recipe(0.07) and bound.allows_recipe(0.07)
    assert tight.allows(0.0611)  # as accurate as the recipe within what 8 samples can rank
    assert tight.report_keys()["recipe_floor"] == {"start": "dynamic", "error": 0.06,
                                                   "default": DEFAULT_MAX_OUTPUT_ERROR}
    assert tight.under_recipe("recipe:onnxruntime", 0.01) is tight  # tightened once
    floor = RECIPE_FLOOR_ERRORS[ErrorMeasure.RELATIVE_L2]
    assert bound.under_recipe("dynamic", 0.001).value == pytest.approx(floor)
    assert floor == pytest.approx(0.0447, abs=1e-4)
    # a recipe less accurate than the default does not loosen it
    assert bound.under_recipe("recipe:onnxruntime", 0.5) is bound
    cosine = AccuracyBound.resolve(AskedBound(None, "1-cosine"), "random:8:1")
    assert cosine.under_recipe("dynamic", 0.0).value == pytest.approx(0.001)
    # scored on the samples the static scales were fitted to: a floor of cosine 0.9995
    on_calibration = AccuracyBound.resolve(AskedBound(None, "relative_l2"),
                                           "--calibration-data cal.npz:1a2b")
    assert on_calibration.under_recipe("dynamic", 0.0).value == pytest.approx(0.0316, abs=1e-4)
    cosine = AccuracyBound.resolve(AskedBound(None, "1-cosine"), "--calibration-data c.npz:1")
    assert cosine.under_recipe("dynamic", 0.0).value == pytest.approx(0.0005)
    held_out = AccuracyBound.resolve(AskedBound(None, "relative_l2"),
                                     "--calibration-data held out (4 of its 16 samples, not used for scales)")
    assert held_out.under_recipe("dynamic", 0.0).value == pytest.approx(floor)


@pytest.mark.parametrize("asked", [AskedBound(0.2, "relative_l2"),
                                   AskedBound(None, "max_abs"),
                                   AskedBound(None, "relative_l2", "m:top1_error")])
def test_a_bound_the_user_gave_or_one_without_a_cosine_is_not_tightened(asked):
    bound = AccuracyBound.resolve(asked, "random:8:1")
    assert bound.under_recipe("dynamic", 0.01) is bound
