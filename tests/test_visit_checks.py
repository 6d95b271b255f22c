"""``qdq_optuna.record.visit_problems``: the rules every decided visit must hold, shared by the
tests (``_runs.check_visit``) and the worker-race benchmark; each rule is shown to fail here on
a study in a real SQLite storage."""

from __future__ import annotations

import optuna
import pytest
from optuna.trial import TrialState

from qdq_optuna.record import (
    PatternAttr,
    SystemAttr,
    TrialAttr,
    is_visit,
    open_storage,
    set_trial_system_attr,
    visit_cap,
    visit_problems,
)


def _visit(tmp_path, trials: list[tuple[dict, TrialState]], committed: bool = True):
    storage = open_storage(f"sqlite:///{tmp_path}/run.db", heartbeat=False)
    study = optuna.create_study(study_name="RUN/P001/round1", storage=storage)
    study.set_user_attr(PatternAttr.POINTS, ["a", "b"])
    study.set_user_attr(PatternAttr.MOVES, 2)
    if committed:
        study.set_user_attr(PatternAttr.COMMITTED, True)
    for attrs, state in trials:
        trial = study.ask()
        for key, value in attrs.items():
            if key == SystemAttr.DUPLICATE:  # our sampler's mark, a system attr
                set_trial_system_attr(study, trial, key, value)
            else:
                trial.set_user_attr(key, value)
        if state == TrialState.COMPLETE:
            study.tell(trial, 1.0)
    return study


def _trial(key: str, move: str = "flip", **attrs) -> tuple[dict, TrialState]:
    return {TrialAttr.PLAN_KEY: key, TrialAttr.MOVE: move, **attrs}, TrialState.COMPLETE


def test_a_visit_that_keeps_the_rules_has_no_problem(tmp_path):
    study = _visit(tmp_path, [_trial("k0", "start"), _trial("k1"),
                              _trial("k1", **{SystemAttr.DUPLICATE: True})])
    assert visit_problems("P001/round1", study, budget=30) == []


@pytest.mark.parametrize("case, expected", [
    ("twice", "a model was measured twice"),
    ("not_start", "first trial is not the standing scheme"),
    ("undecided", "not decided"),
    ("running", "still running"),
    ("over_budget", "its budget is 4"),
])
def test_each_broken_rule_is_named(tmp_path, case, expected):
    trials = [_trial("k0", "start"), _trial("k1")]
    if case == "twice":
        trials.append(_trial("k1"))
    if case == "not_start":
        trials[0] = _trial("k0")
    if case == "running":
        trials.append(({TrialAttr.PLAN_KEY: "k2"}, TrialState.RUNNING))
    if case == "over_budget":
        trials += [_trial(f"k{i}") for i in range(2, 5)]
    study = _visit(tmp_path, trials, committed=case != "undecided")
    problems = visit_problems("P001/round1", study, budget=30)
    assert len(problems) == 1 and expected in problems[0], problems


def test_repeats_answered_without_a_measurement_are_no_second_measurement(tmp_path):
    study = _visit(tmp_path, [_trial("k0", "start"), _trial("k1"),
                              _trial("k1", **{TrialAttr.MEASUREMENTS: 0})])
    assert visit_problems("P001/round1", study, budget=30, repeats=True) == []
    assert visit_problems("P001/round1", study, budget=30) != []


def test_visits_and_their_cap():
    assert is_visit("P003/round1") and is_visit("P003/recipe/round2")
    assert not is_visit("P003") and not is_visit("_starts")
    assert visit_cap({PatternAttr.POINTS: ["a"], PatternAttr.MOVES: 7}, 30) == 8
    assert visit_cap({PatternAttr.POINTS: ["a"] * 10}, 30) == 20
    assert visit_cap({PatternAttr.POINTS: ["a"] * 10}, 6) == 6
