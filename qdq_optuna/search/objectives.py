"""What a trial is scored on besides latency, and which trial a pattern tries to commit.

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
  of the runtime's quant types (TensorRT: int8/fp8, ONNX Runtime: uint8/int8); the choices are
  a :class:`~qdq_optuna.placement.scheme.ChoiceSpace`. Samplers with categorical parameters see the
  names, so only some samplers can search it (:func:`check_sampler`).

The errors themselves are measured by :class:`qdq_optuna.measure.accuracy.ErrorScorer`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import optuna

from qdq_optuna.errors import OptionError
from qdq_optuna.measure.accuracy import ERROR_MEASURES
from qdq_optuna.search.samplers import (
    CATEGORICAL_SAMPLERS,
    SamplerArg,
    sampler_name,
    sampler_traits,
)

log = logging.getLogger("qdq_optuna")

OBJECTIVES = ("latency", "error")
METRIC_NAMES = {"latency": "latency_ms", "error": "error"}


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


def check_metric_drop(max_drop, metric, max_output_error) -> None:
    """``--max-metric-drop`` bounds the drop of ``--metric``: it needs one, a positive number
    and no second bound beside it (``--metric-drop-type`` is a
    :class:`~qdq_optuna.measure.accuracy.DropType`)."""
    if max_drop is None:
        return
    try:
        ok = float(max_drop) > 0 and math.isfinite(float(max_drop))
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise OptionError(f"--max-metric-drop must be a positive number, got {max_drop!r}")
    if metric is None:
        raise OptionError("--max-metric-drop needs --metric (the function whose drop it bounds)")
    if max_output_error is not None:
        raise OptionError("--max-metric-drop and --max-output-error are two bounds on one "
                          "metric: give one")


def check_sampler(given: SamplerArg, *, multi_objective: bool, mixed: bool,
                  constrained: bool) -> None:
    """Clear errors for sampler/mode combinations that cannot work."""
    traits, sampler = sampler_traits(given), sampler_name(given)
    if traits is None:
        return  # unknown names are refused where the sampler is made
    if mixed and not traits.categorical:
        raise OptionError(
            f"--quant-type mixed needs categorical parameters; --sampler {sampler} has none "
            f"(use qdq, {', '.join(CATEGORICAL_SAMPLERS[:-1])} or {CATEGORICAL_SAMPLERS[-1]})"
        )
    if multi_objective and not traits.multi_objective:
        raise OptionError(
            f"--objectives latency,error: --sampler {sampler} supports one objective only "
            "(use qdq or nsga2)"
        )
    if constrained and not traits.constrained:
        log.warning("--sampler %s ignores the --max-output-error constraint while sampling; "
                    "the commit still takes feasible trials only", sampler)


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
