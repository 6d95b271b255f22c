"""The accuracy guard: no model whose outputs drift past the bound is started from, committed
or shipped, whether or not the run asked for accuracy.

Errors are those of the model that would ship: exported with calibrated scales (whatever scales
the trials use), run in ONNX Runtime on the validation data (else the calibration data, else
random inputs) and compared with the FP32 model; the measure is the run's ``--error-measure``
(worst output) or its ``--metric``. The bound is the run's
:class:`~qdq_optuna.measure.bound.AccuracyBound`, built once while preparing and owned here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from qdq_optuna.accuracy_words import (
    WITHIN_BOUND,
    data_kind,
    data_phrase,
    default_session_lines,
    share_words,
)
from qdq_optuna.backends.what_ran import WhatRan
from qdq_optuna.measure.accuracy import samples_needed
from qdq_optuna.measure.bias import DEFAULT_MODE as BIAS_MODE
from qdq_optuna.measure.bias import CorrectedExports
from qdq_optuna.measure.bound import AccuracyBound
from qdq_optuna.measure.repair import RepairMethod, repair, sensitivity
from qdq_optuna.placement.export import QDQExporter, QuantPlan
from qdq_optuna.search._outcome import ShippedAccuracy
from qdq_optuna.search._plans import PlanMeasurer

log = logging.getLogger("qdq_optuna")


@dataclass
class Guard:
    plans: PlanMeasurer
    #: exports with calibrated scales: the errors of the model that would ship
    exporter: QDQExporter
    #: the bound, what it is measured in and on (the one every feasibility check reads)
    bound: AccuracyBound
    #: ``--bias-correction``: the exporter's models with their biases corrected, scored and
    #: shipped instead of the plain exports (None: off, or not possible for this run)
    corrected: CorrectedExports | None = None
    #: :meth:`~qdq_optuna.measure.accuracy.ErrorScorer.noise_floor` on the guard's data, with
    #: its share of the room the bound leaves (None: not measured)
    floor: dict | None = None
    #: the bound refused a model of this run (a start, a commit): trials are then scored
    #: before they are timed (:meth:`refuses_untimed`)
    binds: bool = False

    def measure_floor(self) -> dict | None:
        """The FP32 model's own error under half an 8-bit step of input noise, and its share
        of the room the bound leaves over the FP32 model's own value (the bound itself for an
        output error); one warning line when that share is :data:`FLOOR_WARN` or more: no
        8-bit placement is likely to stay within such a bound, and a repair that returns
        quantizer groups to float cannot help much (each quantized tensor adds noise of that
        order)."""
        try:
            floor = self.plans.scorer.noise_floor()
        except Exception as exc:  # a diagnosis only: never the run's failure
            log.info("the FP32 model's noise floor could not be measured (%s)", exc)
            return None
        if floor is None:
            return None
        own = self.bound.drop.fp32_metric if self.bound.drop else 0.0
        room = self.bound.value - own
        floor["share_of_bound"] = (floor["error"] - own) / room if room > 0 else None
        self.floor = floor
        if room > 0 and floor["share_of_bound"] >= FLOOR_WARN:
            log.warning(
                "noise floor: the FP32 model itself moves by %.3g (%s, worst output, on %s) "
                "when its inputs move by half an 8-bit step, %s what the bound %g allows: "
                "8-bit placements will hardly stay within it; give a task-level --metric with "
                "--max-metric-drop, or a --max-output-error you can accept", floor["error"],
                self.bound.label, data_phrase(self.bound.data),
                share_words(floor["share_of_bound"]), self.bound.value)
        return floor

    def error(self, plan: QuantPlan) -> dict:
        """Output errors of ``plan`` vs FP32 (``error``: the worst output's, in
        the bound's measure), scored once per run; of its bias-corrected export when the run
        corrects biases (what would ship)."""
        if self.corrected is not None:
            return self.plans.error(self.corrected, plan, tag=BIAS_TAG)
        return self.plans.error(self.exporter, plan)

    def shipped_exporter(self, exporter: QDQExporter) -> QDQExporter | CorrectedExports:
        """What writes ``optimized.onnx`` from ``exporter``'s plans: the model this guard
        scored (bias-corrected when the run corrects biases)."""
        return exporter if self.corrected is None else self.corrected.over(exporter)

    def correction_keys(self, plan: QuantPlan) -> dict:
        """report.json's ``bias_correction``: whether the shipped plan's biases were
        corrected, in how many layers, how they were measured."""
        if self.corrected is None:
            return {"applied": False}
        done, _ = self.corrected.correction(plan)
        return {"applied": bool(done.layers), "layers": len(done.layers),
                "skipped": len(done.skipped), "mode": BIAS_MODE,
                "mean_abs_shift": done.mean_abs_shift}

    def sensitivity(self, plan: QuantPlan, time_left) -> dict | None:
        """report.json's ``accuracy.sensitivity``: which quantizer groups of the shipped
        ``plan`` cost the most output error, on the guard's errors (a few plans scored; see
        :func:`~qdq_optuna.measure.repair.sensitivity`)."""
        try:
            return sensitivity(self.exporter, plan, lambda p: self.error(p)["error"],
                               time_left=time_left)
        except Exception as exc:  # a diagnosis only: never the run's failure
            log.info("the sensitivity table could not be measured (%s)", exc)
            return None

    def allows(self, plan: QuantPlan) -> bool:
        allowed = self.bound.allows(self.error(plan)["error"])
        self.binds |= not allowed
        return allowed

    def refuses_untimed(self, plan: QuantPlan) -> str | None:
        """Why ``plan`` is refused before it is timed, where the bound binds (:attr:`binds`):
        its error is past the bound, so it could never commit (None: time it). Scoring a
        model costs one session and the guard's samples, timing it many sessions of runs: a
        ViT-S's (real weights, ONNX Runtime CPU) one visit timed 12 trials in 262 s, and the
        guard then refused its three fastest."""
        if not self.binds:
            return None
        error = self.error(plan)["error"]
        if self.bound.allows(error):
            return None
        return (f"output error {error:.3g} over the bound {self.bound.value:g}: not timed "
                "(it could not commit)")

    def final(self, plan: QuantPlan, *,
              what_ran: Callable[[QuantPlan], WhatRan | None] | None = None) -> Verdict:
        """What may ship of the tuned ``plan``: the plan itself when it is within the bound;
        else the run's one repair (:func:`~qdq_optuna.measure.repair.repair`, as the starts'):
        quantizer groups returned to float by error per latency cost (``what_ran``: what the
        runtime ran for a plan, the costs; read only when the guard steps in), else the plan
        without the Q/DQ bisection names (every other commit kept), or the model without Q/DQ
        when that is all that is within the bound."""
        tuned = self.error(plan)
        if self.bound.allows(tuned["error"]):
            return Verdict(plan, WITHIN_BOUND, SHIPPED_TUNED, tuned, tuned, [], 0, plan.tensors)
        fixed = repair(self.exporter, plan, lambda p: self.error(p)["error"], self.bound.value,
                       what=what_ran(plan) if what_ran is not None else None)
        errors = self.error(fixed.plan)
        status = FALLBACK if self.bound.allows(errors["error"]) else FLOAT_PAST_BOUND
        return Verdict(fixed.plan, status, SHIPPED_BY[fixed.method], errors, tuned,
                       fixed.responsible, fixed.evaluations, plan.tensors, fixed.method)

    def ship(self, plan: QuantPlan, precision: str, *,
             what_ran: Callable[[QuantPlan], WhatRan | None] | None = None) -> Verdict:
        """:meth:`final`, said in one warning line when the guard had to step in
        (``precision``: the run's high precision, named when even its float model drifts)."""
        verdict = self.final(plan, what_ran=what_ran)
        self._say_claim(verdict)
        if verdict.status == WITHIN_BOUND:
            return verdict
        where, bound = data_phrase(self.bound.data), self.bound
        if verdict.status == FALLBACK:
            culprits = listed(verdict.responsible)
            log.warning(
                "accuracy guard: the tuned model's output error %.4g (%s, worst output, on %s) "
                "is past the bound %g; Q/DQ on %s caused it: optimized.onnx is the %s instead "
                "(error %.4g)", verdict.tuned_errors["error"], bound.label, where,
                bound.value, culprits or "no single tensor", verdict.shipped,
                verdict.errors["error"])
        else:
            log.warning(
                "accuracy guard: even the %s model without Q/DQ has output error %.4g (%s, "
                "worst output, on %s), past the bound %g: optimized.onnx is that model; raise "
                "--max-output-error or choose another --high-precision", precision,
                verdict.errors["error"], bound.label, where, bound.value)
        return verdict

    def claim(self, errors: dict) -> dict | None:
        """report.json's ``claim``: how the shipped model's per-sample errors on the guard's
        data spread (:func:`~qdq_optuna.measure.accuracy.error_spread`), whether the upper
        bound of their mean is within the bound, and how many samples with this spread would
        put it there; None where the samples cannot be told apart."""
        spread = errors.get("spread")
        if spread is None:
            return None
        bound = self.bound
        return {**spread, "held_on": "upper" if bound.confidence is not None else "all samples",
                "upper_within_bound": bound.allows(spread["upper"]),
                "samples_needed": samples_needed(spread, bound.value)}

    def _say_claim(self, verdict: Verdict) -> None:
        """One warning line when the guard's data is too small to support what ships: its
        error within the bound, the upper bound of the mean per-sample error past it."""
        if verdict.status == FLOAT_PAST_BOUND:
            return
        claim = self.claim(verdict.errors)
        if claim is None:
            if self.bound.confidence is not None:
                log.warning("--accuracy-confidence: the guard's errors on %s cannot be told "
                            "apart per sample (fewer than two, an output without the samples "
                            "on its first axis, or a --metric that scores whole data sets "
                            "only): the bound holds on the error over all samples",
                            data_phrase(self.bound.data))
            return
        if claim["upper_within_bound"]:
            return
        needed = claim["samples_needed"]
        log.warning(
            "accuracy claim: the shipped model's error is within the bound %g on %d samples "
            "(%s), but they spread (per sample %.3g to %.3g, mean %.3g): the upper %g%% bound "
            "of the mean is %.3g, past the bound; %s", self.bound.value, claim["samples"],
            data_phrase(self.bound.data), claim["min"], claim["worst"], claim["mean"],
            100 * claim["confidence"], claim["upper"],
            f"about {needed} samples with this spread would support it (--validation-data)"
            if needed else "no number of samples with this mean would support it")

    def shipped_accuracy(self, verdict: Verdict, *, scored_as: str) -> ShippedAccuracy:
        """What the guard measured of what ships: report.json's ``accuracy`` (bound, measure,
        data, errors of what ships and of the tuned placement, status, responsible tensors)
        and ``final_output_error(s)``; ``scored_as``: how the guard ran candidates, in the
        profile's words (``Runtime.scored_as``)."""
        errors = verdict.errors
        return ShippedAccuracy(
            {
                **self.bound.report_keys(),
                "data_kind": data_kind(self.bound.data),
                "scored_as": scored_as,
                **scored_with(self.plans.scorer.evaluator.runner),
                "status": verdict.status,
                "shipped": verdict.shipped,
                "error": errors["error"],
                "output_errors": errors["output_errors"],
                "tuned_error": verdict.tuned_errors["error"],
                "tuned_output_errors": verdict.tuned_errors["output_errors"],
                "tuned_tensors": verdict.tuned_tensors,
                "responsible_tensors": verdict.responsible,
                "bisection_evaluations": verdict.evaluations,
                **({"repair": verdict.repair.value} if verdict.repair else {}),
                "confidence": self.bound.confidence,
                "claim": self.claim(errors),
                **({"input_noise_floor": self.floor} if self.floor else {}),
            },
            errors["error"], errors["output_errors"])


#: the noise floor's share of the bound's room at which the guard warns that 8-bit placements
#: will hardly fit (PP-OCRv5's detector on text photos: 0.77)
FLOOR_WARN = 0.5
#: the error memo's tag for a plan's bias-corrected export
BIAS_TAG = "+bias"
#: the tuned model broke the bound: a model within it ships instead
FALLBACK = "fallback"
#: not even the model without Q/DQ (in the run's high precision) is within the bound: it ships
FLOAT_PAST_BOUND = "float model past bound"
#: :attr:`Verdict.shipped`
SHIPPED_TUNED = "tuned model"
SHIPPED_WITHOUT = "tuned model without the responsible tensors' Q/DQ"
SHIPPED_RANKED = "tuned model with its costliest quantizer groups returned to float"
SHIPPED_FLOAT = "model without Q/DQ"
#: what ships after each way :func:`~qdq_optuna.measure.repair.repair` ends
SHIPPED_BY = {RepairMethod.RANKED: SHIPPED_RANKED, RepairMethod.BISECTION: SHIPPED_WITHOUT,
              RepairMethod.FLOAT: SHIPPED_FLOAT, RepairMethod.NO_TIME: SHIPPED_FLOAT}


@dataclass
class Verdict:
    """The guard's decision about the model a run ships (:meth:`Guard.final`)."""

    #: the plan that ships
    plan: QuantPlan
    status: str
    shipped: str
    #: output errors of what ships, and of the tuned plan (error records, see
    #: :func:`qdq_optuna.measure.accuracy.error_record`)
    errors: dict
    tuned_errors: dict
    #: activation tensors whose Q/DQ the repair took out (empty when within the bound)
    responsible: list[str]
    #: error evaluations the repair made
    evaluations: int
    #: activation tensors the tuned plan quantizes
    tuned_tensors: list[str]
    #: how the repair ended (None: the tuned plan was within the bound)
    repair: RepairMethod | None = None


def listed(names: list[str], limit: int = 6) -> str:
    """``names`` for a log line or a note: the first ``limit``, then how many more."""
    more = len(names) - limit
    return ", ".join(names[:limit]) + (f" (+{more})" if more > 0 else "")


def scored_with(runner) -> dict:
    """``{"scored_with": properties}`` when the guard ran candidates in the runtime itself
    (OpenVINO: the compile properties, the inference precision hint among them, that a check
    of the shipped file must use to see the same values), else nothing."""
    config = getattr(getattr(runner, "__self__", None), "config", None)
    return {"scored_with": config()} if callable(config) else {}


def check_default_session(accuracy: dict, scorer, saved) -> None:
    """``accuracy["onnxruntime_cpu_default"]`` for a model the guard scored another way (see
    :meth:`~qdq_optuna.measure.accuracy.ErrorScorer.default_session_check`), and one warning line when
    a default ONNX Runtime CPU session refuses it or drifts past the stated factor."""
    check = scorer.default_session_check(saved) if isinstance(saved, bytes) else None
    if check is None:
        return
    accuracy["onnxruntime_cpu_default"] = check
    for line in default_session_lines(check, accuracy["error"]):
        log.warning("%s", line.replace("`", ""))


