"""The commit rule: what a re-measurement must show before the standing model changes."""

from __future__ import annotations

import pytest

from qdq_optuna.measure.timing import Comparison
from qdq_optuna.search._commit import REMOVAL_MARGIN, CommitRule


def _cmp(ratio: float, lo: float, hi: float) -> Comparison:
    """candidate/standing ``ratio`` with its interval (the measurements themselves unused)."""
    return Comparison(ratio=ratio, ci_low=lo, ci_high=hi, candidate=None, reference=None,
                      rounds=12, decided=True)


@pytest.mark.parametrize(("ratio", "lo", "hi", "commits"), [
    (0.95, 0.93, 0.97, True),     # faster, and the interval says so
    (0.95, 0.85, 1.05, False),    # faster by the estimate only
    (1.02, 1.00, 1.04, False),    # slower
])
def test_an_addition_commits_when_the_interval_shows_a_gain(ratio, lo, hi, commits):
    rule = CommitRule(1.0)
    assert rule.confirmed(_cmp(ratio, lo, hi), rule.needed(False), False) is commits


@pytest.mark.parametrize(("ratio", "lo", "hi", "commits"), [
    (0.99, 0.98, 1.005, True),            # not slower, and at most 0.5 % slower at worst
    (0.957, 0.824, 1.11, False),          # "1.045x faster" within noise of 0.90-1.21x
    (1.0, 0.99, 1.0 + REMOVAL_MARGIN, True),
    (1.001, 0.995, 1.004, False),         # slower by the estimate
])
def test_a_removal_commits_on_a_measured_backend_only_when_no_loss_is_likely(ratio, lo, hi,
                                                                              commits):
    rule = CommitRule(1.0)
    assert rule.confirmed(_cmp(ratio, lo, hi), rule.needed(True), False, True) is commits


def test_a_removal_that_is_not_slower_commits_on_a_deterministic_backend():
    rule = CommitRule(1.02)
    assert rule.confirmed(_cmp(1.0, 1.0, 1.0), rule.needed(True), True, True)
    assert not rule.confirmed(_cmp(1.0001, 1.0001, 1.0001), rule.needed(True), True, True)
    assert "1%" in rule.describe(False) and "not slower" in rule.describe(True)


def test_the_requirement_a_decision_quotes_matches_the_rule():
    rule = CommitRule(1.02)
    measured = rule.requirement(True, rule.needed(True), deterministic=False)
    assert "must not be slower" in measured and f"{REMOVAL_MARGIN:.0%}" in measured
    assert rule.requirement(True, rule.needed(True), deterministic=True).endswith("not be slower")
    assert rule.requirement(False, 1.02, deterministic=True) == "it must be 1.02x faster"
    assert rule.requirement(False, 1.0, deterministic=False) == "any gain commits"


def _visit_with_trials(latencies: list[float]):
    """A real pattern study (the ask/tell Autotuner on a tiny model) whose trials, all
    distinct schemes that add Q/DQ, finished at ``latencies`` ms; the reference ran 10 ms."""
    from qdq_optuna import Autotuner
    from qdq_optuna.examples import zoo

    tuner = Autotuner(zoo.build("tiny_residual"), runtime="tensorrt", seed=0)
    index = max(range(len(tuner.patterns)), key=lambda i: len(tuner.patterns[i].ids))
    tuner.set_pattern(index)
    seen = set()
    while len(seen) < len(latencies):
        trial = tuner.generate()
        scheme = frozenset(tuner.scheme(trial))
        if not scheme or scheme in seen:
            tuner.submit(trial, 20.0)  # slower than every trial below: never a candidate
            continue
        tuner.submit(trial, latencies[len(seen)])
        seen.add(scheme)
    return tuner


@pytest.mark.parametrize(("ratios", "commits", "measured"), [
    ([1.005, 0.96], 1, 2),          # the fastest was a misreading; the runner-up holds
    ([1.005, 1.01, 0.9], None, 2),  # both fail: the standing scheme, no third re-measurement
    ([0.96], 0, 1),                 # the fastest holds: nothing else re-measured
])
def test_a_visit_re_measures_its_runner_up_when_its_fastest_trial_fails(ratios, commits,
                                                                        measured):
    """A trial is ranked by one in-search reading: when the fastest fails its interleaved
    re-measurement, the next fastest is re-measured too (once), and commits if it holds."""
    from types import SimpleNamespace

    from qdq_optuna.search._pattern import RUNNER_UPS, Judge
    from qdq_optuna.search._trials import commit_pool, trial_rank

    assert RUNNER_UPS == 1
    tuner = _visit_with_trials([9.0, 9.2, 9.4])
    ps = tuner._pattern
    ranked = sorted(commit_pool(ps.study, constrained=False), key=trial_rank)[:3]
    by_key = {ps.plan_of(t).key: i for i, t in enumerate(ranked)}
    asked: list[int] = []

    def confirm(plan):
        asked.append(by_key[plan.key])
        r = ratios[asked[-1]]
        return _cmp(r, r - 0.02, r + 0.02)

    tuner.search.plans = SimpleNamespace(deterministic=False)  # a measured backend's answer
    keep = dict.fromkeys(ps.pp.ids, 0)
    decision = Judge(ps).single(keep, 10.0, confirm)
    assert asked == list(range(measured))
    if commits is None:
        assert decision.committed == keep and decision.gain == 1.0
        assert decision.reason.count("standing scheme kept") == 2
    else:
        chosen = ranked[commits]
        assert decision.candidate_trial == chosen.number
        assert decision.committed == tuner.search.settings.space.indices(chosen.params,
                                                                          ps.pp.ids)
        assert decision.gain == pytest.approx(1 / ratios[commits])
        assert ("standing scheme kept" in decision.reason) is (commits > 0)
