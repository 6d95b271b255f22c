"""What a trial is scored on besides latency: output error, error budget, precision choices.

Accuracy modes (``--max-output-error``, ``--objectives latency,error``, ``--validation-data``,
``--metric``) run every trial's model in ONNX Runtime on the validation data and record its
output errors against the FP32 model. Trials always use calibrated scales then: errors measured
with placeholder scales say nothing about the deployed model.

* **Constraint mode** (``--max-output-error X``): each trial gets the Optuna constraint
  ``error - X`` (``Trial.set_constraint``; Optuna 5 samplers read it from the trial, the
  ``constraints_func`` argument is deprecated there) and the user attr ``feasible``. The commit
  takes the fastest *feasible* trial. Since a pattern's trials are measured on top of the earlier
  patterns' commits, the error is that of the whole model so far, so the final model stays
  within the budget on the validation data.
* **Multi-objective** (``--objectives latency,error``): studies minimize ``[latency_ms, error]``.
  The commit takes the Pareto point that is fastest (feasible ones only under a budget); Pareto
  points whose latency lies within ``performance_threshold`` of it are treated as equally fast
  (the search cannot tell them apart) and the most accurate of them wins.
* **Mixed precision** (``--quant-type mixed``): every insertion point chooses ``none`` or one
  of the runtime's quant types (TensorRT: int8/fp8, ONNX Runtime: uint8/int8). Our sampler
  sees ``IntDistribution(0, n-1)`` (study attrs ``qdq_num_choices``, ``qdq_choice_names``);
  samplers with categorical parameters see the names. A study attr ``committed`` holds the
  chosen index per point (0 = no Q/DQ) in every mode.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import optuna

from .accuracy import ERROR_MEASURES
from .errors import OptionError, UserError
from .graph import Use
from .insertion.points import PatternPoints
from .storage import MeasurementCache

log = logging.getLogger("qdq_optuna")

OBJECTIVES = ("latency", "error")
METRIC_NAMES = {"latency": "latency_ms", "error": "error"}
NONE = "none"
#: samplers that take categorical parameters (mixed precision with choice names)
CATEGORICAL_SAMPLERS = ("tpe", "random", "nsga2", "bruteforce")
#: samplers that cannot handle two objectives
SINGLE_OBJECTIVE_SAMPLERS = ("cmaes",)
#: samplers that ignore Optuna trial constraints (the commit still takes feasible trials only)
UNCONSTRAINED_SAMPLERS = ("cmaes", "random", "bruteforce")


def parse_objectives(spec: str | Sequence[str] | None) -> tuple[str, ...]:
    """``"latency"`` or ``"latency,error"`` (latency always first: it drives the commit)."""
    if spec is None:
        return ("latency",)
    names = [s.strip() for s in spec.split(",")] if isinstance(spec, str) else list(spec)
    names = [n for n in names if n]
    bad = [n for n in names if n not in OBJECTIVES]
    if bad or not names or len(set(names)) != len(names) or names[0] != "latency":
        raise OptionError(
            f"--objectives {','.join(map(str, names)) or spec!r}: expected latency or "
            "latency,error"
        )
    return tuple(names)


def check_error_options(error_measure: str, max_output_error: float | None) -> None:
    if error_measure not in ERROR_MEASURES:
        raise OptionError(
            f"--error-measure: unknown {error_measure!r} (choose {', '.join(ERROR_MEASURES)})"
        )
    if max_output_error is not None:
        try:
            ok = float(max_output_error) > 0 and math.isfinite(float(max_output_error))
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise OptionError(
                f"--max-output-error must be a positive number, got {max_output_error!r}"
            )


def check_sampler(sampler: str, *, multi_objective: bool, mixed: bool,
                  constrained: bool) -> None:
    """Clear errors for sampler/mode combinations that cannot work."""
    if mixed and sampler not in ("qdq", *CATEGORICAL_SAMPLERS):
        raise OptionError(
            f"--quant-type mixed needs categorical parameters; --sampler {sampler} has none "
            f"(use qdq, {', '.join(CATEGORICAL_SAMPLERS[:-1])} or {CATEGORICAL_SAMPLERS[-1]})"
        )
    if multi_objective and sampler in SINGLE_OBJECTIVE_SAMPLERS:
        raise OptionError(
            f"--objectives latency,error: --sampler {sampler} supports one objective only "
            "(use qdq or nsga2)"
        )
    if constrained and sampler in UNCONSTRAINED_SAMPLERS:
        log.warning("--sampler %s ignores the --max-output-error constraint while sampling; "
                    "the commit still takes feasible trials only", sampler)


# -- precision choices ---------------------------------------------------------------------------
@dataclass(frozen=True)
class ChoiceSpace:
    """The values one insertion point can take: ``none`` then quant types.

    ``categorical`` samplers get the names; ours gets indices. Either way
    :meth:`index` turns a trial's parameter value into the index (0 = no Q/DQ).
    """

    types: tuple[str, ...]
    categorical: bool = False

    @property
    def names(self) -> tuple[str, ...]:
        return (NONE, *self.types)

    @property
    def n(self) -> int:
        return len(self.names)

    @property
    def mixed(self) -> bool:
        return len(self.types) > 1

    def suggest(self, trial: optuna.Trial, pid: str) -> int:
        if self.categorical and self.mixed:
            return self.names.index(trial.suggest_categorical(pid, list(self.names)))
        return int(trial.suggest_int(pid, 0, self.n - 1))

    def index(self, value) -> int:
        if isinstance(value, str):
            if value not in self.names:
                raise ValueError(f"unknown precision choice {value!r} (choices {self.names})")
            return self.names.index(value)
        i = int(value)
        if not 0 <= i < self.n:
            raise ValueError(f"precision choice {i} outside 0..{self.n - 1}")
        return i

    def indices(self, params: Mapping[str, object], ids: Iterable[str]) -> dict[str, int]:
        """Index per point; a point missing from ``params`` is off."""
        return {pid: self.index(params[pid]) if pid in params else 0 for pid in ids}

    def value(self, index: int):
        """The parameter value a sampler of this space uses for ``index`` (seeds)."""
        return self.names[index] if self.categorical and self.mixed else int(index)

    def seed(self, params01: Mapping[str, int]) -> dict:
        """An on/off seed (pattern cache, Q/DQ baseline, empty scheme) in this space: on is the
        first (default) quant type."""
        return {pid: self.value(1 if v else 0) for pid, v in params01.items()}

    def typed_uses(self, pp: PatternPoints, params: Mapping[str, object]) -> dict[Use, str]:
        """Covered uses -> quant type. Points are applied in the pattern's point order; a use
        that two points cover with different types keeps the first point's type."""
        out: dict[Use, str] = {}
        for pid in pp.ids:
            i = self.index(params[pid]) if pid in params else 0
            if i == 0:
                continue
            for use in pp.uses([pid]):
                out.setdefault(use, self.types[i - 1])
        return out

    def on(self, params: Mapping[str, object]) -> list[str]:
        return [p for p, v in params.items() if self.index(v) != 0]

    def study_attrs(self) -> dict:
        if not self.mixed:
            return {}
        return {"qdq_num_choices": self.n, "qdq_choice_names": list(self.names)}

    def describe(self, params: Mapping[str, object]) -> dict[str, str]:
        """Point -> chosen quant type, for points that are on."""
        return {p: self.names[self.index(v)] for p, v in params.items() if self.index(v) != 0}


def combine(base: Mapping[Use, str], typed: Mapping[Use, str]) -> dict[Use, str]:
    """A pattern's uses on top of the committed ones. A use an earlier pattern committed keeps
    its type (a region-output point and the next pattern's input point can cover the same
    use): commits are never changed by later patterns, as with on/off schemes."""
    return {**typed, **base}


# -- errors ----------------------------------------------------------------------------------------
class ErrorCache(MeasurementCache):
    """Plan key -> output errors, in the run study's user attrs (shared by workers)."""

    PREFIX = "error:"


def error_record(error: float, details: Mapping) -> dict:
    """JSON-safe error record (inf becomes a large number Optuna and JSON both accept)."""
    def clean(x: float) -> float:
        return float(x) if math.isfinite(float(x)) else 1e30

    outputs = {name: {k: clean(v) for k, v in e.items()}
               for name, e in details.get("outputs", {}).items()}
    rec = {"error": clean(error), "output_errors": outputs}
    for k in ("worst_cosine", "worst_relative_l2", "worst_max_abs", "metric"):
        if k in details:
            rec[k] = clean(details[k])
    return rec


# -- commit choice ------------------------------------------------------------------------------
def feasible(trial: optuna.trial.FrozenTrial) -> bool:
    return all(v <= 0 for v in trial.constraints.values())


def pareto_indices(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the non-dominated points (minimize both), in input order."""
    out = []
    for i, (a0, a1) in enumerate(points):
        dominated = any(
            (b0 <= a0 and b1 <= a1) and (b0 < a0 or b1 < a1)
            for j, (b0, b1) in enumerate(points) if j != i
        )
        if not dominated:
            out.append(i)
    return out


def choose_candidate(
    trials: Sequence[optuna.trial.FrozenTrial], *, multi_objective: bool, constrained: bool,
    threshold: float,
) -> tuple[optuna.trial.FrozenTrial | None, str]:
    """The trial a pattern tries to commit (before the confirming re-measurement), and why.

    Single objective: the fastest trial (feasible ones only under a budget). Two objectives:
    among the Pareto-optimal (feasible) trials, those within ``threshold`` of the fastest latency
    count as equally fast and the one with the lowest error is taken.
    """
    pool = [t for t in trials if t.values is not None]
    if constrained:
        pool = [t for t in pool if feasible(t)]
        if not pool:
            return None, "no trial met the error budget"
    if not pool:
        return None, "no trial finished"
    if not multi_objective:
        return min(pool, key=lambda t: (t.values[0], t.number)), "fastest" + (
            " feasible" if constrained else "")
    front = [pool[i] for i in pareto_indices([(t.values[0], t.values[1]) for t in pool])]
    fastest = min(t.values[0] for t in front)
    near = [t for t in front if t.values[0] <= fastest * threshold]
    best = min(near, key=lambda t: (t.values[1], t.values[0], t.number))
    return best, (f"most accurate of {len(near)} Pareto point(s) within {threshold}x of the "
                  f"fastest ({len(front)} on the front)")


def chain_order(rows: Sequence[Mapping]) -> list[Mapping]:
    """Patterns with a non-empty commit, ordered by latency gain per error added.

    ``rows`` are pattern study attrs. Gain is ``log(gain)`` of the confirmed commit, the error
    added is ``committed_error - reference_error`` (both whole-model errors measured during the
    search); patterns that add no error come first, fastest gain first.
    """
    picked = []
    for r in rows:
        if not any(int(v) for v in r.get("committed", {}).values()):
            continue
        gain = math.log(max(float(r.get("gain", 1.0)), 1.0 + 1e-9))
        added = float(r.get("committed_error", 0.0)) - float(r.get("reference_error", 0.0))
        picked.append((added <= 0, gain / max(added, 1e-12), int(r.get("order", 0)), r))
    picked.sort(key=lambda x: (not x[0], -x[1], x[2]))
    return [r for *_, r in picked]


# -- scoring trials -----------------------------------------------------------------------------
def validation_data(model, *, validation: str | None, calibration_data: str | None,
                    input_shapes: Mapping | None, samples: int = 8) -> tuple[dict, str]:
    """The data trials are scored on, and an id for fingerprints: ``--validation-data``, else the
    calibration data, else random inputs (with a warning: errors on noise are only a sanity
    check)."""
    from . import calibration
    from .search import _sha_file

    path = validation or calibration_data
    if path:
        option = "--validation-data" if validation else "--calibration-data"
        try:
            data = calibration.load_calibration_data(path, model)
        except UserError as exc:
            raise type(exc)(f"{option}: {exc}") from exc
        return data, f"{option}:{_sha_file(path)}"
    log.warning("no --validation-data or --calibration-data: output errors are measured on "
                "random inputs (a sanity check only; pass real data for meaningful errors)")
    data = calibration.random_calibration_data(model, input_shapes or None, samples=samples,
                                               seed=1)
    return data, f"random:{samples}:1"


class ErrorScorer:
    """Output errors of exported plans against the FP32 model, cached by plan key.

    ``optimize``: run candidates with ONNX Runtime's full graph optimizations (its fused integer
    kernels, what an ONNX Runtime deployment runs) or with none (the ONNX semantics of the Q/DQ
    model: the better proxy for TensorRT, and the only correct one for FP8, see
    :func:`qdq_optuna.accuracy.run_model`).
    """

    def __init__(self, reference: bytes, data: Mapping, *, metric: str | None,
                 error_measure: str, optimize: bool, run_study: optuna.Study | None) -> None:
        from .accuracy import AccuracyEvaluator

        self.evaluator = AccuracyEvaluator(reference, data, metric=metric,
                                           error_measure=error_measure, optimize=optimize)
        self.cache = ErrorCache(run_study) if run_study is not None else None
        self.evaluations = 0

    def score(self, exporter, plan) -> dict:
        if self.cache is not None:
            hit = self.cache.get(plan.key)
            if hit is not None:
                return dict(hit)
        record = self.score_bytes(exporter.to_bytes(plan))
        if self.cache is not None:
            self.cache.put(plan.key, record)
        return record

    def score_bytes(self, data: bytes) -> dict:
        self.evaluations += 1
        error, details = self.evaluator.evaluate(data)
        return error_record(error, details)
