"""Which Q/DQ pairs break a model: the search-independent half of the accuracy guard.

A quantized model whose output error exceeds a bound is usually broken by very few pairs (an
activation with a heavy tail that calibration gives a coarse scale, so most of its values
round to zero). :func:`bisect_plan` names them with few evaluations: delta debugging
(Zeller's ddmin) over the plan's quantized activation tensors finds a 1-minimal set whose
removal brings the plan within the bound. With one culprit among n tensors that takes about
2 log2(n) evaluations; errors that only add up to too much give a set that removes just enough.

The unit is an activation tensor's Q/DQ (with the consumers the plan gives it); the weights
that come with an activation's consumers come and go with it, as in every plan.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from qdq_optuna.placement.export import QDQExporter, QuantPlan

PlanError = Callable[[QuantPlan], float]


@dataclass
class Bisection:
    """What :func:`bisect_plan` found."""

    #: activation tensors whose Q/DQ break the bound, in the order they were found
    responsible: list[str]
    #: the plan without them (within the bound, unless even the float model is not)
    kept: QuantPlan
    #: error of ``kept``, and of the plan as given
    error: float
    full_error: float
    bound: float
    evaluations: int
    #: error of every plan evaluated, by its tensors (for reports)
    tried: dict[tuple[str, ...], float] = field(default_factory=dict, repr=False)

    @property
    def within(self) -> bool:
        """Whether ``kept`` is within the bound."""
        return self.error <= self.bound


def sub_plan(exporter: QDQExporter, plan: QuantPlan, tensors: Iterable[str]) -> QuantPlan:
    """``plan`` with only the Q/DQ of ``tensors`` (each with its consumers and type)."""
    keep = set(tensors)
    uses = {(t, n, s): q for t, consumers, q in plan.activations if t in keep
            for n, s in consumers}
    return exporter.plan(uses)


def plan_error_function(exporter: QDQExporter, evaluator) -> PlanError:
    """``plan -> error`` through an :class:`qdq_optuna.measure.accuracy.AccuracyEvaluator` (FP32
    reference outputs computed once, candidates run in ONNX Runtime)."""
    def error(plan: QuantPlan) -> float:
        return float(evaluator.evaluate(exporter.to_bytes(plan))[0])

    return error


def bisect_plan(exporter: QDQExporter, plan: QuantPlan, error_fn: PlanError, bound: float,
                *, max_evaluations: int = 64) -> Bisection:
    """Name the activation tensors of ``plan`` whose Q/DQ push ``error_fn`` above ``bound``.

    ``error_fn(plan) -> float`` (lower is better; NaN counts as broken). Returns a 1-minimal
    set of tensors whose removal brings the plan within the bound (dropping any one of them
    from the set would not) and the plan without them; nothing is responsible when the plan
    is within the bound. After ``max_evaluations`` evaluations the set found so far is
    returned: still a fix, maybe not a minimal one."""
    tried: dict[tuple[str, ...], float] = {}
    tensors = sorted(plan.tensors)

    def err(kept: Sequence[str]) -> float:
        key = tuple(sorted(kept))
        if key not in tried:
            value = error_fn(sub_plan(exporter, plan, key))
            tried[key] = math.inf if math.isnan(value) else value
        return tried[key]

    def fixes(removed: Sequence[str]) -> bool:
        gone = set(removed)
        return err([t for t in tensors if t not in gone]) <= bound

    full = err(tensors)
    if full <= bound or not tensors:
        responsible: list[str] = []
    elif not fixes(tensors):  # not even the float model is within the bound
        responsible = tensors
    else:
        responsible = _ddmin(tensors, fixes, lambda: len(tried) < max_evaluations)
    kept = [t for t in tensors if t not in set(responsible)]
    return Bisection(responsible, sub_plan(exporter, plan, kept), err(kept), full, bound,
                     len(tried), tried)


def _ddmin(items: list[str], holds: Callable[[Sequence[str]], bool],
           budget_left: Callable[[], bool]) -> list[str]:
    """A 1-minimal subset of ``items`` for which ``holds`` (true of ``items`` itself): test
    chunks, then complements, refining the split when neither holds (Zeller's ddmin)."""
    n = 2
    while len(items) >= 2 and budget_left():
        chunks = _split(items, n)
        smaller = next((c for c in chunks if holds(c)), None)
        if smaller is not None:
            items, n = smaller, 2
            continue
        if n > 2:
            rest = next((r for c in chunks if holds(r := [t for t in items if t not in set(c)])),
                        None)
            if rest is not None:
                items, n = rest, max(n - 1, 2)
                continue
        if n >= len(items):
            break
        n = min(len(items), 2 * n)
    return items


def _split(items: list[str], n: int) -> list[list[str]]:
    size, extra = divmod(len(items), n)
    out, start = [], 0
    for k in range(n):
        end = start + size + (1 if k < extra else 0)
        out.append(items[start:end])
        start = end
    return [c for c in out if c]
