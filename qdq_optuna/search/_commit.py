"""The commit rule: when a measured candidate replaces the standing model (a search decision,
made from the timing protocol's comparisons)."""

from __future__ import annotations

from dataclasses import dataclass

from qdq_optuna.measure.timing import Comparison

#: on a measured backend a change that only removes Q/DQ commits when its interval rules out a
#: loss of more than this (the interval's upper bound of candidate/standing below 1.01). "Not
#: slower by the point estimate" alone let noise commit one removal after another: on the
#: YOLO-like model nine such removals, each within noise (intervals as wide as 0.90-1.21), left
#: the tuned model 2 % slower than the start it came from.
REMOVAL_MARGIN = 0.01


@dataclass(frozen=True)
class CommitRule:
    """When a candidate replaces the standing model: by whole-model evidence.

    * A change that adds Q/DQ (or moves them) must be faster by ``threshold``
      (``Config.performance_threshold``, default 1.0: any gain): on a deterministic backend its
      latency must be below the standing model's; on a measured backend an interleaved
      re-measurement must show that speedup and be significantly faster (its interval of the
      ratio lies below 1).
    * A change that only takes Q/DQ away costs no accuracy: it is kept when it is not slower
      (the latency, or the re-measured ratio, is at most the standing model's).
    """

    #: ``Config.performance_threshold``: 1.0 = any confirmed gain; 1.02 = 2 % faster
    threshold: float = 1.0

    def needed(self, removes_only: bool) -> float:
        """The speedup a candidate must show (1.0 for a removal: not slower)."""
        return 1.0 if removes_only else self.threshold

    @staticmethod
    def promising(candidate_ms: float, reference_ms: float, needed: float,
                  removes_only: bool = False) -> bool:
        """Whether the candidate's in-search latency is worth confirming."""
        if removes_only:
            return candidate_ms <= reference_ms
        return candidate_ms < reference_ms / needed

    @staticmethod
    def confirmed(comparison: Comparison, needed: float, deterministic: bool,
                  removes_only: bool = False) -> bool:
        """Whether a re-measurement (candidate vs reference) confirms the change."""
        speedup = 1.0 / comparison.ratio
        if removes_only:
            return comparison.ratio <= 1.0 and (
                deterministic or comparison.ci_high <= 1.0 + REMOVAL_MARGIN)
        if deterministic:
            return speedup > 1.0 and speedup >= needed
        return speedup >= needed and comparison.ci_high < 1.0

    def describe(self, deterministic: bool) -> str:
        """The rule in words, for commit reasons."""
        gain = "any gain" if self.threshold <= 1.0 else f"a {self.threshold:g}x speedup"
        if deterministic:
            return f"deterministic backend: {gain} commits, a removal that is not slower too"
        return (f"measured backend: {gain} that an interleaved re-measurement confirms commits, "
                f"a removal too when its interval rules out a loss over "
                f"{REMOVAL_MARGIN:.0%}")

    def requirement(self, removes_only: bool, needed: float, deterministic: bool) -> str:
        """What one change must show to commit (a decision's reason line)."""
        if removes_only:
            return "removes Q/DQ only, so it must not be slower" + (
                "" if deterministic else
                f", nor possibly more than {REMOVAL_MARGIN:.0%} slower by its interval")
        return "any gain commits" if needed <= 1.0 else f"it must be {needed:g}x faster"
