"""What every decided visit of a stored run must hold, read from its storage: within its
budget, no model measured twice, the standing scheme first, decided, nothing left running.

Why in the package: the tests check every finished run against these rules, and the
worker-race benchmark checks the runs that several processes wrote against the same ones.
"""

from __future__ import annotations

import optuna
from optuna.trial import TrialState

from qdq_optuna.record.schema import ROUND, PatternAttr, SystemAttr, TrialAttr


def is_visit(study_key: str) -> bool:
    """A descent visit's study (``P003/round1``, ``P003/recipe/round2``), by its name after
    ``RUN/``."""
    return f"/{ROUND}" in study_key


def visit_cap(attrs: dict, budget: int) -> int:
    """A visit's budget: its moves and the standing scheme, at least twice its points, at most
    ``budget`` (``--schemes-per-region``)."""
    moves = int(attrs.get(PatternAttr.MOVES, 0))
    return min(budget, max(moves + 1, 2 * len(attrs[PatternAttr.POINTS])))


def visit_problems(name: str, study: optuna.Study, budget: int,
                   repeats: bool = False) -> list[str]:
    """What breaks a decided visit's rules (empty: nothing). ``repeats``: the sampler may
    propose a model again (Optuna's samplers); the repeat is then answered without a
    measurement."""
    attrs = study.user_attrs
    trials = study.get_trials(deepcopy=False)
    done = [t for t in trials if t.state == TrialState.COMPLETE]
    cap = visit_cap(attrs, budget)
    problems = []
    if not 1 <= len(done) <= cap:
        problems.append(f"{name}: {len(done)} trials finished, its budget is {cap}")
    keys = [t.user_attrs[TrialAttr.PLAN_KEY] for t in done
            if not t.system_attrs.get(SystemAttr.DUPLICATE)
            and (not repeats or t.user_attrs.get(TrialAttr.MEASUREMENTS, 1))]
    if len(keys) != len(set(keys)):
        problems.append(f"{name}: a model was measured twice")
    if trials and min(trials, key=lambda t: t.number).user_attrs.get(TrialAttr.MOVE) != "start":
        problems.append(f"{name}: its first trial is not the standing scheme")
    if PatternAttr.COMMITTED not in attrs:
        problems.append(f"{name}: not decided")
    if any(t.state == TrialState.RUNNING for t in trials):
        problems.append(f"{name}: a trial is still running")
    return problems
