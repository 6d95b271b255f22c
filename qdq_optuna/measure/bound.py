"""The accuracy bound: one value, built once while a run is prepared and owned by the accuracy
guard. Every feasibility check (a trial's constraint, a start, a commit, what ships), the report
and the resume fingerprint read this object, so none of them can disagree about the bound.

The bound is ``--max-output-error`` when given, the FP32 model's own metric plus
``--max-metric-drop`` (absolute or relative) when that is, else
:data:`DEFAULT_MAX_OUTPUT_ERROR`, tightened once the starts are measured to the error of the
fastest of the runtime's own recipes (:meth:`AccuracyBound.under_recipe`), never below
:data:`RECIPE_FLOOR_ERRORS`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from enum import Enum

from qdq_optuna.accuracy_words import CALIBRATION_DATA, data_kind
from qdq_optuna.measure.accuracy import DropType, ErrorMeasure

#: the accuracy guard's default bound on the worst output's relative L2 error vs FP32: a cosine
#: of about 0.98 when the error is uncorrelated with the output. On real held-out photos
#: (``benchmarks/bound_evidence.py``) a text-line classifier kept 92-96 % of its FP32 classes
#: at 0.1, 83-92 % at 0.2-0.25; 0.5 shipped a PP-OCR detector at cosine 0.87. Healthy
#: full-INT8 models sit at 0.02-0.17 (``benchmarks/calibration_methods.py``); past the bound the
#: starts' repair returns the groups that cost the least speed per error to float
DEFAULT_MAX_OUTPUT_ERROR = 0.2

#: the default bound is never tightened below an output cosine of 0.999 vs FP32 (in each
#: measure that has a cosine; relative L2 0.0447 when the error is uncorrelated with the
#: output): a recipe closer to FP32 than that does not make the tuned model meet it too
RECIPE_FLOOR_ERRORS = {ErrorMeasure.RELATIVE_L2: math.sqrt(2 * (1 - 0.999)),
                       ErrorMeasure.ONE_MINUS_COSINE: 1 - 0.999}
#: that floor's 1 - cosine is halved (cosine 0.9995, relative L2 0.0316) when the guard scores
#: the calibration samples themselves: the static scales were fitted to them, and inputs they
#: never saw read more. A ViT-like model's tuned file, its static parts calibrated on 8
#: generated scenes: relative L2 0.040 on them, 0.050 on 8 others (1 - cosine 1.5x)
CALIBRATION_FLOOR_SHARE = 0.5
#: a model within this factor of the recipe's error counts as accurate as the recipe: two
#: placements quantizing almost the same tensors read 0.07637 and 0.07636 on the same 8
#: samples, a difference no guard data can rank
RECIPE_ERROR_SLACK = 1.02


class BoundSource(str, Enum):
    """Where the bound's value comes from (report.json ``accuracy.bound_from``)."""

    MAX_OUTPUT_ERROR = "--max-output-error"
    MAX_METRIC_DROP = "--max-metric-drop"
    DEFAULT = "default"
    #: the default, tightened to the fastest recipe's own error (``accuracy.recipe_floor``)
    RECIPE = "the fastest recipe's error"


@dataclass(frozen=True)
class RecipeFloor:
    """Why a default bound was tightened: the runtime's recipe (as a start) that measured
    fastest among those within the default, its error, and the bound before."""

    start: str
    error: float
    default: float

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class MetricDrop:
    """``--max-metric-drop``: the FP32 model's own metric and the drop the bound allows over it
    (:func:`~qdq_optuna.measure.accuracy.metric_drop_bound`)."""

    fp32_metric: float
    max_metric_drop: float
    drop_type: DropType
    bound: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "drop_type", DropType.parse(self.drop_type))

    def to_dict(self) -> dict:
        return {**asdict(self), "drop_type": self.drop_type.value}


@dataclass(frozen=True)
class AskedBound:
    """The accuracy bound as a run's options ask for it: all of it that is known before
    anything is measured, and what the resume fingerprint reads (a metric drop's FP32 value is
    measured once the stored run agreed to the settings)."""

    #: ``--max-output-error`` (None: not given)
    max_output_error: float | None
    #: the error compared with the bound (a ``metric`` replaces it when given)
    measure: ErrorMeasure
    #: ``--metric`` as ``module:name`` (None: the output error :attr:`measure` is the error)
    metric: str | None = None
    #: ``--max-metric-drop`` and ``--metric-drop-type`` (None: the bound is no metric drop)
    max_metric_drop: float | None = None
    drop_type: DropType = DropType.ABSOLUTE
    #: ``--accuracy-confidence``: errors compared with the bound are the upper bounds of the
    #: mean per-sample error at this level (None: the error over all samples)
    confidence: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "measure", ErrorMeasure(self.measure))
        object.__setattr__(self, "drop_type", DropType.parse(self.drop_type))
        if self.max_output_error is not None:
            object.__setattr__(self, "max_output_error", float(self.max_output_error))

    @property
    def constrains_trials(self) -> bool:
        """Whether trials carry the bound as an Optuna constraint (an error budget the sampler
        sees): only a ``--max-output-error`` the user gave; the default and a metric drop bound
        the starts, commits and what ships only."""
        return self.max_output_error is not None

    def fingerprint_keys(self) -> dict:
        """The bound's part of the resume fingerprint (``max_metric_drop`` absent when unset,
        so runs stored before it existed still resume)."""
        keys = {"max_output_error": self.max_output_error, "error_measure": self.measure.value,
                "metric": self.metric}
        if self.max_metric_drop is not None:
            keys["max_metric_drop"] = [self.max_metric_drop, self.drop_type.value]
        return keys


@dataclass(frozen=True)
class AccuracyBound:
    """The bound every model a run starts from, commits or ships must keep, and what it is
    claimed on: built once, from what was asked, the data the guard measures on and (a metric
    drop) the FP32 model's own metric; a default one tightened once by the recipe starts."""

    asked: AskedBound
    value: float
    source: BoundSource
    #: the data the errors are measured on (``--validation-data FILE:sha``, ``random:8:1``, ...)
    data: str
    #: the FP32 model's metric and the allowed drop (None: the bound is not a metric drop)
    drop: MetricDrop | None = None
    #: the recipe whose error tightened the default bound (None: not tightened)
    recipe: RecipeFloor | None = None

    @classmethod
    def resolve(cls, asked: AskedBound, data: str, drop: MetricDrop | None = None
                ) -> AccuracyBound:
        """The bound of what was asked: the metric drop's, else the given output error, else
        the default."""
        if drop is not None:
            return cls(asked, drop.bound, BoundSource.MAX_METRIC_DROP, data, drop)
        if asked.max_output_error is not None:
            return cls(asked, asked.max_output_error, BoundSource.MAX_OUTPUT_ERROR, data)
        return cls(asked, DEFAULT_MAX_OUTPUT_ERROR, BoundSource.DEFAULT, data)

    def under_recipe(self, start: str, error: float) -> AccuracyBound:
        """The default bound tightened to ``error`` (within :data:`RECIPE_ERROR_SLACK`), the
        output error of the runtime's recipe ``start`` that measured fastest within it, but
        not below :attr:`recipe_floor_error`: a model faster than the recipe a user of the
        runtime would deploy is only worth it at that recipe's accuracy or better. A ViT-like
        model's tuned file ran 1.26x ``quantize_dynamic``'s with 1 - cosine 0.0019 against
        its 0.0013 on held-out inputs, from static Q/DQ on the residual stream. A bound the
        user gave (``--max-output-error``, ``--max-metric-drop``, ``--metric``) is theirs,
        and a measure without a cosine (``max_abs``) has no floor: both stay as they are."""
        if self.source is not BoundSource.DEFAULT or self.asked.metric \
                or self.measure not in RECIPE_FLOOR_ERRORS:
            return self
        value = max(self.recipe_floor_error, float(error) * RECIPE_ERROR_SLACK)
        if value >= self.value:
            return self
        return replace(self, value=value, source=BoundSource.RECIPE,
                       recipe=RecipeFloor(start, float(error), self.value))

    @property
    def recipe_floor_error(self) -> float:
        """The least a recipe can tighten this bound to (:data:`RECIPE_FLOOR_ERRORS`, its
        1 - cosine times :data:`CALIBRATION_FLOOR_SHARE` on the calibration samples)."""
        floor = RECIPE_FLOOR_ERRORS[self.measure]
        if data_kind(self.data) != CALIBRATION_DATA:
            return floor
        if self.measure is ErrorMeasure.ONE_MINUS_COSINE:
            return floor * CALIBRATION_FLOOR_SHARE
        return floor * math.sqrt(CALIBRATION_FLOOR_SHARE)  # relative L2 ~ sqrt(2 (1 - cos))

    @property
    def measure(self) -> ErrorMeasure:
        return self.asked.measure

    @property
    def confidence(self) -> float | None:
        return self.asked.confidence

    @property
    def constrains_trials(self) -> bool:
        return self.asked.constrains_trials

    @property
    def trial_budget(self) -> float | None:
        """The trials' error budget (report.json ``max_output_error``), None when trials are
        not constrained."""
        return self.value if self.constrains_trials else None

    @property
    def label(self) -> str:
        """What the error is, in the report: ``metric MODULE:NAME`` or the measure."""
        return f"metric {self.asked.metric}" if self.asked.metric else self.measure.value

    def allows(self, error: float) -> bool:
        return error <= self.value

    def allows_recipe(self, error: float) -> bool:
        """Whether one of the runtime's recipe files may ship: the bound before any recipe
        tightened it (that floor asks the tuned model for a recipe's accuracy; a recipe
        file need not match another recipe's)."""
        return error <= (self.recipe.default if self.recipe is not None else self.value)

    def excess(self, error: float) -> float | None:
        """A trial's constraint value (Optuna: feasible when <= 0), None when trials are not
        constrained."""
        return error - self.value if self.constrains_trials else None

    def describe(self) -> dict:
        return {"bound": self.value, "measure": self.label, "data": self.data}

    def report_keys(self) -> dict:
        """report.json ``accuracy``'s keys that state the bound."""
        return {**self.describe(), "bound_from": self.source.value,
                **({"metric_drop": self.drop.to_dict()} if self.drop else {}),
                **({"recipe_floor": self.recipe.to_dict()} if self.recipe else {})}
