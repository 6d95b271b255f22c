"""One pattern's Optuna study: open it, time its trials against a reference, decide, commit.

A study is one *visit* of the descent (``RUN/P003/round2``): every trial applies one scheme to
every member region of the pattern, placed between the standing schemes of the other patterns
(its :data:`~qdq_optuna.placement.scheme.Around`), and is timed against the same *reference*: the
standing model (everything that stands, this pattern's standing scheme included), so machine
drift cancels in the ratio; the objective returns ``reference_ms * ratio``, a whole-model
latency. Its first trial is the standing scheme itself (free: the reference). With our sampler
a visit's trials are its moves: the sampler reads the visit's description
(:class:`~qdq_optuna.search._moves.VisitMoves`) and proposes one move per trial in expected-gain
order, each on the best scheme so far, and stops the study when none is left; a chain move also
sets points of neighbouring patterns (the trial's ``partner``). Other samplers propose their
own schemes from the same start, within the same budget. The visit is one ``optimize`` call
(Optuna's heartbeats run inside it). Then the best trial replaces the standing scheme if the
commit rule (:class:`~qdq_optuna.measure.timing.CommitRule`) says so and the accuracy guard
allows it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import optuna
from optuna.exceptions import UpdateFinishedTrialError
from optuna.trial import TrialState

from qdq_optuna._progress import Progress
from qdq_optuna.backends.base import BackendError
from qdq_optuna.config import Config
from qdq_optuna.measure.accuracy import AccuracyError
from qdq_optuna.placement.export import QDQExporter, QuantPlan
from qdq_optuna.placement.points import PatternPoints
from qdq_optuna.placement.scheme import (
    Around,
    ChoiceSpace,
    Neighbourhood,
    distinct_schemes,
    quantized_uses,
)
from qdq_optuna.record import (
    Decision,
    PatternAttr,
    RunRecord,
    TrialAttr,
    note_error,
    note_failure,
    note_measurement,
    note_scheme,
    pattern_attrs,
)
from qdq_optuna.runtimes.prepared import PreparedModel
from qdq_optuna.search._commit import CommitRule
from qdq_optuna.search._guard import Guard
from qdq_optuna.search._moves import VisitMoves, trial_move
from qdq_optuna.search._plans import PlanMeasurer, Reference
from qdq_optuna.search._settings import Settings
from qdq_optuna.search._trials import (
    best_trial,
    commit_pool,
    improves,
    stopping_callbacks,
    trial_rank,
    visit_over,
)
from qdq_optuna.search._workers import Workers
from qdq_optuna.search.objectives import METRIC_NAMES, choose_candidate
from qdq_optuna.search.samplers import SamplerArg, is_ours, make_sampler
from qdq_optuna.wall_time import WallTime

#: two objectives: Pareto points whose latency is within this factor of the fastest count as
#: equally fast (the most accurate of them is committed), or within the threshold when higher
EQUALLY_FAST = 1.02


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
    sampler: SamplerArg = "qdq"
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
    #: the runtime profile's kernel timing on this backend (None: no kernel evidence)
    kernel_timing: Callable | None = None
    #: ``--kernel-cache``: the kernel timings' file, ``off``, or None (the default's)
    kernel_cache: str | None = None
    #: where the run's wall time goes (each phase's steps: the starts' recipe, timing, ...)
    wall: WallTime = field(default_factory=WallTime)

    def __post_init__(self) -> None:
        if self.neighbourhood is None:
            self.neighbourhood = Neighbourhood(self.prepared)

    @property
    def constrained(self) -> bool:
        """Whether trials carry the accuracy bound as their Optuna constraint (the guard's
        bound says: a ``--max-output-error`` the user gave)."""
        return self.guard is not None and self.guard.bound.constrains_trials


class PatternStudy:
    """One study of one pattern (see the module docstring).

    ``around``: the standing schemes of the other patterns; ``start``: the pattern's standing
    scheme to start from (indices; None: the empty scheme, and our sampler proposes the empty
    and full schemes first); ``seeds``: schemes to try first; ``budget``: finished trials at
    most (default ``Config.schemes_per_region``; never more than the distinct models the
    pattern's schemes build); ``rule``: when a candidate replaces the start (default: the
    run's); ``rnd``/``lane``: the visit's round and lane (0: an ask/tell study ``RUN/P003``);
    ``visit``: the descent's visit (our sampler proposes its moves)."""

    def __init__(self, search: Search, pp: PatternPoints, *, order: int, around: Around,
                 rnd: int = 0, lane: str = "", start: dict[str, int] | None = None,
                 seeds: Sequence[Seed] = (), budget: int | None = None,
                 rule: CommitRule | None = None, visit: VisitMoves | None = None,
                 context_key: str | None = None) -> None:
        self.s = search
        self.pp = pp
        self.order = order
        self.rnd = rnd
        self.lane = lane
        self.around = around
        self.start = start
        self.seeds = list(seeds)
        self.cap = budget or search.config.schemes_per_region
        self.rule = rule or search.rule
        self.visit = visit
        self.context_key = context_key
        self.study: optuna.Study | None = None
        self.sampler = None
        self.reference: Reference | None = None
        self.budget = self.cap

    # -- the study -----------------------------------------------------------------------
    def plan(self, params: dict, partner: dict | None = None) -> QuantPlan:
        """The whole model's plan with ``params`` for this pattern (and a chain move's
        ``partner`` points of other patterns)."""
        return self.s.exporter.plan(self.s.settings.space.placed(self._around(partner), self.pp,
                                                                 params))

    def _around(self, partner: dict | None) -> Around:
        if not partner or self.visit is None:
            return self.around
        return self.s.record.around(self.pp, self.visit.schemes({}, partner), self.lane)

    def _scheme_key(self, values: dict) -> str:
        """The model a sampler's scheme builds (its ``P005:<point>`` values: a chain move's
        other patterns' points)."""
        own, partner = self.visit.own_and_partner(values) if self.visit else (values, None)
        return self.plan(own, partner).key

    def plan_of(self, trial) -> QuantPlan:
        return self.plan(trial.params, trial.user_attrs.get(TrialAttr.PARTNER))

    @property
    def ours(self) -> bool:
        return is_ours(self.s.sampler)

    def open(self) -> bool:
        """Create (or load) the study, describe it and queue its seeds; False when it was
        decided already (a resumed run, or another worker)."""
        s = self.s
        self.sampler = make_sampler(
            s.sampler, seed=None if s.seed is None else s.seed + self.order, config=s.config,
            scheme_key=self._scheme_key,
            multi_objective=s.settings.multi_objective, refine=self.start is not None)
        self.study = s.record.create_study(self.pp, self.rnd, self.sampler,
                                           len(s.settings.objectives), self.lane)
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
        first = [Seed(space.params(self.start, self.pp.ids), {TrialAttr.MOVE: "start"})
                 ] if self.start is not None else []
        for seed in first + self.seeds:
            self.study.enqueue_trial(seed.params, user_attrs=seed.user_attrs, skip_if_exists=True)
        return True

    def _attrs(self) -> dict:
        s = self.s
        return visit_attrs(
            pattern_attrs(self.pp, s.prepared, s.settings.space), s.settings.space,
            run_id=s.record.run_id, order=self.order, rnd=self.rnd, lane=self.lane,
            context_key=self.context_key or s.neighbourhood.key(self.pp, self.around),
            baseline_ms=s.baseline_ms, start=self.start, visit=self.visit)

    def measure_reference(self) -> Reference:
        """The reference every trial is timed against, measured once for all workers (its own
        trials are free: its record is known)."""
        s = self.s
        plan = self.plan(self.start or {})
        source = s.exporter.source(plan)  # bytes, or a path for a model in external mode
        def measure() -> list:
            before = s.plans.measurements
            return [*s.plans.reference(source, plan.key), s.plans.measurements - before]

        ms, screen_ms = s.record.reference(self.study, measure)
        self.reference = Reference(plan, source, ms, screen_ms)
        s.plans.known(self.reference)
        if s.settings.accuracy:
            s.record.reference_error(self.study, lambda: s.plans.error(s.exporter, plan))
        self.budget = visit_budget(self.cap, s.settings.space, self.pp, self.around,
                                   s.exporter, self.visit)
        return self.reference

    # -- a trial -------------------------------------------------------------------------
    def objective(self, trial: optuna.Trial):
        """One trial: its scheme, the model it builds, its latency (and error)."""
        s = self.s
        s.workers.admit(self.study, trial, self.budget)
        partner = self._move(trial)
        drawn = s.settings.space.draw(trial, self.pp, self._around(partner))
        plan = s.exporter.plan(drawn.uses)
        note_scheme(trial, drawn, plan)
        twin = s.workers.twin(self.study, trial, plan.key)
        if twin is not None:  # two workers drew the same scheme at once: measure it once
            trial.set_user_attr(TrialAttr.DUPLICATE_OF, twin)
            raise optuna.TrialPruned(f"trial {twin} measures the same model")
        why = not_timed(s, plan)
        if why is not None:
            trial.set_user_attr(why[0], why[1])
            raise optuna.TrialPruned(why[2])
        before = s.plans.measurements  # what this trial cost (0 when cached); see bench.py
        try:
            latency, record = s.plans.latency(s.exporter, plan, self.reference,
                                              f"{self.study.study_name} trial {trial.number}")
        except BackendError as exc:
            note_failure(trial, str(exc), bool(getattr(exc, "transient", False)),
                         s.plans.measurements - before)
            raise
        note_measurement(trial, record, s.plans.measurements - before)
        excess = None
        if s.settings.accuracy:
            err = s.plans.error(s.exporter, plan)
            excess = s.guard.bound.excess(err["error"]) if s.guard is not None else None
            note_error(trial, err, excess)
        if not s.settings.multi_objective:
            trial.set_user_attr(TrialAttr.IMPROVED, improves(
                trial.number, latency, len(plan), excess, self.best_trial(), self.reference.ms))
        if not s.settings.accuracy:
            return latency
        return (latency, err["error"]) if s.settings.multi_objective else latency

    def best_trial(self):
        return best_trial(self.study, constrained=self.s.constrained)

    # -- the moves -----------------------------------------------------------------------
    def _move(self, trial: optuna.Trial) -> dict | None:
        """The trial's partner points: of the move our sampler proposes for it now (its kind,
        place and signature become the trial's user attrs), else of its queued attrs. No move
        left (another worker's trial may still change the best): wait for the others, then
        give the trial up; the visit ends when none runs."""
        if self.visit is None or not self.ours:
            return trial.user_attrs.get(TrialAttr.PARTNER)
        return trial_move(trial, self.sampler, self.visit,
                          lambda: self.s.workers.wait_for_others(self.study, trial))

    # -- the run of the study ------------------------------------------------------------
    def run(self) -> dict:
        """Open, measure the reference, spend the budget, commit; the study's attrs after."""
        if not self.open():
            return dict(self.study.user_attrs)
        self.measure_reference()
        regions, points = len(self.pp.pattern.regions), len(self.pp.ids)
        detail = (f"{regions} region{'s' if regions != 1 else ''}, "
                  f"{points} point{'s' if points != 1 else ''}")
        # progress lines name the pattern (the stage names the round)
        with self.s.progress.pattern(self.pp.pattern.id, self.budget, detail=detail,
                                     done=self._complete()) as bar:
            self.optimize(bar)
            attrs = self.commit()
            bar.finish(gain=float(attrs.get(PatternAttr.GAIN, 1.0)),
                       note=attrs.get(PatternAttr.COMMIT_REASON, ""))
        return attrs

    def _complete(self) -> int:
        return len(self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))

    def _done(self) -> bool:
        return (self._complete() >= self.budget
                or PatternAttr.CONVERGED_AFTER in self.study.user_attrs)

    def optimize(self, bar=None) -> None:
        """Run trials until the budget is spent (across workers), our sampler ends the visit
        (its moves are done) or its climb converged, too many trials failed, or the run is
        out of time (:class:`OutOfTime`). ``bar``: the progress of this study."""
        s = self.s
        while not self._done() and not self._visit_over():
            try:
                self.study.optimize(
                    s.workers.interruptible(self.study, self.objective),
                    callbacks=self._callbacks(bar), timeout=s.remaining(),
                    catch=(BackendError, AccuracyError), gc_after_trial=False)
                break
            except (ValueError, AssertionError, UpdateFinishedTrialError) as exc:
                # another worker ran the trial we popped too, or failed ours as stale: go on
                if not (s.workers.lost() or s.workers.taken_over(self.study, exc)):
                    raise
        if not self._done():
            self._visit_over()
        remaining = s.remaining()
        if remaining is not None and remaining <= 0 and not self._done():
            raise OutOfTime()

    def _visit_over(self) -> bool:
        """Whether our sampler has no move left for the visit (:func:`visit_over`)."""
        return self.visit is not None and self.ours and visit_over(self.study, self.sampler)

    def _callbacks(self, bar) -> list:
        patience = self.s.config.converged_patience

        def on_complete() -> None:
            best = self.best_trial() if not self.s.settings.multi_objective else None
            bar.trial(best=f"{best.values[0]:.4f} ms" if best is not None else "")

        # workers keep exact budgets: one worker cannot know the others' trials are done
        return stopping_callbacks(
            self.budget, sampler=self.sampler, patience=patience,
            converges=bool(patience and not self.s.workers.worker and self.visit is None
                           and hasattr(self.sampler, "converged")),
            on_complete=on_complete if bar is not None else None)

    # -- the decision --------------------------------------------------------------------
    def commit(self, confirm: Callable[[QuantPlan], object] | None = None) -> dict:
        """Store the pattern's decision (the first stored in the run wins, so every worker
        builds the next visits on the same commits), tell the commit callbacks, and return
        the study's attrs. ``confirm``: re-measures a candidate against the reference (default:
        the plan measurer's interleaved A/B; ask/tell passes None and its own figures count)."""
        s = self.s
        if confirm is None and s.plans is not None:  # an interleaved A/B vs the reference
            confirm = lambda plan: s.plans.compare(  # noqa: E731
                s.exporter.source(plan), self.reference.source, "confirmation")
        ref_ms = self.study.user_attrs.get(PatternAttr.REFERENCE_MS)
        if s.record.store_decision(self.study, lambda: self.decide(ref_ms, confirm)):
            for callback in s.on_commit:
                callback(self.study, self.pp)
        return dict(self.study.user_attrs)

    def decide(self, reference_ms: float | None, confirm=None) -> Decision:
        """The decision for this pattern (:meth:`Judge.decide`)."""
        return Judge(self).decide(reference_ms, confirm)


def not_timed(s: Search, plan: QuantPlan) -> tuple[str, str, str] | None:
    """Why a trial's model is not timed, as (its trial attr, that attr's value, the pruning
    message): the same model failed before, or the bound binds and the model breaks it
    (:meth:`~qdq_optuna.search._guard.Guard.refuses_untimed`; a run that asked for accuracy
    as an objective or constraint times every trial). None: time it."""
    failed_in = s.plans.failed.get(plan.key)
    if failed_in is not None:
        return TrialAttr.KNOWN_FAILURE, failed_in, f"the same model failed in {failed_in}"
    refused = (s.guard.refuses_untimed(plan) if s.guard is not None and not s.settings.accuracy
               else None)
    return None if refused is None else (TrialAttr.SKIPPED, refused, refused)


def visit_attrs(pattern: dict, space: ChoiceSpace, *, run_id: str, order: int, rnd: int,
                lane: str, context_key: str, baseline_ms: float | None,
                start: dict[str, int] | None, visit: VisitMoves | None) -> dict:
    """A visit's study attrs: the ``pattern``'s own (the same in every round of it), where the
    visit runs (run, order, round, lane, the other patterns' schemes as ``context_key``), the
    baseline, the scheme it starts from and our sampler's moves."""
    attrs = {**pattern, PatternAttr.RUN_ID: run_id, PatternAttr.ORDER: order,
             PatternAttr.ROUND: rnd, PatternAttr.LANE: lane,
             PatternAttr.CONTEXT_KEY: context_key, PatternAttr.BASELINE_MS: baseline_ms}
    if start is not None:
        attrs[PatternAttr.FROM] = space.on(start)
    if visit is not None:
        attrs[PatternAttr.MOVES] = len(visit.moves)
        attrs[PatternAttr.VISIT] = visit.attr
    return attrs


def visit_budget(cap: int, space: ChoiceSpace, pp: PatternPoints, around: Around,
                 exporter: QDQExporter, visit: VisitMoves | None) -> int:
    """Finished trials a visit may spend: ``cap``, never more than the distinct models the
    pattern's schemes build (chain moves build more)."""
    distinct = distinct_schemes(space, pp, around, lambda uses: exporter.plan(uses).key)
    if distinct is not None and visit is not None:
        distinct += sum(m.kind == "chain" for m in visit.moves)
    return cap if distinct is None else min(cap, distinct)


#: how many more of a visit's fastest trials are re-measured against the standing model when
#: the fastest fails its re-measurement: a trial is ranked by one in-search reading, and on
#: the real YOLOv8n one of four runs committed nothing because its fastest trial (2.6 %
#: faster in the search) re-measured 0.995x, where the other runs' visits committed 1.02-1.04x
RUNNER_UPS = 1


class Judge:
    """A visit's decision: its best trials judged against the standing model (the commit rule,
    the accuracy guard), with reasons that say what was compared with what."""

    def __init__(self, study: PatternStudy) -> None:
        self.ps = study

    def decide(self, reference_ms: float | None, confirm=None) -> Decision:
        """The decision for this pattern: its best trial if the commit rule confirms it beats
        the reference and the guard allows it, else the starting scheme (agreed by all
        workers, see :meth:`~qdq_optuna.record.run.RunRecord.store_decision`)."""
        ps = self.ps
        s, pp = ps.s, ps.pp
        space = s.settings.space
        keep = space.indices(ps.start, pp.ids) if ps.start else dict.fromkeys(pp.ids, 0)
        if s.settings.multi_objective:
            complete = ps.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            best, why = choose_candidate(complete, multi_objective=True,
                                         constrained=s.constrained,
                                         threshold=max(ps.rule.threshold, EQUALLY_FAST))
            decision = Decision(keep, reason=why if complete else "no trial finished")
            if best is not None:
                decision = replace(self.judge(best, keep, reference_ms, confirm), candidate=why)
        else:
            decision = self.single(keep, reference_ms, confirm)
        plan = ps.plan(decision.committed, self.partner_points(decision))
        err = None
        if s.guard is not None:  # the whole-model error now (calibrated scales)
            err = s.guard.error(plan)
        elif s.plans is not None and s.plans.scorer is not None:
            err = s.plans.error(s.exporter, plan)
        if err is not None:
            decision = replace(decision, committed_error=err["error"],
                               committed_output_errors=err["output_errors"])
        if space.mixed:
            decision = replace(decision, committed_types=space.describe(decision.committed))
        return decision

    def partner_points(self, decision: Decision) -> dict | None:
        """A decision's partner schemes as the points that differ from standing."""
        partner = decision.partner
        if not partner or self.ps.visit is None:
            return None
        return self.ps.visit.split({**self.ps.visit.standing, **partner,
                                 self.ps.pp.pattern.id: decision.committed})[1]

    def single(self, keep: dict, reference_ms: float | None, confirm) -> Decision:
        """The fastest trials in turn (at most three the guard refuses), judged against the
        reference; when the fastest fails its re-measurement, the next fastest is re-measured
        too (:data:`RUNNER_UPS`)."""
        s = self.ps.s
        pool = sorted(commit_pool(self.ps.study, constrained=self.ps.s.constrained), key=trial_rank)
        if not pool:
            return Decision(keep, reason="no trial met the error budget"
                            if s.constrained else "no trial finished")
        refused: list[str] = []
        failed: list[Decision] = []
        for best in pool:
            plan = self.ps.plan_of(best)
            if len(refused) >= 3 or (self.ps.reference is not None
                                     and plan.key == self.ps.reference.plan.key):
                break
            if s.guard is not None and not s.guard.allows(plan):
                refused.append(f"trial #{best.number}: output error "
                               f"{s.guard.error(plan)['error']:.3g} over the guard's bound "
                               f"{s.guard.bound.value:g}")
                continue
            decision = self.judge(best, keep, reference_ms, confirm)
            if decision.confirmation is not None and decision.committed == keep \
                    and len(failed) < RUNNER_UPS:
                failed.append(decision)  # one in-search reading misled: try the next
                continue
            if failed and decision.confirmation is None:  # the next was not worth measuring
                decision = failed[-1]
            return self._with_reasons(decision, refused, failed)
        if failed:
            return self._with_reasons(failed[-1], refused, failed)
        what = "; ".join(refused) if refused else (
            f"no trial beat the standing model ({reference_ms:.4f} ms)"
            if reference_ms is not None else "no trial beat the standing model")
        return Decision(keep, reason=what)

    @staticmethod
    def _with_reasons(decision: Decision, refused: list[str], failed: list[Decision]) -> Decision:
        """``decision`` with the trials passed over before it (refused by the guard, or not
        confirmed by their re-measurement) in its reason."""
        before = refused + [d.reason for d in failed if d is not decision]
        if not before:
            return decision
        return replace(decision, reason=f"{decision.reason} ({'; '.join(before)})")

    def judge(self, best, keep: dict, reference_ms: float | None, confirm) -> Decision:
        """The decision about the best trial: committed when the rule confirms it."""
        s = self.ps.s
        rule = self.ps.rule
        plan = self.ps.plan_of(best)
        reference = self.ps.reference.plan if self.ps.reference else self.ps.plan(self.ps.start or {})
        removes_only = quantized_uses(plan) < quantized_uses(reference)
        needed = rule.needed(removes_only=removes_only)
        trial = f"trial #{best.number}" + (f" ({best.user_attrs[TrialAttr.MOVE]} move)"
                                           if best.user_attrs.get(TrialAttr.MOVE) else "")
        if plan.key == reference.key:
            return Decision(keep, reason="no trial beat the standing model: the best is the "
                                         "standing scheme")
        if reference_ms is None:
            return Decision(keep, reason="the reference was not measured")
        what = rule.requirement(removes_only, needed, confirm is None or s.plans.deterministic)
        if not rule.promising(best.values[0], reference_ms, needed, removes_only):
            short = "slower" if best.values[0] > reference_ms else (
                f"{reference_ms / best.values[0]:.4f}x" if best.values[0] < reference_ms
                else "as fast")
            return Decision(keep, reason=f"best {trial} {best.values[0]:.4f} ms vs the "
                                         f"standing model {reference_ms:.4f} ms: {short}, "
                                         f"not enough ({what})")
        chosen = s.settings.space.indices(best.params, self.ps.pp.ids)
        partner = best.user_attrs.get(TrialAttr.PARTNER)
        if partner and self.ps.visit is not None:
            schemes = self.ps.visit.schemes(chosen, partner)
            partner = {p: schemes[p] for p in partner}
        else:
            partner = None
        decided = Decision(chosen, candidate_trial=best.number, partner=partner)
        if confirm is None:  # ask/tell: the caller's figures are the evidence
            return replace(decided, gain=reference_ms / best.values[0],
                           reason=f"{trial} faster by the submitted latencies")
        if s.plans.deterministic:
            gain = reference_ms / best.values[0]
            return replace(decided, gain=gain,
                           reason=f"{trial} {best.values[0]:.4f} ms vs the standing model "
                                  f"{reference_ms:.4f} ms: {gain:.4f}x (deterministic "
                                  f"backend: {what})")
        cmp = confirm(plan)
        speedup = 1.0 / cmp.ratio
        confirmed = rule.confirmed(cmp, needed, False, removes_only)
        measured = (f"{trial} re-measured against the standing model in {cmp.rounds} "
                    f"interleaved rounds: {speedup:.3f}x (95 % CI {1 / cmp.ci_high:.3f}-"
                    f"{1 / cmp.ci_low:.3f})")
        return replace(
            decided if confirmed else Decision(keep),
            gain=speedup if confirmed else 1.0, candidate_trial=best.number,
            confirmation={"ratio": cmp.ratio, "ci": [cmp.ci_low, cmp.ci_high],
                          "rounds": cmp.rounds, "speedup": speedup},
            reason=f"{measured}: committed ({what})" if confirmed else
                   f"{measured}: standing scheme kept ({what}"
                   + ("" if removes_only else ", confirmed by the interval") + ")",
        )

