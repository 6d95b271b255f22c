"""A model-level latency/error front after a two-objective run (``--objectives latency,error``),
measured at the end of the conclusion (:func:`with_measured_front`); the outputs word and write it.

Every pattern ends with one committed scheme; combining every pattern's Pareto points is
exponential, so the front is a *greedy chain*: start from the FP32 model and add the patterns'
committed schemes one at a time, in order of latency gain per error added (as measured during
the search, see :func:`chain_order`). Each prefix of the chain is exported and measured again
as a whole model: latency by an interleaved A/B against FP32 (like the final figure), error on
the validation data. The chain is a heuristic: it is not the exact front over all
combinations, but every point is a real, measured model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from qdq_optuna.placement.scheme import combine
from qdq_optuna.record import FRONT_PHASE, PatternStanding, RunRecord
from qdq_optuna.search._outcome import FrontPoint
from qdq_optuna.search.objectives import pareto_indices

if TYPE_CHECKING:  # the outcome the front is measured for (annotations only)
    from qdq_optuna.search._outcome import SearchOutcome


def chain_order(rows: Sequence[PatternStanding]) -> list[PatternStanding]:
    """Patterns with a non-empty commit, ordered by latency gain per error added.

    Gain is ``log(gain)`` of the confirmed commits, the error added is ``committed_error -
    reference_error`` of the pattern's last visit (both whole-model errors measured during the
    search); patterns that add no error come first, fastest gain first.
    """
    picked = []
    for r in rows:
        if not any(int(v) for v in r.scheme.values()):
            continue
        last = r.last
        gain = math.log(max(float(r.gain), 1.0 + 1e-9))
        added = (_or_zero(last and last.committed_error) - _or_zero(last and last.reference_error))
        picked.append((added <= 0, gain / max(added, 1e-12), int(last.order if last else 0), r))
    picked.sort(key=lambda x: (not x[0], -x[1], x[2]))
    return [r for *_, r in picked]


def _or_zero(value: float | None) -> float:
    return float(value) if value is not None else 0.0


def chain_steps(record: RunRecord, rows: list[PatternStanding]) -> list[tuple[list[str], dict]]:
    """The chain's prefixes: (patterns added, their typed uses), FP32 first."""
    by_id = {pp.pattern.id: pp for pp in record.tunable}
    steps: list[tuple[list[str], dict]] = [([], {})]
    added: list[str] = []
    for r in chain_order(rows):
        if r.pattern_id not in by_id:
            continue
        added = [*added, r.pattern_id]
        uses: dict = {}
        for row in rows:  # in pattern order, as the search combined them
            if row.pattern_id in added:
                uses = combine(uses, record.space.typed_uses(by_id[row.pattern_id], row.scheme))
        steps.append((added, uses))
    return steps


def measure_front(outcome: SearchOutcome) -> list[FrontPoint]:
    """Every prefix of the chain of ``outcome``'s shipped lane, measured with its plan
    measurer (the shipped model's A/B is reused), the non-dominated ones marked."""
    o, plans, exporter = outcome, outcome.plans, outcome.exporter
    fp32_ms = o.comparison.reference.score_ms
    points: list[FrontPoint] = []
    for i, (patterns, step_uses) in enumerate(chain_steps(o.record, o.rows)):
        plan = exporter.plan(step_uses)
        data = exporter.to_bytes(plan)
        if not patterns:
            ratio, ci = 1.0, (1.0, 1.0)
        elif plan.key == o.plan.key:  # the optimized model: measured just before
            ratio, ci = o.comparison.ratio, (o.comparison.ci_low, o.comparison.ci_high)
        else:
            cmp = plans.compare(data, o.baseline_bytes, FRONT_PHASE)
            ratio, ci = cmp.ratio, (cmp.ci_low, cmp.ci_high)
        err = plans.error(exporter, plan)
        points.append(FrontPoint(
            index=i, patterns=list(patterns), latency_ms=fp32_ms * ratio,
            speedup=1.0 / ratio if ratio > 0 else None,
            speedup_ci=[1.0 / ci[1] if ci[1] > 0 else None, 1.0 / ci[0] if ci[0] > 0 else None],
            error=err["error"], worst_cosine=err.get("worst_cosine"),
            worst_relative_l2=err.get("worst_relative_l2"), plan=plan))
    for i in pareto_indices([(p.latency_ms, p.error) for p in points]):
        points[i].on_front = True
    return points


def with_measured_front(outcome: SearchOutcome) -> SearchOutcome:
    """``outcome`` with its front measured when the run has two objectives (the conclusion's
    last measurements; its counters were taken before them)."""
    if outcome.multi_objective:
        outcome.front = measure_front(outcome)
    return outcome
