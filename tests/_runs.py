"""What a finished run of the whole-model search must contain, checked from its storage."""

from __future__ import annotations

import optuna
from optuna.trial import TrialState

from qdq_optuna.record import is_visit, visit_problems

__all__ = ["check_visit", "is_visit", "standing_schemes"]


def check_visit(name: str, study: optuna.Study, budget: int,
                repeats: bool = False) -> list[optuna.trial.FrozenTrial]:
    """The rules of a decided visit (``qdq_optuna.record.visit_problems``) as an assertion;
    returns its finished trials."""
    problems = visit_problems(name, study, budget, repeats)
    assert not problems, problems
    return study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))


def standing_schemes(study_attrs: list[dict], lane: str = "") -> list[tuple[dict, dict]]:
    """Per pattern: the attrs of its last decided visit in ``lane`` (report.json's ``lane``:
    the lane whose standing model was saved) and the scheme that stands after replaying every
    decided visit of the lane in order (a chain move's partner schemes included), from the
    user attrs of a run's studies (in any order; every pattern is visited in round 1, so the
    lane's start is covered)."""
    visits = sorted((a for a in study_attrs if a.get("round") and a.get("lane", "") == lane),
                    key=lambda a: a["order"])
    schemes: dict[str, dict] = {}
    last: dict[str, dict] = {}
    for a in visits:
        assert "committed" in a, f"{a.get('pattern_id')} round {a.get('round')}: not committed"
        schemes[a["pattern_id"]] = a["committed"]
        for pid, scheme in (a.get("partner") or {}).items():
            schemes[pid] = scheme
        last[a["pattern_id"]] = a
    return sorted(((last[p], schemes[p]) for p in last), key=lambda pair: pair[0]["pattern_id"])
