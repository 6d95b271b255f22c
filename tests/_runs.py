"""What a finished run of the whole-model search must contain, checked from its storage."""

from __future__ import annotations

import optuna
from optuna.trial import TrialState

DUPLICATE = "qdq:duplicate"


def is_visit(study_key: str) -> bool:
    """A descent visit's study (``P003/round1``, ``P003/recipe/round2``), by its name after
    ``RUN/``."""
    return "/round" in study_key


def visit_cap(attrs: dict, budget: int) -> int:
    """A visit's budget: its moves and the standing scheme, at least twice its points, at most
    ``budget`` (``--schemes-per-region``)."""
    return min(budget, max(int(attrs.get("moves", 0)) + 1, 2 * len(attrs["qdq_points"])))


def check_visit(name: str, study: optuna.Study, budget: int,
                repeats: bool = False) -> list[optuna.trial.FrozenTrial]:
    """The invariants of a decided visit: within its budget, no model measured twice, its
    first trial the standing scheme (free), decided, nothing left running. Returns its
    finished trials. ``repeats``: the sampler may propose a model again (Optuna's samplers);
    the repeat is then answered without a measurement."""
    attrs = study.user_attrs
    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    assert 1 <= len(done) <= visit_cap(attrs, budget), (name, len(done), visit_cap(attrs, budget))
    keys = [t.user_attrs["plan_key"] for t in done if not t.system_attrs.get(DUPLICATE)
            and (not repeats or t.user_attrs.get("measurements", 1))]
    assert len(keys) == len(set(keys)), f"{name}: a model was measured twice"
    first = min(study.get_trials(deepcopy=False), key=lambda t: t.number)
    assert first.user_attrs.get("move") == "start", name
    assert "committed" in attrs, name
    assert not study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)), name
    return done


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
