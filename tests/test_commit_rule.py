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
