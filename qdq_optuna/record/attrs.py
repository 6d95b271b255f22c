"""The stored run: study names, every user-attribute key, and reading a run back.

A run ``RUN`` is the Optuna studies named ``RUN/...`` in one storage:

* ``RUN``: the run's overview for optuna-dashboard, made when the run finishes (so it is the
  first card of the study list): a note with the run's figures, phases and studies, the
  whole-run convergence picture, a few small user attrs (speedup, latencies, the guard's
  status) and no trials (:func:`qdq_optuna.outputs.dashboard.save_run_overview`);
* ``RUN/_run``: the run's bookkeeping, kept small and out of sight. Its user attrs are the
  settings' digest, when it was made, the baseline (the user's model) and the lane that
  ships; its system attrs hold the settings, the whole-model starts and the lanes chosen from
  them, every measured model (``measured:<plan key>``) and scored error (``error:<plan
  key>``) and whether the run finished. Its trials are the values workers agreed on
  (:func:`~qdq_optuna.record.storage.agree`: the baseline, the starts, each study's reference, each
  commit, the lane that ships), without values. Its note follows the run while it runs;
* ``RUN/_starts``: one trial per whole-model start (float, every point, the runtime's recipe,
  the user's seeds), its value the start's latency;
* ``RUN/P003/round1``: pattern ``P003``'s visit in round 1 of the descent from the standing
  model; ``RUN/P003/recipe/round1`` the same in the descent from another start (a *lane*).
  A visit's user attrs describe the pattern and, once decided, hold its commit (``committed``
  last: its presence means the whole decision is stored; ``partner``: other patterns' schemes a
  chain move changed with it). The standing model of a lane is its start with every decided
  visit replayed in order (:meth:`RunRecord.standing`);
* ``RUN/P003`` (no round): a study of the ask/tell :class:`~qdq_optuna.Autotuner`, and of runs
  made before the whole-model search (the pattern-by-pattern pass and ``RUN/P003/refineN``),
  which this version does not resume (:meth:`RunRecord.check_layout`).

:class:`RunRecord` is the one place that names these studies and reads and writes their
attributes; the search, the report, the dashboard and ``qdq-optuna bench`` go through it.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
from collections.abc import Callable, Iterable
from pathlib import Path

import optuna
import yaml
from optuna.trial import FrozenTrial, TrialState

from qdq_optuna._files import atomic_write_bytes
from qdq_optuna.errors import UserError
from qdq_optuna.model.graph import Use
from qdq_optuna.placement.points import PatternPoints
from qdq_optuna.placement.scheme import Around, ChoiceSpace, combine
from qdq_optuna.placement.seeds import PatternCache
from qdq_optuna.record.storage import agree, claim

RUN_STUDY = "_run"
STARTS_STUDY = "_starts"
#: the old layout's refinement studies (``RUN/P003/refine1``)
REFINE = "refine"
ROUND = "round"
#: the phases measurements are counted in (``PlanMeasurer.by_phase``, report.json's
#: ``measurements_by_phase``): the baseline, the whole-model starts (each measured once, then
#: an A/B of the fastest two on a measured backend), the descent (each visit's reference and
#: its trials), commit confirmations, the choice between lanes, the final A/B and the Pareto
#: front
PHASES = ("baseline", "starts", "descent", "confirmation", "lanes", "final", "pareto")
#: the settings key that marks a run of the whole-model search
FLOW = "flow"
WHOLE_MODEL = "whole-model"


class RunAttr:
    """Attrs of the run study: user attrs (small, shown by ``optuna studies`` and the
    dashboard) and system attrs (the bookkeeping; earlier versions kept them in user attrs)."""

    # user attrs
    FINGERPRINT = "fingerprint"
    CREATED = "created"
    BASELINE_MS = "baseline_latency_ms"
    # system attrs
    SETTINGS = "settings"
    BASELINE_MEASUREMENT = "baseline_measurement"
    #: the run's last finish: ``fingerprint``, ``at``, ``speedup``, ``report_sha256``
    FINISHED = "qdq:finished"
    #: the agreed starts: chosen start, lanes, each lane's start schemes (``Agreed.STARTS``)
    STARTS = "starts"
    #: the measurements choosing the lane that ships took
    WINNER_COST = "winner_measurements"
    # user attrs
    #: what the baseline is (the user's model as given, or converted to FP16/BF16)
    BASELINE_MODEL = "baseline_model"
    #: the lane whose standing model ships (``Agreed.WINNER``)
    WINNER = "winner"
    #: prefixes of the per-model records: plan key -> measurement / output errors
    MEASURED = "measured:"
    ERROR = "error:"


class OverviewAttr:
    """Attrs of the run's overview study: small user attrs (what ``optuna studies`` shows) and
    its picture (a system attr)."""

    RUN_ID = "run_id"
    STATUS = "status"
    BASELINE_MS = "baseline_latency_ms"
    FINAL_MS = "final_latency_ms"
    SPEEDUP = "speedup"
    ACCURACY = "accuracy_status"
    #: the whole-run picture uploaded to it: ``artifact_id``, ``digest``, ``url``
    PICTURE = "qdq:run_picture"


class PatternAttr:
    """User attrs of a pattern study (the ``qdq_*`` ones are read by our sampler)."""

    SIGNATURE = "signature"
    PATTERN_ID = "pattern_id"
    REGIONS = "regions"
    REGION_NODES = "region_nodes"
    OPS = "ops"
    POINTS = "qdq_points"
    POINT_KINDS = "qdq_point_kinds"
    CONCAT_GROUPS = "qdq_concat_groups"
    FUSION_GROUPS = "qdq_fusion_groups"
    POINT_TENSORS = "qdq_point_tensors"
    POINT_USES = "qdq_point_uses"
    NUM_CHOICES = "qdq_num_choices"
    CHOICE_NAMES = "qdq_choice_names"
    RUN_ID = "run_id"
    #: the order visits ran in (lane, round, pattern)
    ORDER = "order"
    #: the descent round of a visit (1, 2, ...; 0: an ask/tell study)
    ROUND = "round"
    #: the start a visit's lane descends from (``float``, ``recipe``, ...)
    LANE = "lane"
    CONTEXT_KEY = "context_key"
    BASELINE_MS = "baseline_latency_ms"
    #: a visit's starting scheme: the pattern's standing scheme (points on)
    FROM = "from_scheme"
    #: the moves a visit queued and those it left out (their kind failed in this run before)
    MOVES = "moves"
    MOVES_SKIPPED = "moves_skipped"
    #: a visit as our sampler's move engine reads it (see search/_moves.py)
    VISIT = "qdq_visit"
    #: every attr above is stored (a killed process may have left only some)
    COMPLETE = "attrs_complete"
    REFERENCE_MS = "reference_ms"
    REFERENCE_SCREEN_MS = "reference_screen_ms"
    REFERENCE_COST = "reference_measurements"
    REFERENCE_ERROR = "reference_error"
    REFERENCE_OUTPUT_ERRORS = "reference_output_errors"
    CONVERGED_AFTER = "converged_after"
    # the decision (see :meth:`RunRecord.store_decision`)
    COMMITTED = "committed"
    GAIN = "gain"
    COMMIT_REASON = "commit_reason"
    CANDIDATE_TRIAL = "candidate_trial"
    CANDIDATE = "candidate"
    CONFIRMATION = "confirmation"
    COMMITTED_ERROR = "committed_error"
    COMMITTED_OUTPUT_ERRORS = "committed_output_errors"
    COMMITTED_TYPES = "committed_types"
    #: other patterns' whole schemes a committed chain move changed (pattern id -> indices)
    PARTNER = "partner"
    #: the dashboard's pictures of the study
    ARTIFACTS = "artifacts"


class TrialAttr:
    """User attrs of a pattern study's trials."""

    SCHEME = "scheme"
    SCHEME_TYPES = "scheme_types"
    PLAN_KEY = "plan_key"
    QDQ_COUNT = "qdq_count"
    TENSORS = "tensors"
    #: what the trial cost: times the backend was asked to time a model (0 when cached)
    MEASUREMENTS = "measurements"
    MEASUREMENT = "measurement"
    ERROR = "error"
    OUTPUT_ERRORS = "output_errors"
    FEASIBLE = "feasible"
    FAILURE = "failure"
    TRANSIENT = "transient"
    KNOWN_FAILURE = "known_failure"
    DUPLICATE_OF = "duplicate_of"
    SKIPPED = "skipped"
    SLOT = "slot"
    RETRY_OF = "retry_of"
    RETRY_REASON = "retry_reason"
    #: a descent move: its kind (``cache``, ``fusion``, ``concat``, ``chain``, ``single``),
    #: its place in the visit's move list, what it changes (``on:Conv>Concat`` strings: Q/DQ
    #: added or removed between a producer op and a consumer op) and, for a chain, the other
    #: patterns' points it sets (pattern id -> {point: choice})
    MOVE = "move"
    MOVE_INDEX = "move_index"
    MOVE_SIGNATURE = "move_signature"
    PARTNER = "partner"
    #: the trial beat the visit's best so far (what the move-kind statistics count)
    IMPROVED = "improved"


class SystemAttr:
    """System attrs the search reads: Optuna's own and our sampler's."""

    FIXED_PARAMS = "fixed_params"  # Optuna: an enqueued trial's parameters
    FAILED_TRIAL = "failed_trial"  # Optuna: the trial a retry repeats
    RETRY_HISTORY = "retry_history"
    DUPLICATE = "qdq:duplicate"  # our sampler repeats a scheme knowingly
    PHASE = "qdq:phase"


class Agreed:
    """Keys of the values a run's workers agree on (:func:`~qdq_optuna.record.storage.agree`).

    A commit's agreed value is a decision: a dict of :class:`PatternAttr` keys, except that its
    reason is under :attr:`REASON` (stored on the study as ``commit_reason``)."""

    FINGERPRINT = "fingerprint"
    BASELINE = "baseline"
    STARTS = "starts"
    WINNER = "winner"
    REASON = "reason"

    @staticmethod
    def reference(study_name: str) -> str:
        return f"reference/{study_name}"

    @staticmethod
    def commit(study_name: str) -> str:
        return f"commit/{study_name}"

    @staticmethod
    def run(study_name: str, number: int) -> str:
        """Which worker measures a queued trial two workers popped at once."""
        return f"run/{study_name}/{number}"

    @staticmethod
    def redo(study_name: str, number: int) -> str:
        return f"redo/{study_name}/{number}"

    @staticmethod
    def retry(study_name: str, number: int) -> str:
        return f"retry/{study_name}/{number}"


# -- names -----------------------------------------------------------------------------------------
def run_study_name(run_id: str) -> str:
    return f"{run_id}/{RUN_STUDY}"


def overview_study_name(run_id: str) -> str:
    """The run's overview study (see the module docstring): the run's own name."""
    return run_id


def starts_study_name(run_id: str) -> str:
    return f"{run_id}/{STARTS_STUDY}"


def pattern_study_name(run_id: str, pattern_id: str, rnd: int = 0, lane: str = "") -> str:
    """``RUN/P003/round1`` (a visit), ``RUN/P003/recipe/round1`` (a visit in the lane that
    descends from the recipe), ``RUN/P003`` (round 0: an ask/tell study)."""
    name = f"{run_id}/{pattern_id}"
    if not rnd:
        return name
    return f"{name}/{lane}/{ROUND}{rnd}" if lane else f"{name}/{ROUND}{rnd}"


def run_study_of(study: optuna.Study) -> optuna.Study:
    """The run study of a pattern study (KeyError when it has none: not one of our runs)."""
    run_id = study.user_attrs.get(PatternAttr.RUN_ID)
    if run_id is None:  # a study made without its attrs: its name says where it belongs
        run_id = study.study_name.split("/")[0]
    return optuna.load_study(study_name=run_study_name(run_id), storage=study._storage)


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
    storage, sid = run_study._storage, run_study._study_id
    return {**storage.get_study_system_attrs(sid), **storage.get_study_user_attrs(sid)}


def set_system_attr(study: optuna.Study, key: str, value) -> None:
    study._storage.set_study_system_attr(study._study_id, key, value)


# -- per-model records -------------------------------------------------------------------------------
class PlanMemo:
    """Plan key -> a record of that model (its measurement, or its output errors), stored in
    the run study's system attrs under ``prefix`` (shared by workers, kept across resumes; a
    run stored by an earlier version has them in user attrs)."""

    def __init__(self, run_study: optuna.Study, prefix: str) -> None:
        self.study = run_study
        self.prefix = prefix
        self._local: dict[str, dict] = {}

    def refresh(self) -> None:
        for k, v in run_attrs(self.study).items():
            if k.startswith(self.prefix):
                self._local[k[len(self.prefix):]] = v

    def get(self, key: str) -> dict | None:
        if key not in self._local:
            self.refresh()
        return self._local.get(key)

    def put(self, key: str, record: dict) -> None:
        self._local[key] = record
        set_system_attr(self.study, self.prefix + key, record)

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


def note_measurement(trial: optuna.Trial, record: dict, cost: int) -> None:
    trial.set_user_attr(TrialAttr.MEASUREMENTS, cost)
    trial.set_user_attr(TrialAttr.MEASUREMENT, record)


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
        self.measured = PlanMemo(self.run_study, RunAttr.MEASURED)
        self.errors = PlanMemo(self.run_study, RunAttr.ERROR)

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

    def baseline(self, measure: Callable[[], tuple[float, dict]], model: str = "") -> float:
        """The baseline's latency (the user's model), measured once for all workers."""
        if RunAttr.BASELINE_MS not in self.run_study.user_attrs:
            base_ms, record = self.agree(Agreed.BASELINE, lambda: list(measure()))
            set_system_attr(self.run_study, RunAttr.BASELINE_MEASUREMENT, record)
            self.run_study.set_user_attr(RunAttr.BASELINE_MODEL, model)
            self.run_study.set_user_attr(RunAttr.BASELINE_MS, base_ms)
        return self.run_study.user_attrs[RunAttr.BASELINE_MS]

    def settings(self) -> dict:
        """The run's stored settings (what its fingerprint digests)."""
        return run_attrs(self.run_study).get(RunAttr.SETTINGS, {})

    # -- starts and lanes ------------------------------------------------------------------
    def starts_study(self) -> optuna.Study:
        return optuna.create_study(study_name=starts_study_name(self.run_id),
                                   storage=self.storage, load_if_exists=True)

    def starts(self, decide: Callable[[], dict] | None = None) -> dict | None:
        """The agreed starts (``chosen``, ``lanes``: lane name -> start schemes, in descent
        order); ``decide`` makes them when no process has yet. None: not decided."""
        attrs = run_attrs(self.run_study)
        if RunAttr.STARTS not in attrs:
            if decide is None:
                return None
            set_system_attr(self.run_study, RunAttr.STARTS, self.agree(Agreed.STARTS, decide))
            attrs = run_attrs(self.run_study)
        return attrs[RunAttr.STARTS]

    def winner(self, decide: Callable[[], tuple[str, int]]) -> str:
        """The lane whose standing model ships, agreed once (``decide``: the lane and the
        measurements choosing it took)."""
        if RunAttr.WINNER not in self.run_study.user_attrs:
            lane, cost = self.agree(Agreed.WINNER, lambda: list(decide()))
            set_system_attr(self.run_study, RunAttr.WINNER_COST, cost)
            self.run_study.set_user_attr(RunAttr.WINNER, lane)
        return self.run_study.user_attrs[RunAttr.WINNER]

    def resume_line(self, rounds: int) -> str | None:
        """What a resumed run has done and has left, in a line (None: a new run)."""
        if RunAttr.BASELINE_MS not in self.run_study.user_attrs:
            return None
        starts = self.starts()
        if starts is None:
            return (f"resuming run {self.run_id!r}: baseline measured; left: the starts, then "
                    "the descent")
        visits = self.visits()
        decided = sum(PatternAttr.COMMITTED in a for a in visits)
        last = visits[-1] if visits else None
        where = (f"; last visit: {last[PatternAttr.PATTERN_ID]} "
                 f"{(last.get(PatternAttr.LANE) + ' ') if last.get(PatternAttr.LANE) else ''}"
                 f"round {last[PatternAttr.ROUND]}" if last else "")
        return (f"resuming run {self.run_id!r}: baseline and starts done (standing model from "
                f"{starts['chosen']}), {decided} visit(s) decided{where}; left: the rest of the "
                f"descent (at most {rounds} rounds a lane, lanes "
                f"{', '.join(n or 'main' for n in starts['order'])}), then the final A/B")

    # -- a finished run --------------------------------------------------------------------
    def mark_finished(self, digest: str | None, report: dict) -> None:
        """The run finished with these settings and this report (a rerun prints it and exits,
        see :meth:`finished`)."""
        text = json.dumps(report, indent=2, default=str).encode()
        set_system_attr(self.run_study, RunAttr.FINISHED, {
            "fingerprint": digest, "at": report.get("finished"),
            "speedup": report.get("speedup"),
            "report_sha256": hashlib.sha256(text).hexdigest()})

    def finished(self) -> dict | None:
        """How the run last finished (None: it has not)."""
        return run_attrs(self.run_study).get(RunAttr.FINISHED)

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

    def store_decision(self, study: optuna.Study, decide: Callable[[], dict]) -> bool:
        """Store a pattern's decision; the first decision stored in the run wins, so every
        worker builds the next visits on the same commits. False when the study was decided
        already (by another worker)."""
        if PatternAttr.COMMITTED in study.user_attrs:
            return False
        decision = self.agree(Agreed.commit(study.study_name), decide)
        # "committed" last: its presence means the whole decision is stored
        for k, v in sorted(decision.items(), key=lambda kv: kv[0] == PatternAttr.COMMITTED):
            study.set_user_attr(k if k != Agreed.REASON else PatternAttr.COMMIT_REASON, v)
        return True

    # -- what stands -----------------------------------------------------------------------
    def visits(self, lane: str | None = None) -> list[dict]:
        """The user attrs of the descent's visit studies (of one lane, or all), in the order
        they ran; undecided ones included."""
        found = [s.user_attrs for s in self.storage.get_all_studies()
                 if s.study_name.startswith(f"{self.run_id}/")
                 and int(s.user_attrs.get(PatternAttr.ROUND) or 0) > 0
                 and (lane is None or s.user_attrs.get(PatternAttr.LANE, "") == lane)]
        return sorted(found, key=lambda a: a[PatternAttr.ORDER])

    def lane_start(self, lane: str) -> dict[str, dict[str, int]]:
        """A lane's start: pattern id -> scheme (indices); patterns it leaves out are float."""
        starts = self.starts() or {}
        schemes = (starts.get("lanes") or {}).get(lane, {})
        return {pp.pattern.id: self.space.indices(schemes.get(pp.pattern.id, {}), pp.ids)
                for pp in self.tunable}

    def standing(self, lane: str, visits: list[dict] | None = None) -> dict[str, dict[str, int]]:
        """A lane's standing model: its start with every decided visit replayed in order
        (a visit's commit, and the partner schemes of a committed chain move)."""
        schemes = self.lane_start(lane)
        for attrs in self.visits(lane) if visits is None else visits:
            if PatternAttr.COMMITTED not in attrs:
                continue
            schemes[attrs[PatternAttr.PATTERN_ID]] = dict(attrs[PatternAttr.COMMITTED])
            for pid, scheme in (attrs.get(PatternAttr.PARTNER) or {}).items():
                schemes[pid] = dict(scheme)
        return schemes

    def uses(self, schemes: dict[str, dict[str, int]]) -> dict[Use, str]:
        """The typed uses of whole-model schemes (earlier patterns' types stand)."""
        uses: dict[Use, str] = {}
        for pp in self.tunable:
            uses = combine(uses, self.space.typed_uses(pp, schemes.get(pp.pattern.id, {})))
        return uses

    def around(self, pp: PatternPoints, schemes: dict[str, dict[str, int]]) -> Around:
        """The uses of the other patterns' schemes, before ``pp`` and after it."""
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
        return before, after

    def committed(self, lane: str) -> tuple[dict[Use, str], list[dict]]:
        """The uses of a lane's standing model, and one report row per pattern: its standing
        scheme, the product of its visits' gains and the visits (``visits``: its own, and the
        chain moves of other patterns that changed it)."""
        visits = self.visits(lane)
        schemes = self.standing(lane, visits)
        rows = []
        for pp in self.tunable:
            pid = pp.pattern.id
            own = [a for a in visits if a[PatternAttr.PATTERN_ID] == pid]
            row = dict(own[-1]) if own else {PatternAttr.PATTERN_ID: pid}
            row[PatternAttr.COMMITTED] = schemes[pid]
            row[PatternAttr.GAIN] = math.prod(float(a.get(PatternAttr.GAIN, 1.0)) for a in own
                                              if PatternAttr.COMMITTED in a)
            row["visits"] = [self.visit_entry(a) for a in visits if a[PatternAttr.PATTERN_ID] == pid
                             or pid in (a.get(PatternAttr.PARTNER) or {})]
            row["start_scheme"] = self.space.on(self.lane_start(lane)[pid])
            rows.append(row)
        return self.uses(schemes), rows

    def visit_entry(self, attrs: dict) -> dict:
        """One visit, for the report (from its study's attrs)."""
        entry = {"pattern": attrs.get(PatternAttr.PATTERN_ID),
                 "round": attrs.get(PatternAttr.ROUND), "lane": attrs.get(PatternAttr.LANE, ""),
                 "status": "committed" if PatternAttr.COMMITTED in attrs else "running",
                 "from_scheme": attrs.get(PatternAttr.FROM, []),
                 "committed_scheme": self.space.on(attrs.get(PatternAttr.COMMITTED, {})),
                 "gain": float(attrs.get(PatternAttr.GAIN, 1.0)),
                 "commit_reason": attrs.get(PatternAttr.COMMIT_REASON),
                 "moves": attrs.get(PatternAttr.MOVES, 0),
                 "moves_skipped": attrs.get(PatternAttr.MOVES_SKIPPED, 0)}
        if attrs.get(PatternAttr.PARTNER):
            entry["partner"] = {p: self.space.on(s) for p, s in attrs[PatternAttr.PARTNER].items()}
        if PatternAttr.CONVERGED_AFTER in attrs:
            entry["converged_after"] = attrs[PatternAttr.CONVERGED_AFTER]
        return entry

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

    def visit_trials(self, attrs: dict) -> list[FrozenTrial]:
        """Every trial of a visit (from its study's attrs)."""
        pp = next(p for p in self.tunable if p.pattern.id == attrs[PatternAttr.PATTERN_ID])
        return self.trials(pp, int(attrs[PatternAttr.ROUND]), attrs.get(PatternAttr.LANE, "")) or []

    # -- snapshots -------------------------------------------------------------------------
    def write_state(self, out: Path, status: str, run: dict, lane: str | None = None) -> None:
        """``state.yaml``: a readable snapshot (``run``: storage, fingerprint, baseline and
        counters of this process, in that order; ``lane``: the lane whose standing model the
        patterns show, once the starts are decided)."""
        patterns = []
        rows = {}
        visits = self.visits()
        if lane is not None and self.starts() is not None:
            rows = {r[PatternAttr.PATTERN_ID]: r for r in self.committed(lane)[1]}
        for pp in self.tunable:
            pid = pp.pattern.id
            mine = [a for a in visits if a[PatternAttr.PATTERN_ID] == pid]
            row = {"id": pid, "signature": pp.pattern.signature,
                   "regions": len(pp.pattern.regions), "points": len(pp.ids),
                   "status": "pending", "visits": len(mine),
                   "decided": sum(PatternAttr.COMMITTED in a for a in mine)}
            if mine:
                row["status"] = "committed" if row["visits"] == row["decided"] else "running"
            r = rows.get(pid)
            if r is not None:
                row["standing"] = sorted(self.space.on(r[PatternAttr.COMMITTED]))
                row["gain"] = round(float(r.get(PatternAttr.GAIN, 1.0)), 4)
            patterns.append(row)
        state = {"status": status, "run_id": self.run_id, **run, "patterns": patterns,
                 "resume": "rerun the same command to continue"}
        atomic_write_bytes(out / "state.yaml", yaml.safe_dump(state, sort_keys=False).encode())

    def write_pattern_cache(self, path: Path, *, minimum_distance: int, max_entries: int,
                            lane: str | None = None) -> None:
        """Every measured scheme of every pattern with the whole model's latency it gave, the
        standing scheme (``lane``'s) first, for ``--pattern-cache`` of a later run."""
        cache = PatternCache()
        standing = self.standing(lane) if lane is not None and self.starts() else {}
        by_pattern: dict[str, list] = {}
        for attrs in self.visits():
            for t in self.visit_trials(attrs):
                if t.state == TrialState.COMPLETE and t.values and not t.user_attrs.get(
                        TrialAttr.PARTNER):
                    by_pattern.setdefault(attrs[PatternAttr.PATTERN_ID], []).append(
                        (self.space.on(t.params), t.values[0]))
        for pp in self.tunable:
            schemes = by_pattern.get(pp.pattern.id, [])
            if pp.pattern.id in standing:  # first: below every measured latency
                best = min((lat for _, lat in schemes), default=0.0)
                schemes.append((self.space.on(standing[pp.pattern.id]), max(best - 1e-6, 0.0)))
            if schemes:
                cache.add(pp.pattern.signature, schemes, minimum_distance=minimum_distance,
                          max_entries=max_entries)
        cache.save(path)


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
    starts = run.get(RunAttr.STARTS) or {}
    for row in starts.get("starts", []):  # each start measured once (their total below)
        if row.get("feasible") and row.get("latency_ms"):
            best = min(best, float(row["latency_ms"]))
    x += int(starts.get("measurements", len(starts.get("starts", []))))
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
    record = t.user_attrs.get(TrialAttr.MEASUREMENT)  # runs made before trials carried a count
    return 0 if not isinstance(record, dict) or record.get("cached") else 1


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


# -- aggregation ---------------------------------------------------------------------------------
