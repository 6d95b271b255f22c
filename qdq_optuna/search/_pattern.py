"""One pattern's Optuna study: open it, time its trials against a reference, decide, commit.

Every trial applies one scheme to every member region of the pattern, placed between the
standing schemes of the other patterns (its :data:`~qdq_optuna.scheme.Around`), and is timed
against the same *reference*: the model with everything that stands and this pattern's
starting scheme (none in the first pass), so machine drift cancels in the ratio; the objective
returns ``reference_ms * ratio``. When the budget is spent (or the sampler's climb converged),
the best trial is re-measured against the reference and committed if the commit rule
(:class:`~qdq_optuna.measure.CommitRule`) says so; otherwise the starting scheme stays.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import optuna
from optuna.trial import TrialState

from ..accuracy import AccuracyError
from ..backends.base import BackendError
from ..config import Config
from ..export import QDQExporter, QuantPlan
from ..insertion.points import PatternPoints
from ..measure import CommitRule
from ..model import PreparedModel
from ..objectives import METRIC_NAMES, choose_candidate
from ..sampling import make_sampler
from ..scheme import Around, Neighbourhood, distinct_schemes, quantized_uses
from ._guard import Guard
from ._options import Settings
from ._plans import PlanMeasurer, Reference
from ._progress import Bar, Progress
from ._record import (
    Agreed,
    PatternAttr,
    RunRecord,
    TrialAttr,
    note_error,
    note_failure,
    note_measurement,
    note_scheme,
    pattern_attrs,
)
from ._workers import Workers


class OutOfTime(Exception):
    """The run's ``timeout`` ended a pattern study before its budget."""


@dataclass(frozen=True)
class Seed:
    """A scheme a study tries before its sampler's own (in the study's parameter values),
    with user attrs for the trial that measures it."""

    params: dict
    user_attrs: dict | None = None


@dataclass
class Search:
    """What every pattern study of a run shares. The measuring parts (``plans``,
    ``workers``) are None for studies whose trials are measured by the caller (ask/tell)."""

    prepared: PreparedModel
    exporter: QDQExporter
    settings: Settings
    config: Config
    record: RunRecord
    rule: CommitRule
    sampler: str = "qdq"
    seed: int | None = 0
    plans: PlanMeasurer | None = None
    workers: Workers | None = None
    progress: Progress = field(default_factory=lambda: Progress(False))
    #: called with (study, pattern) after a decision is stored (the dashboard's pictures)
    on_commit: list[Callable[[optuna.Study, PatternPoints], None]] = field(default_factory=list)
    #: seconds left of the run (None: no timeout)
    remaining: Callable[[], float | None] = lambda: None
    baseline_ms: float | None = None
    neighbourhood: Neighbourhood | None = None
    #: the accuracy guard (None: no errors are checked, e.g. ask/tell)
    guard: Guard | None = None

    def __post_init__(self) -> None:
        if self.neighbourhood is None:
            self.neighbourhood = Neighbourhood(self.prepared)


class PatternStudy:
    """One study of one pattern in one round (see the module docstring).

    ``around``: the standing schemes of the other patterns; ``start``: the pattern's standing
    scheme to start from (indices; None: the empty scheme, and the sampler proposes the empty
    and full schemes first); ``seeds``: schemes to try first; ``budget``: finished trials at
    most (default ``Config.schemes_per_region``; never more than the distinct models the
    pattern's schemes build); ``rule``: when a candidate replaces the start (default: the
    run's)."""

    def __init__(self, search: Search, pp: PatternPoints, *, order: int, around: Around,
                 rnd: int = 0, start: dict[str, int] | None = None, seeds: Sequence[Seed] = (),
                 budget: int | None = None, rule: CommitRule | None = None) -> None:
        self.s = search
        self.pp = pp
        self.order = order
        self.rnd = rnd
        self.around = around
        self.start = start
        self.seeds = list(seeds)
        self.cap = budget or search.config.schemes_per_region
        self.rule = rule or search.rule
        self.study: optuna.Study | None = None
        self.sampler = None
        self.reference: Reference | None = None
        self.budget = self.cap

    # -- the study -----------------------------------------------------------------------
    def plan(self, params: dict) -> QuantPlan:
        """The whole model's plan with ``params`` for this pattern."""
        return self.s.exporter.plan(self.s.settings.space.placed(self.around, self.pp, params))

    def open(self) -> bool:
        """Create (or load) the study, describe it and queue its seeds; False when it was
        decided already (a resumed run, or another worker)."""
        s = self.s
        self.sampler = make_sampler(
            s.sampler, seed=None if s.seed is None else s.seed + self.order, config=s.config,
            scheme_key=lambda params: self.plan(params).key,
            multi_objective=s.settings.multi_objective, refine=self.start is not None)
        self.study = s.record.create_study(self.pp, self.rnd, self.sampler,
                                           len(s.settings.objectives))
        if PatternAttr.COMMITTED in self.study.user_attrs:
            return False
        if s.workers is not None:
            s.workers.study = self.study
        if PatternAttr.COMPLETE not in self.study.user_attrs:
            self.study.set_metric_names([METRIC_NAMES[o] for o in s.settings.objectives])
            s.record.describe(self.study, self._attrs())
        if s.workers is not None:
            s.workers.requeue(self.study)
        space = s.settings.space
        first = [Seed(space.params(self.start, self.pp.ids))] if self.start is not None else []
        for seed in first + self.seeds:
            self.study.enqueue_trial(seed.params, user_attrs=seed.user_attrs, skip_if_exists=True)
        return True

    def _attrs(self) -> dict:
        attrs = {**pattern_attrs(self.pp, self.s.prepared, self.s.settings.space),
                 PatternAttr.RUN_ID: self.s.record.run_id,
                 PatternAttr.ORDER: self.order,
                 PatternAttr.ROUND: self.rnd,
                 PatternAttr.CONTEXT_KEY: self.s.neighbourhood.key(self.pp, self.around),
                 PatternAttr.BASELINE_MS: self.s.baseline_ms}
        if self.rnd:
            attrs[PatternAttr.REFINES] = self.s.settings.space.on(self.start or {})
        return attrs

    def measure_reference(self) -> Reference:
        """The reference every trial is timed against, measured once for all workers (its own
        trials are free: its record is known)."""
        s = self.s
        plan = self.plan(self.start or {})
        source = s.exporter.source(plan)  # bytes, or a path for a model in external mode
        ms, screen_ms = s.record.reference(self.study, lambda: s.plans.reference(source))
        self.reference = Reference(plan, source, ms, screen_ms)
        s.plans.known(self.reference)
        if s.settings.accuracy:
            s.record.reference_error(self.study, lambda: s.plans.error(s.exporter, plan))
        distinct = distinct_schemes(s.settings.space, self.pp, self.around,
                                    lambda uses: s.exporter.plan(uses).key)
        self.budget = self.cap if distinct is None else min(self.cap, distinct)
        return self.reference

    # -- a trial -------------------------------------------------------------------------
    def objective(self, trial: optuna.Trial):
        """One trial: its scheme, the model it builds, its latency (and error)."""
        s = self.s
        s.workers.admit(self.study, trial, self.budget)
        drawn = s.settings.space.draw(trial, self.pp, self.around)
        plan = s.exporter.plan(drawn.uses)
        note_scheme(trial, drawn, plan)
        twin = s.workers.twin(self.study, trial, plan.key)
        if twin is not None:  # two workers drew the same scheme at once: measure it once
            trial.set_user_attr(TrialAttr.DUPLICATE_OF, twin)
            raise optuna.TrialPruned(f"trial {twin} measures the same model")
        failed_in = s.plans.failed.get(plan.key)
        if failed_in is not None:
            trial.set_user_attr(TrialAttr.KNOWN_FAILURE, failed_in)
            raise optuna.TrialPruned(f"the same model failed in {failed_in}")
        before = s.plans.measurements  # what this trial cost (0 when cached); see bench.py
        try:
            latency, record = s.plans.latency(s.exporter, plan, self.reference,
                                              f"{self.pp.pattern.id} trial {trial.number}")
        except BackendError as exc:
            note_failure(trial, str(exc), bool(getattr(exc, "transient", False)),
                         s.plans.measurements - before)
            raise
        note_measurement(trial, record, s.plans.measurements - before)
        if not s.settings.accuracy:
            return latency
        err = s.plans.error(s.exporter, plan)
        excess = (err["error"] - float(s.settings.max_output_error)
                  if s.settings.constrained else None)
        note_error(trial, err, excess)
        return (latency, err["error"]) if s.settings.multi_objective else latency

    # -- the run of the study ------------------------------------------------------------
    def run(self) -> dict:
        """Open, measure the reference, spend the budget, commit; the study's attrs after."""
        if not self.open():
            return dict(self.study.user_attrs)
        self.measure_reference()
        self.optimize()
        return self.commit()

    def _complete(self) -> int:
        return len(self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))

    def _done(self) -> bool:
        return (self._complete() >= self.budget
                or PatternAttr.CONVERGED_AFTER in self.study.user_attrs)

    def optimize(self) -> None:
        """Run trials until the budget is spent (across workers), the sampler's climb
        converged, too many trials failed, or the run is out of time (:class:`OutOfTime`)."""
        s = self.s
        bar = s.progress.pattern(self.pp.pattern.id, self.rnd, len(self.pp.pattern.regions),
                                 len(self.pp.ids), budget=self.budget, done=self._complete(),
                                 reference_ms=self.reference.ms)
        try:
            if not self._done():
                self.study.optimize(
                    s.workers.interruptible(self.study, self.objective),
                    callbacks=self._callbacks(bar), timeout=s.remaining(),
                    catch=(BackendError, AccuracyError), gc_after_trial=False)
        finally:
            bar.close()
        remaining = s.remaining()
        if remaining is not None and remaining <= 0 and not self._done():
            raise OutOfTime()

    def _callbacks(self, bar: Bar) -> list:
        budget = self.budget

        def stop_on_failures(study: optuna.Study, trial) -> None:
            fails = sum(1 for t in study.get_trials(deepcopy=False, states=(TrialState.FAIL,
                                                                            TrialState.PRUNED))
                        if t.state == TrialState.FAIL or TrialAttr.KNOWN_FAILURE in t.user_attrs)
            if fails >= max(5, budget):
                study.stop()

        def progress(study: optuna.Study, trial) -> None:
            if trial.state == TrialState.COMPLETE:
                bar.trial_done(study)

        callbacks = [optuna.study.MaxTrialsCallback(budget, states=(TrialState.COMPLETE,)),
                     stop_on_failures, progress]
        patience = self.s.config.converged_patience
        if patience and not self.s.workers.worker and hasattr(self.sampler, "converged"):
            # workers keep exact budgets: one worker cannot know the others' trials are done
            def stop_when_converged(study: optuna.Study, trial) -> None:
                if trial.state == TrialState.COMPLETE and self.sampler.converged(study, patience):
                    study.set_user_attr(PatternAttr.CONVERGED_AFTER, trial.number + 1)
                    study.stop()

            callbacks.append(stop_when_converged)
        return callbacks

    # -- the decision --------------------------------------------------------------------
    def commit(self, confirm: Callable[[QuantPlan], object] | None = None) -> dict:
        """Store the pattern's decision (the first stored in the run wins, so every worker
        builds the next patterns on the same commits), tell the commit callbacks, and return
        the study's attrs. ``confirm``: re-measures a candidate against the reference (default:
        the plan measurer's interleaved A/B; ask/tell passes None and its own figures count)."""
        s = self.s
        if confirm is None and s.plans is not None:
            confirm = self._confirm
        ref_ms = self.study.user_attrs.get(PatternAttr.REFERENCE_MS)
        if s.record.store_decision(self.study, lambda: self.decide(ref_ms, confirm)):
            for callback in s.on_commit:
                callback(self.study, self.pp)
        return dict(self.study.user_attrs)

    def _confirm(self, plan: QuantPlan):
        """An interleaved A/B of a candidate against the reference."""
        return self.s.plans.compare(self.s.exporter.source(plan), self.reference.source,
                                    "confirmation")

    def decide(self, reference_ms: float | None, confirm=None) -> dict:
        """The decision for this pattern: its best trial if the commit rule confirms it beats
        the reference, else the starting scheme (an agreed decision, see :class:`Agreed`)."""
        s = self.s
        space = s.settings.space
        complete = self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        keep = space.indices(self.start, self.pp.ids) if self.start else dict.fromkeys(self.pp.ids, 0)
        decision = {PatternAttr.COMMITTED: keep, PatternAttr.GAIN: 1.0,
                    Agreed.REASON: "no trial beat the reference"}
        best, why = choose_candidate(complete, multi_objective=s.settings.multi_objective,
                                     constrained=s.settings.constrained,
                                     threshold=self.rule.threshold)
        if best is None and complete:
            decision[Agreed.REASON] = why
        if best is not None:
            decision = self._judge(best, keep, reference_ms, confirm)
            if s.settings.accuracy or s.settings.multi_objective:
                decision[PatternAttr.CANDIDATE] = why
        if s.plans is not None and s.plans.scorer is not None:  # the whole-model error now
            err = s.plans.error(s.exporter, self.plan(decision[PatternAttr.COMMITTED]))
            decision[PatternAttr.COMMITTED_ERROR] = err["error"]
            decision[PatternAttr.COMMITTED_OUTPUT_ERRORS] = err["output_errors"]
        if space.mixed:
            decision[PatternAttr.COMMITTED_TYPES] = space.describe(decision[PatternAttr.COMMITTED])
        return decision

    def _judge(self, best, keep: dict, reference_ms: float | None, confirm) -> dict:
        """The decision about the best trial: committed when the rule confirms it."""
        s = self.s
        rule = self.rule
        plan = self.plan(best.params)
        reference = self.reference.plan if self.reference else self.plan(self.start or {})
        needed = rule.needed(removes_only=quantized_uses(plan) < quantized_uses(reference))
        stay = {PatternAttr.COMMITTED: keep, PatternAttr.GAIN: 1.0}
        if plan.key == reference.key:
            return {**stay, Agreed.REASON: "best scheme is the reference"}
        if reference_ms is None:
            return {**stay, Agreed.REASON: "the reference was not measured"}
        if not rule.promising(best.values[0], reference_ms, needed):
            return {**stay, Agreed.REASON: f"best {best.values[0]:.4f} ms not {needed}x faster "
                                           f"than reference {reference_ms:.4f} ms"}
        chosen = s.settings.space.indices(best.params, self.pp.ids)
        if confirm is None:  # ask/tell: the caller's figures are the evidence
            return {PatternAttr.COMMITTED: chosen, PatternAttr.GAIN: reference_ms / best.values[0],
                    PatternAttr.CANDIDATE_TRIAL: best.number,
                    Agreed.REASON: "faster by the submitted latencies"}
        cmp = confirm(plan)
        speedup = 1.0 / cmp.ratio
        confirmed = rule.confirmed(cmp, needed, s.plans.deterministic)
        return {
            PatternAttr.COMMITTED: chosen if confirmed else keep,
            PatternAttr.GAIN: speedup if confirmed else 1.0,
            PatternAttr.CANDIDATE_TRIAL: best.number,
            PatternAttr.CONFIRMATION: {"ratio": cmp.ratio, "ci": [cmp.ci_low, cmp.ci_high],
                                       "rounds": cmp.rounds, "speedup": speedup},
            Agreed.REASON: "confirmed" if confirmed else
                           f"re-measured speedup {speedup:.3f} below threshold "
                           f"{needed} or not significant",
        }
