"""The move engine: a visit's moves proposed by the sampler, in order, and the visit ended."""

from __future__ import annotations

from typing import Any

import optuna
from optuna.trial import TrialState

from .. import VISIT_ATTR, MoveStats, QDQMutationSampler, Visit, VisitSpec

optuna.logging.set_verbosity(optuna.logging.WARNING)

POINTS = ["a", "b", "c", "d"]


def _visit_attr(**over: Any) -> dict:
    attr = {
        "standing": {"a": 0, "b": 0, "c": 1, "d": 0},
        "foreign": {"P9:x": 0},
        "edges": {"a": [["Conv", "Relu"]], "b": [["Relu", "Conv"]], "c": [["Conv", "Sigmoid"]],
                  "d": [["Add", "Concat"]], "P9:x": [["Add", "Concat"]]},
        "chains": [["P9:x", "d"]],
        "cache": None,
        "taught": {},
        "give_up_after": 0,
        "sites": None,
    }
    attr.update(over)
    return attr


def test_a_visit_spec_is_the_attr_it_writes_and_reads() -> None:
    """The descent writes a VisitSpec's attr, the engine reads the same spec back; a spec and
    its stored attr make the same moves."""
    attr = _visit_attr(sites={"a": {"t": 4}, "b": {}, "c": {}, "d": {}, "P9:x": {}},
                       settled=["c"], added={"a": 3, "b": -1, "c": 0, "d": 0, "P9:x": 0},
                       min_share=0.01, total=100, prior={"on:Conv>Relu": [2, 0]})
    spec = VisitSpec.from_attr(attr)
    assert spec.to_attr() == attr and VisitSpec.from_attr(spec.to_attr()) == spec
    assert "prior" not in VisitSpec(standing={"a": 0}).to_attr()
    assert "min_share" not in VisitSpec(standing={"a": 0}).to_attr()
    by_spec, dropped = Visit(spec, POINTS, [["a", "b"]]).moves()
    by_attr, dropped_too = Visit(attr, POINTS, [["a", "b"]]).moves()
    assert by_spec == by_attr and dropped == dropped_too and by_spec


def _study(attr: dict, sampler: QDQMutationSampler | None = None) -> optuna.Study:
    study = optuna.create_study(sampler=sampler or QDQMutationSampler(
        seed=0, seed_empty_scheme=False, seed_full_scheme=False))
    study.set_user_attr("qdq_points", POINTS)
    study.set_user_attr("qdq_fusion_groups", [["a", "b"]])
    study.set_user_attr(VISIT_ATTR, attr)
    study.enqueue_trial(attr["standing"])  # the start: the standing scheme
    return study


def _latency(trial: optuna.Trial) -> float:
    x = {p: trial.suggest_int(p, 0, 1) for p in POINTS}
    # the fusion group pays only whole; c costs; d alone changes nothing
    return 10.0 - 3.0 * (x["a"] and x["b"]) + 0.5 * x["a"] + 2.0 * x["c"]


def test_the_sampler_proposes_the_visits_moves_and_ends_it() -> None:
    study = _study(_visit_attr())
    study.optimize(_latency, n_trials=50)
    trials = study.get_trials(deepcopy=False)
    assert len(trials) < 50, "the sampler stops the study when its moves are done"
    assert [bool(t.system_attrs.get("fixed_params")) for t in trials] == \
        [True] + [False] * (len(trials) - 1), "no move is enqueued"
    moves, _ = Visit(_visit_attr(), POINTS, [["a", "b"]]).moves()
    records = [t.system_attrs["qdq:visit_move"] for t in trials[1:]]
    assert [r["index"] for r in records] == sorted(r["index"] for r in records)
    assert [r["kind"] for r in records] == [moves[r["index"]].kind for r in records]
    # the fusion group on, and c off: the best scheme
    assert study.best_trial.params == {"a": 1, "b": 1, "c": 0, "d": 0}
    # a chain move sets the other pattern's point too, recorded for the caller
    chain = [r for r in records if r["kind"] == "chain"]
    assert chain and chain[0]["foreign"] == {"P9:x": 1}


def test_moves_apply_to_the_best_scheme_so_far() -> None:
    study = _study(_visit_attr())
    study.optimize(_latency, n_trials=50)
    trials = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    fusion_on = next(t for t in trials if t.params["a"] and t.params["b"])
    later = [t for t in trials if t.number > fusion_on.number]
    assert later and all(t.params["a"] == 1 and t.params["b"] == 1 for t in later
                         if t.system_attrs["qdq:visit_move"]["kind"] != "fusion")


def test_moves_that_only_remove_fused_qdq_are_not_proposed() -> None:
    # c's Q/DQ was fused (no site); removing d alone touches too little to measure
    sites = {"a": {"ta": 50}, "b": {"tb": 50}, "d": {"td": 1}, "P9:x": {"td": 1}}
    every, _ = Visit(_visit_attr(), POINTS, [["a", "b"]]).moves()
    kept, dropped = Visit(_visit_attr(sites=sites), POINTS, [["a", "b"]]).moves()
    assert dropped == {"fused": 1} and len(kept) == len(every) - 1
    assert not any(m.off == frozenset({"c"}) and not m.on for m in kept)
    small = _visit_attr(sites=sites, min_share=0.05, total=100, standing={**_visit_attr()[
        "standing"], "d": 1})
    kept, dropped = Visit(small, POINTS, [["a", "b"]]).moves()
    assert dropped == {"fused": 1, "too small": 1}
    study = _study(_visit_attr(sites=sites))
    study.optimize(_latency, n_trials=50)
    assert all(t.params["c"] == 1 for t in study.get_trials(deepcopy=False))


def test_what_earlier_visits_taught_orders_the_moves() -> None:
    plain, _ = Visit(_visit_attr(), POINTS, [["a", "b"]]).moves()
    single_c = next(m for m in plain if m.off == frozenset({"c"}))
    taught = {"|".join(single_c.signature): [3, 3]}
    moves, _ = Visit(_visit_attr(taught=taught), POINTS, [["a", "b"]]).moves()
    assert moves[0] == single_c and plain[0] != single_c


def test_a_signature_that_never_paid_is_given_up() -> None:
    plain, _ = Visit(_visit_attr(), POINTS, [["a", "b"]]).moves()
    single_c = next(m for m in plain if m.off == frozenset({"c"}))
    attr = _visit_attr(taught={"|".join(single_c.signature): [2, 0]}, give_up_after=2)
    study = _study(attr)
    study.optimize(_latency, n_trials=50)
    assert all(t.params["c"] == 1 for t in study.get_trials(deepcopy=False))


def test_what_earlier_lanes_taught_gives_a_signature_up_sooner() -> None:
    """A signature that failed 3 times in an earlier lane (``prior``) and never paid there is
    given up after 2 failures in this lane, not 3; one that paid there keeps the full 3."""
    plain, _ = Visit(_visit_attr(), POINTS, [["a", "b"]]).moves()
    key = "|".join(next(m for m in plain if m.off == frozenset({"c"})).signature)

    def tried_c(**over: Any) -> bool:
        attr = _visit_attr(taught={key: [2, 0]}, give_up_after=3, **over)
        study = _study(attr)
        study.optimize(_latency, n_trials=50)
        return any(t.params["c"] == 0 for t in study.get_trials(deepcopy=False))

    assert tried_c()  # 2 failures of 3: tried once more
    assert not tried_c(prior={key: [3, 0]})  # 3 failures elsewhere: one fewer needed here
    assert tried_c(prior={key: [3, 1]})  # it paid elsewhere: no sooner
    assert tried_c(prior={key: [2, 0]})  # under 3 failures elsewhere: no sooner
    stats = MoveStats(3, {key: [9, 0]})
    assert stats.need(key) == 2, "never before 2 failures in the lane itself"


def test_ask_and_tell_drive_a_visit_too() -> None:
    sampler = QDQMutationSampler(seed=0, seed_empty_scheme=False, seed_full_scheme=False)
    study = _study(_visit_attr(), sampler)
    for _ in range(50):
        found = sampler.next_move(study)
        waiting = study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
        if not waiting and found.move is None:
            break
        trial = study.ask()
        study.tell(trial, _latency(trial))
    else:
        raise AssertionError("the visit did not end")
    assert study.best_trial.params == {"a": 1, "b": 1, "c": 0, "d": 0}
