"""A run in its storage: reading and writing the stored run.

:class:`RunRecord` names a run's studies (:mod:`qdq_optuna.record.schema`) and reads and writes
what they hold: the settings and their fingerprint, the baseline, the agreed starts and lanes,
each visit's reference and decision (:class:`~qdq_optuna.record.records.Decision`), the
measured models (:class:`~qdq_optuna.record.records.Measurement`, in :class:`PlanMemo`), and
what stands: a lane's standing model, replayed from its start and its decided visits. The
``note_*`` functions write a trial's attrs; :func:`progress_curve` reads a whole run back
without the model. The search, the report, the dashboard and ``qdq-optuna bench`` go through
this module; Optuna's private parts are :mod:`qdq_optuna.record._optuna`'s.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
from collections.abc import Callable, Iterable

import optuna
from optuna.trial import FrozenTrial, TrialState

from qdq_optuna.errors import UserError
from qdq_optuna.machine import machine_differences
from qdq_optuna.model.graph import Use
from qdq_optuna.placement.points import PatternPoints
from qdq_optuna.placement.scheme import Around, ChoiceSpace, combine
from qdq_optuna.record import _optuna
from qdq_optuna.record.records import (
    AgreedStarts,
    Decision,
    FinishedRun,
    Measurement,
    PatternStanding,
    StartOutcome,
    Visit,
    VisitEntry,
)
from qdq_optuna.record.schema import (
    FLOW,
    WHOLE_MODEL,
    Agreed,
    PatternAttr,
    RunAttr,
    TrialAttr,
    overview_study_name,
    pattern_study_name,
    run_study_name,
    starts_study_name,
)
from qdq_optuna.record.storage import agree, claim


def run_study_of(study: optuna.Study) -> optuna.Study:
    """The run study of a pattern study (KeyError when it has none: not one of our runs)."""
    run_id = study.user_attrs.get(PatternAttr.RUN_ID)
    if run_id is None:  # a study made without its attrs: its name says where it belongs
        run_id = study.study_name.split("/")[0]
    return _optuna.load_sibling(study, run_study_name(run_id))


def delete_run(storage, run_id: str) -> int:
    """Remove every study of a run (``--fresh``)."""
    n = 0
    for s in storage.get_all_studies():
        if s.study_name.startswith(f"{run_id}/") or s.study_name == overview_study_name(run_id):
            optuna.delete_study(study_name=s.study_name, storage=storage)
            n += 1
    return n


# -- the run study's attrs ---------------------------------------------------------------------------
def run_attrs(run_study: optuna.Study) -> dict:
    """The run study's user and system attrs in one view (a key is in one or the other)."""
    return _optuna.study_attrs(run_study)


def set_system_attr(study: optuna.Study, key: str, value) -> None:
    """Store a study's system attr (the run study's bookkeeping, the overview's picture)."""
    _optuna.set_study_system_attr(study, key, value)


# -- per-model records -------------------------------------------------------------------------------
class PlanMemo:
    """Plan key -> a record of that model, stored in the run study's system attrs under
    ``prefix`` (shared by workers, kept across resumes; a run stored by an earlier version has
    them in user attrs): a :class:`~qdq_optuna.record.records.Measurement` (``kind``) under
    ``measured:``, output errors (a dict) under ``error:``."""

    def __init__(self, run_study: optuna.Study, prefix: str, kind: type | None = None) -> None:
        self.study = run_study
        self.prefix = prefix
        self.kind = kind
        self._local: dict = {}

    def refresh(self) -> None:
        for k, v in run_attrs(self.study).items():
            if k.startswith(self.prefix):
                self._local[k[len(self.prefix):]] = self.kind.from_attrs(v) if self.kind else v

    def get(self, key: str):
        if key not in self._local:
            self.refresh()
        return self._local.get(key)

    def put(self, key: str, record) -> None:
        self._local[key] = record
        set_system_attr(self.study, self.prefix + key,
                        record.to_attrs() if self.kind else record)

    def __len__(self) -> int:
        return len(self._local)


# -- trial notes ---------------------------------------------------------------------------------
def note_scheme(trial: optuna.Trial, drawn, plan) -> None:
    """What a trial builds: its scheme, the model's plan key and size, the tensors it covers."""
    trial.set_user_attr(TrialAttr.SCHEME, drawn.on)
    if drawn.mixed:
        trial.set_user_attr(TrialAttr.SCHEME_TYPES, drawn.types)
    trial.set_user_attr(TrialAttr.PLAN_KEY, plan.key)
    trial.set_user_attr(TrialAttr.QDQ_COUNT, len(plan))
    trial.set_user_attr(TrialAttr.TENSORS, drawn.tensors)


def note_failure(trial: optuna.Trial, why: str, transient: bool, cost: int) -> None:
    trial.set_user_attr(TrialAttr.FAILURE, why[:2000])
    trial.set_user_attr(TrialAttr.TRANSIENT, transient)
    trial.set_user_attr(TrialAttr.MEASUREMENTS, cost)


def note_measurement(trial: optuna.Trial, measurement: Measurement, cost: int) -> None:
    """A trial's measurement, and what it cost (0: the model was measured before)."""
    trial.set_user_attr(TrialAttr.MEASUREMENTS, cost)
    trial.set_user_attr(TrialAttr.MEASUREMENT, measurement.to_attrs())


def trial_measurement(trial: FrozenTrial) -> Measurement | None:
    """A trial's measurement (None: it measured nothing)."""
    attrs = trial.user_attrs.get(TrialAttr.MEASUREMENT)
    return Measurement.from_attrs(attrs) if isinstance(attrs, dict) else None


def note_error(trial: optuna.Trial, err: dict, excess: float | None) -> None:
    """A trial's output errors; with an error budget, its constraint (``excess`` over it)."""
    trial.set_user_attr(TrialAttr.ERROR, err["error"])  # the scalar objective / constraint
    trial.set_user_attr(TrialAttr.OUTPUT_ERRORS, err["output_errors"])  # per output: cosine, ...
    if excess is not None:
        trial.set_constraint("max_output_error", excess)
        trial.set_user_attr(TrialAttr.FEASIBLE, excess <= 0)


def pattern_attrs(pp: PatternPoints, prepared, space: ChoiceSpace) -> dict:
    """The attrs that describe a pattern (the same in every round of it)."""
    g = prepared.graph
    uses_index = {u: i for i, u in enumerate(sorted(pp.uses(pp.ids)))}
    attrs = {
        PatternAttr.SIGNATURE: pp.pattern.signature,
        PatternAttr.PATTERN_ID: pp.pattern.id,
        PatternAttr.REGIONS: pp.pattern.regions,
        PatternAttr.REGION_NODES: {str(r): [g.name_of(n) for n in prepared.tree[r].all_nodes]
                                   for r in pp.pattern.regions},
        PatternAttr.OPS: pp.pattern.ops,
        PatternAttr.POINTS: pp.ids,
        PatternAttr.POINT_KINDS: {p.id: p.kind for p in pp.points},
        PatternAttr.CONCAT_GROUPS: pp.concat_groups,
        PatternAttr.FUSION_GROUPS: pp.fusion_groups,
        PatternAttr.POINT_TENSORS: {pid: sorted({u[0] for us in pp.resolved[pid].values()
                                                 for u in us}) for pid in pp.ids},
        PatternAttr.POINT_USES: {pid: sorted(uses_index[u] for us in pp.resolved[pid].values()
                                             for u in us) for pid in pp.ids},
    }
    if space.mixed:
        attrs[PatternAttr.NUM_CHOICES] = space.n
        attrs[PatternAttr.CHOICE_NAMES] = list(space.names)
    return attrs



# -- the record ------------------------------------------------------------------------------------
class RunRecord:
    """One run in one storage: its studies by name, what they hold, and what stands.

    ``tunable``: the model's patterns in study order; ``space``: their choices (to read stored
    schemes)."""

    def __init__(self, storage, run_id: str, tunable: list[PatternPoints],
                 space: ChoiceSpace) -> None:
        self.storage = storage
        self.run_id = run_id
        self.tunable = tunable
        self.space = space
        self.run_study = optuna.create_study(study_name=run_study_name(run_id), storage=storage,
                                             load_if_exists=True)
        self.measured = PlanMemo(self.run_study, RunAttr.MEASURED, Measurement)
        self.errors = PlanMemo(self.run_study, RunAttr.ERROR)
        #: lane -> its pinned uses, read once the starts are agreed (they never change then;
        #: a chain move's trials ask for them on every scheme the sampler proposes)
        self._pinned: dict[str, frozenset[Use]] = {}

    # -- agreement -------------------------------------------------------------------------
    def agree(self, key: str, value):
        return agree(self.run_study, key, value)

    def claim(self, key: str) -> bool:
        return claim(self.run_study, key)

    def check_layout(self, where: str) -> None:
        """Refuse, in one line, a run stored by the pattern-by-pattern search (before the
        whole-model search): its studies mean something else, so it cannot be resumed."""
        settings = run_attrs(self.run_study).get(RunAttr.SETTINGS)
        if settings is not None and settings.get(FLOW) != WHOLE_MODEL:
            raise UserError(
                f"{where}: holds run {self.run_id!r} of the pattern-by-pattern search of an "
                "earlier qdq-optuna, which the whole-model search cannot resume; add --fresh to "
                "tune it again, or pick another --output (its report.json and optimized.onnx, "
                "if it finished, stay valid)")

    def settle_machine(self, machine: dict, where: str) -> None:
        """Store the machine the run's timings come from once (:func:`measuring_machine`;
        a run stored before it was recorded takes this process's), and refuse a process on
        another machine, naming what differs: its timings would be compared with the run's
        and a commit decided by figures that do not compare."""
        run = self.agree(Agreed.MACHINE, json.loads(json.dumps(machine, default=str)))
        differs = machine_differences(run, machine)
        if differs:
            raise UserError(
                f"{where}: run {self.run_id!r} measures on another machine ("
                f"{'; '.join(differs)}): its timings and this process's do not compare; run "
                "this process where the run measures, add --measuring-group NAME to measure "
                "as a group of its own, add --fresh to start over here, or pick another "
                "--output")

    def settle_fingerprint(self, settings: dict, digest: str, where: str) -> None:
        """Store the run's settings once (workers starting together agree on one set); refuse
        a process whose settings differ, naming what changed."""
        attrs = run_attrs(self.run_study)
        if RunAttr.FINGERPRINT not in attrs:
            won = self.agree(Agreed.FINGERPRINT, {
                "digest": digest, "settings": json.loads(json.dumps(settings, default=str))})
            set_system_attr(self.run_study, RunAttr.SETTINGS, won["settings"])
            self.run_study.set_user_attr(RunAttr.CREATED,
                                         _dt.datetime.now(_dt.timezone.utc).isoformat())
            self.run_study.set_user_attr(RunAttr.FINGERPRINT, won["digest"])
            attrs = run_attrs(self.run_study)
        if RunAttr.FINGERPRINT in attrs and attrs[RunAttr.FINGERPRINT] != digest:
            old = attrs.get(RunAttr.SETTINGS, {})
            changed = sorted(k for k in settings
                             if json.dumps(settings[k], sort_keys=True, default=str)
                             != json.dumps(old.get(k), sort_keys=True, default=str))
            raise UserError(
                f"{where}: holds run {self.run_id!r} with other settings "
                f"(changed: {', '.join(changed) or 'unknown'}); rerun with the same settings to "
                "resume, add --fresh to start over, or pick another --output")

    def baseline(self, measure: Callable[[], tuple[float, Measurement]], model: str = "") -> float:
        """The baseline's latency (the user's model), measured once for all workers."""
        if RunAttr.BASELINE_MS not in self.run_study.user_attrs:
            def measured() -> list:
                ms, measurement = measure()
                return [ms, measurement.to_attrs()]

            base_ms, record = self.agree(Agreed.BASELINE, measured)
            set_system_attr(self.run_study, RunAttr.BASELINE_MEASUREMENT, record)
            self.run_study.set_user_attr(RunAttr.BASELINE_MODEL, model)
            self.run_study.set_user_attr(RunAttr.BASELINE_MS, base_ms)
        return self.run_study.user_attrs[RunAttr.BASELINE_MS]

    # -- starts and lanes ------------------------------------------------------------------
    def starts_study(self) -> optuna.Study:
        return optuna.create_study(study_name=starts_study_name(self.run_id),
                                   storage=self.storage, load_if_exists=True)

    def starts(self, decide: Callable[[], AgreedStarts] | None = None) -> AgreedStarts | None:
        """The agreed starts; ``decide`` makes them when no process has yet. None: not
        decided."""
        attrs = run_attrs(self.run_study)
        if RunAttr.STARTS not in attrs:
            if decide is None:
                return None
            set_system_attr(self.run_study, RunAttr.STARTS,
                            self.agree(Agreed.STARTS, lambda: decide().to_attrs()))
            attrs = run_attrs(self.run_study)
        return AgreedStarts.from_attrs(attrs[RunAttr.STARTS])

    def start_outcomes(self) -> list[StartOutcome]:
        """The measured whole-model starts, as agreed (empty: not decided)."""
        starts = self.starts()
        return list(starts.rows) if starts is not None else []

    def winner(self, decide: Callable[[], tuple[str, int]]) -> str:
        """The lane whose standing model ships, agreed once (``decide``: the lane and the
        measurements choosing it took)."""
        if RunAttr.WINNER not in self.run_study.user_attrs:
            lane, cost = self.agree(Agreed.WINNER, lambda: list(decide()))
            set_system_attr(self.run_study, RunAttr.WINNER_COST, cost)
            self.run_study.set_user_attr(RunAttr.WINNER, lane)
        return self.run_study.user_attrs[RunAttr.WINNER]

    def resume_line(self, rounds: int, remeasure: bool = False) -> str | None:
        """What a resumed run has done and has left, in a line (None: a new run); for
        ``--remeasure`` on a finished run, what that does instead."""
        if RunAttr.BASELINE_MS not in self.run_study.user_attrs:
            return None
        if remeasure and self.finished() is not None:
            return (f"run {self.run_id!r} had finished: --remeasure measures its final model "
                    "against the baseline again (one interleaved A/B, no search) and rewrites "
                    "the report")
        starts = self.starts()
        if starts is None:
            return (f"resuming run {self.run_id!r}: baseline measured; left: the starts, then "
                    "the descent")
        visits = self.visits()
        decided = sum(v.decided for v in visits)
        last = visits[-1] if visits else None
        where = (f"; last visit: {last.pattern_id} {(last.lane + ' ') if last.lane else ''}"
                 f"round {last.round}" if last else "")
        return (f"resuming run {self.run_id!r}: baseline and starts done (standing model from "
                f"{starts.chosen}), {decided} visit(s) decided{where}; left: the rest of the "
                f"descent (at most {rounds} rounds a lane, lanes "
                f"{', '.join(n or 'main' for n in starts.order)}), then the final A/B")

    # -- a finished run --------------------------------------------------------------------
    def mark_finished(self, digest: str | None, report: dict) -> None:
        """The run finished with these settings and this report (a rerun prints it and exits,
        see :meth:`finished`)."""
        text = json.dumps(report, indent=2, default=str).encode()
        set_system_attr(self.run_study, RunAttr.FINISHED, FinishedRun(
            digest, report.get("finished"), report.get("speedup"),
            hashlib.sha256(text).hexdigest()).to_attrs())

    def finished(self) -> FinishedRun | None:
        """How the run last finished (None: it has not)."""
        attrs = run_attrs(self.run_study).get(RunAttr.FINISHED)
        return FinishedRun.from_attrs(attrs) if attrs is not None else None

    def overview_study(self) -> optuna.Study:
        """The run's overview study (made when first asked for: when the run finishes)."""
        return optuna.create_study(study_name=overview_study_name(self.run_id),
                                   storage=self.storage, load_if_exists=True)

    # -- pattern studies -------------------------------------------------------------------
    def study_name(self, pp: PatternPoints, rnd: int = 0, lane: str = "") -> str:
        return pattern_study_name(self.run_id, pp.pattern.id, rnd, lane)

    def create_study(self, pp: PatternPoints, rnd: int, sampler, directions: int,
                     lane: str = "") -> optuna.Study:
        return optuna.create_study(study_name=self.study_name(pp, rnd, lane),
                                   storage=self.storage, sampler=sampler,
                                   directions=["minimize"] * directions, load_if_exists=True)

    def load_study(self, pp: PatternPoints, rnd: int = 0, lane: str = "") -> optuna.Study | None:
        try:
            return optuna.load_study(study_name=self.study_name(pp, rnd, lane),
                                     storage=self.storage)
        except KeyError:
            return None

    def study_names(self) -> set[str]:
        return {s.study_name for s in self.storage.get_all_studies()}

    @staticmethod
    def describe(study: optuna.Study, attrs: dict) -> None:
        """Store a pattern study's descriptive attrs, once (``attrs_complete`` last)."""
        if PatternAttr.COMPLETE in study.user_attrs:
            return
        for k, v in attrs.items():
            study.set_user_attr(k, v)
        study.set_user_attr(PatternAttr.COMPLETE, True)

    def reference(self, study: optuna.Study, measure: Callable[[], list[float]]) -> tuple:
        """``(reference_ms, reference_screen_ms)`` of a pattern study, agreed by all workers."""
        if PatternAttr.REFERENCE_MS not in study.user_attrs:
            ref_ms, ref_screen, *cost = self.agree(Agreed.reference(study.study_name), measure)
            if cost:  # what measuring it cost (0: the same model was measured before)
                study.set_user_attr(PatternAttr.REFERENCE_COST, cost[0])
            study.set_user_attr(PatternAttr.REFERENCE_SCREEN_MS, ref_screen)
            study.set_user_attr(PatternAttr.REFERENCE_MS, ref_ms)
        attrs = study.user_attrs
        return attrs[PatternAttr.REFERENCE_MS], attrs.get(PatternAttr.REFERENCE_SCREEN_MS)

    @staticmethod
    def reference_error(study: optuna.Study, score: Callable[[], dict]) -> None:
        if PatternAttr.REFERENCE_ERROR not in study.user_attrs:
            err = score()
            study.set_user_attr(PatternAttr.REFERENCE_ERROR, err["error"])
            study.set_user_attr(PatternAttr.REFERENCE_OUTPUT_ERRORS, err["output_errors"])

    def store_decision(self, study: optuna.Study, decide: Callable[[], Decision]) -> bool:
        """Store a pattern's decision; the first decision stored in the run wins, so every
        worker builds the next visits on the same commits. False when the study was decided
        already (by another worker)."""
        if PatternAttr.COMMITTED in study.user_attrs:
            return False
        agreed = self.agree(Agreed.commit(study.study_name), lambda: decide().to_agreed())
        # "committed" last: its presence means the whole decision is stored
        for k, v in Decision.from_attrs(agreed, agreed=True).to_attrs().items():
            study.set_user_attr(k, v)
        return True

    @staticmethod
    def decision(attrs: dict) -> Decision | None:
        """A visit's decision, from its study's user attrs (None: not decided yet)."""
        return Decision.from_attrs(attrs)

    # -- what stands -----------------------------------------------------------------------
    def visits(self, lane: str | None = None) -> list[Visit]:
        """The descent's visits (of one lane, or all), read from their studies' user attrs in
        the order they ran; undecided ones included."""
        found = [s.user_attrs for s in self.storage.get_all_studies()
                 if s.study_name.startswith(f"{self.run_id}/")
                 and int(s.user_attrs.get(PatternAttr.ROUND) or 0) > 0
                 and (lane is None or s.user_attrs.get(PatternAttr.LANE, "") == lane)]
        return [Visit.from_attrs(a) for a in sorted(found, key=lambda a: a[PatternAttr.ORDER])]

    def lane_start(self, lane: str) -> dict[str, dict[str, int]]:
        """A lane's start: pattern id -> scheme (indices); patterns it leaves out are float."""
        starts = self.starts()
        schemes = (starts.lanes if starts is not None else {}).get(lane, {})
        return {pp.pattern.id: self.space.indices(schemes.get(pp.pattern.id, {}), pp.ids)
                for pp in self.tunable}

    def standing(self, lane: str, visits: list[Visit] | None = None
                 ) -> dict[str, dict[str, int]]:
        """A lane's standing model: its start with every decided visit replayed in order
        (a visit's commit, and the partner schemes of a committed chain move)."""
        schemes = self.lane_start(lane)
        for visit in self.visits(lane) if visits is None else visits:
            decision = visit.decision
            if decision is None:
                continue
            schemes[visit.pattern_id] = dict(decision.committed)
            for pid, scheme in (decision.partner or {}).items():
                schemes[pid] = dict(scheme)
        return schemes

    def uses(self, schemes: dict[str, dict[str, int]],
             pinned: Iterable[Use] = ()) -> dict[Use, str]:
        """The typed uses of whole-model schemes (earlier patterns' types stand), with
        ``pinned`` uses (a lane's: :meth:`pinned`) after them."""
        uses: dict[Use, str] = {}
        for pp in self.tunable:
            uses = combine(uses, self.space.typed_uses(pp, schemes.get(pp.pattern.id, {})))
        return self._with_pinned(uses, pinned)

    def _with_pinned(self, uses: dict[Use, str], pinned: Iterable[Use]) -> dict[Use, str]:
        """``uses`` and the ``pinned`` ones, these as the first quant type (a use both have
        keeps its scheme's type)."""
        return combine(uses, dict.fromkeys(pinned, self.space.types[0]))

    def pinned(self, lane: str | None) -> frozenset[Use]:
        """The uses a lane's start quantizes beyond its schemes (member regions of a pattern
        placed differently: a repaired start): every model of the lane keeps them
        (``AgreedStarts.pinned``)."""
        if lane is None:
            return frozenset()
        if lane not in self._pinned:
            starts = self.starts()
            if starts is None:  # not agreed yet: nothing to keep
                return frozenset()
            self._pinned[lane] = frozenset(
                (str(t), int(n), int(slot)) for t, n, slot in starts.pinned.get(lane) or [])
        return self._pinned[lane]

    def standing_uses(self, lane: str, visits: list[Visit] | None = None) -> dict[Use, str]:
        """The typed uses of a lane's standing model (its pinned uses included)."""
        return self.uses(self.standing(lane, visits), self.pinned(lane))

    def around(self, pp: PatternPoints, schemes: dict[str, dict[str, int]],
               lane: str | None = None) -> Around:
        """The uses of the other patterns' schemes, before ``pp`` and after it (``lane``'s
        pinned uses after: every trial of the lane keeps them)."""
        before: dict[Use, str] = {}
        after: dict[Use, str] = {}
        seen = False
        for other in self.tunable:
            if other.pattern.id == pp.pattern.id:
                seen = True
                continue
            typed = self.space.typed_uses(other, schemes.get(other.pattern.id, {}))
            if seen:
                after = combine(after, typed)
            else:
                before = combine(before, typed)
        return before, self._with_pinned(after, self.pinned(lane))

    def committed(self, lane: str) -> tuple[dict[Use, str], list[PatternStanding]]:
        """The uses of a lane's standing model, and each pattern's place in it: its standing
        scheme, the product of its visits' gains and the visits (its own, and the chain moves
        of other patterns that changed it)."""
        visits = self.visits(lane)
        schemes = self.standing(lane, visits)
        rows = []
        for pp in self.tunable:
            pid = pp.pattern.id
            own = [v for v in visits if v.pattern_id == pid]
            rows.append(PatternStanding(
                pid, schemes[pid], math.prod(v.gain for v in own if v.decided),
                tuple(self.visit_entry(v) for v in visits
                      if v.pattern_id == pid or pid in (v.partner or {})),
                self.space.on(self.lane_start(lane)[pid]), own[-1] if own else None))
        return self.uses(schemes, self.pinned(lane)), rows

    def visit_entry(self, visit: Visit) -> VisitEntry:
        """One visit, for the report (its schemes by point name)."""
        decision = visit.decision or Decision(committed={}, gain=visit.gain, reason=visit.reason)
        partner = ({p: self.space.on(s) for p, s in decision.partner.items()}
                   if decision.partner else None)
        return VisitEntry(visit.pattern_id, visit.round, visit.lane,
                          "committed" if visit.decided else "running", visit.from_scheme,
                          self.space.on(decision.committed), decision.gain, decision.reason,
                          visit.moves, visit.moves_skipped, partner, visit.converged_after)

    # -- trials ----------------------------------------------------------------------------
    def trials(self, pp: PatternPoints, rnd: int = 0, lane: str = "",
               states: Iterable[TrialState] | None = None) -> list[FrozenTrial] | None:
        """The trials of one of the pattern's studies (None: the study does not exist)."""
        study = self.load_study(pp, rnd, lane)
        if study is None:
            return None
        return study.get_trials(deepcopy=False, states=tuple(states) if states else None)

    def complete_trials(self, pp: PatternPoints, rnd: int = 0,
                        lane: str = "") -> list[FrozenTrial] | None:
        return self.trials(pp, rnd, lane, (TrialState.COMPLETE,))

    def visit_trials(self, visit: Visit) -> list[FrozenTrial]:
        """Every trial of a visit."""
        pp = next(p for p in self.tunable if p.pattern.id == visit.pattern_id)
        return self.trials(pp, int(visit.round), visit.lane) or []

    # -- snapshots -------------------------------------------------------------------------


def studies_in_order(storage, run_id: str) -> list[tuple[optuna.Study, dict]]:
    """A run's pattern studies in the order the search ran them (lanes, rounds, patterns),
    with their user attrs; read without the model."""
    found = [s for s in storage.get_all_studies()
             if s.study_name.startswith(f"{run_id}/") and PatternAttr.ORDER in s.user_attrs]
    found.sort(key=lambda s: s.user_attrs[PatternAttr.ORDER])
    return [(optuna.load_study(study_name=s.study_name, storage=storage), s.user_attrs)
            for s in found]


def progress_curve(storage, run_id: str) -> dict:
    """``{"measurements": n, "curve": [[x, speedup], ...]}`` of a run in ``storage``: after each
    measurement (the baseline, the starts, each visit's reference and trials, each commit
    confirmation, the choice between lanes, the final A/B), the speedup of the fastest feasible
    whole model measured so far (see :mod:`qdq_optuna.cli.bench`)."""
    run = run_attrs(optuna.load_study(study_name=run_study_name(run_id), storage=storage))
    base = float(run[RunAttr.BASELINE_MS])
    x, best = 1, math.inf  # the baseline; the fastest whole model known so far
    curve = [(x, 1.0)]
    starts = AgreedStarts.from_attrs(run[RunAttr.STARTS]) if run.get(RunAttr.STARTS) else None
    rows = starts.rows if starts is not None else ()
    for start in rows:  # each measured once
        if start.feasible and start.latency_ms:
            best = min(best, float(start.latency_ms))
    x += int(starts.measurements if starts is not None and starts.measurements is not None
             else len(rows))
    curve.append((x, base / best if best < math.inf else 1.0))
    for study, attrs in studies_in_order(storage, run_id):
        x += int(attrs.get(PatternAttr.REFERENCE_COST, 1))
        for t in sorted(study.get_trials(deepcopy=False), key=lambda t: t.number):
            x += _trial_cost(t)
            if t.state == TrialState.COMPLETE and t.values and \
                    t.user_attrs.get("feasible", True):
                best = min(best, float(t.values[0]))
            curve.append((x, base / best if best < math.inf else 1.0))
        x += PatternAttr.CONFIRMATION in attrs
    x += int(run.get(RunAttr.WINNER_COST, 0))
    x += 1  # the final A/B against the baseline
    curve.append((x, curve[-1][1]))
    return {"measurements": x, "curve": _compress(curve)}


def _trial_cost(t) -> int:
    n = t.user_attrs.get(TrialAttr.MEASUREMENTS)
    if isinstance(n, int) and not isinstance(n, bool):
        return n
    m = trial_measurement(t)  # runs made before trials carried a count
    return 0 if m is None or m.cached else 1


def _compress(curve: list[tuple[int, float]]) -> list[list[float]]:
    """Keep the last point of every x and drop points that change nothing."""
    by_x: dict[int, float] = {}
    for x, y in curve:
        by_x[x] = y
    out: list[list[float]] = []
    items = sorted(by_x.items())
    for i, (x, y) in enumerate(items):
        if out and out[-1][1] == y and i != len(items) - 1:
            continue
        out.append([x, y])
    return out
